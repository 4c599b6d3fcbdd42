//! Element types and the host-side element trait.

use half::{bf16, f16};
use serde::{Deserialize, Serialize};
use std::fmt;

/// The element type of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum DType {
    /// 32-bit IEEE float.
    F32,
    /// 64-bit IEEE float.
    F64,
    /// 16-bit IEEE float (computed in f32, rounded once).
    F16,
    /// bfloat16 (computed in f32, rounded once).
    BF16,
    /// 32-bit signed integer.
    I32,
    /// 64-bit signed integer.
    I64,
    /// 8-bit unsigned integer.
    U8,
    /// Boolean (one byte on the host).
    Bool,
    /// 8-bit signed integer.
    I8,
    /// 16-bit signed integer.
    I16,
    /// 16-bit unsigned integer.
    U16,
    /// 32-bit unsigned integer.
    U32,
    /// 64-bit unsigned integer.
    U64,
}

impl DType {
    /// Every dtype, in declaration order (the order graph files number them in).
    pub const ALL: [DType; 13] = [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I32,
        DType::I64,
        DType::U8,
        DType::Bool,
        DType::I8,
        DType::I16,
        DType::U16,
        DType::U32,
        DType::U64,
    ];

    /// Every integer dtype (those [`DType::is_int`] accepts), signed by width, then unsigned.
    pub const INTS: [DType; 8] = [
        DType::I8,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::U8,
        DType::U16,
        DType::U32,
        DType::U64,
    ];

    /// Bytes per element.
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F64 | DType::I64 | DType::U64 => 8,
            DType::F16 | DType::BF16 | DType::I16 | DType::U16 => 2,
            DType::U8 | DType::I8 | DType::Bool => 1,
        }
    }

    /// Whether this is a floating-point type.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }

    /// Whether this is an integer type (bool excluded).
    pub fn is_int(self) -> bool {
        self.is_signed_int() || self.is_unsigned_int()
    }

    /// Whether this is a signed integer type.
    pub fn is_signed_int(self) -> bool {
        matches!(self, DType::I8 | DType::I16 | DType::I32 | DType::I64)
    }

    /// Whether this is an unsigned integer type (bool excluded).
    pub fn is_unsigned_int(self) -> bool {
        matches!(self, DType::U8 | DType::U16 | DType::U32 | DType::U64)
    }

    /// The short name used in IR text (`f32`, `bf16`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::U8 => "u8",
            DType::Bool => "bool",
            DType::I8 => "i8",
            DType::I16 => "i16",
            DType::U16 => "u16",
            DType::U32 => "u32",
            DType::U64 => "u64",
        }
    }

    /// Parses a short name (`f32`, `bf16`, ...).
    pub fn from_name(s: &str) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.name() == s)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A host element type: conversion to and from f64 and its [`DType`].
pub trait Element: Copy + Send + Sync + PartialOrd + Default + fmt::Debug + 'static {
    /// The dtype of this element type.
    const DTYPE: DType;
    /// Converts to f64 (bool: 0/1).
    fn to_f64(self) -> f64;
    /// Converts from f64 with Rust `as` semantics (saturating for integers; bool: != 0).
    fn from_f64(v: f64) -> Self;
    /// Converts to f32 (the compute type of f16/bf16 kernels).
    fn to_f32(self) -> f32;
    /// Converts from f32, rounding once.
    fn from_f32(v: f32) -> Self;
}

macro_rules! element_num {
    ($t:ty, $d:expr) => {
        impl Element for $t {
            const DTYPE: DType = $d;
            #[inline(always)]
            fn to_f64(self) -> f64 {
                self as f64
            }
            #[inline(always)]
            fn from_f64(v: f64) -> Self {
                v as $t
            }
            #[inline(always)]
            fn to_f32(self) -> f32 {
                self as f32
            }
            #[inline(always)]
            fn from_f32(v: f32) -> Self {
                v as $t
            }
        }
    };
}
element_num!(f32, DType::F32);
element_num!(f64, DType::F64);
element_num!(i32, DType::I32);
element_num!(i64, DType::I64);
element_num!(u8, DType::U8);
element_num!(i8, DType::I8);
element_num!(i16, DType::I16);
element_num!(u16, DType::U16);
element_num!(u32, DType::U32);
element_num!(u64, DType::U64);

impl Element for bool {
    const DTYPE: DType = DType::Bool;
    #[inline(always)]
    fn to_f64(self) -> f64 {
        self as u8 as f64
    }
    #[inline(always)]
    fn from_f64(v: f64) -> Self {
        v != 0.0
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self as u8 as f32
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v != 0.0
    }
}

macro_rules! element_half {
    ($t:ty, $d:expr) => {
        impl Element for $t {
            const DTYPE: DType = $d;
            #[inline(always)]
            fn to_f64(self) -> f64 {
                self.to_f64()
            }
            #[inline(always)]
            fn from_f64(v: f64) -> Self {
                <$t>::from_f64(v)
            }
            #[inline(always)]
            fn to_f32(self) -> f32 {
                self.to_f32()
            }
            #[inline(always)]
            fn from_f32(v: f32) -> Self {
                <$t>::from_f32(v)
            }
        }
    };
}
element_half!(f16, DType::F16);
element_half!(bf16, DType::BF16);

/// Host storage access for an element type (implemented for every [`Element`]).
pub trait HostElement: Element {
    /// Wraps a vector as typed storage.
    fn wrap(v: Vec<Self>) -> crate::Data;
    /// Wraps storage (owned or foreign) as typed storage.
    fn wrap_buf(b: crate::Buf<Self>) -> crate::Data;
    /// Views storage as this type, if it is this type.
    fn view(d: &crate::Data) -> Option<&[Self]>;
    /// Unwraps storage of this type.
    fn unwrap(d: crate::Data) -> Option<Vec<Self>>;
}

macro_rules! host_element {
    ($t:ty, $v:ident) => {
        impl HostElement for $t {
            fn wrap(v: Vec<Self>) -> crate::Data {
                crate::Data::$v(v.into())
            }
            fn wrap_buf(b: crate::Buf<Self>) -> crate::Data {
                crate::Data::$v(b)
            }
            fn view(d: &crate::Data) -> Option<&[Self]> {
                match d {
                    crate::Data::$v(v) => Some(v.as_slice()),
                    _ => None,
                }
            }
            fn unwrap(d: crate::Data) -> Option<Vec<Self>> {
                match d {
                    crate::Data::$v(v) => Some(v.into_vec()),
                    _ => None,
                }
            }
        }
    };
}
host_element!(f32, F32);
host_element!(f64, F64);
host_element!(f16, F16);
host_element!(bf16, BF16);
host_element!(i32, I32);
host_element!(i64, I64);
host_element!(u8, U8);
host_element!(bool, Bool);
host_element!(i8, I8);
host_element!(i16, I16);
host_element!(u16, U16);
host_element!(u32, U32);
host_element!(u64, U64);

#[cfg(test)]
mod tests {
    use super::DType;

    #[test]
    fn ints_lists_every_integer_dtype_once() {
        let mut want: Vec<DType> = DType::ALL.into_iter().filter(|d| d.is_int()).collect();
        let mut got = DType::INTS.to_vec();
        want.sort_by_key(|d| format!("{d:?}"));
        got.sort_by_key(|d| format!("{d:?}"));
        assert_eq!(got, want);
    }
}
