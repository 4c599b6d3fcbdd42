//! Movement ops: reshape, permute, expand, slice, concat and pad.
//!
//! The runtime's tensors are always contiguous, so these kernels are how a strided view becomes a
//! tensor. They all go through one engine, [`strided_copy`]: the output is walked row by row (rows
//! of its last dim, after merging dims that are contiguous in the source), and each row is a
//! `copy_from_slice`, a `fill` (broadcast) or a strided gather. Permutes that move the unit-stride
//! dim away from the end use a tiled transpose instead, so that reads and writes both stay in cache.

use crate::util::{arity, attr_err, dtype_err, shape_err, PAR_THRESHOLD};
use crate::{
    with_data, Data, HostElement, HostTensor, Op, OpError, Result, Shape, TensorType, Value, VjpCtx,
};
use rayon::prelude::*;

/// Output type of a movement op, or a typed error naming the op, shapes and dtypes.
pub fn infer(op: &Op, inputs: &[&TensorType]) -> Result<TensorType> {
    match op {
        Op::Reshape { shape } => {
            arity(op, inputs, 1)?;
            let x = inputs[0];
            let count = |s: &Shape| match s.try_numel() {
                Some(n) => n.to_string(),
                None => "too many".into(),
            };
            if x.shape.try_numel().is_none() || x.shape.try_numel() != shape.try_numel() {
                return Err(shape_err(
                    op,
                    inputs,
                    format!(
                        "cannot reshape {} ({} elements) to {} ({} elements)",
                        x.shape,
                        count(&x.shape),
                        shape,
                        count(shape)
                    ),
                ));
            }
            Ok(TensorType::new(x.dtype, shape.clone()))
        }
        Op::Permute { perm } => {
            arity(op, inputs, 1)?;
            let x = inputs[0];
            let r = x.shape.rank();
            let mut seen = vec![false; r];
            let ok = perm.len() == r
                && perm
                    .iter()
                    .all(|&p| p < r && !std::mem::replace(&mut seen[p], true));
            if !ok {
                return Err(attr_err(
                    op,
                    format!("perm {perm:?} is not a permutation of 0..{r} (input {})", x),
                ));
            }
            let dims: Vec<usize> = perm.iter().map(|&p| x.shape.dims()[p]).collect();
            Ok(TensorType::new(x.dtype, dims))
        }
        Op::Expand { shape } => {
            arity(op, inputs, 1)?;
            let x = inputs[0];
            if !x.shape.broadcasts_to(shape) {
                return Err(shape_err(
                    op,
                    inputs,
                    format!("{} does not broadcast to {}", x.shape, shape),
                ));
            }
            Ok(TensorType::new(x.dtype, shape.clone()))
        }
        Op::Slice {
            starts,
            ends,
            steps,
        } => {
            arity(op, inputs, 1)?;
            let x = inputs[0];
            let r = x.shape.rank();
            if starts.len() != r || ends.len() != r || steps.len() != r {
                return Err(attr_err(
                    op,
                    format!(
                        "starts {starts:?}, ends {ends:?}, steps {steps:?} need one entry per dim of {x}"
                    ),
                ));
            }
            let mut dims = Vec::with_capacity(r);
            for k in 0..r {
                let d = x.shape.dims()[k];
                let (s, e, st) = (starts[k], ends[k], steps[k]);
                if st == 0 || s > e || e > d {
                    return Err(shape_err(
                        op,
                        inputs,
                        format!(
                            "dim {k} of size {d}: need start <= end <= size and step >= 1, got {s}..{e} step {st}"
                        ),
                    ));
                }
                dims.push((e - s).div_ceil(st));
            }
            Ok(TensorType::new(x.dtype, dims))
        }
        Op::Concat { axis } => {
            if inputs.is_empty() {
                return Err(OpError::Arity {
                    op: op.name(),
                    expected: "at least 1".into(),
                    got: 0,
                });
            }
            let first = inputs[0];
            let r = first.shape.rank();
            if *axis >= r {
                return Err(attr_err(
                    op,
                    format!("axis {axis} out of range for rank {r} ({first})"),
                ));
            }
            if inputs.iter().any(|t| t.dtype != first.dtype) {
                return Err(dtype_err(op, inputs, "all inputs must have the same dtype"));
            }
            let mut total = 0usize;
            for (i, t) in inputs.iter().enumerate() {
                let same = t.shape.rank() == r
                    && (0..r).all(|k| k == *axis || t.shape.dims()[k] == first.shape.dims()[k]);
                if !same {
                    return Err(shape_err(
                        op,
                        inputs,
                        format!(
                            "input {i} {} differs from input 0 {} outside axis {axis}",
                            t.shape, first.shape
                        ),
                    ));
                }
                total = total.checked_add(t.shape.dims()[*axis]).ok_or_else(|| {
                    shape_err(op, inputs, format!("the sizes along axis {axis} overflow"))
                })?;
            }
            let mut dims = first.shape.dims().to_vec();
            dims[*axis] = total;
            Ok(TensorType::new(first.dtype, dims))
        }
        Op::Pad { pads, .. } => {
            arity(op, inputs, 1)?;
            let x = inputs[0];
            if pads.len() != x.shape.rank() {
                return Err(attr_err(
                    op,
                    format!("pads {pads:?} need one (before, after) pair per dim of {x}"),
                ));
            }
            let dims = x
                .shape
                .dims()
                .iter()
                .zip(pads)
                .enumerate()
                .map(|(k, (&d, &(b, a)))| {
                    d.checked_add(b)
                        .and_then(|n| n.checked_add(a))
                        .ok_or_else(|| {
                            shape_err(
                                op,
                                inputs,
                                format!("dim {k} of size {d} padded by ({b}, {a}) overflows"),
                            )
                        })
                })
                .collect::<Result<Vec<usize>>>()?;
            Ok(TensorType::new(x.dtype, dims))
        }
        _ => Err(OpError::Runtime {
            op: op.name(),
            reason: "not a movement op".into(),
        }),
    }
}

/// Runs a movement op on the CPU; `out` is the inferred output type.
pub fn cpu(op: &Op, inputs: &[&HostTensor], out: &TensorType) -> Result<HostTensor> {
    let od = out.shape.dims();
    let data = match op {
        Op::Reshape { .. } => inputs[0].data().clone(),
        Op::Permute { perm } => {
            let st = inputs[0].shape().strides();
            let strides: Vec<usize> = perm.iter().map(|&p| st[p]).collect();
            with_data!(inputs[0].data(), v => strided_copy(v, 0, od, &strides))
        }
        Op::Expand { shape } => {
            let strides = inputs[0].shape().broadcast_strides(shape);
            with_data!(inputs[0].data(), v => strided_copy(v, 0, od, &strides))
        }
        Op::Slice { starts, steps, .. } => {
            let st = inputs[0].shape().strides();
            let offset: usize = starts.iter().zip(&st).map(|(s, t)| s * t).sum();
            let strides: Vec<usize> = steps.iter().zip(&st).map(|(s, t)| s * t).collect();
            with_data!(inputs[0].data(), v => strided_copy(v, offset, od, &strides))
        }
        Op::Concat { axis } => concat(inputs, *axis, out)?,
        Op::Pad { pads, value } => {
            let x = inputs[0];
            with_data!(x.data(), v => pad(v, x.dims(), pads, value.get()))
        }
        _ => {
            return Err(OpError::Runtime {
                op: op.name(),
                reason: "not a movement op".into(),
            })
        }
    };
    HostTensor::from_data(data, out.shape.clone())
}

/// Calls `f(outer_index, row)` for every row (length `row_len`) of `out`, whose leading dims are
/// `outer`; in parallel over blocks of rows when the work (`cost` element visits per row) is
/// large.
pub(crate) fn for_each_row<T: Send>(
    out: &mut [T],
    outer: &[usize],
    row_len: usize,
    cost: usize,
    f: impl Fn(&[usize], &mut [T]) + Sync,
) {
    if out.is_empty() || row_len == 0 {
        return;
    }
    let cost = cost.max(1);
    let per = (PAR_THRESHOLD / 4 / cost).max(1);
    let block = |(b, chunk): (usize, &mut [T])| {
        let mut idx = vec![0usize; outer.len()];
        let mut r = b * per;
        for k in (0..outer.len()).rev() {
            idx[k] = r % outer[k];
            r /= outer[k];
        }
        for row in chunk.chunks_mut(row_len) {
            f(&idx, row);
            for k in (0..outer.len()).rev() {
                idx[k] += 1;
                if idx[k] < outer[k] {
                    break;
                }
                idx[k] = 0;
            }
        }
    };
    if out.len() / row_len * cost >= PAR_THRESHOLD {
        out.par_chunks_mut(per * row_len)
            .enumerate()
            .for_each(block);
    } else {
        out.chunks_mut(per * row_len).enumerate().for_each(block);
    }
}

/// Drops size-1 dims and merges neighbours that are contiguous in the source
/// (`stride[i] == stride[i+1] * dim[i+1]`). Returns the simplified dims and strides (at least one
/// dim, so that a scalar is one row of one element).
pub(crate) fn coalesce(dims: &[usize], strides: &[usize]) -> (Vec<usize>, Vec<usize>) {
    let mut d: Vec<usize> = Vec::with_capacity(dims.len());
    let mut s: Vec<usize> = Vec::with_capacity(dims.len());
    for (&n, &st) in dims.iter().zip(strides) {
        if n == 1 {
            continue;
        }
        if let (Some(&ld), Some(&ls)) = (d.last(), s.last()) {
            if ls == st * n {
                *d.last_mut().expect("nonempty") = ld * n;
                *s.last_mut().expect("nonempty") = st;
                continue;
            }
        }
        d.push(n);
        s.push(st);
    }
    if d.is_empty() {
        d.push(1);
        s.push(1);
    }
    (d, s)
}

/// Tile edge of the blocked transpose.
const TILE: usize = 32;

/// `out[i] = src[offset + Σ idx_k · strides_k]` over the contiguous output of shape `dims`.
/// Strides may be 0 (broadcast). This is the one gather behind permute, expand and slice.
pub(crate) fn strided_gather<T: Copy + Send + Sync + Default>(
    src: &[T],
    offset: usize,
    dims: &[usize],
    strides: &[usize],
) -> Vec<T> {
    let n: usize = dims.iter().product();
    let mut out = vec![T::default(); n];
    if n == 0 {
        return out;
    }
    let (d, s) = coalesce(dims, strides);
    let r = d.len();
    let last = d[r - 1];
    let ls = s[r - 1];
    // Tiled transpose: the unit-stride source dim is not the last output dim.
    if r >= 2 && ls > 1 && last >= 8 {
        if let Some(j) = (0..r - 1).find(|&j| s[j] == 1 && d[j] >= 8) {
            transpose_tiles(src, offset, &d, &s, j, &mut out);
            return out;
        }
    }
    let outer = &d[..r - 1];
    let os = &s[..r - 1];
    for_each_row(&mut out, outer, last, last, |idx, row| {
        let base = offset + idx.iter().zip(os).map(|(i, st)| i * st).sum::<usize>();
        if ls == 1 {
            row.copy_from_slice(&src[base..base + last]);
        } else if ls == 0 {
            row.fill(src[base]);
        } else {
            for (j, o) in row.iter_mut().enumerate() {
                *o = src[base + j * ls];
            }
        }
    });
    out
}

/// Blocked transpose. The output is `[outer.., rows, mid.., cols]` where the source has stride 1
/// along `rows` (output dim `j`) and stride `s[last] > 1` along `cols`. Each task owns `TILE`
/// consecutive `rows` of one outer index (a contiguous output block) and walks it in
/// `TILE × TILE` tiles of (rows, cols) for every `mid` index, so the source lines it reads are
/// reused across the tile instead of being evicted between rows.
fn transpose_tiles<T: Copy + Send + Sync>(
    src: &[T],
    offset: usize,
    d: &[usize],
    s: &[usize],
    j: usize,
    out: &mut [T],
) {
    let r = d.len();
    let (rows, cols, cs) = (d[j], d[r - 1], s[r - 1]);
    let (outer, os) = (&d[..j], &s[..j]);
    let (mid, ms) = (&d[j + 1..r - 1], &s[j + 1..r - 1]);
    let midn: usize = mid.iter().product();
    // Source offset of every mid index.
    let mut mid_offs = Vec::with_capacity(midn);
    let mut idx = vec![0usize; mid.len()];
    for _ in 0..midn {
        mid_offs.push(idx.iter().zip(ms).map(|(i, st)| i * st).sum::<usize>());
        for k in (0..mid.len()).rev() {
            idx[k] += 1;
            if idx[k] < mid[k] {
                break;
            }
            idx[k] = 0;
        }
    }
    let row_len = midn * cols;
    let blocks_per_outer = rows.div_ceil(TILE);
    let work = |b: usize, chunk: &mut [T]| {
        let (o, r0) = (b / blocks_per_outer, (b % blocks_per_outer) * TILE);
        let mut m = o;
        let mut base = offset + r0;
        for k in (0..outer.len()).rev() {
            base += (m % outer[k]) * os[k];
            m /= outer[k];
        }
        let nrows = chunk.len() / row_len;
        for (mi, &moff) in mid_offs.iter().enumerate() {
            for c0 in (0..cols).step_by(TILE) {
                let c1 = (c0 + TILE).min(cols);
                for i in 0..nrows {
                    let at = (i * midn + mi) * cols;
                    let from = base + i + moff;
                    for (jj, o) in chunk[at + c0..at + c1].iter_mut().enumerate() {
                        *o = src[from + (c0 + jj) * cs];
                    }
                }
            }
        }
    };
    // Blocks never straddle two outer indices: split per outer index first.
    let per_outer = rows * row_len;
    if out.len() >= PAR_THRESHOLD {
        out.par_chunks_mut(per_outer)
            .enumerate()
            .for_each(|(oi, part)| {
                part.par_chunks_mut(TILE * row_len)
                    .enumerate()
                    .for_each(|(bi, c)| work(oi * blocks_per_outer + bi, c));
            });
    } else {
        for (oi, part) in out.chunks_mut(per_outer).enumerate() {
            for (bi, c) in part.chunks_mut(TILE * row_len).enumerate() {
                work(oi * blocks_per_outer + bi, c);
            }
        }
    }
}

/// [`strided_gather`] wrapped as storage.
fn strided_copy<T: HostElement>(
    src: &[T],
    offset: usize,
    dims: &[usize],
    strides: &[usize],
) -> Data {
    T::wrap(strided_gather(src, offset, dims, strides))
}

/// Concatenation: the output is `[outer, total·inner]`; each input contributes a run of
/// `len_i·inner` per outer row.
fn concat(inputs: &[&HostTensor], axis: usize, out: &TensorType) -> Result<Data> {
    let od = out.shape.dims();
    let inner: usize = od[axis + 1..].iter().product();
    let outer: usize = od[..axis].iter().product();
    let row = od[axis] * inner;
    let runs: Vec<usize> = inputs.iter().map(|t| t.dims()[axis] * inner).collect();
    fn go<T: HostElement>(srcs: &[&[T]], runs: &[usize], outer: usize, row: usize) -> Data {
        let mut out = vec![T::default(); outer * row];
        for_each_row(&mut out, &[outer], row, row, |idx, dst| {
            let o = idx[0];
            let mut at = 0;
            for (s, &n) in srcs.iter().zip(runs) {
                dst[at..at + n].copy_from_slice(&s[o * n..(o + 1) * n]);
                at += n;
            }
        });
        T::wrap(out)
    }
    macro_rules! cat {
        ($variant:ident) => {{
            let srcs: Vec<&[_]> = inputs
                .iter()
                .map(|t| match t.data() {
                    Data::$variant(v) => Ok(v.as_slice()),
                    _ => Err(OpError::Runtime {
                        op: "concat",
                        reason: "inputs of mixed dtypes".into(),
                    }),
                })
                .collect::<Result<_>>()?;
            go(&srcs, &runs, outer, row)
        }};
    }
    Ok(match inputs[0].data() {
        Data::F32(_) => cat!(F32),
        Data::F64(_) => cat!(F64),
        Data::F16(_) => cat!(F16),
        Data::BF16(_) => cat!(BF16),
        Data::I32(_) => cat!(I32),
        Data::I64(_) => cat!(I64),
        Data::U8(_) => cat!(U8),
        Data::I8(_) => cat!(I8),
        Data::I16(_) => cat!(I16),
        Data::U16(_) => cat!(U16),
        Data::U32(_) => cat!(U32),
        Data::U64(_) => cat!(U64),
        Data::Bool(_) => cat!(Bool),
    })
}

/// Constant padding: each output row (last dim) is either all padding or
/// `[value × before, input row, value × after]`.
fn pad<T: HostElement>(src: &[T], dims: &[usize], pads: &[(usize, usize)], value: f64) -> Data {
    let v = T::from_f64(value);
    let r = dims.len();
    if r == 0 {
        return T::wrap(src.to_vec());
    }
    let od: Vec<usize> = dims
        .iter()
        .zip(pads)
        .map(|(&d, &(b, a))| b + d + a)
        .collect();
    let n: usize = od.iter().product();
    let mut out = vec![v; n];
    let in_strides = Shape::new(dims).strides();
    let (lb, ld) = (pads[r - 1].0, dims[r - 1]);
    for_each_row(&mut out, &od[..r - 1], od[r - 1], od[r - 1], |idx, row| {
        let mut base = 0;
        for k in 0..r - 1 {
            let (b, d) = (pads[k].0, dims[k]);
            if idx[k] < b || idx[k] >= b + d {
                return;
            }
            base += (idx[k] - b) * in_strides[k];
        }
        row[lb..lb + ld].copy_from_slice(&src[base..base + ld]);
    });
    T::wrap(out)
}

/// Gradient rules: reshape back, inverse permute, sum over broadcast dims, pad a slice's gradient
/// back (stepped slices interleave zeros with a reshape/pad/reshape), slice concat's gradient
/// apart, and slice out a pad's interior.
pub fn vjp(cx: &mut VjpCtx<'_>) -> Result<Vec<Option<Value>>> {
    let x = cx.inputs[0];
    let xs = cx.ty(x).shape;
    let g = cx.grad;
    match cx.op {
        Op::Reshape { .. } => Ok(vec![Some(cx.reshape(g, xs)?)]),
        Op::Permute { perm } => {
            let mut inv = vec![0; perm.len()];
            for (i, &p) in perm.iter().enumerate() {
                inv[p] = i;
            }
            if inv.iter().enumerate().all(|(i, &p)| i == p) {
                return Ok(vec![Some(g)]);
            }
            Ok(vec![Some(cx.emit(Op::Permute { perm: inv }, &[g])?)])
        }
        Op::Expand { .. } => Ok(vec![Some(cx.sum_to(g, &xs)?)]),
        Op::Slice {
            starts,
            ends,
            steps,
        } => {
            let (starts, ends, steps) = (starts.clone(), ends.clone(), steps.clone());
            Ok(vec![Some(slice_grad(cx, g, &xs, &starts, &ends, &steps)?)])
        }
        Op::Concat { axis } => {
            let axis = *axis;
            let inputs = cx.inputs.to_vec();
            let gd = cx.ty(g).shape.dims().to_vec();
            let mut at = 0;
            let mut out = Vec::with_capacity(inputs.len());
            for v in inputs {
                let n = cx.ty(v).shape.dims()[axis];
                let mut starts = vec![0; gd.len()];
                let mut ends = gd.clone();
                starts[axis] = at;
                ends[axis] = at + n;
                at += n;
                let steps = vec![1; gd.len()];
                out.push(Some(slice_or_id(cx, g, starts, ends, steps)?));
            }
            Ok(out)
        }
        Op::Pad { pads, .. } => {
            let starts: Vec<usize> = pads.iter().map(|p| p.0).collect();
            let ends: Vec<usize> = starts.iter().zip(xs.dims()).map(|(s, d)| s + d).collect();
            let steps = vec![1; starts.len()];
            Ok(vec![Some(slice_or_id(cx, g, starts, ends, steps)?)])
        }
        _ => Err(OpError::Runtime {
            op: cx.op.name(),
            reason: "not a movement op".into(),
        }),
    }
}

/// A slice, skipped when it takes everything.
fn slice_or_id(
    cx: &mut VjpCtx<'_>,
    g: Value,
    starts: Vec<usize>,
    ends: Vec<usize>,
    steps: Vec<usize>,
) -> Result<Value> {
    let gd = cx.ty(g).shape;
    let whole = starts.iter().all(|&s| s == 0)
        && steps.iter().all(|&s| s == 1)
        && ends.as_slice() == gd.dims();
    if whole {
        return Ok(g);
    }
    cx.emit(
        Op::Slice {
            starts,
            ends,
            steps,
        },
        &[g],
    )
}

/// A zero pad, skipped when it adds nothing.
fn pad_or_id(cx: &mut VjpCtx<'_>, g: Value, pads: Vec<(usize, usize)>) -> Result<Value> {
    if pads.iter().all(|&(b, a)| b == 0 && a == 0) {
        return Ok(g);
    }
    cx.emit(
        Op::Pad {
            pads,
            value: 0.0.into(),
        },
        &[g],
    )
}

/// Scatters a slice's gradient back into a zero tensor of the input's shape. For a dim with step
/// `s > 1` and `m` picked elements: reshape `[m]` to `[m, 1]`, zero-pad to `[m, s]`, reshape to
/// `[m·s]` (each gradient followed by `s-1` zeros), keep the first `(m-1)·s+1`; then zero-pad every
/// dim to its full size around the start.
fn slice_grad(
    cx: &mut VjpCtx<'_>,
    g: Value,
    xs: &Shape,
    starts: &[usize],
    ends: &[usize],
    steps: &[usize],
) -> Result<Value> {
    let gd = cx.ty(g).shape.dims().to_vec();
    let mut g = g;
    if steps.iter().any(|&s| s > 1) {
        let mut split = Vec::with_capacity(2 * gd.len());
        let mut spread_pads = Vec::with_capacity(2 * gd.len());
        for (&m, &s) in gd.iter().zip(steps) {
            split.push(m);
            split.push(1);
            spread_pads.push((0, 0));
            spread_pads.push((0, s - 1));
        }
        g = cx.reshape(g, Shape::new(split))?;
        g = pad_or_id(cx, g, spread_pads)?;
        let spread: Vec<usize> = gd.iter().zip(steps).map(|(&m, &s)| m * s).collect();
        g = cx.reshape(g, Shape::new(spread.clone()))?;
        let keep: Vec<usize> = gd
            .iter()
            .zip(steps)
            .map(|(&m, &s)| if m == 0 { 0 } else { (m - 1) * s + 1 })
            .collect();
        let zeros = vec![0; keep.len()];
        let ones = vec![1; keep.len()];
        g = slice_or_id(cx, g, zeros, keep, ones)?;
    }
    let kept = cx.ty(g).shape.dims().to_vec();
    let _ = ends;
    let pads: Vec<(usize, usize)> = starts
        .iter()
        .zip(&kept)
        .zip(xs.dims())
        .map(|((&s, &k), &d)| (s, d - s - k))
        .collect();
    pad_or_id(cx, g, pads)
}
