//! Request handling: what a proven connection asks (puts, gets, deletes, barriers, its
//! session), by the rules of `values`, and the sessions' news of a lost process. Every frame
//! comes and goes sealed (`channel`); one that does not open ends its connection, said in the
//! log.

use super::shared::Shared;
use super::values;
use crate::cluster::channel::{Opener, Sealer};
use crate::cluster::handshake::Opened;
use crate::cluster::locks::locked;
use crate::cluster::wire::{receive_header, receive_value, send, Reply, Request};
use crate::words::secs;
use std::io::{BufRead, BufReader};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::mpsc::{sync_channel, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The sending half of a proven connection, shared with its session's writer.
type Out = Arc<Mutex<Sealer<TcpStream>>>;

/// The receiving half.
type In = BufReader<Opener<TcpStream>>;

/// Serve a proven connection of `process` until it closes (`ticketed`: it carries the ticket of
/// the process's session).
pub(super) fn serve(
    shared: &Shared,
    socket: TcpStream,
    opened: Opened,
    from: SocketAddr,
    (process, ticketed): (usize, bool),
) {
    Proven {
        shared,
        from,
        process,
        ticketed,
        session: None,
        out: Arc::new(Mutex::new(opened.sealer)),
        socket,
    }
    .serve(BufReader::with_capacity(64 << 10, opened.opener));
}

/// A proven connection of `process`, and its session once it joined.
struct Proven<'a> {
    shared: &'a Shared,
    from: SocketAddr,
    process: usize,
    /// It carries the ticket of `process`'s session (or is that session): once the process
    /// joined, no other connection acts as it.
    ticketed: bool,
    session: Option<Joined>,
    /// Where replies go (a session's through its writer, which shares it).
    out: Out,
    /// To close it.
    socket: TcpStream,
}

/// A connection's session: where its replies go (its writer, shared with news of a loss), its
/// host, and how long it may stay silent.
struct Joined {
    news: SyncSender<Reply>,
    host: String,
    silent: Option<Duration>,
}

/// What to do after a request.
enum Then {
    /// Answer and read the next.
    Answer(Reply, Option<Arc<Vec<u8>>>),
    /// Answer, then close (the connection's bytes are no longer in step, or it is refused).
    Close(Reply),
    /// The answer went through the session's writer already.
    Sent,
}

fn refuse(message: String) -> Then {
    Then::Close(Reply::Refused { message })
}

impl Proven<'_> {
    fn serve(mut self, mut reader: In) {
        loop {
            let header = match self.next_header(&mut reader) {
                Ok(h) => h,
                Err(e) => {
                    self.ended(&e);
                    if e.kind() == std::io::ErrorKind::OutOfMemory {
                        // A value over the cap: told why (its bytes were never read).
                        let message = e.to_string();
                        self.answer_then_close(Reply::Refused { message });
                    }
                    break;
                }
            };
            let (reply, value, close) = match self.handle(header, &mut reader) {
                Then::Answer(r, v) => (r, v, false),
                Then::Close(r) => (r, None, true),
                Then::Sent => continue,
            };
            let sent = match &self.session {
                // Through the session's writer: news of a lost process goes the same way.
                Some(j) => j.news.try_send(reply).is_ok(),
                None => {
                    let value = value.as_deref().map_or(&[][..], |v| &v[..]);
                    send(&mut *locked(&self.out), &reply, value).is_ok()
                }
            };
            if close || !sent {
                let _ = self.socket.shutdown(Shutdown::Both);
                break;
            }
        }
        if let Some(j) = self.session.take() {
            self.lose(format!(
                "process {} (on {}) left the run without finishing: it was killed, crashed or \
                 lost its network",
                self.process, j.host
            ));
        }
    }

    /// Send a last reply (through the session's writer where there is one), then close.
    fn answer_then_close(&self, reply: Reply) {
        match &self.session {
            Some(j) => {
                let _ = j.news.try_send(reply);
            }
            None => {
                let _ = send(&mut *locked(&self.out), &reply, &[]);
                let _ = self.socket.shutdown(Shutdown::Both);
            }
        }
    }

    /// The next request's header and its value's length. A session reads under its silence
    /// limit; another connection may idle between requests, but a frame once begun must come
    /// whole within the I/O timeout.
    fn next_header(&self, reader: &mut In) -> std::io::Result<(Request, u64)> {
        let limits = &self.shared.config.limits;
        match &self.session {
            Some(j) => self.socket.set_read_timeout(j.silent)?,
            None => {
                self.socket.set_read_timeout(None)?;
                if reader.fill_buf()?.is_empty() {
                    return Err(std::io::ErrorKind::UnexpectedEof.into());
                }
                self.socket.set_read_timeout(Some(limits.io))?;
            }
        }
        receive_header(reader, limits.value)
    }

    /// The connection ended (`e`): a session silent past its limit is a hung process; bytes
    /// that are not the protocol's, or a record that did not open, are said.
    fn ended(&mut self, e: &std::io::Error) {
        let timed_out = matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        );
        if let (true, Some(j)) = (timed_out, &self.session) {
            if let Some(d) = j.silent {
                let message = format!(
                    "process {} (on {}) went silent: nothing from it for {} (--init-timeout), \
                     though its connection is open: it hangs, or its network dropped",
                    self.process,
                    j.host,
                    secs(d)
                );
                self.session = None;
                self.lose(message);
            }
        }
        if e.kind() == std::io::ErrorKind::OutOfMemory
            || e.kind() == std::io::ErrorKind::InvalidData
        {
            self.shared.refuse(
                "frame",
                self.from,
                &format!(
                    "closed the connection of process {} from {}: {}",
                    self.process,
                    self.from,
                    // The words may quote the peer's bytes (an unknown operation's name).
                    crate::words::escaped(&e.to_string(), 512)
                ),
            );
        }
    }

    fn handle(&mut self, (request, len): (Request, u64), reader: &mut In) -> Then {
        if !self.ticketed && self.shared.state().tickets.contains_key(&self.process) {
            return refuse(format!(
                "process {} has joined the run, and this connection does not carry its \
                 session's ticket (it opened before the process joined, or another process \
                 holding the run's secret made it)",
                self.process
            ));
        }
        let session_says = matches!(request, Request::Heartbeat | Request::Leave);
        if self.session.is_some() != session_says {
            return refuse(
                "a session says only heartbeats and leave, and only a session does".into(),
            );
        }
        let shared = self.shared;
        match request {
            Request::Put { key } => {
                if let Err(why) = values::reserve(shared, self.process, &key, len) {
                    return refuse(why);
                }
                let value = receive_value(reader, len);
                if let Err(e) = &value {
                    // A record of the value that did not open (changed, cut or replayed on
                    // the way) is said as one of the header's would be.
                    self.ended(e);
                }
                match values::commit(shared, self.process, key, len, value) {
                    Ok(()) => Then::Answer(Reply::Done, None),
                    Err(why) => refuse(why),
                }
            }
            _ if len > 0 => refuse("only a put carries a value".into()),
            Request::Get { key, timeout_ms } => match values::wait_for(shared, &key, timeout_ms) {
                Ok(v) => Then::Answer(Reply::Value, Some(v)),
                Err(reply) => Then::Answer(reply, None),
            },
            Request::TryGet { key } => match values::wait_for(shared, &key, 0) {
                Ok(v) => Then::Answer(Reply::Value, Some(v)),
                Err(Reply::Timeout) => Then::Answer(Reply::NotFound, None),
                Err(reply) => Then::Answer(reply, None),
            },
            Request::Delete { key } => match values::delete(shared, self.process, &key) {
                Ok(()) => Then::Answer(Reply::Done, None),
                Err(why) => refuse(why),
            },
            Request::Barrier { name, timeout_ms } => {
                match values::barrier(shared, self.process, &name, timeout_ms) {
                    Reply::Refused { message } => refuse(message),
                    reply => Then::Answer(reply, None),
                }
            }
            Request::Join { host, silent_ms } => self.join(host, silent_ms),
            Request::Heartbeat => Then::Answer(Reply::Done, None),
            Request::Leave => {
                let Some(j) = self.session.take() else {
                    return Then::Answer(Reply::Done, None);
                };
                let mut st = shared.state();
                st.sessions.remove(&self.process);
                shared.wake_all(&st);
                drop(st);
                // The last reply through its writer, which then ends.
                let _ = j.news.try_send(Reply::Done);
                Then::Sent
            }
        }
    }

    /// Open this connection's session (the first of its process), and give it the ticket that
    /// every other connection of the process carries from then on.
    fn join(&mut self, host: String, silent_ms: u64) -> Then {
        let process = self.process;
        // A peer's host name goes into messages: printable, and short.
        let host = crate::words::escaped(&host, 255);
        let mut ticket = [0u8; 32];
        if let Err(e) = getrandom::fill(&mut ticket) {
            return refuse(format!(
                "process 0 cannot draw a ticket for a session ({e})"
            ));
        }
        let mut st = self.shared.state();
        if let Some(first) = st.joined.get(&process) {
            let message = format!(
                "process {process} joined the run twice: from {first} and now from {}: two \
                 processes were started with the same process id",
                self.from
            );
            drop(st);
            self.shared.refuse("twice", self.from, &message);
            return refuse(message);
        }
        st.joined.insert(process, self.from);
        st.tickets.insert(process, ticket);
        let (news, heard) = sync_channel::<Reply>(64);
        st.sessions.insert(process, news.clone());
        drop(st);
        self.ticketed = true;
        // The ticket goes first, before anything the session's writer sends.
        if send(&mut *locked(&self.out), &Reply::Joined, &ticket).is_err() {
            let _ = self.socket.shutdown(Shutdown::Both);
        }
        spawn_writer(self.out.clone(), self.socket.try_clone().ok(), heard);
        let silent = (silent_ms > 0).then(|| Duration::from_millis(silent_ms));
        self.session = Some(Joined { news, host, silent });
        Then::Sent
    }

    /// Record that the run cannot go on and tell every session but this one's.
    fn lose(&self, message: String) {
        let mut st = self.shared.state();
        st.sessions.remove(&self.process);
        if st.lost.is_none() {
            st.lost = Some(message.clone());
        }
        // A session whose writer is full (it reads nothing) hears nothing more: its writer's
        // timeout closes it.
        for news in st.sessions.values() {
            let _ = news.try_send(Reply::Lost {
                message: message.clone(),
            });
        }
        self.shared.wake_all(&st);
    }
}

/// A session's writer: its replies and news, in order, each within the I/O timeout; a session
/// that does not read them is closed (and lost), never waited on under the state's lock.
fn spawn_writer(out: Out, socket: Option<TcpStream>, heard: std::sync::mpsc::Receiver<Reply>) {
    let _ = std::thread::Builder::new()
        .name("xtrain-store-session".into())
        .spawn(move || {
            for reply in heard {
                if send(&mut *locked(&out), &reply, &[]).is_err() {
                    if let Some(s) = &socket {
                        let _ = s.shutdown(Shutdown::Both);
                    }
                    break;
                }
            }
        });
}
