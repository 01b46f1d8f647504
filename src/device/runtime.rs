//! The device side: a PJRT client, compiled programs, host <-> device tensors.

use crate::cluster::gather::StoreGather;
use crate::device::hosts::place::{DeviceMap, Hosts};
use crate::device::platform::{gpu_memory_fraction, keep_freed_host_memory, named_platform};
use crate::formats::host::element_type;
use crate::program::Program;
use anyhow::{bail, Context, Result};
use pjrt::{
    Buffer, Client, ClientOptions, CompileOptions, Device, ElementType, Executable, HostTensor,
    Plugin,
};

/// What each device must be given: every argument's element type and shard shape.
pub fn expected_inputs(program: &Program) -> Vec<(ElementType, Vec<i64>)> {
    program
        .args
        .iter()
        .zip(&program.arg_shard_dims)
        .map(|(a, d)| (element_type(a.dtype), d.clone()))
        .collect()
}

/// A PJRT client on one backend.
pub struct Runtime {
    pub client: Client,
    pub devices: Vec<Device>,
    /// An executable compiled ahead of time for this plugin and these devices (a program dir's
    /// build, see [`Prebuilt`]), used instead of compiling its program.
    pub prebuilt: Option<Prebuilt>,
    /// Kernels put in place of the program's composites before it is compiled (`--kernel`,
    /// see [`crate::device::kernels`]).
    pub kernels: Vec<&'static crate::device::kernels::Kernel>,
    /// The program texts [`Runtime::kernels`] rewrote, each once.
    rewritten: crate::device::kernels::Rewritten,
    /// How this process runs the step's mesh (see [`Hosts`]): one host unless
    /// [`Runtime::place_virtual_hosts`] or [`Runtime::place_across_processes`] placed it; a
    /// process of a run of several has its own devices in [`Runtime::devices`], in the order of
    /// the positions it holds.
    pub hosts: Hosts,
    /// Whether [`Runtime::upload_owned`] may hand a shard's memory to the CPU plugin (true
    /// unless a caller measuring the loader's own memory apart from the devices' says not).
    pub zero_copy: bool,
}

/// This process's part of a client that spans a run of several processes: the plugin creates
/// it through the run's store, as node `node_id` of `num_nodes`.
pub struct InRun {
    pub store: std::sync::Arc<dyn pjrt::KeyValueStore>,
    pub node_id: usize,
    pub num_nodes: usize,
    /// The GPU plugins' `visible_devices`: which of this host's GPUs the process takes (all
    /// where `None`); two processes on one GPU (`[0]` each) is how the run is checked on one.
    pub visible_devices: Option<Vec<i64>>,
}

impl Runtime {
    /// Open the plugin (`cpu`, `cuda`, ..., a path, or `$XTRAIN_PLUGIN`; the CPU plugin is
    /// installed on first use) and create a client. `cpu_devices` sets the CPU plugin's number
    /// of virtual devices.
    pub fn open(plugin: Option<&str>, cpu_devices: Option<i64>) -> Result<Runtime> {
        Self::open_in(plugin, cpu_devices, None)
    }

    /// [`Runtime::open`], for one process of a run of several when `run` is given.
    pub fn open_in(
        plugin: Option<&str>,
        cpu_devices: Option<i64>,
        run: Option<InRun>,
    ) -> Result<Runtime> {
        let path = pjrt::discover::resolve_or_install(plugin)?;
        let name = path.to_string_lossy();
        // The same rule by name as `xtrain`'s commands use before they start (the policy must be
        // set before the plugin's threads exist, so its platform name comes too late).
        let cpu = named_platform(Some(&name)) == "cpu";
        let gpu = name.contains("cuda") || name.contains("rocm");
        if cpu {
            keep_freed_host_memory();
        }
        if named_platform(Some(&name)) == "tpu" && !crate::device::platform::has_tpu_devices() {
            bail!(
                "the TPU plugin {} needs TPU chips to run on, and this machine has none (no \
                 /dev/accel*); compile for a TPU that is not here with `xtrain compile --target \
                 tpu:<generation>:<chips> --check`",
                path.display()
            );
        }
        let options = match cpu_devices {
            Some(n) if cpu => ClientOptions::cpu_device_count(n),
            _ if gpu => ClientOptions::gpu_memory_fraction(gpu_memory_fraction()?),
            _ => ClientOptions::default(),
        };
        // The GPU plugins log absl's "before InitializeLog" warning and "Could not find cuda
        // drivers" as they load and look for devices, whatever TF_CPP_MIN_LOG_LEVEL says;
        // their errors come back as PJRT errors. Shown with -v.
        let quiet = gpu && !crate::device::platform::verbose();
        let plugin = crate::device::platform::quiet_unless(!quiet, || Plugin::load(&path))?;
        let client = crate::device::platform::quiet_unless(!quiet, || match run {
            Some(r) => {
                let mut options = options.distributed(r.node_id, r.num_nodes);
                if let Some(v) = r.visible_devices {
                    options
                        .options
                        .push(("visible_devices".into(), pjrt::Value::Ints(v)));
                }
                plugin.client_with_store(&options, r.store)
            }
            None => plugin.client(&options),
        });
        let client = client.map_err(|e| {
            let hint = if gpu {
                let platform = if name.contains("rocm") {
                    "rocm"
                } else {
                    "cuda"
                };
                format!(
                    ". If this machine has no {platform} GPU: compile for one with `xtrain \
                     compile --target {platform}:<name>:<count> --check` (`xtrain targets` \
                     lists the GPUs) and train its program dir where the GPU is, or train here \
                     on the CPU with --plugin cpu (-v shows the plugin's own log)"
                )
            } else {
                String::new()
            };
            anyhow::anyhow!(
                "cannot create a client for {}: {}{hint}",
                path.display(),
                if hint.is_empty() {
                    e.to_string()
                } else {
                    e.to_string().trim_end_matches('.').to_string()
                }
            )
        })?;
        let devices = client.devices()?;
        if devices.is_empty() {
            bail!("the plugin {} reports no devices", path.display());
        }
        Ok(Runtime {
            client,
            devices,
            prebuilt: None,
            kernels: Vec::new(),
            rewritten: Default::default(),
            hosts: Hosts::One,
            zero_copy: true,
        })
    }

    /// The platform the plugin reports (PJRT's name: `cpu`, `cuda`, `rocm`, `tpu`), for the
    /// compile options and messages: never for the program's text.
    pub fn platform(&self) -> String {
        self.client.platform_name().unwrap_or_default()
    }

    /// The options xtrain compiles with on this backend, on top of the caller's.
    ///
    /// On CPU, XLA computes bf16 matmuls in f32 and its while-loop invariant code motion then
    /// hoists the f32 conversion of a whole stacked weight out of the layer loop: 3x the weight
    /// memory. xtrain already builds loop-invariant values outside its loops, so the pass is off.
    /// XLA CPU's tree reduction rewriter splits every long reduction (the softmax over the
    /// vocabulary, RMSNorm's mean) into a chain of reduce-windows that cannot take their producer
    /// into the same loop; without it the step was 1-3% faster in three A/B runs on the benchmark
    /// (same loss to the last bit there; the oracle tests pass), so it is off too.
    pub fn options(&self, base: &CompileOptions) -> CompileOptions {
        let mut o = base.clone();
        if self.platform() == "cpu" && !o.overrides.contains_key("xla_disable_hlo_passes") {
            o = o.with_override(
                "xla_disable_hlo_passes",
                pjrt::OptionValue::String(
                    "while-loop-invariant-code-motion,tree_reduction_rewriter".into(),
                ),
            );
        }
        o
    }

    /// [`Runtime::compile`] with the usual options, XLA's optimized HLO written as text into
    /// `dump` when given (`compile --check --xla-dump DIR`).
    pub fn compile_dumping(
        &self,
        program: &Program,
        dump: Option<&std::path::Path>,
    ) -> Result<Executable> {
        let mut options = CompileOptions::default();
        if let Some(dir) = dump {
            std::fs::create_dir_all(dir)?;
            options = options.with_override(
                "xla_dump_to",
                pjrt::OptionValue::String(dir.to_string_lossy().into()),
            );
            options = options.with_override("xla_dump_hlo_as_text", pjrt::OptionValue::Bool(true));
        }
        self.compile(program, &options)
    }

    /// The devices a program of `partitions` partitions runs on, in partition order. A run of
    /// several processes (or virtual hosts): the placement's assignment, the same in every
    /// process. Otherwise a client spanning several processes compiles over every process's
    /// devices (each process then runs its own share), and any other over this process's.
    fn partition_devices(&self, partitions: i64) -> Result<Vec<i64>> {
        if let Some(placed) = self.hosts.placement() {
            if placed.ids.len() as i64 != partitions {
                bail!(
                    "the program needs {partitions} devices but the run places its step on {}",
                    placed.ids.len()
                );
            }
            return Ok(placed.ids.clone());
        }
        let global = self.client.global_devices()?;
        let devices = if global.len() > self.devices.len() {
            &global
        } else {
            &self.devices
        };
        if (devices.len() as i64) < partitions {
            bail!(
                "the program needs {partitions} devices but the plugin has {}",
                devices.len()
            );
        }
        Ok(devices[..partitions as usize]
            .iter()
            .map(|d| d.id().map(|i| i as i64))
            .collect::<std::result::Result<_, _>>()?)
    }

    /// Compile a program (on as many devices as it has partitions), checking its arguments on
    /// every execute.
    pub fn compile(&self, program: &Program, options: &CompileOptions) -> Result<Executable> {
        let program = &Program {
            text: self.kernel_text(program)?.text.clone(),
            ..program.clone()
        };
        let mut options = self.options(options);
        if program.partitions > 1 {
            options = options.partitioned_over(self.partition_devices(program.partitions)?);
        }
        let compile = |options: &CompileOptions| {
            self.client
                .compile(&program.text, options)
                .context("XLA could not compile the program")
        };
        let mut exe = match compile(&options) {
            Err(e)
                if matches!(self.platform().as_str(), "cuda" | "rocm")
                    && crate::device::platform::is_gemm_tiling_failure(&e) =>
            {
                let (options, said) = crate::device::platform::without_triton_gemm(&options);
                crate::esay!(
                    "xtrain: the {} compiler's Triton GEMM emitter could not tile a matmul of \
                     this program; compiling again with {said} (the same program)",
                    self.platform()
                );
                compile(&options)?
            }
            r => r?,
        };
        exe.expect_inputs(expected_inputs(program));
        Ok(exe)
    }

    /// The text this runtime's compiler sees for `program`: the program with [`Runtime::kernels`]
    /// in place of the composites they implement (each a composite of the program, or refused),
    /// and what they replaced. Rewritten on the first call for a program and kept: compiling,
    /// keying the cache and recording a build read the same text. Saying what was replaced is
    /// the caller's ([`crate::device::kernels::announce`]).
    pub fn kernel_text(
        &self,
        program: &Program,
    ) -> Result<std::sync::Arc<crate::device::kernels::Replaced>> {
        self.rewritten.get(&program.text, &self.kernels)
    }

    /// Choose the kernels `--kernel` names for this plugin's platform.
    pub fn use_kernels(&mut self, names: &[String]) -> Result<()> {
        self.kernels = crate::device::kernels::chosen(names, &self.platform())?;
        self.rewritten.clear();
        Ok(())
    }

    pub fn upload(&self, t: &HostTensor) -> Result<Buffer> {
        Ok(self.client.to_device(t, &self.devices[0])?)
    }

    /// Upload each device's shard of `t` (one buffer per partition). Only the shard is copied to
    /// each device.
    pub fn upload_sharded(
        &self,
        t: &HostTensor,
        sharding: &hlo::Sharding,
        mesh: Option<&hlo::Mesh>,
    ) -> Result<Vec<Buffer>> {
        self.upload_sharded_into(t, sharding, mesh, None)
    }

    /// [`Runtime::upload_sharded`] into a memory of each device other than its own (the
    /// `pinned_host` memory of an offloaded weight), where `memory` says so.
    pub fn upload_sharded_into(
        &self,
        t: &HostTensor,
        sharding: &hlo::Sharding,
        mesh: Option<&hlo::Mesh>,
        memory: Option<hlo::MemoryKind>,
    ) -> Result<Vec<Buffer>> {
        let put = |shard: &HostTensor, p: usize| self.upload_to(shard, p, memory);
        let Some(mesh) = mesh else {
            return Ok(vec![put(t, 0)?]);
        };
        self.held(mesh.device_count() as usize)
            .into_iter()
            .map(|p| {
                let (starts, sizes) =
                    crate::program::sharding::shard_box(&t.dims, sharding, mesh, p);
                let shard = crate::device::shards::slice(t, &starts, &sizes);
                put(&shard, p)
            })
            .collect()
    }

    /// Place a step of `partitions` devices over a client spanning a run of several
    /// processes: positions from the client's global devices and their process indices
    /// ([`DeviceMap::of_processes`]), and [`Runtime::devices`] (this process's) put in the order
    /// of the positions it holds; `gather` brings the others' shards to process 0.
    pub fn place_across_processes(&mut self, partitions: usize, gather: StoreGather) -> Result<()> {
        let described = |d: &Device| -> Result<(i64, usize)> {
            let x = d.description()?;
            Ok((x.id as i64, x.process_index.max(0) as usize))
        };
        let global: Vec<(i64, usize)> = self
            .client
            .global_devices()?
            .iter()
            .map(described)
            .collect::<Result<_>>()?;
        let mine: Vec<(i64, usize)> = self.devices.iter().map(described).collect::<Result<_>>()?;
        let Some(me) = mine.first().map(|d| d.1) else {
            bail!("this process has no devices of its own in the run");
        };
        let placed = DeviceMap::of_processes(&global, partitions, me)?;
        let mut ordered = Vec::new();
        for p in placed.held() {
            let id = placed.ids[p];
            let Some(k) = mine.iter().position(|d| d.0 == id) else {
                bail!(
                    "device {id} (mesh position {p}) belongs to process {me} by its process \
                     index but is not among this process's devices"
                );
            };
            ordered.push(self.devices[k].clone());
        }
        self.devices = ordered;
        self.hosts = Hosts::Processes {
            placement: placed,
            gather,
        };
        Ok(())
    }

    /// `--virtual-hosts hosts`: the first `partitions` of this process's devices placed as
    /// `hosts` hosts of equal size, with a store of their own (see [`Hosts::virtual_hosts`]).
    pub fn place_virtual_hosts(
        &mut self,
        hosts: usize,
        partitions: usize,
        timeout: std::time::Duration,
    ) -> Result<()> {
        if self.devices.len() < partitions {
            bail!(
                "--virtual-hosts {hosts}: the step needs {partitions} devices but the plugin has {}",
                self.devices.len()
            );
        }
        let ids = self.devices[..partitions]
            .iter()
            .map(|d| Ok(d.id()? as i64))
            .collect::<Result<Vec<i64>>>()?;
        self.hosts = Hosts::virtual_hosts(ids, hosts, timeout)?;
        Ok(())
    }

    /// The mesh positions (of a step over `devices`) this process holds, in the order of its
    /// argument lists: all of them unless [`Runtime::hosts`] says otherwise.
    pub fn held(&self, devices: usize) -> Vec<usize> {
        self.hosts.held(devices)
    }

    /// Which of [`Runtime::devices`] mesh position `p` is.
    fn slot(&self, p: usize) -> Result<usize> {
        self.hosts.slot(p)
    }

    /// Upload `t` (one device's shard) to device `p`, into its memory of kind `memory` (None:
    /// the device's own).
    pub fn upload_to(
        &self,
        t: &HostTensor,
        p: usize,
        memory: Option<hlo::MemoryKind>,
    ) -> Result<Buffer> {
        let p = self.slot(p)?;
        match memory {
            None => Ok(self.client.to_device(t, &self.devices[p])?),
            Some(kind) => {
                let m = self.memory(p, kind)?;
                Ok(self.client.to_memory(t, &m)?)
            }
        }
    }

    /// Whether uploads into memory of kind `memory` (None: the device's own) may hand host
    /// memory to the plugin instead of copying it: on the CPU plugin, whose devices' memory is
    /// host memory (unless [`Runtime::zero_copy`] is off).
    pub fn takes_host_memory(&self, memory: Option<hlo::MemoryKind>) -> bool {
        self.zero_copy && memory.is_none() && self.platform() == "cpu"
    }

    /// A shard this process no longer needs onto device `p` (a slot of [`Runtime::devices`]):
    /// where [`Runtime::takes_host_memory`], the plugin takes the shard's memory as the
    /// buffer's instead of copying it (PJRT's zero-copy host buffers; the buffer keeps it until
    /// it is destroyed). Returns the buffer and whether the plugin kept the memory (false: it
    /// copied it, and the shard is freed now).
    pub fn upload_owned(&self, t: pjrt::AlignedHost, p: usize) -> Result<(Buffer, bool)> {
        let slot = self.slot(p)?;
        if !self.takes_host_memory(None) {
            return Ok((self.client.to_device_copy(&t, &self.devices[slot])?, false));
        }
        Ok(self.client.to_device_owned(t, &self.devices[slot])?)
    }

    /// A copy of an aligned shard onto device `p` (one that other devices also take).
    pub fn upload_copy(&self, t: &pjrt::AlignedHost, p: usize) -> Result<Buffer> {
        let slot = self.slot(p)?;
        Ok(self.client.to_device_copy(t, &self.devices[slot])?)
    }

    /// Device `p`'s (a slot of [`Runtime::devices`]) memory of `kind`, or an error naming the
    /// kinds it has.
    fn memory(&self, p: usize, kind: hlo::MemoryKind) -> Result<pjrt::Memory> {
        let memories = self.devices[p].memories()?;
        let mut kinds = Vec::new();
        for m in memories {
            let k = m.kind()?;
            if k == kind.name() {
                return Ok(m);
            }
            kinds.push(k);
        }
        bail!(
            "device {p} of the {} plugin has no `{}` memory to offload to (its memory kinds: {}); \
             use --offload none",
            self.platform(),
            kind.name(),
            kinds.join(", ")
        )
    }
}

/// An executable compiled before the trainer asks for one (a program dir's, or the one
/// `--offload` was decided with), for the program whose text has `program_sha256`.
pub struct Prebuilt {
    pub program_sha256: String,
    pub executable: Vec<u8>,
    /// Where it comes from, for messages ("by `xtrain compile` for cuda:h100:8 (DIR/...)");
    /// empty: say nothing.
    pub from: String,
}
