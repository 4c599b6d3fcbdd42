//! Scans and selection along one axis: the cumulative sum ([`Op::CumSum`], inclusive or
//! exclusive, forward or reversed) and the indices of the k largest or smallest elements
//! ([`Op::TopK`]; their values are a `gather` of those indices, which carries the gradient).
//!
//! Floats accumulate in f64 and round once to their dtype; integers accumulate with wrapping
//! i64 addition. TopK orders NaN above every number, and equal values by index (the lower first).

use crate::util::{arity, attr_err, dtype_err};
use crate::{DType, Data, HostTensor, Op, Result, TensorType, Value, VjpCtx};

/// `(outer, n, inner)`: the dims before `axis`, its size, and the dims after.
fn split(dims: &[usize], axis: usize) -> (usize, usize, usize) {
    (
        dims[..axis].iter().product(),
        dims[axis],
        dims[axis + 1..].iter().product(),
    )
}

/// Output type.
pub fn infer(op: &Op, inputs: &[&TensorType]) -> Result<TensorType> {
    arity(op, inputs, 1)?;
    let x = inputs[0];
    let rank = x.shape.rank();
    let axis = match op {
        Op::CumSum { axis, .. } | Op::TopK { axis, .. } => *axis,
        _ => return Err(attr_err(op, "not a scan op")),
    };
    if axis >= rank {
        return Err(attr_err(
            op,
            format!("axis {axis} out of range for rank {rank} ({x})"),
        ));
    }
    if x.dtype == DType::Bool {
        return Err(dtype_err(op, inputs, "needs a numeric dtype"));
    }
    match op {
        Op::TopK { k, .. } => {
            let n = x.shape.dims()[axis];
            if *k > n {
                return Err(attr_err(
                    op,
                    format!("k {k} is larger than dim {axis} of {x}"),
                ));
            }
            let mut dims = x.shape.dims().to_vec();
            dims[axis] = *k;
            Ok(TensorType::new(DType::I64, dims))
        }
        _ => Ok(x.clone()),
    }
}

/// Runs a scan op on the CPU; `out` is the inferred output type.
pub fn cpu(op: &Op, inputs: &[&HostTensor], out: &TensorType) -> Result<HostTensor> {
    let x = inputs[0];
    match op {
        Op::CumSum {
            axis,
            exclusive,
            reverse,
        } => {
            let (outer, n, inner) = split(x.dims(), *axis);
            let order = |j: usize| if *reverse { n - 1 - j } else { j };
            if x.dtype().is_float() {
                let v = x.to_f64_vec();
                let mut o = vec![0.0; v.len()];
                scan(
                    &v,
                    &mut o,
                    outer,
                    n,
                    inner,
                    order,
                    *exclusive,
                    0.0,
                    |a, b| a + b,
                );
                HostTensor::from_f64_slice(out, &o)
            } else {
                if x.dtype() == DType::Bool {
                    return Err(dtype_err(op, &[&x.ty()], "needs a numeric dtype"));
                }
                // Integers sum in wrapping i64 (the low bits of every narrower or unsigned sum).
                let v = x.cast(DType::I64).to_vec::<i64>()?;
                let mut o = vec![0i64; v.len()];
                scan(
                    &v,
                    &mut o,
                    outer,
                    n,
                    inner,
                    order,
                    *exclusive,
                    0,
                    i64::wrapping_add,
                );
                let data = match x.dtype() {
                    DType::I8 => Data::I8(o.iter().map(|&a| a as i8).collect()),
                    DType::I16 => Data::I16(o.iter().map(|&a| a as i16).collect()),
                    DType::I32 => Data::I32(o.iter().map(|&a| a as i32).collect()),
                    DType::U8 => Data::U8(o.iter().map(|&a| a as u8).collect()),
                    DType::U16 => Data::U16(o.iter().map(|&a| a as u16).collect()),
                    DType::U32 => Data::U32(o.iter().map(|&a| a as u32).collect()),
                    DType::U64 => Data::U64(o.iter().map(|&a| a as u64).collect()),
                    _ => Data::I64(o.into()),
                };
                HostTensor::from_data(data, out.shape.clone())
            }
        }
        Op::TopK { axis, k, largest } => {
            let (outer, n, inner) = split(x.dims(), *axis);
            let v = x.to_f64_vec();
            let mut o = vec![0i64; outer * k * inner];
            let mut lane: Vec<usize> = Vec::with_capacity(n);
            for a in 0..outer {
                for i in 0..inner {
                    let at = |j: usize| v[(a * n + j) * inner + i];
                    lane.clear();
                    lane.extend(0..n);
                    // NaN above every number; ties by index.
                    let key = |j: usize| {
                        let x = at(j);
                        if x.is_nan() {
                            f64::INFINITY
                        } else {
                            x
                        }
                    };
                    let nan = |j: usize| at(j).is_nan();
                    lane.sort_by(|&p, &q| {
                        let c = if *largest {
                            nan(q).cmp(&nan(p)).then(
                                key(q)
                                    .partial_cmp(&key(p))
                                    .unwrap_or(std::cmp::Ordering::Equal),
                            )
                        } else {
                            nan(p).cmp(&nan(q)).then(
                                key(p)
                                    .partial_cmp(&key(q))
                                    .unwrap_or(std::cmp::Ordering::Equal),
                            )
                        };
                        c.then(p.cmp(&q))
                    });
                    for (r, &j) in lane.iter().take(*k).enumerate() {
                        o[(a * k + r) * inner + i] = j as i64;
                    }
                }
            }
            HostTensor::from_vec(o, out.shape.clone())
        }
        _ => Err(attr_err(op, "not a scan op")),
    }
}

/// A running `f`-accumulation along the middle axis of `[outer, n, inner]`, visiting positions
/// in `order(0..n)`; exclusive writes the accumulation before adding each element.
fn scan<T: Copy>(
    v: &[T],
    o: &mut [T],
    outer: usize,
    n: usize,
    inner: usize,
    order: impl Fn(usize) -> usize,
    exclusive: bool,
    zero: T,
    f: impl Fn(T, T) -> T,
) {
    for a in 0..outer {
        for i in 0..inner {
            let mut acc = zero;
            for j in 0..n {
                let at = (a * n + order(j)) * inner + i;
                if exclusive {
                    o[at] = acc;
                    acc = f(acc, v[at]);
                } else {
                    acc = f(acc, v[at]);
                    o[at] = acc;
                }
            }
        }
    }
}

/// Gradients: a cumulative sum's is the cumulative sum of the output gradient in the other
/// direction (same exclusiveness); TopK's indices have none.
pub fn vjp(cx: &mut VjpCtx<'_>) -> Result<Vec<Option<Value>>> {
    let x = cx.inputs[0];
    match cx.op.clone() {
        Op::CumSum {
            axis,
            exclusive,
            reverse,
        } if cx.ty(x).dtype.is_float() => {
            let g = cx.grad;
            let op = Op::CumSum {
                axis,
                exclusive,
                reverse: !reverse,
            };
            Ok(vec![Some(cx.emit(op, &[g])?)])
        }
        _ => Ok(vec![None]),
    }
}
