//! Which process of a run this one is: how many processes the run has, this one's index, and
//! where process 0 serves the run's key-value store. Taken from `xtrain train`'s flags
//! (`--num-processes`, `--process-id`, `--coordinator`), else from the launcher's environment:
//! SLURM (`srun`), torchrun-style variables, a TPU VM's worker variables, a GKE indexed job, or
//! `XTRAIN_*` variables. Each value comes from the first place that has it, in that order, so a
//! flag always wins; the launch says where each came from.

use crate::cluster::address::parse_port;
pub use crate::cluster::address::{is_loopback, parse_bind, parse_coordinator, Coordinator};
use crate::cluster::auth::Secret;
use anyhow::{bail, Context, Result};
use std::path::PathBuf;
use std::time::Duration;

/// The port process 0 serves the store on when the launcher names only a host: SLURM and TPU
/// VMs say where process 0 runs, not on which port (torchrun's `MASTER_PORT` does).
pub const DEFAULT_PORT: u16 = 8476;

/// How long a process waits for the others at the start of a run (and at each barrier) before
/// it gives up, by default.
pub const DEFAULT_INIT_TIMEOUT: Duration = Duration::from_secs(300);

/// The longest `--init-timeout` taken: a day.
pub const MAX_INIT_TIMEOUT: Duration = Duration::from_secs(86_400);

/// The most processes a run may have: one per host of the largest pods (a TPU v5p pod's 8,960
/// chips are 2,240 hosts) with room to spare; the store keeps a few keys per process.
pub const MAX_PROCESSES: usize = 65_536;

/// The flags of `xtrain train` that place a process in a run; `None` where not given.
#[derive(Clone, Debug, Default)]
pub struct LaunchFlags {
    pub num_processes: Option<usize>,
    pub process_id: Option<usize>,
    pub coordinator: Option<String>,
    pub init_timeout: Option<Duration>,
    /// `--virtual-hosts P` (a test mode): one process whose devices are split into P hosts,
    /// each reading its own weights and batch rows.
    pub virtual_hosts: Option<usize>,
    /// `--run-token-file FILE`: the run's secret (else `XTRAIN_RUN_TOKEN`).
    pub run_token_file: Option<PathBuf>,
    /// `--trusted-network`: a coordinator on a network address may run without a secret.
    pub trusted_network: bool,
    /// `--coordinator-bind ADDR`: where process 0 serves the store, when the coordinator's
    /// address is not one of its host's own.
    pub coordinator_bind: Option<String>,
}

/// One process's place in a run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Launch {
    /// How many processes (one per host) the run has.
    pub processes: usize,
    /// This process's index, 0..processes; process 0 serves the store and writes the outputs.
    pub process_id: usize,
    /// `host:port` of process 0's store; `None` for a run of one process.
    pub coordinator: Option<Coordinator>,
    pub init_timeout: Duration,
    /// A name for the run shared by its processes (the launcher's job id where it has one),
    /// which prefixes every key of the store.
    pub run: String,
    /// Where the values came from (`--num-processes`, `SLURM_NTASKS`, ...), for messages.
    pub source: String,
    /// The run's secret, which every connection to the store proves (none: anyone who reaches
    /// it may join; only on loopback or with `--trusted-network`).
    pub secret: Secret,
    /// `--trusted-network`: the store may serve a network address without a secret.
    pub trusted_network: bool,
    /// `--coordinator-bind`: where process 0 serves the store instead of the coordinator's
    /// address (its port the coordinator's where it names none).
    pub bind: Option<Coordinator>,
    /// What the user should hear about how the launch was read (flags that do nothing here).
    pub notes: Vec<String>,
}

impl Launch {
    /// A run of one process: no store, no peers.
    pub fn single() -> Launch {
        Launch {
            processes: 1,
            process_id: 0,
            coordinator: None,
            init_timeout: DEFAULT_INIT_TIMEOUT,
            run: "run".into(),
            source: "one process".into(),
            secret: Secret::none(),
            trusted_network: false,
            bind: None,
            notes: Vec::new(),
        }
    }

    pub fn is_single(&self) -> bool {
        self.processes == 1
    }

    /// `process 2 of 4`, for messages.
    pub fn name(&self) -> String {
        format!("process {} of {}", self.process_id, self.processes)
    }

    /// Where process 0 serves the store: `--coordinator-bind`, else the coordinator.
    pub fn serves_at(&self) -> Option<&Coordinator> {
        self.bind.as_ref().or(self.coordinator.as_ref())
    }

    /// The one line a run without a secret says: on a network address (`--trusted-network`),
    /// anyone who reaches it; on loopback, any user of this host.
    pub fn warning(&self) -> Option<String> {
        let at = self.serves_at()?;
        if self.secret.is_set() {
            return None;
        }
        Some(if is_loopback(&at.host) {
            format!(
                "warning: the run has no secret: any user of this host can join the run at {at}, \
                 read what its processes exchange, or end it (give every process \
                 XTRAIN_RUN_TOKEN=$(xtrain run-token) to keep them out)"
            )
        } else {
            format!(
                "warning: the run has no secret (--trusted-network): any program that reaches \
                 {at} can join the run, read what its processes exchange, or end it"
            )
        })
    }
}

fn parse_count(text: &str, what: &str) -> Result<usize> {
    text.trim()
        .parse::<usize>()
        .ok()
        .with_context(|| format!("{what} must be a whole number, got {text:?}"))
}

/// The first host of a SLURM node list: `node[01-04],gpu7` -> `node01`, `a,b` -> `a`,
/// `rack[3,5-6]-n[1-2]` -> `rack3-n1`.
pub fn first_slurm_host(list: &str) -> Result<String> {
    let list = list.trim();
    let bad = || anyhow::anyhow!("SLURM_JOB_NODELIST {list:?} is not a SLURM node list");
    let mut host = String::new();
    let mut rest = list;
    loop {
        match rest.find(['[', ',']) {
            None => {
                host.push_str(rest);
                break;
            }
            Some(i) if rest.as_bytes()[i] == b',' => {
                host.push_str(&rest[..i]);
                break;
            }
            Some(i) => {
                host.push_str(&rest[..i]);
                let close = rest[i..].find(']').ok_or_else(bad)? + i;
                let first = rest[i + 1..close].split(',').next().unwrap_or("");
                let first = first.split('-').next().unwrap_or("").trim();
                if first.is_empty() || !first.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(bad());
                }
                host.push_str(first);
                rest = &rest[close + 1..];
            }
        }
    }
    if host.is_empty() {
        return Err(bad());
    }
    Ok(host)
}

/// One value and where it came from.
struct Found<T> {
    value: T,
    from: String,
}

/// What one launcher's environment says; `None` for what it does not say.
#[derive(Default)]
struct FromEnv {
    processes: Option<Found<String>>,
    process_id: Option<Found<String>>,
    host: Option<Found<String>>,
    port: Option<Found<String>>,
    run: Option<String>,
}

fn found(env: &dyn Fn(&str) -> Option<String>, name: &str) -> Option<Found<String>> {
    env(name)
        .filter(|v| !v.trim().is_empty())
        .map(|value| Found {
            value,
            from: name.to_string(),
        })
}

/// The launchers' environments, in the order they are asked.
fn environments(env: &dyn Fn(&str) -> Option<String>) -> Result<Vec<FromEnv>> {
    let mut all = Vec::new();
    all.push(FromEnv {
        processes: found(env, "XTRAIN_NUM_PROCESSES"),
        process_id: found(env, "XTRAIN_PROCESS_ID"),
        host: None,
        port: None,
        run: env("XTRAIN_RUN_ID"),
    });
    if let Some(c) = found(env, "XTRAIN_COORDINATOR") {
        let parsed = parse_coordinator(&c.value, "XTRAIN_COORDINATOR")?;
        all[0].host = Some(Found {
            value: parsed.host,
            from: c.from.clone(),
        });
        all[0].port = Some(Found {
            value: parsed.port.to_string(),
            from: c.from,
        });
    }
    // SLURM: one task per host (`srun --ntasks-per-node=1`).
    if let Some(id) = found(env, "SLURM_PROCID") {
        let host = match found(env, "SLURM_JOB_NODELIST").or_else(|| found(env, "SLURM_NODELIST")) {
            Some(list) => Some(Found {
                value: first_slurm_host(&list.value)?,
                from: format!("the first host of {}", list.from),
            }),
            None => None,
        };
        all.push(FromEnv {
            processes: found(env, "SLURM_NTASKS").or_else(|| found(env, "SLURM_NPROCS")),
            process_id: Some(id),
            host,
            port: found(env, "MASTER_PORT"),
            run: env("SLURM_JOB_ID").map(|j| format!("slurm-{j}")),
        });
    }
    // torchrun and the launchers that copy it (one process per host: --nproc-per-node=1).
    if let Some(rank) = found(env, "RANK") {
        all.push(FromEnv {
            processes: found(env, "WORLD_SIZE"),
            process_id: Some(rank),
            host: found(env, "MASTER_ADDR"),
            port: found(env, "MASTER_PORT"),
            run: env("TORCHELASTIC_RUN_ID"),
        });
    }
    // A Cloud TPU VM slice: every worker has the list of workers' host names.
    if let Some(id) = found(env, "TPU_WORKER_ID") {
        let hosts = found(env, "TPU_WORKER_HOSTNAMES");
        let list: Vec<String> = hosts
            .as_ref()
            .map(|h| {
                h.value
                    .split(',')
                    .map(|s| s.trim().to_string())
                    .filter(|s| !s.is_empty())
                    .collect()
            })
            .unwrap_or_default();
        if let Some(h) = hosts.as_ref().filter(|_| list.is_empty()) {
            bail!("{} {:?} names no host", h.from, h.value);
        }
        all.push(FromEnv {
            processes: hosts.as_ref().map(|h| Found {
                value: list.len().to_string(),
                from: format!("the {} hosts of {}", list.len(), h.from),
            }),
            process_id: Some(id),
            host: list.first().map(|first| Found {
                value: first.clone(),
                from: "the first host of TPU_WORKER_HOSTNAMES".into(),
            }),
            port: None,
            run: None,
        });
    }
    // A GKE indexed Job gives the index only: the count and process 0's address come from
    // flags (or XTRAIN_* variables in the Job's spec).
    if let Some(index) = found(env, "JOB_COMPLETION_INDEX") {
        all.push(FromEnv {
            process_id: Some(index),
            ..FromEnv::default()
        });
    }
    Ok(all)
}

/// This process's place in the run, from the flags and then the environment (`env` looks a
/// variable up: `|k| std::env::var(k).ok()` outside tests). A run of one process when nothing
/// says otherwise.
pub fn detect(flags: &LaunchFlags, env: &dyn Fn(&str) -> Option<String>) -> Result<Launch> {
    let envs = environments(env)?;
    let (processes, process_id) = counted(flags, &envs)?;
    if flags.virtual_hosts == Some(0) {
        bail!("--virtual-hosts must be at least 1");
    }
    let init_timeout = init_timeout(flags)?;
    let run = envs
        .iter()
        .find_map(|e| e.run.clone())
        .unwrap_or_else(|| "run".into());
    let sources = |extra: &[&str]| {
        let mut s: Vec<&str> = [processes.from.as_str(), process_id.from.as_str()]
            .into_iter()
            .chain(extra.iter().copied())
            .filter(|s| !s.is_empty())
            .collect();
        s.dedup();
        s.join(", ")
    };
    if processes.value > 1 && flags.virtual_hosts.is_some() {
        bail!(
            "--virtual-hosts is a test mode of one process; this is {} ({})",
            format_args!("process {} of {}", process_id.value, processes.value),
            sources(&[])
        );
    }
    if processes.value == 1 {
        if let Some(c) = &flags.coordinator {
            parse_coordinator(c, "--coordinator")?;
        }
        return Ok(Launch {
            init_timeout,
            run,
            source: if processes.from.is_empty() {
                "one process".into()
            } else {
                sources(&[])
            },
            notes: alone(flags, &processes.from),
            ..Launch::single()
        });
    }
    let coordinator = coordinator(flags, &envs, processes.value, &sources(&[]))?;
    let bind = match &flags.coordinator_bind {
        Some(b) => Some(parse_bind(b, coordinator.value.port)?),
        None => None,
    };
    let secret = crate::cluster::auth::from_launch(flags.run_token_file.as_deref(), env)?;
    for (at, what) in [
        (Some(&coordinator.value), "--coordinator"),
        (bind.as_ref(), "--coordinator-bind"),
    ] {
        if let Some(at) = at {
            refuse_untrusted(at, what, &secret, flags.trusted_network)?;
        }
    }
    Ok(Launch {
        processes: processes.value,
        process_id: process_id.value,
        source: sources(&[coordinator.from.as_str()]),
        coordinator: Some(coordinator.value),
        init_timeout,
        run,
        secret,
        trusted_network: flags.trusted_network,
        bind,
        notes: Vec::new(),
    })
}

/// How many processes the run has and which one this is: each from its flag, else the first
/// environment that has it, else 1 and 0; checked against each other.
fn counted(flags: &LaunchFlags, envs: &[FromEnv]) -> Result<(Found<usize>, Found<usize>)> {
    let number = |flag: Option<usize>,
                  name: &str,
                  pick: &dyn Fn(&FromEnv) -> Option<&Found<String>>,
                  default: usize|
     -> Result<Found<usize>> {
        Ok(match (flag, envs.iter().find_map(pick)) {
            (Some(n), _) => Found {
                value: n,
                from: name.into(),
            },
            (None, Some(f)) => Found {
                value: parse_count(&f.value, &f.from)?,
                from: f.from.clone(),
            },
            (None, None) => Found {
                value: default,
                from: String::new(),
            },
        })
    };
    let processes = number(
        flags.num_processes,
        "--num-processes",
        &|e| e.processes.as_ref(),
        1,
    )?;
    let mut process_id = number(
        flags.process_id,
        "--process-id",
        &|e| e.process_id.as_ref(),
        0,
    )?;
    if processes.from.is_empty() && process_id.from == "JOB_COMPLETION_INDEX" {
        // An indexed Job with no count given runs independent pods (a sweep): each is a run
        // of its own.
        process_id = Found {
            value: 0,
            from: String::new(),
        };
    }
    if processes.value == 0 {
        bail!("{} is 0: a run has at least one process", processes.from);
    }
    if processes.value > MAX_PROCESSES {
        bail!(
            "{} is {}: xtrain runs at most {MAX_PROCESSES} processes (one per host)",
            processes.from,
            processes.value
        );
    }
    if process_id.value >= processes.value {
        bail!(
            "the process id {} ({}) must be less than the number of processes {} ({}): ids run \
             from 0 to {}",
            process_id.value,
            or_default(&process_id.from),
            processes.value,
            or_default(&processes.from),
            processes.value - 1
        );
    }
    Ok((processes, process_id))
}

/// `--init-timeout`, within its range (1 s to [`MAX_INIT_TIMEOUT`]).
fn init_timeout(flags: &LaunchFlags) -> Result<Duration> {
    let t = flags.init_timeout.unwrap_or(DEFAULT_INIT_TIMEOUT);
    if t.is_zero() {
        bail!("--init-timeout must be at least 1 second");
    }
    if t > MAX_INIT_TIMEOUT {
        bail!(
            "--init-timeout {} is more than a day ({} s), the longest a process waits for the \
             others",
            t.as_secs(),
            MAX_INIT_TIMEOUT.as_secs()
        );
    }
    Ok(t)
}

/// What a run of one process says about the flags of a run of several it was given.
fn alone(flags: &LaunchFlags, count_from: &str) -> Vec<String> {
    let given: Vec<&str> = [
        ("--coordinator", flags.coordinator.is_some()),
        ("--process-id", flags.process_id.is_some()),
        ("--run-token-file", flags.run_token_file.is_some()),
        ("--coordinator-bind", flags.coordinator_bind.is_some()),
    ]
    .into_iter()
    .filter(|(_, g)| *g)
    .map(|(f, _)| f)
    .collect();
    if given.is_empty() || !count_from.is_empty() {
        return Vec::new();
    }
    vec![format!(
        "{} given, but no --num-processes (nor a launcher's count): this is a run of one \
         process, which meets no one",
        given.join(", ")
    )]
}

/// Where process 0 serves the store: `--coordinator`, else the launcher's host (and port, or
/// [`DEFAULT_PORT`]).
fn coordinator(
    flags: &LaunchFlags,
    envs: &[FromEnv],
    processes: usize,
    sources: &str,
) -> Result<Found<Coordinator>> {
    if let Some(c) = &flags.coordinator {
        return Ok(Found {
            value: parse_coordinator(c, "--coordinator")?,
            from: "--coordinator".into(),
        });
    }
    let Some(host) = envs.iter().find_map(|e| e.host.as_ref()) else {
        bail!(
            "a run of {processes} processes ({sources}) needs the address of process 0: pass \
             --coordinator HOST:PORT (process 0's host name and a free port), or set \
             MASTER_ADDR and MASTER_PORT"
        );
    };
    let port = match envs.iter().find_map(|e| e.port.as_ref()) {
        Some(p) => parse_port(p.value.trim(), &p.from)?,
        None => DEFAULT_PORT,
    };
    Ok(Found {
        value: Coordinator {
            host: host.value.clone(),
            port,
        },
        from: host.from.clone(),
    })
}

/// A store on a network address (`what` names the flag it comes from, which may be where it
/// binds) takes only processes that hold the run's secret, unless the user says the network is
/// the run's alone.
pub fn refuse_untrusted(c: &Coordinator, what: &str, secret: &Secret, trusted: bool) -> Result<()> {
    if secret.is_set() || trusted || is_loopback(&c.host) {
        return Ok(());
    }
    bail!(
        "the run's store would serve {c} ({what}) with no secret: any program that reaches it \
         could join, read or end the run. Give every process the same secret (export \
         XTRAIN_RUN_TOKEN=$(xtrain run-token) before starting them, or --run-token-file FILE), \
         or pass --trusted-network if only the run's hosts can reach {c}"
    )
}

fn or_default(from: &str) -> &str {
    if from.is_empty() {
        "the default"
    } else {
        from
    }
}

/// [`detect`] on this process's environment.
pub fn from_environment(flags: &LaunchFlags) -> Result<Launch> {
    // The secret's variable as the process was started with it: `main` took it out of the
    // environment, so that no program it starts inherits it.
    detect(flags, &|k| match k {
        "XTRAIN_RUN_TOKEN" => crate::cluster::auth::token_variable(),
        _ => std::env::var(k).ok(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A random secret (`xtrain run-token`'s form).
    const TOKEN: &str = "9f2c41e07ab35d6890e1c4b7f03a26d58c1e9b47a02f6d3e85b9c0174ad2e6f3";

    /// [`detect`] with these variables and, unless they say otherwise, the run's secret.
    fn with(vars: &[(&str, &str)], flags: &LaunchFlags) -> Result<Launch> {
        let mut map: std::collections::HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        map.entry("XTRAIN_RUN_TOKEN".into())
            .or_insert_with(|| TOKEN.into());
        map.retain(|_, v| !v.is_empty());
        detect(flags, &|k| map.get(k).cloned())
    }

    fn coord(host: &str, port: u16) -> Option<Coordinator> {
        Some(Coordinator {
            host: host.into(),
            port,
        })
    }

    #[test]
    fn nothing_said_is_one_process() {
        let l = with(&[], &LaunchFlags::default()).unwrap();
        assert_eq!(
            (l.processes, l.process_id, l.coordinator.clone()),
            (1, 0, None)
        );
        assert!(l.is_single());
    }

    #[test]
    fn flags_place_the_process() {
        let flags = LaunchFlags {
            num_processes: Some(4),
            process_id: Some(3),
            coordinator: Some("node01:1234".into()),
            init_timeout: Some(Duration::from_secs(9)),
            ..LaunchFlags::default()
        };
        let l = with(&[], &flags).unwrap();
        assert_eq!((l.processes, l.process_id), (4, 3));
        assert_eq!(l.coordinator, coord("node01", 1234));
        assert_eq!(l.init_timeout, Duration::from_secs(9));
        assert_eq!(l.source, "--num-processes, --process-id, --coordinator");
    }

    #[test]
    fn slurm_gives_rank_count_and_the_first_node() {
        let env = [
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_JOB_NODELIST", "gpu-node[07-10]"),
            ("SLURM_JOB_ID", "4242"),
        ];
        let l = with(&env, &LaunchFlags::default()).unwrap();
        assert_eq!((l.processes, l.process_id), (4, 1));
        assert_eq!(l.coordinator, coord("gpu-node07", DEFAULT_PORT));
        assert_eq!(l.run, "slurm-4242");
        assert!(l.source.contains("SLURM_NTASKS"), "{}", l.source);
    }

    #[test]
    fn slurm_node_lists_name_their_first_host() {
        for (list, first) in [
            ("node01", "node01"),
            ("a,b,c", "a"),
            ("node[01-04]", "node01"),
            ("node[3,5-6],other", "node3"),
            ("rack[2-3]-n[10-12]", "rack2-n10"),
        ] {
            assert_eq!(first_slurm_host(list).unwrap(), first, "{list}");
        }
        for bad in ["node[", "node[a-b]", "", "[]"] {
            let e = first_slurm_host(bad).unwrap_err().to_string();
            assert!(e.contains("SLURM_JOB_NODELIST"), "{bad}: {e}");
        }
    }

    #[test]
    fn torchrun_gives_rank_world_size_and_master() {
        let env = [
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "10.0.0.5"),
            ("MASTER_PORT", "29500"),
        ];
        let l = with(&env, &LaunchFlags::default()).unwrap();
        assert_eq!((l.processes, l.process_id), (2, 0));
        assert_eq!(l.coordinator, coord("10.0.0.5", 29500));
    }

    #[test]
    fn a_tpu_vm_counts_its_workers() {
        let env = [
            ("TPU_WORKER_ID", "2"),
            ("TPU_WORKER_HOSTNAMES", "t1v-0,t1v-1,t1v-2,t1v-3"),
        ];
        let l = with(&env, &LaunchFlags::default()).unwrap();
        assert_eq!((l.processes, l.process_id), (4, 2));
        assert_eq!(l.coordinator, coord("t1v-0", DEFAULT_PORT));
    }

    #[test]
    fn a_gke_indexed_job_gives_the_index_and_flags_the_rest() {
        let env = [("JOB_COMPLETION_INDEX", "5")];
        // No count given: the Job's pods are independent runs (a sweep), each of one process.
        let l = with(&env, &LaunchFlags::default()).unwrap();
        assert!(l.is_single(), "{l:?}");
        let counted = LaunchFlags {
            num_processes: Some(4),
            coordinator: Some("train-0.train:8476".into()),
            ..LaunchFlags::default()
        };
        let e = with(&env, &counted).unwrap_err().to_string();
        assert!(
            e.contains("process id 5 (JOB_COMPLETION_INDEX) must be less than the number of processes 4 (--num-processes)"),
            "{e}"
        );
        let flags = LaunchFlags {
            num_processes: Some(8),
            coordinator: Some("train-0.train:8476".into()),
            ..LaunchFlags::default()
        };
        let l = with(&env, &flags).unwrap();
        assert_eq!((l.processes, l.process_id), (8, 5));
        assert_eq!(l.coordinator, coord("train-0.train", 8476));
        let env = [
            ("JOB_COMPLETION_INDEX", "5"),
            ("XTRAIN_NUM_PROCESSES", "6"),
            ("XTRAIN_COORDINATOR", "train-0.train:9000"),
        ];
        let l = with(&env, &LaunchFlags::default()).unwrap();
        assert_eq!((l.processes, l.process_id), (6, 5));
        assert_eq!(l.coordinator, coord("train-0.train", 9000));
    }

    #[test]
    fn flags_win_over_the_environment() {
        let env = [("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h")];
        let flags = LaunchFlags {
            process_id: Some(0),
            ..LaunchFlags::default()
        };
        let l = with(&env, &flags).unwrap();
        assert_eq!((l.processes, l.process_id), (2, 0));
        assert_eq!(l.source, "WORLD_SIZE, --process-id, MASTER_ADDR");
    }

    #[test]
    fn inconsistent_values_are_refused_naming_them() {
        let flags = |n, k, c: &str| LaunchFlags {
            num_processes: n,
            process_id: k,
            coordinator: Some(c.to_string()),
            ..LaunchFlags::default()
        };
        type Case<'a> = (Vec<(&'a str, &'a str)>, LaunchFlags, &'a str);
        let cases: Vec<Case> = vec![
            (
                vec![],
                flags(Some(2), Some(2), "h:1"),
                "less than the number of processes 2",
            ),
            (
                vec![],
                flags(Some(0), Some(0), "h:1"),
                "--num-processes is 0",
            ),
            (vec![], flags(Some(2), Some(0), "h:0"), "from 1 to 65535"),
            (
                vec![],
                flags(Some(2), Some(0), "h:99999"),
                "from 1 to 65535",
            ),
            (vec![], flags(Some(2), Some(0), "h"), "expected HOST:PORT"),
            (vec![], flags(Some(2), Some(0), ":80"), "the host is empty"),
            (
                vec![("RANK", "x"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h")],
                LaunchFlags::default(),
                "RANK must be a whole number",
            ),
            (
                vec![("RANK", "3"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h")],
                LaunchFlags::default(),
                "process id 3 (RANK)",
            ),
            (
                vec![
                    ("RANK", "1"),
                    ("WORLD_SIZE", "2"),
                    ("MASTER_ADDR", "h"),
                    ("MASTER_PORT", "http"),
                ],
                LaunchFlags::default(),
                "MASTER_PORT: the port must be",
            ),
            (
                vec![("RANK", "1"), ("WORLD_SIZE", "2")],
                LaunchFlags::default(),
                "needs the address of process 0",
            ),
            (
                vec![("TPU_WORKER_ID", "0"), ("TPU_WORKER_HOSTNAMES", ",,")],
                LaunchFlags::default(),
                "TPU_WORKER_HOSTNAMES \",,\" names no host",
            ),
        ];
        for (env, f, want) in cases {
            let e = format!("{:#}", with(&env, &f).unwrap_err());
            assert!(e.contains(want), "{env:?} {f:?}: {e}");
        }
        let zero = LaunchFlags {
            init_timeout: Some(Duration::ZERO),
            ..LaunchFlags::default()
        };
        assert!(with(&[], &zero)
            .unwrap_err()
            .to_string()
            .contains("--init-timeout"));
        // The largest a user can type is refused by name, not an overflow later.
        let huge = LaunchFlags {
            init_timeout: Some(Duration::from_secs(i64::MAX as u64)),
            ..LaunchFlags::default()
        };
        let e = with(&[], &huge).unwrap_err().to_string();
        assert!(
            e.contains("--init-timeout 9223372036854775807 is more than a day (86400 s)"),
            "{e}"
        );
    }

    /// A store on a network address needs the run's secret (or --trusted-network); on
    /// loopback it runs without; the secret is read from --run-token-file before the variable.
    #[test]
    fn a_network_coordinator_needs_a_secret_or_a_trusted_network() {
        let flags = |c: &str, trusted| LaunchFlags {
            num_processes: Some(2),
            process_id: Some(1),
            coordinator: Some(c.into()),
            trusted_network: trusted,
            ..LaunchFlags::default()
        };
        let none = [("XTRAIN_RUN_TOKEN", "")];
        let e = with(&none, &flags("node01:8476", false))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("the run's store would serve node01:8476 (--coordinator) with no secret")
                && e.contains("--trusted-network"),
            "{e}"
        );
        let trusted = with(&none, &flags("node01:8476", true)).unwrap();
        assert!(!trusted.secret.is_set());
        assert!(trusted.warning().unwrap().contains("node01:8476"));
        for local in ["127.0.0.1:9", "localhost:9", "[::1]:9"] {
            let l = with(&none, &flags(local, false)).unwrap();
            let w = l.warning().unwrap();
            assert!(
                w.contains("any user of this host") && !l.secret.is_set(),
                "{local}: {w}"
            );
        }
        // The bind is checked as the coordinator is: a wildcard without a secret is refused.
        for bind in ["0.0.0.0", "0.0.0.0:9", "[::]", "10.1.2.3"] {
            let wild = LaunchFlags {
                coordinator_bind: Some(bind.into()),
                ..flags("127.0.0.1:9", false)
            };
            let e = with(&none, &wild).unwrap_err().to_string();
            assert!(
                e.contains("(--coordinator-bind) with no secret"),
                "{bind}: {e}"
            );
        }
        let bound = LaunchFlags {
            coordinator_bind: Some("127.0.0.2".into()),
            ..flags("127.0.0.1:9", false)
        };
        assert_eq!(with(&none, &bound).unwrap().bind, coord("127.0.0.2", 9));
        let l = with(&[], &flags("node01:8476", false)).unwrap();
        assert!(l.secret.is_set() && l.warning().is_none());
        assert_eq!(format!("{:?}", l.secret), "Secret(set)");
        let dir = std::env::temp_dir().join(format!("xtrain-token-{}", std::process::id()));
        std::fs::write(&dir, "short\n").unwrap();
        let from_file = LaunchFlags {
            run_token_file: Some(dir.clone()),
            ..flags("node01:8476", false)
        };
        let e = with(&[], &from_file).unwrap_err().to_string();
        assert!(
            e.contains("is not a random secret") && !e.contains("short"),
            "{e}"
        );
        std::fs::remove_file(&dir).unwrap();
    }

    #[test]
    fn flags_of_a_run_of_several_without_a_count_get_a_note() {
        let flags = LaunchFlags {
            coordinator: Some("127.0.0.1:9".into()),
            process_id: Some(0),
            ..LaunchFlags::default()
        };
        let l = with(&[], &flags).unwrap();
        assert!(l.is_single());
        assert_eq!(
            l.notes,
            [
                "--coordinator, --process-id given, but no --num-processes (nor a launcher's \
              count): this is a run of one process, which meets no one"
            ]
        );
    }

    #[test]
    fn ipv6_coordinators_keep_their_brackets() {
        let c = parse_coordinator("[fe80::1]:8476", "--coordinator").unwrap();
        assert_eq!(
            c,
            Coordinator {
                host: "fe80::1".into(),
                port: 8476
            }
        );
        assert_eq!(c.to_string(), "[fe80::1]:8476");
        let e = parse_coordinator("::1:8476", "--coordinator")
            .unwrap_err()
            .to_string();
        assert!(e.contains("[::1]:8476"), "{e}");
        assert_eq!(
            parse_bind("::", 9).unwrap(),
            Coordinator {
                host: "::".into(),
                port: 9
            }
        );
        assert!(parse_bind("h:port", 9).is_err());
    }
}
