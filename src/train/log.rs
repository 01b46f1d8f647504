//! What a run tells the person watching it.

use std::time::Instant;

/// The progress line: step, loss, tokens/s, ETA. Rewritten in place on a terminal.
pub struct Progress {
    pub start: Instant,
    pub tty: bool,
    pub first_step: u64,
}

impl Progress {
    pub fn show(&self, step: u64, total: u64, loss: f32, tokens_per_s: f64, lr: f64) {
        use std::io::IsTerminal;
        let done = (step - self.first_step + 1) as f64;
        let eta = self.start.elapsed().as_secs_f64() / done * (total - step) as f64;
        let width = 24;
        let filled = (step as usize * width) / total.max(1) as usize;
        let bar: String = "#".repeat(filled) + &".".repeat(width - filled);
        let line = format!("[{bar}] step {step}/{total} loss {loss:.4} lr {lr:.2e} {tokens_per_s:.0} tok/s eta {eta:.0}s");
        if self.tty && std::io::stderr().is_terminal() {
            eprint!("\r{line}");
            if step == total {
                eprintln!();
            }
        } else {
            eprintln!("{line}");
        }
    }
}
