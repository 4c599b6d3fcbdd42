//! Sparse matrices: the host types and SpGEMM of the ops crate ([`CsrMatrix`], [`CooMatrix`],
//! [`spgemm`]), the graph-side pattern ([`CsrPattern`], for `sparse_matmul`), and files with one
//! tensor per component: `NAME.row_ptr`, `NAME.col_idx`, `NAME.values` (CSR) or `NAME.row_idx`,
//! `NAME.col_idx`, `NAME.values` (COO), and `NAME.shape` (i64 [rows, cols]), as `.npy` files in
//! a directory or as tensors of a safetensors file. Loading validates the index data like the
//! constructors do, so a damaged or hostile file is an error naming the component.
//!
//! numpy has no bf16: bf16 values are written to `.npy` as f32 (exactly) and read back as f32.
//!
//! On CUDA, [`DeviceCsr`] and [`DeviceCoo`] hold matrices in device memory: upload from and
//! download to the host types, conversions between the two forms (repeated COO entries summed as
//! on the host) and to dense, SpGEMM and transposition of CSR matrices.

use crate::npy::{load_safetensors, read_npy, save_safetensors, write_npy};
use crate::{Error, Result};
pub use rustytorch_compiler::CsrPattern;
pub use rustytorch_ops::sparse::{random_csr, SpIndex};
pub use rustytorch_ops::{spgemm, CooMatrix, CsrMatrix};
use rustytorch_ops::{DType, HostTensor, OpError};
pub use rustytorch_runtime::cuda::sparse::{DeviceCoo, DeviceCsr};
use std::path::Path;

/// A sparse matrix stored as three 1-D component tensors and its shape.
pub trait SparseComponents: Sized {
    /// The names of the three components, in order.
    const PARTS: [&'static str; 3];
    /// (rows, cols).
    fn dims(&self) -> (usize, usize);
    /// The components, in [`SparseComponents::PARTS`] order.
    fn components(&self) -> [&HostTensor; 3];
    /// The matrix from its shape and components, validated.
    fn from_components(rows: usize, cols: usize, parts: [HostTensor; 3]) -> Result<Self>;
}

impl SparseComponents for CsrMatrix {
    const PARTS: [&'static str; 3] = ["row_ptr", "col_idx", "values"];
    fn dims(&self) -> (usize, usize) {
        self.shape()
    }
    fn components(&self) -> [&HostTensor; 3] {
        [self.row_ptr(), self.col_idx(), self.values()]
    }
    fn from_components(rows: usize, cols: usize, [a, b, c]: [HostTensor; 3]) -> Result<Self> {
        Ok(CsrMatrix::new(rows, cols, a, b, c)?)
    }
}

impl SparseComponents for CooMatrix {
    const PARTS: [&'static str; 3] = ["row_idx", "col_idx", "values"];
    fn dims(&self) -> (usize, usize) {
        self.shape()
    }
    fn components(&self) -> [&HostTensor; 3] {
        [self.row_idx(), self.col_idx(), self.values()]
    }
    fn from_components(rows: usize, cols: usize, [a, b, c]: [HostTensor; 3]) -> Result<Self> {
        Ok(CooMatrix::new(rows, cols, a, b, c)?)
    }
}

fn format_err(reason: String) -> Error {
    Error::Op(OpError::Runtime {
        op: "sparse file",
        reason,
    })
}

/// The matrix as named tensors: `NAME.<component>` and `NAME.shape`.
pub fn to_tensors<M: SparseComponents>(name: &str, m: &M) -> Vec<(String, HostTensor)> {
    let (rows, cols) = m.dims();
    let mut out: Vec<(String, HostTensor)> = M::PARTS
        .iter()
        .zip(m.components())
        .map(|(p, t)| (format!("{name}.{p}"), t.clone()))
        .collect();
    out.push((
        format!("{name}.shape"),
        HostTensor::from_vec(vec![rows as i64, cols as i64], [2]).expect("1-D"),
    ));
    out
}

/// Reads `(rows, cols)` from a `NAME.shape` tensor.
fn shape_of(name: &str, t: &HostTensor) -> Result<(usize, usize)> {
    let v = match (t.dtype(), t.dims()) {
        (DType::I64 | DType::I32, [2]) => t.to_f64_vec(),
        _ => {
            return Err(format_err(format!(
                "`{name}.shape` must be an integer tensor of 2 elements, got {}",
                t.ty()
            )))
        }
    };
    if v.iter().any(|&d| d < 0.0) {
        return Err(format_err(format!(
            "`{name}.shape` has a negative dim: {v:?}"
        )));
    }
    Ok((v[0] as usize, v[1] as usize))
}

/// The matrix `NAME` from named tensors (as [`to_tensors`] makes them), validated.
pub fn from_tensors<M: SparseComponents>(
    name: &str,
    tensors: &[(String, HostTensor)],
) -> Result<M> {
    let get = |part: &str| -> Result<HostTensor> {
        let key = format!("{name}.{part}");
        tensors
            .iter()
            .find(|(n, _)| *n == key)
            .map(|(_, t)| t.clone())
            .ok_or_else(|| format_err(format!("no tensor `{key}`")))
    };
    let (rows, cols) = shape_of(name, &get("shape")?)?;
    let [a, b, c] = M::PARTS;
    M::from_components(rows, cols, [get(a)?, get(b)?, get(c)?])
}

/// Writes the matrix to a safetensors file as `NAME.<component>` and `NAME.shape`.
pub fn save_sparse_safetensors<M: SparseComponents>(path: &Path, name: &str, m: &M) -> Result<()> {
    save_safetensors(path, &to_tensors(name, m))
}

/// Reads matrix `NAME` from a safetensors file (other tensors in the file are ignored).
pub fn load_sparse_safetensors<M: SparseComponents>(path: &Path, name: &str) -> Result<M> {
    from_tensors(name, &load_safetensors(path)?)
}

/// Writes the matrix as `DIR/NAME.<component>.npy` and `DIR/NAME.shape.npy`.
pub fn save_sparse_npy<M: SparseComponents>(dir: &Path, name: &str, m: &M) -> Result<()> {
    for (n, t) in to_tensors(name, m) {
        write_npy(&dir.join(format!("{n}.npy")), &t)?;
    }
    Ok(())
}

/// Reads matrix `NAME` from `DIR/NAME.<component>.npy` and `DIR/NAME.shape.npy`.
pub fn load_sparse_npy<M: SparseComponents>(dir: &Path, name: &str) -> Result<M> {
    let mut tensors = vec![];
    for part in M::PARTS.iter().chain(&["shape"]) {
        let n = format!("{name}.{part}");
        tensors.push((n.clone(), read_npy(&dir.join(format!("{n}.npy")))?));
    }
    from_tensors(name, &tensors)
}
