//! Sparse matrices in graphs: a [`CsrPattern`] is a CSR matrix's structure (row pointers and
//! column indices, as graph constants or as inputs of fixed nnz); its values are a separate tensor
//! (a parameter when trainable), so shapes stay static and gradients reach the values only at the
//! nonzeros.
//!
//! ```
//! use rustytorch_compiler::{CsrPattern, GraphBuilder, Init};
//! use rustytorch_ops::{sparse::random_csr, DType};
//!
//! let g = GraphBuilder::new();
//! let a = random_csr(8, 6, 0.3, DType::F32, DType::I64, 1).unwrap();
//! let pattern = CsrPattern::constant(&g, &a);
//! let values = g.constant(a.values().clone());
//! let x = g.input("x", DType::F32, [6, 4]);
//! let y = pattern.matmul(&values, &x); // A·x: [8, 4]
//! assert_eq!(y.dims(), [8, 4]);
//! ```

use crate::{GraphBuilder, Tensor};
use rustytorch_ops::{CsrMatrix, Op};

/// The structure of a CSR matrix of `rows × cols` in a graph.
#[derive(Clone, Debug)]
pub struct CsrPattern {
    /// Row count of A.
    pub rows: usize,
    /// Column count of A.
    pub cols: usize,
    /// Row pointers, [rows + 1] (i32 or i64).
    pub row_ptr: Tensor,
    /// Column indices, [nnz] (the dtype of `row_ptr`).
    pub col_idx: Tensor,
}

impl CsrPattern {
    /// A pattern from tensors already in a graph (graph inputs of fixed nnz, or constants). The
    /// ops check the pattern's data when they run.
    pub fn new(rows: usize, cols: usize, row_ptr: Tensor, col_idx: Tensor) -> CsrPattern {
        CsrPattern {
            rows,
            cols,
            row_ptr,
            col_idx,
        }
    }

    /// `a`'s structure as graph constants (its values are left to the caller: a constant, an
    /// input or a trainable parameter of `a.nnz()` elements).
    pub fn constant(g: &GraphBuilder, a: &CsrMatrix) -> CsrPattern {
        CsrPattern {
            rows: a.rows(),
            cols: a.cols(),
            row_ptr: g.constant(a.row_ptr().clone()),
            col_idx: g.constant(a.col_idx().clone()),
        }
    }

    /// Number of nonzeros (the length of `col_idx`).
    pub fn nnz(&self) -> usize {
        self.col_idx.dims().first().copied().unwrap_or(0)
    }

    /// `A·x` (SpMM) for A with this pattern and `values` [nnz], x [cols, n]: [rows, n].
    #[track_caller]
    pub fn matmul(&self, values: &Tensor, x: &Tensor) -> Tensor {
        self.product(false, values, x)
    }

    /// `Aᵀ·x` for A with this pattern and `values` [nnz], x [rows, n]: [cols, n].
    #[track_caller]
    pub fn matmul_t(&self, values: &Tensor, x: &Tensor) -> Tensor {
        self.product(true, values, x)
    }

    /// `a·bᵀ` at this pattern's nonzeros (SDDMM), a [rows, k], b [cols, k]: [nnz].
    #[track_caller]
    pub fn sampled_matmul(&self, a: &Tensor, b: &Tensor) -> Tensor {
        a.builder()
            .apply(Op::SampledMatmul, &[&self.row_ptr, &self.col_idx, a, b])
    }

    #[track_caller]
    fn product(&self, trans_a: bool, values: &Tensor, x: &Tensor) -> Tensor {
        x.builder().apply(
            Op::SparseMatmul {
                rows: self.rows,
                cols: self.cols,
                trans_a,
            },
            &[&self.row_ptr, &self.col_idx, values, x],
        )
    }
}
