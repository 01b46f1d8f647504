//! Process 0's side of the run's store: the values, one thread per connection, blocking gets
//! that wait on a condition variable (many at once), and the sessions: when one closes without
//! saying goodbye, every other session is told and every waiting get returns. A process of
//! another xtrain build (another store protocol) ends the run the same way, named.

use crate::cluster::wire::{
    greeting, other_protocol, read_greeting, receive, refusal_for_json, secs, send, Greeting,
    Reply, Request, StoreError, PROTOCOL,
};
use std::collections::HashMap;
use std::io::{BufReader, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

#[derive(Default)]
struct State {
    /// Shared, so that a get's answer is sent (gigabytes, for a gathered state) outside the
    /// lock and without a copy.
    values: HashMap<String, Arc<Vec<u8>>>,
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
    let _ = stream.set_nodelay(true);
    let Ok(mut writer) = stream.try_clone() else {
        return;
    };
    let from = stream
        .peer_addr()
        .map_or_else(|_| "?".into(), |a| a.to_string());
    let mut reader = BufReader::new(stream);
    // Both sides say which protocol they speak before anything else.
    let who = format!("a process connecting from {from} (another xtrain build)");
    match read_greeting(&mut reader) {
        Ok(Greeting::Same) => {
            if writer.write_all(&greeting()).is_err() {
                return;
            }
        }
        Ok(Greeting::Version(v)) => {
            // Answered with this side's version, so that the peer names both too.
            let _ = writer.write_all(&greeting());
            lose(shared, None, other_protocol(&who, &v.to_string()));
            return;
        }
        Ok(Greeting::Json) => {
            let message = other_protocol(&who, "1");
            let _ = writer.write_all(&refusal_for_json(&format!(
                "process 0's store speaks store protocol {PROTOCOL}, this xtrain protocol 1:                  every host of a run must run the same xtrain build"
            )));
            lose(shared, None, message);
            return;
        }
        // Something else on the port (a probe): not a process of the run.
        Ok(Greeting::Stranger) | Err(_) => return,
    }
    let mut session: Option<(usize, String)> = None;
    // How long the session may stay silent, once it has said (None: no limit).
    let mut silent_for: Option<Duration> = None;
    // Until the connection closes, sends what is not a request, or its session falls silent.
    loop {
        let (request, value) = match receive::<Request>(&mut reader) {
            Ok(r) => r,
            Err(e) => {
                let timed_out = matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                );
                if let (true, Some((process, host)), Some(d)) = (timed_out, &session, silent_for) {
                    let message = format!(
                        "process {process} (on {host}) went silent: nothing from it for {} \
                         (--init-timeout), though its connection is open: it hangs, or its \
                         network dropped",
                        secs(d)
                    );
                    lose(shared, Some(*process), message);
                    session = None;
                }
                break;
            }
        };
        let mut found = None;
        let reply = match request {
            Request::Put { key } => {
                let mut st = shared.state.lock().unwrap();
                st.values.insert(key, Arc::new(value));
                shared.changed.notify_all();
                Reply::Done
            }
            Request::TryGet { key } => {
                let st = shared.state.lock().unwrap();
                match (&st.lost, st.values.get(&key)) {
                    (_, Some(v)) => {
                        found = Some(v.clone());
                        Reply::Value
                    }
                    (Some(why), None) => Reply::Lost {
                        message: why.clone(),
                    },
                    (None, None) => Reply::NotFound,
                }
            }
            Request::Delete { key } => {
                shared.state.lock().unwrap().values.remove(&key);
                Reply::Done
            }
            Request::Get { key, timeout_ms } => match wait_for(shared, &key, timeout_ms) {
                Ok(v) => {
                    found = Some(v);
                    Reply::Value
                }
                Err(reply) => reply,
            },
            Request::Join {
                process,
                host,
                silent_ms,
            } => {
                let mut st = shared.state.lock().unwrap();
                if let Ok(w) = writer.try_clone() {
                    st.sessions.insert(process, w);
                }
                session = Some((process, host));
                if silent_ms > 0 {
                    let d = Duration::from_millis(silent_ms);
                    silent_for = Some(d);
                    let _ = reader.get_ref().set_read_timeout(Some(d));
                }
                Reply::Done
            }
            Request::Heartbeat => Reply::Done,
            Request::Leave => {
                if let Some((process, _)) = session.take() {
                    shared.state.lock().unwrap().sessions.remove(&process);
                    shared.changed.notify_all();
                }
                Reply::Done
            }
        };
        // A session's replies go under the lock that news of a lost process is sent under, so
        // that the two never interleave on its connection.
        let value = found.as_deref().map_or(&[][..], |v| &v[..]);
        let sent = match session {
            Some(_) => {
                let _st = shared.state.lock().unwrap();
                send(&mut writer, &reply, value)
            }
            None => send(&mut writer, &reply, value),
        };
        if sent.is_err() {
            break;
        }
    }
    if let Some((process, host)) = session {
        let message = format!(
            "process {process} (on {host}) left the run without finishing: it was killed, \
             crashed or lost its network"
        );
        lose(shared, Some(process), message);
    }
}

/// Record that the run cannot go on, wake every waiting get, and tell every session but the
/// `gone` process's.
fn lose(shared: &Shared, gone: Option<usize>, message: String) {
    let mut st = shared.state.lock().unwrap();
    if let Some(gone) = gone {
        st.sessions.remove(&gone);
    }
    if st.lost.is_none() {
        st.lost = Some(message.clone());
    }
    let news = Reply::Lost { message };
    for s in st.sessions.values_mut() {
        let _ = send(s, &news, &[]);
    }
    shared.changed.notify_all();
}

/// `key`'s value once some process put it, or the reply that says why not (a timeout, a loss).
fn wait_for(shared: &Shared, key: &str, timeout_ms: u64) -> Result<Arc<Vec<u8>>, Reply> {
    let deadline = Instant::now() + Duration::from_millis(timeout_ms);
    let mut st = shared.state.lock().unwrap();
    loop {
        if let Some(v) = st.values.get(key) {
            return Ok(v.clone());
        }
        if let Some(why) = &st.lost {
            return Err(Reply::Lost {
                message: why.clone(),
            });
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(Reply::Timeout);
        }
        st = shared.changed.wait_timeout(st, deadline - now).unwrap().0;
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
