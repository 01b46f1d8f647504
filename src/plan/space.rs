//! The settings `xtrain plan` searches ([`Space`]): each knob either fixed (the user gave its
//! flag) or searched over a short list of values, and one point of it ([`Knobs`]), which is a
//! set of flags a user could have typed.

use crate::program::sharding::Rules;
use crate::program::{KeyBlocks, DEFAULT_KEY_BLOCK};
use crate::program::{MeshPlan, MlpChunks, Offload, Remat, StepOptions, DEFAULT_MLP_CHUNK};

/// A knob of the search: fixed by its flag, or searched over a short list.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum Knob<T> {
    #[default]
    Searched,
    Fixed(T),
}

impl<T: Clone> Knob<T> {
    /// The fixed value, or `searched` where the knob is searched.
    pub fn values(&self, searched: impl FnOnce() -> Vec<T>) -> Vec<T> {
        match self {
            Knob::Fixed(v) => vec![v.clone()],
            Knob::Searched => searched(),
        }
    }

    /// The fixed value, or `searched` where the knob is searched.
    pub fn or_else(&self, searched: impl FnOnce() -> T) -> T {
        match self {
            Knob::Fixed(v) => v.clone(),
            Knob::Searched => searched(),
        }
    }

    /// Fixed to `value` where `given`, else searched.
    pub fn given(given: bool, value: T) -> Knob<T> {
        match given {
            true => Knob::Fixed(value),
            false => Knob::Searched,
        }
    }

    pub fn is_searched(&self) -> bool {
        matches!(self, Knob::Searched)
    }
}

/// The knobs of the search, each fixed (the user gave its flag) or searched.
#[derive(Clone, Debug, Default)]
pub struct Space {
    /// The mesh (`--mesh`; fixed to None: one device); searched: every factorization of the
    /// devices into data x fsdp x tensor x context.
    pub mesh: Knob<Option<MeshPlan>>,
    /// Microbatches per step (`--grad-accum`); searched: every divisor of the global batch.
    pub grad_accum: Knob<i64>,
    /// Searched: save-proj and layer (`none`, the unrolled step, only when asked: its compile
    /// grows with the depth and it keeps every activation).
    pub remat: Knob<Remat>,
    /// Searched: none, frozen, activations, all.
    pub offload: Knob<Offload>,
    /// Searched: off and the default block.
    pub key_block: Knob<KeyBlocks>,
    /// Searched: off and [`loss_chunk_for`] of the sequence (fixed to None: off).
    pub loss_chunk: Knob<Option<i64>>,
    /// Searched: off and [`mlp_chunk_for`] of the sequence.
    pub mlp_chunk: Knob<MlpChunks>,
}

/// One point of the space, the knobs' values: the flags of one step.
#[derive(Clone, Debug, PartialEq)]
pub struct Knobs {
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
    pub fn points(&self, devices: i64, batch: i64, seq: i64, rules: &Rules) -> Vec<Knobs> {
        let meshes = self.mesh.values(|| meshes(devices, rules));
        let accums = self
            .grad_accum
            .values(|| (1..=batch).filter(|g| batch % g == 0).collect());
        let remats = self.remat.values(|| vec![Remat::SaveProj, Remat::Layer]);
        let offloads = self.offload.values(|| Offload::EVERY.to_vec());
        let key_blocks = self
            .key_block
            .values(|| vec![KeyBlocks::Off, KeyBlocks::Size(DEFAULT_KEY_BLOCK)]);
        let mut loss_chunks = self.loss_chunk.values(|| vec![None, loss_chunk_for(seq)]);
        loss_chunks.dedup();
        let mlp_chunks = self.mlp_chunk.values(|| {
            [
                Some(MlpChunks::Off),
                mlp_chunk_for(seq).map(MlpChunks::Size),
            ]
            .into_iter()
            .flatten()
            .collect()
        });
        let mut points = Vec::new();
        for mesh in &meshes {
            for &grad_accum in &accums {
                for &remat in &remats {
                    for &offload in &offloads {
                        for &key_block in &key_blocks {
                            for &loss_chunk in &loss_chunks {
                                for &mlp_chunk in &mlp_chunks {
                                    points.push(Knobs {
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
    /// layer, the most microbatches, key blocks, the loss in chunks and the MLP in tiles, each
    /// where the knob is searched; on a searched mesh of several devices, FSDP over them all
    /// and the sequence split over them (a context axis); with the offload searched, each of
    /// these with everything offloaded (the least device memory), then the activations, the
    /// frozen weights and nothing (less host memory, for a host budget that everything
    /// offloaded exceeds).
    pub fn least_memory(&self, devices: i64, batch: i64, seq: i64, rules: &Rules) -> Vec<Knobs> {
        let meshes = self.mesh.values(|| match devices <= 1 {
            true => vec![None],
            false => ["fsdp", "context"]
                .map(|axis| {
                    Some(MeshPlan {
                        axes: vec![(axis.to_string(), devices)],
                        rules: rules.clone(),
                    })
                })
                .to_vec(),
        });
        let frugal = Knobs {
            mesh: None,
            grad_accum: self.grad_accum.or_else(|| batch),
            remat: self.remat.or_else(|| Remat::Layer),
            offload: Offload::ALL,
            key_block: self
                .key_block
                .or_else(|| KeyBlocks::Size(DEFAULT_KEY_BLOCK)),
            loss_chunk: self.loss_chunk.or_else(|| loss_chunk_for(seq)),
            mlp_chunk: self
                .mlp_chunk
                .or_else(|| mlp_chunk_for(seq).map_or(MlpChunks::Off, MlpChunks::Size)),
        };
        let offloads = self.offload.values(|| {
            vec![
                Offload::ALL,
                Offload::ACTIVATIONS,
                Offload::FROZEN,
                Offload::NONE,
            ]
        });
        let mut points = Vec::new();
        for mesh in meshes {
            // The MLP's tiles cut the sequence, which a context axis splits already.
            let split = mesh.as_ref().is_some_and(|m| m.context_size() > 1);
            let mlp_chunk = match split && self.mlp_chunk.is_searched() {
                true => MlpChunks::Off,
                false => frugal.mlp_chunk,
            };
            for &offload in &offloads {
                points.push(Knobs {
                    mesh: mesh.clone(),
                    mlp_chunk,
                    offload,
                    ..frugal.clone()
                });
            }
        }
        points
    }
}

impl Knobs {
    /// The step options of these knobs over `base` (the flags the user gave).
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

    /// Every knob's flag by name, with its value as a user types it, or None where the step
    /// has none to give (no mesh on one device, no loss chunk): plan.json writes these as
    /// empty or `off`, the command line and the recipe leave them out.
    fn each(&self) -> [(&'static str, Option<String>); 7] {
        [
            ("mesh", self.mesh.as_ref().map(mesh_text)),
            ("grad-accum", Some(self.grad_accum.to_string())),
            ("remat", Some(self.remat.name().to_string())),
            ("offload", Some(self.offload.name().to_string())),
            ("key-block", Some(self.key_block.name())),
            ("loss-chunk", self.loss_chunk.map(|c| c.to_string())),
            ("mlp-chunk", Some(self.mlp_chunk.name())),
        ]
    }

    /// Every knob's flag by name and value, as plan.json has them (`mesh` empty on one device;
    /// `loss-chunk` off where there is none).
    pub fn flags(&self) -> Vec<(&'static str, String)> {
        self.each()
            .into_iter()
            .map(|(f, v)| {
                let none = if f == "mesh" { "" } else { "off" };
                (f, v.unwrap_or_else(|| none.to_string()))
            })
            .collect()
    }

    /// The flags a command line or a recipe gives for these knobs: those with a value.
    pub fn given(&self) -> Vec<(&'static str, String)> {
        self.each()
            .into_iter()
            .filter_map(|(f, v)| Some((f, v?)))
            .collect()
    }

    /// The flags in one line (`--mesh fsdp=4 --remat layer ...`).
    pub fn line(&self) -> String {
        self.given()
            .into_iter()
            .map(|(f, v)| format!("--{f} {v}"))
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// Whether these knobs' step needs no more `memory` than `other`'s, knob by knob, by the
    /// orders the search takes for granted: more microbatches, a chunked loss, MLP tiles and remat
    /// per layer (against save-proj) need less of both memories; more offload less device memory
    /// and more host memory. The mesh and the key block must be the same (their memory is not
    /// ordered).
    pub fn needs_no_more(&self, other: &Knobs, memory: Memory) -> bool {
        let offload = |a: Offload, b: Offload| {
            let within = |x: Offload, y: Offload| {
                (!x.frozen || y.frozen) && (!x.activations || y.activations)
            };
            match memory {
                Memory::Device => within(b, a),
                Memory::Host => within(a, b),
            }
        };
        let remat = self.remat == other.remat
            || (self.remat == Remat::Layer && other.remat == Remat::SaveProj);
        let loss = self.loss_chunk == other.loss_chunk || other.loss_chunk.is_none();
        let mlp = self.mlp_chunk == other.mlp_chunk || other.mlp_chunk == MlpChunks::Off;
        self.mesh == other.mesh
            && self.key_block == other.key_block
            && self.grad_accum >= other.grad_accum
            && remat
            && loss
            && mlp
            && offload(self.offload, other.offload)
    }

    /// How many knobs differ from `other`'s.
    pub fn differences(&self, other: &Knobs) -> usize {
        [
            self.mesh != other.mesh,
            self.grad_accum != other.grad_accum,
            self.remat != other.remat,
            self.offload != other.offload,
            self.key_block != other.key_block,
            self.loss_chunk != other.loss_chunk,
            self.mlp_chunk != other.mlp_chunk,
        ]
        .iter()
        .filter(|d| **d)
        .count()
    }
}

/// The two memories a point must fit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Memory {
    Device,
    Host,
}

impl Memory {
    pub fn name(self) -> &'static str {
        match self {
            Memory::Device => "device memory",
            Memory::Host => "host memory",
        }
    }
}

/// `data=2,fsdp=4`.
pub fn mesh_text(m: &MeshPlan) -> String {
    let axes: Vec<String> = m.axes.iter().map(|(n, s)| format!("{n}={s}")).collect();
    axes.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meshes_are_every_factorization_of_the_devices() {
        let rules = Rules::default();
        let texts: Vec<String> = meshes(4, &rules)
            .iter()
            .map(|m| mesh_text(m.as_ref().expect("a mesh")))
            .collect();
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

    /// The memory orders: more offload needs no more device memory and no less host memory;
    /// a chunked loss, MLP tiles, remat per layer and more microbatches need no more of either.
    #[test]
    fn the_memory_orders_of_the_knobs() {
        let rules = Rules::default();
        let low = Space::default().least_memory(1, 4, 64, &rules)[0].clone();
        let with = |f: &dyn Fn(&mut Knobs)| {
            let mut k = low.clone();
            f(&mut k);
            k
        };
        let less_offload = with(&|k| k.offload = Offload::ACTIVATIONS);
        assert!(low.needs_no_more(&less_offload, Memory::Device));
        assert!(!low.needs_no_more(&less_offload, Memory::Host));
        assert!(less_offload.needs_no_more(&low, Memory::Host));
        for bigger in [
            with(&|k| k.remat = Remat::SaveProj),
            with(&|k| k.loss_chunk = None),
            with(&|k| k.mlp_chunk = MlpChunks::Off),
            with(&|k| k.grad_accum = 2),
        ] {
            assert_eq!(low.differences(&bigger), 1);
            for m in [Memory::Device, Memory::Host] {
                assert!(low.needs_no_more(&bigger, m), "{bigger:?}");
                assert!(!bigger.needs_no_more(&low, m), "{bigger:?}");
            }
        }
        let other_block = with(&|k| k.key_block = KeyBlocks::Off);
        assert!(!low.needs_no_more(&other_block, Memory::Device));
        assert!(!other_block.needs_no_more(&low, Memory::Device));
    }

    /// A fixed knob is one value; a searched one its list: 2 remats x 4 offloads x 2 key
    /// blocks x 2 loss chunks x 2 MLP tiles on one device with a batch of one row.
    #[test]
    fn a_fixed_knob_is_not_searched() {
        let rules = Rules::default();
        assert_eq!(Space::default().points(1, 1, 64, &rules).len(), 64);
        let fixed = Space {
            remat: Knob::Fixed(Remat::Layer),
            offload: Knob::Fixed(Offload::NONE),
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
