//! Host tensors to and from files: `.npy` (numpy, through the `npyz` crate) for the runner's
//! inputs and outputs, and safetensors for parameter state.

use crate::{Error, Result};
use rustytorch_ops::{f16, DType, Data, HostTensor, Shape};
use std::path::Path;

fn file_err(path: &Path, reason: impl std::fmt::Display) -> Error {
    Error::File {
        path: path.display().to_string(),
        reason: reason.to_string(),
    }
}

/// Reads a C-order `.npy` file of f32, f64, f16, i32, i64, u8 or bool.
pub fn read_npy(path: &Path) -> Result<HostTensor> {
    let bytes = std::fs::read(path).map_err(|e| file_err(path, e))?;
    let f = npyz::NpyFile::new(&bytes[..])
        .map_err(|e| file_err(path, format!("not a .npy file: {e}")))?;
    if f.order() != npyz::Order::C {
        return Err(file_err(
            path,
            "Fortran-order arrays are not supported; save with C order",
        ));
    }
    let dims: Vec<usize> = f.shape().iter().map(|&d| d as usize).collect();
    let descr = f.dtype().descr();
    let descr = descr.trim_matches('\'');
    let dtype = match descr {
        "<f4" => DType::F32,
        "<f8" => DType::F64,
        "<f2" => DType::F16,
        "<i4" => DType::I32,
        "<i8" => DType::I64,
        "|u1" => DType::U8,
        "|b1" => DType::Bool,
        other => {
            return Err(file_err(
                path,
                format!(
                    "unsupported numpy dtype `{other}` (supported: <f4 <f8 <f2 <i4 <i8 |u1 |b1)"
                ),
            ))
        }
    };
    // Bound the allocation by what the file holds before decoding.
    let numel = dims
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .filter(|n| {
            n.checked_mul(dtype.size_bytes())
                .is_some_and(|b| b <= bytes.len())
        })
        .ok_or_else(|| file_err(path, "header shape is larger than the file"))?;
    let bad = |e: std::io::Error| file_err(path, e);
    let data = match dtype {
        DType::F32 => Data::F32(f.into_vec().map_err(bad)?),
        DType::F64 => Data::F64(f.into_vec().map_err(bad)?),
        DType::F16 => Data::F16(f.into_vec::<f16>().map_err(bad)?),
        DType::I32 => Data::I32(f.into_vec().map_err(bad)?),
        DType::I64 => Data::I64(f.into_vec().map_err(bad)?),
        DType::U8 => Data::U8(f.into_vec().map_err(bad)?),
        DType::Bool => Data::Bool(f.into_vec().map_err(bad)?),
        DType::BF16 => unreachable!("numpy has no bf16"),
    };
    debug_assert_eq!(data.len(), numel);
    Ok(HostTensor::from_data(data, Shape::new(dims))?)
}

/// Writes a `.npy` file (bf16 is written as f32: numpy has no bf16).
pub fn write_npy(path: &Path, t: &HostTensor) -> Result<()> {
    let shape: Vec<u64> = t.dims().iter().map(|&d| d as u64).collect();
    let file = std::fs::File::create(path).map_err(|e| file_err(path, e))?;
    let mut w = std::io::BufWriter::new(file);
    fn put<T: npyz::AutoSerialize + Clone>(
        w: &mut impl std::io::Write,
        shape: &[u64],
        v: &[T],
    ) -> std::io::Result<()> {
        use npyz::WriterBuilder;
        let mut wr = npyz::WriteOptions::new()
            .default_dtype()
            .shape(shape)
            .writer(w)
            .begin_nd()?;
        wr.extend(v.iter().cloned())?;
        wr.finish()
    }
    let r = match t.data() {
        Data::F32(v) => put(&mut w, &shape, v),
        Data::F64(v) => put(&mut w, &shape, v),
        Data::F16(v) => put(&mut w, &shape, v),
        Data::BF16(v) => put(
            &mut w,
            &shape,
            &v.iter().map(|x| x.to_f32()).collect::<Vec<_>>(),
        ),
        Data::I32(v) => put(&mut w, &shape, v),
        Data::I64(v) => put(&mut w, &shape, v),
        Data::U8(v) => put(&mut w, &shape, v),
        Data::Bool(v) => put(&mut w, &shape, v),
    };
    r.map_err(|e| file_err(path, e))
}

/// Writes named tensors to a safetensors file.
pub fn save_safetensors(path: &Path, tensors: &[(String, HostTensor)]) -> Result<()> {
    let bytes = rustytorch_compiler::format::safetensors_bytes(tensors)?;
    std::fs::write(path, bytes).map_err(|e| file_err(path, e))
}

/// Reads every tensor of a safetensors file, sorted by name.
pub fn load_safetensors(path: &Path) -> Result<Vec<(String, HostTensor)>> {
    let bytes = std::fs::read(path).map_err(|e| file_err(path, e))?;
    Ok(rustytorch_compiler::format::safetensors_tensors(
        &bytes,
        &path.display().to_string(),
    )?)
}
