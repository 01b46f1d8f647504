//! What the store's threads share: its values and sessions ([`State`]), the connections open
//! ([`Conns`]), who it serves ([`Config`]) and what it takes at most ([`Limits`]).

use crate::cluster::auth::Secret;
use crate::cluster::wire::Reply;
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::AtomicBool;
use std::sync::mpsc::SyncSender;
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
pub(super) struct State {
    /// Shared, so that a get's answer is sent (gigabytes, for a gathered state) outside the
    /// lock and without a copy.
    pub(super) values: HashMap<String, Arc<Vec<u8>>>,
    /// Bytes of `values`, and of puts under way.
    pub(super) total: u64,
    /// Why the run cannot go on (a process left without saying goodbye), once known.
    pub(super) lost: Option<String>,
    /// The open sessions, by process: where news of a lost process is sent (through each
    /// session's writer).
    pub(super) sessions: HashMap<usize, SyncSender<Reply>>,
    /// Where each process joined from (every join of the run, for a second one).
    pub(super) joined: HashMap<usize, SocketAddr>,
}

/// The connections open, to close them when the server stops (and the oldest handshakes when
/// too many are under way).
#[derive(Default)]
pub(super) struct Conns {
    pub(super) next: u64,
    /// Each with when it was accepted.
    pub(super) handshaking: VecDeque<(u64, TcpStream, Instant)>,
    pub(super) open: HashMap<u64, TcpStream>,
}

pub(super) struct Shared {
    pub(super) state: Mutex<State>,
    pub(super) changed: Condvar,
    pub(super) config: Config,
    pub(super) conns: Mutex<Conns>,
    /// The kinds of refusal already said (each is said once).
    pub(super) said: Mutex<BTreeSet<&'static str>>,
    pub(super) stopped: AtomicBool,
}

pub(super) fn locked<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    pub(super) fn state(&self) -> MutexGuard<'_, State> {
        locked(&self.state)
    }

    /// Say `message` once per `kind` of event.
    pub(super) fn say_once(&self, kind: &'static str, message: &str) {
        if locked(&self.said).insert(kind) {
            crate::esay!("xtrain: store: {message} (said once)");
        }
    }

    pub(super) fn forget(&self, id: u64) {
        let mut c = locked(&self.conns);
        c.handshaking.retain(|(k, _, _)| *k != id);
        c.open.remove(&id);
    }
}
