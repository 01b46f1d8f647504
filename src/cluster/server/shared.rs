//! What the store's threads share: its values and sessions ([`State`]), the connections under
//! way and open ([`Conns`]), who it serves ([`Config`]), what it takes at most ([`Limits`]),
//! and what it turned away ([`Refusals`]).

use crate::cluster::auth::Secret;
use crate::cluster::handshake::Ticket;
use crate::cluster::locks::locked;
use crate::cluster::wire::Reply;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::sync::atomic::AtomicBool;
use std::sync::mpsc::SyncSender;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

/// What the store takes, at most.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Bytes of one value (the largest shard a run gathers is at most about 430 MB: the
    /// stacked LoRA B of the MLP at 405B, r=16, unsharded).
    pub value: u64,
    /// Bytes the store holds at once: values, their keys and [`ENTRY`] per key, and puts under
    /// way (their declared lengths, reserved before their bytes are read).
    pub total: u64,
    /// The most of `total` one process's keys may hold (`total` over the processes, and at
    /// least one value's worth).
    pub share: u64,
    /// Connections of one process that proved the secret, open at once.
    pub connections: usize,
    /// Connections in their handshake at once, from all sources: past it a newcomer closes
    /// the oldest handshake of the source holding the most.
    pub handshake_slots: usize,
    /// Connections in their handshake at once from one source address: past it a newcomer
    /// from there closes that source's oldest.
    pub slots_per_source: usize,
    /// How long a whole handshake may take.
    pub handshake_time: Duration,
    /// How long the rest of a frame may take once its first byte came, and any write.
    pub io: Duration,
}

/// What each key costs past its key's and value's bytes (the map's entry, its owner).
pub const ENTRY: u64 = 64;

impl Limits {
    /// The limits of a run of `processes` processes.
    pub fn for_run(processes: usize) -> Limits {
        let value = 1 << 30;
        // Room for a whole gathered state should process 0 fall behind its readers (about
        // 7.5 GB with both moments at 405B, r=16, every projection); the store forgets each
        // shard once read.
        let total: u64 = 16 << 30;
        Limits {
            value,
            total,
            share: (total / processes.max(1) as u64).max(value + (1 << 20)),
            connections: 64,
            handshake_slots: 64,
            slots_per_source: 16,
            handshake_time: Duration::from_secs(10),
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

/// A key's value and the process that wrote it.
pub(super) struct Entry {
    /// Shared, so that a get's answer is sent (gigabytes, for a gathered state) outside the
    /// lock and without a copy.
    pub(super) value: Arc<Vec<u8>>,
    pub(super) owner: usize,
}

/// A barrier under way: who arrived, and where its waiters wait (its own condition variable,
/// so that an arrival wakes only them).
pub(super) struct Barrier {
    pub(super) arrived: Vec<bool>,
    pub(super) count: usize,
    pub(super) done: Arc<Condvar>,
}

#[derive(Default)]
pub(super) struct State {
    pub(super) values: HashMap<String, Entry>,
    /// What the store holds and has reserved, counted as [`Limits::total`] says.
    pub(super) total: u64,
    /// The same, by the process whose keys they are.
    pub(super) held: HashMap<usize, u64>,
    /// Keys process 0 deleted (a SHA-256 prefix of each): written once, they stay written.
    pub(super) deleted: HashSet<[u8; 16]>,
    pub(super) barriers: HashMap<String, Barrier>,
    /// Barriers every process passed (passing one again by name returns at once).
    pub(super) passed: HashSet<String>,
    /// Why the run cannot go on (a process left without saying goodbye), once known.
    pub(super) lost: Option<String>,
    /// The open sessions, by process: where news of a lost process is sent (through each
    /// session's writer).
    pub(super) sessions: HashMap<usize, SyncSender<Reply>>,
    /// Where each process joined from (every join of the run, for a second one).
    pub(super) joined: HashMap<usize, SocketAddr>,
    /// The ticket each process's session was given when it joined: from then on, only a
    /// connection that carries it acts as that process.
    pub(super) tickets: HashMap<usize, Ticket>,
}

impl State {
    /// Count `bytes` more (or fewer) as `process`'s.
    pub(super) fn count(&mut self, process: usize, bytes: i64) {
        let held = self.held.entry(process).or_default();
        *held = held.saturating_add_signed(bytes);
        self.total = self.total.saturating_add_signed(bytes);
    }
}

/// A connection in its handshake.
pub(super) struct Pending {
    pub(super) id: u64,
    pub(super) stream: TcpStream,
    pub(super) source: IpAddr,
    /// Its first message opened under the run's secret (it is a process's, not a stranger's):
    /// closed for a newcomer only where every handshake under way is.
    pub(super) proven: bool,
}

/// The most first messages remembered, to refuse one replayed (a recording of the wire).
pub(super) const SEEN: usize = 1 << 16;

/// The connections under way and open, to close them when the server stops (and to make room
/// for a newcomer's handshake).
#[derive(Default)]
pub(super) struct Conns {
    pub(super) next: u64,
    /// Oldest first.
    pub(super) handshaking: Vec<Pending>,
    /// Each with its process.
    pub(super) open: HashMap<u64, (TcpStream, usize)>,
    /// The fresh public keys of the first messages that opened (the last [`SEEN`]), oldest
    /// first: one seen again is a recording, replayed.
    pub(super) seen: HashSet<[u8; 32]>,
    pub(super) seen_order: VecDeque<[u8; 32]>,
}

impl Conns {
    /// Open connections of `process`.
    pub(super) fn of(&self, process: usize) -> usize {
        self.open.values().filter(|(_, p)| *p == process).count()
    }

    /// Remember a first message's fresh public key; false where it was seen before.
    pub(super) fn first_seen(&mut self, key: &[u8; 32]) -> bool {
        if !self.seen.insert(*key) {
            return false;
        }
        self.seen_order.push_back(*key);
        if self.seen_order.len() > SEEN {
            if let Some(old) = self.seen_order.pop_front() {
                self.seen.remove(&old);
            }
        }
        true
    }
}

/// How many connections of one kind the store turned away, and from where (the first few).
#[derive(Default, Clone)]
pub struct Refused {
    pub count: usize,
    pub from: BTreeSet<IpAddr>,
}

/// The connections the store turned away, by kind: `secret` (its first message did not open
/// under the run's secret), `unfinished` (closed, slow or crowded out before its handshake
/// ended), `replayed` (its first message opened but it could not go on: a recording, or bytes
/// changed on the way), `version`, `stranger`, `refused` (an id outside the run, a second
/// join), `frame` (a proven connection's bytes were not the protocol's or did not open).
pub type Refusals = BTreeMap<&'static str, Refused>;

pub(super) struct Shared {
    pub(super) state: Mutex<State>,
    /// Woken by every put and loss (where blocking gets wait).
    pub(super) changed: Condvar,
    pub(super) config: Config,
    pub(super) conns: Mutex<Conns>,
    pub(super) refusals: Mutex<Refusals>,
    /// The kinds of event already said in the log (each is said once).
    pub(super) said: Mutex<BTreeSet<&'static str>>,
    pub(super) stopped: AtomicBool,
}

impl Shared {
    pub(super) fn new(config: Config) -> Shared {
        Shared {
            state: Mutex::default(),
            changed: Condvar::new(),
            config,
            conns: Mutex::default(),
            refusals: Mutex::default(),
            said: Mutex::default(),
            stopped: AtomicBool::new(false),
        }
    }

    pub(super) fn state(&self) -> MutexGuard<'_, State> {
        locked(&self.state)
    }

    /// Say `message` once per `kind` of event.
    pub(super) fn say_once(&self, kind: &'static str, message: &str) {
        if locked(&self.said).insert(kind) {
            crate::esay!("xtrain: store: {message} (said once)");
        }
    }

    /// Count a connection from `from` turned away as `kind`, and say it once.
    pub(super) fn refuse(&self, kind: &'static str, from: SocketAddr, message: &str) {
        {
            let mut r = locked(&self.refusals);
            let r = r.entry(kind).or_default();
            r.count += 1;
            if r.from.len() < 4 {
                r.from.insert(from.ip());
            }
        }
        self.say_once(kind, message);
    }

    pub(super) fn forget(&self, id: u64) {
        let mut c = locked(&self.conns);
        c.handshaking.retain(|p| p.id != id);
        c.open.remove(&id);
    }

    /// Wake everything waiting: blocking gets and every barrier's waiters.
    pub(super) fn wake_all(&self, st: &State) {
        self.changed.notify_all();
        for b in st.barriers.values() {
            b.done.notify_all();
        }
    }
}
