//! Leak check, alone in its own test binary so that no concurrent test moves the RSS figure.

use pjrt::{Buffer, Client, ClientOptions, CompileOptions, HostTensor, Plugin};

fn client() -> Client {
    let path = pjrt::discover::resolve_or_install(Some("cpu")).expect("CPU plugin");
    Plugin::load(&path)
        .expect("load")
        .client(&ClientOptions::cpu_device_count(1))
        .expect("client")
}

const DOT_ADD: &str = r#"
module @dot_add {
  func.func @main(%x: tensor<2x3xf32>, %w: tensor<3x2xf32>, %b: tensor<2x2xf32>) -> tensor<2x2xf32> {
    %0 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<2x3xf32>, tensor<3x2xf32>) -> tensor<2x2xf32>
    %1 = stablehlo.add %0, %b : tensor<2x2xf32>
    return %1 : tensor<2x2xf32>
  }
}"#;

fn rss_kib() -> i64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

#[test]
fn ten_thousand_executes_do_not_leak() {
    let client = client();
    let upload =
        |t: &HostTensor| -> Buffer { client.to_device(t, &client.devices().unwrap()[0]).unwrap() };
    let exe = client.compile(DOT_ADD, &CompileOptions::default()).unwrap();
    let x = upload(&HostTensor::from_f32(&[1.0; 6], &[2, 3]));
    let w = upload(&HostTensor::from_f32(&[1.0; 6], &[3, 2]));
    let run = |n: usize| {
        for _ in 0..n {
            let b = upload(&HostTensor::from_f32(&[0.5; 4], &[2, 2]));
            let out = exe.execute(&[vec![&x, &w, &b]]).unwrap();
            let _ = out[0][0].to_host().unwrap();
        }
    };
    run(1000); // warm up allocator pools
    let before = rss_kib();
    run(10_000);
    let grown = rss_kib() - before;
    // 10,000 iterations each create 2 buffers, an executable run and 2 events: a leak of even one
    // small object per iteration would show as well over 1 MiB.
    assert!(grown < 1024, "RSS grew by {grown} KiB over 10,000 executes");
}
