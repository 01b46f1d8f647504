//! The settings `xtrain plan` searches ([`Space`]): each knob either fixed (the user gave its
//! flag) or searched over a short list of values, and one point of it ([`Settings`]), which is a
//! set of flags a user could have typed.

use crate::program::sharding::Rules;
use crate::program::{KeyBlocks, DEFAULT_KEY_BLOCK};
use crate::program::{MeshPlan, MlpChunks, Offload, Remat, StepOptions, DEFAULT_MLP_CHUNK};

/// The knobs of the search: None where the knob is searched, the value where it is fixed.
#[derive(Clone, Debug, Default)]
pub struct Space {
    /// The mesh (`--mesh`); searched: every factorization of the devices into data x fsdp x
    /// tensor x context.
    pub mesh: Option<Option<MeshPlan>>,
    /// Microbatches per step (`--grad-accum`); searched: every divisor of the global batch.
    pub grad_accum: Option<i64>,
    /// Searched: save-proj and layer (`none`, the unrolled step, only when asked: its compile
    /// grows with the depth and it keeps every activation).
    pub remat: Option<Remat>,
    /// Searched: none, frozen, activations, all.
    pub offload: Option<Offload>,
    /// Searched: off and the default block.
    pub key_block: Option<KeyBlocks>,
    /// Searched: off and [`loss_chunk_for`] of the sequence.
    pub loss_chunk: Option<Option<i64>>,
    /// Searched: off and [`mlp_chunk_for`] of the sequence.
    pub mlp_chunk: Option<MlpChunks>,
}

/// One point of the space: the flags of one step.
#[derive(Clone, Debug, PartialEq)]
pub struct Settings {
    pub mesh: Option<MeshPlan>,
    pub grad_accum: i64,
    pub remat: Remat,
    pub offload: Offload,
    pub key_block: KeyBlocks,
    pub loss_chunk: Option<i64>,
    pub mlp_chunk: MlpChunks,
}

/// The loss chunk searched for a sequence of `seq` (a chunk must divide it): the largest power
/// of two up to 4096 that divides it, where that is shorter than the sequence and at least 256
/// positions; else half the sequence (None for an odd one).
pub fn loss_chunk_for(seq: i64) -> Option<i64> {
    let c = gcd(seq, 4096);
    match c < seq && c >= 256 {
        true => Some(c),
        false => (seq % 2 == 0).then_some(seq / 2),
    }
}

/// The MLP tile searched for a sequence of `seq`: `--mlp-chunk auto`'s 4096 where the sequence
/// is longer, else half the sequence (None for a sequence of one tile).
pub fn mlp_chunk_for(seq: i64) -> Option<i64> {
    match DEFAULT_MLP_CHUNK < seq {
        true => Some(DEFAULT_MLP_CHUNK),
        false => (seq >= 2).then_some(seq / 2),
    }
}

fn gcd(a: i64, b: i64) -> i64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// Every mesh of `devices` devices over the axes data, fsdp, tensor and context (axes of size
/// 1 left out), placed by `rules`; one device: no mesh.
pub fn meshes(devices: i64, rules: &Rules) -> Vec<Option<MeshPlan>> {
    if devices <= 1 {
        return vec![None];
    }
    let divisors = |n: i64| (1..=n).filter(move |d| n % d == 0);
    let mut out = Vec::new();
    for data in divisors(devices) {
        for fsdp in divisors(devices / data) {
            for tensor in divisors(devices / data / fsdp) {
                let context = devices / data / fsdp / tensor;
                let axes: Vec<(String, i64)> = [
                    ("data", data),
                    ("fsdp", fsdp),
                    ("tensor", tensor),
                    ("context", context),
                ]
                .into_iter()
                .filter(|(_, n)| *n > 1)
                .map(|(a, n)| (a.to_string(), n))
                .collect();
                out.push(Some(MeshPlan {
                    axes,
                    rules: rules.clone(),
                }));
            }
        }
    }
    out
}

impl Space {
    /// Every point of the space for `devices` devices, a global batch of `batch` rows and
    /// sequences of `seq` tokens, in a fixed order (meshes, then microbatches, remat, offload,
    /// key block, loss chunk, MLP tile). Points the step refuses are kept: the search says why.
    pub fn points(&self, devices: i64, batch: i64, seq: i64, rules: &Rules) -> Vec<Settings> {
        let meshes = match &self.mesh {
            Some(m) => vec![m.clone()],
            None => meshes(devices, rules),
        };
        let accums: Vec<i64> = match self.grad_accum {
            Some(g) => vec![g],
            None => (1..=batch).filter(|g| batch % g == 0).collect(),
        };
        let remats = match self.remat {
            Some(r) => vec![r],
            None => vec![Remat::SaveProj, Remat::Layer],
        };
        let offloads = match self.offload {
            Some(o) => vec![o],
            None => ["none", "frozen", "activations", "all"]
                .map(|o| Offload::parse(o).expect("an offload name"))
                .to_vec(),
        };
        let key_blocks = match self.key_block {
            Some(k) => vec![k],
            None => vec![KeyBlocks::Off, KeyBlocks::Size(DEFAULT_KEY_BLOCK)],
        };
        let loss_chunks = match self.loss_chunk {
            Some(c) => vec![c],
            None => [None, loss_chunk_for(seq)].into_iter().collect(),
        };
        let mlp_chunks = match self.mlp_chunk {
            Some(c) => vec![c],
            None => [
                Some(MlpChunks::Off),
                mlp_chunk_for(seq).map(MlpChunks::Size),
            ]
            .into_iter()
            .flatten()
            .collect(),
        };
        let mut loss_chunks = loss_chunks;
        loss_chunks.dedup();
        let mut points = Vec::new();
        for mesh in &meshes {
            for &grad_accum in &accums {
                for &remat in &remats {
                    for &offload in &offloads {
                        for &key_block in &key_blocks {
                            for &loss_chunk in &loss_chunks {
                                for &mlp_chunk in &mlp_chunks {
                                    points.push(Settings {
                                        mesh: mesh.clone(),
                                        grad_accum,
                                        remat,
                                        offload,
                                        key_block,
                                        loss_chunk,
                                        mlp_chunk,
                                    });
                                }
                            }
                        }
                    }
                }
            }
        }
        points
    }

    /// The points of the space that need the least memory for `seq` (`--seq max` probes with
    /// them, taking a longer sequence than one none of them fits to need more): remat per
    /// layer, everything offloaded, the most microbatches, key blocks, the loss in chunks and
    /// the MLP in tiles, each where the knob is searched; on a searched mesh of several
    /// devices, one point with FSDP over them all and one with the sequence split over them
    /// (a context axis).
    pub fn least_memory(&self, devices: i64, batch: i64, seq: i64, rules: &Rules) -> Vec<Settings> {
        let meshes: Vec<Option<MeshPlan>> = match &self.mesh {
            Some(m) => vec![m.clone()],
            None if devices <= 1 => vec![None],
            None => ["fsdp", "context"]
                .map(|axis| {
                    Some(MeshPlan {
                        axes: vec![(axis.to_string(), devices)],
                        rules: rules.clone(),
                    })
                })
                .to_vec(),
        };
        let frugal = Settings {
            mesh: None,
            grad_accum: self.grad_accum.unwrap_or(batch),
            remat: self.remat.unwrap_or(Remat::Layer),
            offload: self.offload.unwrap_or(Offload::parse("all").expect("all")),
            key_block: self.key_block.unwrap_or(KeyBlocks::Size(DEFAULT_KEY_BLOCK)),
            loss_chunk: self.loss_chunk.unwrap_or_else(|| loss_chunk_for(seq)),
            mlp_chunk: self
                .mlp_chunk
                .unwrap_or_else(|| mlp_chunk_for(seq).map_or(MlpChunks::Off, MlpChunks::Size)),
        };
        meshes
            .into_iter()
            .map(|mesh| {
                // The MLP's tiles cut the sequence, which a context axis splits already.
                let split = mesh.as_ref().is_some_and(|m| m.context_size() > 1);
                let mlp_chunk = match split && self.mlp_chunk.is_none() {
                    true => MlpChunks::Off,
                    false => frugal.mlp_chunk,
                };
                Settings {
                    mesh,
                    mlp_chunk,
                    ..frugal.clone()
                }
            })
            .collect()
    }
}

impl Settings {
    /// The step options of these settings over `base` (the flags the user gave).
    pub fn options(&self, base: &StepOptions) -> StepOptions {
        StepOptions {
            mesh: self.mesh.clone(),
            grad_accum: self.grad_accum,
            remat: Some(self.remat),
            offload: Some(self.offload),
            key_block: self.key_block,
            loss_chunk: self.loss_chunk,
            mlp_chunk: self.mlp_chunk,
            ..base.clone()
        }
    }

    /// The flags these settings are, by name, as a user types them (`mesh` empty on one
    /// device; `loss-chunk` off where there is none).
    pub fn flags(&self) -> Vec<(&'static str, String)> {
        vec![
            ("mesh", mesh_text(&self.mesh)),
            ("grad-accum", self.grad_accum.to_string()),
            ("remat", self.remat.name().to_string()),
            ("offload", self.offload.name().to_string()),
            ("key-block", self.key_block.name()),
            (
                "loss-chunk",
                self.loss_chunk.map_or("off".into(), |c| c.to_string()),
            ),
            ("mlp-chunk", self.mlp_chunk.name()),
        ]
    }

    /// The flags in one line (`--mesh fsdp=4 --remat layer ...`), the mesh left out on one
    /// device and the loss chunk where there is none.
    pub fn line(&self) -> String {
        self.flags()
            .into_iter()
            .filter(|(f, v)| !(v.is_empty() || (*f == "loss-chunk" && v == "off")))
            .map(|(f, v)| format!("--{f} {v}"))
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// The same settings but for the number of microbatches.
    pub fn same_but_accumulation(&self, other: &Settings) -> bool {
        Settings {
            grad_accum: other.grad_accum,
            ..self.clone()
        } == *other
    }
}

/// `data=2,fsdp=4`, empty for one device.
pub fn mesh_text(m: &Option<MeshPlan>) -> String {
    m.as_ref().map_or(String::new(), |m| {
        let axes: Vec<String> = m.axes.iter().map(|(n, s)| format!("{n}={s}")).collect();
        axes.join(",")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meshes_are_every_factorization_of_the_devices() {
        let rules = Rules::default();
        let texts: Vec<String> = meshes(4, &rules).iter().map(mesh_text).collect();
        assert_eq!(texts.len(), 10, "{texts:?}");
        for want in [
            "context=4",
            "fsdp=4",
            "data=2,fsdp=2",
            "data=2,tensor=2",
            "tensor=4",
        ] {
            assert!(texts.contains(&want.to_string()), "{want} in {texts:?}");
        }
        assert_eq!(meshes(1, &rules), vec![None]);
    }

    #[test]
    fn the_searched_chunks_divide_or_tile_the_sequence() {
        assert_eq!(loss_chunk_for(131072), Some(4096));
        assert_eq!(loss_chunk_for(2048), Some(1024));
        assert_eq!(loss_chunk_for(6144), Some(2048));
        assert_eq!(loss_chunk_for(63), None);
        assert_eq!(loss_chunk_for(96), Some(48));
        assert_eq!(mlp_chunk_for(131072), Some(4096));
        assert_eq!(mlp_chunk_for(64), Some(32));
    }

    /// A fixed knob is one value; a searched one its list: 2 remats x 4 offloads x 2 key
    /// blocks x 2 loss chunks x 2 MLP tiles on one device with a batch of one row.
    #[test]
    fn a_fixed_knob_is_not_searched() {
        let rules = Rules::default();
        assert_eq!(Space::default().points(1, 1, 64, &rules).len(), 64);
        let fixed = Space {
            remat: Some(Remat::Layer),
            offload: Some(Offload::NONE),
            ..Space::default()
        };
        let points = fixed.points(1, 2, 64, &rules);
        assert_eq!(points.len(), 2 * 2 * 2 * 2);
        assert!(points.iter().all(|p| p.remat == Remat::Layer));
        let frugal = &fixed.least_memory(1, 2, 64, &rules)[0];
        assert_eq!(frugal.grad_accum, 2);
        assert_eq!(frugal.offload, Offload::NONE);
        assert_eq!(frugal.mlp_chunk, MlpChunks::Size(32));
    }
}
