//! The graph ops over a CSR pattern: [`Op::SparseMatmul`] (SpMM, `A·x` or `Aᵀ·x` for a sparse A
//! and a dense x) and [`Op::SampledMatmul`] (SDDMM, `a·bᵀ` at A's nonzeros, the gradient with
//! respect to A's values). Inference, CPU kernels and gradient rules.
//!
//! The pattern (row pointers, column indices) is data of fixed size, so the shapes are static and
//! the ops are ordinary graph nodes; the kernels check the pattern (row pointers start at 0, never
//! decrease and end at nnz; column indices in range) and report a bad one as a runtime error
//! naming the position. Column indices need not be sorted; repeated ones add up.
//!
//! Gradients (g is the output's gradient; `v` A's values):
//! - `y = A·x`:  `dv = sampled_matmul(g, x)`, `dx = Aᵀ·g`;
//! - `y = Aᵀ·x`: `dv = sampled_matmul(x, g)`, `dx = A·g`;
//! - `s = sampled_matmul(a, b)` (pattern values h = g): `da = H·b`, `db = Hᵀ·a`.
//!
//! The pattern inputs get no gradient.

use super::check_csr_pattern;
use crate::norm::{compute_view, from_compute, Real};
use crate::util::{arity, attr_err, dtype_err, shape_err, PAR_THRESHOLD};
use crate::{DType, HostTensor, Op, Result, TensorType, Value, VjpCtx};
use rayon::prelude::*;

/// Output type of a sparse op; errors name the op, the input types and what does not fit.
pub fn infer(op: &Op, inputs: &[&TensorType]) -> Result<TensorType> {
    arity(op, inputs, 4)?;
    let (rp, ci) = (inputs[0], inputs[1]);
    if !matches!(rp.dtype, DType::I32 | DType::I64) || ci.dtype != rp.dtype {
        return Err(dtype_err(
            op,
            inputs,
            "row_ptr and col_idx must both be i32 or both be i64",
        ));
    }
    if rp.shape.rank() != 1 || ci.shape.rank() != 1 {
        return Err(shape_err(op, inputs, "row_ptr and col_idx must be 1-D"));
    }
    let nnz = ci.shape.dims()[0];
    match op {
        Op::SparseMatmul {
            rows,
            cols,
            trans_a,
        } => {
            let (v, x) = (inputs[2], inputs[3]);
            if !v.dtype.is_float() || x.dtype != v.dtype {
                return Err(dtype_err(
                    op,
                    inputs,
                    "values and x must have one float dtype",
                ));
            }
            if rp.shape.dims()[0] != rows.wrapping_add(1) {
                return Err(shape_err(
                    op,
                    inputs,
                    format!("row_ptr must have rows + 1 = {} entries", *rows as u128 + 1),
                ));
            }
            if v.shape.rank() != 1 || v.shape.dims()[0] != nnz {
                return Err(shape_err(
                    op,
                    inputs,
                    format!("values must be 1-D with one entry per column index ({nnz})"),
                ));
            }
            if x.shape.rank() != 2 {
                return Err(shape_err(op, inputs, "x must be 2-D"));
            }
            let (inner, outer) = if *trans_a {
                (*rows, *cols)
            } else {
                (*cols, *rows)
            };
            let xd = x.shape.dims();
            if xd[0] != inner {
                let a = if *trans_a { "Aᵀ" } else { "A" };
                return Err(shape_err(
                    op,
                    inputs,
                    format!(
                        "{a}·x needs x with {inner} rows (A is {rows}×{cols}), got {}",
                        xd[0]
                    ),
                ));
            }
            Ok(TensorType::new(v.dtype, [outer, xd[1]]))
        }
        Op::SampledMatmul => {
            let (a, b) = (inputs[2], inputs[3]);
            if !a.dtype.is_float() || b.dtype != a.dtype {
                return Err(dtype_err(op, inputs, "a and b must have one float dtype"));
            }
            if a.shape.rank() != 2 || b.shape.rank() != 2 {
                return Err(shape_err(op, inputs, "a and b must be 2-D"));
            }
            let (ad, bd) = (a.shape.dims(), b.shape.dims());
            if ad[1] != bd[1] {
                return Err(shape_err(
                    op,
                    inputs,
                    format!(
                        "a and b must have one column count (a·bᵀ), got {} and {}",
                        ad[1], bd[1]
                    ),
                ));
            }
            if rp.shape.dims()[0] != ad[0] + 1 {
                return Err(shape_err(
                    op,
                    inputs,
                    format!("row_ptr must have a's rows + 1 = {} entries", ad[0] + 1),
                ));
            }
            Ok(TensorType::new(a.dtype, [nnz]))
        }
        _ => Err(attr_err(op, "not a sparse op")),
    }
}

/// A validated pattern as positions: (row_ptr, col_idx).
fn pattern(
    op: &Op,
    rp: &HostTensor,
    ci: &HostTensor,
    rows: usize,
    cols: usize,
) -> Result<(Vec<usize>, Vec<usize>)> {
    super::with_index!(rp.dtype(), I => check_csr_pattern::<I>(
        op.name(),
        rows,
        cols,
        rp.as_slice::<I>()?,
        ci.as_slice::<I>()?,
        false,
    ))?;
    Ok((super::positions(rp), super::positions(ci)))
}

/// The row of each nonzero.
fn row_of(rp: &[usize]) -> Vec<usize> {
    let mut r = Vec::with_capacity(rp[rp.len() - 1]);
    for i in 0..rp.len() - 1 {
        r.extend(std::iter::repeat_n(i, rp[i + 1] - rp[i]));
    }
    r
}

/// CPU kernel.
pub fn cpu(op: &Op, inputs: &[&HostTensor], out: &TensorType) -> Result<HostTensor> {
    match out.dtype {
        DType::F64 => typed::<f64>(op, inputs, out),
        _ => typed::<f32>(op, inputs, out),
    }
}

fn typed<C: Real>(op: &Op, inputs: &[&HostTensor], out: &TensorType) -> Result<HostTensor> {
    let (rpt, cit) = (inputs[0], inputs[1]);
    match op {
        Op::SparseMatmul {
            rows,
            cols,
            trans_a,
        } => {
            let (rp, ci) = pattern(op, rpt, cit, *rows, *cols)?;
            let v = compute_view::<C>(inputs[2]);
            let x = compute_view::<C>(inputs[3]);
            let n = inputs[3].dims()[1];
            let y = if *trans_a {
                spmm_t(&rp, &ci, &v, &x, *cols, n)
            } else {
                spmm(&rp, &ci, &v, &x, n)
            };
            from_compute(y, out)
        }
        Op::SampledMatmul => {
            let (a, b) = (inputs[2], inputs[3]);
            let (rp, ci) = pattern(op, rpt, cit, a.dims()[0], b.dims()[0])?;
            let k = a.dims()[1];
            let (a, b) = (compute_view::<C>(a), compute_view::<C>(b));
            from_compute(sddmm(&rp, &ci, &a, &b, k), out)
        }
        _ => Err(attr_err(op, "not a sparse op")),
    }
}

/// `y = A·x`, one task per block of rows of y.
fn spmm<C: Real>(rp: &[usize], ci: &[usize], v: &[C], x: &[C], n: usize) -> Vec<C> {
    let rows = rp.len() - 1;
    let mut y = vec![C::ZERO; rows * n];
    if n == 0 {
        return y;
    }
    let row = |(i, yr): (usize, &mut [C])| {
        for e in rp[i]..rp[i + 1] {
            let (a, xr) = (v[e], &x[ci[e] * n..(ci[e] + 1) * n]);
            for (o, &xv) in yr.iter_mut().zip(xr) {
                *o += a * xv;
            }
        }
    };
    if ci.len() * n >= PAR_THRESHOLD {
        y.par_chunks_mut(n).enumerate().for_each(row);
    } else {
        y.chunks_mut(n).enumerate().for_each(row);
    }
    y
}

/// `y = Aᵀ·x`: A's pattern transposed by a counting sort over columns, then one task per block
/// of rows of y (A's columns), each summing its nonzeros in row order (deterministic).
fn spmm_t<C: Real>(rp: &[usize], ci: &[usize], v: &[C], x: &[C], cols: usize, n: usize) -> Vec<C> {
    let mut y = vec![C::ZERO; cols * n];
    if n == 0 {
        return y;
    }
    let mut start = vec![0usize; cols + 1];
    for &c in ci {
        start[c + 1] += 1;
    }
    for c in 0..cols {
        start[c + 1] += start[c];
    }
    let mut next = start.clone();
    // For each column of A in turn, its nonzeros as (row, position).
    let mut by_col = vec![(0usize, 0usize); ci.len()];
    for i in 0..rp.len() - 1 {
        for e in rp[i]..rp[i + 1] {
            by_col[next[ci[e]]] = (i, e);
            next[ci[e]] += 1;
        }
    }
    let row = |(c, yr): (usize, &mut [C])| {
        for &(i, e) in &by_col[start[c]..start[c + 1]] {
            let (a, xr) = (v[e], &x[i * n..(i + 1) * n]);
            for (o, &xv) in yr.iter_mut().zip(xr) {
                *o += a * xv;
            }
        }
    };
    if ci.len() * n >= PAR_THRESHOLD {
        y.par_chunks_mut(n).enumerate().for_each(row);
    } else {
        y.chunks_mut(n).enumerate().for_each(row);
    }
    y
}

/// `out[e] = a[row(e)] · b[col(e)]` over rows of length k.
fn sddmm<C: Real>(rp: &[usize], ci: &[usize], a: &[C], b: &[C], k: usize) -> Vec<C> {
    let rows = row_of(rp);
    let dot = |(e, o): (usize, &mut C)| {
        let (ar, br) = (&a[rows[e] * k..][..k], &b[ci[e] * k..][..k]);
        *o = ar.iter().zip(br).fold(C::ZERO, |s, (&p, &q)| s + p * q);
    };
    let mut out = vec![C::ZERO; ci.len()];
    if ci.len() * k >= PAR_THRESHOLD {
        out.par_iter_mut().enumerate().for_each(dot);
    } else {
        out.iter_mut().enumerate().for_each(dot);
    }
    out
}

/// Gradient rule (see the module comment); the pattern inputs get none.
pub fn vjp(cx: &mut VjpCtx<'_>) -> Result<Vec<Option<Value>>> {
    let (rp, ci, p, q, g) = (
        cx.inputs[0],
        cx.inputs[1],
        cx.inputs[2],
        cx.inputs[3],
        cx.grad,
    );
    match cx.op.clone() {
        Op::SparseMatmul {
            rows,
            cols,
            trans_a,
        } => {
            let (v, x) = (p, q);
            let dv = if trans_a {
                cx.emit(Op::SampledMatmul, &[rp, ci, x, g])?
            } else {
                cx.emit(Op::SampledMatmul, &[rp, ci, g, x])?
            };
            let dx = cx.emit(
                Op::SparseMatmul {
                    rows,
                    cols,
                    trans_a: !trans_a,
                },
                &[rp, ci, v, g],
            )?;
            Ok(vec![None, None, Some(dv), Some(dx)])
        }
        Op::SampledMatmul => {
            let (a, b) = (p, q);
            let (rows, cols) = (cx.ty(a).shape.dims()[0], cx.ty(b).shape.dims()[0]);
            let da = cx.emit(
                Op::SparseMatmul {
                    rows,
                    cols,
                    trans_a: false,
                },
                &[rp, ci, g, b],
            )?;
            let db = cx.emit(
                Op::SparseMatmul {
                    rows,
                    cols,
                    trans_a: true,
                },
                &[rp, ci, g, a],
            )?;
            Ok(vec![None, None, Some(da), Some(db)])
        }
        op => Err(attr_err(&op, "not a sparse op")),
    }
}
