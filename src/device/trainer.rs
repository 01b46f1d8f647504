//! A compiled training step with its state on the device: the frozen weights uploaded once, the
//! LoRA weights and AdamW moments donated to each step and returned updated, evaluation on the
//! same buffers, and the state read back for checkpoints.

use crate::data::Batch;
use crate::device::runtime::Runtime;
use crate::formats::host::convert;
use crate::formats::weights::FrozenWeights;
use crate::program::{self, Program, Role, StepSpec};
use anyhow::{bail, Context, Result};
use pjrt::{Buffer, CompileOptions, ElementType, Executable, HostTensor};
use std::collections::BTreeMap;
use std::time::Instant;

/// LoRA weights or AdamW moments by per-layer PEFT name.
pub type LoraState = BTreeMap<String, HostTensor>;

/// A compiled training step with its state on the device.
pub struct Trainer {
    pub rt: Runtime,
    pub program: Program,
    exe: Executable,
    /// Per argument, one buffer per device (its shard).
    pub(super) frozen: Vec<Vec<Buffer>>,
    /// LoRA params, then m, then v, in program order (the donated part); per device.
    pub(super) state: Vec<Vec<Buffer>>,
    /// Number of optimizer steps taken.
    pub step: u64,
    pub spec: StepSpec,
    /// Threefry key for LoRA dropout, advanced every step.
    pub dropout_seed: u64,
    /// The evaluation program, compiled on first use, with its results' shardings.
    eval_exe: Option<(Executable, Vec<hlo::Sharding>)>,
    /// Seconds spent compiling the step (or loading it from the cache).
    pub compile_s: f64,
    /// Whether the step came from the executable cache (else it was compiled).
    pub compile_cached: bool,
    /// The largest |LoRA weight| the last step's update computed (None: the program does not
    /// report it). Not finite when the program refused the update and kept the old state.
    pub last_max_weight: Option<f32>,
    /// The largest change of a LoRA weight the last step's update computed, and the largest
    /// |LoRA weight| before it (None: the program, from an earlier xtrain, does not report
    /// them). The program refused the update when the change is more than
    /// [`crate::model::optim::BLOWN_UP`] times the weight.
    pub last_update: Option<(f32, f32)>,
    /// Bytes of frozen weights each of this process's hosts' readers handed out (one entry for
    /// one host; see [`Runtime::hosts`]).
    pub frozen_bytes_read: Vec<u64>,
    /// Where loading the frozen weights spent its time.
    pub loading: crate::device::frozen::LoadFigures,
    /// A DPO step's reference adapter and log-probability programs (`device::preference`).
    pub(super) dpo: DpoState,
}

/// What a trainer holds for a DPO step.
#[derive(Default)]
pub(super) struct DpoState {
    /// The reference adapter's tensors on the devices, in LoRA argument order (each one buffer
    /// per device); empty unless `set_reference` was given one.
    pub(super) reference: Vec<Vec<Buffer>>,
    /// The log-probability program with LoRA arguments and without (the base model), compiled
    /// on first use for batches of that many rows.
    pub(super) with_lora: Option<(i64, Executable)>,
    pub(super) base: Option<(i64, Executable)>,
    /// The last step's rows' log-probabilities under the policy and the reference.
    pub(super) last: Option<(Vec<f32>, Vec<f32>)>,
}

impl Trainer {
    /// Whether the program refused the last step's update as blown up (see
    /// [`Trainer::last_update`]), computed as the program does (f32).
    pub fn last_update_blew_up(&self) -> bool {
        self.last_update.is_some_and(|(moved, before)| {
            // Not within the bound, NaN included (the program's `moved <= bound` is false).
            let bound = crate::model::optim::BLOWN_UP * before;
            !matches!(
                moved.partial_cmp(&bound),
                Some(std::cmp::Ordering::Less | std::cmp::Ordering::Equal)
            )
        })
    }
}

/// Loss and exact-match accuracy on held-out rows.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct EvalResult {
    pub loss: f64,
    pub accuracy: f64,
    pub rows: usize,
}

impl Trainer {
    /// Compile `program` (through the executable cache), upload the frozen weights one device's
    /// shard at a time (from a checkpoint or host tensors in the program's layout, see
    /// [`FrozenWeights`]) and the initial LoRA weights and AdamW moments (per-layer PEFT names;
    /// missing moments start at zero).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        rt: Runtime,
        spec: StepSpec,
        program: Program,
        weights: impl FrozenWeights,
        lora: &BTreeMap<String, HostTensor>,
        moments: &BTreeMap<String, HostTensor>,
        use_cache: bool,
        verbose: bool,
    ) -> Result<Trainer> {
        let one = vec![weights];
        Self::new_on_hosts(rt, spec, program, one, lora, moments, use_cache, verbose)
    }

    /// [`Trainer::new`] on the hosts [`Runtime::hosts`] says this process runs (one
    /// unless it says otherwise), each reading the frozen weights through its own reader
    /// (`weights`, one per host) and only the boxes its own devices hold, as a separate host
    /// would. The uploaded arguments are the same as one host's.
    #[allow(clippy::too_many_arguments)]
    pub fn new_on_hosts<W: FrozenWeights>(
        rt: Runtime,
        spec: StepSpec,
        program: Program,
        mut weights: Vec<W>,
        lora: &BTreeMap<String, HostTensor>,
        moments: &BTreeMap<String, HostTensor>,
        use_cache: bool,
        verbose: bool,
    ) -> Result<Trainer> {
        let hosts = rt.hosts.local_hosts();
        if weights.len() != hosts.len().max(1) {
            bail!(
                "{} weight readers for {} hosts in this process",
                weights.len(),
                hosts.len()
            );
        }
        // The positions this process holds, each with the reader of the host it belongs to
        // (all host 0's for one host).
        let held = rt.held(spec.mesh.as_ref().map_or(1, |m| m.devices()) as usize);
        let host_of: Vec<usize> = held
            .iter()
            .map(|p| hosts.iter().position(|h| h.contains(p)).unwrap_or(0))
            .collect();
        let t0 = Instant::now();
        let (exe, cached) = crate::device::cache::compile_cached(
            &rt,
            &program,
            &CompileOptions::default(),
            use_cache,
        )?;
        let compile_s = t0.elapsed().as_secs_f64();
        if verbose {
            let how = if cached {
                "loaded the compiled step from the cache"
            } else {
                "compiled the step"
            };
            crate::esay!(
                "xtrain: {how} in {compile_s:.2}s ({} bytes of StableHLO)",
                program.text.len()
            );
        }
        let loaded = crate::device::platform::while_loading(|| {
            crate::device::frozen::upload_frozen(
                &rt,
                &spec,
                &program,
                &mut weights,
                &held,
                &host_of,
            )
        })?;
        let mut trainer = Trainer {
            rt,
            program,
            exe,
            frozen: loaded.frozen,
            state: Vec::new(),
            step: 0,
            spec,
            dropout_seed: 0,
            eval_exe: None,
            compile_s,
            compile_cached: cached,
            last_max_weight: None,
            last_update: None,
            frozen_bytes_read: loaded.bytes_read,
            loading: loaded.figures,
            dpo: Default::default(),
        };
        trainer.set_state(lora, moments)?;
        Ok(trainer)
    }

    fn state_specs(&self) -> Vec<(String, Vec<i64>)> {
        self.program
            .args
            .iter()
            .filter(|a| matches!(a.role, Role::Lora | Role::AdamM | Role::AdamV))
            .map(|a| (a.name.clone(), a.shape.clone()))
            .collect()
    }

    /// Replace the LoRA weights and moments (per-layer names; missing moments start at zero).
    pub fn set_state(
        &mut self,
        lora: &BTreeMap<String, HostTensor>,
        moments: &BTreeMap<String, HostTensor>,
    ) -> Result<()> {
        let mut all = lora.clone();
        for t in crate::model::tensors::lora_tensors(&self.spec.model, &self.spec.lora) {
            for prefix in ["exp_avg", "exp_avg_sq"] {
                let name = format!("{prefix}.{}", t.name);
                let v = match moments.get(&name) {
                    Some(v) => v.clone(),
                    None => HostTensor::from_f32(
                        &vec![0.0; t.shape.iter().product::<i64>() as usize],
                        &t.shape,
                    ),
                };
                all.insert(name, v);
            }
        }
        let tensors = crate::formats::host::to_program_layout(
            &self.state_specs(),
            &all,
            self.spec.model.num_hidden_layers,
        )?;
        let shardings = self.state_shardings();
        let mesh = self.spec.mesh.as_ref().map(|m| m.mesh());
        self.state = tensors
            .iter()
            .zip(&shardings)
            .map(|(t, sh)| {
                self.rt
                    .upload_sharded(&convert(t, ElementType::F32)?, sh, mesh.as_ref())
            })
            .collect::<Result<_>>()?;
        Ok(())
    }

    fn state_shardings(&self) -> Vec<hlo::Sharding> {
        self.program
            .args
            .iter()
            .zip(self.program.arg_shardings(&self.spec))
            .filter(|(a, _)| matches!(a.role, Role::Lora | Role::AdamM | Role::AdamV))
            .map(|(_, s)| s)
            .collect()
    }

    /// Upload a per-step input (replicated or sharded by its name) to every device.
    pub(super) fn put(&self, name: &str, t: &HostTensor) -> Result<Vec<Buffer>> {
        match &self.spec.mesh {
            Some(m) => self
                .rt
                .upload_sharded(t, &m.sharding(name, &t.dims), Some(&m.mesh())),
            None => Ok(vec![self.rt.upload(t)?]),
        }
    }

    /// A batch tensor (`tensors`: one per host of this process, each from its own loader, or
    /// one for all): as one host puts it, or on hosts of a placement (virtual hosts, a run of
    /// several processes) each host its own rows.
    pub(super) fn put_rows(&self, name: &str, tensors: &[&HostTensor]) -> Result<Vec<Buffer>> {
        match (&self.spec.mesh, self.rt.hosts.placement()) {
            (Some(m), Some(placed)) => crate::device::hosts::share::upload_by_host(
                &self.rt,
                tensors,
                &m.sharding(name, &tensors[0].dims),
                &m.mesh(),
                &placed.local_hosts(),
            ),
            _ => self.put(name, tensors[0]),
        }
    }

    /// The number of devices this process runs the step on (its argument lists).
    pub(super) fn devices(&self) -> usize {
        self.rt.held(self.program.partitions.max(1) as usize).len()
    }

    /// Every mesh position's shard of a result from this process's (`mine`, one per position it
    /// holds): see [`crate::device::hosts::place::Hosts::whole`].
    fn whole(&self, mine: Vec<HostTensor>) -> Result<Option<Vec<HostTensor>>> {
        self.rt.hosts.whole(mine)
    }

    /// Refuse a batch that a kernel in use would compute wrongly (`device::kernels`).
    pub(super) fn check_kernel_rows(&self, batch: &Batch) -> Result<()> {
        crate::device::kernels::check_batch(&self.rt.kernels, &batch.attention_mask)
    }

    /// One optimizer step at learning rate `lr`. Returns (loss before the update, grad norm).
    pub fn step(&mut self, batch: &Batch, lr: f64) -> Result<(f32, f32)> {
        self.step_on_hosts(&[batch], lr)
    }

    /// [`Trainer::step`] with each of this process's hosts uploading its rows from the batch its
    /// own loader yielded (`batches`: one per host, or one for all).
    pub fn step_on_hosts(&mut self, batches: &[&Batch], lr: f64) -> Result<(f32, f32)> {
        let t = self.step + 1;
        for b in batches {
            self.check_kernel_rows(b)?;
        }
        let labels: Vec<HostTensor> = batches.iter().map(|b| b.loss_labels()).collect();
        let of = |f: fn(&Batch) -> &HostTensor| batches.iter().map(|b| f(b)).collect::<Vec<_>>();
        let mut inputs = vec![
            self.put("step", &HostTensor::from_f32(&[t as f32], &[]))?,
            self.put("lr", &HostTensor::from_f32(&[lr as f32], &[]))?,
            self.put_rows("input_ids", &of(|b| &b.input_ids))?,
            self.put_rows("labels", &labels.iter().collect::<Vec<_>>())?,
            self.put_rows("attention_mask", &of(|b| &b.attention_mask))?,
        ];
        if self.spec.lora.dropout > 0.0 {
            let k = [self.dropout_seed, t << 20];
            inputs.push(self.put(
                "dropout_key",
                &HostTensor {
                    ty: ElementType::U64,
                    dims: vec![2],
                    bytes: k.iter().flat_map(|v| v.to_le_bytes()).collect(),
                },
            )?);
        }
        inputs.extend(self.precomputed_reference(batches[0])?);
        let reference = self.reference_args()?;
        let args: Vec<Vec<&Buffer>> = (0..self.devices())
            .map(|d| {
                self.frozen
                    .iter()
                    .chain(&self.state)
                    .chain(&inputs)
                    .chain(reference)
                    .map(|per_device| &per_device[d])
                    .collect()
            })
            .collect();
        let out = self.exe.execute(&args)?;
        self.read_pair_results(&out)?;
        let n_state = self.state.len();
        // Loss and grad norm are replicated: read device 0's.
        let loss = out[0][n_state].to_host()?.scalar_f32()?;
        let grad_norm = out[0][n_state + 1].to_host()?.scalar_f32()?;
        // The guard's scalars are replicated too: read device 0's, by role.
        let scalar = |role: Role| -> Result<Option<f32>> {
            match self.program.results.iter().position(|r| r.role == role) {
                Some(k) => Ok(Some(out[0][k].to_host()?.scalar_f32()?)),
                None => Ok(None),
            }
        };
        self.last_max_weight = scalar(Role::MaxWeight)?;
        self.last_update = match (scalar(Role::MaxUpdate)?, scalar(Role::MaxWeightBefore)?) {
            (Some(moved), Some(before)) => Some((moved, before)),
            _ => None,
        };
        let mut per_arg: Vec<Vec<Buffer>> = (0..n_state).map(|_| Vec::new()).collect();
        for device_out in out {
            for (k, b) in device_out.into_iter().take(n_state).enumerate() {
                per_arg[k].push(b);
            }
        }
        self.state = per_arg;
        self.step = t;
        Ok((loss, grad_norm))
    }

    /// Mean loss over `batches` (summed CE / valid targets) and the fraction of rows whose every
    /// target token is the argmax prediction (what greedy decoding would reproduce exactly).
    /// None on a process of a run of several other than process 0 (which alone gets the
    /// results whole).
    pub fn evaluate(&mut self, batches: &[Batch]) -> Result<Option<EvalResult>> {
        if batches.is_empty() {
            bail!("no evaluation batches");
        }
        if self.eval_exe.is_none() {
            let mut spec = self.spec.clone();
            spec.batch = batches[0].dims().0;
            spec.grad_accum = 1;
            let program = program::build_eval(&spec)?;
            let (exe, _) = crate::device::cache::compile_cached(
                &self.rt,
                &program,
                &CompileOptions::default(),
                true,
            )?;
            self.eval_exe = Some((exe, program.result_shardings(&spec)));
        }
        let (exe, result_shardings) = self.eval_exe.as_ref().unwrap();
        let n_lora = self
            .program
            .args
            .iter()
            .filter(|a| a.role == Role::Lora)
            .count();
        let (mut total, mut count, mut rows, mut exact) = (0.0f64, 0.0f64, 0usize, 0usize);
        // False on a process that does not get the results whole (see above).
        let mut whole = true;
        let mesh = self.spec.mesh.as_ref().map(|m| m.mesh());
        for batch in batches {
            self.check_kernel_rows(batch)?;
            // Every host has the whole evaluation batch (each reads the evaluation data) and
            // uploads only its devices' rows of it, as with a training batch.
            let inputs = [
                self.put_rows("input_ids", &[&batch.input_ids])?,
                self.put_rows("labels", &[&batch.loss_labels()])?,
                self.put_rows("attention_mask", &[&batch.attention_mask])?,
            ];
            let args: Vec<Vec<&Buffer>> = (0..self.devices())
                .map(|d| {
                    self.frozen
                        .iter()
                        .chain(&self.state[..n_lora])
                        .chain(&inputs)
                        .map(|per| &per[d])
                        .collect()
                })
                .collect();
            let out = exe.execute(&args)?;
            let gather = |k: usize| -> Result<Option<Vec<f32>>> {
                let shards: Vec<HostTensor> = out
                    .iter()
                    .map(|o| o[k].to_host())
                    .collect::<std::result::Result<_, _>>()?;
                let Some(shards) = self.whole(shards)? else {
                    return Ok(None);
                };
                let dims = vec![batch.dims().0, batch.dims().1];
                Ok(Some(
                    match &mesh {
                        Some(m) => {
                            crate::device::shards::unshard(&shards, &dims, &result_shardings[k], m)?
                        }
                        None => shards[0].clone(),
                    }
                    .to_f32()?,
                ))
            };
            // Both gathered on every process, in the same order (a gather is a round for all).
            let (ce, correct) = match (gather(0)?, gather(1)?) {
                (Some(ce), Some(correct)) => (ce, correct),
                _ => {
                    whole = false;
                    continue;
                }
            };
            let lab = batch.loss_labels().to_i32()?;
            let t = batch.dims().1 as usize;
            for r in 0..batch.dims().0 as usize {
                let mut all = true;
                let mut any = false;
                for p in 0..t - 1 {
                    if lab[r * t + p + 1] != -100 {
                        any = true;
                        total += ce[r * t + p] as f64;
                        count += 1.0;
                        all &= correct[r * t + p] > 0.5;
                    }
                }
                if any {
                    rows += 1;
                    exact += all as usize;
                }
            }
        }
        Ok(whole.then_some(EvalResult {
            loss: total / count.max(1.0),
            accuracy: exact as f64 / rows.max(1) as f64,
            rows,
        }))
    }

    /// The current LoRA weights (per-layer PEFT names) and AdamW moments, on the host.
    pub fn state_to_host(&self) -> Result<(LoraState, LoraState)> {
        self.state_on_host()?.context(
            "the LoRA state is gathered on process 0 of the run; this process does not get it",
        )
    }

    /// [`Trainer::state_to_host`] in a run of several processes, where every process calls it
    /// (each hands over its shards) and process 0 alone gets the state: None on the others.
    pub fn state_on_host(&self) -> Result<Option<(LoraState, LoraState)>> {
        let mesh = self.spec.mesh.as_ref().map(|m| m.mesh());
        let shardings = self.state_shardings();
        let named: Vec<Option<(String, HostTensor)>> = self
            .state_specs()
            .into_iter()
            .zip(&self.state)
            .zip(&shardings)
            .map(|(((n, shape), bufs), sh)| {
                let shards: Vec<HostTensor> = bufs
                    .iter()
                    .map(|b| b.to_host())
                    .collect::<std::result::Result<_, _>>()?;
                let Some(shards) = self.whole(shards)? else {
                    return Ok(None);
                };
                let t = match &mesh {
                    Some(m) => crate::device::shards::unshard(&shards, &shape, sh, m)?,
                    None => shards.into_iter().next().context("no shard")?,
                };
                Ok(Some((n, t)))
            })
            .collect::<Result<Vec<Option<_>>>>()?;
        // Every tensor was gathered (every process took part); only process 0 holds them.
        let Some(named) = named.into_iter().collect::<Option<Vec<_>>>() else {
            return Ok(None);
        };
        let all = crate::formats::host::from_program_layout(named);
        let (moments, lora): (BTreeMap<_, _>, BTreeMap<_, _>) =
            all.into_iter().partition(|(n, _)| n.starts_with("exp_avg"));
        Ok(Some((lora, moments)))
    }
}

/// The DPO step's own arguments and results.
impl Trainer {
    /// Whether the step's program takes the reference adapter.
    fn takes_reference_adapter(&self) -> bool {
        self.program
            .args
            .iter()
            .any(|a| a.role == Role::ReferenceLora)
    }

    /// A DPO step's arguments after the per-step inputs: the precomputed reference
    /// log-probabilities of `batch` (an argument of a `--precompute-reference` step), as
    /// buffers one per device.
    fn precomputed_reference(&self, batch: &Batch) -> Result<Option<Vec<Buffer>>> {
        if !self
            .program
            .args
            .iter()
            .any(|a| a.role == Role::ReferenceLogps)
        {
            return Ok(None);
        }
        let Some(t) = &batch.reference_logps else {
            bail!(
                "this step takes the reference's precomputed log-probabilities \
                 (--precompute-reference), but the batch carries none"
            );
        };
        Ok(Some(self.put("precomputed_reference_logps", t)?))
    }

    /// The reference adapter's buffers, where the step takes them (after every other argument).
    fn reference_args(&self) -> Result<&[Vec<Buffer>]> {
        if !self.takes_reference_adapter() {
            return Ok(&[]);
        }
        if self.dpo.reference.is_empty() {
            bail!("this step compares with the starting adapter (--reference start), but none was given");
        }
        Ok(&self.dpo.reference)
    }

    /// Read the rows' log-probabilities a DPO step returned (replicated: this process's first
    /// device's).
    fn read_pair_results(&mut self, out: &[Vec<Buffer>]) -> Result<()> {
        let read = |role: Role| -> Result<Option<Vec<f32>>> {
            match self.program.results.iter().position(|r| r.role == role) {
                Some(k) => Ok(Some(out[0][k].to_host()?.to_f32()?)),
                None => Ok(None),
            }
        };
        self.dpo.last = match (read(Role::Logps)?, read(Role::ReferenceLogps)?) {
            (Some(p), Some(r)) => Some((p, r)),
            _ => None,
        };
        Ok(())
    }

    /// The last DPO step's rows' log-probabilities under the policy and the reference.
    pub fn last_logps(&self) -> Option<&(Vec<f32>, Vec<f32>)> {
        self.dpo.last.as_ref()
    }
}
