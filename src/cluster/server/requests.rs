//! Request handling: what a proven connection asks (puts, gets, deletes, its session), within
//! the store's limits and the keys' owners, and the sessions' news of a lost process.

use super::shared::Shared;
use crate::cluster::keys::{may_delete, owner};
use crate::cluster::wire::{receive_header, receive_value, send, Reply, Request};
use crate::words::secs;
use std::io::BufRead;
use std::io::BufReader;
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::mpsc::{sync_channel, SyncSender};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Serve a proven connection of `process` until it closes.
pub(super) fn serve(shared: &Shared, stream: TcpStream, from: SocketAddr, process: usize) {
    let Ok(socket) = stream.try_clone() else {
        return;
    };
    Connection {
        shared,
        from,
        process,
        session: None,
        socket,
    }
    .serve(stream);
}

/// A proven connection of `process`, and its session once it joined.
struct Connection<'a> {
    shared: &'a Shared,
    from: SocketAddr,
    process: usize,
    session: Option<Joined>,
    /// Where replies go (but a session's, which go through its writer).
    socket: TcpStream,
}

/// A connection's session: where its replies go (its writer, shared with news of a loss), its
/// host, and how long it may stay silent.
struct Joined {
    out: SyncSender<Reply>,
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

impl Connection<'_> {
    fn serve(mut self, stream: TcpStream) {
        let mut reader = BufReader::new(stream);
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
                Some(j) => j.out.try_send(reply).is_ok(),
                None => {
                    let value = value.as_deref().map_or(&[][..], |v| &v[..]);
                    send(&mut &self.socket, &reply, value).is_ok()
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
                let _ = j.out.try_send(reply);
            }
            None => {
                let _ = send(&mut &self.socket, &reply, &[]);
                let _ = self.socket.shutdown(Shutdown::Both);
            }
        }
    }

    /// The next request's header and its value's length. A session reads under its silence
    /// limit; another connection may idle between requests, but a frame once begun must come
    /// whole within the I/O timeout.
    fn next_header(&self, reader: &mut BufReader<TcpStream>) -> std::io::Result<(Request, u64)> {
        let limits = &self.shared.config.limits;
        match &self.session {
            Some(j) => reader.get_ref().set_read_timeout(j.silent)?,
            None => {
                reader.get_ref().set_read_timeout(None)?;
                if reader.fill_buf()?.is_empty() {
                    return Err(std::io::ErrorKind::UnexpectedEof.into());
                }
                reader.get_ref().set_read_timeout(Some(limits.io))?;
            }
        }
        receive_header(reader, limits.value)
    }

    /// The connection ended (`e`): a session silent past its limit is a hung process.
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
            self.shared.say_once(
                "frame",
                &format!(
                    "closed the connection of process {} from {}: {e}",
                    self.process, self.from
                ),
            );
        }
    }

    fn handle(
        &mut self,
        (request, len): (Request, u64),
        reader: &mut BufReader<TcpStream>,
    ) -> Then {
        let session_says = matches!(request, Request::Heartbeat | Request::Leave);
        if self.session.is_some() != session_says {
            return Then::Close(Reply::Refused {
                message: "a session says only heartbeats and leave, and only a session does".into(),
            });
        }
        match request {
            Request::Put { key } => self.put(key, len, reader),
            _ if len > 0 => Then::Close(Reply::Refused {
                message: "only a put carries a value".into(),
            }),
            Request::Get { key, timeout_ms } => match wait_for(self.shared, &key, timeout_ms) {
                Ok(v) => Then::Answer(Reply::Value, Some(v)),
                Err(reply) => Then::Answer(reply, None),
            },
            Request::TryGet { key } => {
                let st = self.shared.state();
                match (&st.lost, st.values.get(&key)) {
                    (_, Some(v)) => Then::Answer(Reply::Value, Some(v.clone())),
                    (Some(why), None) => Then::Answer(
                        Reply::Lost {
                            message: why.clone(),
                        },
                        None,
                    ),
                    (None, None) => Then::Answer(Reply::NotFound, None),
                }
            }
            Request::Delete { key } => {
                if let Err(why) = may_delete(&key, self.process) {
                    return Then::Close(Reply::Refused { message: why });
                }
                let mut st = self.shared.state();
                if let Some(v) = st.values.remove(&key) {
                    st.total -= v.len() as u64;
                }
                Then::Answer(Reply::Done, None)
            }
            Request::Join {
                process,
                host,
                silent_ms,
            } => self.join(process, host, silent_ms),
            Request::Heartbeat => Then::Answer(Reply::Done, None),
            Request::Leave => {
                let Some(j) = self.session.take() else {
                    return Then::Answer(Reply::Done, None);
                };
                self.shared.state().sessions.remove(&self.process);
                self.shared.changed.notify_all();
                // The last reply through its writer, which then ends.
                let _ = j.out.try_send(Reply::Done);
                Then::Sent
            }
        }
    }

    /// A put of `len` bytes to `key`: refused (before its bytes are read where it can be) unless
    /// the key is this process's and new (or holds the same bytes), and the value within the
    /// caps.
    fn put(&mut self, key: String, len: u64, reader: &mut BufReader<TcpStream>) -> Then {
        let refuse = |message: String| Then::Close(Reply::Refused { message });
        let free = match owner(&key) {
            Ok(None) => true,
            Ok(Some(k)) if k == self.process => false,
            Ok(Some(k)) => {
                return refuse(format!(
                    "process {} may not write {key:?}, process {k}'s key",
                    self.process
                ))
            }
            Err(why) => return refuse(why),
        };
        let total = self.shared.config.limits.total;
        {
            let mut st = self.shared.state();
            // The same value again (a barrier passed twice by name) changes nothing; another
            // is refused before its bytes are read where its length already differs.
            if !free && st.values.get(&key).is_some_and(|v| v.len() as u64 != len) {
                return refuse(format!("{key:?} is written once, and was"));
            }
            if st.total.saturating_add(len) > total {
                drop(st);
                self.shared.say_once(
                    "total",
                    &format!("refused a put: the store would hold more than {total} bytes"),
                );
                return refuse(format!(
                    "a value of {len} bytes would take the store over its {total} bytes"
                ));
            }
            st.total += len;
        }
        let value = receive_value(reader, len);
        let mut st = self.shared.state();
        let Ok(value) = value else {
            st.total -= len;
            return Then::Close(Reply::Refused {
                message: "the value was cut short".into(),
            });
        };
        if let Some(same) = st
            .values
            .get(&key)
            .filter(|_| !free)
            .map(|was| **was == value)
        {
            st.total -= len;
            if same {
                return Then::Answer(Reply::Done, None);
            }
            return refuse(format!("{key:?} is written once, and was"));
        }
        if let Some(old) = st.values.insert(key, Arc::new(value)) {
            st.total -= old.len() as u64;
        }
        self.shared.changed.notify_all();
        Then::Answer(Reply::Done, None)
    }

    /// Open this connection's session as `process` (which must be its own, and the first).
    fn join(&mut self, process: usize, host: String, silent_ms: u64) -> Then {
        let refuse = |message: String| Then::Close(Reply::Refused { message });
        if process != self.process {
            return refuse(format!(
                "a connection of process {} may not join as process {process}",
                self.process
            ));
        }
        // A peer's host name goes into messages: printable, and short.
        let host: String = host
            .chars()
            .take(255)
            .collect::<String>()
            .escape_debug()
            .to_string();
        let mut st = self.shared.state();
        if let Some(first) = st.joined.get(&process) {
            let message = format!(
                "process {process} joined the run twice: from {first} and now from {}: two \
                 processes were started with the same process id",
                self.from
            );
            drop(st);
            self.shared.say_once("twice", &message);
            return refuse(message);
        }
        let Ok(stream) = self.socket.try_clone() else {
            return refuse("the store cannot keep this connection".into());
        };
        st.joined.insert(process, self.from);
        let (out, news) = sync_channel::<Reply>(64);
        st.sessions.insert(process, out.clone());
        drop(st);
        spawn_writer(stream, news);
        let silent = (silent_ms > 0).then(|| Duration::from_millis(silent_ms));
        self.session = Some(Joined { out, host, silent });
        Then::Answer(Reply::Done, None)
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
        for out in st.sessions.values() {
            let _ = out.try_send(Reply::Lost {
                message: message.clone(),
            });
        }
        self.shared.changed.notify_all();
    }
}

/// A session's writer: its replies and news, in order, each within the I/O timeout; a session
/// that does not read them is closed (and lost), never waited on under the state's lock.
fn spawn_writer(stream: TcpStream, news: std::sync::mpsc::Receiver<Reply>) {
    let _ = std::thread::Builder::new()
        .name("xtrain-store-session".into())
        .spawn(move || {
            let mut w = &stream;
            for reply in news {
                if send(&mut w, &reply, &[]).is_err() {
                    let _ = stream.shutdown(Shutdown::Both);
                    break;
                }
            }
        });
}

/// `key`'s value once some process put it, or the reply that says why not (a timeout, a loss,
/// the store stopping).
fn wait_for(shared: &Shared, key: &str, timeout_ms: u64) -> Result<Arc<Vec<u8>>, Reply> {
    let deadline = Instant::now() + Duration::from_millis(timeout_ms.min(86_400_000));
    let mut st = shared.state();
    loop {
        if let Some(v) = st.values.get(key) {
            return Ok(v.clone());
        }
        if let Some(why) = &st.lost {
            return Err(Reply::Lost {
                message: why.clone(),
            });
        }
        if shared.stopped.load(Ordering::SeqCst) {
            return Err(Reply::Lost {
                message: "process 0's store stopped".into(),
            });
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(Reply::Timeout);
        }
        st = shared
            .changed
            .wait_timeout(st, deadline - now)
            .unwrap_or_else(|e| e.into_inner())
            .0;
    }
}
