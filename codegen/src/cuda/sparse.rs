//! The sparse graph ops on CUDA: `sparse_matmul` (SpMM, `A·x` or `Aᵀ·x`) as a cuSPARSE call
//! descriptor, `sampled_matmul` (SDDMM, the gradient with respect to A's values) as a generated
//! kernel.
//!
//! cuSPARSE reads the pattern as given, so the runtime validates it where it enters the device
//! (a constant when the session is prepared, an input before every run, with the CPU kernels'
//! checks); a pattern computed on the device or held in a parameter is refused at prepare.

use super::elementwise::{grid, grid_kernel, param};
use super::ir::*;
use super::{Launch, StepKernels};
use crate::{CodegenError, Result};
use rustytorch_ops::{DType, Op, TensorType};

/// One cuSPARSE SpMM: `out = op(A)·x` with A a CSR matrix of `rows × cols` holding `nnz`
/// entries (operands row_ptr, col_idx, values, x), x and out dense row-major with `n` columns.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct SpmmDesc {
    /// A's rows.
    pub rows: usize,
    /// A's columns.
    pub cols: usize,
    /// A's stored entries.
    pub nnz: usize,
    /// Columns of x and of the result.
    pub n: usize,
    /// Multiply by Aᵀ (x is `[rows, n]`, the result `[cols, n]`).
    pub trans_a: bool,
    /// Index type of row_ptr and col_idx (i32 or i64).
    pub index: DType,
    /// Element type of the values, x and the result (f16/bf16 accumulate in f32).
    pub dtype: DType,
}

impl SpmmDesc {
    /// Rows of the result.
    pub fn out_rows(&self) -> usize {
        if self.trans_a {
            self.cols
        } else {
            self.rows
        }
    }

    /// Whether the product is all zeros without reading anything (no entries or an empty
    /// dimension): the runtime then clears the result instead of calling cuSPARSE.
    pub fn is_empty(&self) -> bool {
        self.nnz == 0 || self.n == 0 || self.rows == 0 || self.cols == 0
    }
}

fn not_sparse(op: &Op) -> CodegenError {
    CodegenError::Invalid(format!("{} is not a sparse op", op.name()))
}

/// The cuSPARSE call of a `sparse_matmul` with operand types `inputs` and result `out`.
pub fn lower_spmm(op: &Op, inputs: &[&TensorType], out: &TensorType) -> Result<SpmmDesc> {
    let Op::SparseMatmul {
        rows,
        cols,
        trans_a,
    } = op
    else {
        return Err(not_sparse(op));
    };
    if inputs.len() != 4 {
        return Err(CodegenError::Invalid(format!(
            "sparse_matmul has {} operands, not 4",
            inputs.len()
        )));
    }
    Ok(SpmmDesc {
        rows: *rows,
        cols: *cols,
        nnz: inputs[1].shape.numel(),
        n: out.shape.dims().get(1).copied().unwrap_or(0),
        trans_a: *trans_a,
        index: inputs[0].dtype,
        dtype: out.dtype,
    })
}

/// `sampled_matmul` (operands row_ptr [m+1], col_idx [nnz], a [m,k], b [n,k]; result [nnz]) as
/// one kernel: a thread per row of the pattern walks its entries, each a dot product of a row of
/// `a` with a row of `b` accumulated in the compute type (f32 for f16/bf16).
pub fn lower_sddmm(op: &Op, inputs: &[&TensorType], out: &TensorType) -> Result<StepKernels> {
    if !matches!(op, Op::SampledMatmul) {
        return Err(not_sparse(op));
    }
    if inputs.len() != 4 {
        return Err(CodegenError::Invalid(format!(
            "sampled_matmul has {} operands, not 4",
            inputs.len()
        )));
    }
    let (idx, dt) = (inputs[0].dtype, out.dtype);
    let m = inputs[2].shape.dims()[0];
    let k = inputs[2].shape.dims()[1] as i64;
    if out.shape.numel() == 0 || m == 0 {
        return Ok(StepKernels::default());
    }
    let (it, el, ty) = (CTy::storage(idx), CTy::storage(dt), CTy::compute(dt));
    let params = vec![
        param("row_ptr", idx, false),
        param("col_idx", idx, false),
        param("a", dt, false),
        param("b", dt, false),
        param("out", dt, true),
    ];
    let kernel = grid_kernel("sddmm", params, m, |b, i| {
        b.push(let_(
            "e0",
            CTy::I64,
            cast(CTy::I64, load("row_ptr", it, i.clone())),
        ));
        b.push(let_(
            "e1",
            CTy::I64,
            cast(CTy::I64, load("row_ptr", it, add(i.clone(), i64c(1)))),
        ));
        b.push(let_("arow", CTy::I64, mul(i, i64c(k))));
        let dot = vec![
            let_(
                "brow",
                CTy::I64,
                mul(cast(CTy::I64, load("col_idx", it, var("e"))), i64c(k)),
            ),
            let_("acc", ty, fc(0.0, ty)),
            for_(
                "j",
                i64c(0),
                i64c(k),
                i64c(1),
                vec![assign(
                    "acc",
                    add(
                        var("acc"),
                        mul(
                            load("a", el, add(var("arow"), var("j"))),
                            load("b", el, add(var("brow"), var("j"))),
                        ),
                    ),
                )],
            ),
            store("out", el, var("e"), var("acc")),
        ];
        b.push(for_("e", var("e0"), var("e1"), i64c(1), dot));
        Ok(())
    })?;
    Ok(StepKernels {
        launches: vec![Launch::simple(kernel, 4, grid(m))],
        scratch_bytes: 0,
    })
}
