//! How the step trades memory for time: what the backward pass recomputes ([`Remat`]), what
//! lives in host memory ([`Offload`]), and the choices `auto` tries until the step fits.

use anyhow::{bail, Result};

/// How much of the forward pass the backward pass recomputes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Remat {
    /// Layers unrolled, every intermediate kept (program size grows with depth).
    None,
    /// Layers looped; each layer's input kept, the rest recomputed in the backward loop.
    Layer,
    /// Layers looped; each layer's input, its frozen projections' outputs, its attention output
    /// and its softmax's row max and sum kept.
    SaveProj,
}

impl Remat {
    pub fn parse(s: &str) -> Result<Remat> {
        Ok(match s {
            "none" => Remat::None,
            "layer" => Remat::Layer,
            "save-proj" => Remat::SaveProj,
            _ => bail!("--remat must be auto, none, layer or save-proj, got `{s}`"),
        })
    }

    /// `--remat` as given: None for `auto`, which the command decides once it knows the
    /// device's memory (see [`fit_choices`]).
    pub fn parse_choice(s: &str) -> Result<Option<Remat>> {
        match s {
            "auto" => Ok(None),
            other => Remat::parse(other).map(Some),
        }
    }

    /// The `--remat` value that gives this.
    pub fn name(self) -> &'static str {
        match self {
            Remat::None => "none",
            Remat::Layer => "layer",
            Remat::SaveProj => "save-proj",
        }
    }

    /// Whether layers are a loop over stacked weights.
    pub fn scan(self) -> bool {
        self != Remat::None
    }
}

/// Host offload (XLA memory kinds; `pinned_host` memory that the device reads by DMA): the
/// frozen layer weights live in host memory and each layer's shard is copied to the device in
/// the layer loop just before use; the activations the backward pass needs (each layer's input,
/// and with `--remat save-proj` the projections' outputs) are written to host memory in the
/// forward loop and read back in the backward loop.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Offload {
    pub frozen: bool,
    pub activations: bool,
}

impl Offload {
    pub const NONE: Offload = Offload {
        frozen: false,
        activations: false,
    };
    pub const FROZEN: Offload = Offload {
        frozen: true,
        activations: false,
    };
    pub const ACTIVATIONS: Offload = Offload {
        frozen: false,
        activations: true,
    };
    pub const ALL: Offload = Offload {
        frozen: true,
        activations: true,
    };
    /// Every value, least offloaded first: none, frozen, activations, all.
    pub const EVERY: [Offload; 4] = [
        Offload::NONE,
        Offload::FROZEN,
        Offload::ACTIVATIONS,
        Offload::ALL,
    ];

    pub fn is_none(&self) -> bool {
        *self == Offload::NONE
    }

    /// `--offload` as given: none, frozen, activations or all (`auto` is decided by the command,
    /// which knows the device's memory).
    pub fn parse(s: &str) -> Result<Offload> {
        Ok(match s {
            "none" => Offload::NONE,
            "frozen" => Offload::FROZEN,
            "activations" => Offload::ACTIVATIONS,
            "all" => Offload::ALL,
            _ => bail!("--offload must be auto, none, frozen, activations or all, got `{s}`"),
        })
    }

    /// `--offload` as given: None for `auto`, which the command decides once it knows the
    /// device's memory (see [`fit_choices`]).
    pub fn parse_choice(s: &str) -> Result<Option<Offload>> {
        match s {
            "auto" => Ok(None),
            other => Offload::parse(other).map(Some),
        }
    }

    /// The `--offload` value that gives this.
    pub fn name(&self) -> &'static str {
        match (self.frozen, self.activations) {
            (false, false) => "none",
            (true, false) => "frozen",
            (false, true) => "activations",
            (true, true) => "all",
        }
    }

    /// What `--offload auto` tries, in order, until the step fits: nothing; the saved
    /// activations (a few GB moved per step); the frozen weights as well (every weight crosses
    /// the host link twice a step).
    pub const AUTO_ORDER: [Offload; 3] = [Offload::NONE, Offload::ACTIVATIONS, Offload::ALL];
}

/// What the command tries, in order, until the step fits the device's memory, for `--remat`
/// and `--offload` as given (None: `auto`): with `--remat auto`, save-proj first (the
/// backward pass recomputes no projection, for about three times layer's memory), then layer;
/// with `--offload auto`, the offload choices of
/// [`Offload::AUTO_ORDER`] (for layer remat only: save-proj is tried without offload, or with
/// the one `--offload` names). Where the device's memory is not known the command takes
/// [`default_choice`] instead.
pub fn fit_choices(remat: Option<Remat>, offload: Option<Offload>) -> Vec<(Remat, Offload)> {
    let offloads = match offload {
        Some(o) => vec![o],
        None => Offload::AUTO_ORDER.to_vec(),
    };
    if remat == Some(Remat::None) {
        // Unrolled layers cannot offload (nothing is kept between loops): one choice.
        return vec![(Remat::None, offload.unwrap_or(Offload::NONE))];
    }
    let mut choices = Vec::new();
    if remat.is_none() {
        choices.push((Remat::SaveProj, offload.unwrap_or(Offload::NONE)));
    }
    let remat = remat.unwrap_or(Remat::Layer);
    choices.extend(offloads.into_iter().map(|o| (remat, o)));
    choices
}

/// What `--remat auto` and `--offload auto` are where the device's memory is not known (a CPU
/// plugin, `compile` without `--check --target`): remat per layer, nothing offloaded.
pub fn default_choice(remat: Option<Remat>, offload: Option<Offload>) -> (Remat, Offload) {
    (
        remat.unwrap_or(Remat::Layer),
        offload.unwrap_or(Offload::NONE),
    )
}
