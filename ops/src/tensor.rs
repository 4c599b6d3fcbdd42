//! Host tensors: contiguous row-major storage (owned, or a view of foreign memory) plus a shape.

use crate::{Buf, DType, HostElement, OpError, Result, Shape, TensorType};
use half::{bf16, f16};
use std::sync::Arc;

/// Typed contiguous storage: one [`Buf`] (an owned `Vec` or a view of foreign memory) per dtype.
#[derive(Clone, Debug, PartialEq)]
pub enum Data {
    /// f32 elements.
    F32(Buf<f32>),
    /// f64 elements.
    F64(Buf<f64>),
    /// f16 elements.
    F16(Buf<f16>),
    /// bf16 elements.
    BF16(Buf<bf16>),
    /// i32 elements.
    I32(Buf<i32>),
    /// i64 elements.
    I64(Buf<i64>),
    /// u8 elements.
    U8(Buf<u8>),
    /// bool elements.
    Bool(Buf<bool>),
    /// i8 elements.
    I8(Buf<i8>),
    /// i16 elements.
    I16(Buf<i16>),
    /// u16 elements.
    U16(Buf<u16>),
    /// u32 elements.
    U32(Buf<u32>),
    /// u64 elements.
    U64(Buf<u64>),
}

/// Runs `$body` with `$v` bound to the typed vector inside a [`Data`] (one dispatch per tensor,
/// never per element).
#[macro_export]
macro_rules! with_data {
    ($data:expr, $v:ident => $body:expr) => {
        match $data {
            $crate::Data::F32($v) => $body,
            $crate::Data::F64($v) => $body,
            $crate::Data::F16($v) => $body,
            $crate::Data::BF16($v) => $body,
            $crate::Data::I32($v) => $body,
            $crate::Data::I64($v) => $body,
            $crate::Data::U8($v) => $body,
            $crate::Data::Bool($v) => $body,
            $crate::Data::I8($v) => $body,
            $crate::Data::I16($v) => $body,
            $crate::Data::U16($v) => $body,
            $crate::Data::U32($v) => $body,
            $crate::Data::U64($v) => $body,
        }
    };
}

/// Runs `$body` with the type alias `$T` bound to the Rust element type of a [`DType`].
#[macro_export]
macro_rules! with_dtype {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            $crate::DType::F32 => {
                type $T = f32;
                $body
            }
            $crate::DType::F64 => {
                type $T = f64;
                $body
            }
            $crate::DType::F16 => {
                type $T = half::f16;
                $body
            }
            $crate::DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            $crate::DType::I32 => {
                type $T = i32;
                $body
            }
            $crate::DType::I64 => {
                type $T = i64;
                $body
            }
            $crate::DType::U8 => {
                type $T = u8;
                $body
            }
            $crate::DType::Bool => {
                type $T = bool;
                $body
            }
            $crate::DType::I8 => {
                type $T = i8;
                $body
            }
            $crate::DType::I16 => {
                type $T = i16;
                $body
            }
            $crate::DType::U16 => {
                type $T = u16;
                $body
            }
            $crate::DType::U32 => {
                type $T = u32;
                $body
            }
            $crate::DType::U64 => {
                type $T = u64;
                $body
            }
        }
    };
}

impl Data {
    /// The dtype of the elements.
    pub fn dtype(&self) -> DType {
        match self {
            Data::F32(_) => DType::F32,
            Data::F64(_) => DType::F64,
            Data::F16(_) => DType::F16,
            Data::BF16(_) => DType::BF16,
            Data::I32(_) => DType::I32,
            Data::I64(_) => DType::I64,
            Data::U8(_) => DType::U8,
            Data::Bool(_) => DType::Bool,
            Data::I8(_) => DType::I8,
            Data::I16(_) => DType::I16,
            Data::U16(_) => DType::U16,
            Data::U32(_) => DType::U32,
            Data::U64(_) => DType::U64,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        with_data!(self, v => v.len())
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A tensor in host memory: contiguous, row-major.
#[derive(Clone, Debug, PartialEq)]
pub struct HostTensor {
    shape: Shape,
    data: Data,
}

impl HostTensor {
    /// A tensor from typed data; errors when the length does not match the shape.
    pub fn from_vec<T: HostElement>(v: Vec<T>, shape: impl Into<Shape>) -> Result<HostTensor> {
        HostTensor::from_data(T::wrap(v), shape)
    }

    /// A tensor from storage; errors when the length does not match the shape.
    pub fn from_data(data: Data, shape: impl Into<Shape>) -> Result<HostTensor> {
        let shape = shape.into();
        if data.len() != shape.numel() {
            return Err(OpError::Runtime {
                op: "from_vec",
                reason: format!(
                    "{} elements given for shape {} ({} elements)",
                    data.len(),
                    shape,
                    shape.numel()
                ),
            });
        }
        Ok(HostTensor { shape, data })
    }

    /// A rank-0 tensor.
    pub fn scalar<T: HostElement>(v: T) -> HostTensor {
        HostTensor {
            shape: Shape::scalar(),
            data: T::wrap(vec![v]),
        }
    }

    /// A tensor of `ty` filled with `value` (converted with `as` semantics).
    pub fn full(ty: &TensorType, value: f64) -> HostTensor {
        let n = ty.shape.numel();
        let data = with_dtype!(ty.dtype, T => <T as HostElement>::wrap(vec![<T as crate::Element>::from_f64(value); n]));
        HostTensor {
            shape: ty.shape.clone(),
            data,
        }
    }

    /// A zero tensor of `ty`.
    pub fn zeros(ty: &TensorType) -> HostTensor {
        HostTensor::full(ty, 0.0)
    }

    /// A tensor of `ty` from f64 values, each converted once (rounded for f16/bf16).
    pub fn from_f64_slice(ty: &TensorType, vals: &[f64]) -> Result<HostTensor> {
        let data = with_dtype!(ty.dtype, T => <T as HostElement>::wrap(vals.iter().map(|&x| <T as crate::Element>::from_f64(x)).collect()));
        HostTensor::from_data(data, ty.shape.clone())
    }

    /// The shape.
    pub fn shape(&self) -> &Shape {
        &self.shape
    }

    /// The dims.
    pub fn dims(&self) -> &[usize] {
        self.shape.dims()
    }

    /// The dtype.
    pub fn dtype(&self) -> DType {
        self.data.dtype()
    }

    /// The tensor type.
    pub fn ty(&self) -> TensorType {
        TensorType::new(self.dtype(), self.shape.clone())
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.numel()
    }

    /// The storage.
    pub fn data(&self) -> &Data {
        &self.data
    }

    /// Whether the elements are a view of another library's memory ([`Buf::is_foreign`]).
    pub fn is_foreign(&self) -> bool {
        with_data!(&self.data, v => v.is_foreign())
    }

    /// The tensor with storage of its own: a view of foreign memory is copied (and the foreign
    /// memory released when nothing else shares it); owned storage is kept as it is.
    pub fn into_owned(mut self) -> HostTensor {
        with_data!(&mut self.data, v => {
            v.make_owned();
        });
        self
    }

    /// `this` under another shape of the same element count, sharing its storage (no copy): the
    /// view keeps `this` alive, and like every shared region it is copied before a write.
    pub fn reshaped_shared(this: &Arc<HostTensor>, shape: impl Into<Shape>) -> Result<HostTensor> {
        let shape = shape.into();
        if shape.numel() != this.numel() {
            return Err(OpError::Runtime {
                op: "reshape",
                reason: format!("{} elements cannot be viewed as {shape}", this.numel()),
            });
        }
        let owner: Arc<dyn Send + Sync> = this.clone();
        let data = crate::with_dtype!(this.dtype(), T => {
            let v = this.as_slice::<T>()?;
            // SAFETY: `owner` (a clone of `this`) keeps the elements alive and initialized; a
            // tensor behind a shared `Arc` is never written in place (writing needs `&mut`, which
            // a shared `Arc` does not give), and `Buf` copies a foreign region before any write.
            let b = unsafe { crate::Buf::from_foreign(v.as_ptr(), v.len(), owner) };
            <T as HostElement>::wrap_buf(b)
        });
        HostTensor::from_data(data, shape)
    }

    /// Consumes the tensor into its storage.
    pub fn into_data(self) -> Data {
        self.data
    }

    /// The elements as `T`; errors naming both dtypes when `T` is not the tensor's dtype.
    pub fn as_slice<T: HostElement>(&self) -> Result<&[T]> {
        T::view(&self.data).ok_or_else(|| OpError::DType {
            op: "as_slice",
            inputs: vec![self.ty()],
            reason: format!("requested {}", T::DTYPE),
        })
    }

    /// The elements copied out as `T` (the dtype must match).
    pub fn to_vec<T: HostElement>(&self) -> Result<Vec<T>> {
        self.as_slice::<T>().map(|s| s.to_vec())
    }

    /// Every element converted to f64 (for references and comparisons).
    pub fn to_f64_vec(&self) -> Vec<f64> {
        with_data!(&self.data, v => v.iter().map(|x| crate::Element::to_f64(*x)).collect())
    }

    /// The same elements with another shape of equal size.
    pub fn reshape(self, shape: impl Into<Shape>) -> Result<HostTensor> {
        HostTensor::from_data(self.data, shape)
    }

    /// A copy converted to `dtype`, as the `cast` op converts (`as` semantics, integers exact at
    /// every width; f16/bf16 rounded once).
    pub fn cast(&self, dtype: DType) -> HostTensor {
        HostTensor {
            shape: self.shape.clone(),
            data: crate::elementwise::cast_cpu(self, dtype),
        }
    }
}
