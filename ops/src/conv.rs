//! Convolution over 1, 2 or 3 spatial dims (NCW, NCHW, NCDHW), grouped, strided, padded and
//! dilated: shape inference, CPU kernels (im2col + GEMM per batch and group) and gradients.
//!
//! One implementation serves every rank: 1-d and 2-d problems are run as 3-d ones with leading
//! spatial dims of size 1. f16/bf16 are computed in f32 and rounded once at the end.
//!
//! A convolution's activation (`act`, [`Activation`]) is applied with its bias in the kernel's own
//! output loop, per batch while the block is in cache; its gradient goes back through the
//! activation at the recomputed pre-activation (as the matmul epilogue's does), then through the
//! convolution.
//!
//! Channels-last ops (`geom.layout`, [`Layout::ChannelsLast`]: activations `[N, *spatial, C]`,
//! weights `[O, *kernel, C/groups]`) are inferred on their dims reordered channels-first, and the
//! CPU runs them by transposing the operands channels-first, running the channels-first kernel
//! and transposing the result back: the CPU has no faster channels-last kernel, and the layout
//! exists for devices whose libraries have one (docs/architecture.md).

use crate::util::{arity, attr_err, dtype_err, shape_err};
use crate::vmath::{self, VFn};
use crate::{
    bf16, f16, Activation, ConvGeom, DType, Data, Element, HostTensor, Layout, Op, OpError, Result,
    Shape, TensorType, UnaryOp, Value, VjpCtx,
};
use gemm::Parallelism;
use rayon::prelude::*;
use std::borrow::Cow;
use std::ops::{Add, AddAssign, Div, Mul};

// ---------------------------------------------------------------------------------------------
// Compute types shared with pooling
// ---------------------------------------------------------------------------------------------

/// A kernel compute type: f64 for f64 tensors, f32 for f32, f16 and bf16 tensors.
pub(crate) trait Real:
    Copy
    + Send
    + Sync
    + PartialOrd
    + Add<Output = Self>
    + AddAssign
    + Mul<Output = Self>
    + Div<Output = Self>
    + 'static
{
    /// 0
    const ZERO: Self;
    /// 1
    const ONE: Self;
    /// -∞
    const NEG_INF: Self;
    /// `n` as this type.
    fn from_usize(n: usize) -> Self;
    /// Whether this is NaN.
    fn is_nan(self) -> bool;
    /// Applies `act` to every element of `v` in place.
    fn activate(v: &mut [Self], act: Activation);
}

impl Real for f32 {
    const ZERO: f32 = 0.0;
    const ONE: f32 = 1.0;
    const NEG_INF: f32 = f32::NEG_INFINITY;
    fn from_usize(n: usize) -> f32 {
        n as f32
    }
    fn is_nan(self) -> bool {
        f32::is_nan(self)
    }
    /// The vectorized forms of [`crate::vmath`].
    fn activate(v: &mut [f32], act: Activation) {
        let f = match act {
            Activation::None => return,
            Activation::Relu => VFn::Relu,
            Activation::GeluErf => VFn::GeluErf,
            Activation::GeluTanh => VFn::GeluTanh,
        };
        let n = v.len();
        vmath::bias_act(v, None, n, f);
    }
}

impl Real for f64 {
    const ZERO: f64 = 0.0;
    const ONE: f64 = 1.0;
    const NEG_INF: f64 = f64::NEG_INFINITY;
    fn from_usize(n: usize) -> f64 {
        n as f64
    }
    fn is_nan(self) -> bool {
        f64::is_nan(self)
    }
    fn activate(v: &mut [f64], act: Activation) {
        let f = match act {
            Activation::None => return,
            Activation::Relu => crate::matmul::relu,
            Activation::GeluErf => crate::matmul::gelu_erf,
            Activation::GeluTanh => crate::matmul::gelu_tanh,
        };
        v.iter_mut().for_each(|y| *y = f(*y));
    }
}

/// A kernel generic over its compute type, run by [`run_real`].
pub(crate) trait RealKernel {
    /// Computes the output from the inputs' elements in the compute type.
    fn run<R: Real>(&self, xs: &[&[R]]) -> Vec<R>;
}

/// A float tensor's elements as f32 (borrowed when already f32).
fn as_f32(t: &HostTensor) -> Cow<'_, [f32]> {
    match t.data() {
        Data::F32(v) => Cow::Borrowed(v),
        Data::F16(v) => Cow::Owned(v.iter().map(|x| x.to_f32()).collect()),
        Data::BF16(v) => Cow::Owned(v.iter().map(|x| x.to_f32()).collect()),
        other => Cow::Owned(
            crate::with_data!(other, v => v.iter().map(|x| Element::to_f32(*x)).collect()),
        ),
    }
}

/// Runs `k` in the compute type of `dtype` (a float dtype, the same for every input) and returns
/// the result as a tensor of `out`.
pub(crate) fn run_real(
    op: &Op,
    inputs: &[&HostTensor],
    out: &TensorType,
    k: &impl RealKernel,
) -> Result<HostTensor> {
    let data = match out.dtype {
        DType::F64 => {
            let xs = inputs
                .iter()
                .map(|t| t.as_slice::<f64>())
                .collect::<Result<Vec<_>>>()?;
            Data::F64(k.run::<f64>(&xs).into())
        }
        DType::F32 | DType::F16 | DType::BF16 => {
            let cows: Vec<Cow<'_, [f32]>> = inputs.iter().map(|t| as_f32(t)).collect();
            let xs: Vec<&[f32]> = cows.iter().map(|c| &**c).collect();
            let r = k.run::<f32>(&xs);
            match out.dtype {
                DType::F16 => Data::F16(r.into_iter().map(f16::from_f32).collect()),
                DType::BF16 => Data::BF16(r.into_iter().map(bf16::from_f32).collect()),
                _ => Data::F32(r.into()),
            }
        }
        d => {
            return Err(OpError::Runtime {
                op: op.name(),
                reason: format!("no CPU kernel for dtype {d}"),
            })
        }
    };
    HostTensor::from_data(data, out.shape.clone())
}

/// Checks that every input has the same float dtype; returns it.
pub(crate) fn float_dtype(op: &Op, inputs: &[&TensorType]) -> Result<DType> {
    let d = inputs[0].dtype;
    if !d.is_float() {
        return Err(dtype_err(op, inputs, "a float dtype is required"));
    }
    if inputs.iter().any(|t| t.dtype != d) {
        return Err(dtype_err(op, inputs, "all inputs must have the same dtype"));
    }
    Ok(d)
}

/// Checks that `t` is `[N, C, *spatial]` with 1 to 3 spatial dims; returns the spatial rank.
pub(crate) fn spatial_rank(op: &Op, inputs: &[&TensorType], t: &[usize]) -> Result<usize> {
    if !(3..=5).contains(&t.len()) {
        return Err(shape_err(
            op,
            inputs,
            format!(
                "expected an input of rank 3, 4 or 5 ([N, C, *spatial]), got rank {}",
                t.len()
            ),
        ));
    }
    Ok(t.len() - 2)
}

/// Checks that each geometry vector has `s` entries and that strides (and dilations) are >= 1.
pub(crate) fn check_geom(op: &Op, geom: &ConvGeom, s: usize) -> Result<()> {
    for (name, v) in [
        ("stride", &geom.stride),
        ("padding", &geom.padding),
        ("dilation", &geom.dilation),
    ] {
        if v.len() != s {
            return Err(attr_err(
                op,
                format!("{name} has {} entries for {s} spatial dims", v.len()),
            ));
        }
    }
    if geom.stride.contains(&0) {
        return Err(attr_err(
            op,
            format!("stride {:?} must be >= 1", geom.stride),
        ));
    }
    if geom.dilation.contains(&0) {
        return Err(attr_err(
            op,
            format!("dilation {:?} must be >= 1", geom.dilation),
        ));
    }
    Ok(())
}

/// The range of output positions `o` in `0..out` whose input position `o*stride + off` lies in
/// `0..len`.
#[inline]
pub(crate) fn valid_range(off: isize, stride: usize, len: usize, out: usize) -> (usize, usize) {
    let s = stride as isize;
    let lo = if off >= 0 { 0 } else { (-off + s - 1) / s };
    let room = len as isize - off;
    let hi = if room <= 0 { 0 } else { (room + s - 1) / s };
    let lo = (lo as usize).min(out);
    (lo, (hi as usize).clamp(lo, out))
}

/// Pads a spatial vector to 3 entries by prepending `fill`.
pub(crate) fn to3(v: &[usize], fill: usize) -> [usize; 3] {
    let mut r = [fill; 3];
    r[3 - v.len()..].copy_from_slice(v);
    r
}

// ---------------------------------------------------------------------------------------------
// Shape inference
// ---------------------------------------------------------------------------------------------

/// The output shape of a convolution of `x` by a weight of shape `w`, validating everything.
fn conv_out_shape(
    op: &Op,
    inputs: &[&TensorType],
    x: &[usize],
    w: &[usize],
    geom: &ConvGeom,
    groups: usize,
) -> Result<Shape> {
    let s = spatial_rank(op, inputs, x)?;
    check_geom(op, geom, s)?;
    if groups == 0 {
        return Err(attr_err(op, "groups must be >= 1"));
    }
    if w.len() != x.len() {
        return Err(shape_err(
            op,
            inputs,
            format!(
                "weight {} must have the input's rank {} ([O, C/groups, *kernel])",
                Shape::new(w),
                x.len()
            ),
        ));
    }
    let (c, o) = (x[1], w[0]);
    if c % groups != 0 || o % groups != 0 {
        return Err(shape_err(
            op,
            inputs,
            format!("groups {groups} must divide the input channels {c} and output channels {o}"),
        ));
    }
    if w[1].checked_mul(groups) != Some(c) {
        return Err(shape_err(
            op,
            inputs,
            format!(
                "weight {} has {} input channels per group, expected C/groups = {}",
                Shape::new(w),
                w[1],
                c / groups
            ),
        ));
    }
    let mut out = vec![x[0], o];
    for i in 0..s {
        let (n, k) = (x[2 + i], w[2 + i]);
        let (st, p, d) = (geom.stride[i], geom.padding[i], geom.dilation[i]);
        if k == 0 {
            return Err(shape_err(op, inputs, "kernel dims must be >= 1"));
        }
        // Checked: absurd attributes give an error naming the op, never an overflow.
        let overflow = |what: &str| {
            shape_err(
                op,
                inputs,
                format!("spatial dim {i}: the {what} overflows (size {n}, kernel {k}, stride {st}, padding {p}, dilation {d})"),
            )
        };
        let span = d
            .checked_mul(k - 1)
            .and_then(|s| s.checked_add(1))
            .ok_or_else(|| overflow("dilated kernel"))?;
        let padded = p
            .checked_mul(2)
            .and_then(|pp| n.checked_add(pp))
            .filter(|&pp| pp <= isize::MAX as usize)
            .ok_or_else(|| overflow("padded size"))?;
        if padded < span {
            return Err(shape_err(
                op,
                inputs,
                format!("spatial dim {i}: padded size {padded} is smaller than the dilated kernel {span}"),
            ));
        }
        out.push((padded - span) / st + 1);
    }
    Ok(Shape::new(out))
}

/// Output type of `conv`, `conv_grad_input` and `conv_grad_weight`.
pub fn infer(op: &Op, inputs: &[&TensorType]) -> Result<TensorType> {
    // Shapes are checked channels-first; `first` reorders a shape of the op's layout.
    let first = |geom: &ConvGeom, dims: &[usize]| geom.layout.dims_to_first(dims);
    let back = |geom: &ConvGeom, s: Shape| Shape::new(geom.layout.dims_from_first(s.dims()));
    match op {
        Op::Conv {
            geom, groups, bias, ..
        } => {
            arity(op, inputs, if *bias { 3 } else { 2 })?;
            let d = float_dtype(op, inputs)?;
            let (x, w) = (inputs[0].shape.dims(), inputs[1].shape.dims());
            spatial_rank(op, inputs, x)?;
            let (xf, wf) = (first(geom, x), first(geom, w));
            let out = conv_out_shape(op, inputs, &xf, &wf, geom, *groups)?;
            if *bias && inputs[2].shape.dims() != [w[0]] {
                return Err(shape_err(
                    op,
                    inputs,
                    format!("bias must have shape [{}] (the output channels)", w[0]),
                ));
            }
            Ok(TensorType::new(d, back(geom, out)))
        }
        Op::ConvGradInput {
            geom,
            groups,
            input_shape,
        } => {
            arity(op, inputs, 2)?;
            let d = float_dtype(op, inputs)?;
            let (g, w) = (inputs[0].shape.dims(), inputs[1].shape.dims());
            spatial_rank(op, inputs, input_shape.dims())?;
            let xf = first(geom, input_shape.dims());
            let out = conv_out_shape(op, inputs, &xf, &first(geom, w), geom, *groups)?;
            let out = back(geom, out);
            if out.dims() != g {
                return Err(shape_err(
                    op,
                    inputs,
                    format!("grad_out must have shape {out} (a conv of input {input_shape})"),
                ));
            }
            Ok(TensorType::new(d, input_shape.clone()))
        }
        Op::ConvGradWeight {
            geom,
            groups,
            weight_shape,
        } => {
            arity(op, inputs, 2)?;
            let d = float_dtype(op, inputs)?;
            let (x, g) = (inputs[0].shape.dims(), inputs[1].shape.dims());
            spatial_rank(op, inputs, x)?;
            let wf = first(geom, weight_shape.dims());
            let out = conv_out_shape(op, inputs, &first(geom, x), &wf, geom, *groups)?;
            let out = back(geom, out);
            if out.dims() != g {
                return Err(shape_err(
                    op,
                    inputs,
                    format!("grad_out must have shape {out} (a conv by weight {weight_shape})"),
                ));
            }
            Ok(TensorType::new(d, weight_shape.clone()))
        }
        _ => Err(attr_err(op, "not a convolution op")),
    }
}

/// Runs a channels-last op on the CPU: its operands transposed channels-first (`transpose[k]`
/// says whether operand `k` is one of its activations or weights), the channels-first `op` on
/// them, and its result transposed back.
pub(crate) fn via_channels_first(
    op: &Op,
    inputs: &[&HostTensor],
    transpose: &[bool],
    out: &TensorType,
) -> Result<HostTensor> {
    let moved: Vec<HostTensor> = inputs
        .iter()
        .zip(transpose)
        .map(|(t, &tr)| {
            if tr {
                let perm = Layout::ChannelsLast.to_first(t.dims().len());
                crate::eval_cpu(&Op::Permute { perm }, &[t])
            } else {
                Ok((*t).clone())
            }
        })
        .collect::<Result<_>>()?;
    let refs: Vec<&HostTensor> = moved.iter().collect();
    let r = crate::eval_cpu(op, &refs)?;
    let perm = Layout::ChannelsLast.from_first(out.shape.rank());
    crate::eval_cpu(&Op::Permute { perm }, &[&r])
}

/// `op` with its geometry channels-first and its shape attribute reordered to match.
fn channels_first(op: &Op) -> Op {
    let first = |g: &ConvGeom| g.clone().with_layout(Layout::ChannelsFirst);
    let shape = |g: &ConvGeom, s: &Shape| Shape::new(g.layout.dims_to_first(s.dims()));
    match op {
        Op::Conv {
            geom,
            groups,
            bias,
            act,
        } => Op::Conv {
            geom: first(geom),
            groups: *groups,
            bias: *bias,
            act: *act,
        },
        Op::ConvGradInput {
            geom,
            groups,
            input_shape,
        } => Op::ConvGradInput {
            geom: first(geom),
            groups: *groups,
            input_shape: shape(geom, input_shape),
        },
        Op::ConvGradWeight {
            geom,
            groups,
            weight_shape,
        } => Op::ConvGradWeight {
            geom: first(geom),
            groups: *groups,
            weight_shape: shape(geom, weight_shape),
        },
        other => other.clone(),
    }
}

// ---------------------------------------------------------------------------------------------
// CPU kernels
// ---------------------------------------------------------------------------------------------

/// A convolution problem, as 3-d.
#[derive(Clone, Debug)]
struct Geo {
    n: usize,
    c: usize,
    o: usize,
    groups: usize,
    ins: [usize; 3],
    ks: [usize; 3],
    outs: [usize; 3],
    stride: [usize; 3],
    pad: [usize; 3],
    dil: [usize; 3],
}

impl Geo {
    fn new(x: &[usize], w: &[usize], out: &[usize], geom: &ConvGeom, groups: usize) -> Geo {
        Geo {
            n: x[0],
            c: x[1],
            o: w[0],
            groups,
            ins: to3(&x[2..], 1),
            ks: to3(&w[2..], 1),
            outs: to3(&out[2..], 1),
            stride: to3(&geom.stride, 1),
            pad: to3(&geom.padding, 0),
            dil: to3(&geom.dilation, 1),
        }
    }
    /// Input channels per group.
    fn cg(&self) -> usize {
        self.c / self.groups
    }
    /// Output channels per group.
    fn og(&self) -> usize {
        self.o / self.groups
    }
    /// Input spatial size.
    fn in_sp(&self) -> usize {
        self.ins.iter().product()
    }
    /// Output spatial size (the GEMM's `n`).
    fn l(&self) -> usize {
        self.outs.iter().product()
    }
    /// Rows of a group's column matrix (the GEMM's `k`): C/groups · kernel size.
    fn kdim(&self) -> usize {
        self.cg() * self.ks.iter().product::<usize>()
    }
    /// A 1×1 kernel with unit stride and no padding: the column matrix is the input itself.
    fn pointwise(&self) -> bool {
        self.ks == [1; 3] && self.stride == [1; 3] && self.pad == [0; 3]
    }
    /// Multiply-adds of the whole convolution.
    fn macs(&self) -> usize {
        self.n * self.o * self.l() * self.kdim()
    }
    /// How work is split: (parallel over the batch, GEMM parallelism inside).
    fn plan(&self) -> (bool, Parallelism) {
        if self.macs() < (1 << 20) {
            return (false, Parallelism::None);
        }
        let threads = rayon::current_num_threads();
        if self.n >= threads {
            (true, Parallelism::None)
        } else {
            (self.n > 1, Parallelism::Rayon(0))
        }
    }
    /// The input offset of kernel tap `k` for output 0 along dim `i`.
    fn off(&self, i: usize, k: usize) -> isize {
        (k * self.dil[i]) as isize - self.pad[i] as isize
    }
}

/// Unfolds one group's input `x` ([C/groups, *in]) into `cols` ([C/groups·kernel, *out]).
fn im2col<R: Real>(geo: &Geo, x: &[R], cols: &mut [R]) {
    let [id_n, ih_n, iw_n] = geo.ins;
    let [kd_n, kh_n, kw_n] = geo.ks;
    let [od_n, oh_n, ow_n] = geo.outs;
    let [_, _, sw] = geo.stride;
    let l = geo.l();
    let mut row = 0;
    for c in 0..geo.cg() {
        let xc = &x[c * geo.in_sp()..][..geo.in_sp()];
        for kd in 0..kd_n {
            let (d_lo, d_hi) = valid_range(geo.off(0, kd), geo.stride[0], id_n, od_n);
            for kh in 0..kh_n {
                let (h_lo, h_hi) = valid_range(geo.off(1, kh), geo.stride[1], ih_n, oh_n);
                for kw in 0..kw_n {
                    let offw = geo.off(2, kw);
                    let (w_lo, w_hi) = valid_range(offw, sw, iw_n, ow_n);
                    let dst = &mut cols[row * l..][..l];
                    row += 1;
                    for od in 0..od_n {
                        let plane = &mut dst[od * oh_n * ow_n..][..oh_n * ow_n];
                        if od < d_lo || od >= d_hi {
                            plane.fill(R::ZERO);
                            continue;
                        }
                        let id = (od * geo.stride[0]) as isize + geo.off(0, kd);
                        for oh in 0..oh_n {
                            let line = &mut plane[oh * ow_n..][..ow_n];
                            if oh < h_lo || oh >= h_hi {
                                line.fill(R::ZERO);
                                continue;
                            }
                            let ih = (oh * geo.stride[1]) as isize + geo.off(1, kh);
                            let src = &xc[(id as usize * ih_n + ih as usize) * iw_n..][..iw_n];
                            line[..w_lo].fill(R::ZERO);
                            line[w_hi..].fill(R::ZERO);
                            let start = (w_lo * sw) as isize + offw;
                            for (j, v) in line[w_lo..w_hi].iter_mut().enumerate() {
                                *v = src[start as usize + j * sw];
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Folds `cols` ([C/groups·kernel, *out]) back onto one group's input gradient `dx`
/// ([C/groups, *in]), adding overlapping taps.
fn col2im<R: Real>(geo: &Geo, cols: &[R], dx: &mut [R]) {
    let [id_n, ih_n, iw_n] = geo.ins;
    let [kd_n, kh_n, kw_n] = geo.ks;
    let [od_n, oh_n, ow_n] = geo.outs;
    let [_, _, sw] = geo.stride;
    let l = geo.l();
    let mut row = 0;
    for c in 0..geo.cg() {
        let xc = &mut dx[c * geo.in_sp()..][..geo.in_sp()];
        for kd in 0..kd_n {
            let (d_lo, d_hi) = valid_range(geo.off(0, kd), geo.stride[0], id_n, od_n);
            for kh in 0..kh_n {
                let (h_lo, h_hi) = valid_range(geo.off(1, kh), geo.stride[1], ih_n, oh_n);
                for kw in 0..kw_n {
                    let offw = geo.off(2, kw);
                    let (w_lo, w_hi) = valid_range(offw, sw, iw_n, ow_n);
                    let src = &cols[row * l..][..l];
                    row += 1;
                    for od in d_lo..d_hi {
                        let id = (od * geo.stride[0]) as isize + geo.off(0, kd);
                        for oh in h_lo..h_hi {
                            let ih = (oh * geo.stride[1]) as isize + geo.off(1, kh);
                            let dst = &mut xc[(id as usize * ih_n + ih as usize) * iw_n..][..iw_n];
                            let line = &src[(od * oh_n + oh) * ow_n..][..ow_n];
                            let start = (w_lo * sw) as isize + offw;
                            for (j, &v) in line[w_lo..w_hi].iter().enumerate() {
                                dst[start as usize + j * sw] += v;
                            }
                        }
                    }
                }
            }
        }
    }
}

/// A strided matrix operand: its elements and its row and column strides.
#[derive(Clone, Copy)]
struct Mat<'a, R> {
    data: &'a [R],
    rs: usize,
    cs: usize,
}

impl<'a, R> Mat<'a, R> {
    /// A row-major matrix with `ld` elements per row.
    fn rows(data: &'a [R], ld: usize) -> Self {
        Mat {
            data,
            rs: ld,
            cs: 1,
        }
    }
    /// The transpose of a row-major matrix with `ld` elements per row.
    fn trans(data: &'a [R], ld: usize) -> Self {
        Mat {
            data,
            rs: 1,
            cs: ld,
        }
    }
    /// Whether an `r × c` matrix with these strides lies inside the data.
    fn fits(&self, r: usize, c: usize) -> bool {
        r == 0 || c == 0 || (r - 1) * self.rs + (c - 1) * self.cs < self.data.len()
    }
}

/// `dst[m×n]` (row-major, `n` per row) `= [dst +] lhs[m×k] · rhs[k×n]` with the gemm crate.
fn matmul<R: Real>(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [R],
    accumulate: bool,
    lhs: Mat<'_, R>,
    rhs: Mat<'_, R>,
    par: Parallelism,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(dst.len() >= m * n && lhs.fits(m, k) && rhs.fits(k, n));
    if k == 0 {
        if !accumulate {
            dst[..m * n].fill(R::ZERO);
        }
        return;
    }
    // SAFETY: the assert above keeps every element gemm reads or writes inside the three
    // slices; `dst` is borrowed mutably and cannot alias `lhs` or `rhs`; R is f32 or f64, types
    // gemm supports.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            lhs.data.as_ptr(),
            lhs.cs as isize,
            lhs.rs as isize,
            rhs.data.as_ptr(),
            rhs.cs as isize,
            rhs.rs as isize,
            R::ONE,
            R::ONE,
            false,
            false,
            false,
            par,
        )
    }
}

/// Runs `f(batch index, chunk, scratch)` over the `chunk`-sized pieces of `out`, in parallel
/// when `parallel`; the scratch vector is reused within a thread.
fn per_batch<R: Real>(
    out: &mut [R],
    chunk: usize,
    parallel: bool,
    f: impl Fn(usize, &mut [R], &mut Vec<R>) + Sync,
) {
    if chunk == 0 {
        return;
    }
    if parallel {
        out.par_chunks_mut(chunk)
            .enumerate()
            .for_each_init(Vec::new, |scratch, (i, o)| f(i, o, scratch));
    } else {
        let mut scratch = Vec::new();
        for (i, o) in out.chunks_mut(chunk).enumerate() {
            f(i, o, &mut scratch);
        }
    }
}

/// The forward convolution: inputs x, w, [bias]; the activation applied per batch.
struct ConvFwd(Geo, Activation);

impl RealKernel for ConvFwd {
    fn run<R: Real>(&self, xs: &[&[R]]) -> Vec<R> {
        let geo = &self.0;
        let (x, w, bias) = (xs[0], xs[1], xs.get(2));
        let (cg, og, l, kd, in_sp) = (geo.cg(), geo.og(), geo.l(), geo.kdim(), geo.in_sp());
        let (parallel, par) = geo.plan();
        let mut out = vec![R::ZERO; geo.n * geo.o * l];
        per_batch(&mut out, geo.o * l, parallel, |b, out_b, cols| {
            if let Some(bias) = bias {
                for (row, &bv) in out_b.chunks_mut(l).zip(bias.iter()) {
                    row.fill(bv);
                }
            }
            for g in 0..geo.groups {
                let xg = &x[(b * geo.c + g * cg) * in_sp..][..cg * in_sp];
                let rhs = if geo.pointwise() {
                    xg
                } else {
                    cols.resize(kd * l, R::ZERO);
                    im2col(geo, xg, cols);
                    &cols[..]
                };
                matmul(
                    og,
                    l,
                    kd,
                    &mut out_b[g * og * l..][..og * l],
                    bias.is_some(),
                    Mat::rows(&w[g * og * kd..][..og * kd], kd),
                    Mat::rows(rhs, l),
                    par,
                );
            }
            R::activate(out_b, self.1);
        });
        out
    }
}

/// The input gradient: inputs grad_out, w.
struct ConvDx(Geo);

impl RealKernel for ConvDx {
    fn run<R: Real>(&self, xs: &[&[R]]) -> Vec<R> {
        let geo = &self.0;
        let (gout, w) = (xs[0], xs[1]);
        let (cg, og, l, kd, in_sp) = (geo.cg(), geo.og(), geo.l(), geo.kdim(), geo.in_sp());
        let (parallel, par) = geo.plan();
        let mut dx = vec![R::ZERO; geo.n * geo.c * in_sp];
        per_batch(&mut dx, geo.c * in_sp, parallel, |b, dx_b, cols| {
            for g in 0..geo.groups {
                let gg = &gout[(b * geo.o + g * og) * l..][..og * l];
                let wt = Mat::trans(&w[g * og * kd..][..og * kd], kd);
                let dxg = &mut dx_b[g * cg * in_sp..][..cg * in_sp];
                if geo.pointwise() {
                    matmul(kd, l, og, dxg, false, wt, Mat::rows(gg, l), par);
                } else {
                    cols.resize(kd * l, R::ZERO);
                    matmul(kd, l, og, cols, false, wt, Mat::rows(gg, l), par);
                    col2im(geo, cols, dxg);
                }
            }
        });
        dx
    }
}

/// The weight gradient: inputs x, grad_out; summed over the batch.
struct ConvDw(Geo);

impl ConvDw {
    /// Adds the weight gradient of batch items `batches` to `dw`.
    fn accumulate<R: Real>(
        &self,
        x: &[R],
        gout: &[R],
        batches: std::ops::Range<usize>,
        dw: &mut [R],
        par: Parallelism,
    ) {
        let geo = &self.0;
        let (cg, og, l, kd, in_sp) = (geo.cg(), geo.og(), geo.l(), geo.kdim(), geo.in_sp());
        let mut cols = Vec::new();
        for b in batches {
            for g in 0..geo.groups {
                let xg = &x[(b * geo.c + g * cg) * in_sp..][..cg * in_sp];
                let gg = &gout[(b * geo.o + g * og) * l..][..og * l];
                let cols_t = if geo.pointwise() {
                    xg
                } else {
                    cols.resize(kd * l, R::ZERO);
                    im2col(geo, xg, &mut cols);
                    &cols[..]
                };
                matmul(
                    og,
                    kd,
                    l,
                    &mut dw[g * og * kd..][..og * kd],
                    true,
                    Mat::rows(gg, l),
                    Mat::trans(cols_t, l),
                    par,
                );
            }
        }
    }
}

impl RealKernel for ConvDw {
    fn run<R: Real>(&self, xs: &[&[R]]) -> Vec<R> {
        let geo = &self.0;
        let (x, gout) = (xs[0], xs[1]);
        let size = geo.o * geo.kdim();
        let (parallel, par) = geo.plan();
        if !parallel {
            let mut dw = vec![R::ZERO; size];
            self.accumulate(x, gout, 0..geo.n, &mut dw, par);
            return dw;
        }
        // Fixed batch chunks, summed in order: the result does not depend on scheduling.
        let parts = rayon::current_num_threads().min(geo.n);
        let per = geo.n.div_ceil(parts);
        let partial: Vec<Vec<R>> = (0..parts)
            .into_par_iter()
            .map(|p| {
                let mut dw = vec![R::ZERO; size];
                let end = ((p + 1) * per).min(geo.n);
                self.accumulate(x, gout, (p * per).min(end)..end, &mut dw, par);
                dw
            })
            .collect();
        let mut dw = vec![R::ZERO; size];
        for part in &partial {
            for (a, &b) in dw.iter_mut().zip(part) {
                *a += b;
            }
        }
        dw
    }
}

/// CPU kernels of `conv`, `conv_grad_input` and `conv_grad_weight`.
pub fn cpu(op: &Op, inputs: &[&HostTensor], out: &TensorType) -> Result<HostTensor> {
    if let Op::Conv { geom, .. }
    | Op::ConvGradInput { geom, .. }
    | Op::ConvGradWeight { geom, .. } = op
    {
        if geom.layout == Layout::ChannelsLast {
            // Every operand is an activation or a weight except a bias.
            let transpose: Vec<bool> = (0..inputs.len()).map(|k| k < 2).collect();
            return via_channels_first(&channels_first(op), inputs, &transpose, out);
        }
    }
    match op {
        Op::Conv {
            geom, groups, act, ..
        } => {
            let geo = Geo::new(
                inputs[0].dims(),
                inputs[1].dims(),
                out.shape.dims(),
                geom,
                *groups,
            );
            run_real(op, inputs, out, &ConvFwd(geo, *act))
        }
        Op::ConvGradInput { geom, groups, .. } => {
            let geo = Geo::new(
                out.shape.dims(),
                inputs[1].dims(),
                inputs[0].dims(),
                geom,
                *groups,
            );
            run_real(op, inputs, out, &ConvDx(geo))
        }
        Op::ConvGradWeight { geom, groups, .. } => {
            let geo = Geo::new(
                inputs[0].dims(),
                out.shape.dims(),
                inputs[1].dims(),
                geom,
                *groups,
            );
            run_real(op, inputs, out, &ConvDw(geo))
        }
        _ => Err(attr_err(op, "not a convolution op")),
    }
}

// ---------------------------------------------------------------------------------------------
// Gradients
// ---------------------------------------------------------------------------------------------

/// The cotangent of a convolution's pre-activation: `cx.grad` itself without an activation,
/// otherwise the elementwise family's rule for the activation applied at the recomputed
/// `conv(x, w) + bias`.
fn act_grad(
    cx: &mut VjpCtx<'_>,
    geom: &ConvGeom,
    groups: usize,
    bias: bool,
    act: Activation,
) -> Result<Value> {
    let unary = match act {
        Activation::None => return Ok(cx.grad),
        Activation::Relu => UnaryOp::Relu,
        Activation::GeluErf => UnaryOp::GeluErf,
        Activation::GeluTanh => UnaryOp::GeluTanh,
    };
    let pre = cx.emit(
        Op::Conv {
            geom: geom.clone(),
            groups,
            bias,
            act: Activation::None,
        },
        cx.inputs,
    )?;
    let act_op = Op::Unary(unary);
    let ins = [pre];
    let mut sub = VjpCtx {
        b: &mut *cx.b,
        op: &act_op,
        inputs: &ins,
        output: cx.output,
        grad: cx.grad,
    };
    crate::vjp(&mut sub)?
        .into_iter()
        .next()
        .flatten()
        .ok_or_else(|| cx.not_differentiable(0, "activation has no gradient"))
}

/// Gradient rules (the gradients of a channels-last op are channels-last ops). The three ops are
/// linear in each input (a convolution's activation first takes the cotangent back to the
/// pre-activation, [`act_grad`]):
/// - `conv(x, w, b)`: dx = conv_grad_input(g, w), dw = conv_grad_weight(x, g), db = Σ g over all
///   dims but the channels;
/// - `conv_grad_input(g, w)`, cotangent c: d/dg = conv(c, w), d/dw = conv_grad_weight(c, g);
/// - `conv_grad_weight(x, g)`, cotangent c: d/dx = conv_grad_input(g, c), d/dg = conv(x, c).
pub fn vjp(cx: &mut VjpCtx<'_>) -> Result<Vec<Option<Value>>> {
    let op = cx.op;
    let grad = cx.grad;
    match op {
        Op::Conv {
            geom,
            groups,
            bias,
            act,
        } => {
            let (x, w) = (cx.inputs[0], cx.inputs[1]);
            let grad = act_grad(cx, geom, *groups, *bias, *act)?;
            let dx = cx.emit(
                Op::ConvGradInput {
                    geom: geom.clone(),
                    groups: *groups,
                    input_shape: cx.ty(x).shape,
                },
                &[grad, w],
            )?;
            let dw = cx.emit(
                Op::ConvGradWeight {
                    geom: geom.clone(),
                    groups: *groups,
                    weight_shape: cx.ty(w).shape,
                },
                &[x, grad],
            )?;
            let mut grads = vec![Some(dx), Some(dw)];
            if *bias {
                let rank = cx.ty(grad).shape.rank();
                let c = geom.layout.channel_axis(rank);
                let axes: Vec<usize> = (0..rank).filter(|&a| a != c).collect();
                grads.push(Some(cx.sum(grad, axes, false)?));
            }
            Ok(grads)
        }
        Op::ConvGradInput { geom, groups, .. } => {
            let (g, w) = (cx.inputs[0], cx.inputs[1]);
            let dg = cx.emit(
                Op::Conv {
                    geom: geom.clone(),
                    groups: *groups,
                    bias: false,
                    act: Activation::None,
                },
                &[grad, w],
            )?;
            let dw = cx.emit(
                Op::ConvGradWeight {
                    geom: geom.clone(),
                    groups: *groups,
                    weight_shape: cx.ty(w).shape,
                },
                &[grad, g],
            )?;
            Ok(vec![Some(dg), Some(dw)])
        }
        Op::ConvGradWeight { geom, groups, .. } => {
            let (x, g) = (cx.inputs[0], cx.inputs[1]);
            let dx = cx.emit(
                Op::ConvGradInput {
                    geom: geom.clone(),
                    groups: *groups,
                    input_shape: cx.ty(x).shape,
                },
                &[g, grad],
            )?;
            let dg = cx.emit(
                Op::Conv {
                    geom: geom.clone(),
                    groups: *groups,
                    bias: false,
                    act: Activation::None,
                },
                &[x, grad],
            )?;
            Ok(vec![Some(dx), Some(dg)])
        }
        _ => Err(attr_err(op, "not a convolution op")),
    }
}
