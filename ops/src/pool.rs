//! Max and average pooling over 1, 2 or 3 spatial dims of `[N, C, *spatial]` (or, with a
//! channels-last `geom.layout`, `[N, *spatial, C]`): shape inference, CPU kernels (parallel over
//! the N·C planes; channels-last tensors are transposed channels-first around them, as for
//! convolutions) and gradients.
//!
//! Windows never lie wholly in the padding (padding <= kernel/2, as PyTorch requires), so every
//! window has at least one real element: max pooling never returns a padded −∞, and average
//! pooling without `count_include_pad` never divides by zero.

use crate::conv::{
    check_geom, float_dtype, run_real, spatial_rank, to3, via_channels_first, Real, RealKernel,
};
use crate::util::{arity, attr_err, shape_err, PAR_THRESHOLD};
use crate::{ConvGeom, HostTensor, Layout, Op, PoolKind, Result, Shape, TensorType, Value, VjpCtx};
use rayon::prelude::*;

/// The output shape of pooling `x` (in the op's layout), channels-first, validating the
/// attributes.
fn pool_out_shape(
    op: &Op,
    inputs: &[&TensorType],
    x: &[usize],
    kernel: &[usize],
    geom: &ConvGeom,
) -> Result<Shape> {
    let s = spatial_rank(op, inputs, x)?;
    let x = &geom.layout.dims_to_first(x)[..];
    check_geom(op, geom, s)?;
    if kernel.len() != s {
        return Err(attr_err(
            op,
            format!("kernel has {} entries for {s} spatial dims", kernel.len()),
        ));
    }
    if geom.dilation.iter().any(|&d| d != 1) {
        return Err(attr_err(
            op,
            format!("dilation {:?} must be all 1", geom.dilation),
        ));
    }
    if kernel.contains(&0) {
        return Err(attr_err(op, format!("kernel {kernel:?} must be >= 1")));
    }
    if geom.padding.iter().zip(kernel).any(|(&p, &k)| p > k / 2) {
        return Err(attr_err(
            op,
            format!(
                "padding {:?} must be at most half the kernel {kernel:?}",
                geom.padding
            ),
        ));
    }
    let mut out = x[..2].to_vec();
    for i in 0..s {
        let (n, k, p) = (x[2 + i], kernel[i], geom.padding[i]);
        let padded = p
            .checked_mul(2)
            .and_then(|pp| n.checked_add(pp))
            .filter(|&pp| pp <= isize::MAX as usize)
            .ok_or_else(|| {
                shape_err(
                    op,
                    inputs,
                    format!("spatial dim {i}: size {n} with padding {p} overflows"),
                )
            })?;
        if n == 0 || padded < k {
            return Err(shape_err(
                op,
                inputs,
                format!(
                    "spatial dim {i}: size {n} with padding {p} is smaller than the kernel {k}"
                ),
            ));
        }
        out.push((padded - k) / geom.stride[i] + 1);
    }
    Ok(Shape::new(out))
}

/// Output type of `pool` and `pool_grad`.
pub fn infer(op: &Op, inputs: &[&TensorType]) -> Result<TensorType> {
    match op {
        Op::Pool { kernel, geom, .. } => {
            arity(op, inputs, 1)?;
            let d = float_dtype(op, inputs)?;
            let out = pool_out_shape(op, inputs, inputs[0].shape.dims(), kernel, geom)?;
            Ok(TensorType::new(d, geom.layout.dims_from_first(out.dims())))
        }
        Op::PoolGrad { kernel, geom, .. } => {
            arity(op, inputs, 2)?;
            let d = float_dtype(op, inputs)?;
            let out = pool_out_shape(op, inputs, inputs[0].shape.dims(), kernel, geom)?;
            let out = Shape::new(geom.layout.dims_from_first(out.dims()));
            if inputs[1].shape != out {
                return Err(shape_err(
                    op,
                    inputs,
                    format!("grad_out must have the pooled shape {out}"),
                ));
            }
            Ok(TensorType::new(d, inputs[0].shape.clone()))
        }
        _ => Err(attr_err(op, "not a pooling op")),
    }
}

/// A pooling problem, as 3-d.
struct Geo {
    kind: PoolKind,
    planes: usize,
    ins: [usize; 3],
    ks: [usize; 3],
    outs: [usize; 3],
    stride: [usize; 3],
    pad: [usize; 3],
}

impl Geo {
    fn new(kind: PoolKind, x: &[usize], out: &[usize], kernel: &[usize], geom: &ConvGeom) -> Geo {
        Geo {
            kind,
            planes: x[0] * x[1],
            ins: to3(&x[2..], 1),
            ks: to3(kernel, 1),
            outs: to3(&out[2..], 1),
            stride: to3(&geom.stride, 1),
            pad: to3(&geom.padding, 0),
        }
    }
    fn in_sp(&self) -> usize {
        self.ins.iter().product()
    }
    fn out_sp(&self) -> usize {
        self.outs.iter().product()
    }
    /// Whether to split the planes across threads.
    fn parallel(&self) -> bool {
        self.planes > 1
            && self.planes * self.out_sp() * self.ks.iter().product::<usize>() >= PAR_THRESHOLD
    }
    /// The in-bounds input range of output `o`'s window along dim `i`.
    fn window(&self, i: usize, o: usize) -> (usize, usize) {
        let start = (o * self.stride[i]) as isize - self.pad[i] as isize;
        let lo = start.max(0) as usize;
        let hi = ((start + self.ks[i] as isize).max(0) as usize).min(self.ins[i]);
        (lo, hi.max(lo))
    }
    /// Calls `f(output index, input window ranges)` for every output position of a plane.
    fn for_each_window(&self, mut f: impl FnMut(usize, [(usize, usize); 3])) {
        let mut o = 0;
        for od in 0..self.outs[0] {
            let wd = self.window(0, od);
            for oh in 0..self.outs[1] {
                let wh = self.window(1, oh);
                for ow in 0..self.outs[2] {
                    f(o, [wd, wh, self.window(2, ow)]);
                    o += 1;
                }
            }
        }
    }
    /// The averaging divisor of a window.
    fn divisor<R: Real>(&self, count_include_pad: bool, win: &[(usize, usize); 3]) -> R {
        if count_include_pad {
            R::from_usize(self.ks.iter().product())
        } else {
            R::from_usize(win.iter().map(|(lo, hi)| hi - lo).product())
        }
    }
    /// The index (in the plane) of the first maximum of a window; NaN wins over numbers.
    fn argmax<R: Real>(&self, x: &[R], win: &[(usize, usize); 3]) -> usize {
        let [(d0, d1), (h0, h1), (w0, w1)] = *win;
        let (mut best, mut at) = (R::NEG_INF, usize::MAX);
        for d in d0..d1 {
            for h in h0..h1 {
                let row = (d * self.ins[1] + h) * self.ins[2];
                for w in w0..w1 {
                    let v = x[row + w];
                    if at == usize::MAX || v > best || (v.is_nan() && !best.is_nan()) {
                        best = v;
                        at = row + w;
                    }
                }
            }
        }
        at
    }
    /// Calls `f(index)` for every in-bounds index of a window.
    fn each_in<F: FnMut(usize)>(&self, win: &[(usize, usize); 3], mut f: F) {
        let [(d0, d1), (h0, h1), (w0, w1)] = *win;
        for d in d0..d1 {
            for h in h0..h1 {
                let row = (d * self.ins[1] + h) * self.ins[2];
                for w in w0..w1 {
                    f(row + w);
                }
            }
        }
    }
}

/// Runs `f(plane index, output plane)` over `chunk`-sized planes of `out`, in parallel if asked.
fn per_plane<R: Real>(
    out: &mut [R],
    chunk: usize,
    parallel: bool,
    f: impl Fn(usize, &mut [R]) + Sync,
) {
    if chunk == 0 {
        return;
    }
    if parallel {
        out.par_chunks_mut(chunk)
            .enumerate()
            .for_each(|(i, o)| f(i, o));
    } else {
        out.chunks_mut(chunk).enumerate().for_each(|(i, o)| f(i, o));
    }
}

/// The pooling forward: input x.
struct PoolFwd(Geo);

impl RealKernel for PoolFwd {
    fn run<R: Real>(&self, xs: &[&[R]]) -> Vec<R> {
        let geo = &self.0;
        let (in_sp, out_sp) = (geo.in_sp(), geo.out_sp());
        let mut out = vec![R::ZERO; geo.planes * out_sp];
        per_plane(&mut out, out_sp, geo.parallel(), |p, out_p| {
            let x = &xs[0][p * in_sp..][..in_sp];
            match geo.kind {
                PoolKind::Max => geo.for_each_window(|o, win| out_p[o] = x[geo.argmax(x, &win)]),
                PoolKind::Avg { count_include_pad } => geo.for_each_window(|o, win| {
                    let mut s = R::ZERO;
                    geo.each_in(&win, |i| s += x[i]);
                    out_p[o] = s / geo.divisor::<R>(count_include_pad, &win);
                }),
            }
        });
        out
    }
}

/// The pooling gradient: inputs x, grad_out.
struct PoolBwd(Geo);

impl RealKernel for PoolBwd {
    fn run<R: Real>(&self, xs: &[&[R]]) -> Vec<R> {
        let geo = &self.0;
        let (in_sp, out_sp) = (geo.in_sp(), geo.out_sp());
        let mut dx = vec![R::ZERO; geo.planes * in_sp];
        per_plane(&mut dx, in_sp, geo.parallel(), |p, dx_p| {
            let x = &xs[0][p * in_sp..][..in_sp];
            let g = &xs[1][p * out_sp..][..out_sp];
            match geo.kind {
                PoolKind::Max => geo.for_each_window(|o, win| dx_p[geo.argmax(x, &win)] += g[o]),
                PoolKind::Avg { count_include_pad } => geo.for_each_window(|o, win| {
                    let share = g[o] / geo.divisor::<R>(count_include_pad, &win);
                    geo.each_in(&win, |i| dx_p[i] += share);
                }),
            }
        });
        dx
    }
}

/// CPU kernels of `pool` and `pool_grad`.
pub fn cpu(op: &Op, inputs: &[&HostTensor], out: &TensorType) -> Result<HostTensor> {
    if let Op::Pool { kind, kernel, geom } | Op::PoolGrad { kind, kernel, geom } = op {
        if geom.layout == Layout::ChannelsLast {
            let geom = geom.clone().with_layout(Layout::ChannelsFirst);
            let (kind, kernel) = (*kind, kernel.clone());
            let first = if matches!(op, Op::Pool { .. }) {
                Op::Pool { kind, kernel, geom }
            } else {
                Op::PoolGrad { kind, kernel, geom }
            };
            return via_channels_first(&first, inputs, &[true, true], out);
        }
    }
    match op {
        Op::Pool { kind, kernel, geom } => {
            let geo = Geo::new(*kind, inputs[0].dims(), out.shape.dims(), kernel, geom);
            run_real(op, inputs, out, &PoolFwd(geo))
        }
        Op::PoolGrad { kind, kernel, geom } => {
            let geo = Geo::new(*kind, inputs[0].dims(), inputs[1].dims(), kernel, geom);
            run_real(op, inputs, out, &PoolBwd(geo))
        }
        _ => Err(attr_err(op, "not a pooling op")),
    }
}

/// Gradient rules: `pool(x)` → dx = pool_grad(x, g); `pool_grad` is not differentiable.
pub fn vjp(cx: &mut VjpCtx<'_>) -> Result<Vec<Option<Value>>> {
    match cx.op {
        Op::Pool { kind, kernel, geom } => {
            let op = Op::PoolGrad {
                kind: *kind,
                kernel: kernel.clone(),
                geom: geom.clone(),
            };
            let dx = cx.emit(op, &[cx.inputs[0], cx.grad])?;
            Ok(vec![Some(dx)])
        }
        Op::PoolGrad { .. } => Err(cx.not_differentiable(
            0,
            "the gradient of pooling is not differentiable (no second-order pooling rule)",
        )),
        op => Err(attr_err(op, "not a pooling op")),
    }
}
