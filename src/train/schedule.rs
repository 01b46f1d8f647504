//! The learning rate of each step.

/// Learning-rate schedule: linear warmup, then constant, linear or cosine decay to
/// `min_ratio * lr` at the last step.
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
        let progress = ((step - self.warmup) as f64 / span).clamp(0.0, 1.0);
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
