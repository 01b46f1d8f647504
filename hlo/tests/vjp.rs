//! Every vjp rule against central finite differences in f64 (eps 1e-6) on random inputs.
//! Tolerance: |analytic - numeric| / max(1, |numeric|) <= 1e-6 unless a test says otherwise.

mod common;
use common::*;
use hlo::{CmpDir, DType, DotDims, GatherDims, Literal, ScatterDims, Shape};

const TOL: f64 = 1e-6;

fn rand(seed: u64, dims: &[i64], lo: f64, hi: f64) -> Input {
    let n = dims.iter().product::<i64>() as usize;
    input(dims, Rng::new(seed).uniform(n, lo, hi))
}

#[test]
fn elementwise_binary() {
    let a = || rand(1, &[2, 3], 0.5, 2.0);
    let b = || rand(2, &[2, 3], 0.5, 2.0);
    check_vjp("add", &[a(), b()], &[0, 1], TOL, |bd, p| bd.add(p[0], p[1]));
    check_vjp("sub", &[a(), b()], &[0, 1], TOL, |bd, p| bd.sub(p[0], p[1]));
    check_vjp("mul", &[a(), b()], &[0, 1], TOL, |bd, p| bd.mul(p[0], p[1]));
    check_vjp("div", &[a(), b()], &[0, 1], TOL, |bd, p| bd.div(p[0], p[1]));
    check_vjp("pow", &[a(), b()], &[0, 1], TOL, |bd, p| bd.pow(p[0], p[1]));
    check_vjp("max", &[a(), b()], &[0, 1], TOL, |bd, p| bd.max(p[0], p[1]));
    check_vjp("min", &[a(), b()], &[0, 1], TOL, |bd, p| bd.min(p[0], p[1]));
    check_vjp(
        "rem",
        &[rand(3, &[2, 3], 2.1, 2.9), rand(4, &[2, 3], 1.1, 1.9)],
        &[0, 1],
        TOL,
        |bd, p| bd.rem(p[0], p[1]),
    );
    // Only one side differentiated: the other gets no gradient work.
    check_vjp("mul wrt lhs only", &[a(), b()], &[0], TOL, |bd, p| {
        bd.mul(p[0], p[1])
    });
}

#[test]
fn elementwise_unary() {
    let pos = || rand(5, &[3, 2], 0.2, 2.0);
    let any = || rand(6, &[3, 2], -2.0, 2.0);
    check_vjp("neg", &[any()], &[0], TOL, |b, p| b.neg(p[0]));
    check_vjp("abs", &[any()], &[0], TOL, |b, p| b.abs(p[0]));
    check_vjp("exp", &[any()], &[0], TOL, |b, p| b.exp(p[0]));
    check_vjp("log", &[pos()], &[0], TOL, |b, p| b.log(p[0]));
    check_vjp("log1p", &[pos()], &[0], TOL, |b, p| b.log1p(p[0]));
    check_vjp("sqrt", &[pos()], &[0], TOL, |b, p| b.sqrt(p[0]));
    check_vjp("rsqrt", &[pos()], &[0], TOL, |b, p| b.rsqrt(p[0]));
    check_vjp("tanh", &[any()], &[0], TOL, |b, p| b.tanh(p[0]));
    check_vjp("logistic", &[any()], &[0], TOL, |b, p| b.logistic(p[0]));
    check_vjp("sin", &[any()], &[0], TOL, |b, p| b.sin(p[0]));
    check_vjp("cos", &[any()], &[0], TOL, |b, p| b.cos(p[0]));
}

#[test]
fn select_clamp_compare_convert() {
    let a = || rand(7, &[2, 3], -1.0, 1.0);
    let c = || rand(8, &[2, 3], -1.0, 1.0);
    check_vjp("select", &[a(), c()], &[0, 1], TOL, |b, p| {
        let m = b.compare(p[0], p[1], CmpDir::Gt)?;
        b.select(m, p[0], p[1])
    });
    check_vjp("clamp", &[a()], &[0], TOL, |b, p| {
        let lo = b.scalar(-0.5, DType::F64);
        let hi = b.scalar(0.5, DType::F64);
        b.clamp(lo, p[0], hi)
    });
    // Through f32 and back. A quadratic has exact central differences, so a large step (1e-2)
    // keeps f32 rounding (~1e-7 relative) from swamping the difference: tolerance 1e-4.
    check_vjp_eps("convert f64->f32->f64", &[a()], &[0], 1e-4, 1e-2, |b, p| {
        let h = b.convert(p[0], DType::F32)?;
        let t = b.mul(h, h)?;
        b.convert(t, DType::F64)
    });
}

#[test]
fn shape_ops() {
    check_vjp(
        "broadcast_in_dim (new dims + size-1 dim, permuted)",
        &[rand(9, &[3, 1], -1.0, 1.0)],
        &[0],
        TOL,
        |b, p| b.broadcast_in_dim(p[0], &[2, 4, 3], &[2, 1]),
    );
    check_vjp(
        "reshape",
        &[rand(10, &[2, 6], -1.0, 1.0)],
        &[0],
        TOL,
        |b, p| b.reshape(p[0], &[3, 4]),
    );
    check_vjp(
        "transpose",
        &[rand(11, &[2, 3, 4], -1.0, 1.0)],
        &[0],
        TOL,
        |b, p| b.transpose(p[0], &[2, 0, 1]),
    );
    // Cotangents of slices along one dim are gathered before they are summed: pieces that tile
    // the operand become a concatenation (with zeros where no piece reads), overlapping pieces
    // are padded and added. Each case against finite differences.
    check_vjp(
        "slices tiling a dim, one gap",
        &[rand(18, &[7, 3], -1.0, 1.0)],
        &[0],
        TOL,
        |b, p| {
            let a = b.slice_dim(p[0], 0, 0, 2)?;
            let c = b.slice_dim(p[0], 0, 3, 7)?;
            let a2 = b.mul(a, a)?;
            let c3 = b.mul_scalar(c, 3.0)?;
            b.concatenate(&[c3, a2], 0)
        },
    );
    check_vjp(
        "overlapping slices and a direct use",
        &[rand(19, &[6, 4], -1.0, 1.0)],
        &[0],
        TOL,
        |b, p| {
            let a = b.slice_dim(p[0], 1, 0, 2)?;
            let c = b.slice_dim(p[0], 1, 1, 4)?;
            let d = b.slice_dim(p[0], 0, 2, 4)?;
            let ac = b.mul(a, a)?;
            let sa = b.sum_all(ac)?;
            let sc = b.sum_all(c)?;
            let sd = b.sum_all(d)?;
            let sx = b.sum_all(p[0])?;
            let t = b.add(sa, sc)?;
            let t = b.add(t, sd)?;
            b.mul(t, sx)
        },
    );
    check_vjp(
        "slice strided",
        &[rand(12, &[5, 6], -1.0, 1.0)],
        &[0],
        TOL,
        |b, p| b.slice(p[0], &[1, 0], &[5, 5], &[2, 2]),
    );
    check_vjp(
        "concatenate",
        &[rand(13, &[2, 3], -1.0, 1.0), rand(14, &[2, 2], -1.0, 1.0)],
        &[0, 1],
        TOL,
        |b, p| b.concatenate(&[p[0], p[1], p[0]], 1),
    );
    check_vjp(
        "pad with interior",
        &[rand(15, &[2, 3], -1.0, 1.0), rand(16, &[], -1.0, 1.0)],
        &[0, 1],
        TOL,
        |b, p| b.pad(p[0], p[1], &[1, 0], &[0, 2], &[1, 1]),
    );
}

#[test]
fn dynamic_slices() {
    check_vjp(
        "dynamic_slice",
        &[rand(17, &[4, 5], -1.0, 1.0)],
        &[0],
        TOL,
        |b, p| {
            let i = b.scalar(1.0, DType::S32);
            let j = b.scalar(2.0, DType::S32);
            b.dynamic_slice(p[0], &[i, j], &[2, 3])
        },
    );
    check_vjp(
        "dynamic_update_slice",
        &[rand(18, &[4, 5], -1.0, 1.0), rand(19, &[2, 2], -1.0, 1.0)],
        &[0, 1],
        TOL,
        |b, p| {
            let i = b.scalar(2.0, DType::S32);
            let j = b.scalar(1.0, DType::S32);
            b.dynamic_update_slice(p[0], p[1], &[i, j])
        },
    );
}

#[test]
fn gather_and_scatter() {
    // Embedding lookup with a repeated id: the table gradient must add both rows' cotangents.
    check_vjp(
        "take_rows",
        &[rand(20, &[5, 3], -1.0, 1.0)],
        &[0],
        TOL,
        |b, p| {
            let ids = b.constant(
                Literal::Int(vec![4, 1, 1, 0]),
                Shape::new(&[2, 2], DType::S32),
            )?;
            b.take_rows(p[0], ids)
        },
    );
    check_vjp(
        "gather general",
        &[rand(21, &[4, 6], -1.0, 1.0)],
        &[0],
        TOL,
        |b, p| {
            let idx = b.constant(
                Literal::Int(vec![0, 1, 2, 3, 1, 0]),
                Shape::new(&[3, 2], DType::S32),
            )?;
            let dims = GatherDims {
                offset_dims: vec![1],
                collapsed_slice_dims: vec![0],
                start_index_map: vec![0, 1],
                index_vector_dim: 1,
            };
            b.gather(p[0], idx, dims, &[1, 2])
        },
    );
    check_vjp(
        "scatter add",
        &[rand(22, &[5, 3], -1.0, 1.0), rand(23, &[4, 3], -1.0, 1.0)],
        &[0, 1],
        TOL,
        |b, p| {
            let ids = b.constant(
                Literal::Int(vec![4, 1, 1, 0]),
                Shape::new(&[4, 1], DType::S32),
            )?;
            let dims = ScatterDims {
                update_window_dims: vec![1],
                inserted_window_dims: vec![0],
                scatter_dims_to_operand_dims: vec![0],
                index_vector_dim: 1,
            };
            let s = b.scatter(p[0], ids, p[1], dims, hlo::Combiner::Add)?;
            b.mul(s, s)
        },
    );
}

#[test]
fn dot_general_all_layouts() {
    check_vjp(
        "matmul",
        &[rand(24, &[3, 4], -1.0, 1.0), rand(25, &[4, 2], -1.0, 1.0)],
        &[0, 1],
        TOL,
        |b, p| b.matmul(p[0], p[1]),
    );
    // Batch dims not leading on the rhs, two contracting dims in swapped order.
    check_vjp(
        "dot_general batch + 2 contracting",
        &[
            rand(26, &[2, 3, 4, 5], -1.0, 1.0),
            rand(27, &[5, 6, 2, 4], -1.0, 1.0),
        ],
        &[0, 1],
        TOL,
        |b, p| {
            let dims = DotDims {
                lhs_batch: vec![0],
                rhs_batch: vec![2],
                lhs_contract: vec![3, 2],
                rhs_contract: vec![0, 3],
            };
            b.dot_general(p[0], p[1], dims, None, None)
        },
    );
}

#[test]
fn reductions() {
    check_vjp(
        "reduce sum",
        &[rand(28, &[3, 4, 2], -1.0, 1.0)],
        &[0],
        TOL,
        |b, p| b.reduce_sum(p[0], &[0, 2]),
    );
    check_vjp(
        "reduce max",
        &[rand(29, &[3, 4], -1.0, 1.0)],
        &[0],
        TOL,
        |b, p| b.reduce_max(p[0], &[1]),
    );
}

#[test]
fn barrier_and_remat_region() {
    check_vjp(
        "optimization_barrier",
        &[rand(30, &[2, 2], -1.0, 1.0), rand(31, &[2, 2], -1.0, 1.0)],
        &[0, 1],
        TOL,
        |b, p| {
            let o = b.optimization_barrier(&[p[0], p[1]]);
            b.mul(o[0], o[1])
        },
    );
    check_vjp(
        "remat region",
        &[rand(32, &[3, 4], -1.0, 1.0), rand(33, &[4, 4], -1.0, 1.0)],
        &[0, 1],
        TOL,
        |b, p| {
            let h = b.remat(|b| {
                let h = b.matmul(p[0], p[1])?;
                let h = b.tanh(h)?;
                b.matmul(h, p[1])
            })?;
            b.logistic(h)
        },
    );
}

/// A computation with a gradient rule of its own: x^3 as a loop of multiplications (a while
/// loop has no generic vjp rule, so autodiff must use the given one, 3 x^2 g), inside a remat
/// region too (the rule then reads the recomputed inputs).
#[test]
fn custom_vjp_rules() {
    let cube = |b: &mut hlo::Builder, x: hlo::Value| -> hlo::Result<hlo::Value> {
        let one = b.full_like(x, 1.0);
        let out = b.fori_loop(3, &[one], &[x], |bb, _, c, inv| {
            Ok(vec![bb.mul(c[0], inv[0])?])
        })?;
        let rule: hlo::VjpRule = std::rc::Rc::new(|b, ins, _outs, cts| {
            let Some(g) = cts[0] else {
                return Ok(vec![None]);
            };
            let sq = b.mul(ins[0], ins[0])?;
            let three = b.mul_scalar(sq, 3.0)?;
            Ok(vec![Some(b.mul(three, g)?)])
        });
        Ok(b.custom_vjp(&[x], &[out[0]], rule)[0])
    };
    check_vjp(
        "custom rule around a loop",
        &[rand(40, &[2, 3], -1.5, 1.5)],
        &[0],
        TOL,
        |b, p| {
            let y = cube(b, p[0])?;
            b.tanh(y)
        },
    );
    check_vjp(
        "custom rule in a remat region",
        &[rand(41, &[2, 3], -1.5, 1.5), rand(42, &[2, 3], -1.5, 1.5)],
        &[0, 1],
        TOL,
        |b, p| {
            let y = b.remat(|b| {
                let s = b.mul(p[0], p[1])?;
                cube(b, s)
            })?;
            b.sin(y)
        },
    );
}
