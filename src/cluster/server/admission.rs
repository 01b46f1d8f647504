//! Admission: accepting connections, making room for each one's handshake fairly, the
//! handshake on a thread of its own, the caps on proven connections, and what is said (and
//! counted, for process 0's messages) of those turned away. A proven connection goes on to
//! `requests`.
//!
//! Fairness: handshakes under way are capped per source address ([`Limits::slots_per_source`])
//! and in all ([`Limits::handshake_slots`]). A newcomer always gets a slot: past its source's
//! cap it closes that source's oldest handshake, past the total the oldest of the source that
//! holds the most. A flood from one address so only ever crowds out itself, and a process on
//! another address gets in at once. Each handshake must end within
//! [`Limits::handshake_time`], however slowly its bytes come.
//!
//! [`Limits::slots_per_source`]: super::Limits::slots_per_source
//! [`Limits::handshake_slots`]: super::Limits::handshake_slots
//! [`Limits::handshake_time`]: super::Limits::handshake_time

use super::requests;
use super::shared::{Pending, Shared};
use crate::cluster::handshake::{self, Failed, Verdict};
use crate::cluster::locks::locked;
use crate::cluster::wire::{Greeting, PROTOCOL};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Accept connections until the server stops; a failing accept (no descriptors left) backs
/// off, said once.
pub(super) fn accept_all(listener: TcpListener, shared: &Arc<Shared>) {
    let mut backoff = Duration::from_millis(10);
    while !shared.stopped.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, from)) => {
                backoff = Duration::from_millis(10);
                admit(shared, stream, from);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(5));
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

/// Which handshake a newcomer from `source` closes to take its slot, if one must go: its own
/// source's oldest past that source's cap, else past the total the oldest of the source that
/// holds the most.
fn crowded_out(
    pending: &[Pending],
    source: IpAddr,
    per_source: usize,
    all: usize,
) -> Option<usize> {
    let mine = pending.iter().filter(|p| p.source == source).count();
    if mine >= per_source {
        return pending.iter().position(|p| p.source == source);
    }
    if pending.len() < all {
        return None;
    }
    let mut counts: std::collections::HashMap<IpAddr, usize> = Default::default();
    for p in pending {
        *counts.entry(p.source).or_default() += 1;
    }
    let most = counts.values().copied().max()?;
    // Of the sources holding the most, the one whose oldest handshake is oldest.
    pending.iter().position(|p| counts[&p.source] == most)
}

/// Give a new connection a handshake slot and serve it on a thread of its own.
fn admit(shared: &Arc<Shared>, stream: TcpStream, from: SocketAddr) {
    let limits = &shared.config.limits;
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_nodelay(true);
    let mut c = locked(&shared.conns);
    if let Some(k) = crowded_out(
        &c.handshaking,
        from.ip(),
        limits.slots_per_source,
        limits.handshake_slots,
    ) {
        let old = c.handshaking.remove(k);
        let _ = old.stream.shutdown(Shutdown::Both);
        drop(c);
        shared.say_once(
            "crowded",
            &format!(
                "more connections in their handshake than it takes ({} in all, {} from one \
                 address): the oldest of the address holding the most are closed for newcomers",
                limits.handshake_slots, limits.slots_per_source
            ),
        );
        c = locked(&shared.conns);
    }
    let id = c.next;
    c.next += 1;
    let Ok(kept) = stream.try_clone() else { return };
    c.handshaking.push(Pending {
        id,
        stream: kept,
        source: from.ip(),
    });
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
    let config = &shared.config;
    let processes = config.processes;
    let deadline = Instant::now() + config.limits.handshake_time;
    // Asked once the process proved the secret and the keys: nothing about the run (not its
    // size) is said to anyone before.
    let admit = |p: u32| {
        let p = p as usize;
        if p >= processes {
            return Verdict::Refused(format!(
                "process {p} is outside this run of {} (ids 0 to {})",
                crate::words::count(processes, "process"),
                processes - 1
            ));
        }
        let mut c = locked(&shared.conns);
        let Some(k) = c.handshaking.iter().position(|q| q.id == id) else {
            // Closed meanwhile to make room for a newcomer.
            return Verdict::Busy;
        };
        if c.of(p) >= config.limits.connections {
            return Verdict::Busy;
        }
        let pending = c.handshaking.remove(k);
        c.open.insert(id, (pending.stream, p));
        Verdict::Accepted
    };
    let (process, opened) = match handshake::accept(&stream, &config.secret, deadline, &admit) {
        Ok(done) => done,
        Err(failed) => return refused(shared, from, failed),
    };
    let _ = stream.set_read_timeout(None);
    let _ = stream.set_write_timeout(Some(config.limits.io));
    requests::serve(shared, stream, opened, from, process as usize);
}

/// Count and say (once per kind) why a connection was turned away in its handshake.
fn refused(shared: &Shared, from: SocketAddr, failed: Failed) {
    let (kind, message) = match failed {
        Failed::Protocol(Greeting::Version(v)) => (
            "version",
            format!(
                "refused a process of another xtrain build from {from} (store protocol {v}, \
                 this xtrain {PROTOCOL}): every host of a run must run the same build"
            ),
        ),
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
        Failed::Busy => (
            "busy",
            format!(
                "told a process at {from} to try again: it has {} connections open, the most \
                 one process may",
                shared.config.limits.connections
            ),
        ),
        Failed::Unconfirmed => (
            "replayed",
            format!(
                "closed a connection from {from} whose first message opened but which could \
                 not go on (a recorded handshake replayed, or bytes changed on the way)"
            ),
        ),
        Failed::Io(_) | Failed::NoGreeting(_) => (
            "unfinished",
            format!(
                "closed a connection from {from} that did not finish its handshake (it closed, \
                 was too slow, or was crowded out by newer ones)"
            ),
        ),
    };
    shared.refuse(kind, from, &message);
}
