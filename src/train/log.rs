//! What a run tells the person watching it: `metrics.jsonl` (one JSON object per step, evaluation,
//! skipped step or loss spike) with the history the loss curve is drawn from, the same scalars
//! for TensorBoard (`OUT/tensorboard/`); its lines on stderr go above the progress bar
//! (`progress::say`).

use crate::device::preference::PairMetrics;
use crate::device::trainer::EvalResult;
use crate::train::tensorboard::EventWriter;
use anyhow::Result;
use std::io::Write;
use std::path::Path;

/// `OUT/metrics.jsonl`, appended to as the run goes.
pub struct Metrics {
    file: std::fs::File,
    /// Tokens per step, written with each step's line.
    tokens_per_step: i64,
    /// (step, train loss or NaN, eval loss): what the loss curve is drawn from.
    pub history: Vec<(u64, f64, Option<f64>)>,
    /// (step, held-out exact-match accuracy): the accuracy curve under the loss.
    pub eval_accuracy: Vec<(u64, f64)>,
    /// The last (up to 20) losses, to notice a spike.
    recent: Vec<f32>,
    /// `OUT/tensorboard/events.out.tfevents.*`.
    tensorboard: EventWriter,
    /// Model FLOPs of a step over the devices' peak FLOP/s, when the peak is known: a step's MFU
    /// is this over its time.
    pub mfu_seconds: Option<f64>,
    /// When this invocation began and where its time went before the first step (reading the
    /// data, loading, compiling, the step-0 evaluation): written into its first step's line as
    /// `time_to_first_step`, with the step's own time and the total.
    pub first_step: Option<(std::time::Instant, serde_json::Value)>,
}

impl Metrics {
    /// Start `out/metrics.jsonl`: empty, or on a resume from step `resumed_at`, with the lines of
    /// the earlier run up to that step.
    pub fn open(out: &Path, resumed_at: Option<u64>, tokens_per_step: i64) -> Result<Metrics> {
        let metrics_path = out.join("metrics.jsonl");
        let mut kept = String::new();
        if let Some(step) = resumed_at {
            if let Ok(old) = std::fs::read_to_string(&metrics_path) {
                for line in old.lines() {
                    let v: serde_json::Value = serde_json::from_str(line).unwrap_or_default();
                    if v.get("step")
                        .and_then(|s| s.as_u64())
                        .is_some_and(|s| s <= step)
                    {
                        kept.push_str(line);
                        kept.push('\n');
                    }
                }
            }
        }
        // Replaced whole (a temp file renamed over it): a run killed here keeps the old lines.
        crate::formats::atomic::write_bytes_atomic(&metrics_path, kept.as_bytes())?;
        let file = std::fs::OpenOptions::new()
            .append(true)
            .open(&metrics_path)?;
        let mut tensorboard = EventWriter::create(&out.join("tensorboard"))?;
        // On a resume, the earlier files' steps after the checkpoint are logged again or never
        // reached by the run that continues: TensorBoard drops them, as above.
        tensorboard.session_start(resumed_at.map_or(0, |step| step + 1))?;
        Ok(Metrics {
            file,
            tokens_per_step,
            history: Vec::new(),
            eval_accuracy: Vec::new(),
            recent: Vec::new(),
            tensorboard,
            mfu_seconds: None,
            first_step: None,
        })
    }

    /// An evaluation at `step`: its line, a line on stderr, and a point of the curve.
    pub fn eval(&mut self, step: u64, r: &EvalResult) -> Result<()> {
        writeln!(
            self.file,
            "{}",
            serde_json::json!({"step": step, "eval_loss": r.loss, "eval_accuracy": r.accuracy, "eval_rows": r.rows})
        )?;
        crate::train::progress::say(&format!(
            "eval at step {step}: loss {:.4}, exact-match accuracy {:.1}% of {} rows",
            r.loss,
            100.0 * r.accuracy,
            r.rows
        ));
        self.history.push((step, f64::NAN, Some(r.loss)));
        self.eval_accuracy.push((step, r.accuracy));
        self.tensorboard.scalars(
            step,
            &[("eval/loss", r.loss), ("eval/accuracy", r.accuracy)],
        )
    }

    /// An evaluation of held-out preference pairs at `step`: TRL's metrics (`eval_loss`,
    /// `eval_rewards/margins`, ...), a line on stderr, and a point of the curve.
    pub fn eval_pairs(&mut self, step: u64, m: &PairMetrics) -> Result<()> {
        let mut line = serde_json::json!({"step": step});
        for (k, v) in pair_fields(m) {
            line[format!("eval_{k}")] = v.into();
        }
        line["eval_pairs"] = m.pairs.into();
        writeln!(self.file, "{line}")?;
        crate::train::progress::say(&format!(
            "eval at step {step}: loss {:.4}, reward margin {}, accuracy {:.1}% of {} pairs",
            m.loss,
            crate::words::fixed(m.rewards_margins, 4),
            100.0 * m.rewards_accuracies,
            m.pairs
        ));
        self.history.push((step, f64::NAN, Some(m.loss)));
        self.eval_accuracy.push((step, m.rewards_accuracies));
        let scalars: Vec<(String, f64)> = pair_fields(m)
            .into_iter()
            .map(|(k, v)| (format!("eval/{k}"), v))
            .collect();
        let named: Vec<(&str, f64)> = scalars.iter().map(|(k, v)| (k.as_str(), *v)).collect();
        self.tensorboard.scalars(step, &named)
    }

    /// A step whose loss or gradient norm was not finite (and was not applied).
    pub fn nonfinite(&mut self, step: u64, loss: f32, grad_norm: f32) -> Result<()> {
        writeln!(
            self.file,
            "{}",
            serde_json::json!({"step": step, "nonfinite": true, "loss": loss.to_string(), "grad_norm": grad_norm.to_string()})
        )?;
        Ok(())
    }

    /// A step taken: a loss spike against the recent mean is reported first, then the step's
    /// line (flushed) and its point of the curve; a DPO step's line has TRL's metrics (`pairs`).
    #[allow(clippy::too_many_arguments)]
    pub fn step(
        &mut self,
        step: u64,
        loss: f32,
        grad_norm: f32,
        lr: f64,
        epoch: u64,
        step_time_s: f64,
        pairs: Option<&PairMetrics>,
    ) -> Result<()> {
        if self.recent.len() >= 5 {
            let mean = self.recent.iter().sum::<f32>() / self.recent.len() as f32;
            if loss > 2.0 * mean + 1.0 {
                crate::train::progress::say(&format!("xtrain: loss spike at step {step}: {loss:.4} against a recent mean of {mean:.4}"));
                writeln!(
                    self.file,
                    "{}",
                    serde_json::json!({"step": step, "loss_spike": loss, "recent_mean": mean})
                )?;
            }
        }
        self.recent.push(loss);
        if self.recent.len() > 20 {
            self.recent.remove(0);
        }
        let tokens = self.tokens_per_step;
        let dt = step_time_s;
        let mut line = serde_json::json!({"step": step, "loss": loss, "grad_norm": grad_norm, "lr": lr, "epoch": epoch, "tokens": tokens, "step_time_s": dt});
        // The step's loss is the program's; the rest of TRL's metrics come from the rows'
        // log-probabilities.
        let pair_scalars: Vec<(&str, f64)> = pairs.map_or(Vec::new(), |m| {
            pair_fields(m)
                .into_iter()
                .filter(|(k, _)| *k != "loss")
                .collect()
        });
        for (k, v) in &pair_scalars {
            line[*k] = (*v).into();
        }
        if let Some((began, mut before)) = self.first_step.take() {
            before["first_step_s"] = dt.into();
            before["total_s"] = began.elapsed().as_secs_f64().into();
            line["time_to_first_step"] = before;
        }
        writeln!(self.file, "{line}")?;
        self.file.flush()?;
        self.history.push((step, loss as f64, None));
        let mut scalars: Vec<(&str, f64)> = vec![
            ("train/loss", loss as f64),
            ("train/lr", lr),
            ("train/grad_norm", grad_norm as f64),
            ("train/tokens_per_s", tokens as f64 / dt),
        ];
        if let Some(s) = self.mfu_seconds {
            scalars.push(("train/mfu", s / dt));
        }
        let named: Vec<(String, f64)> = pair_scalars
            .iter()
            .map(|(k, v)| (format!("train/{k}"), *v))
            .collect();
        scalars.extend(named.iter().map(|(k, v)| (k.as_str(), *v)));
        self.tensorboard.scalars(step, &scalars)
    }
}

/// TRL's metric names and values of a set of pairs.
fn pair_fields(m: &PairMetrics) -> Vec<(&'static str, f64)> {
    vec![
        ("loss", m.loss),
        ("rewards/chosen", m.rewards_chosen),
        ("rewards/rejected", m.rewards_rejected),
        ("rewards/margins", m.rewards_margins),
        ("rewards/accuracies", m.rewards_accuracies),
        ("logps/chosen", m.logps_chosen),
        ("logps/rejected", m.logps_rejected),
    ]
}

#[cfg(test)]
mod tests {
    use super::Metrics;

    /// On a resume, `metrics.jsonl` is replaced whole by a new file (written under a temp name
    /// and renamed), not cut in place: a hard link to the old file (what a copy or a backup tool
    /// may hold; the old inode is what a kill during a plain rewrite left half-written) keeps
    /// every line, while the run's file keeps the lines up to the checkpoint.
    #[test]
    fn a_resume_replaces_metrics_jsonl_whole_instead_of_cutting_it_in_place() {
        let dir = std::env::temp_dir().join(format!("xtrain-log-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("metrics.jsonl");
        let lines: String = (1..=5)
            .map(|s| format!("{{\"step\": {s}, \"loss\": 1.0}}\n"))
            .collect();
        std::fs::write(&path, &lines).unwrap();
        let linked = dir.join("linked.jsonl");
        std::fs::hard_link(&path, &linked).unwrap();
        drop(Metrics::open(&dir, Some(3), 16).unwrap());
        assert_eq!(std::fs::read_to_string(&linked).unwrap(), lines);
        let kept = std::fs::read_to_string(&path).unwrap();
        assert_eq!(kept.lines().count(), 3, "{kept}");
        let leftovers: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains("tmp"))
            .collect();
        assert!(leftovers.is_empty(), "{leftovers:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
