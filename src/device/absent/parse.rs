//! `--target` read into a [`Target`]: hardware named on the command line, which need not be
//! present.
//!
//! `tpu:<generation>:<chips>` names a TPU slice the way libtpu does (`tpu:v5p:2x2x1`,
//! `tpu:v5e:2x2`, `tpu:v6e:16x16`); `cuda:<device>:<count>` and `rocm:<device>:<count>` name a
//! number of GPUs of a built-in description (`cuda:h100:8`, `cuda:h100:2x8` = 2 hosts of 8,
//! `rocm:mi300x:8`), or of any GPU described in a file (`--target-config`). A target becomes the
//! plugin to load and the topology to create on it; the program itself does not know targets
//! exist. Uses only the `pjrt` crate.

use crate::device::absent::builtin::{gpus, tpus};
use crate::device::absent::config_file::read_target_config;
use crate::device::absent::Platform;
use anyhow::{bail, Context, Result};
use pjrt::Value;
use std::path::Path;

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
    /// The host memory per chip of the machine such a chip usually sits in (`builtin.toml`),
    /// where known (not for a GPU described by a file).
    pub host_memory_per_chip: Option<i64>,
}

/// Every name `--target` knows, for error messages.
pub fn known_targets() -> String {
    let tpu_names: Vec<String> = tpus()
        .iter()
        .map(|t| format!("tpu:{}:<chips>", t.name))
        .collect();
    let gpu_names: Vec<String> = gpus()
        .iter()
        .map(|g| format!("{}:{}:<count>", g.platform().plugin(), g.name))
        .collect();
    format!(
        "{}, {} (e.g. tpu:v5p:2x2x1, tpu:v5e:2x2, cuda:h100:8, cuda:h100:2x8, rocm:mi300x:8; \
         cuda:<name>:<count> or rocm:<name>:<count> with --target-config FILE for another GPU)",
        tpu_names.join(", "),
        gpu_names.join(", ")
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
        if spec == "cpu" || spec.starts_with("cpu:") {
            bail!(
                "--target {spec}: the CPU is not a --target; it is what `xtrain compile` writes \
                 for without one (and compiles for with --check, with this machine's CPU plugin; \
                 --mesh gives it several devices): leave --target out"
            );
        }
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
        // One chip is a slice of one host of one chip, which libtpu names 1x1.
        let dims = if dims == "1" { "1x1" } else { dims };
        let gen = tpus()
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
        let chips: i64 = match &sizes {
            Some(s) if (2..=3).contains(&s.len()) => s.iter().product(),
            _ => bail!(
                "--target {spec}: the chip layout `{dims}` must be 2 or 3 positive sizes joined \
                 by `x`, as libtpu names slices (tpu:{generation}:2x2, tpu:{generation}:2x2x1)"
            ),
        };
        // libtpu's hosts hold 2x2 chips: a slice of more than one chip is whole hosts, its first
        // two sizes even (it refuses `v5e:2x1` or `v5e:2x3` only when asked to compile).
        let sizes = sizes.unwrap_or_default();
        if chips > 1 && sizes[..2].iter().any(|s| s % 2 != 0) {
            let even = |s: i64| s + s % 2;
            let fixed: Vec<String> = sizes
                .iter()
                .enumerate()
                .map(|(i, &s)| if i < 2 { even(s) } else { s }.to_string())
                .collect();
            bail!(
                "--target {spec}: the chip layout `{dims}` is not a {generation} slice: libtpu's \
                 hosts hold 2x2 chips, so a slice of more than one chip has two even first sizes \
                 (e.g. tpu:{generation}:{}), and one chip is tpu:{generation}:1x1",
                fixed.join("x")
            );
        }
        if chips > gen.max_chips {
            bail!(
                "--target {spec}: {chips} chips, but the largest {generation} slice (a full pod) \
                 has {}",
                gen.max_chips
            );
        }
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
            host_memory_per_chip: Some(gen.host_memory_gib_per_chip << 30),
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
        let (config, peak, host) = match config_file {
            Some(file) => (read_target_config(file, platform)?, None, None),
            None => {
                let gpu = gpus()
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
                (
                    gpu.target_config(),
                    Some(gpu.peak_bf16_tflops),
                    Some(gpu.host_memory_bytes),
                )
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
            host_memory_per_chip: host,
        })
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

    /// `--target cpu` says that the CPU is what compile gives without a target.
    #[test]
    fn the_cpu_as_a_target_says_it_is_what_no_target_gives() {
        for spec in ["cpu", "cpu:x86:4"] {
            let e = format!("{:#}", Target::parse(spec, None).unwrap_err());
            assert!(
                e.contains("what `xtrain compile` writes for without one")
                    && e.contains("leave --target out"),
                "{spec}: {e}"
            );
        }
    }

    /// A layout libtpu has no slice of (an odd size among the first two, with more than one
    /// chip) is refused when parsing, as libtpu would refuse it only with --check.
    #[test]
    fn a_tpu_layout_that_is_not_whole_hosts_is_refused_when_parsing() {
        for (spec, hint) in [
            ("tpu:v5e:2x1", "tpu:v5e:2x2"),
            ("tpu:v5e:2x3", "tpu:v5e:2x4"),
            ("tpu:v5p:1x2x1", "tpu:v5p:2x2x1"),
            ("tpu:v6e:3x3", "tpu:v6e:4x4"),
        ] {
            let e = format!("{:#}", Target::parse(spec, None).unwrap_err());
            assert!(
                e.contains("is not a") && e.contains("hosts hold 2x2 chips") && e.contains(hint),
                "{spec}: {e}"
            );
        }
        let one = Target::parse("tpu:v5e:1", None).unwrap();
        assert_eq!((one.chips, one.topology_name.as_str()), (1, "v5e:1x1"));
        for ok in [
            "tpu:v5e:1x1",
            "tpu:v5e:2x4",
            "tpu:v5p:2x2x1",
            "tpu:v5p:4x4x4",
            "tpu:v6e:16x16",
        ] {
            Target::parse(ok, None).unwrap();
        }
    }

    #[test]
    fn a_tpu_slice_larger_than_its_generations_pod_is_refused() {
        let e = format!(
            "{:#}",
            Target::parse("tpu:v5e:1024x1024", None).unwrap_err()
        );
        assert!(
            e.contains("1048576 chips") && e.contains("largest v5e slice (a full pod) has 256"),
            "{e}"
        );
        assert_eq!(Target::parse("tpu:v5e:16x16", None).unwrap().chips, 256);
    }
}
