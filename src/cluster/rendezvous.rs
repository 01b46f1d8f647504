//! The start of a run of several processes: process 0 serves the store, every process joins it,
//! puts what it was started with (the settings by flag, the mesh, the program's hash, xtrain's
//! version, its host) and reads everyone else's. A process started with other settings is
//! refused at once, by every process, naming the flag and both values; a process that never
//! comes is named after `--init-timeout`. All of this happens before any plugin is opened.

use crate::cluster::launch::{Coordinator, Launch};
use crate::cluster::server::{Config, StoreServer};
use crate::cluster::store::{Credentials, Session, Store};
use crate::cluster::wire::StoreError;
use crate::words::{host, ids, secs};
use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::collections::BTreeMap;

/// A process's part in a run of several: its place, the store, and its session (held for the
/// run; process 0 also holds the server).
pub struct Peers {
    pub launch: Launch,
    pub store: Store,
    session: Session,
    server: Option<StoreServer>,
}

/// Settings by flag name, without `--` (`lr`, `mesh`, `program`): what a process says about
/// itself at the start, compared across processes (where it runs is not), and what a checkpoint
/// records (`train::checkpoint`, `train::settings`).
pub type Settings = BTreeMap<String, Value>;

/// Join the run: process 0 starts serving the store first. `on_lost` is called (from a thread
/// of its own) when another process leaves the run without finishing or process 0 goes; the
/// caller ends this process there, since a step with a lost peer never completes.
pub fn join(launch: &Launch, on_lost: impl FnOnce(String) + Send + 'static) -> Result<Peers> {
    let coordinator = launch
        .coordinator
        .as_ref()
        .context("a run of several processes needs --coordinator")?;
    let server = if launch.process_id == 0 {
        let config = Config::new(launch.processes, launch.secret.clone());
        Some(serve(launch, config)?)
    } else {
        None
    };
    let me = Credentials {
        process: launch.process_id,
        secret: launch.secret.clone(),
    };
    // Process 0 reaches its store where it serves it: with --coordinator-bind the coordinator's
    // address may be one the network routes to this host but this host cannot reach (NAT).
    let at = match &server {
        Some(s) => {
            let mut a = s.address();
            if a.ip().is_unspecified() {
                a.set_ip(match a {
                    std::net::SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
                    std::net::SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
                });
            }
            a.to_string()
        }
        None => coordinator.to_string(),
    };
    let store = Store::connect(&at, &launch.run, me, launch.init_timeout)
        .with_context(|| format!("{} ({})", launch.name(), launch.source))?;
    let session = store.watch(Some(launch.init_timeout), on_lost)?;
    Ok(Peers {
        launch: launch.clone(),
        store,
        session,
        server,
    })
}

/// Serve the run's store where the launch says (`--coordinator-bind`, else the coordinator's
/// address, resolved), and nowhere else. Every address it would bind is checked: without a
/// secret (and `--trusted-network`), only a loopback one.
fn serve(launch: &Launch, config: Config) -> Result<StoreServer> {
    let at = launch
        .serves_at()
        .context("a run of several processes needs --coordinator")?;
    let addresses: Vec<std::net::SocketAddr> =
        std::net::ToSocketAddrs::to_socket_addrs(&(at.host.as_str(), at.port))
            .with_context(|| {
                format!("process 0 cannot resolve {at}, where it serves the run's store")
            })?
            .collect();
    let mut last = None;
    for a in addresses {
        if !a.ip().is_loopback() {
            let resolved = Coordinator {
                host: a.ip().to_string(),
                port: a.port(),
            };
            crate::cluster::launch::refuse_untrusted(
                &resolved,
                &format!("where {at} resolves"),
                &launch.secret,
                launch.trusted_network,
            )?;
        }
        match StoreServer::bind(a, config.clone()) {
            Ok(server) => {
                if a.ip().is_loopback() && !crate::cluster::launch::is_loopback(&at.host) {
                    crate::esay!(
                        "xtrain: note: {} resolves to {} on this host: only this host reaches \
                         the run's store there (give this host's network address with \
                         --coordinator-bind if the other processes run elsewhere)",
                        at.host,
                        a.ip()
                    );
                }
                return Ok(server);
            }
            Err(e) => last = Some(e),
        }
    }
    Err(last.map_or_else(
        || anyhow::anyhow!("{at} resolves to no address to serve the run's store on"),
        anyhow::Error::from,
    ))
}

impl Peers {
    /// Put this process's settings and check every other process's against them, waiting up to
    /// `--init-timeout` for each. Fails naming the first process whose settings differ (the
    /// flag, its value there and here), or the processes that did not come.
    pub fn agree(&self, settings: &Settings) -> Result<()> {
        let l = &self.launch;
        let me = serde_json::json!({ "host": host(), "settings": settings });
        self.store.put(
            &format!("settings/{}", l.process_id),
            me.to_string().as_bytes(),
        )?;
        let deadline = std::time::Instant::now() + l.init_timeout;
        let mut missing = Vec::new();
        for p in (0..l.processes).filter(|p| *p != l.process_id) {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let bytes = match self.store.get(&format!("settings/{p}"), left) {
                Ok(b) => b,
                Err(StoreError::DeadlineExceeded { .. }) => {
                    missing.push(p);
                    continue;
                }
                Err(e) => return Err(e.into()),
            };
            let theirs: Value = serde_json::from_slice(&bytes)
                .with_context(|| format!("process {p}'s settings in the store are not JSON"))?;
            // A peer's words reach this terminal: escaped, and short.
            let their_host = crate::words::escaped(theirs["host"].as_str().unwrap_or("?"), 255);
            let empty = serde_json::Map::new();
            let them = theirs["settings"].as_object().unwrap_or(&empty);
            if let Some(diff) = difference(settings, them) {
                let diff = crate::words::escaped(&diff, 4096);
                bail!(
                    "process {p} (on {their_host}) was started with other settings than this one \
                     ({}, on {}): {diff}. Every process of a run must run the same command \
                     (only the launcher's variables differ)",
                    l.name(),
                    host()
                );
            }
        }
        if !missing.is_empty() {
            // What the store turned away, as it happened: a process with another secret is
            // refused at its handshake, so it never shows up as joined.
            let turned = self
                .server
                .as_ref()
                .map_or(String::new(), |s| turned_away(&s.refusals()));
            bail!(
                "DEADLINE_EXCEEDED: {} of {} did not join the run at {} within --init-timeout {} \
                 ({}): was every process started, with the same --coordinator and \
                 --num-processes?{turned}",
                ids("process", &missing),
                l.processes,
                l.coordinator
                    .as_ref()
                    .map_or(String::new(), |c| c.to_string()),
                secs(l.init_timeout),
                l.source
            );
        }
        Ok(())
    }

    /// Leave the run on purpose (done, or refused for a reason every process finds itself):
    /// the others are not told of a loss. Process 0 first waits (up to `--init-timeout`) for
    /// the others to leave, so that closing its store strands no one.
    pub fn leave(self) {
        let own = self.launch.process_id;
        self.session.leave();
        if let Some(server) = &self.server {
            server.wait_for_others_to_leave(own, self.launch.init_timeout);
        }
    }

    /// Wait at barrier `name` for every process (up to `--init-timeout`).
    pub fn barrier(&self, name: &str) -> Result<()> {
        let l = &self.launch;
        Ok(self.store.barrier(name, l.init_timeout)?)
    }
}

/// What process 0's store turned away while the others did not come, by kind, with where from:
/// empty where it turned away nothing.
fn turned_away(refusals: &crate::cluster::server::Refusals) -> String {
    let said: Vec<String> = refusals
        .iter()
        .map(|(kind, r)| {
            let what = match *kind {
                "secret" => {
                    "whose first message did not open under the run's secret (a process \
                             given another XTRAIN_RUN_TOKEN or --run-token-file, or a stranger)"
                }
                "unfinished" => {
                    "that did not finish their handshake (closed, too slow, or \
                                 crowded out by newer ones)"
                }
                "replayed" => {
                    "that could not go on after their first message (a recorded \
                               handshake replayed, or bytes changed on the way)"
                }
                "version" => "of another xtrain build",
                "stranger" => "that did not speak xtrain's store protocol",
                "busy" => "of a process that had as many connections open as it may",
                "frame" => "whose frames were not the protocol's or did not open",
                _ => "refused for an id outside the run or a second join",
            };
            let from: Vec<String> = r.from.iter().map(|ip| ip.to_string()).collect();
            format!(
                "{} {what}, from {}",
                crate::words::count(r.count, "connection"),
                from.join(", ")
            )
        })
        .collect();
    match said.is_empty() {
        true => String::new(),
        false => format!(" Meanwhile the store turned away: {}.", said.join("; ")),
    }
}

/// The first flag whose value differs, worded `--lr 0.001 there, 0.0002 here`.
fn difference(mine: &Settings, theirs: &serde_json::Map<String, Value>) -> Option<String> {
    let none = Value::Null;
    let keys: std::collections::BTreeSet<&String> = mine.keys().chain(theirs.keys()).collect();
    keys.into_iter().find_map(|k| {
        let (a, b) = (theirs.get(k).unwrap_or(&none), mine.get(k).unwrap_or(&none));
        (a != b).then(|| {
            let what = match k.as_str() {
                // Not flags: what the binary and the program dir are.
                "xtrain-version" => "xtrain".to_string(),
                "program-sha256" => "the program dir's program, sha256".to_string(),
                "data-file" => {
                    "the data file (its size, and a hash of its first and last MiB)".to_string()
                }
                "resumed-step" => "the step of the checkpoint it resumes".to_string(),
                flag => format!("--{flag}"),
            };
            format!("{what} {} there, {} here", show(a), show(b))
        })
    })
}

/// A value as a user would write it after its flag (`train::settings` words its refusals with
/// it too).
pub fn show(v: &Value) -> String {
    match v {
        Value::String(s) if s.is_empty() => "(none)".into(),
        Value::String(s) => s.clone(),
        Value::Null => "(none)".into(),
        Value::Number(n) if n.is_f64() => format!("{}", n.as_f64().unwrap_or(f64::NAN)),
        v => v.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::launch::Coordinator;
    use serde_json::json;
    use std::time::Duration;

    fn launch(k: usize, n: usize, port: u16, timeout_ms: u64) -> Launch {
        Launch {
            processes: n,
            process_id: k,
            coordinator: Some(Coordinator {
                host: "127.0.0.1".into(),
                port,
            }),
            init_timeout: Duration::from_millis(timeout_ms),
            run: "t".into(),
            source: "test".into(),
            ..Launch::single()
        }
    }

    fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    fn settings(lr: f64) -> Settings {
        [
            ("lr".to_string(), json!(lr)),
            ("mesh".into(), json!("fsdp=2")),
        ]
        .into_iter()
        .collect()
    }

    #[test]
    fn processes_with_the_same_settings_agree() {
        let port = free_port();
        let zero = join(&launch(0, 2, port, 10_000), |_| {}).unwrap();
        let one = std::thread::spawn(move || {
            let p = join(&launch(1, 2, port, 10_000), |_| {}).unwrap();
            p.agree(&settings(1e-3)).unwrap();
            p.barrier("end").unwrap();
            p.leave();
        });
        zero.agree(&settings(1e-3)).unwrap();
        zero.barrier("end").unwrap();
        zero.leave();
        one.join().unwrap();
    }

    #[test]
    fn other_settings_are_named_by_both() {
        let port = free_port();
        let zero = join(&launch(0, 2, port, 10_000), |_| {}).unwrap();
        let one = std::thread::spawn(move || {
            let p = join(&launch(1, 2, port, 10_000), |_| {}).unwrap();
            p.agree(&settings(2e-4)).unwrap_err().to_string()
        });
        let here = zero.agree(&settings(1e-3)).unwrap_err().to_string();
        assert!(
            here.contains("process 1 (on") && here.contains("--lr 0.0002 there, 0.001 here"),
            "{here}"
        );
        let there = one.join().unwrap();
        assert!(there.contains("--lr 0.001 there, 0.0002 here"), "{there}");
    }

    #[test]
    fn what_is_not_a_flag_is_named_as_what_it_is() {
        let mine = settings(1e-3);
        let mut theirs: serde_json::Map<String, Value> = mine.clone().into_iter().collect();
        theirs.insert("xtrain-version".into(), json!("0.2.0"));
        let mut mine = mine;
        mine.insert("xtrain-version".into(), json!("0.1.0"));
        assert_eq!(
            difference(&mine, &theirs).unwrap(),
            "xtrain 0.2.0 there, 0.1.0 here"
        );
    }

    #[test]
    fn a_process_that_never_comes_is_named_after_the_timeout() {
        let port = free_port();
        let zero = join(&launch(0, 3, port, 300), |_| {}).unwrap();
        let e = zero.agree(&settings(1e-3)).unwrap_err().to_string();
        assert!(
            e.starts_with("DEADLINE_EXCEEDED: processes 1, 2 of 3"),
            "{e}"
        );
        assert!(e.contains("--init-timeout 0.3 s"), "{e}");
    }
}
