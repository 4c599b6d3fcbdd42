//! Sparse matrices on the host: [`CsrMatrix`] and [`CooMatrix`] with i32 or i64 indices and f32,
//! f64, f16 or bf16 values, conversions between them and dense tensors, validation of untrusted
//! index data, `transpose`, the eager sparse × sparse product [`spgemm`], and the graph ops over a
//! CSR pattern ([`Op::SparseMatmul`], [`Op::SampledMatmul`], in `spmm.rs`).
//!
//! Invariants of a [`CsrMatrix`] (checked by [`CsrMatrix::new`], kept by every operation):
//! `row_ptr` has `rows + 1` entries, starts at 0, never decreases and ends at `nnz`; the column
//! indices of each row are strictly increasing (sorted, no duplicates) and below `cols`. A
//! [`CooMatrix`] only needs indices in range: entries may come in any order and repeat, and
//! repeated entries add up (in [`CooMatrix::to_csr`], [`CooMatrix::to_dense`]).
//!
//! f16 and bf16 values are computed in f32 and rounded once, f32 in f32, f64 in f64.

mod spgemm;
mod spmm;

pub use spgemm::spgemm;
pub use spmm::{cpu, infer, vjp};

use crate::util::PAR_THRESHOLD;
use crate::{DType, Data, HostElement, HostTensor, OpError, Result, TensorType};
use rayon::prelude::*;

/// An index element of a sparse matrix (i32 or i64).
pub trait SpIndex: HostElement + Ord {
    /// The largest count or position this type can hold.
    const LIMIT: usize;
    /// As a signed 64-bit value.
    fn to_i64(self) -> i64;
    /// As a position (the value must be non-negative, as validated data is).
    fn to_usize(self) -> usize;
    /// From a position (at most [`SpIndex::LIMIT`]).
    fn from_usize(v: usize) -> Self;
}

macro_rules! sp_index {
    ($t:ty) => {
        impl SpIndex for $t {
            const LIMIT: usize = <$t>::MAX as usize;
            #[inline(always)]
            fn to_i64(self) -> i64 {
                self as i64
            }
            #[inline(always)]
            fn to_usize(self) -> usize {
                self as usize
            }
            #[inline(always)]
            fn from_usize(v: usize) -> Self {
                v as $t
            }
        }
    };
}
sp_index!(i32);
sp_index!(i64);

/// Runs `$body` with `$I` bound to the index type of `$dtype` (i32 or i64).
macro_rules! with_index {
    ($dtype:expr, $I:ident => $body:expr) => {
        match $dtype {
            DType::I32 => {
                type $I = i32;
                $body
            }
            _ => {
                type $I = i64;
                $body
            }
        }
    };
}
pub(crate) use with_index;

fn err(what: &'static str, reason: impl Into<String>) -> OpError {
    OpError::Runtime {
        op: what,
        reason: reason.into(),
    }
}

/// Checks that `t` is a 1-D index tensor (i32 or i64) named `name`.
fn check_index_tensor(what: &'static str, name: &str, t: &HostTensor) -> Result<()> {
    if !matches!(t.dtype(), DType::I32 | DType::I64) {
        return Err(err(
            what,
            format!("{name} must be i32 or i64, got {}", t.dtype()),
        ));
    }
    if t.shape().rank() != 1 {
        return Err(err(
            what,
            format!("{name} must be 1-D, got shape {}", t.shape()),
        ));
    }
    Ok(())
}

/// Checks the values tensor: 1-D, a float dtype.
fn check_values(what: &'static str, t: &HostTensor) -> Result<()> {
    if !t.dtype().is_float() {
        return Err(err(
            what,
            format!("values must be f32, f64, f16 or bf16, got {}", t.dtype()),
        ));
    }
    if t.shape().rank() != 1 {
        return Err(err(
            what,
            format!("values must be 1-D, got shape {}", t.shape()),
        ));
    }
    Ok(())
}

/// Checks a CSR pattern given as untrusted data: `row_ptr` has `rows + 1` entries, starts at 0,
/// never decreases and ends at `col_idx.len()`; every column index is in `0..cols`; with
/// `sorted`, the column indices of each row are strictly increasing. The error names the first
/// offending position and value.
pub fn check_csr_pattern<I: SpIndex>(
    what: &'static str,
    rows: usize,
    cols: usize,
    row_ptr: &[I],
    col_idx: &[I],
    sorted: bool,
) -> Result<()> {
    if row_ptr.len() != rows.wrapping_add(1) || rows == usize::MAX {
        return Err(err(
            what,
            format!(
                "row_ptr has {} entries but {rows} rows need {}",
                row_ptr.len(),
                rows as u128 + 1
            ),
        ));
    }
    let nnz = col_idx.len();
    if row_ptr[0].to_i64() != 0 {
        return Err(err(
            what,
            format!("row_ptr[0] is {} but must be 0", row_ptr[0].to_i64()),
        ));
    }
    for i in 0..rows {
        let (s, e) = (row_ptr[i].to_i64(), row_ptr[i + 1].to_i64());
        if e < s {
            return Err(err(
                what,
                format!(
                    "row_ptr decreases at row {i}: row_ptr[{i}] = {s} > row_ptr[{}] = {e}",
                    i + 1
                ),
            ));
        }
    }
    if row_ptr[rows].to_i64() as u64 != nnz as u64 {
        return Err(err(
            what,
            format!(
                "row_ptr[{rows}] is {} but there are {nnz} column indices",
                row_ptr[rows].to_i64()
            ),
        ));
    }
    let check_row = |i: usize| -> Result<()> {
        let (s, e) = (row_ptr[i].to_usize(), row_ptr[i + 1].to_usize());
        let mut prev = -1i64;
        for (k, &c) in col_idx[s..e].iter().enumerate() {
            let c = c.to_i64();
            if c < 0 || c as u64 >= cols as u64 {
                return Err(err(
                    what,
                    format!(
                        "col_idx[{}] = {c} (row {i}) is out of range for {cols} columns",
                        s + k
                    ),
                ));
            }
            if sorted && c <= prev {
                return Err(err(
                    what,
                    format!(
                        "column indices of row {i} are not strictly increasing: col_idx[{}] = \
                         {c} after {prev} (sort them and sum duplicates, as CooMatrix::to_csr does)",
                        s + k
                    ),
                ));
            }
            prev = c;
        }
        Ok(())
    };
    if nnz >= PAR_THRESHOLD {
        (0..rows).into_par_iter().try_for_each(check_row)
    } else {
        (0..rows).try_for_each(check_row)
    }
}

/// Checks COO indices: every row index in `0..rows`, every column index in `0..cols`.
pub fn check_coo_indices<I: SpIndex>(
    what: &'static str,
    rows: usize,
    cols: usize,
    row_idx: &[I],
    col_idx: &[I],
) -> Result<()> {
    for (name, idx, n) in [("row_idx", row_idx, rows), ("col_idx", col_idx, cols)] {
        if let Some((k, v)) = idx
            .iter()
            .enumerate()
            .find(|(_, v)| v.to_i64() < 0 || v.to_i64() as u64 >= n as u64)
        {
            return Err(err(
                what,
                format!("{name}[{k}] = {} is out of range for {n}", v.to_i64()),
            ));
        }
    }
    Ok(())
}

/// Checks that an index dtype can address `n` positions.
fn check_capacity(what: &'static str, index: DType, n: usize, of: &str) -> Result<()> {
    let limit = with_index!(index, I => I::LIMIT);
    if n > limit {
        return Err(err(
            what,
            format!("{of} ({n}) does not fit {index} indices; use i64 indices"),
        ));
    }
    Ok(())
}

/// An index tensor of `dtype` from positions.
fn index_tensor(dtype: DType, v: Vec<usize>) -> HostTensor {
    let n = v.len();
    let data = with_index!(dtype, I => I::wrap(v.into_iter().map(I::from_usize).collect()));
    HostTensor::from_data(data, [n]).expect("1-D")
}

/// Positions from an index tensor of validated, non-negative data.
fn positions(t: &HostTensor) -> Vec<usize> {
    match t.data() {
        Data::I32(v) => v.iter().map(|&i| i as usize).collect(),
        Data::I64(v) => v.iter().map(|&i| i as usize).collect(),
        _ => unreachable!("index tensors are validated as i32 or i64"),
    }
}

/// Values as f64 (exact for every value dtype).
fn values_f64(t: &HostTensor) -> Vec<f64> {
    t.to_f64_vec()
}

/// A 1-D values tensor of `dtype` from f64 sums (rounded once).
fn values_tensor(dtype: DType, v: &[f64]) -> HostTensor {
    HostTensor::from_f64_slice(&TensorType::new(dtype, [v.len()]), v).expect("sizes match")
}

/// A sparse matrix in compressed sparse row form, on the host.
#[derive(Clone, Debug, PartialEq)]
pub struct CsrMatrix {
    rows: usize,
    cols: usize,
    row_ptr: HostTensor,
    col_idx: HostTensor,
    values: HostTensor,
}

/// The checks shared by both formats' constructors: the first index tensor (`row_ptr` or
/// `row_idx`, named) and `col_idx` are i32/i64 vectors of one dtype, `values` a float vector.
fn check_components(
    w: &'static str,
    (name, first): (&str, &HostTensor),
    col_idx: &HostTensor,
    values: &HostTensor,
) -> Result<()> {
    check_index_tensor(w, name, first)?;
    check_index_tensor(w, "col_idx", col_idx)?;
    check_values(w, values)?;
    if first.dtype() != col_idx.dtype() {
        return Err(err(
            w,
            format!(
                "{name} ({}) and col_idx ({}) must have one index dtype",
                first.dtype(),
                col_idx.dtype()
            ),
        ));
    }
    Ok(())
}

impl CsrMatrix {
    /// A CSR matrix from its components, validated: `row_ptr` [rows+1] and `col_idx` [nnz] of
    /// one index dtype (i32 or i64), `values` [nnz] of a float dtype, row pointers starting at 0,
    /// non-decreasing and ending at nnz, column indices in range and strictly increasing within
    /// each row. Any violation is an error naming the position and value.
    pub fn new(
        rows: usize,
        cols: usize,
        row_ptr: HostTensor,
        col_idx: HostTensor,
        values: HostTensor,
    ) -> Result<CsrMatrix> {
        const W: &str = "csr";
        check_components(W, ("row_ptr", &row_ptr), &col_idx, &values)?;
        if col_idx.numel() != values.numel() {
            return Err(err(
                W,
                format!(
                    "col_idx has {} entries but values has {}",
                    col_idx.numel(),
                    values.numel()
                ),
            ));
        }
        check_capacity(W, row_ptr.dtype(), rows.max(cols), "the matrix size")?;
        with_index!(row_ptr.dtype(), I => check_csr_pattern::<I>(
            W,
            rows,
            cols,
            row_ptr.as_slice::<I>()?,
            col_idx.as_slice::<I>()?,
            true,
        ))?;
        Ok(CsrMatrix {
            rows,
            cols,
            row_ptr,
            col_idx,
            values,
        })
    }

    /// Components already known to satisfy the invariants (made by this module's kernels).
    pub(crate) fn from_valid(
        rows: usize,
        cols: usize,
        row_ptr: HostTensor,
        col_idx: HostTensor,
        values: HostTensor,
    ) -> CsrMatrix {
        debug_assert!(
            CsrMatrix::new(rows, cols, row_ptr.clone(), col_idx.clone(), values.clone()).is_ok()
        );
        CsrMatrix {
            rows,
            cols,
            row_ptr,
            col_idx,
            values,
        }
    }

    /// An all-zero matrix of the given shape, index dtype and value dtype.
    pub fn zeros(rows: usize, cols: usize, index: DType, dtype: DType) -> Result<CsrMatrix> {
        CsrMatrix::new(
            rows,
            cols,
            index_tensor(index, vec![0; rows + 1]),
            index_tensor(index, vec![]),
            values_tensor(dtype, &[]),
        )
    }

    /// The nonzeros of a dense 2-D float tensor (every element that is not ±0; NaN counts),
    /// with indices of `index` (i32 or i64).
    pub fn from_dense(t: &HostTensor, index: DType) -> Result<CsrMatrix> {
        CooMatrix::from_dense(t, index)?.to_csr()
    }

    /// The matrix as a dense 2-D tensor of its value dtype.
    pub fn to_dense(&self) -> HostTensor {
        let (rp, ci) = (positions(&self.row_ptr), positions(&self.col_idx));
        let v = values_f64(&self.values);
        let mut d = vec![0.0; self.rows * self.cols];
        for i in 0..self.rows {
            for e in rp[i]..rp[i + 1] {
                d[i * self.cols + ci[e]] = v[e];
            }
        }
        HostTensor::from_f64_slice(&TensorType::new(self.dtype(), [self.rows, self.cols]), &d)
            .expect("sizes match")
    }

    /// The same entries in coordinate form (row-major order).
    pub fn to_coo(&self) -> CooMatrix {
        let rp = positions(&self.row_ptr);
        let mut rows = Vec::with_capacity(self.nnz());
        for i in 0..self.rows {
            rows.extend(std::iter::repeat_n(i, rp[i + 1] - rp[i]));
        }
        CooMatrix {
            rows: self.rows,
            cols: self.cols,
            row_idx: index_tensor(self.index_dtype(), rows),
            col_idx: self.col_idx.clone(),
            values: self.values.clone(),
        }
    }

    /// The transpose, in CSR form (a counting sort by column; the result's rows are sorted).
    pub fn transpose(&self) -> CsrMatrix {
        let (rp, ci) = (positions(&self.row_ptr), positions(&self.col_idx));
        let mut t_rp = vec![0usize; self.cols + 1];
        for &c in &ci {
            t_rp[c + 1] += 1;
        }
        for c in 0..self.cols {
            t_rp[c + 1] += t_rp[c];
        }
        let mut next = t_rp.clone();
        let mut t_ci = vec![0usize; ci.len()];
        let mut perm = vec![0usize; ci.len()];
        for i in 0..self.rows {
            for e in rp[i]..rp[i + 1] {
                let slot = &mut next[ci[e]];
                t_ci[*slot] = i;
                perm[*slot] = e;
                *slot += 1;
            }
        }
        let values = crate::with_data!(self.values.data(), v => HostTensor::from_data(
            HostElement::wrap(perm.iter().map(|&e| v[e]).collect()),
            [perm.len()],
        ))
        .expect("1-D");
        let index = self.index_dtype();
        CsrMatrix::from_valid(
            self.cols,
            self.rows,
            index_tensor(index, t_rp),
            index_tensor(index, t_ci),
            values,
        )
    }

    /// `self · other` (SpGEMM, see [`spgemm`]).
    pub fn matmul(&self, other: &CsrMatrix) -> Result<CsrMatrix> {
        spgemm(self, other)
    }

    /// `self · x` for a dense 2-D `x` of the value dtype (SpMM, the CPU kernel of
    /// [`crate::Op::SparseMatmul`]).
    pub fn matmul_dense(&self, x: &HostTensor) -> Result<HostTensor> {
        crate::eval_cpu(
            &crate::Op::SparseMatmul {
                rows: self.rows,
                cols: self.cols,
                trans_a: false,
            },
            &[&self.row_ptr, &self.col_idx, &self.values, x],
        )
    }

    /// Values converted to another float dtype (rounded once).
    pub fn to_dtype(&self, dtype: DType) -> Result<CsrMatrix> {
        if !dtype.is_float() {
            return Err(err(
                "csr",
                format!("values must be f32, f64, f16 or bf16, not {dtype}"),
            ));
        }
        let mut m = self.clone();
        m.values = self.values.cast(dtype);
        Ok(m)
    }

    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Number of columns.
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// (rows, cols).
    pub fn shape(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }
    /// Number of stored entries.
    pub fn nnz(&self) -> usize {
        self.col_idx.numel()
    }
    /// The index dtype (i32 or i64).
    pub fn index_dtype(&self) -> DType {
        self.row_ptr.dtype()
    }
    /// The value dtype.
    pub fn dtype(&self) -> DType {
        self.values.dtype()
    }
    /// Row pointers, [rows + 1].
    pub fn row_ptr(&self) -> &HostTensor {
        &self.row_ptr
    }
    /// Column indices, [nnz].
    pub fn col_idx(&self) -> &HostTensor {
        &self.col_idx
    }
    /// Values, [nnz].
    pub fn values(&self) -> &HostTensor {
        &self.values
    }
    /// The components: (row_ptr, col_idx, values).
    pub fn into_parts(self) -> (HostTensor, HostTensor, HostTensor) {
        (self.row_ptr, self.col_idx, self.values)
    }
}

/// A sparse matrix in coordinate form, on the host: any order, repeated entries add up.
#[derive(Clone, Debug, PartialEq)]
pub struct CooMatrix {
    rows: usize,
    cols: usize,
    row_idx: HostTensor,
    col_idx: HostTensor,
    values: HostTensor,
}

impl CooMatrix {
    /// A COO matrix from its components, validated: `row_idx`, `col_idx` [nnz] of one index dtype
    /// (i32 or i64) with every index in range, `values` [nnz] of a float dtype.
    pub fn new(
        rows: usize,
        cols: usize,
        row_idx: HostTensor,
        col_idx: HostTensor,
        values: HostTensor,
    ) -> Result<CooMatrix> {
        const W: &str = "coo";
        check_components(W, ("row_idx", &row_idx), &col_idx, &values)?;
        if row_idx.numel() != col_idx.numel() || col_idx.numel() != values.numel() {
            return Err(err(
                W,
                format!(
                    "row_idx, col_idx and values have {}, {} and {} entries; they must agree",
                    row_idx.numel(),
                    col_idx.numel(),
                    values.numel()
                ),
            ));
        }
        check_capacity(W, row_idx.dtype(), rows.max(cols), "the matrix size")?;
        with_index!(row_idx.dtype(), I => check_coo_indices::<I>(
            W,
            rows,
            cols,
            row_idx.as_slice::<I>()?,
            col_idx.as_slice::<I>()?,
        ))?;
        Ok(CooMatrix {
            rows,
            cols,
            row_idx,
            col_idx,
            values,
        })
    }

    /// The nonzeros of a dense 2-D float tensor (every element that is not ±0; NaN counts),
    /// row-major, with indices of `index` (i32 or i64).
    pub fn from_dense(t: &HostTensor, index: DType) -> Result<CooMatrix> {
        const W: &str = "coo";
        if t.shape().rank() != 2 || !t.dtype().is_float() {
            return Err(err(
                W,
                format!("a dense matrix must be a 2-D float tensor, got {}", t.ty()),
            ));
        }
        if !matches!(index, DType::I32 | DType::I64) {
            return Err(err(W, format!("indices must be i32 or i64, not {index}")));
        }
        let (rows, cols) = (t.dims()[0], t.dims()[1]);
        check_capacity(W, index, rows.max(cols), "the matrix size")?;
        let d = t.to_f64_vec();
        let (mut ri, mut ci, mut v) = (vec![], vec![], vec![]);
        for (k, &x) in d.iter().enumerate() {
            if x != 0.0 {
                ri.push(k / cols);
                ci.push(k % cols);
                v.push(x);
            }
        }
        Ok(CooMatrix {
            rows,
            cols,
            row_idx: index_tensor(index, ri),
            col_idx: index_tensor(index, ci),
            values: values_tensor(t.dtype(), &v),
        })
    }

    /// The CSR form: entries sorted by row, then column; repeated entries summed (in f64,
    /// rounded once to the value dtype), in their input order.
    pub fn to_csr(&self) -> Result<CsrMatrix> {
        let (ri, ci) = (positions(&self.row_idx), positions(&self.col_idx));
        let v = values_f64(&self.values);
        // Counting sort by row keeps the input order within a row.
        let mut start = vec![0usize; self.rows + 1];
        for &r in &ri {
            start[r + 1] += 1;
        }
        for r in 0..self.rows {
            start[r + 1] += start[r];
        }
        let mut next = start.clone();
        let mut order = vec![0usize; ri.len()];
        for (e, &r) in ri.iter().enumerate() {
            order[next[r]] = e;
            next[r] += 1;
        }
        let mut rp = Vec::with_capacity(self.rows + 1);
        rp.push(0);
        let (mut out_c, mut out_v) = (Vec::with_capacity(ri.len()), Vec::with_capacity(ri.len()));
        for r in 0..self.rows {
            let row = &mut order[start[r]..start[r + 1]];
            row.sort_by_key(|&e| ci[e]);
            for &e in row.iter() {
                if out_c.len() > rp[r] && *out_c.last().unwrap() == ci[e] {
                    *out_v.last_mut().unwrap() += v[e];
                } else {
                    out_c.push(ci[e]);
                    out_v.push(v[e]);
                }
            }
            rp.push(out_c.len());
        }
        let index = self.index_dtype();
        Ok(CsrMatrix::from_valid(
            self.rows,
            self.cols,
            index_tensor(index, rp),
            index_tensor(index, out_c),
            values_tensor(self.dtype(), &out_v),
        ))
    }

    /// The matrix as a dense 2-D tensor (repeated entries summed in f64, rounded once).
    pub fn to_dense(&self) -> HostTensor {
        let (ri, ci) = (positions(&self.row_idx), positions(&self.col_idx));
        let v = values_f64(&self.values);
        let mut d = vec![0.0; self.rows * self.cols];
        for e in 0..v.len() {
            d[ri[e] * self.cols + ci[e]] += v[e];
        }
        HostTensor::from_f64_slice(&TensorType::new(self.dtype(), [self.rows, self.cols]), &d)
            .expect("sizes match")
    }

    /// The transpose (row and column indices swapped).
    pub fn transpose(&self) -> CooMatrix {
        CooMatrix {
            rows: self.cols,
            cols: self.rows,
            row_idx: self.col_idx.clone(),
            col_idx: self.row_idx.clone(),
            values: self.values.clone(),
        }
    }

    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Number of columns.
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// (rows, cols).
    pub fn shape(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }
    /// Number of stored entries (repeats included).
    pub fn nnz(&self) -> usize {
        self.values.numel()
    }
    /// The index dtype (i32 or i64).
    pub fn index_dtype(&self) -> DType {
        self.row_idx.dtype()
    }
    /// The value dtype.
    pub fn dtype(&self) -> DType {
        self.values.dtype()
    }
    /// Row indices, [nnz].
    pub fn row_idx(&self) -> &HostTensor {
        &self.row_idx
    }
    /// Column indices, [nnz].
    pub fn col_idx(&self) -> &HostTensor {
        &self.col_idx
    }
    /// Values, [nnz].
    pub fn values(&self) -> &HostTensor {
        &self.values
    }
    /// The components: (row_idx, col_idx, values).
    pub fn into_parts(self) -> (HostTensor, HostTensor, HostTensor) {
        (self.row_idx, self.col_idx, self.values)
    }
}

/// A seeded random `rows × cols` CSR matrix with about `density · rows · cols` nonzeros at
/// uniformly random positions (repeats merged) and values uniform in [-1, 1), for tests and
/// benchmarks.
pub fn random_csr(
    rows: usize,
    cols: usize,
    density: f64,
    dtype: DType,
    index: DType,
    seed: u64,
) -> Result<CsrMatrix> {
    let target = (density * rows as f64 * cols as f64).round() as usize;
    let target = if rows == 0 || cols == 0 { 0 } else { target };
    let u =
        |s: u64, i: usize| crate::rng::uniform01(seed.wrapping_mul(3).wrapping_add(s), i as u64);
    let ri: Vec<usize> = (0..target)
        .map(|i| ((u(0, i) * rows as f64) as usize).min(rows - 1))
        .collect();
    let ci: Vec<usize> = (0..target)
        .map(|i| ((u(1, i) * cols as f64) as usize).min(cols - 1))
        .collect();
    let v: Vec<f64> = (0..target).map(|i| 2.0 * u(2, i) - 1.0).collect();
    let coo = CooMatrix::new(
        rows,
        cols,
        index_tensor(index, ri),
        index_tensor(index, ci),
        values_tensor(dtype, &v),
    )?;
    // Repeated positions add up.
    coo.to_csr()
}
