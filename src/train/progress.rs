//! What the person at a terminal sees while a run loads, compiles and trains: `indicatif` bars
//! and spinners with ETAs, drawn only when stderr is a terminal (piped or redirected, they are
//! not drawn at all, and the run writes plain lines instead, one per `--log-every` steps); lines
//! said while a bar is drawn go above it ([`say`]). And the process's host memory figures
//! (`VmRSS`, `VmHWM` from `/proc/self/status`), which `xtrain train` reports after loading.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use std::sync::Mutex;
use std::time::Duration;

/// The bar being drawn now, if any (one at a time): [`say`] prints above it.
static ACTIVE: Mutex<Option<ProgressBar>> = Mutex::new(None);

/// Whether bars are drawn: stderr is a terminal.
pub fn drawn() -> bool {
    std::io::stderr().is_terminal()
}

/// A bar not drawn yet: [`show`] draws it.
fn make(len: Option<u64>, template: &str) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(len, ProgressDrawTarget::hidden());
    bar.set_style(
        ProgressStyle::with_template(template)
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar
}

/// Draw `bar` on stderr from now on, if stderr is a terminal (one bar at a time: clear the
/// last one first).
pub fn show(bar: &ProgressBar) {
    if drawn() {
        bar.set_draw_target(ProgressDrawTarget::stderr());
    }
    *ACTIVE.lock().unwrap_or_else(|e| e.into_inner()) = Some(bar.clone());
}

/// A spinner for work of unknown length (compiling), ticking on its own.
pub fn spinner(message: &str) -> ProgressBar {
    let bar = make(None, "{spinner} {msg} {elapsed}");
    bar.set_message(message.to_string());
    show(&bar);
    bar.enable_steady_tick(Duration::from_millis(120));
    bar
}

/// A bar over `total` bytes (loading weights), with throughput and ETA; not drawn until
/// [`show`].
pub fn bytes(message: &str, total: u64) -> ProgressBar {
    let bar = make(
        Some(total),
        "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
    );
    bar.set_message(message.to_string());
    bar
}

/// A bar over a run's steps: step, the message (loss, lr, tokens/s) and ETA.
pub fn steps(first: u64, total: u64) -> ProgressBar {
    let bar = make(
        Some(total),
        "[{bar:24}] step {pos}/{len} {msg} eta {eta} ({elapsed})",
    );
    bar.set_position(first);
    bar.reset_eta();
    show(&bar);
    bar
}

/// Stop drawing `bar` and clear it from the terminal.
pub fn clear(bar: &ProgressBar) {
    bar.finish_and_clear();
    *ACTIVE.lock().unwrap_or_else(|e| e.into_inner()) = None;
}

/// Stop drawing `bar`, leaving its last state on the terminal.
pub fn leave(bar: &ProgressBar) {
    if !bar.is_finished() {
        bar.finish();
    }
    *ACTIVE.lock().unwrap_or_else(|e| e.into_inner()) = None;
}

/// Print a line on stderr, above the bar being drawn (if one is), never onto it.
pub fn say(line: &str) {
    let active = ACTIVE.lock().unwrap_or_else(|e| e.into_inner()).clone();
    match active {
        Some(bar) if !bar.is_finished() => bar.suspend(|| crate::esay!("{line}")),
        _ => crate::esay!("{line}"),
    }
}

/// A `kB` figure of `/proc/self/status` (`VmRSS`, `VmHWM`), in bytes; None where there is no
/// such file (not Linux).
fn proc_status(key: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = text.lines().find(|l| l.starts_with(key))?;
    let kb: u64 = line[key.len()..]
        .trim_start_matches(':')
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(kb * 1024)
}

/// The host memory the process holds now (`VmRSS`).
pub fn resident_bytes() -> Option<u64> {
    proc_status("VmRSS")
}

/// The most host memory the process has held (`VmHWM`), since it started or since
/// [`reset_peak`].
pub fn peak_bytes() -> Option<u64> {
    proc_status("VmHWM")
}

/// Start the peak ([`peak_bytes`]) over from what the process holds now (Linux's
/// `/proc/self/clear_refs` `5`); false where that cannot be done.
pub fn reset_peak() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// Bytes as GiB with two decimals (MiB or KiB for small figures): [`crate::words::gib`] for a
/// count of bytes.
pub fn gib(b: u64) -> String {
    crate::words::gib(i64::try_from(b).unwrap_or(i64::MAX))
}
