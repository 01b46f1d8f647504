//! Admission: accepting connections, making room for each one's handshake fairly, the
//! handshake on a thread of its own, the caps on proven connections, and what is said (and
//! counted, for process 0's messages) of those turned away. A proven connection goes on to
//! `requests`.
//!
//! Fairness: handshakes under way are capped per source address ([`Limits::slots_per_source`])
//! and in all ([`Limits::handshake_slots`]). A newcomer always gets a slot: past its source's
//! cap it closes that source's oldest handshake, past the total the oldest of the source that
//! holds the most. A handshake whose first message opened under the run's secret (a process's:
//! no stranger can make one, and a recording replayed is refused at once) goes only where
//! every handshake under way has one: so a flood from one address only ever crowds out itself,
//! and a flood from many addresses (a stranger with a whole IPv6 prefix, or loopback's) crowds
//! out none of the run's processes once their first message is read. A handshake closed for a
//! newcomer before that is told "busy", and its process tries again. Each handshake must end
//! within [`Limits::handshake_time`], however slowly its bytes come.
//!
//! [`Limits::slots_per_source`]: super::Limits::slots_per_source
//! [`Limits::handshake_slots`]: super::Limits::handshake_slots
//! [`Limits::handshake_time`]: super::Limits::handshake_time

use super::requests;
use super::shared::{Pending, Shared};
use crate::cluster::handshake::{self, Failed, First, Ticket, Verdict};
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
/// holds the most. Handshakes whose first message opened go last: where any has not, the
/// choice is among those.
fn crowded_out(
    pending: &[Pending],
    source: IpAddr,
    per_source: usize,
    all: usize,
) -> Option<usize> {
    let any_unproven = pending.iter().any(|p| !p.proven);
    let candidate = |p: &Pending| !(any_unproven && p.proven);
    let mine = pending.iter().filter(|p| p.source == source).count();
    if mine >= per_source {
        return pending
            .iter()
            .position(|p| p.source == source && !p.proven)
            .or_else(|| pending.iter().position(|p| p.source == source));
    }
    if pending.len() < all {
        return None;
    }
    let mut counts: std::collections::HashMap<IpAddr, usize> = Default::default();
    for p in pending.iter().filter(|p| candidate(p)) {
        *counts.entry(p.source).or_default() += 1;
    }
    let most = counts.values().copied().max()?;
    // Of the sources holding the most, the one whose oldest handshake is oldest.
    pending
        .iter()
        .position(|p| candidate(p) && counts[&p.source] == most)
}

/// Tell a handshake closed for a newcomer that the store is busy, where it has not been
/// answered yet (its first message did not open yet), without waiting on its socket.
fn tell_busy(old: &Pending) {
    if old.proven {
        return;
    }
    #[cfg(unix)]
    {
        use std::os::fd::AsRawFd;
        let fd = old.stream.as_raw_fd();
        let busy = handshake::busy();
        let mut unread = [0u8; 4096];
        // SAFETY: a send and a receive on the connection's own open descriptor, of buffers
        // that live across each call; MSG_DONTWAIT: neither blocks. What the peer sent is
        // read first (a few bytes), so that closing the connection after says "busy" and
        // ends it cleanly, rather than with a reset that may lose the answer.
        unsafe {
            libc::recv(
                fd,
                unread.as_mut_ptr().cast(),
                unread.len(),
                libc::MSG_DONTWAIT,
            );
            libc::send(
                fd,
                busy.as_ptr().cast(),
                busy.len(),
                libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
            );
        }
    }
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
        tell_busy(&old);
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
        proven: false,
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
    // Told when the first message opened: the handshake is a process's from then on (a
    // recording replayed stops there; one closed meanwhile for a newcomer was told "busy").
    let first = |ephemeral: &[u8; 32]| {
        let mut c = locked(&shared.conns);
        let Some(k) = c.handshaking.iter().position(|q| q.id == id) else {
            return First::Closed;
        };
        if !c.first_seen(ephemeral) {
            return First::Replayed;
        }
        c.handshaking[k].proven = true;
        First::GoOn
    };
    // Asked once the process proved the secret and the keys: nothing about the run (not its
    // size) is said to anyone before. Once a process joined, only its ticket's bearers act as
    // it.
    let ticketed = std::cell::Cell::new(false);
    let admit = |p: u32, ticket: Option<&Ticket>| {
        let p = p as usize;
        if p >= processes {
            return Verdict::Refused(format!(
                "process {p} is outside this run of {} (ids 0 to {})",
                crate::words::count(processes, "process"),
                processes - 1
            ));
        }
        let joined = {
            let st = shared.state();
            st.tickets.get(&p).copied().zip(st.joined.get(&p).copied())
        };
        if let Some((theirs, first)) = joined {
            if !ticket.is_some_and(|t| handshake::same_ticket(t, &theirs)) {
                return Verdict::Refused(format!(
                    "process {p} joined the run from {first}, and this connection from {from} \
                     does not carry its session's ticket: two processes were started with the \
                     same process id (or another holder of the run's secret claims it)"
                ));
            }
            ticketed.set(true);
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
    let (process, opened) =
        match handshake::accept(&stream, &config.secret, deadline, &first, &admit) {
            Ok(done) => done,
            Err(failed) => return refused(shared, from, failed),
        };
    let _ = stream.set_read_timeout(None);
    let _ = stream.set_write_timeout(Some(config.limits.io));
    requests::serve(
        shared,
        stream,
        opened,
        from,
        (process as usize, ticketed.get()),
    );
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
