//! Indexing ops: gather / scatter_add along an axis (PyTorch's `torch.gather` and
//! `Tensor.scatter_add`), index_select / index_add with a 1-D index (embedding is index_select on
//! axis 0 of a `[V, D]` table).
//!
//! Indices are i32 or i64. An index outside `0..dim` (negative ones included) is a runtime error
//! naming the op, the index value, the axis and its size. Gather and index_select copy any dtype;
//! scatter_add and index_add accumulate floats in f64 (f64 tensors) or f32 (others, rounded once)
//! and integers with wrapping addition; bool is rejected there.

use crate::norm::{compute_view, from_compute, split_axis};
use crate::util::{arity, attr_err, dtype_err, shape_err, PAR_THRESHOLD};
use crate::{
    DType, F64Bits, HostElement, HostTensor, Op, OpError, Result, TensorType, Value, VjpCtx,
};
use rayon::prelude::*;
use std::borrow::Cow;

/// Output type.
pub fn infer(op: &Op, inputs: &[&TensorType]) -> Result<TensorType> {
    let axis = match op {
        Op::Gather { axis }
        | Op::ScatterAdd { axis }
        | Op::IndexSelect { axis }
        | Op::IndexAdd { axis } => *axis,
        _ => return Err(attr_err(op, "not an indexing op")),
    };
    let accumulates = matches!(op, Op::ScatterAdd { .. } | Op::IndexAdd { .. });
    arity(op, inputs, if accumulates { 3 } else { 2 })?;
    let x = inputs[0];
    let index = inputs[1];
    let rank = x.shape.rank();
    if axis >= rank {
        return Err(attr_err(
            op,
            format!("axis {axis} out of range for rank {rank}"),
        ));
    }
    if !matches!(index.dtype, DType::I32 | DType::I64) {
        return Err(dtype_err(op, inputs, "index must be i32 or i64"));
    }
    if accumulates {
        if x.dtype == DType::Bool {
            return Err(dtype_err(op, inputs, "cannot accumulate bool tensors"));
        }
        if inputs[2].dtype != x.dtype {
            return Err(dtype_err(op, inputs, "src must have the dtype of base"));
        }
    }
    let xd = x.shape.dims();
    let id = index.shape.dims();
    match op {
        Op::Gather { .. } | Op::ScatterAdd { .. } => {
            if index.shape.rank() != rank {
                return Err(shape_err(
                    op,
                    inputs,
                    "index must have the rank of the input",
                ));
            }
            if let Some(d) = (0..rank).find(|&d| d != axis && id[d] > xd[d]) {
                return Err(shape_err(
                    op,
                    inputs,
                    format!("index dim {d} ({}) exceeds the input's ({})", id[d], xd[d]),
                ));
            }
            if accumulates && inputs[2].shape != index.shape {
                return Err(shape_err(op, inputs, "src must have the index's shape"));
            }
            if accumulates {
                Ok(x.clone())
            } else {
                Ok(TensorType::new(x.dtype, index.shape.clone()))
            }
        }
        _ => {
            if index.shape.rank() != 1 {
                return Err(shape_err(op, inputs, "index must be 1-D"));
            }
            let mut sel = xd.to_vec();
            sel[axis] = id[0];
            if accumulates {
                if inputs[2].shape.dims() != sel.as_slice() {
                    return Err(shape_err(
                        op,
                        inputs,
                        format!(
                            "src must have shape {:?} (base with dim {axis} = len(index))",
                            sel
                        ),
                    ));
                }
                Ok(x.clone())
            } else {
                Ok(TensorType::new(x.dtype, sel))
            }
        }
    }
}

/// The indices as i64 (one conversion for i32).
fn indices(t: &HostTensor) -> Cow<'_, [i64]> {
    match t.data() {
        crate::Data::I64(v) => Cow::Borrowed(v),
        crate::Data::I32(v) => Cow::Owned(v.iter().map(|&i| i as i64).collect()),
        _ => Cow::Owned(t.to_f64_vec().iter().map(|&v| v as i64).collect()),
    }
}

/// Checks one index against the size of `axis`; returns it as a position.
#[inline]
fn check(op: &Op, i: i64, axis: usize, n: usize) -> Result<usize> {
    if i < 0 || i as u64 >= n as u64 {
        return Err(OpError::Runtime {
            op: op.name(),
            reason: format!("index {i} is out of range for dim {axis} of size {n}"),
        });
    }
    Ok(i as usize)
}

/// CPU kernel.
pub fn cpu(op: &Op, inputs: &[&HostTensor], out: &TensorType) -> Result<HostTensor> {
    let idx = indices(inputs[1]);
    match op {
        Op::Gather { axis } => {
            let x = inputs[0];
            let (xd, id) = (x.dims(), inputs[1].dims());
            crate::with_data!(x.data(), v => HostTensor::from_data(
                HostElement::wrap(gather(op, v, xd, &idx, id, *axis)?),
                out.shape.clone(),
            ))
        }
        Op::IndexSelect { axis } => {
            let x = inputs[0];
            crate::with_data!(x.data(), v => HostTensor::from_data(
                HostElement::wrap(index_select(op, v, x.dims(), &idx, *axis)?),
                out.shape.clone(),
            ))
        }
        Op::ScatterAdd { .. } | Op::IndexAdd { .. } => match out.dtype {
            DType::F64 => accumulate::<f64>(op, inputs, &idx, out),
            DType::F32 | DType::F16 | DType::BF16 => accumulate::<f32>(op, inputs, &idx, out),
            DType::I32 => accumulate::<i32>(op, inputs, &idx, out),
            DType::I64 => accumulate::<i64>(op, inputs, &idx, out),
            DType::U8 => accumulate::<u8>(op, inputs, &idx, out),
            DType::I8 => accumulate::<i8>(op, inputs, &idx, out),
            DType::I16 => accumulate::<i16>(op, inputs, &idx, out),
            DType::U16 => accumulate::<u16>(op, inputs, &idx, out),
            DType::U32 => accumulate::<u32>(op, inputs, &idx, out),
            DType::U64 => accumulate::<u64>(op, inputs, &idx, out),
            DType::Bool => Err(dtype_err(
                op,
                &[&inputs[0].ty()],
                "cannot accumulate bool tensors",
            )),
        },
        _ => Err(attr_err(op, "not an indexing op")),
    }
}

/// torch.gather: `out[p] = x[p with p[axis] = index[p]]` over the positions `p` of `index`.
fn gather<T: Copy + Default + Send + Sync>(
    op: &Op,
    x: &[T],
    xd: &[usize],
    idx: &[i64],
    id: &[usize],
    axis: usize,
) -> Result<Vec<T>> {
    let mut out = vec![T::default(); idx.len()];
    let rank = id.len();
    let last = id[rank - 1];
    if out.is_empty() {
        return Ok(out);
    }
    let xs = crate::Shape::new(xd).strides();
    let n = xd[axis];
    // One row of the index's last dim at a time: its base offset in x is computed once.
    let row = |(r, orow): (usize, &mut [T])| -> Result<()> {
        let mut rem = r;
        let mut base = 0;
        for d in (0..rank - 1).rev() {
            let c = rem % id[d];
            rem /= id[d];
            if d != axis {
                base += c * xs[d];
            }
        }
        let irow = &idx[r * last..(r + 1) * last];
        if axis == rank - 1 {
            for (o, &i) in orow.iter_mut().zip(irow) {
                *o = x[base + check(op, i, axis, n)?];
            }
        } else {
            for (k, (o, &i)) in orow.iter_mut().zip(irow).enumerate() {
                *o = x[base + k + check(op, i, axis, n)? * xs[axis]];
            }
        }
        Ok(())
    };
    if out.len() >= PAR_THRESHOLD {
        out.par_chunks_mut(last).enumerate().try_for_each(row)?;
    } else {
        out.chunks_mut(last).enumerate().try_for_each(row)?;
    }
    Ok(out)
}

/// index_select: rows of `x` along `axis` picked by a 1-D index.
fn index_select<T: Copy + Default + Send + Sync>(
    op: &Op,
    x: &[T],
    xd: &[usize],
    idx: &[i64],
    axis: usize,
) -> Result<Vec<T>> {
    let (outer, n, inner) = split_axis(xd, axis);
    let pos: Vec<usize> = idx
        .iter()
        .map(|&i| check(op, i, axis, n))
        .collect::<Result<_>>()?;
    let m = pos.len();
    let mut out = vec![T::default(); outer * m * inner];
    if out.is_empty() {
        return Ok(out);
    }
    let row = |(r, orow): (usize, &mut [T])| {
        let (o, i) = (r / m, r % m);
        let s = (o * n + pos[i]) * inner;
        orow.copy_from_slice(&x[s..s + inner]);
    };
    if out.len() >= PAR_THRESHOLD {
        out.par_chunks_mut(inner).enumerate().for_each(row);
    } else {
        out.chunks_mut(inner).enumerate().for_each(row);
    }
    Ok(out)
}

/// An accumulation type of scatter_add / index_add.
trait Acc: Copy + Send + Sync + 'static {
    /// `*self += v` (wrapping for integers).
    fn acc(&mut self, v: Self);
    /// A tensor's elements in this type.
    fn load(t: &HostTensor) -> Result<Cow<'_, [Self]>>;
    /// A tensor of `ty` from accumulated values.
    fn store(v: Vec<Self>, ty: &TensorType) -> Result<HostTensor>;
}

macro_rules! acc_float {
    ($t:ty) => {
        impl Acc for $t {
            #[inline(always)]
            fn acc(&mut self, v: Self) {
                *self += v;
            }
            fn load(t: &HostTensor) -> Result<Cow<'_, [Self]>> {
                Ok(compute_view::<$t>(t))
            }
            fn store(v: Vec<Self>, ty: &TensorType) -> Result<HostTensor> {
                from_compute(v, ty)
            }
        }
    };
}
acc_float!(f32);
acc_float!(f64);

macro_rules! acc_int {
    ($t:ty) => {
        impl Acc for $t {
            #[inline(always)]
            fn acc(&mut self, v: Self) {
                *self = self.wrapping_add(v);
            }
            fn load(t: &HostTensor) -> Result<Cow<'_, [Self]>> {
                t.as_slice::<$t>().map(Cow::Borrowed)
            }
            fn store(v: Vec<Self>, ty: &TensorType) -> Result<HostTensor> {
                HostTensor::from_vec(v, ty.shape.clone())
            }
        }
    };
}
acc_int!(i32);
acc_int!(i64);
acc_int!(u8);
acc_int!(i8);
acc_int!(i16);
acc_int!(u16);
acc_int!(u32);
acc_int!(u64);

/// scatter_add and index_add in accumulation type `A`.
fn accumulate<A: Acc>(
    op: &Op,
    inputs: &[&HostTensor],
    idx: &[i64],
    out: &TensorType,
) -> Result<HostTensor> {
    let mut acc = A::load(inputs[0])?.into_owned();
    let src = A::load(inputs[2])?;
    let bd = inputs[0].dims();
    match op {
        Op::ScatterAdd { axis } => {
            let axis = *axis;
            let id = inputs[1].dims();
            let rank = id.len();
            let bs = crate::Shape::new(bd).strides();
            let n = bd[axis];
            let mut coords = vec![0usize; rank];
            for (p, (&i, &s)) in idx.iter().zip(src.iter()).enumerate() {
                if p > 0 {
                    // Advance the row-major counter over the index's shape.
                    let mut d = rank - 1;
                    coords[d] += 1;
                    while coords[d] == id[d] {
                        coords[d] = 0;
                        d -= 1;
                        coords[d] += 1;
                    }
                }
                let mut off = check(op, i, axis, n)? * bs[axis];
                for d in 0..rank {
                    if d != axis {
                        off += coords[d] * bs[d];
                    }
                }
                acc[off].acc(s);
            }
        }
        Op::IndexAdd { axis } => {
            let (outer, n, inner) = split_axis(bd, *axis);
            let pos: Vec<usize> = idx
                .iter()
                .map(|&i| check(op, i, *axis, n))
                .collect::<Result<_>>()?;
            let m = pos.len();
            let block = n * inner;
            if block > 0 && inner > 0 {
                // Each outer slice of the output is written by one task.
                let slice = |(o, ob): (usize, &mut [A])| {
                    for (i, &pi) in pos.iter().enumerate() {
                        let s = (o * m + i) * inner;
                        let dst = &mut ob[pi * inner..(pi + 1) * inner];
                        for (d, &v) in dst.iter_mut().zip(&src[s..s + inner]) {
                            d.acc(v);
                        }
                    }
                };
                if src.len() >= PAR_THRESHOLD && outer > 1 {
                    acc.par_chunks_mut(block).enumerate().for_each(slice);
                } else {
                    acc.chunks_mut(block).enumerate().for_each(slice);
                }
            }
        }
        _ => return Err(attr_err(op, "not an accumulating indexing op")),
    }
    A::store(acc, out)
}

/// Gradient rule. Index inputs get no gradient; nor do integer tensors.
pub fn vjp(cx: &mut VjpCtx<'_>) -> Result<Vec<Option<Value>>> {
    let (x, index, g) = (cx.inputs[0], cx.inputs[1], cx.grad);
    let xt = cx.ty(x);
    if !xt.dtype.is_float() {
        return Ok(vec![None; cx.inputs.len()]);
    }
    match cx.op.clone() {
        Op::Gather { axis } => {
            // dx = scatter_add(zeros_like(x), index, g)
            let z = zeros(cx, xt)?;
            Ok(vec![
                Some(cx.emit(Op::ScatterAdd { axis }, &[z, index, g])?),
                None,
            ])
        }
        Op::IndexSelect { axis } => {
            // dx = index_add(zeros_like(x), index, g)
            let z = zeros(cx, xt)?;
            Ok(vec![
                Some(cx.emit(Op::IndexAdd { axis }, &[z, index, g])?),
                None,
            ])
        }
        Op::ScatterAdd { axis } => {
            let ds = cx.emit(Op::Gather { axis }, &[g, index])?;
            Ok(vec![Some(g), None, Some(ds)])
        }
        Op::IndexAdd { axis } => {
            let ds = cx.emit(Op::IndexSelect { axis }, &[g, index])?;
            Ok(vec![Some(g), None, Some(ds)])
        }
        op => Err(attr_err(&op, "not an indexing op")),
    }
}

/// A zero tensor of type `ty`.
fn zeros(cx: &mut VjpCtx<'_>, ty: TensorType) -> Result<Value> {
    cx.emit(
        Op::Full {
            value: F64Bits::new(0.0),
            ty,
        },
        &[],
    )
}
