//! [`Preference`]: what a preference-training (DPO) step is built for, beside the step's other
//! settings: the pair loss and its constants, the reference the policy is compared with, and
//! whether the reference's log-probabilities come in precomputed.

use crate::model::preference::{Objective, PairLoss};
use anyhow::{bail, Result};

/// What a step trains on (`--method`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Method {
    /// Supervised: the next token's cross entropy on the examples' responses.
    #[default]
    Sft,
    /// Preference training (DPO) on pairs of completions.
    Dpo,
}

impl Method {
    pub fn name(self) -> &'static str {
        match self {
            Method::Sft => "sft",
            Method::Dpo => "dpo",
        }
    }

    pub fn parse(s: &str) -> Result<Method> {
        match s {
            "sft" => Ok(Method::Sft),
            "dpo" => Ok(Method::Dpo),
            _ => bail!("--method must be sft or dpo, got `{s}`"),
        }
    }
}

/// The model the policy's log-probabilities are compared with (`--reference`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Reference {
    /// The frozen model without the adapter.
    Base,
    /// The frozen model with the adapter the run started from (`--init-adapter`), as it was at
    /// step 0: extra arguments of the step, never trained.
    Start,
}

impl Reference {
    pub fn name(self) -> &'static str {
        match self {
            Reference::Base => "base",
            Reference::Start => "start",
        }
    }

    pub fn parse(s: &str) -> Result<Reference> {
        match s {
            "base" => Ok(Reference::Base),
            "start" => Ok(Reference::Start),
            _ => bail!("--reference must be base or start, got `{s}`"),
        }
    }
}

/// A DPO step's settings, each named as its flag (`--beta`, `--dpo-loss`, ...), as the manifest
/// writes them under `dpo`.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct Preference {
    pub beta: f64,
    pub dpo_loss: PairLoss,
    /// cDPO's label smoothing: the chance that a pair's preference is flipped (sigmoid only).
    pub label_smoothing: f64,
    pub reference: Reference,
    /// The reference's log-probabilities are an argument of the step (computed once over the
    /// data by the log-probability program) instead of a forward pass inside it.
    pub precompute_reference: bool,
}

impl Default for Preference {
    /// TRL's defaults: sigmoid, beta 0.1, no label smoothing; the base model as the reference.
    fn default() -> Self {
        Preference {
            beta: 0.1,
            dpo_loss: PairLoss::Sigmoid,
            label_smoothing: 0.0,
            reference: Reference::Base,
            precompute_reference: false,
        }
    }
}

impl Preference {
    /// The loss's constants.
    pub fn objective(&self) -> Objective {
        Objective {
            loss: self.dpo_loss,
            beta: self.beta,
            label_smoothing: self.label_smoothing,
        }
    }

    /// Refuse constants no DPO loss can use, each naming its flag.
    pub fn validate(&self) -> Result<()> {
        if !(self.beta.is_finite() && self.beta > 0.0) {
            bail!(
                "--beta must be a number > 0 (how far the policy may move from the reference: \
                 TRL's default is 0.1), got {}",
                self.beta
            );
        }
        if !(0.0..0.5).contains(&self.label_smoothing) {
            bail!(
                "--label-smoothing must be in [0, 0.5) (the chance that a pair's preference is \
                 flipped), got {}",
                self.label_smoothing
            );
        }
        if self.label_smoothing > 0.0 && self.dpo_loss != PairLoss::Sigmoid {
            bail!(
                "--label-smoothing {} is cDPO's, a form of the sigmoid loss; --dpo-loss {} does \
                 not use it: give --dpo-loss sigmoid, or leave --label-smoothing out",
                self.label_smoothing,
                self.dpo_loss.name()
            );
        }
        Ok(())
    }
}
