//! The leaves: graph inputs, parameters and constants (whose data the runtime supplies), and the
//! generated tensors `Full`, `Iota`, `RandUniform` and `RandNormal`.
//!
//! Random tensors are counter-based (see [`crate::rng`]): element `i` depends only on the seed and
//! `i`, so the result is the same on every machine and for every thread count. Values are computed
//! in f64 and converted once to the tensor's dtype (so in f16/bf16 a uniform value just below
//! `high` may round to `high`).

use crate::util::{arity, attr_err, dtype_err, PAR_THRESHOLD};
use crate::{
    rng, with_dtype, Element, HostElement, HostTensor, Op, OpError, Result, TensorType, Value,
    VjpCtx,
};
use rayon::prelude::*;

/// Output type of a leaf: its declared type, after validating the attributes.
pub fn infer(op: &Op, inputs: &[&TensorType]) -> Result<TensorType> {
    arity(op, inputs, 0)?;
    match op {
        Op::Input { ty, .. }
        | Op::Param { ty, .. }
        | Op::Constant { ty, .. }
        | Op::Full { ty, .. } => Ok(ty.clone()),
        Op::Iota { axis, ty } => {
            if *axis >= ty.shape.rank() {
                return Err(attr_err(
                    op,
                    format!(
                        "axis {axis} out of range for shape {} (rank {})",
                        ty.shape,
                        ty.shape.rank()
                    ),
                ));
            }
            if !(ty.dtype.is_float() || ty.dtype.is_int()) {
                return Err(dtype_err(
                    op,
                    &[ty],
                    format!("iota needs a numeric dtype, got {}", ty.dtype),
                ));
            }
            Ok(ty.clone())
        }
        Op::RandUniform { ty, .. } | Op::RandNormal { ty, .. } => {
            if !ty.dtype.is_float() {
                return Err(dtype_err(
                    op,
                    &[ty],
                    format!("random tensors need a float dtype, got {}", ty.dtype),
                ));
            }
            Ok(ty.clone())
        }
        _ => Err(OpError::Runtime {
            op: op.name(),
            reason: "not a leaf op".into(),
        }),
    }
}

/// Fills `out[i] = f(i)` (in parallel for large tensors).
fn fill<T: Element>(out: &mut [T], f: impl Fn(usize) -> T + Sync) {
    const CHUNK: usize = 1 << 14;
    if out.len() >= PAR_THRESHOLD {
        out.par_chunks_mut(CHUNK)
            .enumerate()
            .for_each(|(c, chunk)| {
                for (j, o) in chunk.iter_mut().enumerate() {
                    *o = f(c * CHUNK + j);
                }
            });
    } else {
        for (i, o) in out.iter_mut().enumerate() {
            *o = f(i);
        }
    }
}

/// A zeroed buffer of `n` elements of `T` for `op`, or an error (never an abort) when the
/// allocation fails.
fn alloc<T: Element>(op: &Op, ty: &TensorType, n: usize) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| OpError::Runtime {
        op: op.name(),
        reason: format!(
            "cannot allocate {ty} ({} bytes)",
            ty.try_size_bytes()
                .map_or("too many".into(), |b| b.to_string())
        ),
    })?;
    v.resize(n, T::default());
    Ok(v)
}

/// A tensor of `ty` with `out[i] = T::from_f64(f(i))`; the type is checked against the size
/// limits and the buffer allocated fallibly first.
fn generate(op: &Op, ty: &TensorType, f: impl Fn(usize) -> f64 + Sync) -> Result<HostTensor> {
    let n = ty
        .shape
        .check_limits()
        .map_err(|e| attr_err(op, format!("type {}: {e}", ty.dtype)))?;
    let data = with_dtype!(ty.dtype, T => {
        let mut v = alloc::<T>(op, ty, n)?;
        fill(&mut v, |i| <T as Element>::from_f64(f(i)));
        <T as HostElement>::wrap(v)
    });
    HostTensor::from_data(data, ty.shape.clone())
}

/// CPU kernel of a generated leaf. `Input`, `Param` and `Constant` are supplied by the runtime and
/// are an error here.
pub fn cpu(op: &Op, _inputs: &[&HostTensor], out: &TensorType) -> Result<HostTensor> {
    match op {
        Op::Input { .. } | Op::Param { .. } | Op::Constant { .. } => Err(OpError::Runtime {
            op: op.name(),
            reason:
                "graph inputs, parameters and constants are supplied by the runtime, not computed"
                    .into(),
        }),
        Op::Full { value, .. } => {
            let v = value.get();
            generate(op, out, |_| v)
        }
        Op::Iota { axis, .. } => {
            let dims = out.shape.dims();
            let stride = out.shape.strides()[*axis].max(1);
            let len = dims[*axis].max(1);
            generate(op, out, |i| ((i / stride) % len) as f64)
        }
        Op::RandUniform {
            low, high, seed, ..
        } => {
            let (lo, hi, seed) = (low.get(), high.get(), *seed);
            generate(op, out, |i| lo + (hi - lo) * rng::uniform01(seed, i as u64))
        }
        Op::RandNormal {
            mean, std, seed, ..
        } => {
            let (m, s, seed) = (mean.get(), std.get(), *seed);
            generate(op, out, |i| m + s * rng::normal(seed, i as u64))
        }
        _ => Err(OpError::Runtime {
            op: op.name(),
            reason: "not a leaf op".into(),
        }),
    }
}

/// Leaves have no inputs, hence no input gradients.
pub fn vjp(_cx: &mut VjpCtx<'_>) -> Result<Vec<Option<Value>>> {
    Ok(Vec::new())
}
