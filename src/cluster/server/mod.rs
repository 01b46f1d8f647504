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
//!
//! Its files: `admission` (accepting, fair handshake slots, each connection's handshake, the
//! caps on proven connections), `requests` (what a proven connection asks, and the sessions),
//! `values` (the values under the keys' rules and the caps, blocking gets, barriers), `shared`
//! (the state they share, the [`Config`] and [`Limits`]).

mod admission;
mod requests;
mod shared;
mod values;

pub use shared::{Config, Limits, Refusals, Refused};

use crate::cluster::locks::{locked, wait};
use crate::cluster::wire::{io_words, StoreError};
use shared::Shared;
use std::net::{Shutdown, SocketAddr, TcpListener};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

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
        // A longer queue of connections not yet accepted than std's 128, so that a burst of
        // them (a flood) does not make the kernel drop a process's connection meanwhile.
        #[cfg(unix)]
        {
            use std::os::fd::AsRawFd;
            // SAFETY: listen on the listener's own open descriptor; it only changes the queue.
            unsafe { libc::listen(listener.as_raw_fd(), 4096) };
        }
        let shared = Arc::new(Shared::new(config));
        let s = shared.clone();
        let accepting = std::thread::Builder::new()
            .name("xtrain-store".into())
            .spawn(move || admission::accept_all(listener, &s))
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

    /// The connections it turned away so far, by kind ([`Refusals`]), for what a run that never
    /// met says.
    pub fn refusals(&self) -> Refusals {
        locked(&self.shared.refusals).clone()
    }

    /// Wait (up to `timeout`) until no session but `own` is open: every other process has left
    /// or is gone, so that closing the store strands no one.
    pub fn wait_for_others_to_leave(&self, own: usize, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        let mut st = self.shared.state();
        while st.sessions.keys().any(|p| *p != own) && Instant::now() < deadline {
            let left = deadline.saturating_duration_since(Instant::now());
            st = wait(
                &self.shared.changed,
                st,
                left.min(Duration::from_millis(100)),
            );
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
                .map(|(s, _)| s)
                .chain(c.handshaking.iter().map(|p| &p.stream))
            {
                let _ = s.shutdown(Shutdown::Both);
            }
        }
        let st = self.shared.state();
        self.shared.wake_all(&st);
        drop(st);
        if let Some(t) = self.accepting.take() {
            let _ = t.join();
        }
    }
}
