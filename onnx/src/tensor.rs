//! ONNX tensors (`TensorProto`) as host tensors: typed fields, raw little-endian bytes and
//! external data files.

use crate::error::{model_err, ImportError, Result};
use crate::proto::{tensor_proto::DataType, TensorProto};
use rustytorch_ops::{bf16, f16, DType, Data, HostTensor, Shape};
use std::io::{Read, Seek, SeekFrom};
use std::path::{Component, Path};

/// The RustyTorch dtype of an ONNX element type code, or a message naming the unsupported type.
pub fn dtype_from_onnx(code: i32) -> std::result::Result<DType, String> {
    let dt = DataType::try_from(code).map_err(|_| format!("unknown element type {code}"))?;
    Ok(match dt {
        DataType::Float => DType::F32,
        DataType::Double => DType::F64,
        DataType::Float16 => DType::F16,
        DataType::Bfloat16 => DType::BF16,
        DataType::Int32 => DType::I32,
        DataType::Int64 => DType::I64,
        DataType::Uint8 => DType::U8,
        DataType::Bool => DType::Bool,
        DataType::Int8 => DType::I8,
        DataType::Int16 => DType::I16,
        DataType::Uint16 => DType::U16,
        DataType::Uint32 => DType::U32,
        DataType::Uint64 => DType::U64,
        other => {
            return Err(format!(
                "element type {} is not supported (supported: float, double, float16, bfloat16, \
                 int8, int16, int32, int64, uint8, uint16, uint32, uint64, bool)",
                other.as_str_name().to_lowercase()
            ))
        }
    })
}

/// The shape of a tensor's `dims`, checked against RustyTorch's size limits.
fn shape_of(name: &str, dims: &[i64]) -> Result<Shape> {
    let mut out = Vec::with_capacity(dims.len());
    for &d in dims {
        if d < 0 {
            return model_err(format!("tensor `{name}`: negative dimension {d}"));
        }
        out.push(d as usize);
    }
    let shape = Shape::new(out);
    shape
        .check_limits()
        .map_err(|e| ImportError::Model(format!("tensor `{name}`: {e}")))?;
    Ok(shape)
}

/// Reads the bytes of an external data entry (`location`, `offset`, `length`) relative to
/// `base_dir`, checking that they are exactly `want` bytes inside the file.
fn read_external(
    t: &TensorProto,
    name: &str,
    base_dir: Option<&Path>,
    want: usize,
) -> Result<Vec<u8>> {
    let mut location = None;
    let mut offset = 0u64;
    let mut length = None;
    for kv in &t.external_data {
        let v = kv.value();
        let num = |what: &str| {
            v.parse::<u64>().map_err(|_| {
                ImportError::Model(format!(
                    "tensor `{name}`: external data {what} `{v}` is not a number"
                ))
            })
        };
        match kv.key() {
            "location" => location = Some(v.to_string()),
            "offset" => offset = num("offset")?,
            "length" => length = Some(num("length")?),
            _ => {}
        }
    }
    let Some(location) = location else {
        return model_err(format!("tensor `{name}`: external data without a location"));
    };
    let rel = Path::new(&location);
    if rel
        .components()
        .any(|c| !matches!(c, Component::Normal(_) | Component::CurDir))
    {
        return model_err(format!(
            "tensor `{name}`: external data location `{location}` must be a relative path inside the model's folder"
        ));
    }
    let Some(dir) = base_dir else {
        return model_err(format!(
            "tensor `{name}`: external data `{location}` needs the model's folder (import from a file)"
        ));
    };
    let path = dir.join(rel);
    let io = |source| ImportError::Io {
        path: path.display().to_string(),
        source,
    };
    let mut f = std::fs::File::open(&path).map_err(io)?;
    let size = f.metadata().map_err(io)?.len();
    let len = length.unwrap_or_else(|| size.saturating_sub(offset));
    if len != want as u64 {
        return model_err(format!(
            "tensor `{name}`: external data `{location}` holds {len} bytes, the tensor needs {want}"
        ));
    }
    if offset.checked_add(len).is_none_or(|end| end > size) {
        return model_err(format!(
            "tensor `{name}`: external data `{location}` bytes {offset}..{} are past its end ({size} bytes)",
            offset.saturating_add(len)
        ));
    }
    f.seek(SeekFrom::Start(offset)).map_err(io)?;
    let mut buf = vec![0u8; want];
    f.read_exact(&mut buf).map_err(io)?;
    Ok(buf)
}

/// Decodes `n` little-endian elements of `size` bytes each.
fn from_le<T, const N: usize>(raw: &[u8], f: impl Fn([u8; N]) -> T) -> Vec<T> {
    raw.chunks_exact(N)
        .map(|c| f(c.try_into().expect("chunks of N bytes")))
        .collect()
}

/// A host tensor from an ONNX `TensorProto`; external data is read relative to `base_dir`.
pub fn tensor_from_proto(t: &TensorProto, base_dir: Option<&Path>) -> Result<HostTensor> {
    let name = t.name().to_string();
    let dtype = dtype_from_onnx(t.data_type())
        .map_err(|e| ImportError::Model(format!("tensor `{name}`: {e}")))?;
    let shape = shape_of(&name, &t.dims)?;
    let n = shape.numel();
    if t.segment.is_some() {
        return model_err(format!(
            "tensor `{name}`: segmented tensors are not supported"
        ));
    }
    let external =
        t.data_location == Some(crate::proto::tensor_proto::DataLocation::External as i32);
    let raw: Option<Vec<u8>> = if external {
        Some(read_external(t, &name, base_dir, n * dtype.size_bytes())?)
    } else {
        t.raw_data.clone()
    };
    let count_err = |got: usize| {
        ImportError::Model(format!(
            "tensor `{name}`: {got} values for shape {shape} ({n} elements)"
        ))
    };
    let data = if let Some(raw) = raw {
        if raw.len() != n * dtype.size_bytes() {
            return model_err(format!(
                "tensor `{name}`: {} bytes of raw data for {n} {dtype} elements",
                raw.len()
            ));
        }
        match dtype {
            DType::F32 => Data::F32(from_le(&raw, f32::from_le_bytes).into()),
            DType::F64 => Data::F64(from_le(&raw, f64::from_le_bytes).into()),
            DType::F16 => {
                Data::F16(from_le(&raw, |b| f16::from_bits(u16::from_le_bytes(b))).into())
            }
            DType::BF16 => {
                Data::BF16(from_le(&raw, |b| bf16::from_bits(u16::from_le_bytes(b))).into())
            }
            DType::I32 => Data::I32(from_le(&raw, i32::from_le_bytes).into()),
            DType::I64 => Data::I64(from_le(&raw, i64::from_le_bytes).into()),
            DType::U8 => Data::U8(raw.into()),
            DType::Bool => Data::Bool(raw.iter().map(|&b| b != 0).collect()),
            DType::I8 => Data::I8(from_le(&raw, i8::from_le_bytes).into()),
            DType::I16 => Data::I16(from_le(&raw, i16::from_le_bytes).into()),
            DType::U16 => Data::U16(from_le(&raw, u16::from_le_bytes).into()),
            DType::U32 => Data::U32(from_le(&raw, u32::from_le_bytes).into()),
            DType::U64 => Data::U64(from_le(&raw, u64::from_le_bytes).into()),
        }
    } else {
        let got = match dtype {
            DType::F32 => t.float_data.len(),
            DType::F64 => t.double_data.len(),
            DType::I64 => t.int64_data.len(),
            DType::U32 | DType::U64 => t.uint64_data.len(),
            _ => t.int32_data.len(),
        };
        if got != n {
            return Err(count_err(got));
        }
        let i32s = &t.int32_data;
        match dtype {
            DType::F32 => Data::F32(t.float_data.clone().into()),
            DType::F64 => Data::F64(t.double_data.clone().into()),
            DType::I64 => Data::I64(t.int64_data.clone().into()),
            DType::I32 => Data::I32(i32s.clone().into()),
            DType::U8 => Data::U8(i32s.iter().map(|&v| v as u8).collect()),
            DType::Bool => Data::Bool(i32s.iter().map(|&v| v != 0).collect()),
            DType::F16 => Data::F16(i32s.iter().map(|&v| f16::from_bits(v as u16)).collect()),
            DType::BF16 => Data::BF16(i32s.iter().map(|&v| bf16::from_bits(v as u16)).collect()),
            DType::I8 => Data::I8(i32s.iter().map(|&v| v as i8).collect()),
            DType::I16 => Data::I16(i32s.iter().map(|&v| v as i16).collect()),
            DType::U16 => Data::U16(i32s.iter().map(|&v| v as u16).collect()),
            DType::U32 => Data::U32(t.uint64_data.iter().map(|&v| v as u32).collect()),
            DType::U64 => Data::U64(t.uint64_data.clone().into()),
        }
    };
    Ok(HostTensor::from_data(data, shape)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn proto(dtype: DataType, dims: &[i64]) -> TensorProto {
        TensorProto {
            name: Some("t".into()),
            data_type: Some(dtype as i32),
            dims: dims.to_vec(),
            ..Default::default()
        }
    }

    #[test]
    fn integer_element_types_from_typed_fields_and_raw_bytes() {
        // The narrow integers are stored widened in int32_data, uint32 and uint64 in uint64_data.
        let mut t = proto(DataType::Int8, &[3]);
        t.int32_data = vec![-128, 127, -1];
        assert_eq!(
            tensor_from_proto(&t, None).unwrap(),
            HostTensor::from_vec(vec![-128i8, 127, -1], [3]).unwrap()
        );
        let mut t = proto(DataType::Int16, &[2]);
        t.int32_data = vec![-32768, 32767];
        assert_eq!(
            tensor_from_proto(&t, None)
                .unwrap()
                .to_vec::<i16>()
                .unwrap(),
            vec![-32768, 32767]
        );
        let mut t = proto(DataType::Uint16, &[2]);
        t.int32_data = vec![0, 65535];
        assert_eq!(
            tensor_from_proto(&t, None)
                .unwrap()
                .to_vec::<u16>()
                .unwrap(),
            vec![0, 65535]
        );
        let mut t = proto(DataType::Uint32, &[2]);
        t.uint64_data = vec![0, u32::MAX as u64];
        assert_eq!(
            tensor_from_proto(&t, None)
                .unwrap()
                .to_vec::<u32>()
                .unwrap(),
            vec![0, u32::MAX]
        );
        let mut t = proto(DataType::Uint64, &[2]);
        t.uint64_data = vec![1 << 63, u64::MAX];
        assert_eq!(
            tensor_from_proto(&t, None)
                .unwrap()
                .to_vec::<u64>()
                .unwrap(),
            vec![1 << 63, u64::MAX]
        );
        // Raw little-endian bytes.
        let mut t = proto(DataType::Uint64, &[1]);
        t.raw_data = Some(u64::MAX.to_le_bytes().to_vec());
        assert_eq!(
            tensor_from_proto(&t, None)
                .unwrap()
                .to_vec::<u64>()
                .unwrap(),
            vec![u64::MAX]
        );
        let mut t = proto(DataType::Int16, &[2]);
        t.raw_data = Some([(-2i16).to_le_bytes(), 300i16.to_le_bytes()].concat());
        assert_eq!(
            tensor_from_proto(&t, None)
                .unwrap()
                .to_vec::<i16>()
                .unwrap(),
            vec![-2, 300]
        );
        // A count that does not match the shape is an error, not a panic.
        let mut t = proto(DataType::Uint32, &[3]);
        t.uint64_data = vec![1];
        assert!(tensor_from_proto(&t, None).is_err());
        // The element types RustyTorch does not have name themselves.
        let e = dtype_from_onnx(DataType::Float8e4m3fn as i32).unwrap_err();
        assert!(e.contains("float8e4m3fn") && e.contains("uint64"), "{e}");
    }
}
