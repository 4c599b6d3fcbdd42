//! Pooling kernels, forward and backward, 1-D to 3-D, over contiguous NC + spatial tensors.
//!
//! Generated rather than cuDNN's: measured on the H200 (docs/performance.md), cuDNN's pooling
//! moves well under half the copy bandwidth and its backward needs the forward result, which the
//! graph does not keep. Forward: a thread per output element loops over the in-bounds part of its
//! window (padding never wins a max, NaN does). Backward: a thread per input element gathers from
//! the outputs whose windows hold it, so no atomics are needed; max pooling first writes each
//! window's first maximum (the CPU kernel's rule; its in-plane index) to the step's scratch, and
//! the gather takes the gradient of the outputs whose maximum is itself.

use super::elementwise::{grid, grid_kernel, linear, param, Body, Coords};
use super::ir::*;
use super::{ArgRef, Launch, StepKernels};
use crate::{CodegenError, Result};
use rustytorch_ops::{ConvGeom, Op, PoolKind, Shape, TensorType};

/// The geometry of one pooling op, per spatial dim.
struct Geo {
    planes: usize,
    ins: Vec<usize>,
    outs: Vec<usize>,
    ks: Vec<usize>,
    stride: Vec<usize>,
    pad: Vec<usize>,
}

impl Geo {
    fn new(x: &Shape, y: &Shape, kernel: &[usize], g: &ConvGeom) -> Geo {
        let (xd, yd) = (x.dims(), y.dims());
        Geo {
            planes: xd[0] * xd[1],
            ins: xd[2..].to_vec(),
            outs: yd[2..].to_vec(),
            ks: kernel.to_vec(),
            stride: g.stride.clone(),
            pad: g.padding.clone(),
        }
    }
    fn in_sp(&self) -> usize {
        self.ins.iter().product()
    }
    fn out_sp(&self) -> usize {
        self.outs.iter().product()
    }
    fn in_strides(&self) -> Vec<usize> {
        Shape::new(self.ins.clone()).strides()
    }
    fn out_strides(&self) -> Vec<usize> {
        Shape::new(self.outs.clone()).strides()
    }
}

/// `(lo, hi)`: the in-bounds input range of the window of output coordinate `o` along dim `j`,
/// bound to locals named after `tag`.
fn window(stmts: &mut Vec<Stmt>, geo: &Geo, j: usize, o: Expr, tag: &str) -> (Expr, Expr) {
    let st = format!("{tag}s{j}");
    let (lo, hi) = (format!("{tag}lo{j}"), format!("{tag}hi{j}"));
    stmts.push(let_(
        &st,
        CTy::I64,
        sub(mul(o, i64c(geo.stride[j] as i64)), i64c(geo.pad[j] as i64)),
    ));
    stmts.push(let_(&lo, CTy::I64, bin(BinFn::Max, var(&st), i64c(0))));
    stmts.push(let_(
        &hi,
        CTy::I64,
        bin(
            BinFn::Min,
            add(var(&st), i64c(geo.ks[j] as i64)),
            i64c(geo.ins[j] as i64),
        ),
    ));
    (var(&lo), var(&hi))
}

/// Nested loops around `body` over the positions `{tag}w{j}` of `[lo, hi)` per dim (`ranges`),
/// written as `count` steps from `start` with a bounds check: constant trip counts let the
/// compiler unroll the loops and issue a window's loads together instead of one after another.
fn nest(ranges: &[(Expr, Expr)], steps: &[(Expr, i64)], tag: &str, body: Vec<Stmt>) -> Vec<Stmt> {
    let mut inner = body;
    for (j, ((lo, hi), (start, count))) in ranges.iter().zip(steps).enumerate().rev() {
        let (t, w) = (format!("{tag}t{j}"), format!("{tag}w{j}"));
        inner = vec![for_(
            &t,
            i64c(0),
            i64c(*count),
            i64c(1),
            vec![
                let_(&w, CTy::I64, add(start.clone(), var(&t))),
                if_(
                    bin(
                        BinFn::And,
                        bin(BinFn::Ge, var(&w), lo.clone()),
                        lt(var(&w), hi.clone()),
                    ),
                    inner,
                ),
            ],
        )];
    }
    inner
}

/// For the output at flat index `i`: binds its plane's input offset `base` and its window's
/// in-bounds ranges (see [`window`]) and returns them.
fn output_window(b: &mut Body, geo: &Geo, i: Expr) -> (Expr, Vec<(Expr, Expr)>) {
    let mut dims = vec![geo.planes];
    dims.extend(&geo.outs);
    let mut co = Coords::new(&dims, i);
    let plane = co.get(b, 0);
    let mut pre = vec![];
    let ranges = (0..geo.outs.len())
        .map(|j| {
            let oj = co.get(b, j + 1);
            window(&mut pre, geo, j, oj, "")
        })
        .collect();
    for s in pre {
        b.push(s);
    }
    let base = b.named("base", CTy::I64, mul(plane, i64c(geo.in_sp() as i64)));
    (base, ranges)
}

/// The loop steps of an output's window: from its start `{tag}s{j}`, the window's size.
fn window_steps(geo: &Geo, tag: &str) -> Vec<(Expr, i64)> {
    (0..geo.ks.len())
        .map(|j| (var(&format!("{tag}s{j}")), geo.ks[j] as i64))
        .collect()
}

/// The in-plane index of the window position `{tag}w{j}`.
fn in_plane(geo: &Geo, tag: &str) -> Expr {
    let st = geo.in_strides();
    linear(
        (0..geo.ins.len())
            .map(|j| (var(&format!("{tag}w{j}")), st[j] as i64))
            .collect(),
        0,
    )
}

/// The averaging divisor of a window whose in-bounds ranges are `ranges`.
fn divisor(geo: &Geo, include_pad: bool, ranges: &[(Expr, Expr)], ty: CTy) -> Expr {
    if include_pad {
        return fc(geo.ks.iter().product::<usize>() as f64, ty);
    }
    let mut n: Option<Expr> = None;
    for (lo, hi) in ranges {
        let e = sub(hi.clone(), lo.clone());
        n = Some(match n {
            Some(a) => mul(a, e),
            None => e,
        });
    }
    cast(ty, n.unwrap_or_else(|| i64c(1)))
}

/// Statements leaving in `{tag}at` the in-plane index of the first maximum of a window (NaN
/// wins over numbers; -1 for an empty window) of the plane starting at `base`.
fn argmax(
    geo: &Geo,
    ranges: &[(Expr, Expr)],
    base: Expr,
    ty: CTy,
    el: CTy,
    tag: &str,
) -> Vec<Stmt> {
    let (best, at, v) = (format!("{tag}best"), format!("{tag}at"), format!("{tag}v"));
    let idx = in_plane(geo, tag);
    let take = bin(
        BinFn::Or,
        bin(
            BinFn::Or,
            lt(var(&at), i64c(0)),
            bin(BinFn::Gt, var(&v), var(&best)),
        ),
        bin(
            BinFn::And,
            un(UnFn::IsNan, var(&v)),
            un(UnFn::Not, un(UnFn::IsNan, var(&best))),
        ),
    );
    let body = vec![
        let_(&v, ty, load("x", el, add(base, idx.clone()))),
        if_(take, vec![assign(&best, var(&v)), assign(&at, idx)]),
    ];
    let mut out = vec![
        let_(&best, ty, fc(f64::NEG_INFINITY, ty)),
        let_(&at, CTy::I64, i64c(-1)),
    ];
    out.extend(nest(ranges, &window_steps(geo, tag), tag, body));
    out
}

fn launch(k: Kernel, n_inputs: usize, n: usize) -> StepKernels {
    StepKernels {
        launches: vec![Launch::simple(k, n_inputs, grid(n))],
        scratch_bytes: 0,
    }
}

/// Lowers `pool` (operand x) or `pool_grad` (operands x, dy) to one kernel.
pub fn lower(op: &Op, inputs: &[&TensorType], out: &TensorType) -> Result<StepKernels> {
    let (kind, kernel, geom, grad) = match op {
        Op::Pool { kind, kernel, geom } => (*kind, kernel, geom, false),
        Op::PoolGrad { kind, kernel, geom } => (*kind, kernel, geom, true),
        _ => {
            return Err(CodegenError::Invalid(format!(
                "{} is not a pooling op",
                op.name()
            )))
        }
    };
    if geom.dilation.iter().any(|&d| d != 1) {
        return Err(CodegenError::Unsupported {
            op: op.name(),
            device: "cuda",
            reason: "dilated pooling".into(),
        });
    }
    let x = inputs[0];
    let dt = out.dtype;
    if !dt.is_float() {
        return Err(CodegenError::Unsupported {
            op: op.name(),
            device: "cuda",
            reason: format!("pooling of {dt:?}"),
        });
    }
    let n = out.shape.numel();
    if n == 0 {
        return Ok(StepKernels::default());
    }
    let (el, ty) = (CTy::storage(dt), CTy::compute(dt));
    if !grad {
        let geo = Geo::new(&x.shape, &out.shape, kernel, geom);
        let params = vec![param("x", dt, false), param("out", dt, true)];
        let k = grid_kernel("pool", params, n, |b: &mut Body, i| {
            let (base, ranges) = output_window(b, &geo, i.clone());
            let v = load("x", el, add(base, in_plane(&geo, "")));
            let (init, update, result) = match kind {
                PoolKind::Max => {
                    let take = bin(
                        BinFn::Or,
                        bin(BinFn::Gt, var("v"), var("acc")),
                        un(UnFn::IsNan, var("v")),
                    );
                    (
                        fc(f64::NEG_INFINITY, ty),
                        vec![
                            let_("v", ty, v),
                            assign("acc", select(take, var("v"), var("acc"))),
                        ],
                        var("acc"),
                    )
                }
                PoolKind::Avg { count_include_pad } => (
                    fc(0.0, ty),
                    vec![assign("acc", add(var("acc"), v))],
                    div(var("acc"), divisor(&geo, count_include_pad, &ranges, ty)),
                ),
            };
            b.push(let_("acc", ty, init));
            for s in nest(&ranges, &window_steps(&geo, ""), "", update) {
                b.push(s);
            }
            b.push(store("out", el, i, result));
            Ok(())
        })?;
        return Ok(launch(k, 1, n));
    }
    let geo = Geo::new(&x.shape, &inputs[1].shape, kernel, geom);
    // Max pooling: first each output's window maximum (its in-plane index) into the scratch,
    // then a gather that compares those indices with its own.
    let max = matches!(kind, PoolKind::Max);
    let idx_ty = if geo.in_sp() <= i32::MAX as usize {
        CTy::I32
    } else {
        CTy::I64
    };
    let n_out = inputs[1].shape.numel();
    let mut launches = vec![];
    if max {
        let params = vec![
            param("x", dt, false),
            Param {
                name: "idx".into(),
                elem: idx_ty,
                writes: true,
            },
        ];
        let k = grid_kernel("pool_argmax", params, n_out, |b: &mut Body, i| {
            let (base, ranges) = output_window(b, &geo, i.clone());
            for s in argmax(&geo, &ranges, base, ty, el, "") {
                b.push(s);
            }
            b.push(store("idx", idx_ty, i, cast(idx_ty, var("at"))));
            Ok(())
        })?;
        launches.push(Launch {
            kernel: k,
            args: vec![ArgRef::Input(0), ArgRef::Scratch],
            grid: grid(n_out),
        });
    }
    let params = vec![
        if max {
            Param {
                name: "idx".into(),
                elem: idx_ty,
                writes: false,
            }
        } else {
            param("x", dt, false)
        },
        param("dy", dt, false),
        param("out", dt, true),
    ];
    let k = grid_kernel("pool_grad", params, n, |b: &mut Body, i| {
        let mut dims = vec![geo.planes];
        dims.extend(&geo.ins);
        let mut co = Coords::new(&dims, i.clone());
        let plane = co.get(b, 0);
        let xs: Vec<Expr> = (0..geo.ins.len()).map(|j| co.get(b, j + 1)).collect();
        let ybase = b.named("ybase", CTy::I64, mul(plane, i64c(geo.out_sp() as i64)));
        let me = b.named(
            "me",
            CTy::I64,
            linear(
                xs.iter()
                    .cloned()
                    .zip(geo.in_strides().into_iter().map(|s| s as i64))
                    .collect(),
                0,
            ),
        );
        // The outputs whose windows hold this input: o·s − p ≤ x < o·s − p + k.
        let mut outs = vec![];
        for (j, xj) in xs.iter().enumerate() {
            let (p, k, s) = (geo.pad[j] as i64, geo.ks[j] as i64, geo.stride[j] as i64);
            let xp = b.named(&format!("xp{j}"), CTy::I64, add(xj.clone(), i64c(p)));
            let lo = b.named(
                &format!("olo{j}"),
                CTy::I64,
                select(
                    lt(xp.clone(), i64c(k)),
                    i64c(0),
                    add(div(sub(xp.clone(), i64c(k)), i64c(s)), i64c(1)),
                ),
            );
            let hi = b.named(
                &format!("ohi{j}"),
                CTy::I64,
                bin(
                    BinFn::Min,
                    add(div(xp, i64c(s)), i64c(1)),
                    i64c(geo.outs[j] as i64),
                ),
            );
            outs.push((lo, hi));
        }
        let ost = geo.out_strides();
        let o_index = linear(
            (0..geo.outs.len())
                .map(|j| (var(&format!("ow{j}")), ost[j] as i64))
                .collect(),
            0,
        );
        let oi = "oi";
        let mut body = vec![
            let_(oi, CTy::I64, add(ybase, o_index)),
            let_("g", ty, load("dy", el, var(oi))),
        ];
        match kind {
            PoolKind::Avg { count_include_pad } => {
                let ranges: Vec<(Expr, Expr)> = (0..geo.outs.len())
                    .map(|j| window(&mut body, &geo, j, var(&format!("ow{j}")), "p"))
                    .collect();
                body.push(assign(
                    "acc",
                    add(
                        var("acc"),
                        div(var("g"), divisor(&geo, count_include_pad, &ranges, ty)),
                    ),
                ))
            }
            PoolKind::Max => body.push(if_(
                bin(BinFn::Eq, cast(CTy::I64, load("idx", idx_ty, var(oi))), me),
                vec![assign("acc", add(var("acc"), var("g")))],
            )),
        }
        b.push(let_("acc", ty, fc(0.0, ty)));
        // At most ⌈k/s⌉ windows along a dim hold an input.
        let steps: Vec<(Expr, i64)> = outs
            .iter()
            .enumerate()
            .map(|(j, (lo, _))| (lo.clone(), geo.ks[j].div_ceil(geo.stride[j]) as i64))
            .collect();
        for s in nest(&outs, &steps, "o", body) {
            b.push(s);
        }
        b.push(store("out", el, i, var("acc")));
        Ok(())
    })?;
    let mut args = vec![
        if max {
            ArgRef::Scratch
        } else {
            ArgRef::Input(0)
        },
        ArgRef::Input(1),
    ];
    args.push(ArgRef::Output);
    launches.push(Launch {
        kernel: k,
        args,
        grid: grid(n),
    });
    Ok(StepKernels {
        launches,
        scratch_bytes: if max { n_out * elem_bytes(idx_ty) } else { 0 },
    })
}
