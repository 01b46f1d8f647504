//! Compile targets: hardware named on the command line, which need not be present.
//!
//! `tpu:<generation>:<chips>` names a TPU slice the way libtpu does (`tpu:v5p:2x2x1`,
//! `tpu:v5e:2x2`, `tpu:v6e:16x16`); `cuda:<device>:<count>` and `rocm:<device>:<count>` name a
//! number of GPUs of a built-in description (`cuda:h100:8`, `cuda:h100:2x8` = 2 hosts of 8,
//! `rocm:mi300x:8`), or of any GPU described in a file (`--target-config`). A target becomes the
//! plugin to load and the topology to create on it; the program itself does not know targets
//! exist. Uses only the `pjrt` crate.

use anyhow::{bail, Context, Result};
use pjrt::Value;
use std::path::Path;

/// The platforms a target can name, each compiled by its own PJRT plugin.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Platform {
    Tpu,
    Cuda,
    Rocm,
}

impl Platform {
    /// The plugin name `pjrt::discover` knows it by.
    pub fn plugin(self) -> &'static str {
        match self {
            Platform::Tpu => "tpu",
            Platform::Cuda => "cuda",
            Platform::Rocm => "rocm",
        }
    }
}

/// A GPU's compute architecture as XLA's GPU compilers take it.
#[derive(Clone, Copy, Debug)]
pub enum GpuArch {
    /// NVIDIA compute capability (major, minor).
    Cuda(u32, u32),
    /// AMD GCN architecture name with its features.
    Rocm(&'static str),
}

/// A GPU described from its public specification, in the terms of XLA's `GpuDeviceInfoProto`.
/// Memory sizes are what the driver reports as the device's total memory.
#[derive(Clone, Copy, Debug)]
pub struct GpuModel {
    /// The name used in `--target` (`cuda:<name>:<count>`).
    pub name: &'static str,
    /// The device kind as the driver reports it (what a PJRT client on the real GPU calls it).
    pub kind: &'static str,
    pub arch: GpuArch,
    /// Streaming multiprocessors (NVIDIA) or compute units (AMD).
    pub cores: u32,
    pub memory_bytes: i64,
    pub bandwidth_bytes_per_s: i64,
    pub l2_bytes: i64,
    pub clock_ghz: f64,
    pub threads_per_warp: u32,
    pub threads_per_core: u32,
    pub fpus_per_core: u32,
    pub shared_per_block: u32,
    pub shared_per_block_optin: u32,
    pub shared_per_core: u32,
    pub registers_per_core: u32,
    pub registers_per_block: u32,
    /// Dense bf16 matrix throughput (TFLOP/s), for model-FLOPs utilisation figures.
    pub peak_bf16_tflops: f64,
}

const KIB: u32 = 1024;

/// Built-in GPU descriptions (vendor data sheets: SM/CU count, memory, bandwidth, L2, boost
/// clock, shared memory per SM and per block; dense bf16 tensor throughput without sparsity).
pub const GPUS: &[GpuModel] = &[
    GpuModel {
        name: "h100",
        kind: "NVIDIA H100 80GB HBM3",
        arch: GpuArch::Cuda(9, 0),
        cores: 132,
        memory_bytes: 81559 << 20,
        bandwidth_bytes_per_s: 3_352_000_000_000,
        l2_bytes: 50 << 20,
        clock_ghz: 1.98,
        threads_per_warp: 32,
        threads_per_core: 2048,
        fpus_per_core: 128,
        shared_per_block: 48 * KIB,
        shared_per_block_optin: 227 * KIB,
        shared_per_core: 228 * KIB,
        registers_per_core: 65536,
        registers_per_block: 65536,
        peak_bf16_tflops: 989.0,
    },
    GpuModel {
        name: "h200",
        kind: "NVIDIA H200",
        arch: GpuArch::Cuda(9, 0),
        cores: 132,
        memory_bytes: 143771 << 20,
        bandwidth_bytes_per_s: 4_800_000_000_000,
        l2_bytes: 50 << 20,
        clock_ghz: 1.98,
        threads_per_warp: 32,
        threads_per_core: 2048,
        fpus_per_core: 128,
        shared_per_block: 48 * KIB,
        shared_per_block_optin: 227 * KIB,
        shared_per_core: 228 * KIB,
        registers_per_core: 65536,
        registers_per_block: 65536,
        peak_bf16_tflops: 989.0,
    },
    GpuModel {
        name: "a100-80g",
        kind: "NVIDIA A100-SXM4-80GB",
        arch: GpuArch::Cuda(8, 0),
        cores: 108,
        memory_bytes: 81920 << 20,
        bandwidth_bytes_per_s: 2_039_000_000_000,
        l2_bytes: 40 << 20,
        clock_ghz: 1.41,
        threads_per_warp: 32,
        threads_per_core: 2048,
        fpus_per_core: 64,
        shared_per_block: 48 * KIB,
        shared_per_block_optin: 163 * KIB,
        shared_per_core: 164 * KIB,
        registers_per_core: 65536,
        registers_per_block: 65536,
        peak_bf16_tflops: 312.0,
    },
    GpuModel {
        name: "a100-40g",
        kind: "NVIDIA A100-SXM4-40GB",
        arch: GpuArch::Cuda(8, 0),
        cores: 108,
        memory_bytes: 40960 << 20,
        bandwidth_bytes_per_s: 1_555_000_000_000,
        l2_bytes: 40 << 20,
        clock_ghz: 1.41,
        threads_per_warp: 32,
        threads_per_core: 2048,
        fpus_per_core: 64,
        shared_per_block: 48 * KIB,
        shared_per_block_optin: 163 * KIB,
        shared_per_core: 164 * KIB,
        registers_per_core: 65536,
        registers_per_block: 65536,
        peak_bf16_tflops: 312.0,
    },
    GpuModel {
        name: "l40s",
        kind: "NVIDIA L40S",
        arch: GpuArch::Cuda(8, 9),
        cores: 142,
        memory_bytes: 46068 << 20,
        bandwidth_bytes_per_s: 864_000_000_000,
        l2_bytes: 96 << 20,
        clock_ghz: 2.52,
        threads_per_warp: 32,
        threads_per_core: 1536,
        fpus_per_core: 128,
        shared_per_block: 48 * KIB,
        shared_per_block_optin: 99 * KIB,
        shared_per_core: 100 * KIB,
        registers_per_core: 65536,
        registers_per_block: 65536,
        peak_bf16_tflops: 362.0,
    },
    GpuModel {
        name: "rtx4090",
        kind: "NVIDIA GeForce RTX 4090",
        arch: GpuArch::Cuda(8, 9),
        cores: 128,
        memory_bytes: 24564 << 20,
        bandwidth_bytes_per_s: 1_008_000_000_000,
        l2_bytes: 72 << 20,
        clock_ghz: 2.52,
        threads_per_warp: 32,
        threads_per_core: 1536,
        fpus_per_core: 128,
        shared_per_block: 48 * KIB,
        shared_per_block_optin: 99 * KIB,
        shared_per_core: 100 * KIB,
        registers_per_core: 65536,
        registers_per_block: 65536,
        peak_bf16_tflops: 165.2,
    },
    GpuModel {
        name: "mi300x",
        kind: "AMD Instinct MI300X",
        arch: GpuArch::Rocm("gfx942:sramecc+:xnack-"),
        cores: 304,
        memory_bytes: 196_288 << 20,
        bandwidth_bytes_per_s: 5_300_000_000_000,
        l2_bytes: 4 << 20,
        clock_ghz: 2.1,
        threads_per_warp: 64,
        threads_per_core: 2048,
        fpus_per_core: 128,
        shared_per_block: 64 * KIB,
        shared_per_block_optin: 64 * KIB,
        shared_per_core: 64 * KIB,
        registers_per_core: 65536,
        registers_per_block: 65536,
        peak_bf16_tflops: 1307.4,
    },
    GpuModel {
        name: "mi325x",
        kind: "AMD Instinct MI325X",
        arch: GpuArch::Rocm("gfx942:sramecc+:xnack-"),
        cores: 304,
        memory_bytes: 262_144 << 20,
        bandwidth_bytes_per_s: 6_000_000_000_000,
        l2_bytes: 4 << 20,
        clock_ghz: 2.1,
        threads_per_warp: 64,
        threads_per_core: 2048,
        fpus_per_core: 128,
        shared_per_block: 64 * KIB,
        shared_per_block_optin: 64 * KIB,
        shared_per_core: 64 * KIB,
        registers_per_core: 65536,
        registers_per_block: 65536,
        peak_bf16_tflops: 1307.4,
    },
];

impl GpuModel {
    fn platform(&self) -> Platform {
        match self.arch {
            GpuArch::Cuda(..) => Platform::Cuda,
            GpuArch::Rocm(_) => Platform::Rocm,
        }
    }

    /// The description in the text form of XLA's `GpuTargetConfigProto`, using only fields the
    /// pinned plugins know (an unknown field fails the plugin's parse).
    pub fn target_config(&self) -> String {
        let (arch, platform, dnn) = match self.arch {
            GpuArch::Cuda(major, minor) => (
                format!("cuda_compute_capability {{ major: {major} minor: {minor} }}"),
                "CUDA",
                // cuDNN 9, which the CUDA 13 plugins are built against.
                "dnn_version_info { major: 9 minor: 8 patch: 0 }",
            ),
            GpuArch::Rocm(name) => (
                format!("rocm_compute_capability {{ gcn_arch_name: \"{name}\" }}"),
                "ROCM",
                "dnn_version_info { major: 3 minor: 5 patch: 0 }",
            ),
        };
        format!(
            "gpu_device_info {{\n  {arch}\n  threads_per_block_limit: 1024\n  \
             threads_per_warp: {}\n  shared_memory_per_block: {}\n  \
             shared_memory_per_block_optin: {}\n  shared_memory_per_core: {}\n  \
             threads_per_core_limit: {}\n  core_count: {}\n  fpus_per_core: {}\n  \
             block_dim_limit_x: 2147483647\n  block_dim_limit_y: 65535\n  \
             block_dim_limit_z: 65535\n  memory_bandwidth: {}\n  l2_cache_size: {}\n  \
             clock_rate_ghz: {}\n  device_memory_size: {}\n  registers_per_core_limit: {}\n  \
             registers_per_block_limit: {}\n}}\nplatform_name: \"{platform}\"\n{dnn}\n\
             device_description_str: \"{}\"\n",
            self.threads_per_warp,
            self.shared_per_block,
            self.shared_per_block_optin,
            self.shared_per_core,
            self.threads_per_core,
            self.cores,
            self.fpus_per_core,
            self.bandwidth_bytes_per_s,
            self.l2_bytes,
            self.clock_ghz,
            self.memory_bytes,
            self.registers_per_core,
            self.registers_per_block,
            self.kind,
        )
    }
}

/// A TPU generation as libtpu names it, with its dense bf16 throughput per chip (TFLOP/s).
pub struct TpuGeneration {
    pub name: &'static str,
    pub peak_bf16_tflops_per_chip: f64,
}

pub const TPUS: &[TpuGeneration] = &[
    TpuGeneration {
        name: "v4",
        peak_bf16_tflops_per_chip: 275.0,
    },
    TpuGeneration {
        name: "v5e",
        peak_bf16_tflops_per_chip: 197.0,
    },
    TpuGeneration {
        name: "v5p",
        peak_bf16_tflops_per_chip: 459.0,
    },
    TpuGeneration {
        name: "v6e",
        peak_bf16_tflops_per_chip: 918.0,
    },
    TpuGeneration {
        name: "tpu7x",
        peak_bf16_tflops_per_chip: 2307.0,
    },
];

/// Hardware to compile for, as named on the command line.
#[derive(Clone, Debug)]
pub struct Target {
    /// As the user wrote it, e.g. `cuda:h100:2x8`.
    pub spec: String,
    pub platform: Platform,
    /// The plugin's topology name (libtpu: `v5p:2x2x1`; the GPU plugins ignore it).
    pub topology_name: String,
    /// `PJRT_TopologyDescription_Create` options.
    pub create_options: Vec<(String, Value)>,
    /// Chips (TPU) or GPUs in all.
    pub chips: i64,
    /// Dense bf16 throughput per chip, TFLOP/s, where known.
    pub peak_bf16_tflops_per_chip: Option<f64>,
}

/// Every name `--target` knows, for error messages.
pub fn known_targets() -> String {
    let tpus: Vec<String> = TPUS
        .iter()
        .map(|t| format!("tpu:{}:<chips>", t.name))
        .collect();
    let gpus: Vec<String> = GPUS
        .iter()
        .map(|g| format!("{}:{}:<count>", g.platform().plugin(), g.name))
        .collect();
    format!(
        "{}, {} (e.g. tpu:v5p:2x2x1, tpu:v5e:2x2, cuda:h100:8, cuda:h100:2x8, rocm:mi300x:8; \
         cuda:<name>:<count> or rocm:<name>:<count> with --target-config FILE for another GPU)",
        tpus.join(", "),
        gpus.join(", ")
    )
}

/// `8` or `<hosts>x<devices per host>`: (hosts, devices per host).
fn parse_count(s: &str, spec: &str) -> Result<(i64, i64)> {
    let parts: Vec<&str> = s.split('x').collect();
    let nums: Vec<i64> = parts
        .iter()
        .map(|p| p.parse::<i64>().ok().filter(|&n| n > 0))
        .collect::<Option<_>>()
        .with_context(|| {
            format!(
                "--target {spec}: the device count `{s}` must be a positive number of devices \
                 per host (`8`) or <hosts>x<devices per host> (`2x8`)"
            )
        })?;
    match nums[..] {
        [n] => Ok((1, n)),
        [h, n] => Ok((h, n)),
        _ => bail!(
            "--target {spec}: the device count `{s}` must be `<devices>` or `<hosts>x<devices>`"
        ),
    }
}

impl Target {
    /// Parse `--target` (and `--target-config`, a GPU description file in the text form of
    /// XLA's `GpuTargetConfigProto`, as in XLA's `gpu_specs` folder).
    pub fn parse(spec: &str, config_file: Option<&Path>) -> Result<Target> {
        let parts: Vec<&str> = spec.splitn(3, ':').collect();
        let [platform, device, count] = parts[..] else {
            bail!(
                "--target {spec}: expected <platform>:<device>:<count>; known targets: {}",
                known_targets()
            );
        };
        match platform {
            "tpu" => {
                if config_file.is_some() {
                    bail!("--target-config describes a GPU; a TPU target takes none (--target {spec})");
                }
                Self::tpu(spec, device, count)
            }
            "cuda" | "rocm" => Self::gpu(spec, platform, device, count, config_file),
            _ => bail!(
                "--target {spec}: unknown platform `{platform}`; known targets: {}",
                known_targets()
            ),
        }
    }

    fn tpu(spec: &str, generation: &str, dims: &str) -> Result<Target> {
        let gen = TPUS
            .iter()
            .find(|t| t.name == generation)
            .with_context(|| {
                format!(
                    "--target {spec}: unknown TPU generation `{generation}`; known targets: {}",
                    known_targets()
                )
            })?;
        let sizes: Option<Vec<i64>> = dims
            .split('x')
            .map(|d| d.parse::<i64>().ok().filter(|&n| n > 0))
            .collect();
        let chips: i64 = match sizes {
            Some(s) if (2..=3).contains(&s.len()) => s.iter().product(),
            _ => bail!(
                "--target {spec}: the chip layout `{dims}` must be 2 or 3 positive sizes joined \
                 by `x`, as libtpu names slices (tpu:{generation}:2x2, tpu:{generation}:2x2x1)"
            ),
        };
        let mut create_options = Vec::new();
        if chips == 1 {
            // libtpu's default host holds 2x2 chips; one chip must say its host holds one.
            create_options.push(("chips_per_host_bounds".into(), Value::Ints(vec![1, 1, 1])));
        }
        Ok(Target {
            spec: spec.into(),
            platform: Platform::Tpu,
            topology_name: format!("{generation}:{dims}"),
            create_options,
            chips,
            peak_bf16_tflops_per_chip: Some(gen.peak_bf16_tflops_per_chip),
        })
    }

    fn gpu(
        spec: &str,
        platform: &str,
        device: &str,
        count: &str,
        config_file: Option<&Path>,
    ) -> Result<Target> {
        let platform = if platform == "cuda" {
            Platform::Cuda
        } else {
            Platform::Rocm
        };
        let (hosts, per_host) = parse_count(count, spec)?;
        let (config, peak) = match config_file {
            Some(file) => (read_target_config(file, platform)?, None),
            None => {
                let gpu = GPUS
                    .iter()
                    .find(|g| g.name == device && g.platform() == platform)
                    .with_context(|| {
                        format!(
                            "--target {spec}: no built-in description of a {} GPU `{device}` \
                             (describe it with --target-config FILE); known targets: {}",
                            platform.plugin(),
                            known_targets()
                        )
                    })?;
                (gpu.target_config(), Some(gpu.peak_bf16_tflops))
            }
        };
        Ok(Target {
            spec: spec.into(),
            platform,
            topology_name: String::new(),
            create_options: vec![
                // slices x hosts per slice x devices per host
                (
                    "topology".into(),
                    Value::Str(format!("1x{hosts}x{per_host}")),
                ),
                ("target_config".into(), Value::Str(config)),
            ],
            chips: hosts * per_host,
            peak_bf16_tflops_per_chip: peak,
        })
    }
}

/// Read a GPU description file, checking that it is for the target's platform and that the
/// fields XLA sizes the device by are there and make sense (a syntax error names its line;
/// the plugin's own parser would say neither where nor what).
fn read_target_config(file: &Path, platform: Platform) -> Result<String> {
    let text = std::fs::read_to_string(file)
        .with_context(|| format!("cannot read --target-config {}", file.display()))?;
    let at = file.display();
    let fields = text_proto::parse(&text).map_err(|e| {
        anyhow::anyhow!("--target-config {at}: {e} (expected a GpuTargetConfigProto in text form)")
    })?;
    let named = text_proto::get(&fields, "platform_name").map(|f| match &f.value {
        text_proto::Value::Scalar(s) => s.to_ascii_lowercase(),
        _ => String::new(),
    });
    let want = platform.plugin();
    match named.as_deref() {
        Some(p) if p == want => {}
        Some(p) => {
            bail!("--target-config {at}: platform_name is \"{p}\" but the target is a {want} GPU")
        }
        None => bail!(
            "--target-config {at}: no `platform_name: \"{}\"` line (a GpuTargetConfigProto in \
             text form, as in XLA's xla/tools/hlo_opt/gpu_specs/)",
            want.to_ascii_uppercase()
        ),
    }
    let Some(info) = text_proto::get(&fields, "gpu_device_info") else {
        bail!(
            "--target-config {at}: no gpu_device_info block (a GpuTargetConfigProto in text form)"
        );
    };
    let info_fields = info.value.fields();
    let (arch, arch_example) = match platform {
        Platform::Rocm => (
            "rocm_compute_capability",
            "rocm_compute_capability { gcn_arch_name: \"gfx942:sramecc+:xnack-\" }",
        ),
        _ => (
            "cuda_compute_capability",
            "cuda_compute_capability { major: 9 minor: 0 }",
        ),
    };
    let arch_given = text_proto::get(info_fields, arch).is_some_and(|f| {
        let inner = f.value.fields();
        match platform {
            Platform::Rocm => text_proto::get(inner, "gcn_arch_name").is_some(),
            _ => text_proto::get(inner, "major").is_some(),
        }
    });
    if !arch_given {
        bail!(
            "--target-config {at}: gpu_device_info (line {}) has no {arch}: XLA compiles for a \
             GPU architecture and cannot without one; add e.g. `{arch_example}` (`xtrain targets \
             {want}:<name>` prints a built-in description to start from)",
            info.line
        );
    }
    for (name, what) in [
        ("device_memory_size", "the device's memory in bytes"),
        ("core_count", "the number of SMs or compute units"),
    ] {
        let Some(f) = text_proto::get(info_fields, name) else {
            bail!(
                "--target-config {at}: gpu_device_info (line {}) has no {name} ({what})",
                info.line
            );
        };
        match text_proto::int(f) {
            Ok(v) if v > 0 => {}
            Ok(v) => bail!(
                "--target-config {at}: line {}: {name} is {v}, but it must be {what}, a positive \
                 number",
                f.line
            ),
            Err(why) => bail!("--target-config {at}: line {}: {name}: {why}", f.line),
        }
    }
    Ok(text)
}

/// The text form of a protocol buffer message, read far enough to check a GPU description
/// before a plugin sees it: fields with the line each starts on, values as written. Follows
/// protobuf's text format (`name: value`, `name { ... }` or `name < ... >`, `[a, b]` lists,
/// `#` comments, `,`/`;` separators, adjacent strings joined).
mod text_proto {
    use anyhow::{bail, Result};

    /// One field as written.
    #[derive(Debug)]
    pub struct Field {
        pub name: String,
        /// 1-based line the field's name is on.
        pub line: usize,
        pub value: Value,
    }

    #[derive(Debug)]
    pub enum Value {
        /// A number, identifier (enum value, `true`) or string (unquoted and unescaped).
        Scalar(String),
        Message(Vec<Field>),
        /// `[a, b]`: parsed so that a description may hold one; no field xtrain checks is one.
        #[allow(dead_code)]
        List(Vec<Value>),
    }

    impl Value {
        pub fn fields(&self) -> &[Field] {
            match self {
                Value::Message(f) => f,
                _ => &[],
            }
        }
    }

    /// The first field called `name` among `fields`.
    pub fn get<'a>(fields: &'a [Field], name: &str) -> Option<&'a Field> {
        fields.iter().find(|f| f.name == name)
    }

    #[derive(Clone, Debug, PartialEq)]
    enum Tok {
        /// A name, number or identifier.
        Word(String),
        Str(String),
        Punct(char),
    }

    fn describe(t: Option<&(Tok, usize)>) -> String {
        match t {
            None => "the end of the file".into(),
            Some((Tok::Word(w), _)) => format!("`{w}`"),
            Some((Tok::Str(s), _)) => format!("the string \"{s}\""),
            Some((Tok::Punct(c), _)) => format!("`{c}`"),
        }
    }

    fn tokens(text: &str) -> Result<Vec<(Tok, usize)>> {
        let mut out = Vec::new();
        let mut chars = text.chars().peekable();
        let mut line = 1;
        while let Some(&c) = chars.peek() {
            match c {
                '\n' => {
                    line += 1;
                    chars.next();
                }
                c if c.is_whitespace() => {
                    chars.next();
                }
                '#' => {
                    while chars.peek().is_some_and(|&c| c != '\n') {
                        chars.next();
                    }
                }
                '"' | '\'' => {
                    let start = line;
                    chars.next();
                    let mut s = String::new();
                    loop {
                        match chars.next() {
                            None | Some('\n') => {
                                bail!("line {start}: a string is not closed on its line")
                            }
                            Some('\\') => match chars.next() {
                                Some('n') => s.push('\n'),
                                Some('t') => s.push('\t'),
                                Some(e) => s.push(e),
                                None => bail!("line {start}: a string is not closed"),
                            },
                            Some(q) if q == c => break,
                            Some(x) => s.push(x),
                        }
                    }
                    out.push((Tok::Str(s), start));
                }
                ':' | '{' | '}' | '<' | '>' | '[' | ']' | ',' | ';' | '/' => {
                    out.push((Tok::Punct(c), line));
                    chars.next();
                }
                c if c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-' | '+') => {
                    let mut w = String::new();
                    while let Some(&c) = chars.peek() {
                        if c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-' | '+') {
                            w.push(c);
                            chars.next();
                        } else {
                            break;
                        }
                    }
                    out.push((Tok::Word(w), line));
                }
                other => bail!("line {line}: unexpected character `{other}`"),
            }
        }
        Ok(out)
    }

    struct Parser {
        toks: Vec<(Tok, usize)>,
        at: usize,
    }

    impl Parser {
        fn peek(&self) -> Option<&(Tok, usize)> {
            self.toks.get(self.at)
        }

        fn is(&self, c: char) -> bool {
            matches!(self.peek(), Some((Tok::Punct(p), _)) if *p == c)
        }

        /// The line of the next token, or of the last one at the end.
        fn line(&self) -> usize {
            self.peek().or(self.toks.last()).map_or(1, |(_, l)| *l)
        }

        /// Fields until `close` (None: the end of the file).
        fn message(&mut self, close: Option<(char, usize)>) -> Result<Vec<Field>> {
            let mut fields = Vec::new();
            loop {
                match (self.peek(), close) {
                    (None, None) => return Ok(fields),
                    (None, Some((c, opened))) => bail!(
                        "line {opened}: the `{}` opened here is never closed with `{c}`",
                        if c == '}' { '{' } else { '<' }
                    ),
                    (Some((Tok::Punct(p), _)), Some((c, _))) if *p == c => {
                        self.at += 1;
                        return Ok(fields);
                    }
                    _ => {}
                }
                fields.push(self.field()?);
                if self.is(',') || self.is(';') {
                    self.at += 1;
                }
            }
        }

        fn field(&mut self) -> Result<Field> {
            let line = self.line();
            let name = match self.peek().cloned() {
                Some((Tok::Word(w), _)) if !w.starts_with(|c: char| c.is_ascii_digit()) => {
                    self.at += 1;
                    w
                }
                // An extension or Any type URL: [pkg.ext] or [type.googleapis.com/pkg.Msg].
                Some((Tok::Punct('['), _)) => {
                    self.at += 1;
                    let mut n = String::from("[");
                    loop {
                        match self.peek().cloned() {
                            Some((Tok::Word(w), _)) => n.push_str(&w),
                            Some((Tok::Punct('/'), _)) => n.push('/'),
                            Some((Tok::Punct(']'), _)) => break,
                            t => bail!(
                                "line {}: expected an extension name, found {}",
                                self.line(),
                                describe(t.as_ref())
                            ),
                        }
                        self.at += 1;
                    }
                    self.at += 1;
                    n.push(']');
                    n
                }
                t => bail!(
                    "line {line}: expected a field name, found {}",
                    describe(t.as_ref())
                ),
            };
            let colon = self.is(':');
            if colon {
                self.at += 1;
            }
            let value = if self.is('{') || self.is('<') || self.is('[') {
                self.value()?
            } else if colon {
                self.scalar(&name)?
            } else {
                bail!(
                    "line {}: expected `:` or `{{` after `{name}`, found {}",
                    self.line(),
                    describe(self.peek())
                );
            };
            Ok(Field { name, line, value })
        }

        /// A message, a list, or a scalar.
        fn value(&mut self) -> Result<Value> {
            let line = self.line();
            if self.is('{') || self.is('<') {
                let close = if self.is('{') { '}' } else { '>' };
                self.at += 1;
                return Ok(Value::Message(self.message(Some((close, line)))?));
            }
            if self.is('[') {
                self.at += 1;
                let mut items = Vec::new();
                if self.is(']') {
                    self.at += 1;
                    return Ok(Value::List(items));
                }
                loop {
                    items.push(self.value()?);
                    if self.is(',') {
                        self.at += 1;
                    } else if self.is(']') {
                        self.at += 1;
                        return Ok(Value::List(items));
                    } else {
                        bail!(
                            "line {}: expected `,` or `]` in the list opened on line {line}, found {}",
                            self.line(),
                            describe(self.peek())
                        );
                    }
                }
            }
            self.scalar("the list")
        }

        fn scalar(&mut self, of: &str) -> Result<Value> {
            match self.peek().cloned() {
                Some((Tok::Word(w), _)) => {
                    self.at += 1;
                    Ok(Value::Scalar(w))
                }
                Some((Tok::Str(mut s), _)) => {
                    self.at += 1;
                    // Adjacent strings are one.
                    while let Some((Tok::Str(more), _)) = self.peek().cloned() {
                        s.push_str(&more);
                        self.at += 1;
                    }
                    Ok(Value::Scalar(s))
                }
                t => bail!(
                    "line {}: expected a value for `{of}`, found {}",
                    self.line(),
                    describe(t.as_ref())
                ),
            }
        }
    }

    /// The fields of a message in text form, or the first syntax error, naming its line.
    pub fn parse(text: &str) -> Result<Vec<Field>> {
        let mut p = Parser {
            toks: tokens(text)?,
            at: 0,
        };
        p.message(None)
    }

    /// An integer field's value (decimal or 0x hex), or why not.
    pub fn int(f: &Field) -> std::result::Result<i64, String> {
        let Value::Scalar(s) = &f.value else {
            return Err("not a number".into());
        };
        let (neg, digits) = match s.strip_prefix('-') {
            Some(d) => (true, d),
            None => (false, s.strip_prefix('+').unwrap_or(s)),
        };
        let v = match digits
            .strip_prefix("0x")
            .or_else(|| digits.strip_prefix("0X"))
        {
            Some(hex) => i64::from_str_radix(hex, 16),
            None => digits.parse::<i64>(),
        }
        .map_err(|_| format!("`{s}` is not an integer"))?;
        Ok(if neg { -v } else { v })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_documented_forms() {
        let t = Target::parse("tpu:v5p:4x4x4", None).unwrap();
        assert_eq!(
            (t.platform, t.topology_name.as_str(), t.chips),
            (Platform::Tpu, "v5p:4x4x4", 64)
        );
        let t = Target::parse("tpu:v5e:1x1", None).unwrap();
        assert_eq!(t.create_options[0].0, "chips_per_host_bounds");
        let t = Target::parse("cuda:h100:2x8", None).unwrap();
        assert_eq!(t.chips, 16);
        assert_eq!(t.create_options[0].1, Value::Str("1x2x8".into()));
        let t = Target::parse("rocm:mi300x:8", None).unwrap();
        assert_eq!(t.platform, Platform::Rocm);
        match &t.create_options[1].1 {
            Value::Str(s) => assert!(s.contains("gfx942") && s.contains("core_count: 304"), "{s}"),
            v => panic!("{v:?}"),
        }
    }

    /// The text format's forms parse (comments, `<>` blocks, lists, separators, extension
    /// names, joined strings, hex); errors name their line.
    #[test]
    fn text_protos_parse_in_every_form_and_errors_name_the_line() {
        let fields = text_proto::parse(
            "# a comment\na { b: 0x10, c < d: \"x\" 'y' >; }\nlist: [1, 2] [ext.name] { e: f }\n",
        )
        .unwrap();
        let a = text_proto::get(&fields, "a").unwrap();
        assert_eq!(a.line, 2);
        assert_eq!(
            text_proto::int(text_proto::get(a.value.fields(), "b").unwrap()),
            Ok(16)
        );
        let c = text_proto::get(a.value.fields(), "c").unwrap();
        match &text_proto::get(c.value.fields(), "d").unwrap().value {
            text_proto::Value::Scalar(s) => assert_eq!(s, "xy"),
            v => panic!("{v:?}"),
        }
        assert!(matches!(
            text_proto::get(&fields, "list").unwrap().value,
            text_proto::Value::List(ref l) if l.len() == 2
        ));
        assert!(text_proto::get(&fields, "[ext.name]").is_some());
        for (text, says) in [
            (
                "a: 1\nb 2\n",
                "line 2: expected `:` or `{` after `b`, found `2`",
            ),
            (
                "a {\n b: 1\n",
                "line 1: the `{` opened here is never closed with `}`",
            ),
            ("a: 1\n}\n", "line 2: expected a field name, found `}`"),
            ("a: \"open\n", "line 1: a string is not closed on its line"),
            (
                "a:\n",
                "line 1: expected a value for `a`, found the end of the file",
            ),
        ] {
            let e = text_proto::parse(text).unwrap_err().to_string();
            assert_eq!(e, says, "{text:?}");
        }
    }

    #[test]
    fn refuses_unknown_names_listing_the_known_ones() {
        for (spec, says) in [
            ("tpu:v9:2x2", "unknown TPU generation `v9`"),
            (
                "cuda:h999:8",
                "no built-in description of a cuda GPU `h999`",
            ),
            (
                "rocm:h100:8",
                "no built-in description of a rocm GPU `h100`",
            ),
            ("gpu:h100:8", "unknown platform `gpu`"),
            ("cuda:h100", "expected <platform>:<device>:<count>"),
        ] {
            let e = Target::parse(spec, None).unwrap_err().to_string();
            assert!(e.contains(says), "{spec}: {e}");
            assert!(
                e.contains("cuda:h100:<count>") || e.contains("expected"),
                "{e}"
            );
        }
        for (spec, says) in [
            ("cuda:h100:0", "positive number"),
            ("cuda:h100:-2", "positive number"),
            ("tpu:v5p:2xx2", "2 or 3 positive sizes"),
            ("tpu:v5p:8", "2 or 3 positive sizes"),
        ] {
            let e = Target::parse(spec, None).unwrap_err().to_string();
            assert!(e.contains(says), "{spec}: {e}");
        }
    }
}
