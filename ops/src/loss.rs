//! Cross entropy from logits `[N, C]` and integer targets `[N]`, and its gradient with respect to
//! the logits.
//!
//! Per row: `logsumexp(row) − row[target]` (max-subtracted). Rows whose target equals
//! `ignore_index` are ignored: they give 0 (reduction `None`), add nothing and are not counted in
//! the mean; a mean over zero counted rows is NaN, as in PyTorch. Any other target outside `0..C`
//! is a runtime error. Kernels run in f64 for f64 logits and in f32 otherwise; the log-sum-exp,
//! each row's loss and the batch sum or mean accumulate in f64, pairwise ([`acc_sum`]).

use crate::norm::{acc_sum, compute_view, from_compute, Real};
use crate::util::{arity, attr_err, dtype_err, shape_err, PAR_THRESHOLD};
use crate::{DType, HostTensor, Op, OpError, Reduction, Result, Shape, TensorType, Value, VjpCtx};
use rayon::prelude::*;

/// Output type.
pub fn infer(op: &Op, inputs: &[&TensorType]) -> Result<TensorType> {
    let (reduction, grad) = match op {
        Op::CrossEntropy { reduction, .. } => (*reduction, false),
        Op::CrossEntropyGrad { reduction, .. } => (*reduction, true),
        _ => return Err(attr_err(op, "not a loss op")),
    };
    arity(op, inputs, if grad { 3 } else { 2 })?;
    let (logits, targets) = (inputs[0], inputs[1]);
    if !logits.dtype.is_float() {
        return Err(dtype_err(op, inputs, "logits must be a float tensor"));
    }
    if !matches!(targets.dtype, DType::I32 | DType::I64) {
        return Err(dtype_err(op, inputs, "targets must be i32 or i64"));
    }
    if logits.shape.rank() != 2 {
        return Err(shape_err(op, inputs, "logits must be [N, C]"));
    }
    let n = logits.shape.dims()[0];
    if targets.shape.dims() != [n] {
        return Err(shape_err(op, inputs, format!("targets must be [{n}]")));
    }
    let loss_shape = match reduction {
        Reduction::None => Shape::new([n]),
        Reduction::Mean | Reduction::Sum => Shape::scalar(),
    };
    if grad {
        let g = inputs[2];
        if g.dtype != logits.dtype {
            return Err(dtype_err(
                op,
                inputs,
                "grad_out must have the logits' dtype",
            ));
        }
        if g.shape != loss_shape {
            return Err(shape_err(
                op,
                inputs,
                format!("grad_out must have the loss's shape {loss_shape}"),
            ));
        }
        Ok(logits.clone())
    } else {
        Ok(TensorType::new(logits.dtype, loss_shape))
    }
}

/// The targets as i64, with every non-ignored one checked against `0..c`.
fn targets(op: &Op, t: &HostTensor, c: usize, ignore: i64) -> Result<Vec<i64>> {
    let v: Vec<i64> = match t.data() {
        crate::Data::I64(v) => v.to_vec(),
        crate::Data::I32(v) => v.iter().map(|&i| i as i64).collect(),
        _ => t.to_f64_vec().iter().map(|&v| v as i64).collect(),
    };
    if let Some(&bad) = v
        .iter()
        .find(|&&i| i != ignore && (i < 0 || i as u64 >= c as u64))
    {
        return Err(OpError::Runtime {
            op: op.name(),
            reason: format!("target {bad} is out of range for {c} classes (ignore_index {ignore})"),
        });
    }
    Ok(v)
}

/// CPU kernel.
pub fn cpu(op: &Op, inputs: &[&HostTensor], out: &TensorType) -> Result<HostTensor> {
    if out.dtype == DType::F64 {
        cpu_in::<f64>(op, inputs, out)
    } else {
        cpu_in::<f32>(op, inputs, out)
    }
}

/// `(max, ln Σ exp(x − max))` of a row, the sum in f64; max is −∞ for an empty or all −∞ row.
fn lse<C: Real>(row: &[C]) -> (C, C::Acc) {
    let mut m = C::NEG_INF;
    for &v in row {
        if v > m || v.is_nan() {
            m = v;
        }
    }
    (m, acc_sum(row, &|v: C| (v - m).exp().acc()).ln())
}

fn cpu_in<C: Real>(op: &Op, inputs: &[&HostTensor], out: &TensorType) -> Result<HostTensor> {
    let (reduction, ignore) = match op {
        Op::CrossEntropy {
            reduction,
            ignore_index,
        }
        | Op::CrossEntropyGrad {
            reduction,
            ignore_index,
        } => (*reduction, *ignore_index),
        _ => return Err(attr_err(op, "not a loss op")),
    };
    let x = compute_view::<C>(inputs[0]);
    let (n, c) = (inputs[0].dims()[0], inputs[0].dims()[1]);
    let t = targets(op, inputs[1], c, ignore)?;
    let count = t.iter().filter(|&&i| i != ignore).count();
    let par = n * c >= PAR_THRESHOLD;
    match op {
        Op::CrossEntropy { .. } => {
            let row_loss = |r: usize| -> C::Acc {
                if t[r] == ignore {
                    return C::Acc::ZERO;
                }
                let row = &x[r * c..(r + 1) * c];
                let (m, l) = lse(row);
                (m.acc() - row[t[r] as usize].acc()) + l
            };
            let losses: Vec<C::Acc> = if par {
                (0..n).into_par_iter().map(row_loss).collect()
            } else {
                (0..n).map(row_loss).collect()
            };
            let total = || acc_sum(&losses, &|l| l);
            let v = match reduction {
                Reduction::None => losses.iter().map(|&l| C::from_acc(l)).collect(),
                Reduction::Sum => vec![C::from_acc(total())],
                Reduction::Mean => vec![C::from_acc(total() / C::Acc::from_usize(count))],
            };
            from_compute(v, out)
        }
        Op::CrossEntropyGrad { .. } => {
            let g = compute_view::<C>(inputs[2]);
            let mut dx = vec![C::ZERO; n * c];
            if c > 0 {
                let row = |(r, dr): (usize, &mut [C])| {
                    if t[r] == ignore {
                        return;
                    }
                    let gr = match reduction {
                        Reduction::None => g[r],
                        Reduction::Sum => g[0],
                        Reduction::Mean => g[0] / C::from_usize(count),
                    };
                    let xr = &x[r * c..(r + 1) * c];
                    let (m, l) = lse(xr);
                    let l = C::from_acc(l);
                    for (d, &v) in dr.iter_mut().zip(xr) {
                        *d = (v - m - l).exp() * gr;
                    }
                    dr[t[r] as usize] = dr[t[r] as usize] - gr;
                };
                if par {
                    dx.par_chunks_mut(c).enumerate().for_each(row);
                } else {
                    dx.chunks_mut(c).enumerate().for_each(row);
                }
            }
            from_compute(dx, out)
        }
        _ => Err(attr_err(op, "not a loss op")),
    }
}

/// Gradient rule: logits get a [`Op::CrossEntropyGrad`] node, targets nothing; the gradient op
/// itself has no gradient (second order is not supported).
pub fn vjp(cx: &mut VjpCtx<'_>) -> Result<Vec<Option<Value>>> {
    match cx.op.clone() {
        Op::CrossEntropy {
            reduction,
            ignore_index,
        } => {
            let d = cx.emit(
                Op::CrossEntropyGrad {
                    reduction,
                    ignore_index,
                },
                &[cx.inputs[0], cx.inputs[1], cx.grad],
            )?;
            Ok(vec![Some(d), None])
        }
        Op::CrossEntropyGrad { .. } => Err(cx.not_differentiable(
            0,
            "second-order gradients of cross entropy are not supported",
        )),
        op => Err(attr_err(&op, "not a loss op")),
    }
}
