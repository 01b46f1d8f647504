//! Compiling for absent hardware through real plugins (fetched into the cache on first use):
//! libtpu for a TPU v5e slice, the CUDA plugin for two H100s described by a target config.
//! (The ROCm plugin needs ROCm's runtime libraries; its compile is tested through `xtrain` in
//! the root crate's tests, with stand-in libraries.)

use pjrt::{CompileOptions, Plugin, Topology, Value};
use std::sync::Arc;

/// A [256, 512] x [512, 512] bf16 matmul, rows split over `n` devices, weight columns too.
fn sharded_matmul(n: usize) -> String {
    format!(
        r#"module @m attributes {{mhlo.num_partitions = {n} : i32}} {{
  sdy.mesh @mesh = <["x"={n}]>
  func.func @main(%x: tensor<256x512xbf16> {{sdy.sharding = #sdy.sharding<@mesh, [{{"x"}}, {{}}]>}},
                  %w: tensor<512x512xbf16> {{sdy.sharding = #sdy.sharding<@mesh, [{{}}, {{"x"}}]>}})
      -> (tensor<256x512xbf16> {{sdy.sharding = #sdy.sharding<@mesh, [{{"x"}}, {{}}]>}}) {{
    %0 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<256x512xbf16>, tensor<512x512xbf16>) -> tensor<256x512xbf16>
    return %0 : tensor<256x512xbf16>
  }}
}}"#
    )
}

fn plugin(name: &str) -> Arc<Plugin> {
    if name == "tpu" {
        // Without these libtpu asks a cloud metadata server for ~29 s per key (see
        // docs/plugins.md); xtrain sets them the same way for a TPU target.
        std::env::set_var("TPU_SKIP_MDS_QUERY", "1");
        std::env::set_var("TPU_ACCELERATOR_TYPE", "v5p-8");
        std::env::set_var("TPU_WORKER_HOSTNAMES", "localhost");
        std::env::set_var("TPU_LOG_DIR", "disabled");
        std::env::set_var("ALLOW_MULTIPLE_LIBTPU_LOAD", "1");
    }
    let path = pjrt::discover::resolve(Some(name))
        .or_else(|_| pjrt::discover::install_announced(name))
        .unwrap_or_else(|e| panic!("the {name} plugin: {e}"));
    Plugin::load(&path).unwrap_or_else(|e| panic!("load {}: {e}", path.display()))
}

fn compile_and_check(topo: &Topology, devices: usize, cost_analysis: bool) {
    let ids: Vec<i64> = topo
        .devices()
        .unwrap()
        .iter()
        .map(|d| d.id as i64)
        .collect();
    assert_eq!(ids.len(), devices);
    let exe = topo
        .compile(&sharded_matmul(devices), &CompileOptions::spmd(ids))
        .unwrap();
    let m = exe.memory_stats().unwrap();
    // Each device holds its shard of x ([256/n, 512]) and of w ([512, 512/n]), bf16.
    let per_device = (256 * 512 + 512 * 512) * 2 / devices as i64;
    assert_eq!(m.argument_bytes, per_device, "{m:?}");
    assert_eq!(m.output_bytes, 256 * 512 * 2 / devices as i64, "{m:?}");
    assert_eq!(m.host_total_bytes(), 0, "{m:?}");
    let (format, optimized) = exe.optimized_program().unwrap();
    assert_eq!(format, "hlo_with_config");
    assert!(optimized.len() > 100);
    assert!(exe.serialize().unwrap().len() > 1000);
    let cost = exe.cost_analysis();
    if cost_analysis {
        let cost = cost.unwrap();
        let flops = cost
            .iter()
            .find(|(k, _)| k == "flops")
            .unwrap()
            .1
            .as_f64()
            .unwrap();
        // 2 * 256 * 512 * 512 multiply-adds over `devices` chips (and a little more).
        let per_chip = 2.0 * 256.0 * 512.0 * 512.0 / devices as f64;
        assert!(
            flops >= per_chip && flops < per_chip * 1.1,
            "{flops} vs {per_chip}"
        );
        assert!(cost.iter().any(|(k, _)| k == "optimal_seconds"), "{cost:?}");
    } else {
        let e = cost.unwrap_err().to_string();
        assert!(e.contains("not supported"), "{e}");
    }
}

#[test]
fn libtpu_compiles_for_an_absent_v5e_slice() {
    let p = plugin("tpu");
    let topo = p.topology("v5e:2x2", &[]).unwrap();
    assert_eq!(topo.platform_name().unwrap(), "tpu");
    let devices = topo.devices().unwrap();
    assert_eq!(devices.len(), 4);
    assert_eq!(devices[0].kind, "TPU v5 lite");
    let memory = devices[0]
        .attributes
        .iter()
        .find(|(k, _)| k == "device_memory_bytes_limit")
        .and_then(|(_, v)| v.as_f64())
        .unwrap();
    assert!(memory > 15e9 && memory < 17e9, "{memory}");
    compile_and_check(&topo, 4, true);
    // One chip needs its host bounds; a malformed name gets libtpu's own message.
    let one = p
        .topology(
            "v5e:1x1",
            &[("chips_per_host_bounds".into(), Value::Ints(vec![1, 1, 1]))],
        )
        .unwrap();
    assert_eq!(one.devices().unwrap().len(), 1);
    let e = p.topology("v5p", &[]).err().unwrap().to_string();
    assert!(e.contains("does not match regex"), "{e}");
}

#[test]
fn cuda_plugin_compiles_for_two_absent_h100s() {
    let p = plugin("cuda");
    let missing = pjrt::discover::missing_cuda_tools(p.path(), None);
    assert!(missing.is_empty(), "{missing:?}");
    let config = r#"gpu_device_info {
  cuda_compute_capability { major: 9 minor: 0 }
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_block_optin: 232448
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3352000000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 85520809984
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
device_description_str: "NVIDIA H100 80GB HBM3"
"#;
    let topo = p
        .topology(
            "",
            &[
                ("topology".into(), Value::Str("1x1x2".into())),
                ("target_config".into(), Value::Str(config.into())),
            ],
        )
        .unwrap();
    let devices = topo.devices().unwrap();
    assert_eq!(devices.len(), 2);
    assert_eq!(devices[1].kind, "NVIDIA H100 80GB HBM3");
    assert!(devices[1]
        .attributes
        .contains(&("compute_capability".into(), Value::Str("9.0".into()))));
    compile_and_check(&topo, 2, false);
}
