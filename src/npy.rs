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

/// Reads a C-order `.npy` file of f32, f64, f16, i8, i16, i32, i64, u8, u16, u32, u64 or bool.
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
        "|i1" => DType::I8,
        "<i2" => DType::I16,
        "<u2" => DType::U16,
        "<u4" => DType::U32,
        "<u8" => DType::U64,
        other => {
            return Err(file_err(
                path,
                format!(
                    "unsupported numpy dtype `{other}` (supported: <f4 <f8 <f2 |i1 <i2 <i4 <i8 \
                     |u1 <u2 <u4 <u8 |b1)"
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
        DType::F32 => Data::F32(f.into_vec().map_err(bad)?.into()),
        DType::F64 => Data::F64(f.into_vec().map_err(bad)?.into()),
        DType::F16 => Data::F16(f.into_vec::<f16>().map_err(bad)?.into()),
        DType::I32 => Data::I32(f.into_vec().map_err(bad)?.into()),
        DType::I64 => Data::I64(f.into_vec().map_err(bad)?.into()),
        DType::U8 => Data::U8(f.into_vec().map_err(bad)?.into()),
        DType::Bool => Data::Bool(f.into_vec().map_err(bad)?.into()),
        DType::I8 => Data::I8(f.into_vec().map_err(bad)?.into()),
        DType::I16 => Data::I16(f.into_vec().map_err(bad)?.into()),
        DType::U16 => Data::U16(f.into_vec().map_err(bad)?.into()),
        DType::U32 => Data::U32(f.into_vec().map_err(bad)?.into()),
        DType::U64 => Data::U64(f.into_vec().map_err(bad)?.into()),
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
        Data::I8(v) => put(&mut w, &shape, v),
        Data::I16(v) => put(&mut w, &shape, v),
        Data::U16(v) => put(&mut w, &shape, v),
        Data::U32(v) => put(&mut w, &shape, v),
        Data::U64(v) => put(&mut w, &shape, v),
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

#[cfg(test)]
mod tests {
    use super::*;
    use rustytorch_ops::testing::rand_tensor;
    use rustytorch_ops::TensorType;

    /// The numpy type string in a `.npy` header.
    fn descr(path: &Path) -> String {
        let bytes = std::fs::read(path).unwrap();
        let f = npyz::NpyFile::new(&bytes[..]).unwrap();
        f.dtype().descr().trim_matches('\'').to_string()
    }

    #[test]
    fn every_dtype_round_trips_with_numpys_type_string() {
        let dir = std::env::temp_dir().join(format!("rustytorch-npy-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cases = [
            (DType::F32, "<f4"),
            (DType::F64, "<f8"),
            (DType::F16, "<f2"),
            (DType::I8, "|i1"),
            (DType::I16, "<i2"),
            (DType::I32, "<i4"),
            (DType::I64, "<i8"),
            (DType::U8, "|u1"),
            (DType::U16, "<u2"),
            (DType::U32, "<u4"),
            (DType::U64, "<u8"),
            (DType::Bool, "|b1"),
        ];
        for (k, (dtype, want)) in cases.into_iter().enumerate() {
            let ty = TensorType::new(dtype, [3, 4]);
            let (lo, hi) = if dtype.is_unsigned_int() {
                (1.0, 250.0)
            } else {
                (-120.0, 120.0)
            };
            let mut t = rand_tensor(&ty, 40 + k as u64, lo, hi);
            // The extremes of each integer type survive too (±∞ saturate to them).
            if dtype.is_int() {
                let mut v = t.to_f64_vec();
                v[0] = f64::NEG_INFINITY;
                v[1] = f64::INFINITY;
                t = HostTensor::from_vec(v, [3, 4]).unwrap().cast(dtype);
            }
            let path = dir.join(format!("t{k}.npy"));
            write_npy(&path, &t).unwrap();
            assert_eq!(descr(&path), want, "{dtype}");
            assert_eq!(read_npy(&path).unwrap(), t, "{dtype}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
