//! The run's key-value store, as PyTorch's TCPStore and JAX's coordination service keep one:
//! process 0 serves it over TCP ([`crate::cluster::server::StoreServer`]), every process
//! (process 0 too, over loopback) reaches it as a [`Store`]. Operations: `put`, a blocking `get`
//! with a timeout, `try_get`, `delete` and a `barrier`. The GPU plugins exchange their topology
//! and NCCL/RCCL ids through it (handed to them by `pjrt::KeyValueStore`); xtrain checks that
//! every process runs the same settings through it, and counts a checkpoint only after every
//! process passed a barrier.
//!
//! Transport and framing: std's blocking `TcpStream`, one thread per connection on the server,
//! a greeting that names the protocol's version and a handshake keyed by the run's secret
//! ([`crate::cluster::handshake`]), then sealed records ([`crate::cluster::channel`]) carrying
//! per message a small JSON header and the value's raw bytes. The store holds tens of
//! connections and, but for a checkpoint's gathered shards, a few kilobytes, so threads cost
//! nothing that matters, and no async runtime (tokio) is built for it. A blocking `get` waits
//! on the server (a condition variable), so many gets wait at once: the client takes an idle
//! connection from its pool, or opens another, per call.
//!
//! A lost process: each process holds one more connection, its session, open for the whole run.
//! When a session closes without saying goodbye (the process was killed or crashed) the server
//! tells every other process, whose [`Store::watch`] callback ends it; when process 0 goes, the
//! others see their sessions close. Waiting gets return at once with the same message.
//!
//! Errors, one class per kind: a wait that ran out (a get, a barrier) is
//! [`StoreError::DeadlineExceeded`]; a connection that broke, or news that a process is gone,
//! is [`StoreError::Lost`]; a store that cannot be reached or is not this run's,
//! [`StoreError::Unavailable`]; a request the store turned down, [`StoreError::Refused`].

use crate::cluster::auth::Secret;
use crate::cluster::channel::{Opener, Sealer};
use crate::cluster::handshake::{self, Failed, Ticket};
use crate::cluster::locks::locked;
use crate::cluster::wire::{
    io_words, other_protocol, receive, send, send_parts, Greeting, Reply, Request, StoreError,
};
use crate::words::{host, secs};
use std::io::BufReader;
use std::net::{Shutdown, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Who this process is to the store: its id in the run, and the run's secret it proves.
#[derive(Clone, Debug)]
pub struct Credentials {
    pub process: usize,
    pub secret: Secret,
}

/// One sealed connection to the store: its two halves.
struct Link {
    writer: Sealer<TcpStream>,
    reader: BufReader<Opener<TcpStream>>,
    socket: TcpStream,
    /// It carries the ticket of this process's session (opened after the process joined).
    ticketed: bool,
}

impl Link {
    /// Connect and prove who this process is, retrying until `timeout` while process 0 starts
    /// (or has no room yet); every try, handshake included, ends by then. A store that is not
    /// this run's is refused at once.
    fn open(
        address: &str,
        me: &Credentials,
        ticket: Option<&Ticket>,
        timeout: Duration,
    ) -> Result<Link, StoreError> {
        let deadline = Instant::now() + timeout;
        // Connections that something accepted but that never greeted, in a row: a store that
        // is busy may close one, another program closes (or ignores) every one.
        let mut silent = 0;
        loop {
            let last = match connect_once(address, deadline) {
                Ok(stream) => match Self::greet(stream, address, me, ticket, deadline) {
                    Ok(link) => return Ok(link),
                    Err(Retry::Now(e)) => return Err(e),
                    Err(Retry::Later(why)) => {
                        silent = 0;
                        why
                    }
                    Err(Retry::Silent(why)) if silent < 2 => {
                        silent += 1;
                        why
                    }
                    Err(Retry::Silent(_)) => {
                        return Err(StoreError::Unavailable(not_a_store(address)))
                    }
                },
                Err(e) => e,
            };
            if Instant::now() + Duration::from_millis(50) >= deadline {
                return Err(StoreError::Unavailable(format!(
                    "could not reach process 0's store at {address} within {} ({last}): is \
                     process 0 running, and is --coordinator its host name and a port it can \
                     open?",
                    secs(timeout)
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The handshake on a new connection (`handshake`), by `deadline`.
    fn greet(
        stream: TcpStream,
        address: &str,
        me: &Credentials,
        ticket: Option<&Ticket>,
        deadline: Instant,
    ) -> Result<Link, Retry> {
        let refused = |why: String| {
            Retry::Now(StoreError::Unavailable(format!(
                "{} (process 0's store at {address})",
                crate::words::escaped(&why, 1024)
            )))
        };
        let _ = stream.set_nodelay(true);
        let process = u32::try_from(me.process).unwrap_or(u32::MAX);
        let opened = match handshake::open_as(&stream, &me.secret, process, ticket, deadline) {
            Ok(o) => o,
            Err(Failed::Protocol(Greeting::Version(v))) => {
                return Err(refused(other_protocol("process 0", &v.to_string())))
            }
            Err(Failed::Protocol(_)) => {
                return Err(Retry::Now(StoreError::Unavailable(not_a_store(address))))
            }
            Err(Failed::NoGreeting(e)) => return Err(Retry::Silent(io_words(&e))),
            Err(Failed::Proof | Failed::Unconfirmed) => {
                return Err(refused(
                    "process 0's store does not prove the run's secret: every host must be \
                     given the same XTRAIN_RUN_TOKEN or --run-token-file (or another program \
                     answers there)"
                        .into(),
                ))
            }
            Err(Failed::Refused(why)) => return Err(refused(why)),
            Err(Failed::Busy) => return Err(Retry::Later("the store has no room yet".into())),
            // Closed on the way (a store still starting, or one that closed the oldest
            // handshakes): tried again.
            Err(Failed::Io(e)) => return Err(Retry::Later(io_words(&e))),
        };
        let _ = stream.set_read_timeout(None);
        let _ = stream.set_write_timeout(None);
        Ok(Link {
            writer: opened.sealer,
            reader: BufReader::with_capacity(64 << 10, opened.opener),
            socket: stream,
            ticketed: ticket.is_some(),
        })
    }

    /// Send `request` (with `value`, a put's) and read the reply and its value.
    fn call(
        &mut self,
        request: &Request,
        value: &[&[u8]],
        read_timeout: Option<Duration>,
    ) -> Result<(Reply, Vec<u8>), String> {
        send_parts(&mut self.writer, request, value).map_err(|e| io_words(&e))?;
        let _ = self.socket.set_read_timeout(read_timeout);
        receive::<Reply>(&mut self.reader, u64::MAX).map_err(|e| io_words(&e))
    }
}

/// Why a connection did not open: for good (`Now`), or for now (`Later`: tried again;
/// `Silent`: what answered never greeted, tried again a few times).
enum Retry {
    Now(StoreError),
    Later(String),
    Silent(String),
}

fn not_a_store(address: &str) -> String {
    format!("{address} is not an xtrain store (another program holds {address}?)")
}

/// One TCP connection to `address`, each try within what is left until `deadline`.
fn connect_once(address: &str, deadline: Instant) -> Result<TcpStream, String> {
    let addrs = address.to_socket_addrs().map_err(|e| io_words(&e))?;
    let mut last = String::from("the host name resolves to no address");
    for a in addrs {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err("no time left".into());
        }
        match TcpStream::connect_timeout(&a, left.min(Duration::from_secs(5))) {
            Ok(s) => return Ok(s),
            Err(e) => last = io_words(&e),
        }
    }
    Err(last)
}

struct Pool {
    address: String,
    me: Credentials,
    connect_timeout: Duration,
    idle: Mutex<Vec<Link>>,
    /// The ticket this process's session was given when it joined (`watch`): every connection
    /// opened after carries it.
    ticket: Mutex<Option<Ticket>>,
}

impl Pool {
    fn open(&self) -> Result<Link, StoreError> {
        let ticket = *locked(&self.ticket);
        Link::open(
            &self.address,
            &self.me,
            ticket.as_ref(),
            self.connect_timeout,
        )
    }

    /// A broken connection to the store, in the one class and words every call uses.
    fn lost(&self, e: String) -> StoreError {
        StoreError::Lost(format!(
            "process 0 (the coordinator at {}) is gone: the connection to its store was lost \
             ({e})",
            self.address
        ))
    }
}

/// A process's handle on the run's store, its keys under a prefix (`xtrain/RUN/`, and a
/// scope's own under that: [`Store::scope`]). Cheap to clone; safe to use from many threads.
#[derive(Clone)]
pub struct Store {
    pool: Arc<Pool>,
    prefix: String,
}

impl Store {
    /// Reach the store at `address` (`host:port`) as `me`, retrying for `connect_timeout`
    /// while process 0 starts. Keys are put under `xtrain/RUN/`.
    pub fn connect(
        address: &str,
        run: &str,
        me: Credentials,
        connect_timeout: Duration,
    ) -> Result<Store, StoreError> {
        let first = Link::open(address, &me, None, connect_timeout)?;
        Ok(Store {
            pool: Arc::new(Pool {
                address: address.to_string(),
                me,
                connect_timeout,
                idle: Mutex::new(vec![first]),
                ticket: Mutex::new(None),
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

    /// This process's id in the run (its credentials').
    pub fn process(&self) -> usize {
        self.pool.me.process
    }

    fn call(
        &self,
        request: Request,
        value: &[&[u8]],
        read_timeout: Option<Duration>,
    ) -> Result<(Reply, Vec<u8>), StoreError> {
        let taken = locked(&self.pool.idle).pop();
        let mut link = match taken {
            Some(c) => c,
            None => self.pool.open()?,
        };
        match link.call(&request, value, read_timeout) {
            Ok((Reply::Lost { message }, _)) => Err(StoreError::Lost(message)),
            // The store closes a connection it refused something on.
            Ok((Reply::Refused { message }, _)) => Err(StoreError::Refused(message)),
            Ok(reply) => {
                // One opened before the process joined (in use while it did) is closed: the
                // store would refuse its next request.
                let mut idle = locked(&self.pool.idle);
                if link.ticketed || locked(&self.pool.ticket).is_none() {
                    idle.push(link);
                }
                Ok(reply)
            }
            Err(e) => Err(self.pool.lost(e)),
        }
    }

    pub fn put(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.put_parts(key, &[value])
    }

    /// [`Store::put`] of a value in parts, which go as one value without being copied together
    /// (a shard's header and its gigabytes).
    pub fn put_parts(&self, key: &str, parts: &[&[u8]]) -> Result<(), StoreError> {
        let key = format!("{}{key}", self.prefix);
        self.call(Request::Put { key }, parts, None).map(|_| ())
    }

    /// Forget `key` (nothing happens where it has no value); only process 0 may, and the key
    /// stays written.
    pub fn delete(&self, key: &str) -> Result<(), StoreError> {
        let key = format!("{}{key}", self.prefix);
        self.call(Request::Delete { key }, &[], None).map(|_| ())
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
        match self.call(request, &[], Some(timeout + Duration::from_secs(10)))? {
            (Reply::Value, value) => Ok(value),
            (Reply::Timeout, _) => Err(StoreError::DeadlineExceeded {
                waited: format!("no value for key {full:?}"),
                timeout,
            }),
            (other, _) => Err(StoreError::Unavailable(format!(
                "the store answered {other:?} to a get"
            ))),
        }
    }

    /// The value of `key` if some process has put it, without waiting.
    pub fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let key = format!("{}{key}", self.prefix);
        match self.call(Request::TryGet { key }, &[], None)? {
            (Reply::Value, value) => Ok(Some(value)),
            (Reply::NotFound, _) => Ok(None),
            (other, _) => Err(StoreError::Unavailable(format!(
                "the store answered {other:?} to a try_get"
            ))),
        }
    }

    /// Wait until every process of the run reached the barrier `name` (each calls it once),
    /// for at most `timeout`: one request, which the store answers when the last arrives; an
    /// error names the processes that did not arrive, as id ranges.
    pub fn barrier(&self, name: &str, timeout: Duration) -> Result<(), StoreError> {
        let request = Request::Barrier {
            name: format!("{}barrier/{name}", self.prefix),
            timeout_ms: timeout.as_millis().min(u64::MAX as u128) as u64,
        };
        match self.call(request, &[], Some(timeout + Duration::from_secs(10)))? {
            (Reply::Done, _) => Ok(()),
            (Reply::Missing { count, ids }, _) => Err(StoreError::DeadlineExceeded {
                waited: format!(
                    "at barrier {name:?}: {} {} did not arrive",
                    crate::words::plural(count, "process"),
                    crate::words::escaped(&ids, 4096)
                ),
                timeout,
            }),
            (other, _) => Err(StoreError::Unavailable(format!(
                "the store answered {other:?} to a barrier"
            ))),
        }
    }

    /// Open this process's session and watch it: `on_lost` is called once, from a thread of
    /// its own, with what happened when another process leaves the run without finishing or
    /// process 0 goes. With `silent` (`--init-timeout`), a thread sends a heartbeat a few times
    /// in that span: a process whose session says nothing for that long (hung, its network
    /// gone with the connection still open) is lost to the others, and process 0 saying
    /// nothing for that long is lost to this one. Dropping the returned [`Session`] leaves the
    /// run on purpose.
    pub fn watch(
        &self,
        silent: Option<Duration>,
        on_lost: impl FnOnce(String) + Send + 'static,
    ) -> Result<Session, StoreError> {
        let mut link = self.pool.open()?;
        let silent_ms = silent.map_or(0, |d| d.as_millis().max(1) as u64);
        let join = Request::Join {
            host: host(),
            silent_ms,
        };
        match link.call(&join, &[], None) {
            Ok((Reply::Joined, ticket)) => {
                let ticket: Ticket = ticket.try_into().map_err(|_| {
                    StoreError::Unavailable("the store answered a join without a ticket".into())
                })?;
                // From now on only connections that carry the ticket act as this process: the
                // ones opened before are closed here (the store would refuse them).
                let mut idle = locked(&self.pool.idle);
                *locked(&self.pool.ticket) = Some(ticket);
                idle.clear();
            }
            Ok((Reply::Refused { message }, _)) => return Err(StoreError::Refused(message)),
            Ok((Reply::Lost { message }, _)) => return Err(StoreError::Lost(message)),
            Ok((other, _)) => {
                return Err(StoreError::Unavailable(format!(
                    "the store answered {other:?} to a join"
                )))
            }
            Err(e) => return Err(self.pool.lost(e)),
        }
        let Link {
            writer,
            mut reader,
            socket,
            ..
        } = link;
        let writer = Arc::new(Mutex::new(writer));
        let leaving = Arc::new(AtomicBool::new(false));
        let quiet = leaving.clone();
        let address = self.pool.address.clone();
        let _ = socket.set_read_timeout(silent);
        std::thread::Builder::new()
            .name("xtrain-session".into())
            .spawn(move || {
                let why = watched(&mut reader, &address, silent);
                if !quiet.load(Ordering::SeqCst) {
                    on_lost(why);
                }
            })
            .map_err(|e| StoreError::Unavailable(e.to_string()))?;
        if let Some(d) = silent {
            // A few heartbeats per span, so that one late by scheduling is not taken for a hang.
            let every = (d / 4).clamp(Duration::from_millis(20), Duration::from_secs(10));
            let (writer, leaving) = (writer.clone(), leaving.clone());
            std::thread::Builder::new()
                .name("xtrain-heartbeat".into())
                .spawn(move || loop {
                    std::thread::sleep(every);
                    if leaving.load(Ordering::SeqCst) {
                        break;
                    }
                    if send(&mut *locked(&writer), &Request::Heartbeat, &[]).is_err() {
                        break;
                    }
                })
                .map_err(|e| StoreError::Unavailable(e.to_string()))?;
        }
        Ok(Session {
            writer,
            socket,
            leaving,
        })
    }
}

/// What a session hears until it ends: why it ended.
fn watched(
    reader: &mut BufReader<Opener<TcpStream>>,
    address: &str,
    silent: Option<Duration>,
) -> String {
    loop {
        match receive::<Reply>(reader, 0) {
            // The answer to a heartbeat: the store is alive.
            Ok((Reply::Done, _)) => continue,
            Ok((Reply::Lost { message }, _)) => return crate::words::escaped(&message, 4096),
            Ok((other, _)) => return format!("the store sent {other:?} unasked"),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return format!(
                    "process 0 (the coordinator at {address}) went silent: its store answered \
                     nothing for {} (--init-timeout), though the connection is open: it hangs, \
                     or the network dropped",
                    secs(silent.unwrap_or_default())
                )
            }
            Err(e) => {
                return format!(
                    "process 0 (the coordinator at {address}) is gone: its store closed the \
                     connection ({})",
                    io_words(&e)
                )
            }
        }
    }
}

/// This process's membership of the run. [`Session::leave`] leaves on purpose; dropping it
/// otherwise (an error on the way) closes it as a crash would, so that the other processes are
/// told rather than left waiting.
pub struct Session {
    /// Shared with the heartbeat's thread.
    writer: Arc<Mutex<Sealer<TcpStream>>>,
    socket: TcpStream,
    leaving: Arc<AtomicBool>,
}

impl Session {
    /// Leave the run on purpose: the others are not told of a loss.
    pub fn leave(self) {
        self.leaving.store(true, Ordering::SeqCst);
        let _ = send(&mut *locked(&self.writer), &Request::Leave, &[]);
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        // This process's own watcher must not report its own session's close.
        self.leaving.store(true, Ordering::SeqCst);
        let _ = self.socket.shutdown(Shutdown::Both);
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
        StoreError::Lost(_) | StoreError::Unavailable(_) | StoreError::Refused(_) => {
            pjrt::KvCode::Unavailable
        }
    };
    pjrt::KvError {
        code,
        message: e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::server::StoreServer;
    use std::net::TcpListener;
    use std::sync::mpsc;

    use crate::cluster::server::Config;
    use std::io::Write;

    /// A store for a run of 3 processes, without a secret (loopback).
    fn serve() -> (StoreServer, String) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let server = StoreServer::serve(listener, Config::new(3, Secret::none())).unwrap();
        let address = format!("127.0.0.1:{}", server.port());
        (server, address)
    }

    fn me(process: usize) -> Credentials {
        Credentials {
            process,
            secret: Secret::none(),
        }
    }

    /// The store as process `k` of the run.
    fn store_as(address: &str, k: usize) -> Store {
        Store::connect(address, "test", me(k), Duration::from_secs(5)).unwrap()
    }

    fn store(address: &str) -> Store {
        store_as(address, 0)
    }

    #[test]
    fn put_get_and_try_get_under_the_runs_prefix() {
        let (_server, address) = serve();
        let a = store(&address);
        let b = store_as(&address, 1);
        assert_eq!(a.try_get("k/0").unwrap(), None);
        a.put("k/0", &[0, 1, 255]).unwrap();
        assert_eq!(
            b.get("k/0", Duration::from_secs(1)).unwrap(),
            vec![0, 1, 255]
        );
        assert_eq!(b.try_get("k/0").unwrap(), Some(vec![0, 1, 255]));
        // A scope's keys are apart from the run's.
        assert_eq!(a.scope("pjrt/cuda").try_get("k/0").unwrap(), None);
        assert_eq!(a.scope("pjrt/cuda").prefix(), "xtrain/test/pjrt/cuda/");
        let other_run = Store::connect(&address, "other", me(2), Duration::from_secs(1)).unwrap();
        assert_eq!(other_run.try_get("k/0").unwrap(), None);
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
                waited: "no value for key \"xtrain/test/never\"".into(),
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
                tx.send((i, s.get("later/0", Duration::from_secs(10))))
                    .unwrap();
            });
        }
        std::thread::sleep(Duration::from_millis(200));
        s.put("later/0", b"v").unwrap();
        for _ in 0..8 {
            let (_, got) = rx.recv_timeout(Duration::from_secs(10)).unwrap();
            assert_eq!(got.unwrap(), b"v");
        }
    }

    #[test]
    fn a_barrier_waits_for_all_and_names_who_is_missing() {
        let (_server, address) = serve();
        let stores: Vec<Store> = (0..3).map(|k| store_as(&address, k)).collect();
        let handles: Vec<_> = stores
            .iter()
            .map(|s| {
                let s = s.clone();
                std::thread::spawn(move || s.barrier("b1", Duration::from_secs(10)))
            })
            .collect();
        for h in handles {
            h.join().unwrap().unwrap();
        }
        let e = stores[0]
            .barrier("b2", Duration::from_millis(200))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(
                "DEADLINE_EXCEEDED: at barrier \"b2\": processes 1, 2 did not arrive within 0.2 s"
            ),
            "{e}"
        );
    }

    #[test]
    fn a_process_that_leaves_without_finishing_ends_the_others_waits() {
        let (_server, address) = serve();
        let watcher = store(&address);
        let (tx, rx) = mpsc::channel();
        let _mine = watcher
            .watch(None, move |why| tx.send(why).unwrap())
            .unwrap();
        // Process 1 joins, then its connection drops as a killed process's would.
        let mut peer = Link::open(&address, &me(1), None, Duration::from_secs(5)).unwrap();
        let reply = peer.call(
            &Request::Join {
                host: "peer".into(),
                silent_ms: 0,
            },
            &[],
            None,
        );
        assert!(matches!(reply, Ok((Reply::Joined, _))));
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
    fn a_process_silent_for_the_timeout_is_lost_though_its_connection_is_open() {
        let (_server, address) = serve();
        let watcher = store(&address);
        let (tx, rx) = mpsc::channel();
        // This process heartbeats; its peer joins asking to be heard every 0.3 s, then hangs.
        let _mine = watcher
            .watch(Some(Duration::from_millis(300)), move |why| {
                tx.send(why).unwrap()
            })
            .unwrap();
        let mut peer = Link::open(&address, &me(1), None, Duration::from_secs(5)).unwrap();
        let join = Request::Join {
            host: "peer".into(),
            silent_ms: 300,
        };
        assert!(matches!(
            peer.call(&join, &[], None),
            Ok((Reply::Joined, _))
        ));
        let t0 = Instant::now();
        let why = rx.recv_timeout(Duration::from_secs(5)).unwrap();
        assert!(
            why.contains("process 1 (on peer) went silent: nothing from it for 0.3 s"),
            "{why}"
        );
        assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
        drop(peer);
    }

    #[test]
    fn a_coordinator_silent_for_the_timeout_is_lost() {
        // A store that accepts the session and then says nothing more (a hung process 0).
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let hung = std::thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            let soon = Instant::now() + Duration::from_secs(5);
            let accepted = handshake::Verdict::Accepted;
            let (_, mut o) = handshake::accept(
                &stream,
                &Secret::none(),
                soon,
                &|_| handshake::First::GoOn,
                &|_, _| accepted.clone(),
            )
            .unwrap();
            let _: (Request, _) = receive(&mut o.opener, 0).unwrap();
            send(&mut o.sealer, &Reply::Joined, &[7u8; 32]).unwrap();
            std::thread::sleep(Duration::from_secs(3));
        });
        let s = Store {
            pool: Arc::new(Pool {
                address: address.clone(),
                me: me(1),
                connect_timeout: Duration::from_secs(5),
                idle: Mutex::new(Vec::new()),
                ticket: Mutex::new(None),
            }),
            prefix: "xtrain/t/".into(),
        };
        let (tx, rx) = mpsc::channel();
        let _watch = s
            .watch(Some(Duration::from_millis(300)), move |why| {
                tx.send(why).unwrap()
            })
            .unwrap();
        let why = rx.recv_timeout(Duration::from_secs(2)).unwrap();
        assert!(
            why.contains(&format!(
                "process 0 (the coordinator at {address}) went silent"
            )),
            "{why}"
        );
        hung.join().unwrap();
    }

    #[test]
    fn a_session_dropped_on_purpose_is_no_loss() {
        let (_server, address) = serve();
        let s = store(&address);
        let (tx, rx) = mpsc::channel::<String>();
        let tx2 = tx.clone();
        let _watch = s.watch(None, move |why| tx.send(why).unwrap()).unwrap();
        let done = store_as(&address, 1)
            .watch(None, move |why| tx2.send(why).unwrap())
            .unwrap();
        done.leave();
        assert!(rx.recv_timeout(Duration::from_millis(500)).is_err());
        s.put("still/0", b"up").unwrap();
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
        let s = store_as(&address, 1);
        let (tx, rx) = mpsc::channel();
        let _watch = s.watch(None, move |why| tx.send(why).unwrap()).unwrap();
        drop(server);
        let why = rx.recv_timeout(Duration::from_secs(5)).unwrap();
        assert!(why.contains("process 0 (the coordinator at"), "{why}");
    }

    /// A process of another xtrain build is refused on its own connection, told both versions,
    /// a stranger's bytes hear nothing; the run goes on.
    #[test]
    fn a_process_of_another_protocol_is_refused_and_the_run_goes_on() {
        use crate::cluster::wire::{greeting, MAGIC};
        use std::io::Read;
        let (_server, address) = serve();
        let s = store(&address);
        let (tx, rx) = mpsc::channel();
        let _mine = s.watch(None, move |why| tx.send(why).unwrap()).unwrap();
        for hello in [
            [&MAGIC[..], &99u32.to_le_bytes()].concat(),
            br#"{"op":"put","key":"k","value":[1]}"#.to_vec(),
        ] {
            let mut other = TcpStream::connect(&address).unwrap();
            other.write_all(&hello).unwrap();
            let mut heard = Vec::new();
            // A stranger's unread bytes may end its connection with a reset.
            let _ = other.read_to_end(&mut heard);
            if hello.starts_with(MAGIC) {
                // It hears this side's version, so that it can name both, and nothing more.
                assert_eq!(heard, greeting());
            } else {
                // A stranger hears nothing.
                assert!(heard.is_empty(), "{heard:?}");
            }
        }
        assert!(rx.recv_timeout(Duration::from_millis(300)).is_err());
        s.put("still/0", b"up").unwrap();
        assert_eq!(s.try_get("still/0").unwrap(), Some(b"up".to_vec()));
    }

    /// This process refuses a store of another protocol at once (not after its connect
    /// timeout), naming both versions; what closes on the greeting (protocol 1's store, another
    /// program) is not an xtrain store.
    #[test]
    fn a_store_of_another_protocol_is_refused_at_once() {
        use crate::cluster::wire::MAGIC;
        use std::io::Read;
        for answer in [Some(7u32), None] {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let address = listener.local_addr().unwrap().to_string();
            // A program that never greets is tried three times (a busy store may close one).
            let tries = if answer.is_some() { 1 } else { 3 };
            let other = std::thread::spawn(move || {
                for _ in 0..tries {
                    let (mut stream, _) = listener.accept().unwrap();
                    let mut hello = [0u8; 12];
                    stream.read_exact(&mut hello).unwrap();
                    if let Some(v) = answer {
                        stream
                            .write_all(&[&MAGIC[..], &v.to_le_bytes()].concat())
                            .unwrap();
                    }
                }
            });
            let t0 = Instant::now();
            let e = match Store::connect(&address, "t", me(1), Duration::from_secs(20)) {
                Err(e) => e.to_string(),
                Ok(_) => panic!("a store of another protocol was taken"),
            };
            assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
            let want = match answer {
                Some(_) => format!(
                    "process 0 speaks store protocol 7, this xtrain protocol {}",
                    crate::cluster::wire::PROTOCOL
                ),
                None => "is not an xtrain store (another program holds".into(),
            };
            assert!(e.contains(&want) && e.contains(&address), "{e}");
            other.join().unwrap();
        }
    }

    #[test]
    fn an_absent_coordinator_is_named_after_the_timeout() {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let address = format!("127.0.0.1:{port}");
        let e = match Store::connect(&address, "t", me(1), Duration::from_millis(300)) {
            Err(e) => e.to_string(),
            Ok(_) => panic!("connected to nothing"),
        };
        assert!(e.contains(&address) && e.contains("0.3 s"), "{e}");
    }
}
