//! The frozen weights onto the devices, one device's shard at a time, in two threads: this one
//! reads each shard (cut out of the mapped checkpoint, converted or NF4-quantized on every core,
//! see [`FrozenWeights`]) while an uploader thread puts the shards read before it on their
//! devices. Between the two is a queue of at most [`QUEUE`] shards, so the host memory loading
//! holds besides the devices' buffers is the shard being read, those queued and the one being
//! uploaded (a few tensors), never the whole checkpoint. A box that a host's consecutive devices
//! hold alike (replicated) is read once and uploaded to each of them.
//!
//! On the CPU plugin, whose devices' memory is host memory, a shard's last upload hands the
//! shard's own memory to the plugin (PJRT's zero-copy host buffers, [`Runtime::upload_owned`])
//! instead of copying it into freshly allocated pages.

use crate::device::runtime::Runtime;
use crate::formats::host::element_type;
use crate::formats::weights::{FrozenWeights, ReadFigures};
use crate::program::sharding::shard_box;
use crate::program::{Program, Role, StepSpec};
use anyhow::{Context, Result};
use pjrt::{AlignedHost, Buffer, HostTensor};
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::Arc;
use std::time::Instant;

/// Shards read ahead of the upload at most.
pub const QUEUE: usize = 1;

/// The frozen weights on the devices, and what putting them there took.
pub struct Loaded {
    /// Per frozen argument, one buffer per device this process holds (in its held order).
    pub frozen: Vec<Vec<Buffer>>,
    /// Bytes of frozen weights each host's reader handed out.
    pub bytes_read: Vec<u64>,
    pub figures: LoadFigures,
}

/// Where loading's time went. Reading and uploading overlap, so their sum may exceed `wall_s`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LoadFigures {
    /// The readers' figures, together.
    pub read: ReadFigures,
    /// Seconds the uploader spent in the plugin's upload calls.
    pub upload_s: f64,
    /// Seconds from the first shard asked for to the last one on its device.
    pub wall_s: f64,
    /// Bytes put on the devices (a replicated shard counts once per device).
    pub uploaded: u64,
    /// Of those, bytes the plugin took over without a copy (zero-copy host buffers).
    pub handed_over: u64,
}

/// One upload: a shard of frozen argument `k` to mesh position `p`, into its memory of kind
/// `memory` (None: the device's own).
struct Job {
    k: usize,
    p: usize,
    memory: Option<hlo::MemoryKind>,
    shard: Shard,
}

/// A shard as read: in aligned memory where the plugin may take it as the buffer's own, else
/// plain. Shared by the uploads of the devices that hold the same box.
enum Shard {
    Plain(Arc<HostTensor>),
    Aligned(Arc<AlignedHost>),
}

impl Shard {
    fn len(&self) -> u64 {
        match self {
            Shard::Plain(t) => t.bytes.len() as u64,
            Shard::Aligned(t) => t.data().len() as u64,
        }
    }
}

impl Clone for Shard {
    fn clone(&self) -> Shard {
        match self {
            Shard::Plain(t) => Shard::Plain(t.clone()),
            Shard::Aligned(t) => Shard::Aligned(t.clone()),
        }
    }
}

/// Upload the frozen arguments of `program` to the mesh positions `held` (this process's, in
/// its order), each read by the reader of its host (`host_of[i]` indexes `weights`).
pub fn upload_frozen<W: FrozenWeights>(
    rt: &Runtime,
    spec: &StepSpec,
    program: &Program,
    weights: &mut [W],
    held: &[usize],
    host_of: &[usize],
) -> Result<Loaded> {
    let t0 = Instant::now();
    let mut bytes_read = vec![0u64; weights.len()];
    let count = program
        .args
        .iter()
        .filter(|a| a.role == Role::Frozen)
        .count();
    let (tx, rx) = sync_channel::<Job>(QUEUE);
    let (read, uploaded) = std::thread::scope(|s| {
        let uploader = s.spawn(move || upload_all(rt, rx, count));
        let read = read_all(
            (spec, program),
            weights,
            (held, host_of),
            &|memory| rt.takes_host_memory(memory),
            &mut bytes_read,
            |job| {
                // A closed queue means the uploader failed: its error is the one to report.
                tx.send(job).is_ok()
            },
        );
        drop(tx);
        let uploaded = uploader
            .join()
            .unwrap_or_else(|_| Err(anyhow::anyhow!("the upload thread panicked")));
        (read, uploaded)
    });
    let (frozen, mut figures) = match (read, uploaded) {
        (Err(e), _) => return Err(e),
        (Ok(()), Err(e)) => return Err(e),
        (Ok(()), Ok(u)) => u,
    };
    figures.read = ReadFigures::sum(weights.iter().map(|w| w.figures()));
    figures.wall_s = t0.elapsed().as_secs_f64();
    Ok(Loaded {
        frozen,
        bytes_read,
        figures,
    })
}

/// Read every frozen argument's shards in order (in aligned memory where `takes` says the
/// plugin takes host memory of that kind) and hand each upload to `send` (false: stop, the
/// uploader has failed).
fn read_all<W: FrozenWeights>(
    (spec, program): (&StepSpec, &Program),
    weights: &mut [W],
    (held, host_of): (&[usize], &[usize]),
    takes: &dyn Fn(Option<hlo::MemoryKind>) -> bool,
    bytes_read: &mut [u64],
    mut send: impl FnMut(Job) -> bool,
) -> Result<()> {
    let mesh = spec.mesh.as_ref().map(|m| m.mesh());
    let shardings = program.arg_shardings(spec);
    let frozen = program
        .args
        .iter()
        .zip(&shardings)
        .filter(|(a, _)| a.role == Role::Frozen);
    for (k, (a, sh)) in frozen.enumerate() {
        let want = element_type(a.dtype);
        // Host memory for offloaded frozen weights (--offload frozen), else the device's.
        let memory = a.memory(spec);
        // Each held position's box (the whole tensor without a mesh, on position 0).
        let boxes: Vec<(usize, usize, Vec<i64>, Vec<i64>)> = match &mesh {
            None => vec![(0, 0, vec![0; a.shape.len()], a.shape.clone())],
            Some(m) => held
                .iter()
                .zip(host_of)
                .map(|(&p, &g)| {
                    let (starts, sizes) = shard_box(&a.shape, sh, m, p);
                    (p, g, starts, sizes)
                })
                .collect(),
        };
        // Per host: the shard it read last, kept while its next device holds the same box.
        let mut last: Vec<Option<Shard>> = weights.iter().map(|_| None).collect();
        let aligned = takes(memory);
        for (i, (p, g, starts, sizes)) in boxes.iter().enumerate() {
            let shard = match last[*g].take() {
                Some(t) => t,
                None => {
                    let w = &mut weights[*g];
                    let t = if aligned {
                        Shard::Aligned(Arc::new(
                            w.shard_aligned(k, &a.name, &a.shape, starts, sizes, want)?,
                        ))
                    } else {
                        Shard::Plain(Arc::new(
                            w.shard(k, &a.name, &a.shape, starts, sizes, want)?,
                        ))
                    };
                    bytes_read[*g] += t.len();
                    t
                }
            };
            let next_same = boxes[i + 1..]
                .iter()
                .find(|b| b.1 == *g)
                .is_some_and(|b| (&b.2, &b.3) == (starts, sizes));
            if next_same {
                last[*g] = Some(shard.clone());
            }
            let job = Job {
                k,
                p: *p,
                memory,
                shard,
            };
            if !send(job) {
                return Ok(());
            }
        }
        for w in weights.iter_mut() {
            w.done(k);
        }
    }
    Ok(())
}

/// Upload what arrives until the queue closes: per argument, the buffers in the order sent.
fn upload_all(
    rt: &Runtime,
    rx: Receiver<Job>,
    count: usize,
) -> Result<(Vec<Vec<Buffer>>, LoadFigures)> {
    let mut frozen: Vec<Vec<Buffer>> = (0..count).map(|_| Vec::new()).collect();
    let mut figures = LoadFigures::default();
    for job in rx {
        let t = Instant::now();
        let bytes = job.shard.len();
        let buffer = match job.shard {
            Shard::Plain(t) => rt.upload_to(&t, job.p, job.memory)?,
            Shard::Aligned(t) => match Arc::try_unwrap(t) {
                // The last upload of this shard: its memory may become the device buffer's.
                Ok(shard) => {
                    let (buffer, kept) = rt.upload_owned(shard, job.p)?;
                    if kept {
                        figures.handed_over += bytes;
                    }
                    buffer
                }
                Err(shared) => rt.upload_copy(&shared, job.p)?,
            },
        };
        figures.upload_s += t.elapsed().as_secs_f64();
        figures.uploaded += bytes;
        frozen
            .get_mut(job.k)
            .context("an upload for an argument the program does not have")?
            .push(buffer);
    }
    Ok((frozen, figures))
}
