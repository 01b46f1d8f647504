//! The printer's text read back: composite calls to the attributes and shapes they were built
//! with, and a decomposition replaced by another function that the CPU plugin then compiles
//! and runs in its place.

mod common;
use common::*;
use hlo::*;
use pjrt::HostTensor;

/// `main(x [2, 3] f32, y [3] f32)`: `test.scale_rows` (two results, x * s and y + 1) then
/// `test.halve` of its first, each a composite with attributes of every kind.
fn module() -> (Module, Vec<Vec<(String, Attr)>>) {
    let mut b = Builder::new("main");
    let x = b.param("x", Shape::new(&[2, 3], DType::F32));
    let y = b.param("y", Shape::new(&[3], DType::F32));
    let first = vec![
        ("causal".to_string(), Attr::Str("rows, \"quoted\"".into())),
        ("rows".to_string(), Attr::Int(2)),
        ("scale".to_string(), Attr::Float(1.0 / 3f64.sqrt())),
    ];
    let second = vec![("factor".to_string(), Attr::Float(0.5))];
    let outs = b
        .composite(
            ("test.scale_rows", 3),
            first.clone(),
            &[("x", x), ("y", y)],
            |b, p| {
                let s = b.mul_scalar(p[0], 1.0 / 3f64.sqrt())?;
                let one = b.full(1.0, Shape::new(&[3], DType::F32));
                Ok(vec![s, b.add(p[1], one)?])
            },
        )
        .unwrap();
    let halved = b
        .composite(
            ("test.halve", 1),
            second.clone(),
            &[("x", outs[0])],
            |b, p| Ok(vec![b.mul_scalar(p[0], 0.5)?]),
        )
        .unwrap();
    let func = b.finish(&[("h", halved[0]), ("y1", outs[1])]);
    (Module::new("read", func), vec![first, second])
}

#[test]
fn composite_calls_read_back_to_what_was_built() {
    let (module, attrs) = module();
    let text = module.to_text();
    let calls = composite_calls(&text).unwrap();
    let names: Vec<(&str, i32, &str)> = calls
        .iter()
        .map(|c| (c.name.as_str(), c.version, c.decomposition.as_str()))
        .collect();
    assert_eq!(
        names,
        [
            ("test.scale_rows", 3, "test.scale_rows.impl"),
            ("test.halve", 1, "test.halve.impl")
        ]
    );
    // Floats come back at f32, the precision they are printed at.
    let at_f32 = |a: &[(String, Attr)]| -> Vec<(String, Attr)> {
        a.iter()
            .map(|(n, v)| match v {
                Attr::Float(f) => (n.clone(), Attr::Float(*f as f32 as f64)),
                v => (n.clone(), v.clone()),
            })
            .collect()
    };
    assert_eq!(calls[0].attributes, at_f32(&attrs[0]));
    assert_eq!(calls[1].attributes, at_f32(&attrs[1]));
    let m23 = Shape::new(&[2, 3], DType::F32);
    let v3 = Shape::new(&[3], DType::F32);
    assert_eq!(calls[0].operands, [m23.clone(), v3.clone()]);
    assert_eq!(calls[0].results, [m23.clone(), v3.clone()]);
    assert_eq!(calls[1].operands, std::slice::from_ref(&m23));
    assert_eq!(calls[1].results, std::slice::from_ref(&m23));
    assert!(text
        .lines()
        .nth(calls[1].line - 1)
        .unwrap()
        .contains("test.halve"));
    let (p, r) = function_signature(&text, "test.scale_rows.impl").unwrap();
    assert_eq!((p, r), (vec![m23.clone(), v3.clone()], vec![m23, v3]));
}

#[test]
fn a_replaced_decomposition_compiles_and_runs_in_its_place() {
    let (module, _) = module();
    let text = module.to_text();
    // test.halve's decomposition computed another way: x / 2 plus 100, to see it ran.
    let mut b = Builder::new("other");
    let x = b.param("x", Shape::new(&[2, 3], DType::F32));
    let two = b.full(2.0, Shape::new(&[2, 3], DType::F32));
    let h = b.div(x, two).unwrap();
    let h = b.add_scalar(h, 100.0).unwrap();
    let other = b.finish(&[("out0", h)]);
    let replaced = replace_function(&text, "test.halve.impl", &other).unwrap();
    assert_eq!(
        replaced
            .matches("func.func private @test.halve.impl(")
            .count(),
        1,
        "{replaced}"
    );
    assert!(replaced.contains("stablehlo.divide"), "{replaced}");
    // Everything but the function is as printed.
    let (before, _) = text
        .split_once("  func.func private @test.halve.impl(")
        .unwrap();
    assert!(replaced.starts_with(before));
    assert_eq!(
        composite_calls(&replaced).unwrap(),
        composite_calls(&text).unwrap()
    );

    let c = client();
    let exe = c
        .compile(&replaced, &pjrt::CompileOptions::default())
        .unwrap_or_else(|e| panic!("{e}\n{replaced}"));
    let d = &c.devices().unwrap()[0];
    let xs = [3.0f32, -6.0, 9.0, 0.0, 1.5, 12.0];
    let x = c.to_device(&HostTensor::from_f32(&xs, &[2, 3]), d).unwrap();
    let y = c
        .to_device(&HostTensor::from_f32(&[1.0, 2.0, 3.0], &[3]), d)
        .unwrap();
    let out = exe.execute(&[vec![&x, &y]]).unwrap();
    let h = out[0][0].to_host().unwrap().to_f32().unwrap();
    let want: Vec<f32> = xs.iter().map(|v| v / 3f32.sqrt() / 2.0 + 100.0).collect();
    for (g, w) in h.iter().zip(&want) {
        assert!((g - w).abs() < 1e-4, "{h:?} against {want:?}");
    }
    let y1 = out[0][1].to_host().unwrap().to_f32().unwrap();
    assert_eq!(y1, [2.0, 3.0, 4.0]);

    // A replacement of another signature is refused, naming both.
    let mut b = Builder::new("wrong");
    let x = b.param("x", Shape::new(&[3, 2], DType::F32));
    let wrong = b.finish(&[("out0", x)]);
    let e = replace_function(&text, "test.halve.impl", &wrong)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("@test.halve.impl takes (tensor<2x3xf32>) and gives (tensor<2x3xf32>), its replacement takes (tensor<3x2xf32>)"),
        "{e}"
    );
}
