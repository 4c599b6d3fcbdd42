//! The CUDA C printer of the kernel IR: exhaustive over every expression and statement, with the
//! types of expressions inferred so that conversions, literals and intrinsics are chosen per type.
//! The printed source is self-contained (no headers): f16/bf16 conversions are PTX `cvt`
//! instructions in [`PRELUDE`].

use super::ir::{elem_bytes, BinFn, CTy, Expr, Kernel, Lit, Special, Stmt, UnFn};
use std::collections::HashMap;
use std::fmt::Write;

/// Device helpers every kernel module starts with: storage conversions for f16/bf16, Rust `as`
/// semantics for float→int casts, integer division that never traps, NaN-propagating max/min and
/// atomics for sub-word types.
pub const PRELUDE: &str = r#"// RustyTorch generated kernel. Do not edit: regenerated from the kernel IR.
typedef unsigned short rt_f16;
typedef unsigned short rt_bf16;
template <typename T, int N> struct alignas(sizeof(T) * N) rt_vec { T v[N]; };
__device__ __forceinline__ float rt_tanh_approx(float x) { float y; asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }
__device__ __forceinline__ float rt_h2f(rt_f16 h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
__device__ __forceinline__ rt_f16 rt_f2h(float f) { rt_f16 h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
__device__ __forceinline__ rt_f16 rt_d2h(double d) { rt_f16 h; asm("cvt.rn.f16.f64 %0, %1;" : "=h"(h) : "d"(d)); return h; }
__device__ __forceinline__ float rt_bf2f(rt_bf16 h) { return __uint_as_float(((unsigned)h) << 16); }
__device__ __forceinline__ rt_bf16 rt_f2bf(float f) { rt_bf16 h; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
__device__ __forceinline__ float rt_round_f16(float f) { return rt_h2f(rt_f2h(f)); }
__device__ __forceinline__ float rt_round_bf16(float f) { return rt_bf2f(rt_f2bf(f)); }
__device__ __forceinline__ float rt_round_f16_d(double d) { return rt_h2f(rt_d2h(d)); }
__device__ __forceinline__ float rt_round_bf16_d(double d) { return rt_bf2f(rt_f2bf((float)d)); }
template <typename T> __device__ __forceinline__ T rt_max(T a, T b) { return (a != a) ? a : ((b != b) ? b : (a > b ? a : b)); }
template <typename T> __device__ __forceinline__ T rt_min(T a, T b) { return (a != a) ? a : ((b != b) ? b : (a < b ? a : b)); }
template <typename T> __device__ __forceinline__ T rt_idiv(T a, T b) { return b == 0 ? (T)0 : (b == (T)-1 ? (T)(0 - (unsigned long long)a) : a / b); }
template <typename T> __device__ __forceinline__ T rt_irem(T a, T b) { return b == 0 ? (T)0 : (b == (T)-1 ? (T)0 : a % b); }
template <typename T> __device__ __forceinline__ T rt_iabs(T a) { return a < 0 ? (T)(0 - (unsigned long long)a) : a; }
template <typename T> __device__ __forceinline__ T rt_ipow(T a, T b) {
  if (b < 0) { return a == 1 ? (T)1 : (a == (T)-1 ? ((b & 1) ? (T)-1 : (T)1) : (T)0); }
  unsigned long long r = 1, x = (unsigned long long)a;
  while (b > 0) { if (b & 1) r *= x; x *= x; b >>= 1; }
  return (T)r;
}
template <typename F> __device__ __forceinline__ long long rt_f2i64(F x) { return x != x ? 0LL : (long long)x; }
template <typename F> __device__ __forceinline__ int rt_f2i32(F x) { return x != x ? 0 : (int)x; }
template <typename F> __device__ __forceinline__ unsigned char rt_f2u8(F x) { return x != x ? 0 : (x <= (F)0 ? 0 : (x >= (F)255 ? 255 : (unsigned char)x)); }
__device__ __forceinline__ void rt_atomic_add_f16(rt_f16* p, float v) {
  unsigned* w = (unsigned*)((unsigned long long)p & ~3ull); unsigned sh = ((unsigned long long)p & 2ull) * 8u;
  unsigned old = *w, assumed;
  do { assumed = old; rt_f16 h = (rt_f16)((assumed >> sh) & 0xffffu); rt_f16 n = rt_f2h(rt_h2f(h) + v);
       old = atomicCAS(w, assumed, (assumed & ~(0xffffu << sh)) | ((unsigned)n << sh)); } while (assumed != old);
}
__device__ __forceinline__ void rt_atomic_add_bf16(rt_bf16* p, float v) {
  unsigned* w = (unsigned*)((unsigned long long)p & ~3ull); unsigned sh = ((unsigned long long)p & 2ull) * 8u;
  unsigned old = *w, assumed;
  do { assumed = old; rt_bf16 h = (rt_bf16)((assumed >> sh) & 0xffffu); rt_bf16 n = rt_f2bf(rt_bf2f(h) + v);
       old = atomicCAS(w, assumed, (assumed & ~(0xffffu << sh)) | ((unsigned)n << sh)); } while (assumed != old);
}
__device__ __forceinline__ void rt_atomic_add_u8(unsigned char* p, unsigned v) {
  unsigned* w = (unsigned*)((unsigned long long)p & ~3ull); unsigned sh = ((unsigned long long)p & 3ull) * 8u;
  unsigned old = *w, assumed;
  do { assumed = old; unsigned b = ((assumed >> sh) + v) & 0xffu;
       old = atomicCAS(w, assumed, (assumed & ~(0xffu << sh)) | (b << sh)); } while (assumed != old);
}
"#;

/// The C spelling of a storage or compute type.
pub fn c_type(t: CTy) -> &'static str {
    match t {
        CTy::F32 => "float",
        CTy::F64 => "double",
        CTy::F16 => "rt_f16",
        CTy::BF16 => "rt_bf16",
        CTy::I32 => "int",
        CTy::I64 => "long long",
        CTy::U32 => "unsigned",
        CTy::U64 => "unsigned long long",
        CTy::U8 => "unsigned char",
        CTy::Bool => "bool",
        CTy::I8 => "signed char",
        CTy::I16 => "short",
        CTy::U16 => "unsigned short",
    }
}

/// Errors of printing (an ill-typed kernel).
#[derive(Debug, thiserror::Error)]
#[error("kernel `{kernel}`: {msg}")]
pub struct EmitError {
    /// The kernel's name.
    pub kernel: String,
    /// What is wrong.
    pub msg: String,
}

struct Printer<'k> {
    kernel: &'k Kernel,
    out: String,
    /// Scopes of variable types.
    scopes: Vec<HashMap<String, CTy>>,
    bufs: HashMap<String, CTy>,
    /// Vector temporaries printed so far (their names are `rt_v1`, `rt_v2`, ...).
    vectors: usize,
}

/// A loaded storage element `raw` of type `elem` as its compute type.
fn widen(elem: CTy, raw: String) -> String {
    match elem {
        CTy::F16 => format!("rt_h2f({raw})"),
        CTy::BF16 => format!("rt_bf2f({raw})"),
        _ => raw,
    }
}

/// Prints a whole module (prelude + kernel).
pub fn emit(k: &Kernel) -> Result<String, EmitError> {
    let mut s = String::from(PRELUDE);
    s.push_str(&emit_kernel(k)?);
    Ok(s)
}

/// Prints one kernel function (no prelude).
pub fn emit_kernel(k: &Kernel) -> Result<String, EmitError> {
    let mut p = Printer {
        kernel: k,
        out: String::new(),
        scopes: vec![HashMap::new()],
        bufs: k.params.iter().map(|p| (p.name.clone(), p.elem)).collect(),
        vectors: 0,
    };
    let params: Vec<String> = k
        .params
        .iter()
        .map(|q| match q.map {
            Some(_) => format!("const __grid_constant__ RtTensorMap {}", q.name),
            None => format!(
                "{}{}* __restrict__ {}",
                if q.writes { "" } else { "const " },
                c_type(q.elem),
                q.name
            ),
        })
        .collect();
    if k.params.iter().any(|q| q.map.is_some()) {
        // The opaque tensor map a bulk tensor copy reads (CUtensorMap: 128 bytes, 64-aligned).
        p.out.push_str(TENSOR_MAP);
    }
    let _ = writeln!(
        p.out,
        "extern \"C\" __global__ void __launch_bounds__({}) {}({}) {{",
        k.block,
        k.name,
        params.join(", ")
    );
    p.stmts(&k.body, 1)?;
    p.out.push_str("}\n");
    Ok(p.out)
}

/// The tensor-map parameter type, defined once per module.
const TENSOR_MAP: &str = "#ifndef RT_TENSOR_MAP\n#define RT_TENSOR_MAP\nstruct __align__(64) RtTensorMap { unsigned long long v[16]; };\n#endif\n";

fn float_lit(v: f64, t: CTy) -> String {
    match t {
        CTy::F64 => {
            if v.is_nan() {
                "__longlong_as_double(0x7ff8000000000000LL)".into()
            } else if v.is_infinite() {
                if v > 0.0 {
                    "__longlong_as_double(0x7ff0000000000000LL)".into()
                } else {
                    "__longlong_as_double(0xfff0000000000000LL)".into()
                }
            } else {
                format!("{v:e}")
            }
        }
        _ => {
            let f = v as f32;
            if f.is_nan() {
                "__int_as_float(0x7fc00000)".into()
            } else if f.is_infinite() {
                if f > 0.0 {
                    "__int_as_float(0x7f800000)".into()
                } else {
                    "__int_as_float(0xff800000)".into()
                }
            } else {
                format!("{f:e}f")
            }
        }
    }
}

fn int_lit(v: i64, t: CTy) -> String {
    match t {
        CTy::I64 => {
            if v == i64::MIN {
                "(-9223372036854775807LL - 1)".into()
            } else if v < 0 {
                format!("({v}LL)")
            } else {
                format!("{v}LL")
            }
        }
        CTy::I32 => {
            if v == i32::MIN as i64 {
                "(-2147483647 - 1)".into()
            } else if v < 0 {
                format!("({v})")
            } else {
                format!("{v}")
            }
        }
        CTy::U32 => format!("{}u", v as u32),
        CTy::U64 => format!("{}ull", v as u64),
        CTy::U8 => format!("((unsigned char){})", v as u8),
        CTy::I8 => format!("((signed char)({}))", v as i8),
        CTy::I16 => format!("((short)({}))", v as i16),
        CTy::U16 => format!("((unsigned short){})", v as u16),
        CTy::Bool => (if v != 0 { "true" } else { "false" }).into(),
        CTy::F32 | CTy::F64 | CTy::F16 | CTy::BF16 => float_lit(v as f64, t),
    }
}

fn wider(a: CTy, b: CTy) -> CTy {
    let rank = |t: CTy| match t {
        CTy::Bool => 0,
        CTy::U8 | CTy::I8 | CTy::I16 | CTy::U16 => 1,
        CTy::I32 => 2,
        CTy::U32 => 3,
        CTy::I64 => 4,
        CTy::U64 => 5,
        CTy::F16 | CTy::BF16 | CTy::F32 => 6,
        CTy::F64 => 7,
    };
    if rank(a) >= rank(b) {
        a
    } else {
        b
    }
}

impl Printer<'_> {
    fn err<T>(&self, msg: String) -> Result<T, EmitError> {
        Err(EmitError {
            kernel: self.kernel.name.clone(),
            msg,
        })
    }

    fn lookup(&self, n: &str) -> Option<CTy> {
        self.scopes.iter().rev().find_map(|s| s.get(n).copied())
    }

    /// The compute type of an expression.
    fn ty(&self, e: &Expr) -> Result<CTy, EmitError> {
        Ok(match e {
            Expr::Var(n) => match self.lookup(n) {
                Some(t) => t,
                None => return self.err(format!("unknown variable `{n}`")),
            },
            Expr::Lit(Lit::Float(_, t)) => t.compute_of(),
            Expr::Lit(Lit::Int(_, t)) => *t,
            Expr::Lit(Lit::Bool(_)) => CTy::Bool,
            Expr::Special(_) => CTy::U32,
            Expr::Un(f, a) => match f {
                UnFn::Not | UnFn::IsNan | UnFn::IsInf | UnFn::IsFinite => CTy::Bool,
                _ => self.ty(a)?,
            },
            Expr::Bin(f, a, b) => match f {
                BinFn::Lt
                | BinFn::Le
                | BinFn::Gt
                | BinFn::Ge
                | BinFn::Eq
                | BinFn::Ne
                | BinFn::And
                | BinFn::Or => CTy::Bool,
                BinFn::ShflXor => self.ty(a)?,
                _ => wider(self.ty(a)?, self.ty(b)?),
            },
            Expr::Select(_, a, b) => wider(self.ty(a)?, self.ty(b)?),
            Expr::Cast(t, _) => t.compute_of(),
            Expr::Load { elem, .. } => elem.compute_of(),
        })
    }

    fn expr(&self, e: &Expr) -> Result<String, EmitError> {
        Ok(match e {
            Expr::Var(n) => {
                if self.lookup(n).is_none() {
                    return self.err(format!("unknown variable `{n}`"));
                }
                n.clone()
            }
            Expr::Lit(Lit::Float(v, t)) => float_lit(*v, *t),
            Expr::Lit(Lit::Int(v, t)) => int_lit(*v, *t),
            Expr::Lit(Lit::Bool(b)) => (if *b { "true" } else { "false" }).into(),
            Expr::Special(s) => match s {
                Special::ThreadIdx => "threadIdx.x",
                Special::BlockIdx => "blockIdx.x",
                Special::BlockDim => "blockDim.x",
                Special::GridDim => "gridDim.x",
            }
            .into(),
            Expr::Un(f, a) => self.unary(*f, a)?,
            Expr::Bin(f, a, b) => self.binary(*f, a, b)?,
            Expr::Select(c, a, b) => {
                let t = self.ty(e)?;
                format!(
                    "({} ? ({})({}) : ({})({}))",
                    self.expr(c)?,
                    c_type(t),
                    self.expr(a)?,
                    c_type(t),
                    self.expr(b)?
                )
            }
            Expr::Cast(t, a) => self.cast(*t, a)?,
            Expr::Load { buf, elem, index } => {
                match self.bufs.get(buf) {
                    Some(b) if b == elem => {}
                    Some(b) => {
                        return self.err(format!("load of `{buf}` as {elem:?}, declared {b:?}"))
                    }
                    None => return self.err(format!("unknown buffer `{buf}`")),
                }
                widen(*elem, format!("{buf}[{}]", self.expr(index)?))
            }
        })
    }

    fn unary(&self, f: UnFn, a: &Expr) -> Result<String, EmitError> {
        let t = self.ty(a)?;
        let x = self.expr(a)?;
        let f32_ = t != CTy::F64;
        let fl =
            |f32name: &str, f64name: &str| format!("{}({x})", if f32_ { f32name } else { f64name });
        Ok(match f {
            UnFn::Neg => format!("(-{x})"),
            UnFn::Not => format!("(!{x})"),
            UnFn::Abs => {
                if t.is_float() {
                    fl("fabsf", "fabs")
                } else if matches!(t, CTy::U8 | CTy::U32 | CTy::U64 | CTy::Bool) {
                    x
                } else {
                    format!("rt_iabs({x})")
                }
            }
            UnFn::Exp => fl("expf", "exp"),
            UnFn::Log => fl("logf", "log"),
            UnFn::Sqrt => fl("sqrtf", "sqrt"),
            UnFn::Rsqrt => {
                if f32_ {
                    format!("(1.0f / sqrtf({x}))")
                } else {
                    format!("(1.0 / sqrt({x}))")
                }
            }
            UnFn::Sin => fl("sinf", "sin"),
            UnFn::Cos => fl("cosf", "cos"),
            UnFn::Tanh => fl("tanhf", "tanh"),
            UnFn::Erf => fl("erff", "erf"),
            UnFn::Erfc => fl("erfcf", "erfc"),
            UnFn::ExpApprox => fl("__expf", "exp"),
            UnFn::TanhApprox => fl("rt_tanh_approx", "tanh"),
            UnFn::Recip => {
                if f32_ {
                    format!("__frcp_rn({x})")
                } else {
                    format!("(1.0 / {x})")
                }
            }
            UnFn::Floor => fl("floorf", "floor"),
            UnFn::Ceil => fl("ceilf", "ceil"),
            UnFn::Rint => fl("rintf", "rint"),
            UnFn::IsNan => {
                if t.is_float() {
                    format!("isnan({x})")
                } else {
                    "false".into()
                }
            }
            UnFn::IsInf => {
                if t.is_float() {
                    format!("isinf({x})")
                } else {
                    "false".into()
                }
            }
            UnFn::IsFinite => {
                if t.is_float() {
                    format!("isfinite({x})")
                } else {
                    "true".into()
                }
            }
        })
    }

    fn binary(&self, f: BinFn, a: &Expr, b: &Expr) -> Result<String, EmitError> {
        let t = wider(self.ty(a)?, self.ty(b)?);
        let (x, y) = (self.expr(a)?, self.expr(b)?);
        let op = |o: &str| format!("({x} {o} {y})");
        let positive_lit = matches!(b, Expr::Lit(Lit::Int(v, _)) if *v > 0);
        Ok(match f {
            BinFn::Add => op("+"),
            BinFn::Sub => op("-"),
            BinFn::Mul => op("*"),
            BinFn::Div => {
                if t.is_float() || positive_lit || t == CTy::Bool {
                    op("/")
                } else {
                    format!("rt_idiv<{}>({x}, {y})", c_type(t))
                }
            }
            BinFn::Rem => {
                if positive_lit {
                    op("%")
                } else if t.is_float() {
                    format!("{}({x}, {y})", if t == CTy::F64 { "fmod" } else { "fmodf" })
                } else {
                    format!("rt_irem<{}>({x}, {y})", c_type(t))
                }
            }
            BinFn::Lt => op("<"),
            BinFn::Le => op("<="),
            BinFn::Gt => op(">"),
            BinFn::Ge => op(">="),
            BinFn::Eq => op("=="),
            BinFn::Ne => op("!="),
            BinFn::And => op("&&"),
            BinFn::Or => op("||"),
            BinFn::Pow => match t {
                CTy::F64 => format!("pow({x}, {y})"),
                t if t.is_float() => format!("powf({x}, {y})"),
                t => format!("rt_ipow<{}>({x}, {y})", c_type(t)),
            },
            BinFn::Max => format!("rt_max<{}>({x}, {y})", c_type(t)),
            BinFn::Min => format!("rt_min<{}>({x}, {y})", c_type(t)),
            BinFn::ShflXor => format!("__shfl_xor_sync(0xffffffffu, {x}, {y})"),
        })
    }

    fn cast(&self, to: CTy, a: &Expr) -> Result<String, EmitError> {
        let from = self.ty(a)?;
        let x = self.expr(a)?;
        Ok(match to {
            CTy::F16 => match from {
                CTy::F64 => format!("rt_round_f16_d({x})"),
                _ => format!("rt_round_f16((float)({x}))"),
            },
            CTy::BF16 => match from {
                CTy::F64 => format!("rt_round_bf16_d({x})"),
                _ => format!("rt_round_bf16((float)({x}))"),
            },
            CTy::Bool => {
                if from == CTy::Bool {
                    x
                } else {
                    format!("(({x}) != 0)")
                }
            }
            CTy::I64 if from.is_float() => format!("rt_f2i64({x})"),
            CTy::I32 if from.is_float() => format!("rt_f2i32({x})"),
            CTy::U8 if from.is_float() => format!("rt_f2u8({x})"),
            t => format!("(({})({x}))", c_type(t)),
        })
    }

    fn line(&mut self, depth: usize, s: &str) {
        for _ in 0..depth {
            self.out.push_str("  ");
        }
        self.out.push_str(s);
        self.out.push('\n');
    }

    fn store_value(&self, elem: CTy, value: &Expr) -> Result<String, EmitError> {
        let v = self.expr(value)?;
        Ok(match elem {
            CTy::F16 => {
                if self.ty(value)? == CTy::F64 {
                    format!("rt_d2h({v})")
                } else {
                    format!("rt_f2h({v})")
                }
            }
            CTy::BF16 => format!("rt_f2bf((float)({v}))"),
            t => {
                if self.ty(value)? == t {
                    v
                } else {
                    self.cast(t, value)?
                }
            }
        })
    }

    /// The `rt_vec` type of a vector access of `n` elements of `elem`: a power of two, 2 to 16
    /// bytes in all.
    fn vector_type(&self, elem: CTy, n: usize) -> Result<String, EmitError> {
        let bytes = n * elem_bytes(elem);
        if !n.is_power_of_two() || !(2..=16).contains(&bytes) {
            return self.err(format!("a vector access of {n} × {elem:?} ({bytes} bytes)"));
        }
        Ok(format!("rt_vec<{}, {n}>", c_type(elem)))
    }

    fn fresh_vector(&mut self) -> String {
        self.vectors += 1;
        format!("rt_v{}", self.vectors)
    }

    fn check_buf(&self, buf: &str, elem: CTy) -> Result<(), EmitError> {
        match self.bufs.get(buf) {
            Some(b) if *b == elem => Ok(()),
            Some(b) => self.err(format!("`{buf}` used as {elem:?}, declared {b:?}")),
            None => self.err(format!("unknown buffer `{buf}`")),
        }
    }

    fn stmts(&mut self, body: &[Stmt], depth: usize) -> Result<(), EmitError> {
        for s in body {
            match s {
                Stmt::Let { name, ty, init } => {
                    let v = if self.ty(init)? == *ty {
                        self.expr(init)?
                    } else {
                        self.cast(*ty, init)?
                    };
                    let l = format!("{} {name} = {v};", c_type(ty.compute_of()));
                    self.line(depth, &l);
                    self.scopes
                        .last_mut()
                        .expect("a scope")
                        .insert(name.clone(), ty.compute_of());
                }
                Stmt::Assign { name, value } => {
                    let Some(t) = self.lookup(name) else {
                        return self.err(format!("assignment to unknown `{name}`"));
                    };
                    let v = if self.ty(value)? == t {
                        self.expr(value)?
                    } else {
                        self.cast(t, value)?
                    };
                    let l = format!("{name} = {v};");
                    self.line(depth, &l);
                }
                Stmt::Store {
                    buf,
                    elem,
                    index,
                    value,
                } => {
                    self.check_buf(buf, *elem)?;
                    let l = format!(
                        "{buf}[{}] = {};",
                        self.expr(index)?,
                        self.store_value(*elem, value)?
                    );
                    self.line(depth, &l);
                }
                Stmt::LoadVec {
                    buf,
                    elem,
                    index,
                    names,
                } => {
                    self.check_buf(buf, *elem)?;
                    let vt = self.vector_type(*elem, names.len())?;
                    let t = self.fresh_vector();
                    let l = format!(
                        "const {vt} {t} = *reinterpret_cast<const {vt}*>(&{buf}[{}]);",
                        self.expr(index)?
                    );
                    self.line(depth, &l);
                    for (k, name) in names.iter().enumerate() {
                        let v = widen(*elem, format!("{t}.v[{k}]"));
                        let l = format!("{} {name} = {v};", c_type(elem.compute_of()));
                        self.line(depth, &l);
                        self.scopes
                            .last_mut()
                            .expect("a scope")
                            .insert(name.clone(), elem.compute_of());
                    }
                }
                Stmt::StoreVec {
                    buf,
                    elem,
                    index,
                    values,
                } => {
                    self.check_buf(buf, *elem)?;
                    let vt = self.vector_type(*elem, values.len())?;
                    let t = self.fresh_vector();
                    self.line(depth, &format!("{vt} {t};"));
                    for (k, v) in values.iter().enumerate() {
                        let l = format!("{t}.v[{k}] = {};", self.store_value(*elem, v)?);
                        self.line(depth, &l);
                    }
                    let l = format!(
                        "*reinterpret_cast<{vt}*>(&{buf}[{}]) = {t};",
                        self.expr(index)?
                    );
                    self.line(depth, &l);
                }
                Stmt::AtomicAdd {
                    buf,
                    elem,
                    index,
                    value,
                } => {
                    self.check_buf(buf, *elem)?;
                    let i = self.expr(index)?;
                    let l = match elem {
                        CTy::F32 => format!("atomicAdd(&{buf}[{i}], (float)({}));", self.expr(value)?),
                        CTy::F64 => {
                            format!("atomicAdd(&{buf}[{i}], (double)({}));", self.expr(value)?)
                        }
                        CTy::I32 | CTy::U32 => {
                            format!("atomicAdd(&{buf}[{i}], ({})({}));", c_type(*elem), self.expr(value)?)
                        }
                        CTy::I64 | CTy::U64 => format!(
                            "atomicAdd((unsigned long long*)&{buf}[{i}], (unsigned long long)({}));",
                            self.expr(value)?
                        ),
                        CTy::F16 => {
                            format!("rt_atomic_add_f16(&{buf}[{i}], (float)({}));", self.expr(value)?)
                        }
                        CTy::BF16 => {
                            format!("rt_atomic_add_bf16(&{buf}[{i}], (float)({}));", self.expr(value)?)
                        }
                        CTy::U8 => format!(
                            "rt_atomic_add_u8(&{buf}[{i}], (unsigned)({}));",
                            self.expr(value)?
                        ),
                        CTy::Bool => {
                            // Adding bools is `or`; a racing plain store of `true` is benign.
                            format!("if ({}) {{ {buf}[{i}] = true; }}", self.expr(value)?)
                        }
                        CTy::I8 | CTy::I16 | CTy::U16 => {
                            return self.err(format!("no atomic add to {elem:?} storage"))
                        }
                    };
                    self.line(depth, &l);
                }
                Stmt::For {
                    var,
                    start,
                    end,
                    step,
                    body,
                } => {
                    let l = format!(
                        "for (long long {var} = {}; {var} < {}; {var} += {}) {{",
                        self.expr(start)?,
                        self.expr(end)?,
                        self.expr(step)?
                    );
                    self.line(depth, &l);
                    let mut scope = HashMap::new();
                    scope.insert(var.clone(), CTy::I64);
                    self.scopes.push(scope);
                    self.stmts(body, depth + 1)?;
                    self.scopes.pop();
                    self.line(depth, "}");
                }
                Stmt::If { cond, then, els } => {
                    let l = format!("if ({}) {{", self.expr(cond)?);
                    self.line(depth, &l);
                    self.scopes.push(HashMap::new());
                    self.stmts(then, depth + 1)?;
                    self.scopes.pop();
                    if !els.is_empty() {
                        self.line(depth, "} else {");
                        self.scopes.push(HashMap::new());
                        self.stmts(els, depth + 1)?;
                        self.scopes.pop();
                    }
                    self.line(depth, "}");
                }
                Stmt::Shared { name, elem, len } => {
                    let l = format!("__shared__ {} {name}[{len}];", c_type(*elem));
                    self.line(depth, &l);
                    self.bufs.insert(name.clone(), *elem);
                }
                Stmt::SyncThreads => self.line(depth, "__syncthreads();"),
                Stmt::Return => self.line(depth, "return;"),
                Stmt::Verbatim(text) => {
                    for l in text.lines() {
                        self.line(depth, l);
                    }
                }
            }
        }
        Ok(())
    }
}
