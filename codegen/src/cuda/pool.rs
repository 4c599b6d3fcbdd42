//! Pooling kernels, forward and backward, 1-D to 3-D, over contiguous channels-first
//! (`[N, C, *spatial]`) or channels-last (`[N, *spatial, C]`) tensors.
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
use rustytorch_ops::{ConvGeom, Layout, Op, PoolKind, Shape, TensorType};

/// The geometry of one pooling op, per spatial dim.
///
/// Every kernel addresses an element as its plane's base plus its spatial index times
/// [`Geo::mult`]: channels-first, a plane is one `(n, c)` pair's contiguous spatial block (base
/// `plane·spatial`); channels-last, the thread's coordinates are `[n, *spatial, c]` and the base
/// is `n·spatial·C + c` with spatial positions `C` elements apart.
struct Geo {
    planes: usize,
    /// Channels-last: the channel count (the innermost dim).
    last_c: Option<usize>,
    ins: Vec<usize>,
    outs: Vec<usize>,
    ks: Vec<usize>,
    stride: Vec<usize>,
    pad: Vec<usize>,
}

impl Geo {
    fn new(x: &Shape, y: &Shape, kernel: &[usize], g: &ConvGeom) -> Geo {
        let (xd, yd) = (x.dims(), y.dims());
        let r = xd.len();
        let (planes, last_c, ins, outs) = match g.layout {
            Layout::ChannelsFirst => (xd[0] * xd[1], None, &xd[2..], &yd[2..]),
            Layout::ChannelsLast => (xd[0], Some(xd[r - 1]), &xd[1..r - 1], &yd[1..r - 1]),
        };
        Geo {
            planes,
            last_c,
            ins: ins.to_vec(),
            outs: outs.to_vec(),
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
    /// Elements between neighbouring spatial positions.
    fn mult(&self) -> i64 {
        self.last_c.unwrap_or(1) as i64
    }
    /// The dims of a thread's coordinates over `spatial` (the input's or the output's).
    fn coord_dims(&self, spatial: &[usize]) -> Vec<usize> {
        let mut dims = vec![self.planes];
        dims.extend(spatial);
        dims.extend(self.last_c);
        dims
    }
    /// The base offset of the plane of coordinates `co` (from [`Geo::coord_dims`] over
    /// `spatial`) in a tensor of `sp` positions.
    fn plane_base(&self, b: &mut Body, co: &mut Coords, sp: usize, name: &str) -> Expr {
        let plane = co.get(b, 0);
        let e = match self.last_c {
            None => mul(plane, i64c(sp as i64)),
            Some(c) => {
                let ch = co.get(b, self.ins.len() + 1);
                add(mul(plane, i64c((sp * c) as i64)), ch)
            }
        };
        b.named(name, CTy::I64, e)
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

/// Binds the in-bounds window ranges (see [`window`]) of spatial dims `0..dims` for the output
/// whose spatial coordinate `j` is coordinate `j + 1` of `co`.
fn windows(b: &mut Body, geo: &Geo, co: &mut Coords, dims: usize) -> Vec<(Expr, Expr)> {
    let mut pre = vec![];
    let ranges = (0..dims)
        .map(|j| {
            let oj = co.get(b, j + 1);
            window(&mut pre, geo, j, oj, "")
        })
        .collect();
    for s in pre {
        b.push(s);
    }
    ranges
}

/// For the output at flat index `i`: binds its plane's input offset `base` and its window's
/// in-bounds ranges (see [`window`]) and returns them.
fn output_window(b: &mut Body, geo: &Geo, i: Expr) -> (Expr, Vec<(Expr, Expr)>) {
    let mut co = Coords::new(&geo.coord_dims(&geo.outs), i);
    let ranges = windows(b, geo, &mut co, geo.outs.len());
    let base = geo.plane_base(b, &mut co, geo.in_sp(), "base");
    (base, ranges)
}

/// The element offset of the window position `{tag}w{j}` in the plane starting at `base`.
fn at_window(geo: &Geo, base: Expr, tag: &str) -> Expr {
    add(base, mul(in_plane(geo, tag), i64c(geo.mult())))
}

/// The loop steps of an output's window: from its start `{tag}s{j}`, the window's size.
fn window_steps(geo: &Geo, tag: &str) -> Vec<(Expr, i64)> {
    (0..geo.ks.len())
        .map(|j| (var(&format!("{tag}s{j}")), geo.ks[j] as i64))
        .collect()
}

/// The in-plane (spatial) index of the window position `{tag}w{j}`.
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
        let_(&v, ty, load("x", el, at_window(geo, base, tag))),
        if_(take, vec![assign(&best, var(&v)), assign(&at, idx)]),
    ];
    let mut out = vec![
        let_(&best, ty, fc(f64::NEG_INFINITY, ty)),
        let_(&at, CTy::I64, i64c(-1)),
    ];
    out.extend(nest(ranges, &window_steps(geo, tag), tag, body));
    out
}

/// The outputs per thread of the row-vectorized forward kernel ([`forward_rows`]), if it
/// applies: one 16-byte vector of outputs along the last spatial dim, which needs that dim's
/// input and output sizes to be multiples of it (so every row starts 16-byte aligned and a
/// thread's outputs never cross a row), padding below the window (no window lies wholly in the
/// padding) and a window span of at most 64 inputs.
fn vector_width(geo: &Geo, dt: rustytorch_ops::DType) -> Option<usize> {
    let vl = 16 / dt.size_bytes();
    if geo.last_c.is_some() {
        return None;
    }
    let last = geo.ins.len().checked_sub(1)?;
    let (k, s) = (geo.ks[last], geo.stride[last]);
    let ok = vl >= 2
        && geo.ins[last].is_multiple_of(vl)
        && geo.outs[last].is_multiple_of(vl)
        && geo.pad.iter().zip(&geo.ks).all(|(p, k)| p < k)
        && (vl - 1) * s + k <= 64;
    ok.then_some(vl)
}

/// The forward kernel with a thread per `vl` consecutive outputs along the last spatial dim.
///
/// Generic pooling (a thread per output, scalar loads) is bound by index arithmetic, at well under
/// half the copy bandwidth. Here a thread reads, for each row of its window in the other dims, the
/// `(vl−1)·stride + window` inputs its outputs cover as aligned 16-byte vectors (a vector lies
/// wholly inside or wholly outside a row, since rows are multiples of `vl` long; vectors outside
/// read as padding: −∞ for max, 0 for average), reduces them in registers and stores its outputs
/// as one vector. Because `vl·stride` is a multiple of `vl`, where the span starts within its
/// first vector is the same constant for every thread, so the whole body is straight-line code.
fn forward_rows(kind: PoolKind, geo: &Geo, dt: rustytorch_ops::DType, vl: usize) -> Result<Kernel> {
    let (el, ty) = (CTy::storage(dt), CTy::compute(dt));
    let d = geo.ins.len();
    let last = d - 1;
    let (k, s, p) = (geo.ks[last], geo.stride[last], geo.pad[last]);
    let in_w = geo.ins[last] as i64;
    let span = (vl - 1) * s + k;
    // The span's offset inside its first aligned vector: (−p) mod vl.
    let lead = (-(p as i64)).rem_euclid(vl as i64) as usize;
    let chunks = (lead + span).div_ceil(vl);
    let fill = identity(kind, ty);
    let xv = |j: usize| format!("x{j}");
    let acc = |v: usize| format!("acc{v}");
    let n = geo.planes * geo.outs.iter().product::<usize>() / vl;
    let params = vec![param("x", dt, false), param("out", dt, true)];
    grid_kernel("pool_rows", params, n, |b: &mut Body, i| {
        let mut dims = vec![geo.planes];
        dims.extend(&geo.outs);
        dims[d] /= vl;
        let mut co = Coords::new(&dims, i.clone());
        let plane = co.get(b, 0);
        let ranges = windows(b, geo, &mut co, last);
        let ot = co.get(b, d);
        // The first input column of the span, and the aligned vector holding it.
        let c0 = b.named(
            "col0",
            CTy::I64,
            sub(mul(ot, i64c((vl * s) as i64)), i64c(p as i64)),
        );
        let a0 = b.named("vec0", CTy::I64, sub(c0.clone(), i64c(lead as i64)));
        let base = b.named("pbase", CTy::I64, mul(plane, i64c(geo.in_sp() as i64)));
        for v in 0..vl {
            b.push(let_(&acc(v), ty, fill.clone()));
        }
        // One row of the window: its span's vectors, then each output's window along the row.
        let st = geo.in_strides();
        let row = linear(
            (0..last)
                .map(|j| (var(&format!("w{j}")), st[j] as i64))
                .collect(),
            0,
        );
        let mut body = vec![let_("row", CTy::I64, add(base, row))];
        for q in 0..chunks {
            let used: Vec<usize> = (0..vl)
                .filter(|e| (lead..lead + span).contains(&(q * vl + e)))
                .collect();
            let start = format!("q{q}");
            body.push(let_(
                &start,
                CTy::I64,
                add(a0.clone(), i64c((q * vl) as i64)),
            ));
            for &e in &used {
                body.push(let_(&xv(q * vl + e - lead), ty, fill.clone()));
            }
            let inside = bin(
                BinFn::And,
                bin(BinFn::Ge, var(&start), i64c(0)),
                lt(var(&start), i64c(in_w)),
            );
            let at = add(var("row"), var(&start));
            let loads = if used.len() * 2 > vl {
                let names: Vec<String> = (0..vl).map(|e| format!("t{q}_{e}")).collect();
                let mut l = vec![load_vec("x", el, at, names.clone())];
                for &e in &used {
                    l.push(assign(&xv(q * vl + e - lead), var(&names[e])));
                }
                l
            } else {
                used.iter()
                    .map(|&e| {
                        let v = load("x", el, add(at.clone(), i64c(e as i64)));
                        assign(&xv(q * vl + e - lead), v)
                    })
                    .collect()
            };
            body.push(if_(inside, loads));
        }
        for v in 0..vl {
            for t in 0..k {
                body.push(fold(kind, &acc(v), var(&xv(v * s + t))));
            }
        }
        for st in nest(&ranges, &window_steps(geo, ""), "", body) {
            b.push(st);
        }
        let results: Vec<Expr> = (0..vl)
            .map(|v| match kind {
                PoolKind::Max => var(&acc(v)),
                PoolKind::Avg { count_include_pad } => {
                    let div_by = if count_include_pad {
                        fc(geo.ks.iter().product::<usize>() as f64, ty)
                    } else {
                        // In-bounds rows (the other dims) times in-bounds columns of output v.
                        let cs = add(c0.clone(), i64c((v * s) as i64));
                        let lo = bin(BinFn::Max, cs.clone(), i64c(0));
                        let hi = bin(BinFn::Min, add(cs, i64c(k as i64)), i64c(in_w));
                        let mut cnt = sub(hi, lo);
                        for (lo, hi) in &ranges {
                            cnt = mul(cnt, sub(hi.clone(), lo.clone()));
                        }
                        cast(ty, cnt)
                    };
                    div(var(&acc(v)), div_by)
                }
            })
            .collect();
        b.push(store_vec("out", el, mul(i, i64c(vl as i64)), results));
        Ok(())
    })
}

/// The channels-last forward kernel with a thread per 16 bytes of channels of one output: each
/// window position is one aligned vector (neighbouring threads read neighbouring vectors, so a
/// warp's loads are whole cache lines), reduced in registers and stored as one vector. Needs the
/// channel count to be a multiple of the vector.
fn forward_channels(
    kind: PoolKind,
    geo: &Geo,
    dt: rustytorch_ops::DType,
    vl: usize,
) -> Result<Kernel> {
    let (el, ty) = (CTy::storage(dt), CTy::compute(dt));
    let c = geo.last_c.unwrap_or(1);
    let d = geo.ins.len();
    let n = geo.planes * geo.outs.iter().product::<usize>() * c / vl;
    let acc = |v: usize| format!("acc{v}");
    let params = vec![param("x", dt, false), param("out", dt, true)];
    grid_kernel("pool_channels", params, n, |b: &mut Body, i| {
        let mut dims = vec![geo.planes];
        dims.extend(&geo.outs);
        dims.push(c / vl);
        let mut co = Coords::new(&dims, i.clone());
        let plane = co.get(b, 0);
        let ranges = windows(b, geo, &mut co, d);
        let cg = co.get(b, d + 1);
        let base = b.named(
            "base",
            CTy::I64,
            add(
                mul(plane, i64c((geo.in_sp() * c) as i64)),
                mul(cg, i64c(vl as i64)),
            ),
        );
        let init = identity(kind, ty);
        let names: Vec<String> = (0..vl).map(|e| format!("v{e}")).collect();
        for v in 0..vl {
            b.push(let_(&acc(v), ty, init.clone()));
        }
        let mut body = vec![load_vec("x", el, at_window(geo, base, ""), names.clone())];
        for (v, name) in names.iter().enumerate() {
            body.push(fold(kind, &acc(v), var(name)));
        }
        for st in nest(&ranges, &window_steps(geo, ""), "", body) {
            b.push(st);
        }
        let results: Vec<Expr> = (0..vl)
            .map(|v| match kind {
                PoolKind::Max => var(&acc(v)),
                PoolKind::Avg { count_include_pad } => {
                    div(var(&acc(v)), divisor(geo, count_include_pad, &ranges, ty))
                }
            })
            .collect();
        b.push(store_vec("out", el, mul(i, i64c(vl as i64)), results));
        Ok(())
    })
}

/// The value a window's reduction starts from (and padding reads as): −∞ for max, 0 for average.
fn identity(kind: PoolKind, ty: CTy) -> Expr {
    match kind {
        PoolKind::Max => fc(f64::NEG_INFINITY, ty),
        PoolKind::Avg { .. } => fc(0.0, ty),
    }
}

/// `acc ← acc ⊕ x`: the larger (a NaN wins) for max, the sum for average.
fn fold(kind: PoolKind, acc: &str, x: Expr) -> Stmt {
    let a = var(acc);
    match kind {
        PoolKind::Max => {
            let take = bin(
                BinFn::Or,
                bin(BinFn::Gt, x.clone(), a.clone()),
                un(UnFn::IsNan, x.clone()),
            );
            assign(acc, select(take, x, a))
        }
        PoolKind::Avg { .. } => assign(acc, add(a, x)),
    }
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
        if let Some(vl) = vector_width(&geo, dt) {
            let k = forward_rows(kind, &geo, dt, vl)?;
            return Ok(launch(k, 1, n / vl));
        }
        let vl = 16 / dt.size_bytes();
        if geo.last_c.is_some_and(|c| c.is_multiple_of(vl)) {
            let k = forward_channels(kind, &geo, dt, vl)?;
            return Ok(launch(k, 1, n / vl));
        }
        let params = vec![param("x", dt, false), param("out", dt, true)];
        let k = grid_kernel("pool", params, n, |b: &mut Body, i| {
            let (base, ranges) = output_window(b, &geo, i.clone());
            let v = load("x", el, at_window(&geo, base, ""));
            // The loaded value is bound first: max reads it twice.
            let update = vec![let_("v", ty, v), fold(kind, "acc", var("v"))];
            let result = match kind {
                PoolKind::Max => var("acc"),
                PoolKind::Avg { count_include_pad } => {
                    div(var("acc"), divisor(&geo, count_include_pad, &ranges, ty))
                }
            };
            b.push(let_("acc", ty, identity(kind, ty)));
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
                map: None,
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
                map: None,
            }
        } else {
            param("x", dt, false)
        },
        param("dy", dt, false),
        param("out", dt, true),
    ];
    let k = grid_kernel("pool_grad", params, n, |b: &mut Body, i| {
        let mut co = Coords::new(&geo.coord_dims(&geo.ins), i.clone());
        let xs: Vec<Expr> = (0..geo.ins.len()).map(|j| co.get(b, j + 1)).collect();
        let ybase = geo.plane_base(b, &mut co, geo.out_sp(), "ybase");
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
                .map(|j| (var(&format!("ow{j}")), ost[j] as i64 * geo.mult()))
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
