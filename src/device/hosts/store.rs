//! The run's key-value store, as PyTorch's TCPStore and JAX's coordination service keep one:
//! process 0 serves it over TCP ([`StoreServer`]), every process (process 0 too, over loopback)
//! reaches it as a [`Store`]. Operations: `put`, a blocking `get` with a timeout, `try_get`, and
//! a `barrier`. The GPU plugins exchange their topology and NCCL/RCCL ids through it (handed to
//! them by `pjrt::KeyValueStore`); xtrain checks that every process runs the same settings
//! through it, and counts a checkpoint only after every process passed a barrier.
//!
//! Transport and framing: std's blocking `TcpStream`, one thread per connection on the server,
//! and one JSON object per message read with `serde_json`'s stream deserializer (a JSON object
//! delimits itself, so no length prefix is needed). The store holds tens of connections and a
//! few kilobytes, so threads cost nothing that matters, and no async runtime (tokio) is built
//! for it. A blocking `get` waits on the server (a condition variable), so many gets wait at
//! once: the client takes an idle connection from its pool, or opens another, per call.
//!
//! A lost process: each process holds one more connection, its session, open for the whole run.
//! When a session closes without saying goodbye (the process was killed or crashed) the server
//! tells every other process, whose [`Store::watch`] callback ends it; when process 0 goes, the
//! others see their sessions close. Waiting gets return at once with the same message.

use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::io::{BufReader, Write};
use std::net::{Shutdown, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// What went wrong with the store.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// A blocking get (or a barrier) waited its whole timeout.
    #[error("DEADLINE_EXCEEDED: no value for key {key:?} within {}", secs(*timeout))]
    DeadlineExceeded { key: String, timeout: Duration },
    /// A process of the run is gone (killed, crashed, or unreachable).
    #[error("{0}")]
    Lost(String),
    /// The coordinator could not be reached or answered nonsense.
    #[error("{0}")]
    Unavailable(String),
}

/// `30 s`, `1.5 s`: a duration as a person reads it.
pub fn secs(d: Duration) -> String {
    format!("{} s", (d.as_secs_f64() * 1000.0).round() / 1000.0)
}

#[derive(Serialize, Deserialize, Debug)]
#[serde(tag = "op", rename_all = "snake_case")]
enum Request {
    Put {
        key: String,
        value: Vec<u8>,
    },
    Get {
        key: String,
        timeout_ms: u64,
    },
    TryGet {
        key: String,
    },
    /// Opens a session: this connection lives as long as the process's part in the run.
    Join {
        process: usize,
        host: String,
    },
    /// Closes a session on purpose (the process finished).
    Leave,
}

#[derive(Serialize, Deserialize, Debug)]
#[serde(tag = "reply", rename_all = "snake_case")]
enum Reply {
    Done,
    Value { value: Vec<u8> },
    NotFound,
    Timeout,
    Lost { message: String },
}

fn send<T: Serialize>(stream: &mut TcpStream, msg: &T) -> std::io::Result<()> {
    let mut bytes = serde_json::to_vec(msg)?;
    bytes.push(b'\n');
    stream.write_all(&bytes)?;
    stream.flush()
}

fn receive<T: for<'de> Deserialize<'de>>(reader: &mut BufReader<TcpStream>) -> std::io::Result<T> {
    let mut messages = serde_json::Deserializer::from_reader(reader).into_iter::<T>();
    match messages.next() {
        Some(Ok(m)) => Ok(m),
        Some(Err(e)) if e.is_io() => Err(e.into()),
        Some(Err(e)) => Err(std::io::Error::new(std::io::ErrorKind::InvalidData, e)),
        None => Err(std::io::ErrorKind::UnexpectedEof.into()),
    }
}

#[derive(Default)]
struct State {
    values: HashMap<String, Vec<u8>>,
    /// Why the run cannot go on (a process left without saying goodbye), once known.
    lost: Option<String>,
    /// The open sessions, by process: where news of a lost process is sent.
    sessions: HashMap<usize, TcpStream>,
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

/// Process 0's side: the store's values, served to every process until dropped.
pub struct StoreServer {
    port: u16,
    shared: Arc<Shared>,
    listener: TcpListener,
}

impl StoreServer {
    /// Serve on `port` of every interface (the port the run's `--coordinator` names).
    pub fn bind(port: u16) -> Result<StoreServer, StoreError> {
        let listener = TcpListener::bind(("0.0.0.0", port)).map_err(|e| {
            StoreError::Unavailable(format!(
                "process 0 cannot serve the run's store on port {port}: {e} (another run or \
                 program holds it? choose another port in --coordinator HOST:PORT)"
            ))
        })?;
        Self::serve(listener)
    }

    /// Serve on a listener already bound (tests bind port 0 on loopback).
    pub fn serve(listener: TcpListener) -> Result<StoreServer, StoreError> {
        let port = listener
            .local_addr()
            .map_err(|e| StoreError::Unavailable(e.to_string()))?
            .port();
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
        });
        let accepting = listener
            .try_clone()
            .map_err(|e| StoreError::Unavailable(e.to_string()))?;
        let s = shared.clone();
        std::thread::Builder::new()
            .name("xtrain-store".into())
            .spawn(move || {
                for stream in accepting.incoming() {
                    let Ok(stream) = stream else { continue };
                    let s = s.clone();
                    let _ = std::thread::Builder::new()
                        .name("xtrain-store-conn".into())
                        .spawn(move || serve_connection(stream, &s));
                }
            })
            .map_err(|e| StoreError::Unavailable(e.to_string()))?;
        Ok(StoreServer {
            port,
            shared,
            listener,
        })
    }

    pub fn port(&self) -> u16 {
        self.port
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        // The accepting thread ends with the process; the sessions close so that peers still
        // waiting learn that process 0 is gone rather than hang.
        let _ = &self.listener;
        if let Ok(state) = self.shared.state.lock() {
            for s in state.sessions.values() {
                let _ = s.shutdown(Shutdown::Both);
            }
        }
    }
}

fn serve_connection(stream: TcpStream, shared: &Shared) {
    let Ok(mut writer) = stream.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(stream);
    let mut session: Option<(usize, String)> = None;
    // Until the connection closes or sends what is not a request.
    while let Ok(request) = receive::<Request>(&mut reader) {
        let reply = match request {
            Request::Put { key, value } => {
                let mut st = shared.state.lock().unwrap();
                st.values.insert(key, value);
                shared.changed.notify_all();
                Reply::Done
            }
            Request::TryGet { key } => {
                let st = shared.state.lock().unwrap();
                match (&st.lost, st.values.get(&key)) {
                    (_, Some(v)) => Reply::Value { value: v.clone() },
                    (Some(why), None) => Reply::Lost {
                        message: why.clone(),
                    },
                    (None, None) => Reply::NotFound,
                }
            }
            Request::Get { key, timeout_ms } => wait_for(shared, &key, timeout_ms),
            Request::Join { process, host } => {
                let mut st = shared.state.lock().unwrap();
                if let Ok(w) = writer.try_clone() {
                    st.sessions.insert(process, w);
                }
                session = Some((process, host));
                Reply::Done
            }
            Request::Leave => {
                if let Some((process, _)) = session.take() {
                    shared.state.lock().unwrap().sessions.remove(&process);
                    shared.changed.notify_all();
                }
                Reply::Done
            }
        };
        if send(&mut writer, &reply).is_err() {
            break;
        }
    }
    if let Some((process, host)) = session {
        let message = format!(
            "process {process} (on {host}) left the run without finishing: it was killed, \
             crashed or lost its network"
        );
        lose(shared, process, message);
    }
}

/// Record that the run cannot go on, wake every waiting get, and tell every other session.
fn lose(shared: &Shared, gone: usize, message: String) {
    let mut st = shared.state.lock().unwrap();
    st.sessions.remove(&gone);
    if st.lost.is_none() {
        st.lost = Some(message.clone());
    }
    let news = Reply::Lost { message };
    for s in st.sessions.values_mut() {
        let _ = send(s, &news);
    }
    shared.changed.notify_all();
}

fn wait_for(shared: &Shared, key: &str, timeout_ms: u64) -> Reply {
    let deadline = Instant::now() + Duration::from_millis(timeout_ms);
    let mut st = shared.state.lock().unwrap();
    loop {
        if let Some(v) = st.values.get(key) {
            return Reply::Value { value: v.clone() };
        }
        if let Some(why) = &st.lost {
            return Reply::Lost {
                message: why.clone(),
            };
        }
        let now = Instant::now();
        if now >= deadline {
            return Reply::Timeout;
        }
        st = shared.changed.wait_timeout(st, deadline - now).unwrap().0;
    }
}

/// A connection to the store, with its reader.
struct Connection {
    writer: TcpStream,
    reader: BufReader<TcpStream>,
}

impl Connection {
    fn open(address: &str, timeout: Duration) -> Result<Connection, StoreError> {
        let deadline = Instant::now() + timeout;
        loop {
            let last = match connect_once(address) {
                Ok(stream) => {
                    let _ = stream.set_nodelay(true);
                    let reader = stream
                        .try_clone()
                        .map_err(|e| StoreError::Unavailable(e.to_string()))?;
                    return Ok(Connection {
                        writer: stream,
                        reader: BufReader::new(reader),
                    });
                }
                Err(e) => e,
            };
            if Instant::now() >= deadline {
                return Err(StoreError::Unavailable(format!(
                    "could not reach process 0's store at {address} within {} ({last}): is \
                     process 0 running, and is --coordinator its host name and a port it can \
                     open?",
                    secs(timeout)
                )));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn call(&mut self, request: &Request, read_timeout: Option<Duration>) -> Result<Reply, String> {
        send(&mut self.writer, request).map_err(|e| e.to_string())?;
        let _ = self.reader.get_ref().set_read_timeout(read_timeout);
        receive::<Reply>(&mut self.reader).map_err(|e| e.to_string())
    }
}

fn connect_once(address: &str) -> Result<TcpStream, String> {
    let addrs = address.to_socket_addrs().map_err(|e| e.to_string())?;
    let mut last = String::from("the host name resolves to no address");
    for a in addrs {
        match TcpStream::connect_timeout(&a, Duration::from_secs(5)) {
            Ok(s) => return Ok(s),
            Err(e) => last = e.to_string(),
        }
    }
    Err(last)
}

struct Pool {
    address: String,
    connect_timeout: Duration,
    idle: Mutex<Vec<Connection>>,
}

/// A process's handle on the run's store, its keys under a prefix (`xtrain/RUN/`, and a
/// scope's own under that: [`Store::scope`]). Cheap to clone; safe to use from many threads.
#[derive(Clone)]
pub struct Store {
    pool: Arc<Pool>,
    prefix: String,
}

impl Store {
    /// Reach the store at `address` (`host:port`), retrying for `connect_timeout` while
    /// process 0 starts. Keys are put under `xtrain/RUN/`.
    pub fn connect(
        address: &str,
        run: &str,
        connect_timeout: Duration,
    ) -> Result<Store, StoreError> {
        let first = Connection::open(address, connect_timeout)?;
        Ok(Store {
            pool: Arc::new(Pool {
                address: address.to_string(),
                connect_timeout,
                idle: Mutex::new(vec![first]),
            }),
            prefix: format!("xtrain/{run}/"),
        })
    }

    /// The same store with keys under `PREFIX/SCOPE/` (`pjrt/cuda` for a plugin's own keys).
    pub fn scope(&self, scope: &str) -> Store {
        Store {
            pool: self.pool.clone(),
            prefix: format!("{}{}/", self.prefix, scope.trim_matches('/')),
        }
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    fn call(&self, request: Request, read_timeout: Option<Duration>) -> Result<Reply, StoreError> {
        let taken = self.pool.idle.lock().unwrap().pop();
        let mut conn = match taken {
            Some(c) => c,
            None => Connection::open(&self.pool.address, self.pool.connect_timeout)?,
        };
        match conn.call(&request, read_timeout) {
            Ok(Reply::Lost { message }) => Err(StoreError::Lost(message)),
            Ok(reply) => {
                self.pool.idle.lock().unwrap().push(conn);
                Ok(reply)
            }
            Err(e) => Err(StoreError::Lost(format!(
                "process 0 (the coordinator at {}) is gone: the connection to its store was \
                 lost ({e})",
                self.pool.address
            ))),
        }
    }

    pub fn put(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        let key = format!("{}{key}", self.prefix);
        self.call(
            Request::Put {
                key,
                value: value.to_vec(),
            },
            None,
        )
        .map(|_| ())
    }

    /// The value of `key`, waiting up to `timeout` for some process to put it.
    pub fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, StoreError> {
        let full = format!("{}{key}", self.prefix);
        let request = Request::Get {
            key: full.clone(),
            timeout_ms: timeout.as_millis().min(u64::MAX as u128) as u64,
        };
        // The server answers by the deadline; the margin only guards against a server that
        // stopped answering without closing the connection.
        match self.call(request, Some(timeout + Duration::from_secs(10)))? {
            Reply::Value { value } => Ok(value),
            Reply::Timeout => Err(StoreError::DeadlineExceeded { key: full, timeout }),
            other => Err(StoreError::Unavailable(format!(
                "the store answered {other:?} to a get"
            ))),
        }
    }

    /// The value of `key` if some process has put it, without waiting.
    pub fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let key = format!("{}{key}", self.prefix);
        match self.call(Request::TryGet { key }, None)? {
            Reply::Value { value } => Ok(Some(value)),
            Reply::NotFound => Ok(None),
            other => Err(StoreError::Unavailable(format!(
                "the store answered {other:?} to a try_get"
            ))),
        }
    }

    /// Wait until all `processes` reached the barrier `name` (each calls it once), for at
    /// most `timeout`; an error names the processes that did not arrive.
    pub fn barrier(
        &self,
        name: &str,
        process: usize,
        processes: usize,
        timeout: Duration,
    ) -> Result<(), StoreError> {
        self.put(&format!("barrier/{name}/{process}"), b"1")?;
        let deadline = Instant::now() + timeout;
        for p in 0..processes {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.get(&format!("barrier/{name}/{p}"), left) {
                Ok(_) => {}
                Err(StoreError::DeadlineExceeded { .. }) => {
                    let mut missing = Vec::new();
                    for q in p..processes {
                        if self.try_get(&format!("barrier/{name}/{q}"))?.is_none() {
                            missing.push(q.to_string());
                        }
                    }
                    return Err(StoreError::Lost(format!(
                        "DEADLINE_EXCEEDED at barrier {name:?}: process{} {} of {processes} did \
                         not arrive within {}",
                        if missing.len() == 1 { "" } else { "es" },
                        missing.join(", "),
                        secs(timeout)
                    )));
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Open this process's session and watch it: `on_lost` is called once, from a thread of
    /// its own, with what happened when another process leaves the run without finishing or
    /// process 0 goes. Dropping the returned [`Session`] leaves the run on purpose.
    pub fn watch(
        &self,
        process: usize,
        on_lost: impl FnOnce(String) + Send + 'static,
    ) -> Result<Session, StoreError> {
        let mut conn = Connection::open(&self.pool.address, self.pool.connect_timeout)?;
        let host = hostname();
        match conn.call(&Request::Join { process, host }, None) {
            Ok(Reply::Done) => {}
            Ok(other) => {
                return Err(StoreError::Unavailable(format!(
                    "the store answered {other:?} to a join"
                )))
            }
            Err(e) => return Err(StoreError::Unavailable(e)),
        }
        let writer = conn.writer;
        let leaving = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let quiet = leaving.clone();
        let address = self.pool.address.clone();
        let mut reader = conn.reader;
        let _ = reader.get_ref().set_read_timeout(None);
        std::thread::Builder::new()
            .name("xtrain-session".into())
            .spawn(move || {
                let why = match receive::<Reply>(&mut reader) {
                    Ok(Reply::Lost { message }) => message,
                    Ok(other) => format!("the store sent {other:?} unasked"),
                    Err(e) => format!(
                        "process 0 (the coordinator at {address}) is gone: its store closed the \
                         connection ({e})"
                    ),
                };
                if !quiet.load(std::sync::atomic::Ordering::SeqCst) {
                    on_lost(why);
                }
            })
            .map_err(|e| StoreError::Unavailable(e.to_string()))?;
        Ok(Session { writer, leaving })
    }
}

/// This process's membership of the run. [`Session::leave`] leaves on purpose; dropping it
/// otherwise (an error on the way) closes it as a crash would, so that the other processes are
/// told rather than left waiting.
pub struct Session {
    writer: TcpStream,
    leaving: Arc<std::sync::atomic::AtomicBool>,
}

impl Session {
    /// Leave the run on purpose: the others are not told of a loss.
    pub fn leave(mut self) {
        self.leaving
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let _ = send(&mut self.writer, &Request::Leave);
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        // This process's own watcher must not report its own session's close.
        self.leaving
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let _ = self.writer.shutdown(Shutdown::Both);
    }
}

impl StoreServer {
    /// Wait (up to `timeout`) until no session but `own` is open: every other process has left
    /// or is gone, so that closing the store strands no one.
    pub fn wait_for_others_to_leave(&self, own: usize, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        let mut st = self.shared.state.lock().unwrap();
        while st.sessions.keys().any(|p| *p != own) && Instant::now() < deadline {
            let left = deadline.saturating_duration_since(Instant::now());
            st = self
                .shared
                .changed
                .wait_timeout(st, left.min(Duration::from_millis(100)))
                .unwrap()
                .0;
        }
    }
}

/// The store as a plugin sees it: its keys under this store's prefix, failures with PJRT's
/// codes.
impl pjrt::KeyValueStore for Store {
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, pjrt::KvError> {
        Store::get(self, key, timeout).map_err(kv_error)
    }

    fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>, pjrt::KvError> {
        Store::try_get(self, key).map_err(kv_error)
    }

    fn put(&self, key: &str, value: &[u8]) -> Result<(), pjrt::KvError> {
        Store::put(self, key, value).map_err(kv_error)
    }
}

fn kv_error(e: StoreError) -> pjrt::KvError {
    let code = match &e {
        StoreError::DeadlineExceeded { .. } => pjrt::KvCode::DeadlineExceeded,
        StoreError::Lost(_) | StoreError::Unavailable(_) => pjrt::KvCode::Unavailable,
    };
    pjrt::KvError {
        code,
        message: e.to_string(),
    }
}

/// This machine's host name, for messages (`?` where it cannot be read).
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "?".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    fn serve() -> (StoreServer, String) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let server = StoreServer::serve(listener).unwrap();
        let address = format!("127.0.0.1:{}", server.port());
        (server, address)
    }

    fn store(address: &str) -> Store {
        Store::connect(address, "test", Duration::from_secs(5)).unwrap()
    }

    #[test]
    fn put_get_and_try_get_under_the_runs_prefix() {
        let (_server, address) = serve();
        let a = store(&address);
        let b = store(&address);
        assert_eq!(a.try_get("k").unwrap(), None);
        a.put("k", &[0, 1, 255]).unwrap();
        assert_eq!(b.get("k", Duration::from_secs(1)).unwrap(), vec![0, 1, 255]);
        assert_eq!(b.try_get("k").unwrap(), Some(vec![0, 1, 255]));
        // A scope's keys are apart from the run's.
        assert_eq!(a.scope("pjrt/cuda").try_get("k").unwrap(), None);
        assert_eq!(a.scope("pjrt/cuda").prefix(), "xtrain/test/pjrt/cuda/");
        let other_run = Store::connect(&address, "other", Duration::from_secs(1)).unwrap();
        assert_eq!(other_run.try_get("k").unwrap(), None);
    }

    #[test]
    fn a_get_times_out_naming_the_key_and_the_timeout() {
        let (_server, address) = serve();
        let s = store(&address);
        let started = Instant::now();
        let e = s.get("never", Duration::from_millis(300)).unwrap_err();
        assert!(started.elapsed() >= Duration::from_millis(300));
        assert!(started.elapsed() < Duration::from_secs(5));
        assert_eq!(
            e,
            StoreError::DeadlineExceeded {
                key: "xtrain/test/never".into(),
                timeout: Duration::from_millis(300)
            }
        );
        let text = e.to_string();
        assert!(
            text.starts_with("DEADLINE_EXCEEDED") && text.contains("0.3 s"),
            "{text}"
        );
    }

    #[test]
    fn many_gets_wait_at_once_and_all_see_the_put() {
        let (_server, address) = serve();
        let s = store(&address);
        let (tx, rx) = mpsc::channel();
        for i in 0..8 {
            let s = s.clone();
            let tx = tx.clone();
            std::thread::spawn(move || {
                tx.send((i, s.get("later", Duration::from_secs(10))))
                    .unwrap();
            });
        }
        std::thread::sleep(Duration::from_millis(200));
        s.put("later", b"v").unwrap();
        for _ in 0..8 {
            let (_, got) = rx.recv_timeout(Duration::from_secs(10)).unwrap();
            assert_eq!(got.unwrap(), b"v");
        }
    }

    #[test]
    fn a_barrier_waits_for_all_and_names_who_is_missing() {
        let (_server, address) = serve();
        let stores: Vec<Store> = (0..3).map(|_| store(&address)).collect();
        let handles: Vec<_> = stores
            .iter()
            .enumerate()
            .map(|(p, s)| {
                let s = s.clone();
                std::thread::spawn(move || s.barrier("b1", p, 3, Duration::from_secs(10)))
            })
            .collect();
        for h in handles {
            h.join().unwrap().unwrap();
        }
        let e = stores[0]
            .barrier("b2", 0, 3, Duration::from_millis(200))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("DEADLINE_EXCEEDED") && e.contains("processes 1, 2 of 3"),
            "{e}"
        );
    }

    #[test]
    fn a_process_that_leaves_without_finishing_ends_the_others_waits() {
        let (_server, address) = serve();
        let watcher = store(&address);
        let (tx, rx) = mpsc::channel();
        let _mine = watcher.watch(0, move |why| tx.send(why).unwrap()).unwrap();
        // Process 1 joins, then its connection drops as a killed process's would.
        let mut peer = Connection::open(&address, Duration::from_secs(5)).unwrap();
        let reply = peer.call(
            &Request::Join {
                process: 1,
                host: "peer".into(),
            },
            None,
        );
        assert!(matches!(reply, Ok(Reply::Done)));
        let waiting = {
            let s = watcher.clone();
            std::thread::spawn(move || s.get("never", Duration::from_secs(30)))
        };
        std::thread::sleep(Duration::from_millis(100));
        drop(peer);
        let why = rx.recv_timeout(Duration::from_secs(5)).unwrap();
        assert!(why.contains("process 1 (on peer) left the run"), "{why}");
        let e = waiting.join().unwrap().unwrap_err();
        assert!(
            matches!(&e, StoreError::Lost(m) if m.contains("process 1")),
            "{e}"
        );
    }

    #[test]
    fn a_session_dropped_on_purpose_is_no_loss() {
        let (_server, address) = serve();
        let s = store(&address);
        let (tx, rx) = mpsc::channel::<String>();
        let tx2 = tx.clone();
        let _watch = s.watch(0, move |why| tx.send(why).unwrap()).unwrap();
        let done = s.watch(1, move |why| tx2.send(why).unwrap()).unwrap();
        done.leave();
        assert!(rx.recv_timeout(Duration::from_millis(500)).is_err());
        s.put("still", b"up").unwrap();
    }

    #[test]
    fn the_store_answers_a_plugin_with_pjrt_codes() {
        use pjrt::KeyValueStore;
        let (_server, address) = serve();
        let s = store(&address).scope("pjrt/cuda");
        KeyValueStore::put(&s, "id", b"x").unwrap();
        assert_eq!(
            KeyValueStore::try_get(&s, "id").unwrap(),
            Some(b"x".to_vec())
        );
        let e = KeyValueStore::get(&s, "none", Duration::from_millis(50)).unwrap_err();
        assert_eq!(e.code, pjrt::KvCode::DeadlineExceeded);
        assert!(
            e.message.contains("xtrain/test/pjrt/cuda/none"),
            "{}",
            e.message
        );
    }

    #[test]
    fn losing_process_0_is_seen_by_the_others() {
        let (server, address) = serve();
        let s = store(&address);
        let (tx, rx) = mpsc::channel();
        let _watch = s.watch(1, move |why| tx.send(why).unwrap()).unwrap();
        drop(server);
        let why = rx.recv_timeout(Duration::from_secs(5)).unwrap();
        assert!(why.contains("process 0 (the coordinator at"), "{why}");
    }

    #[test]
    fn an_absent_coordinator_is_named_after_the_timeout() {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let address = format!("127.0.0.1:{port}");
        let e = match Store::connect(&address, "t", Duration::from_millis(300)) {
            Err(e) => e.to_string(),
            Ok(_) => panic!("connected to nothing"),
        };
        assert!(e.contains(&address) && e.contains("0.3 s"), "{e}");
    }
}
