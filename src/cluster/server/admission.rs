//! Admission: accepting connections within the caps (handshakes under way, connections
//! open), each one's handshake on a thread of its own, and what is said of those refused. A
//! proven connection goes on to [`requests`](super::requests).

use super::requests;
use super::shared::{locked, Shared};
use crate::cluster::handshake::{self, Failed};
use crate::cluster::wire::{refusal_for_json, Greeting, PROTOCOL};
use std::io::Write;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a handshake may go on before a newcomer may close it to take its place.
const STALE_HANDSHAKE: Duration = Duration::from_millis(500);

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
    requests::serve(shared, stream, from, process);
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
