//! Process 0's side of the run's store: the values, one thread per connection, blocking gets
//! that wait on a condition variable (many at once), and the sessions: when one closes without
//! saying goodbye, every other session is told and every waiting get returns.
//!
//! Only a process that proves the run's secret gets past the handshake (`handshake`), and what
//! it may do is bounded ([`Limits`], [`keys`](super::keys)): it writes only its own keys, once;
//! a value over the cap, or one that would take the store over its total, is refused before its
//! bytes are read, and a value is read as its bytes arrive. Connections still in their
//! handshake are few and short-lived (the oldest closes for a new one past the cap); proven
//! ones are capped too (a newcomer past the cap is told to try again). Nothing is written to a
//! socket under the state's lock: each session has a writer of its own. A connection that fails
//! any of this is closed, said once in the log, and never ends the run.

use crate::cluster::auth::Secret;
use crate::cluster::handshake::{self, Failed};
use crate::cluster::keys::{may_delete, owner};
use crate::cluster::wire::{
    io_words, receive_header, receive_value, refusal_for_json, send, Greeting, Reply, Request,
    StoreError, PROTOCOL,
};
use crate::words::secs;
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::io::{BufRead, BufReader, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// What the store takes, at most.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Bytes of one value (the largest shard a run gathers is at most about 430 MB: the
    /// stacked LoRA B of the MLP at 405B, r=16, unsharded).
    pub value: u64,
    /// Bytes of all values held at once.
    pub total: u64,
    /// Connections open at once that proved the secret.
    pub connections: usize,
    /// Connections in their handshake at once (a new one past it closes the oldest).
    pub handshakes: usize,
    /// How long a handshake may take.
    pub handshake: Duration,
    /// How long the rest of a frame may take once its first byte came, and any write.
    pub io: Duration,
}

impl Limits {
    /// The limits of a run of `processes` processes.
    pub fn for_run(processes: usize) -> Limits {
        Limits {
            value: 1 << 30,
            // Room for a whole gathered state should process 0 fall behind its readers (about
            // 7.5 GB with both moments at 405B, r=16, every projection); the store forgets each
            // shard once read.
            total: 16 << 30,
            connections: 64 + 32 * processes,
            handshakes: 64,
            handshake: Duration::from_secs(10),
            io: Duration::from_secs(60),
        }
    }
}

/// Who the store serves: the run's processes (ids `0..processes`), holding `secret`.
#[derive(Clone, Debug)]
pub struct Config {
    pub processes: usize,
    pub secret: Secret,
    pub limits: Limits,
}

impl Config {
    pub fn new(processes: usize, secret: Secret) -> Config {
        Config {
            processes,
            secret,
            limits: Limits::for_run(processes),
        }
    }
}

#[derive(Default)]
struct State {
    /// Shared, so that a get's answer is sent (gigabytes, for a gathered state) outside the
    /// lock and without a copy.
    values: HashMap<String, Arc<Vec<u8>>>,
    /// Bytes of `values`, and of puts under way.
    total: u64,
    /// Why the run cannot go on (a process left without saying goodbye), once known.
    lost: Option<String>,
    /// The open sessions, by process: where news of a lost process is sent (through each
    /// session's writer).
    sessions: HashMap<usize, SyncSender<Reply>>,
    /// Where each process joined from (every join of the run, for a second one).
    joined: HashMap<usize, SocketAddr>,
}

/// The connections open, to close them when the server stops (and the oldest handshakes when
/// too many are under way).
#[derive(Default)]
struct Conns {
    next: u64,
    /// Each with when it was accepted.
    handshaking: VecDeque<(u64, TcpStream, Instant)>,
    open: HashMap<u64, TcpStream>,
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
    config: Config,
    conns: Mutex<Conns>,
    /// The kinds of refusal already said (each is said once).
    said: Mutex<BTreeSet<&'static str>>,
    stopped: AtomicBool,
}

fn locked<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        locked(&self.state)
    }

    /// Say `message` once per `kind` of event.
    fn say_once(&self, kind: &'static str, message: &str) {
        if locked(&self.said).insert(kind) {
            crate::esay!("xtrain: store: {message} (said once)");
        }
    }

    fn forget(&self, id: u64) {
        let mut c = locked(&self.conns);
        c.handshaking.retain(|(k, _, _)| *k != id);
        c.open.remove(&id);
    }
}

/// Process 0's side: the store's values, served to every process until dropped (which stops
/// serving, closes every connection and frees the port).
pub struct StoreServer {
    address: SocketAddr,
    shared: Arc<Shared>,
    accepting: Option<std::thread::JoinHandle<()>>,
}

impl StoreServer {
    /// Serve on `address` (the coordinator's, resolved, or `--coordinator-bind`'s).
    pub fn bind(address: SocketAddr, config: Config) -> Result<StoreServer, StoreError> {
        let listener = TcpListener::bind(address).map_err(|e| {
            StoreError::Unavailable(format!(
                "process 0 cannot serve the run's store on {address}: {} (another run or program \
                 holds the port? choose another in --coordinator HOST:PORT; an address of \
                 another host? give this host's with --coordinator-bind)",
                io_words(&e)
            ))
        })?;
        Self::serve(listener, config)
    }

    /// Serve on a listener already bound (tests bind port 0 on loopback).
    pub fn serve(listener: TcpListener, config: Config) -> Result<StoreServer, StoreError> {
        let unavailable = |e: std::io::Error| StoreError::Unavailable(io_words(&e));
        let address = listener.local_addr().map_err(unavailable)?;
        // Polled, so that the accepting thread sees the server stop.
        listener.set_nonblocking(true).map_err(unavailable)?;
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            config,
            conns: Mutex::default(),
            said: Mutex::default(),
            stopped: AtomicBool::new(false),
        });
        let s = shared.clone();
        let accepting = std::thread::Builder::new()
            .name("xtrain-store".into())
            .spawn(move || accept_all(listener, &s))
            .map_err(unavailable)?;
        Ok(StoreServer {
            address,
            shared,
            accepting: Some(accepting),
        })
    }

    pub fn port(&self) -> u16 {
        self.address.port()
    }

    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// The kinds of connection it refused or dropped so far ("secret", "handshake", "version",
    /// "stranger", "refused"), for what a run that never met says.
    pub fn refusals(&self) -> Vec<&'static str> {
        locked(&self.shared.said).iter().copied().collect()
    }

    /// Wait (up to `timeout`) until no session but `own` is open: every other process has left
    /// or is gone, so that closing the store strands no one.
    pub fn wait_for_others_to_leave(&self, own: usize, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        let mut st = self.shared.state();
        while st.sessions.keys().any(|p| *p != own) && Instant::now() < deadline {
            let left = deadline.saturating_duration_since(Instant::now());
            st = self
                .shared
                .changed
                .wait_timeout(st, left.min(Duration::from_millis(100)))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        // Every connection closes, so that peers still waiting learn that process 0 is gone
        // rather than hang; waiting gets return; the port is free once the accepting thread
        // has ended.
        self.shared.stopped.store(true, Ordering::SeqCst);
        {
            let c = locked(&self.shared.conns);
            for s in c
                .open
                .values()
                .chain(c.handshaking.iter().map(|(_, s, _)| s))
            {
                let _ = s.shutdown(Shutdown::Both);
            }
        }
        self.shared.changed.notify_all();
        if let Some(t) = self.accepting.take() {
            let _ = t.join();
        }
    }
}

/// How long a handshake may go on before a newcomer may close it to take its place.
const STALE_HANDSHAKE: Duration = Duration::from_millis(500);

/// Accept connections until the server stops; a failing accept (no descriptors left) backs
/// off, said once.
fn accept_all(listener: TcpListener, shared: &Arc<Shared>) {
    let mut backoff = Duration::from_millis(10);
    while !shared.stopped.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, from)) => {
                backoff = Duration::from_millis(10);
                admit(shared, stream, from);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => {
                shared.say_once(
                    "accept",
                    &format!(
                        "cannot accept a connection ({e}): too many open? waiting a little \
                         before each new try"
                    ),
                );
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(Duration::from_secs(1));
            }
        }
    }
}

/// Take a new connection within the caps and serve it on a thread of its own.
fn admit(shared: &Arc<Shared>, stream: TcpStream, from: SocketAddr) {
    let limits = &shared.config.limits;
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_nodelay(true);
    let _ = stream.set_read_timeout(Some(limits.handshake));
    let _ = stream.set_write_timeout(Some(limits.handshake));
    let mut c = locked(&shared.conns);
    if c.open.len() >= limits.connections {
        drop(c);
        // A few bytes into an empty socket buffer: never blocks.
        let _ = (&stream).write_all(&handshake::busy());
        shared.say_once(
            "full",
            &format!(
                "{} connections are open, the most it takes: newcomers are told to try again",
                limits.connections
            ),
        );
        return;
    }
    if c.handshaking.len() >= limits.handshakes {
        shared.say_once(
            "handshakes",
            &format!(
                "more than {} connections in their handshake at once: the oldest are closed, \
                 newcomers told to try again",
                limits.handshakes
            ),
        );
        // A real process's handshake takes milliseconds: one that has taken a while is idle
        // (and closed to make room); a newcomer among fresh ones is told to try again.
        match c.handshaking.front() {
            Some((_, _, at)) if at.elapsed() >= STALE_HANDSHAKE => {
                let (_, oldest, _) = c.handshaking.pop_front().unwrap();
                let _ = oldest.shutdown(Shutdown::Both);
            }
            _ => {
                drop(c);
                let _ = (&stream).write_all(&handshake::busy());
                return;
            }
        }
    }
    let id = c.next;
    c.next += 1;
    let Ok(kept) = stream.try_clone() else { return };
    c.handshaking.push_back((id, kept, Instant::now()));
    drop(c);
    let s = shared.clone();
    let spawned = std::thread::Builder::new()
        .name("xtrain-store-conn".into())
        .spawn(move || {
            serve_connection(stream, from, id, &s);
            s.forget(id);
        });
    if spawned.is_err() {
        shared.forget(id);
    }
}

/// One connection: its handshake, then its requests until it closes.
fn serve_connection(stream: TcpStream, from: SocketAddr, id: u64, shared: &Shared) {
    let processes = shared.config.processes;
    let admit = |p: u32| {
        if (p as usize) < processes {
            Ok(())
        } else {
            Err(format!(
                "process {p} is outside this run of {processes} processes (ids 0 to {})",
                processes - 1
            ))
        }
    };
    let process = match handshake::accept(&mut &stream, &mut &stream, &shared.config.secret, &admit)
    {
        Ok(p) => p as usize,
        Err(failed) => return refused(shared, &stream, from, failed),
    };
    {
        let mut c = locked(&shared.conns);
        // Closed meanwhile as the oldest handshake: gone.
        let Some(k) = c.handshaking.iter().position(|(k, _, _)| *k == id) else {
            return;
        };
        let (_, s, _) = c.handshaking.remove(k).unwrap();
        c.open.insert(id, s);
    }
    let _ = stream.set_write_timeout(Some(shared.config.limits.io));
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

/// Say (once per kind) why a connection was refused in its handshake.
fn refused(shared: &Shared, stream: &TcpStream, from: SocketAddr, failed: Failed) {
    let (kind, message) = match failed {
        Failed::Protocol(Greeting::Version(v)) => (
            "version",
            format!(
                "refused a process of another xtrain build from {from} (store protocol {v}, \
                 this xtrain {PROTOCOL}): every host of a run must run the same build"
            ),
        ),
        Failed::Protocol(Greeting::Json) => {
            // Protocol 1's processes print the JSON line's message as the reason they end.
            let _ = (&*stream).write_all(&refusal_for_json(&format!(
                "process 0's store speaks store protocol {PROTOCOL}, this xtrain protocol 1: \
                 every host of a run must run the same xtrain build"
            )));
            (
                "version",
                format!("refused a process of another xtrain build from {from} (store protocol 1)"),
            )
        }
        Failed::Protocol(_) => (
            "stranger",
            format!("closed a connection from {from} that does not speak xtrain's store protocol"),
        ),
        Failed::Proof => (
            "secret",
            format!("refused a connection from {from} that does not hold the run's secret"),
        ),
        Failed::Refused(why) => (
            "refused",
            format!("refused a connection from {from}: {why}"),
        ),
        Failed::Busy | Failed::Io(_) | Failed::NoGreeting(_) => (
            "handshake",
            format!("closed a connection from {from} that did not finish its handshake"),
        ),
    };
    shared.say_once(kind, &message);
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
