//! Golden-text tests: the printed form of a few programs is pinned in `tests/golden/*.mlir`, so
//! any change to what the builder emits shows up in review as a text diff.
//! Run with `UPDATE_GOLDEN=1` to rewrite the files after an intended change.

mod common;
use hlo::*;

fn check_golden(name: &str, text: &str) {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(format!("{name}.mlir"));
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::write(&path, text).unwrap();
    }
    let want = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (run with UPDATE_GOLDEN=1 to create it)",
            path.display()
        )
    });
    assert_eq!(
        text,
        want,
        "{name}: printed program differs from {}",
        path.display()
    );
    // The pinned text must also be a program XLA accepts.
    common::client()
        .compile(text, &pjrt::CompileOptions::default())
        .unwrap_or_else(|e| panic!("{name}: {e}"));
}

fn tanh_grad() -> Func {
    let mut b = Builder::new("main");
    let x = b.param("x", Shape::new(&[4, 3], DType::F32));
    let w = b.param("W", Shape::new(&[3, 2], DType::F32));
    let xw = b.scoped("layer", |b| b.matmul(x, w)).unwrap();
    let t = b.tanh(xw).unwrap();
    let f = b.sum_all(t).unwrap();
    let g = b.grad(f, &[w]).unwrap();
    b.finish(&[("f", f), ("dW", g[0])])
}

/// Two blocks of rows, each through its own tanh: the gradient is the blocks' cotangents
/// concatenated, not each padded with zeros to the full size and summed.
fn block_grad() -> Func {
    let mut b = Builder::new("main");
    let x = b.param("x", Shape::new(&[4, 2], DType::F32));
    let top = b.slice_dim(x, 0, 0, 1).unwrap();
    let rest = b.slice_dim(x, 0, 1, 4).unwrap();
    let top = b.tanh(top).unwrap();
    let rest = b.tanh(rest).unwrap();
    let st = b.sum_all(top).unwrap();
    let sr = b.sum_all(rest).unwrap();
    let f = b.add(st, sr).unwrap();
    let g = b.grad(f, &[x]).unwrap();
    b.finish(&[("f", f), ("dx", g[0])])
}

#[test]
fn golden_block_grad() {
    let text = Module::new("block_grad", block_grad()).to_text();
    assert!(!text.contains("stablehlo.pad"), "{text}");
    check_golden("block_grad", &text);
}

#[test]
fn printing_is_deterministic() {
    let a = Module::new("m", tanh_grad()).to_text();
    let b = Module::new("m", tanh_grad()).to_text();
    assert_eq!(a, b);
}

#[test]
fn golden_tanh_grad() {
    check_golden(
        "tanh_grad",
        &Module::new("tanh_grad", tanh_grad()).to_text(),
    );
}

/// A bf16 x bf16 product accumulated in f32 (mixed precision): its backward products take the
/// f32 cotangent rounded to bf16 and give their result in f32 too, rounded to the operand's
/// type after, the form XLA CPU runs on a native bf16 GEMM.
#[test]
fn golden_mixed_precision_dot_grad() {
    let mut b = Builder::new("main");
    let x = b.param("x", Shape::new(&[4, 3], DType::BF16));
    let w = b.param("W", Shape::new(&[2, 3], DType::BF16));
    let dims = DotDims {
        lhs_contract: vec![1],
        rhs_contract: vec![1],
        ..Default::default()
    };
    let xw = b
        .scoped("layer", |b| {
            b.dot_general(x, w, dims, None, Some(DType::F32))
        })
        .unwrap();
    let t = b.tanh(xw).unwrap();
    let f = b.sum_all(t).unwrap();
    let g = b.grad(f, &[x, w]).unwrap();
    let text = Module::new("mixed", b.finish(&[("f", f), ("dx", g[0]), ("dW", g[1])])).to_text();
    let backward: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("stablehlo.dot_general") && l.contains("layer.grad"))
        .collect();
    assert_eq!(backward.len(), 2, "{text}");
    for l in backward {
        assert!(
            l.contains("xbf16>, tensor<") && l.ends_with("f32> loc(\"layer.grad\")"),
            "{l}"
        );
    }
    check_golden("mixed_precision_dot_grad", &text);
}

#[test]
fn golden_remat_region() {
    let mut b = Builder::new("main");
    let x = b.param("x", Shape::new(&[2, 4], DType::F32));
    let w = b.param("w", Shape::new(&[4, 4], DType::F32));
    let h = b
        .remat(|b| {
            b.scoped("block", |b| {
                let h = b.matmul(x, w)?;
                b.logistic(h)
            })
        })
        .unwrap();
    let l = b.sum_all(h).unwrap();
    let g = b.grad(l, &[w]).unwrap();
    let text = Module::new("remat", b.finish(&[("loss", l), ("dw", g[0])])).to_text();
    assert_eq!(text.matches("stablehlo.optimization_barrier").count(), 1);
    // The forward matmul plus its recomputation plus dW: three dot_generals.
    assert_eq!(text.matches("stablehlo.dot_general").count(), 3);
    check_golden("remat_region", &text);
}

#[test]
fn golden_donation_and_constants() {
    let mut b = Builder::new("main");
    let p = b.param_with(
        "param",
        Shape::new(&[2], DType::F32),
        ParamAttrs {
            alias_output: Some(0),
            ..ParamAttrs::default()
        },
    );
    let c = b
        .constant(
            Literal::Float(vec![0.5, f64::NAN]),
            Shape::new(&[2], DType::F32),
        )
        .unwrap();
    let m = b.compare(p, p, CmpDir::Eq).unwrap();
    let safe = b.select(m, p, c).unwrap();
    let y = b.add(safe, c).unwrap();
    check_golden(
        "donation_constants",
        &Module::new("donate", b.finish(&[("updated", y)])).to_text(),
    );
}

#[test]
fn frozen_weights_get_no_gradient_work() {
    // loss = sum(x @ W_frozen @ A): d/dA needs one dot for the cotangent (x @ W is reused from
    // the forward). W_frozen and x are not differentiated, so nothing else is computed.
    let mut b = Builder::new("main");
    let x = b.param("x", Shape::new(&[8, 16], DType::F32));
    let w = b.param("W_frozen", Shape::new(&[16, 32], DType::F32));
    let a = b.param("A", Shape::new(&[32, 4], DType::F32));
    let xw = b.matmul(x, w).unwrap();
    let y = b.matmul(xw, a).unwrap();
    let l = b.sum_all(y).unwrap();
    let forward_dots = b.func().count_ops("dot_general");
    let g = b.grad(l, &[a]).unwrap();
    let f = b.finish(&[("loss", l), ("dA", g[0])]);
    assert_eq!(forward_dots, 2);
    assert_eq!(f.count_ops("dot_general"), 3, "forward 2 + one for dA");
    // No value shaped like W_frozen or x is produced by the backward.
    let backward: Vec<&Node> = f
        .nodes
        .iter()
        .filter(|n| n.loc.as_deref().is_some_and(|l| l.contains("grad")))
        .collect();
    for n in backward {
        for &o in &n.outputs {
            let s = f.shape(o);
            assert!(
                s.dims != vec![16, 32] && s.dims != vec![8, 16],
                "backward produced {s} ({})",
                n.op.name()
            );
        }
    }
    // And dA does not need a transpose in the usual layout.
    assert_eq!(f.count_ops("transpose"), 0);
}

#[test]
fn shape_errors_name_the_op_and_the_shapes() {
    let mut b = Builder::new("main");
    let x = b.param("x", Shape::new(&[4, 64], DType::F32));
    let w = b.param("w", Shape::new(&[32, 8], DType::F32));
    let e = b.matmul(x, w).unwrap_err();
    assert_eq!(
        e.to_string(),
        "dot_general: lhs contracting dim 1 has size 64 but rhs contracting dim 0 has size 32 (lhs tensor<4x64xf32>, rhs tensor<32x8xf32>)"
    );
    let e = b.add(x, w).unwrap_err();
    assert_eq!(
        e.to_string(),
        "add: operands must have the same type, got tensor<4x64xf32> and tensor<32x8xf32>"
    );
    let e = b.reshape(x, &[3, 3]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "reshape: cannot reshape tensor<4x64xf32> (256 elements) to [3, 3]"
    );
    let e = b.broadcast_in_dim(w, &[4, 8], &[0, 1]).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("broadcast_in_dim: operand dim 0 has size 32 but result dim 0 has size 4"),
        "{e}"
    );
    let e = b.slice(x, &[0, 0], &[5, 64], &[1, 1]).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("slice: dim 0: [0:5:1] is outside 0..4"),
        "{e}"
    );
    let e = b.transpose(x, &[0, 0]).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("transpose: [0, 0] is not a permutation"),
        "{e}"
    );
    let i = b.param("i", Shape::new(&[2], DType::S32));
    let e = b.exp(i).unwrap_err();
    assert_eq!(
        e.to_string(),
        "exponential: needs a float operand, got tensor<2xi32>"
    );
}

/// A loop with a gradient rule of its own (`custom_vjp`): the marker prints as nothing, the
/// forward loop stays, and the gradient is the rule's (3 x^2 g for x^3), not the loop's.
#[test]
fn golden_custom_vjp() {
    let mut b = Builder::new("main");
    let x = b.param("x", Shape::new(&[3], DType::F32));
    let one = b.full_like(x, 1.0);
    let cube = b
        .scoped("cube", |b| {
            b.fori_loop(3, &[one], &[x], |bb, _, c, inv| {
                Ok(vec![bb.mul(c[0], inv[0])?])
            })
        })
        .unwrap();
    let rule: VjpRule = std::rc::Rc::new(|b, ins, _outs, cts| {
        let sq = b.mul(ins[0], ins[0])?;
        let three = b.mul_scalar(sq, 3.0)?;
        Ok(vec![cts[0].map(|g| b.mul(three, g)).transpose()?])
    });
    let y = b.custom_vjp(&[x], &[cube[0]], rule)[0];
    let f = b.sum_all(y).unwrap();
    let g = b.grad(f, &[x]).unwrap();
    let text = Module::new("custom_vjp", b.finish(&[("f", f), ("dx", g[0])])).to_text();
    assert_eq!(text.matches("stablehlo.while").count(), 1, "{text}");
    assert!(!text.contains("custom_vjp("), "{text}");
    check_golden("custom_vjp", &text);
}
