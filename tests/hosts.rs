//! Runs of several processes on loopback, each a real `xtrain train` as a launcher starts it:
//! they meet through process 0's store, refuse a process started with other settings (before
//! any plugin is opened), end when a process is missing or killed (within `--init-timeout`,
//! naming it), and on the CPU plugin refuse to run a step across processes once they have met.

mod common;
use common::*;
use std::io::{BufRead, BufReader};
use std::process::{Child, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// One process of a run, its stderr collected as it comes.
struct Process {
    child: Child,
    stderr: Arc<Mutex<String>>,
}

impl Process {
    fn said(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    /// Wait (up to `limit`) until its stderr holds `text`.
    fn wait_to_say(&self, text: &str, limit: Duration) {
        let start = Instant::now();
        while !self.said().contains(text) {
            assert!(
                start.elapsed() < limit,
                "no {text:?} within {limit:?}:\n{}",
                self.said()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Wait for it to end (at most `limit`, else it is killed and the test fails); the exit
    /// status's success, what it said, and how long it took.
    fn end(mut self, limit: Duration) -> (bool, String, Duration) {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                // Let the reader thread take the last lines.
                std::thread::sleep(Duration::from_millis(100));
                return (status.success(), self.said(), start.elapsed());
            }
            if start.elapsed() > limit {
                let _ = self.child.kill();
                panic!("still running after {limit:?}:\n{}", self.said());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Start process `id` of `count` with the tiny model's pre-tokenized batch; `extra` flags are
/// added, `env` variables set.
fn start(
    out: &std::path::Path,
    port: u16,
    flags: &[&str],
    extra: &[&str],
    env: &[(&str, &str)],
) -> Process {
    let data = fixtures().join("inputs.safetensors");
    start_with(&data, out, port, flags, extra, env)
}

/// [`start`] with another data file.
fn start_with(
    data: &std::path::Path,
    out: &std::path::Path,
    port: u16,
    flags: &[&str],
    extra: &[&str],
    env: &[(&str, &str)],
) -> Process {
    let f = fixtures();
    let mut c = train_cmd(&f.join("model"), data, out);
    c.args(["--lora-r", "8", "--lora-alpha", "16", "--steps", "1"])
        // The CPU plugin unless `extra` names another.
        .args(
            ["--plugin", "cpu"]
                .iter()
                .filter(|_| !extra.contains(&"--plugin")),
        )
        .args(
            ["--coordinator".to_string(), format!("127.0.0.1:{port}")]
                .iter()
                .filter(|_| !extra.contains(&"--coordinator")),
        )
        .args(flags)
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    for (k, v) in env {
        c.env(k, v);
    }
    let mut child = c.spawn().unwrap();
    let pipe = child.stderr.take().unwrap();
    let stderr = Arc::new(Mutex::new(String::new()));
    let sink = stderr.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(pipe).lines().map_while(Result::ok) {
            let mut s = sink.lock().unwrap();
            s.push_str(&line);
            s.push('\n');
        }
    });
    Process { child, stderr }
}

/// Processes 0 and 1 of a run of two (60 s to meet), each with `extra`, writing under `out`.
fn both(out: &std::path::Path, port: u16, extra: &[&str]) -> Vec<Process> {
    (0..2)
        .map(|k| start(out, port, &refs(&placed(k, 2, 60)), extra, &[]))
        .collect()
}

/// Waits for each process of a run of two, checking that it met the other (the same settings);
/// what each said.
fn met(processes: impl IntoIterator<Item = Process>) -> Vec<String> {
    let said = |p: Process| {
        let (_, said, _) = p.end(Duration::from_secs(60));
        assert!(
            said.contains("all 2 processes run the same settings"),
            "{said}"
        );
        said
    };
    processes.into_iter().map(said).collect()
}

fn placed(id: usize, count: usize, timeout: u64) -> Vec<String> {
    vec![
        "--num-processes".into(),
        count.to_string(),
        "--process-id".into(),
        id.to_string(),
        "--init-timeout".into(),
        timeout.to_string(),
    ]
}

#[test]
fn processes_meet_and_the_cpu_plugin_refuses_to_run_a_step_across_them() {
    let dir = tempdir("hosts-meet");
    let port = free_port();
    // Process 1 is placed by torchrun's variables and starts first: it waits for process 0.
    let one = start(
        &dir.join("out"),
        port,
        &["--init-timeout", "60"],
        &[],
        &[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", &port.to_string()),
        ],
    );
    std::thread::sleep(Duration::from_millis(500));
    let zero = start(&dir.join("out"), port, &refs(&placed(0, 2, 60)), &[], &[]);
    for (p, k) in [(zero, 0), (one, 1)] {
        let (ok, said, took) = p.end(Duration::from_secs(60));
        assert!(!ok, "process {k} succeeded:\n{said}");
        assert!(
            said.contains(&format!(
                "process {k} of 2 joined the run at 127.0.0.1:{port}"
            )),
            "{said}"
        );
        assert!(
            said.contains("all 2 processes run the same settings"),
            "{said}"
        );
        assert!(
            said.contains("error: the CPU plugin cannot run a step across processes"),
            "{said}"
        );
        assert!(
            !said.contains("left the run") && !said.contains("panicked"),
            "{said}"
        );
        assert!(took < Duration::from_secs(30), "{took:?}");
    }
    assert!(
        !dir.join("out").exists(),
        "nothing is written before the processes can train"
    );
}

#[test]
fn a_process_started_with_other_settings_is_refused_by_every_process() {
    let dir = tempdir("hosts-mismatch");
    let port = free_port();
    let zero = start(&dir.join("out"), port, &refs(&placed(0, 2, 60)), &[], &[]);
    let one = start(
        &dir.join("out"),
        port,
        &refs(&placed(1, 2, 60)),
        &["--lr", "0.001"],
        &[],
    );
    let (ok0, said0, _) = zero.end(Duration::from_secs(60));
    let (ok1, said1, _) = one.end(Duration::from_secs(60));
    assert!(!ok0 && !ok1);
    assert!(
        said0.contains("process 1 (on") && said0.contains("--lr 0.001 there, 0.0002 here"),
        "{said0}"
    );
    assert!(said1.contains("--lr 0.0002 there, 0.001 here"), "{said1}");
    for said in [said0, said1] {
        // Refused before any plugin is opened.
        assert!(
            !said.contains("CPU plugin") && !said.contains("client"),
            "{said}"
        );
    }
}

/// The run's secret from the environment: processes that hold it meet; one given another is
/// refused on its own connection, and the secret appears in nothing either says.
#[test]
fn processes_meet_over_their_secret_and_one_without_it_is_refused() {
    let dir = tempdir("hosts-secret");
    let port = free_port();
    let token = "0f5e1d2c3b4a59687766554433221100ffeeddccbbaa9e8d7c6b5a4938271605";
    let env = [("XTRAIN_RUN_TOKEN", token)];
    let zero = start(&dir.join("out"), port, &refs(&placed(0, 2, 60)), &[], &env);
    zero.wait_to_say("joined the run", Duration::from_secs(30));
    let wrong = [(
        "XTRAIN_RUN_TOKEN",
        "7c1a9e3f5b2d4068a1c3e5f7092b4d6f81a3c5e7f9b2d4f6a8c0e2b4d6f81a3c",
    )];
    let stranger = start(
        &dir.join("out2"),
        port,
        &refs(&placed(1, 2, 60)),
        &[],
        &wrong,
    );
    let (ok, said, _) = stranger.end(Duration::from_secs(60));
    assert!(!ok);
    assert!(said.contains("does not hold the run's secret"), "{said}");
    let one = start(&dir.join("out"), port, &refs(&placed(1, 2, 60)), &[], &env);
    for said in met([zero, one]) {
        assert!(!said.contains(token), "the secret was shown:\n{said}");
    }
}

/// Two hosts whose copies of the data file at the same path differ (here: the file changes at
/// its end between process 0's start and process 1's) are refused before any step, naming the
/// data file.
#[test]
fn hosts_whose_data_files_differ_are_refused() {
    let dir = tempdir("hosts-data");
    let port = free_port();
    let bytes = std::fs::read(fixtures().join("inputs.safetensors")).unwrap();
    let data = dir.join("data.safetensors");
    std::fs::write(&data, &bytes).unwrap();
    let out = dir.join("out");
    let flags = |k| placed(k, 2, 60);
    let zero = start_with(&data, &out, port, &refs(&flags(0)), &[], &[]);
    zero.wait_to_say("joined the run", Duration::from_secs(30));
    std::thread::sleep(Duration::from_millis(500));
    let mut changed = bytes.clone();
    *changed.last_mut().unwrap() ^= 1;
    std::fs::write(&data, &changed).unwrap();
    let one = start_with(&data, &out, port, &refs(&flags(1)), &[], &[]);
    for p in [zero, one] {
        let (ok, said, _) = p.end(Duration::from_secs(60));
        assert!(!ok);
        assert!(
            said.contains("the data file (its size, and a hash of its first and last MiB)"),
            "{said}"
        );
    }
}

/// The CPU plugin under another file name is refused as well, from what its client spans (its
/// devices are this process's alone), not from its name: no run of two where each process
/// computes everything alone.
#[test]
fn a_renamed_cpu_plugin_is_refused_from_its_topology() {
    let dir = tempdir("hosts-renamed");
    let port = free_port();
    // The plugin as xtrain finds it (installed on first use), under another name: a hard link
    // where the cache and the temp dir share a file system (a copy is 250 MB), else a copy.
    let original = pjrt::discover::resolve_or_install(Some("cpu")).expect("the CPU plugin");
    let renamed = dir.join("libmy_accelerator.so");
    if std::fs::hard_link(&original, &renamed).is_err() {
        std::fs::copy(&original, &renamed).unwrap();
    }
    let plugin = renamed.to_str().unwrap();
    let processes = both(&dir.join("out"), port, &["--plugin", plugin]);
    let mut refused = 0;
    for p in processes {
        let (ok, said, _) = p.end(Duration::from_secs(120));
        assert!(!ok, "a run of two on a client of one process ran:\n{said}");
        assert!(!said.contains("panicked"), "{said}");
        // The first to stop may end the other as a lost process before it says so itself.
        refused += said.contains("client spans only this process's") as usize;
    }
    assert!(refused >= 1, "no process said why");
}

/// Process 1 started with another secret gives up at its handshake; process 0, whose run never
/// meets, says after its --init-timeout that a process with another secret is turned away.
#[test]
fn a_run_whose_processes_hold_other_secrets_says_so_at_its_timeout() {
    let dir = tempdir("hosts-other-secret");
    let port = free_port();
    let mine = [(
        "XTRAIN_RUN_TOKEN",
        "3e9a1f7c5b0d2e4a6c8f1b3d5e7a9c0f2b4d6e8a1c3f5b7d9e0a2c4f6b8d1e3a",
    )];
    let theirs = [(
        "XTRAIN_RUN_TOKEN",
        "a4c6e8f0b2d41a3c5e7f9b0d2f4a6c8e1b3d5f7a9c2e4b6d8f0a1c3e5b7d9f21",
    )];
    let zero = start(&dir.join("out"), port, &refs(&placed(0, 2, 3)), &[], &mine);
    std::thread::sleep(Duration::from_millis(300));
    let one = start(
        &dir.join("out"),
        port,
        &refs(&placed(1, 2, 3)),
        &[],
        &theirs,
    );
    let (ok, said, _) = one.end(Duration::from_secs(60));
    assert!(
        !ok && said.contains("does not hold the run's secret"),
        "{said}"
    );
    let (ok, said, _) = zero.end(Duration::from_secs(60));
    assert!(!ok, "{said}");
    assert!(
        said.contains("DEADLINE_EXCEEDED")
            && said.contains("whose first message did not open under the run's secret")
            && said.contains("from 127.0.0.1"),
        "{said}"
    );
    for (_, token) in [mine[0], theirs[0]] {
        assert!(!said.contains(token), "a secret was shown:\n{said}");
    }
}

/// Behind NAT: the coordinator's address (here TEST-NET-1's 192.0.2.1, which routes nowhere) is
/// one this host is not reached at, and process 0 serves the store where `--coordinator-bind`
/// says; it joins its own store there, not through the coordinator's address.
#[test]
fn process_0_joins_its_store_where_it_binds_it() {
    let dir = tempdir("hosts-bind");
    let port = free_port();
    let env = [(
        "XTRAIN_RUN_TOKEN",
        "5d7f9a1c3e5b7d9f0a2c4e6b8d0f1a3c5e7b9d2f4a6c8e0b1d3f5a7c9e2b4d6f",
    )];
    let routed = format!("192.0.2.1:{port}");
    let bound = format!("127.0.0.1:{port}");
    let extra = ["--coordinator", &routed, "--coordinator-bind", &bound];
    let zero = start(
        &dir.join("out"),
        port,
        &refs(&placed(0, 2, 60)),
        &extra,
        &env,
    );
    let one = start(&dir.join("out"), port, &refs(&placed(1, 2, 60)), &[], &env);
    met([zero, one]);
}

/// A coordinator on an IPv6 address: process 0 serves the store there (and only there) and
/// both processes meet through it.
#[test]
fn processes_meet_at_an_ipv6_coordinator() {
    let dir = tempdir("hosts-ipv6");
    let port = std::net::TcpListener::bind("[::1]:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let at = format!("[::1]:{port}");
    let extra = ["--coordinator", at.as_str()];
    for said in met(both(&dir.join("out"), port, &extra)) {
        assert!(said.contains(&format!("joined the run at {at}")), "{said}");
    }
}

/// SIGTERM (as `scancel`, Kubernetes and `timeout` send) while a process waits for the others
/// ends it at once with 143, whatever --init-timeout says.
#[test]
fn sigterm_during_the_rendezvous_ends_a_process_at_once() {
    use std::os::unix::process::ExitStatusExt;
    let dir = tempdir("hosts-sigterm");
    let port = free_port();
    let mut zero = start(&dir.join("out"), port, &refs(&placed(0, 2, 3600)), &[], &[]);
    zero.wait_to_say("joined the run", Duration::from_secs(30));
    std::thread::sleep(Duration::from_millis(300));
    let t0 = Instant::now();
    // SAFETY: a signal to the child this test started.
    unsafe { libc::kill(zero.child.id() as i32, libc::SIGTERM) };
    let status = zero.child.wait().unwrap();
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    assert_eq!(status.code(), Some(143), "{status:?} {:?}", status.signal());
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        zero.said().contains("SIGTERM: ending now"),
        "{}",
        zero.said()
    );
}

#[test]
fn a_process_that_never_comes_ends_the_others_within_the_init_timeout() {
    let dir = tempdir("hosts-missing");
    let port = free_port();
    let zero = start(&dir.join("out"), port, &refs(&placed(0, 2, 3)), &[], &[]);
    let (ok, said, took) = zero.end(Duration::from_secs(30));
    assert!(!ok);
    assert!(
        said.contains("error: DEADLINE_EXCEEDED: process 1 of 2 did not join the run")
            && said.contains("--init-timeout 3 s"),
        "{said}"
    );
    assert!(took < Duration::from_secs(3 + 10), "{took:?}");
}

#[test]
fn a_killed_process_ends_every_other_process() {
    let dir = tempdir("hosts-killed");
    let port = free_port();
    // Three processes, of which two start: both wait for the third (a long timeout) when
    // process 1 is killed.
    let zero = start(&dir.join("out"), port, &refs(&placed(0, 3, 120)), &[], &[]);
    let mut one = start(&dir.join("out"), port, &refs(&placed(1, 3, 120)), &[], &[]);
    one.wait_to_say("joined the run", Duration::from_secs(30));
    zero.wait_to_say("joined the run", Duration::from_secs(30));
    one.child.kill().unwrap();
    let _ = one.child.wait();
    let (ok, said, took) = zero.end(Duration::from_secs(30));
    assert!(!ok);
    assert!(
        said.contains("process 1 (on") && said.contains("left the run without finishing"),
        "{said}"
    );
    assert!(said.contains("Ending process 0 of 3 too"), "{said}");
    assert!(took < Duration::from_secs(10), "{took:?}");
}

#[test]
fn a_killed_coordinator_ends_every_other_process() {
    let dir = tempdir("hosts-killed-zero");
    let port = free_port();
    let mut zero = start(&dir.join("out"), port, &refs(&placed(0, 3, 120)), &[], &[]);
    let one = start(&dir.join("out"), port, &refs(&placed(1, 3, 120)), &[], &[]);
    one.wait_to_say("joined the run", Duration::from_secs(30));
    zero.child.kill().unwrap();
    let _ = zero.child.wait();
    let (ok, said, took) = one.end(Duration::from_secs(30));
    assert!(!ok);
    assert!(
        said.contains("process 0 (the coordinator at 127.0.0.1:"),
        "{said}"
    );
    assert!(took < Duration::from_secs(10), "{took:?}");
}

#[test]
fn inconsistent_launch_values_are_refused_before_anything_starts() {
    let f = fixtures();
    let dir = tempdir("hosts-flags");
    let base = [
        "train",
        "--model",
        f.join("model").to_str().unwrap(),
        "--data",
        f.join("inputs.safetensors").to_str().unwrap(),
        "--out",
        dir.join("out").to_str().unwrap(),
    ]
    .map(String::from)
    .to_vec();
    for (extra, want) in [
        (
            vec![
                "--num-processes",
                "2",
                "--process-id",
                "2",
                "--coordinator",
                "h:1",
            ],
            "must be less than the number of processes 2",
        ),
        (
            vec![
                "--num-processes",
                "2",
                "--process-id",
                "0",
                "--coordinator",
                "h:70000",
            ],
            "from 1 to 65535",
        ),
        (
            vec!["--num-processes", "2", "--process-id", "0"],
            "needs the address of process 0",
        ),
        (
            vec![
                "--num-processes",
                "2",
                "--process-id",
                "0",
                "--coordinator",
                "127.0.0.1:9",
                "--init-timeout",
                "9223372036854775807",
            ],
            "--init-timeout 9223372036854775807 is more than a day",
        ),
        (
            vec![
                "--num-processes",
                "2",
                "--process-id",
                "0",
                "--coordinator",
                "192.0.2.1:9",
            ],
            "with no secret",
        ),
    ] {
        let mut args = base.clone();
        args.extend(extra.iter().map(|s| s.to_string()));
        let e = fails(&refs(&args));
        assert!(e.contains(want), "{extra:?}: {e}");
    }
}

/// A program dir is run by every process of the run: they agree on its program (by hash) and
/// meet; the CPU plugin then refuses as for a step built here.
#[test]
fn processes_running_a_program_dir_meet_over_its_program() {
    let f = fixtures();
    let dir = tempdir("hosts-program");
    let prog = dir.join("prog");
    let o = xtrain(&[
        "compile",
        "--model",
        f.join("model").to_str().unwrap(),
        "--batch",
        "2",
        "--seq",
        "16",
        "--lora-r",
        "8",
        "--lora-alpha",
        "16",
        "--mesh",
        "fsdp=2",
        "--out",
        prog.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let port = free_port();
    let program = ["--program", prog.to_str().unwrap()];
    for p in both(&dir.join("out"), port, &program) {
        let (ok, said, _) = p.end(Duration::from_secs(60));
        assert!(!ok);
        assert!(
            said.contains("all 2 processes run the same settings"),
            "{said}"
        );
        assert!(
            said.contains("the CPU plugin cannot run a step across processes"),
            "{said}"
        );
    }
}

/// A run of the tiny model's pre-tokenized batch on the CPU for `steps` steps (a fixed seed).
fn tiny_cmd(out: &std::path::Path, steps: &str) -> std::process::Command {
    let f = fixtures();
    let mut c = train_cmd(&f.join("model"), &f.join("inputs.safetensors"), out);
    c.args(["--lora-r", "8", "--lora-alpha", "16", "--steps", steps])
        .args(["--lr", "1e-3", "--no-plot"]);
    c
}

/// Run `cmd` (a training run into `out`, with `flags`), which must succeed; its stderr, losses
/// and final adapter bytes.
fn outcome(
    mut cmd: std::process::Command,
    out: &std::path::Path,
    flags: &[&str],
) -> (String, Vec<f64>, Vec<u8>) {
    let o = cmd.args(flags).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(o.status.success(), "{flags:?}:\n{err}");
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let losses = metrics
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v["loss"].as_f64())
        .collect();
    let adapter = std::fs::read(out.join("adapter/adapter_model.safetensors")).unwrap();
    (err, losses, adapter)
}

/// One run of the tiny model on the CPU (2 steps, a fixed seed); its stderr, losses and final
/// adapter bytes.
fn tiny_run(out: &std::path::Path, flags: &[&str]) -> (String, Vec<f64>, Vec<u8>) {
    let mut cmd = tiny_cmd(out, "2");
    cmd.args(["--log-every", "1"]);
    outcome(cmd, out, flags)
}

/// `--virtual-hosts 2`: the devices split into two hosts, each reading only its own weight
/// slices and batch rows, gives the one-host run bit for bit, on fsdp, tensor, mixed and context
/// meshes (the tiny model's batch of 2 rows; on `context=2` each host takes every row and its
/// half of the sequence).
#[test]
fn virtual_hosts_equal_the_one_host_run_bit_for_bit() {
    let dir = tempdir("hosts-virtual");
    for mesh in [
        "fsdp=2",
        "tensor=2",
        "fsdp=2,tensor=2",
        "fsdp=4",
        "context=2",
    ] {
        let name = mesh.replace([',', '='], "-");
        let (_, one_losses, one_adapter) =
            tiny_run(&dir.join(format!("one-{name}")), &["--mesh", mesh]);
        let (err, losses, adapter) = tiny_run(
            &dir.join(format!("two-{name}")),
            &["--mesh", mesh, "--virtual-hosts", "2"],
        );
        assert_eq!(losses.len(), 2, "{err}");
        assert_eq!(losses, one_losses, "--mesh {mesh}");
        assert!(adapter == one_adapter, "--mesh {mesh}: the adapters differ");
        assert!(err.contains("virtual host 1 of 2"), "{err}");
        assert!(
            err.contains("--virtual-hosts 2: each host hands its shards of the LoRA state"),
            "{err}"
        );
    }
}

/// Each virtual host reads only the frozen weights its devices hold: on `fsdp=4` over two hosts,
/// half each (2026-12-04: 279168 of 558336 bytes each; a weight every device held whole would be
/// read by both, hence the range).
#[test]
fn each_virtual_host_reads_about_its_share_of_the_frozen_weights() {
    let dir = tempdir("hosts-virtual-bytes");
    let (err, _, _) = tiny_run(
        &dir.join("run"),
        &["--mesh", "fsdp=4", "--virtual-hosts", "2"],
    );
    let mut reads = Vec::new();
    let mut total = 0u64;
    for line in err.lines().filter(|l| l.contains("virtual host")) {
        // "virtual host G of 2 (devices A-B) read N of the T bytes of frozen weights"
        let words: Vec<&str> = line.split_whitespace().collect();
        let at = words.iter().position(|w| *w == "read").unwrap();
        reads.push(words[at + 1].parse::<u64>().unwrap());
        total = words[at + 4].parse().unwrap();
    }
    assert_eq!(reads.len(), 2, "{err}");
    eprintln!("bytes of frozen weights read per virtual host: {reads:?} of {total}");
    for r in &reads {
        let share = *r as f64 / total as f64;
        assert!((0.5..0.6).contains(&share), "{reads:?} of {total}: {share}");
    }
    assert!(reads.iter().sum::<u64>() >= total);
}

/// A process of a run as a checkpoint's commit sees it: barriers through the run's store.
struct Member {
    store: xtrain::cluster::store::Store,
    process: usize,
    timeout: Duration,
}

impl xtrain::train::checkpoint::Team for Member {
    fn process(&self) -> usize {
        self.process
    }

    fn processes(&self) -> usize {
        2
    }

    fn barrier(&self, name: &str) -> anyhow::Result<()> {
        Ok(self.store.barrier(name, self.timeout)?)
    }
}

/// Who process `process` of a run without a secret (on loopback) is to its store.
fn as_process(process: usize) -> xtrain::cluster::store::Credentials {
    xtrain::cluster::store::Credentials {
        process,
        secret: xtrain::cluster::auth::Secret::none(),
    }
}

/// Checkpoint `dir` as process 0 writes it in a run of several (before its commit).
fn write_uncommitted(dir: &std::path::Path) -> anyhow::Result<()> {
    xtrain::formats::atomic::write_dir_atomic(dir, |tmp| {
        std::fs::write(tmp.join("trainer_state.json"), "{}")?;
        std::fs::write(tmp.join("processes.json"), r#"{"processes": 2}"#)?;
        Ok(())
    })
}

/// The commit protocol over a real store, two processes (threads): a checkpoint both reach is
/// committed; one whose second process is gone before the barrier is written by process 0 but
/// never committed, and then skipped (said) by the newest-checkpoint search and refused by
/// `--resume`, which names the newest committed one.
#[test]
fn a_checkpoint_counts_only_once_every_process_passed_its_barrier() {
    use xtrain::cluster::server::{Config, StoreServer};
    use xtrain::cluster::{auth::Secret, store::Store};
    use xtrain::train::checkpoint::{commit_across, is_committed, latest_checkpoint, read_state};
    let dir = tempdir("hosts-commit");
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = format!("127.0.0.1:{}", listener.local_addr().unwrap().port());
    let _server = StoreServer::serve(listener, Config::new(2, Secret::none())).unwrap();
    let member = |process: usize, timeout_ms: u64| Member {
        store: Store::connect(
            &address,
            "commit",
            as_process(process),
            Duration::from_secs(5),
        )
        .unwrap(),
        process,
        timeout: Duration::from_millis(timeout_ms),
    };
    let (first, second) = (dir.join("checkpoint-1"), dir.join("checkpoint-2"));
    let one = member(1, 10_000);
    let other = std::thread::spawn(move || {
        // Process 1 writes nothing; it only meets process 0 at the barrier.
        commit_across(std::path::Path::new("unused"), 1, &one, || {
            panic!("process 1 does not write")
        })
    });
    commit_across(&first, 1, &member(0, 10_000), || write_uncommitted(&first)).unwrap();
    other.join().unwrap().unwrap();
    assert!(is_committed(&first) && first.join("committed.json").is_file());
    // Process 1 is gone before step 2's barrier: process 0 wrote it, but it does not count.
    let e = commit_across(&second, 2, &member(0, 300), || write_uncommitted(&second)).unwrap_err();
    let e = format!("{e:#}");
    assert!(
        e.contains("checkpoint-2 is not committed: not every process reached it"),
        "{e}"
    );
    assert!(e.contains("process 1 did not arrive"), "{e}");
    assert!(second.join("trainer_state.json").is_file() && !is_committed(&second));
    assert_eq!(latest_checkpoint(&dir), Some(first.clone()));
    let e = read_state(&second).unwrap_err().to_string();
    assert!(e.contains("checkpoint-2 is not committed"), "{e}");
    assert!(
        e.contains(&format!(
            "The newest committed checkpoint is {}",
            first.display()
        )),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A one-process run commits each checkpoint by its atomic rename, with the marker inside; a
/// checkpoint of a run of several without its marker is refused at `--resume` (naming the
/// committed one before it), and one with no marker at all, as xtrain wrote before markers,
/// still resumes.
#[test]
fn resume_skips_an_uncommitted_checkpoint_and_takes_one_from_before_markers() {
    let dir = tempdir("hosts-resume-commit");
    let out = dir.join("run");
    let o = tiny_cmd(&out, "4")
        .args(["--save-every", "1", "--stop-after", "2", "--log-every", "0"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let (first, second) = (out.join("checkpoint-1"), out.join("checkpoint-2"));
    for c in [&first, &second] {
        assert!(c.join("committed.json").is_file(), "{}", c.display());
        assert!(!c.join("processes.json").exists(), "{}", c.display());
    }
    // As a run of several leaves it when a process dies before the barrier.
    std::fs::remove_file(second.join("committed.json")).unwrap();
    std::fs::write(second.join("processes.json"), r#"{"processes": 2}"#).unwrap();
    let o = xtrain(&["train", "--resume", second.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(!o.status.success(), "{err}");
    assert!(err.contains("checkpoint-2 is not committed"), "{err}");
    assert!(
        err.contains("checkpoint-2 is not committed (a process of its run ended"),
        "{err}"
    );
    assert!(
        err.contains(&format!(
            "The newest committed checkpoint is {}",
            first.display()
        )),
        "{err}"
    );
    // As xtrain wrote it before markers: its rename committed it.
    std::fs::remove_file(second.join("processes.json")).unwrap();
    let o = xtrain(&["train", "--resume", second.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(o.status.success(), "{err}");
    assert!(
        out.join("adapter/adapter_model.safetensors").is_file(),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--virtual-hosts 2` on rows read in a seeded order: each virtual host loads the data itself
/// (its own loader, as a separate host would) and takes its own rows of each batch; over more
/// than an epoch (6 rows in batches of 2, 8 steps) the run equals the one-host run bit for bit,
/// and so do its evaluations (each host uploading its rows of each evaluation batch, at steps
/// 0, 4 and 8), on an fsdp mesh (each host its own rows) and a context mesh (every row, each
/// host its half of the sequence).
#[test]
fn virtual_hosts_with_their_own_loaders_equal_the_one_host_run_across_epochs() {
    let dir = tempdir("hosts-virtual-loaders");
    let model = tiny_text_model(&dir);
    let data = instruction_examples(&dir.join("d.jsonl"), 6);
    let eval = instruction_examples(&dir.join("e.jsonl"), 4);
    let run = |name: &str, mesh: &str, flags: &[&str]| {
        let out = dir.join(format!("{name}-{}", mesh.replace('=', "-")));
        let mut cmd = train_cmd(&model, &data, &out);
        cmd.args([
            "--steps",
            "8",
            "--batch-size",
            "2",
            "--seq",
            "48",
            "--lora-r",
            "4",
        ])
        .args([
            "--lr",
            "1e-3",
            "--seed",
            "3",
            "--log-every",
            "0",
            "--no-plot",
        ])
        .args(["--mesh", mesh, "--eval-every", "4"])
        .arg("--eval-data")
        .arg(&eval);
        let (_, losses, adapter) = outcome(cmd, &out, flags);
        let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
        let evals: Vec<(u64, f64, f64)> = metrics
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter_map(|v| {
                let loss = v["eval_loss"].as_f64()?;
                Some((v["step"].as_u64()?, loss, v["eval_accuracy"].as_f64()?))
            })
            .collect();
        (losses, adapter, evals)
    };
    for mesh in ["fsdp=2", "context=2"] {
        let (one_losses, one_adapter, one_evals) = run("one", mesh, &[]);
        let (losses, adapter, evals) = run("two", mesh, &["--virtual-hosts", "2"]);
        assert_eq!(one_losses.len(), 8);
        assert_eq!(losses, one_losses, "--mesh {mesh}");
        assert!(adapter == one_adapter, "--mesh {mesh}: the adapters differ");
        assert_eq!(
            one_evals.iter().map(|e| e.0).collect::<Vec<_>>(),
            [0, 4, 8],
            "{one_evals:?}"
        );
        assert_eq!(evals, one_evals, "--mesh {mesh}: the evaluations differ");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The placement of a process of a run, on a real plugin: the CPU client's devices described
/// through PJRT (ids and process indices), all of one process here, so the process holds every
/// position, its devices in the order of their ids as placed.
#[test]
fn a_client_of_one_process_places_every_position_here() {
    let mut rt = xtrain::device::runtime::Runtime::open(Some("cpu"), Some(4)).unwrap();
    let ids: Vec<i64> = rt.devices.iter().map(|d| d.id().unwrap() as i64).collect();
    for d in &rt.devices {
        assert_eq!(d.description().unwrap().process_index, 0);
    }
    // The gather a process of a run hands its shards to process 0 through (unused here).
    let gather = || {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let config = xtrain::cluster::server::Config::new(1, xtrain::cluster::auth::Secret::none());
        let server = xtrain::cluster::server::StoreServer::serve(listener, config).unwrap();
        let me = as_process(0);
        let store =
            xtrain::cluster::store::Store::connect(&address, "place", me, Duration::from_secs(5))
                .unwrap();
        let gather = xtrain::cluster::gather::StoreGather::new(store, Duration::from_secs(5));
        (server, gather)
    };
    let (_server, g) = gather();
    rt.place_across_processes(4, g).unwrap();
    let placed = rt.hosts.placement().cloned().unwrap();
    assert_eq!(placed.ids, ids);
    assert_eq!(placed.held(), vec![0, 1, 2, 3]);
    assert!(placed.holds_all());
    let after: Vec<i64> = rt.devices.iter().map(|d| d.id().unwrap() as i64).collect();
    assert_eq!(after, ids);
    let e = rt
        .place_across_processes(2, gather().1)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("compiled for 2 devices, but the run's processes have 4"),
        "{e}"
    );
}
