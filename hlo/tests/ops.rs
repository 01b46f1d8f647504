//! Every op executed through the CPU plugin, compared with values computed here in Rust.
#![allow(clippy::type_complexity)]

mod common;
use common::*;
use hlo::*;
use pjrt::HostTensor;

fn f32s(dims: &[i64], seed: u64) -> Vec<f32> {
    let n = dims.iter().product::<i64>() as usize;
    Rng::new(seed)
        .uniform(n, -2.0, 2.0)
        .iter()
        .map(|&v| v as f32)
        .collect()
}

/// Build a one-output function of f32 params and run it.
fn run_f32(
    shapes: &[&[i64]],
    data: &[Vec<f32>],
    build: impl Fn(&mut Builder, &[Value]) -> Result<Value>,
) -> HostTensor {
    let mut b = Builder::new("main");
    let ps: Vec<Value> = shapes
        .iter()
        .enumerate()
        .map(|(i, s)| b.param(&format!("p{i}"), Shape::new(s, DType::F32)))
        .collect();
    let y = build(&mut b, &ps).unwrap();
    let inputs: Vec<HostTensor> = shapes
        .iter()
        .zip(data)
        .map(|(s, d)| HostTensor::from_f32(d, s))
        .collect();
    run(b.finish(&[("y", y)]), &inputs).remove(0)
}

fn close(got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * w.abs().max(1.0),
            "element {i}: got {g}, want {w}"
        );
    }
}

#[test]
fn constants_splat_dense_nan_inf() {
    let mut b = Builder::new("main");
    let splat = b.full(1.5, Shape::new(&[2, 2], DType::F32));
    let dense = b
        .constant(
            Literal::Float(vec![1.0, -2.5, 0.1, 3.0e-20, 7.0, 8.0]),
            Shape::new(&[2, 3], DType::F32),
        )
        .unwrap();
    let specials = b
        .constant(
            Literal::Float(vec![f64::NAN, f64::INFINITY, f64::NEG_INFINITY, -0.0]),
            Shape::new(&[4], DType::F32),
        )
        .unwrap();
    let bf = b
        .constant(
            Literal::Float(vec![f64::NAN, f64::INFINITY, 0.5]),
            Shape::new(&[3], DType::BF16),
        )
        .unwrap();
    let ints = b
        .constant(
            Literal::Int(vec![-3, 0, i32::MAX as i64]),
            Shape::new(&[3], DType::S32),
        )
        .unwrap();
    let preds = b
        .constant(
            Literal::Bool(vec![true, false]),
            Shape::new(&[2], DType::Pred),
        )
        .unwrap();
    let big: Vec<f64> = (0..100).map(|i| i as f64 * 0.25).collect();
    let hex = b
        .constant(
            Literal::Float(big.clone()),
            Shape::new(&[10, 10], DType::F32),
        )
        .unwrap();
    let out = run(
        b.finish(&[
            ("s", splat),
            ("d", dense),
            ("x", specials),
            ("bf", bf),
            ("i", ints),
            ("p", preds),
            ("h", hex),
        ]),
        &[],
    );
    assert_eq!(out[0].to_f32().unwrap(), vec![1.5; 4]);
    assert_eq!(
        out[1].to_f32().unwrap(),
        vec![1.0, -2.5, 0.1, 3.0e-20, 7.0, 8.0]
    );
    let x = out[2].to_f32().unwrap();
    assert!(x[0].is_nan() && x[1] == f32::INFINITY && x[2] == f32::NEG_INFINITY);
    assert!(x[3] == 0.0 && x[3].is_sign_negative());
    let bfv = out[3].to_bf16().unwrap();
    assert!(bfv[0].is_nan() && bfv[1].to_f32() == f32::INFINITY && bfv[2].to_f32() == 0.5);
    assert_eq!(out[4].to_i32().unwrap(), vec![-3, 0, i32::MAX]);
    assert_eq!(out[5].to_pred().unwrap(), vec![true, false]);
    assert_eq!(
        out[6].to_f32().unwrap(),
        big.iter().map(|&v| v as f32).collect::<Vec<_>>()
    );
}

#[test]
fn iota_broadcast_reshape_transpose() {
    let mut b = Builder::new("main");
    let io = b.iota(Shape::new(&[2, 3], DType::S32), 1).unwrap();
    let x = b.param("x", Shape::new(&[3], DType::F32));
    let bc = b.broadcast_in_dim(x, &[2, 3], &[1]).unwrap();
    let r = b.reshape(bc, &[3, 2]).unwrap();
    let t = b.transpose(r, &[1, 0]).unwrap();
    let out = run(
        b.finish(&[("iota", io), ("bc", bc), ("t", t)]),
        &[HostTensor::from_f32(&[1.0, 2.0, 3.0], &[3])],
    );
    assert_eq!(out[0].to_i32().unwrap(), vec![0, 1, 2, 0, 1, 2]);
    assert_eq!(out[1].to_f32().unwrap(), vec![1.0, 2.0, 3.0, 1.0, 2.0, 3.0]);
    // reshape [1,2,3,1,2,3] to 3x2 = [[1,2],[3,1],[2,3]], transposed = [[1,3,2],[2,1,3]]
    assert_eq!(out[2].to_f32().unwrap(), vec![1.0, 3.0, 2.0, 2.0, 1.0, 3.0]);
}

#[test]
fn unary_ops_match_rust() {
    let x = f32s(&[8], 1);
    let pos: Vec<f32> = x.iter().map(|v| v.abs() + 0.1).collect();
    type F = fn(&mut Builder, Value) -> Result<Value>;
    let cases: Vec<(&str, F, fn(f32) -> f32, bool)> = vec![
        ("neg", Builder::neg, |v| -v, false),
        ("abs", Builder::abs, |v| v.abs(), false),
        ("exp", Builder::exp, |v| v.exp(), false),
        ("log", Builder::log, |v| v.ln(), true),
        ("log1p", Builder::log1p, |v| v.ln_1p(), true),
        ("sqrt", Builder::sqrt, |v| v.sqrt(), true),
        ("rsqrt", Builder::rsqrt, |v| 1.0 / v.sqrt(), true),
        ("tanh", Builder::tanh, |v| v.tanh(), false),
        (
            "logistic",
            Builder::logistic,
            |v| 1.0 / (1.0 + (-v).exp()),
            false,
        ),
        ("sin", Builder::sin, |v| v.sin(), false),
        ("cos", Builder::cos, |v| v.cos(), false),
        ("floor", Builder::floor, |v| v.floor(), false),
        ("sign", Builder::sign, |v| v.signum(), false),
    ];
    for (name, op, reference, positive) in cases {
        let data = if positive { pos.clone() } else { x.clone() };
        let got = run_f32(&[&[8]], std::slice::from_ref(&data), |b, p| op(b, p[0]))
            .to_f32()
            .unwrap();
        let want: Vec<f32> = data.iter().map(|&v| reference(v)).collect();
        for (g, w) in got.iter().zip(&want) {
            assert!(
                (g - w).abs() <= 1e-5 * w.abs().max(1.0),
                "{name}: got {g}, want {w}"
            );
        }
    }
}

#[test]
fn binary_ops_match_rust() {
    let a = f32s(&[6], 2);
    let b: Vec<f32> = f32s(&[6], 3).iter().map(|v| v.abs() + 0.5).collect();
    type F = fn(&mut Builder, Value, Value) -> Result<Value>;
    let cases: Vec<(&str, F, fn(f32, f32) -> f32)> = vec![
        ("add", Builder::add, |x, y| x + y),
        ("sub", Builder::sub, |x, y| x - y),
        ("mul", Builder::mul, |x, y| x * y),
        ("div", Builder::div, |x, y| x / y),
        ("rem", Builder::rem, |x, y| x % y),
        ("max", Builder::max, |x, y| x.max(y)),
        ("min", Builder::min, |x, y| x.min(y)),
        ("pow", Builder::pow, |x, y| x.abs().powf(y)),
    ];
    for (name, op, reference) in cases {
        let lhs: Vec<f32> = if name == "pow" {
            a.iter().map(|v| v.abs()).collect()
        } else {
            a.clone()
        };
        let got = run_f32(&[&[6], &[6]], &[lhs, b.clone()], |bd, p| op(bd, p[0], p[1]))
            .to_f32()
            .unwrap();
        let want: Vec<f32> = a.iter().zip(&b).map(|(&x, &y)| reference(x, y)).collect();
        for (g, w) in got.iter().zip(&want) {
            assert!(
                (g - w).abs() <= 1e-5 * w.abs().max(1.0),
                "{name}: got {g}, want {w}"
            );
        }
    }
}

#[test]
fn bitwise_shift_bitcast_and_compare() {
    let mut b = Builder::new("main");
    let x = b.param("x", Shape::new(&[4], DType::U32));
    let y = b.param("y", Shape::new(&[4], DType::U32));
    let and = b.and(x, y).unwrap();
    let or = b.or(x, y).unwrap();
    let xor = b.xor(x, y).unwrap();
    let not = b.not(x).unwrap();
    let four = b.full(4.0, Shape::new(&[4], DType::U32));
    let shl = b.shift_left(x, four).unwrap();
    let shr = b.shift_right_logical(x, four).unwrap();
    let f = b.param("f", Shape::new(&[4], DType::F32));
    let bits = b.bitcast_convert(f, DType::U32).unwrap();
    let lt = b.compare(x, y, CmpDir::Lt).unwrap();
    let (xs, ys) = ([0xF0F0_1234u32, 7, 0, u32::MAX], [0x0FF0_FFFFu32, 9, 1, 1]);
    let fs = [1.0f32, -0.0, f32::INFINITY, 0.1];
    let out = run(
        b.finish(&[
            ("and", and),
            ("or", or),
            ("xor", xor),
            ("not", not),
            ("shl", shl),
            ("shr", shr),
            ("bits", bits),
            ("lt", lt),
        ]),
        &[
            HostTensor::from_u32(&xs, &[4]),
            HostTensor::from_u32(&ys, &[4]),
            HostTensor::from_f32(&fs, &[4]),
        ],
    );
    let map2 = |f: fn(u32, u32) -> u32| {
        xs.iter()
            .zip(&ys)
            .map(|(&a, &b)| f(a, b))
            .collect::<Vec<_>>()
    };
    assert_eq!(out[0].to_u32().unwrap(), map2(|a, b| a & b));
    assert_eq!(out[1].to_u32().unwrap(), map2(|a, b| a | b));
    assert_eq!(out[2].to_u32().unwrap(), map2(|a, b| a ^ b));
    assert_eq!(
        out[3].to_u32().unwrap(),
        xs.iter().map(|a| !a).collect::<Vec<_>>()
    );
    assert_eq!(
        out[4].to_u32().unwrap(),
        xs.iter().map(|a| a << 4).collect::<Vec<_>>()
    );
    assert_eq!(
        out[5].to_u32().unwrap(),
        xs.iter().map(|a| a >> 4).collect::<Vec<_>>()
    );
    assert_eq!(
        out[6].to_u32().unwrap(),
        fs.iter().map(|f| f.to_bits()).collect::<Vec<_>>()
    );
    assert_eq!(
        out[7].to_pred().unwrap(),
        map2(|a, b| (a < b) as u32)
            .iter()
            .map(|&v| v == 1)
            .collect::<Vec<_>>()
    );
}

#[test]
fn nibble_unpacking_with_shifts_and_masks() {
    // The 4-bit unpacking QLoRA needs: u8 -> (low, high) nibbles.
    let mut b = Builder::new("main");
    let packed = b.param("packed", Shape::new(&[3], DType::U8));
    let mask = b.full(15.0, Shape::new(&[3], DType::U8));
    let four = b.full(4.0, Shape::new(&[3], DType::U8));
    let lo = b.and(packed, mask).unwrap();
    let hi = b.shift_right_logical(packed, four).unwrap();
    let out = run(
        b.finish(&[("lo", lo), ("hi", hi)]),
        &[HostTensor::from_u8(&[0x1F, 0xA0, 0x73], &[3])],
    );
    assert_eq!(out[0].to_u8().unwrap(), vec![0xF, 0x0, 0x3]);
    assert_eq!(out[1].to_u8().unwrap(), vec![0x1, 0xA, 0x7]);
}

#[test]
fn select_clamp_convert() {
    let x = f32s(&[6], 4);
    let y = f32s(&[6], 5);
    let got = run_f32(&[&[6], &[6]], &[x.clone(), y.clone()], |b, p| {
        let m = b.compare(p[0], p[1], CmpDir::Gt)?;
        b.select(m, p[0], p[1])
    });
    close(
        &got.to_f32().unwrap(),
        &x.iter().zip(&y).map(|(a, b)| a.max(*b)).collect::<Vec<_>>(),
        0.0,
    );
    let got = run_f32(&[&[6]], std::slice::from_ref(&x), |b, p| {
        let lo = b.scalar(-0.5, DType::F32);
        let hi = b.scalar(0.5, DType::F32);
        b.clamp(lo, p[0], hi)
    });
    close(
        &got.to_f32().unwrap(),
        &x.iter().map(|v| v.clamp(-0.5, 0.5)).collect::<Vec<_>>(),
        0.0,
    );
    let got = run_f32(&[&[6]], std::slice::from_ref(&x), |b, p| {
        b.convert(p[0], DType::BF16)
    });
    let want: Vec<half::bf16> = x.iter().map(|&v| half::bf16::from_f32(v)).collect();
    assert_eq!(
        got.to_bf16().unwrap(),
        want,
        "f32 -> bf16 rounds to nearest even"
    );
    let got = run_f32(&[&[6]], std::slice::from_ref(&x), |b, p| {
        b.convert(p[0], DType::S32)
    });
    assert_eq!(
        got.to_i32().unwrap(),
        x.iter().map(|&v| v as i32).collect::<Vec<_>>(),
        "f32 -> s32 truncates"
    );
}

#[test]
fn slices_concat_pad() {
    let x: Vec<f32> = (0..20).map(|i| i as f32).collect();
    let at = |r: i64, c: i64| (r * 5 + c) as f32;
    let got = run_f32(&[&[4, 5]], std::slice::from_ref(&x), |b, p| {
        b.slice(p[0], &[1, 0], &[4, 5], &[2, 2])
    });
    assert_eq!(got.dims, vec![2, 3]);
    assert_eq!(
        got.to_f32().unwrap(),
        vec![at(1, 0), at(1, 2), at(1, 4), at(3, 0), at(3, 2), at(3, 4)]
    );
    let got = run_f32(&[&[4, 5]], std::slice::from_ref(&x), |b, p| {
        let i = b.scalar(2.0, DType::S32);
        let j = b.scalar(4.0, DType::S32); // clamped to 3 so the 2-wide window fits
        b.dynamic_slice(p[0], &[i, j], &[2, 2])
    });
    assert_eq!(
        got.to_f32().unwrap(),
        vec![at(2, 3), at(2, 4), at(3, 3), at(3, 4)]
    );
    let got = run_f32(
        &[&[4, 5], &[1, 2]],
        &[x.clone(), vec![-1.0, -2.0]],
        |b, p| {
            let i = b.scalar(3.0, DType::S32);
            let j = b.scalar(1.0, DType::S32);
            b.dynamic_update_slice(p[0], p[1], &[i, j])
        },
    );
    let mut want = x.clone();
    want[16] = -1.0;
    want[17] = -2.0;
    assert_eq!(got.to_f32().unwrap(), want);
    let got = run_f32(
        &[&[2, 2], &[2, 1]],
        &[vec![1.0, 2.0, 3.0, 4.0], vec![9.0, 8.0]],
        |b, p| b.concatenate(&[p[0], p[1]], 1),
    );
    assert_eq!(got.to_f32().unwrap(), vec![1.0, 2.0, 9.0, 3.0, 4.0, 8.0]);
    let got = run_f32(&[&[2]], &[vec![1.0, 2.0]], |b, p| {
        let z = b.scalar(0.0, DType::F32);
        b.pad(p[0], z, &[1], &[2], &[1])
    });
    assert_eq!(got.to_f32().unwrap(), vec![0.0, 1.0, 0.0, 2.0, 0.0, 0.0]);
}

#[test]
fn gather_rows_and_scatter_add() {
    let table: Vec<f32> = (0..12).map(|i| i as f32).collect(); // 4 rows of 3
    let mut b = Builder::new("main");
    let t = b.param("table", Shape::new(&[4, 3], DType::F32));
    let ids = b.param("ids", Shape::new(&[2, 2], DType::S32));
    let rows = b.take_rows(t, ids).unwrap();
    let zeros = b.zeros(Shape::new(&[4, 3], DType::F32));
    let dims = ScatterDims {
        update_window_dims: vec![2],
        inserted_window_dims: vec![0],
        scatter_dims_to_operand_dims: vec![0],
        index_vector_dim: 2,
    };
    let sc = b.scatter(zeros, ids, rows, dims, Combiner::Add).unwrap();
    let out = run(
        b.finish(&[("rows", rows), ("scatter", sc)]),
        &[
            HostTensor::from_f32(&table, &[4, 3]),
            HostTensor::from_i32(&[3, 0, 0, 2], &[2, 2]),
        ],
    );
    assert_eq!(out[0].dims, vec![2, 2, 3]);
    assert_eq!(
        out[0].to_f32().unwrap(),
        vec![9.0, 10.0, 11.0, 0.0, 1.0, 2.0, 0.0, 1.0, 2.0, 6.0, 7.0, 8.0]
    );
    // Row 0 was picked twice: the scatter adds both copies.
    assert_eq!(
        out[1].to_f32().unwrap(),
        vec![0.0, 2.0, 4.0, 0.0, 0.0, 0.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0]
    );
}

#[test]
fn dot_general_with_batch_and_preferred_type() {
    let (a, c) = (f32s(&[2, 3, 4], 6), f32s(&[2, 4, 5], 7));
    let got = run_f32(
        &[&[2, 3, 4], &[2, 4, 5]],
        &[a.clone(), c.clone()],
        |b, p| {
            let dims = DotDims {
                lhs_batch: vec![0],
                rhs_batch: vec![0],
                lhs_contract: vec![2],
                rhs_contract: vec![1],
            };
            b.dot_general(p[0], p[1], dims, Some(Precision::Highest), None)
        },
    );
    let mut want = vec![0f32; 2 * 3 * 5];
    for n in 0..2 {
        for i in 0..3 {
            for j in 0..5 {
                want[n * 15 + i * 5 + j] = (0..4)
                    .map(|k| a[n * 12 + i * 4 + k] * c[n * 20 + k * 5 + j])
                    .sum();
            }
        }
    }
    close(&got.to_f32().unwrap(), &want, 1e-5);
    // bf16 operands, f32 result.
    let got = run_f32(
        &[&[2, 3, 4], &[2, 4, 5]],
        &[a.clone(), c.clone()],
        |b, p| {
            let x = b.convert(p[0], DType::BF16)?;
            let y = b.convert(p[1], DType::BF16)?;
            let dims = DotDims {
                lhs_batch: vec![0],
                rhs_batch: vec![0],
                lhs_contract: vec![2],
                rhs_contract: vec![1],
            };
            b.dot_general(x, y, dims, None, Some(DType::F32))
        },
    );
    assert_eq!(got.ty, pjrt::ElementType::F32);
    close(&got.to_f32().unwrap(), &want, 2e-2);
}

#[test]
fn reduce_sum_and_max() {
    let x = f32s(&[3, 4], 8);
    let got = run_f32(&[&[3, 4]], std::slice::from_ref(&x), |b, p| {
        b.reduce_sum(p[0], &[1])
    });
    close(
        &got.to_f32().unwrap(),
        &(0..3)
            .map(|r| x[r * 4..r * 4 + 4].iter().sum())
            .collect::<Vec<f32>>(),
        1e-6,
    );
    let got = run_f32(&[&[3, 4]], std::slice::from_ref(&x), |b, p| {
        b.reduce_max(p[0], &[0])
    });
    close(
        &got.to_f32().unwrap(),
        &(0..4)
            .map(|c| (0..3).map(|r| x[r * 4 + c]).fold(f32::MIN, f32::max))
            .collect::<Vec<f32>>(),
        0.0,
    );
}

#[test]
fn while_loop_sums_one_to_ten() {
    let state = [Shape::scalar(DType::S32), Shape::scalar(DType::F32)];
    let mut cond = Builder::new("cond");
    let i = cond.param("i", state[0].clone());
    let _ = cond.param("acc", state[1].clone());
    let ten = cond.scalar(10.0, DType::S32);
    let go = cond.compare(i, ten, CmpDir::Lt).unwrap();
    let cond = cond.finish(&[("go", go)]);
    let mut body = Builder::new("body");
    let i = body.param("i", state[0].clone());
    let acc = body.param("acc", state[1].clone());
    let one = body.scalar(1.0, DType::S32);
    let next = body.add(i, one).unwrap();
    let nf = body.convert(next, DType::F32).unwrap();
    let acc2 = body.add(acc, nf).unwrap();
    let body = body.finish(&[("i", next), ("acc", acc2)]);
    let mut b = Builder::new("main");
    let i0 = b.scalar(0.0, DType::S32);
    let a0 = b.scalar(0.0, DType::F32);
    let out = b.while_loop(cond, body, &[i0, a0]).unwrap();
    let r = run(b.finish(&[("i", out[0]), ("sum", out[1])]), &[]);
    assert_eq!(r[0].to_i32().unwrap(), vec![10]);
    assert_eq!(r[1].to_f32().unwrap(), vec![55.0]);
}

#[test]
fn optimization_barrier_passes_values_through() {
    let got = run_f32(&[&[3]], &[vec![1.0, 2.0, 3.0]], |b, p| {
        let o = b.optimization_barrier(&[p[0]]);
        b.add(o[0], o[0])
    });
    assert_eq!(got.to_f32().unwrap(), vec![2.0, 4.0, 6.0]);
}

#[test]
fn sharding_constraint_runs_on_two_devices() {
    let mut b = Builder::new("main");
    let sh = Sharding {
        dims: vec![vec!["x".into()], vec![]],
    };
    let x = b.param_with(
        "x",
        Shape::new(&[4, 2], DType::F32),
        ParamAttrs {
            sharding: Some(sh.clone()),
            ..ParamAttrs::default()
        },
    );
    let y = b.mul_scalar(x, 3.0).unwrap();
    let y = b.sharding_constraint(y, Sharding::replicated(2)).unwrap();
    let func = b.finish_with(vec![FuncResult {
        value: y,
        name: "y".into(),
        sharding: Some(Sharding::replicated(2)),
    }]);
    let text = Module::new("sharded", func)
        .with_mesh(Mesh {
            axes: vec![("x".into(), 2)],
        })
        .to_text();
    assert!(text.contains("sdy.sharding_constraint"));
    let c = client();
    let exe = c
        .compile(&text, &pjrt::CompileOptions::spmd(vec![0, 1]))
        .unwrap();
    let devs = c.devices().unwrap();
    let s0 = c
        .to_device(
            &HostTensor::from_f32(&[1.0, 2.0, 3.0, 4.0], &[2, 2]),
            &devs[0],
        )
        .unwrap();
    let s1 = c
        .to_device(
            &HostTensor::from_f32(&[5.0, 6.0, 7.0, 8.0], &[2, 2]),
            &devs[1],
        )
        .unwrap();
    let out = exe.execute(&[vec![&s0], vec![&s1]]).unwrap();
    let want: Vec<f32> = (1..=8).map(|v| 3.0 * v as f32).collect();
    for (d, outs) in out.iter().enumerate() {
        assert_eq!(
            outs[0].to_host().unwrap().to_f32().unwrap(),
            want,
            "device {d} holds the replicated result"
        );
    }
}

#[test]
fn rng_bit_generator_is_deterministic_and_uniform() {
    // The Threefry stream is XLA's; we check what a user relies on: the same key gives the same
    // bits, another key other bits, the state advances, and the bits look uniform.
    let mut b = Builder::new("main");
    let key = b.param("key", Shape::new(&[2], DType::U64));
    let (next, bits) = b
        .rng_bit_generator(key, Shape::new(&[4096], DType::U32))
        .unwrap();
    let func = b.finish(&[("next", next), ("bits", bits)]);
    let text = Module::new("rng", func).to_text();
    let c = client();
    let exe = c.compile(&text, &pjrt::CompileOptions::default()).unwrap();
    let d = &c.devices().unwrap()[0];
    let key_tensor = |k: [u64; 2]| HostTensor {
        ty: pjrt::ElementType::U64,
        dims: vec![2],
        bytes: k.iter().flat_map(|v| v.to_le_bytes()).collect(),
    };
    let draw = |k: [u64; 2]| {
        let buf = c.to_device(&key_tensor(k), d).unwrap();
        let o = exe.execute(&[vec![&buf]]).unwrap();
        (
            o[0][0].to_host().unwrap().bytes,
            o[0][1].to_host().unwrap().to_u32().unwrap(),
        )
    };
    let (s1, a) = draw([1, 2]);
    let (_, a2) = draw([1, 2]);
    let (_, other) = draw([3, 4]);
    assert_eq!(a, a2, "same key, same bits");
    assert_ne!(a, other, "another key, other bits");
    assert_ne!(s1, key_tensor([1, 2]).bytes, "state advances");
    let mean = a.iter().map(|&v| v as f64 / u32::MAX as f64).sum::<f64>() / a.len() as f64;
    assert!(
        (mean - 0.5).abs() < 0.02,
        "mean of 4096 uniform draws {mean} (sd ~0.0045)"
    );
}

#[test]
fn grad_does_not_flow_through_stop_gradient() {
    // f(x) = stop_gradient(x)^2 + x: df/dx = 1 everywhere.
    let mut b = Builder::new("main");
    let x = b.param("x", Shape::new(&[3], DType::F32));
    let s = b.stop_gradient(x);
    let sq = b.mul(s, s).unwrap();
    let y = b.add(sq, x).unwrap();
    let l = b.sum_all(y).unwrap();
    let g = b.grad(l, &[x]).unwrap();
    let out = run(
        b.finish(&[("g", g[0])]),
        &[HostTensor::from_f32(&[1.0, 2.0, 3.0], &[3])],
    );
    assert_eq!(out[0].to_f32().unwrap(), vec![1.0; 3]);
}

#[test]
fn fori_loop_sums_rows_with_dynamic_slices() {
    // carry = sum of xs[i] over rows, xs an invariant.
    let xs: Vec<f32> = (0..12).map(|v| v as f32).collect(); // 4 rows of 3
    let got = run_f32(&[&[4, 3]], &[xs], |b, p| {
        let zero = b.zeros(Shape::new(&[1, 3], DType::F32));
        let out = b.fori_loop(4, &[zero], &[p[0]], |b, i, carry, inv| {
            let z = b.scalar(0.0, DType::S32);
            let row = b.dynamic_slice(inv[0], &[i, z], &[1, 3])?;
            Ok(vec![b.add(carry[0], row)?])
        })?;
        Ok(out[0])
    });
    assert_eq!(got.to_f32().unwrap(), vec![18.0, 22.0, 26.0]);
}

#[test]
fn unrolled_fori_loop_computes_what_the_loop_does_without_a_while() {
    // carry = tanh(carry * xs[i]) over 3 rows: order matters, so a wrong unrolling shows.
    let xs: Vec<f32> = (0..9).map(|v| 0.1 * v as f32 - 0.3).collect(); // 3 rows of 3
    let build = |unroll: bool| {
        move |b: &mut Builder, p: &[Value]| {
            b.unroll_loops(unroll);
            let one = b.full(1.5, Shape::new(&[1, 3], DType::F32));
            let out = b.fori_loop(3, &[one], &[p[0]], |b, i, carry, inv| {
                let z = b.scalar(0.0, DType::S32);
                let row = b.dynamic_slice(inv[0], &[i, z], &[1, 3])?;
                let m = b.mul(carry[0], row)?;
                Ok(vec![b.tanh(m)?])
            })?;
            Ok(out[0])
        }
    };
    let looped = run_f32(&[&[3, 3]], std::slice::from_ref(&xs), build(false));
    let unrolled = run_f32(&[&[3, 3]], std::slice::from_ref(&xs), build(true));
    let mut want = [1.5f32; 3];
    for r in 0..3 {
        for c in 0..3 {
            want[c] = (want[c] * xs[r * 3 + c]).tanh();
        }
    }
    close(&looped.to_f32().unwrap(), &want, 1e-6);
    assert_eq!(looped.to_f32().unwrap(), unrolled.to_f32().unwrap());
    // And the unrolled text has no while loop.
    let mut b = Builder::new("main");
    let p = b.param("p0", Shape::new(&[3, 3], DType::F32));
    let y = build(true)(&mut b, &[p]).unwrap();
    let text = hlo::Module::new("m", b.finish(&[("y", y)])).to_text();
    assert!(!text.contains("stablehlo.while"), "{text}");
    assert_eq!(text.matches("optimization_barrier").count(), 3, "{text}");
}

#[test]
fn uninitialized_buffers_print_as_allocate_buffer_and_xla_cpu_refuses_them() {
    // A loop-carried stack that its loop writes whole starts as XLA's AllocateBuffer: no
    // operands, no fill. TPU and GPU compilers implement it (the target tests compile such
    // steps); XLA CPU does not, which is why the CPU's programs keep a fill.
    let mut b = Builder::new("main");
    let x = b.param("x", Shape::new(&[2, 3], DType::F32));
    let stack = b.uninitialized(Shape::new(&[4, 2, 3], DType::F32));
    let x = b.reshape(x, &[1, 2, 3]).unwrap();
    let zero = b.scalar(0.0, DType::S32);
    let written = b
        .dynamic_update_slice(stack, x, &[zero, zero, zero])
        .unwrap();
    let text = Module::new("alloc", b.finish(&[("stack", written)])).to_text();
    assert!(
        text.contains("stablehlo.custom_call @AllocateBuffer() : () -> tensor<4x2x3xf32>"),
        "{text}"
    );
    let e = client()
        .compile(&text, &pjrt::CompileOptions::default())
        .err()
        .expect("XLA CPU has no AllocateBuffer");
    assert!(e.to_string().contains("AllocateBuffer"), "{e}");
}

/// A custom call prints in the form XLA reads (symbol, backend config with its quotes
/// escaped, operand and result layouts, several results): the CPU compiler parses it and then
/// refuses the target it has no implementation of, by name. Layouts that are not permutations
/// are refused when the op is built.
#[test]
fn custom_calls_print_as_xla_reads_them_and_check_their_layouts() {
    let mut b = Builder::new("main");
    let x = b.param("x", Shape::new(&[2, 3], DType::F32));
    let bad = b.custom_call(
        "lib$op",
        "{}",
        &[(x, vec![0, 0])],
        &[(Shape::new(&[2], DType::F32), vec![0])],
    );
    let e = bad.expect_err("a repeated dim is no layout").to_string();
    assert!(
        e.contains("operand 0 is tensor<2x3xf32>, its layout [0, 0]"),
        "{e}"
    );
    let outs = b
        .custom_call(
            "lib$op",
            r#"{"scale": 0.5, "name": "a\b"}"#,
            &[(x, vec![0, 1])],
            &[
                (Shape::new(&[3, 2], DType::F32), vec![1, 0]),
                (Shape::new(&[0], DType::U8), vec![0]),
            ],
        )
        .unwrap();
    let text = Module::new("call", b.finish(&[("y", outs[0]), ("scratch", outs[1])])).to_text();
    assert!(
        text.contains(r#"stablehlo.custom_call @lib$op(%x) {api_version = 2 : i32, backend_config = "{\"scale\": 0.5, \"name\": \"a\\b\"}", operand_layouts = [dense<[0, 1]> : tensor<2xindex>], result_layouts = [dense<[1, 0]> : tensor<2xindex>, dense<[0]> : tensor<1xindex>]} : (tensor<2x3xf32>) -> (tensor<3x2xf32>, tensor<0xui8>)"#),
        "{text}"
    );
    let e = client()
        .compile(&text, &pjrt::CompileOptions::default())
        .err()
        .expect("XLA CPU has no lib$op");
    assert!(e.to_string().contains("lib$op"), "{e}");
}

/// A composite inside a manual computation over two devices: each device adds its shard's
/// row index (an operand cut by the mesh) to its rows through the composite's decomposition,
/// which the CPU compiler inlines; the results are put back together by the out-sharding.
#[test]
fn a_composite_runs_per_device_in_a_manual_computation() {
    let mesh = Mesh {
        axes: vec![("x".into(), 2)],
    };
    let split = Sharding {
        dims: vec![vec!["x".into()], vec![]],
    };
    let mut b = Builder::new("main");
    let x = b.param_with(
        "x",
        Shape::new(&[4, 2], DType::F32),
        ParamAttrs {
            sharding: Some(split.clone()),
            ..ParamAttrs::default()
        },
    );
    let ids = b
        .constant(
            Literal::Float(vec![10.0, 20.0]),
            Shape::new(&[2, 1], DType::F32),
        )
        .unwrap();
    let outs = b
        .manual_computation(
            &mesh,
            &[(x, split.clone()), (ids, split.clone())],
            std::slice::from_ref(&split),
            |b, local| {
                assert_eq!(b.dims(local[0]), &[2, 2], "each device sees its two rows");
                let attrs = vec![("shift".to_string(), Attr::Int(1))];
                let outs = b.composite(
                    ("test.add_row_id", 1),
                    attrs,
                    &[("x", local[0]), ("id", local[1])],
                    |b, p| {
                        let id = b.reshape(p[1], &[])?;
                        let id = b.broadcast_in_dim(id, &[2, 2], &[])?;
                        Ok(vec![b.add(p[0], id)?])
                    },
                )?;
                Ok(outs)
            },
        )
        .unwrap();
    let func = b.finish_with(vec![FuncResult {
        value: outs[0],
        name: "y".into(),
        sharding: Some(split),
    }]);
    let text = Module::new("manual", func).with_mesh(mesh).to_text();
    assert!(text.contains("sdy.manual_computation"), "{text}");
    assert!(
        text.contains("stablehlo.composite \"test.add_row_id\"")
            && text.contains("func.func private @test.add_row_id.impl("),
        "{text}"
    );
    let c = client();
    let exe = c
        .compile(&text, &pjrt::CompileOptions::spmd(vec![0, 1]))
        .unwrap_or_else(|e| panic!("{e}\n{text}"));
    let devs = c.devices().unwrap();
    let shard = |v: &[f32], d: usize| {
        c.to_device(&HostTensor::from_f32(v, &[2, 2]), &devs[d])
            .unwrap()
    };
    let (s0, s1) = (
        shard(&[1.0, 2.0, 3.0, 4.0], 0),
        shard(&[5.0, 6.0, 7.0, 8.0], 1),
    );
    let out = exe.execute(&[vec![&s0], vec![&s1]]).unwrap();
    assert_eq!(
        out[0][0].to_host().unwrap().to_f32().unwrap(),
        vec![11.0, 12.0, 13.0, 14.0]
    );
    assert_eq!(
        out[1][0].to_host().unwrap().to_f32().unwrap(),
        vec![25.0, 26.0, 27.0, 28.0]
    );
}
