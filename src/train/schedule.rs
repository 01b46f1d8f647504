//! The learning rate of each step.

/// Learning-rate schedule: linear warmup (step s of w at `lr * s / w`), then constant, or linear
/// or cosine decay from `lr` towards `min_ratio * lr`, which the step after the last would have:
/// the first step after the warmup takes the full rate and the last one a small one, never 0
/// (Hugging Face's `get_linear_schedule_with_warmup` and `get_cosine_schedule_with_warmup`
/// after their warmup; a run of one step learns at `lr`).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Schedule {
    pub lr: f64,
    pub warmup: u64,
    /// "constant", "linear" or "cosine"
    pub kind: String,
    pub min_ratio: f64,
    pub total: u64,
}

impl Schedule {
    /// The learning rate of step `step` (1-based).
    pub fn at(&self, step: u64) -> f64 {
        if self.warmup > 0 && step <= self.warmup {
            return self.lr * step as f64 / self.warmup as f64;
        }
        let span = self.total.saturating_sub(self.warmup).max(1) as f64;
        let progress = (step.saturating_sub(self.warmup + 1) as f64 / span).clamp(0.0, 1.0);
        let min = self.lr * self.min_ratio;
        match self.kind.as_str() {
            "linear" => self.lr - (self.lr - min) * progress,
            "cosine" => {
                min + (self.lr - min) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
            }
            _ => self.lr,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Schedule;

    fn schedule(kind: &str, warmup: u64, total: u64, min_ratio: f64) -> Schedule {
        Schedule {
            lr: 1.0,
            warmup,
            kind: kind.into(),
            min_ratio,
            total,
        }
    }

    /// Hugging Face's linear schedule over 4 steps after 2 of warmup: 1, 3/4, 1/2, 1/4 (its
    /// `lr_lambda` at 0-based steps 2 to 5); our warmup gives 1/2, 1 (theirs 0, 1/2).
    #[test]
    fn linear_decay_matches_hugging_faces_after_the_warmup_and_never_reaches_0() {
        let s = schedule("linear", 2, 6, 0.0);
        let got: Vec<f64> = (1..=6).map(|i| s.at(i)).collect();
        assert_eq!(got, [0.5, 1.0, 1.0, 0.75, 0.5, 0.25]);
        assert_eq!(
            schedule("linear", 0, 1, 0.0).at(1),
            1.0,
            "one step learns at lr"
        );
    }

    /// Cosine: 0.5 (1 + cos(pi k / n)) at the k-th of n steps after the warmup, counted from 0,
    /// towards `min_ratio * lr`.
    #[test]
    fn cosine_decay_runs_from_lr_towards_the_minimum() {
        let s = schedule("cosine", 0, 4, 0.1);
        let want = |k: f64| 0.1 + 0.9 * 0.5 * (1.0 + (std::f64::consts::PI * k / 4.0).cos());
        for step in 1..=4 {
            assert!(
                (s.at(step) - want((step - 1) as f64)).abs() < 1e-12,
                "step {step}"
            );
        }
        assert_eq!(s.at(1), 1.0);
        assert!(s.at(4) > 0.1);
        assert_eq!(schedule("constant", 0, 4, 0.0).at(4), 1.0);
    }
}
