//! The PJRT layer against the real CPU plugin (installed into the cache on first use).

use pjrt::{Buffer, Client, ClientOptions, CompileOptions, ElementType, HostTensor, Plugin};
use std::sync::OnceLock;

fn client() -> &'static Client {
    static CLIENT: OnceLock<Client> = OnceLock::new();
    CLIENT.get_or_init(|| {
        let path = pjrt::discover::resolve_or_install(Some("cpu")).expect("CPU plugin");
        let plugin = Plugin::load(&path).expect("load CPU plugin");
        plugin
            .client(&ClientOptions::cpu_device_count(4))
            .expect("CPU client")
    })
}

fn upload(t: &HostTensor) -> Buffer {
    let c = client();
    c.to_device(t, &c.devices().unwrap()[0]).unwrap()
}

const DOT_ADD: &str = r#"
module @dot_add {
  func.func @main(%x: tensor<2x3xf32>, %w: tensor<3x2xf32>, %b: tensor<2x2xf32>) -> tensor<2x2xf32> {
    %0 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<2x3xf32>, tensor<3x2xf32>) -> tensor<2x2xf32>
    %1 = stablehlo.add %0, %b : tensor<2x2xf32>
    return %1 : tensor<2x2xf32>
  }
}"#;

fn dot_add_reference(x: &[f32], w: &[f32], b: &[f32]) -> Vec<f32> {
    let mut out = vec![0f32; 4];
    for i in 0..2 {
        for j in 0..2 {
            out[i * 2 + j] =
                (0..3).map(|k| x[i * 3 + k] * w[k * 2 + j]).sum::<f32>() + b[i * 2 + j];
        }
    }
    out
}

#[test]
fn plugin_reports_version_and_four_devices() {
    let c = client();
    let (major, minor) = c.plugin().api_version();
    assert_eq!((major, minor), (0, 81));
    assert_eq!(c.platform_name().unwrap(), "cpu");
    let devices = c.devices().unwrap();
    assert_eq!(devices.len(), 4);
    let ids: Vec<i32> = devices.iter().map(|d| d.info().unwrap().id).collect();
    assert_eq!(ids, vec![0, 1, 2, 3]);
}

#[test]
fn dot_general_plus_add_f32() {
    let exe = client()
        .compile(DOT_ADD, &CompileOptions::default())
        .unwrap();
    assert_eq!(exe.num_outputs().unwrap(), 1);
    let x = [1.0, 2.0, 3.0, -1.0, 0.5, 4.0];
    let w = [0.5, -2.0, 1.0, 3.0, -1.5, 0.25];
    let b = [10.0, 20.0, 30.0, 40.0];
    let (bx, bw, bb) = (
        upload(&HostTensor::from_f32(&x, &[2, 3])),
        upload(&HostTensor::from_f32(&w, &[3, 2])),
        upload(&HostTensor::from_f32(&b, &[2, 2])),
    );
    let out = exe.execute(&[vec![&bx, &bw, &bb]]).unwrap();
    let got = out[0][0].to_host().unwrap();
    assert_eq!(got.dims, vec![2, 2]);
    let expected = dot_add_reference(&x, &w, &b);
    for (g, e) in got.to_f32().unwrap().iter().zip(&expected) {
        assert!((g - e).abs() < 1e-5, "{g} vs {e}");
    }
    let stats = exe.memory_stats().unwrap();
    assert_eq!(stats.argument_bytes, (6 + 6 + 4) * 4);
    assert_eq!(stats.output_bytes, 4 * 4);
}

#[test]
fn dot_general_plus_add_bf16() {
    let text = DOT_ADD.replace("xf32>", "xbf16>");
    let exe = client().compile(&text, &CompileOptions::default()).unwrap();
    // Values exactly representable in bf16, so the reference is exact up to bf16 output rounding.
    let x = [1.0, 2.0, 3.0, -1.0, 0.5, 4.0];
    let w = [0.5, -2.0, 1.0, 3.0, -1.5, 0.25];
    let b = [10.0, 20.0, 30.0, 40.0];
    let bf = |v: &[f32]| {
        v.iter()
            .map(|&f| half::bf16::from_f32(f))
            .collect::<Vec<_>>()
    };
    let (bx, bw, bb) = (
        upload(&HostTensor::from_bf16(&bf(&x), &[2, 3])),
        upload(&HostTensor::from_bf16(&bf(&w), &[3, 2])),
        upload(&HostTensor::from_bf16(&bf(&b), &[2, 2])),
    );
    let out = exe.execute(&[vec![&bx, &bw, &bb]]).unwrap();
    let got = out[0][0].to_host().unwrap();
    assert_eq!(got.ty, ElementType::BF16);
    let expected = dot_add_reference(&x, &w, &b);
    for (g, e) in got.to_bf16().unwrap().iter().zip(&expected) {
        // bf16 keeps 8 significant bits: relative error <= 2^-8.
        assert!((g.to_f32() - e).abs() <= e.abs() / 256.0, "{g} vs {e}");
    }
}

#[test]
fn every_element_type_round_trips() {
    let c = client();
    let d = &c.devices().unwrap()[0];
    let tensors = [
        HostTensor::from_pred(&[true, false, true], &[3]),
        HostTensor::from_i8(&[-3, 0, 127], &[3]),
        HostTensor::from_i32(&[-7, 1 << 30, 5], &[3]),
        HostTensor::from_i64(&[-1, 1 << 40, 9], &[3]),
        HostTensor::from_u8(&[0, 200, 255], &[3]),
        HostTensor::from_u32(&[0, 3_000_000_000, 7], &[3]),
        HostTensor::from_f16(&[half::f16::from_f32(1.5); 3], &[3]),
        HostTensor::from_bf16(&[half::bf16::from_f32(-2.25); 3], &[3]),
        HostTensor::from_f32(&[f32::NAN, f32::INFINITY, -0.0], &[3]),
        HostTensor::from_f64(&[1e300, -1e-300, 2.5], &[3]),
    ];
    for t in &tensors {
        let back = c.to_device(t, d).unwrap().to_host().unwrap();
        assert_eq!(back.ty, t.ty);
        assert_eq!(back.dims, t.dims);
        assert_eq!(back.bytes, t.bytes, "{:?}", t.ty);
    }
}

#[test]
fn shardy_program_runs_one_shard_per_device_on_four_devices() {
    let text = r#"
module @sharded attributes {mhlo.num_partitions = 4 : i32} {
  sdy.mesh @mesh = <["x"=4]>
  func.func @main(%a: tensor<8x2xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"x"}, {}]>})
      -> (tensor<8x2xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"x"}, {}]>}) {
    %c = stablehlo.constant dense<2.0> : tensor<8x2xf32>
    %0 = stablehlo.multiply %a, %c : tensor<8x2xf32>
    return %0 : tensor<8x2xf32>
  }
}"#;
    let c = client();
    let devices = c.devices().unwrap();
    let exe = c
        .compile(text, &CompileOptions::spmd(vec![0, 1, 2, 3]))
        .unwrap();
    // Each device gets its own 2x2 shard: rows 2d..2d+2.
    let shards: Vec<Buffer> = (0..4)
        .map(|d| {
            let v: Vec<f32> = (0..4).map(|i| (d * 10 + i) as f32).collect();
            c.to_device(&HostTensor::from_f32(&v, &[2, 2]), &devices[d])
                .unwrap()
        })
        .collect();
    let args: Vec<Vec<&Buffer>> = shards.iter().map(|b| vec![b]).collect();
    let out = exe.execute(&args).unwrap();
    assert_eq!(out.len(), 4);
    for (d, outs) in out.iter().enumerate() {
        let got = outs[0].to_host().unwrap();
        assert_eq!(got.dims, vec![2, 2], "device {d} holds one shard");
        let expected: Vec<f32> = (0..4).map(|i| 2.0 * (d * 10 + i) as f32).collect();
        assert_eq!(got.to_f32().unwrap(), expected);
    }
}

#[test]
fn donated_input_is_deleted_after_the_call() {
    let text = r#"
module @donate {
  func.func @main(%a: tensor<4xf32> {tf.aliasing_output = 0 : i32}) -> tensor<4xf32> {
    %0 = stablehlo.add %a, %a : tensor<4xf32>
    return %0 : tensor<4xf32>
  }
}"#;
    let exe = client().compile(text, &CompileOptions::default()).unwrap();
    let a = upload(&HostTensor::from_f32(&[1.0, 2.0, 3.0, 4.0], &[4]));
    assert!(!a.is_deleted().unwrap());
    let out = exe.execute(&[vec![&a]]).unwrap();
    assert!(a.is_deleted().unwrap(), "donated buffer must be consumed");
    assert_eq!(
        out[0][0].to_host().unwrap().to_f32().unwrap(),
        vec![2.0, 4.0, 6.0, 8.0]
    );
    let stats = exe.memory_stats().unwrap();
    assert_eq!(stats.alias_bytes, 16);
    // Reusing the donated buffer is an error, not a crash.
    let again = exe.execute(&[vec![&a]]);
    assert!(again.is_err());
}

#[test]
fn bad_mlir_returns_the_parser_message() {
    let err = client()
        .compile(
            "module { func.func @main() -> tensor<2xf32> { return %nope } }",
            &CompileOptions::default(),
        )
        .err()
        .expect("bad MLIR must fail");
    let msg = err.to_string();
    assert!(msg.contains("PJRT_Client_Compile"), "{msg}");
    assert!(
        msg.to_lowercase().contains("error") || msg.contains("expected"),
        "{msg}"
    );
}

#[test]
fn wrong_inputs_return_errors() {
    let mut exe = client()
        .compile(DOT_ADD, &CompileOptions::default())
        .unwrap();
    let x = upload(&HostTensor::from_f32(&[0.0; 6], &[2, 3]));
    let w = upload(&HostTensor::from_f32(&[0.0; 6], &[3, 2]));
    let b = upload(&HostTensor::from_f32(&[0.0; 4], &[2, 2]));
    let wrong_shape = upload(&HostTensor::from_f32(&[0.0; 6], &[6]));
    let wrong_type = upload(&HostTensor::from_i32(&[0; 4], &[2, 2]));
    let count = exe.execute(&[vec![&x, &w]]).err().expect("too few args");
    assert!(count.to_string().contains("expected 3"), "{count}");
    // The CPU plugin itself does not check shapes, so the executable is told what it takes.
    exe.expect_inputs(vec![
        (ElementType::F32, vec![2, 3]),
        (ElementType::F32, vec![3, 2]),
        (ElementType::F32, vec![2, 2]),
    ]);
    let shape = exe
        .execute(&[vec![&x, &wrong_shape, &b]])
        .err()
        .expect("wrong shape");
    assert!(
        shape
            .to_string()
            .contains("argument 1 on device 0 should be F32[3, 2] but is F32[6]"),
        "{shape}"
    );
    let ty = exe
        .execute(&[vec![&x, &w, &wrong_type]])
        .err()
        .expect("wrong dtype");
    assert!(
        ty.to_string()
            .contains("argument 2 on device 0 should be F32[2, 2] but is S32[2, 2]"),
        "{ty}"
    );
    assert!(exe.execute(&[vec![&x, &w, &b]]).is_ok());
}

#[test]
fn executable_serializes_and_reloads() {
    let c = client();
    let exe = c.compile(DOT_ADD, &CompileOptions::default()).unwrap();
    let bytes = exe.serialize().unwrap();
    assert!(bytes.len() > 100);
    let again = c.deserialize(&bytes).unwrap();
    let x = upload(&HostTensor::from_f32(&[1.0; 6], &[2, 3]));
    let w = upload(&HostTensor::from_f32(&[1.0; 6], &[3, 2]));
    let b = upload(&HostTensor::from_f32(&[0.5; 4], &[2, 2]));
    let out = again.execute(&[vec![&x, &w, &b]]).unwrap();
    assert_eq!(out[0][0].to_host().unwrap().to_f32().unwrap(), vec![3.5; 4]);
}

#[test]
fn float_create_options_are_passed() {
    // The GPU plugins take `memory_fraction` as a float; the CPU plugin ignores options it does not
    // know, so this checks that a float option is marshalled without upsetting the plugin.
    // (A float given for one of the CPU plugin's own int64 options aborts the process inside the
    // plugin with an uncatchable C++ exception, so that is not tried.)
    let path = pjrt::discover::resolve_or_install(Some("cpu")).expect("CPU plugin");
    let plugin = Plugin::load(&path).expect("load CPU plugin");
    let options = ClientOptions {
        options: vec![
            ("cpu_device_count".into(), pjrt::Value::Int(2)),
            ("memory_fraction".into(), pjrt::Value::Float(0.9)),
        ],
    };
    let client = plugin.client(&options).expect("client with a float option");
    assert_eq!(client.devices().unwrap().len(), 2);
}

/// A store handed to `PJRT_Client_Create` lives exactly as long as the client: held while the
/// client is, released once it is destroyed. (The CPU plugin takes the callbacks and never calls
/// them; the GPU plugins call them, which `tools/hosts-gpu-check` checks on a GPU.)
#[test]
fn a_client_created_with_a_store_holds_it_as_long_as_it_lives() {
    use pjrt::{KeyValueStore, KvCode, KvError};
    use std::sync::Arc;
    use std::time::Duration;
    struct Empty;
    impl KeyValueStore for Empty {
        fn get(&self, key: &str, _: Duration) -> Result<Vec<u8>, KvError> {
            Err(KvError {
                code: KvCode::DeadlineExceeded,
                message: key.into(),
            })
        }
        fn try_get(&self, _: &str) -> Result<Option<Vec<u8>>, KvError> {
            Ok(None)
        }
        fn put(&self, _: &str, _: &[u8]) -> Result<(), KvError> {
            Ok(())
        }
    }
    let path = pjrt::discover::resolve_or_install(Some("cpu")).expect("CPU plugin");
    let plugin = Plugin::load(&path).unwrap();
    let store: Arc<dyn KeyValueStore> = Arc::new(Empty);
    let client = plugin
        .client_with_store(&ClientOptions::cpu_device_count(2), store.clone())
        .unwrap();
    assert_eq!(Arc::strong_count(&store), 2);
    // One process: every device of the client is this process's.
    assert_eq!(client.global_devices().unwrap().len(), 2);
    assert_eq!(client.devices().unwrap().len(), 2);
    let kept = client.clone();
    drop(client);
    assert_eq!(
        Arc::strong_count(&store),
        2,
        "a clone of the client keeps it"
    );
    drop(kept);
    assert_eq!(Arc::strong_count(&store), 1);
}
