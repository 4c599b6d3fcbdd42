//! A CPU interpreter of the kernel IR, for testing kernel templates numerically without a GPU.
//!
//! A kernel runs block by block; the threads of a block run in SIMT lockstep, statement by
//! statement, under an active mask: `if` splits the mask, a `for` loop runs while any active
//! thread's condition holds, `return` retires threads for the rest of the kernel. Expressions are
//! evaluated for all active threads of the block at once (so a warp shuffle sees the values of
//! its whole warp), and a store or atomic takes effect for the active threads in thread order.
//!
//! The values and conversions follow what [`super::emit`] prints, as the CUDA compiler would
//! type it: C++ integer promotion and the usual arithmetic conversions, the prelude's helpers
//! (`rt_idiv`, `rt_irem`, `rt_ipow`, `rt_max`, `rt_min`, saturating float→int casts),
//! round-to-nearest-even f16/bf16 conversions, f32 math in f32 and f64 math in f64.
//!
//! What would be undefined or fatal on a GPU is an error naming the kernel: an access out of the
//! bounds of a buffer, a store to a read-only parameter, a shuffle with an inactive lane, a
//! `__syncthreads` reached by only part of the live threads of a block.

use super::ir::{add, elem_bytes, i64c, load, BinFn, CTy, Expr, Kernel, Lit, Special, Stmt, UnFn};
use super::{ArgRef, CudaStep, StepKernels};
use crate::CodegenError;
use rustytorch_ops::{bf16, f16, DType, Data, HostTensor, TensorType};
use std::borrow::Cow;
use std::collections::HashMap;

/// The byte every output, scratch and shared buffer starts filled with, so that elements a kernel
/// forgets to write stand out.
pub const POISON: u8 = 0xA5;

const WARP: u32 = 32;
const MAX_BLOCK: u32 = 1024;
const MAX_SHARED_BYTES: usize = 48 * 1024;

/// Errors of interpreting a kernel.
#[derive(Debug, thiserror::Error)]
pub enum InterpError {
    /// The kernel is ill-formed or cannot be launched with the given arguments.
    #[error("kernel `{kernel}`: {msg}")]
    Invalid {
        /// The kernel's name.
        kernel: String,
        /// What is wrong.
        msg: String,
    },
    /// A thread accessed a buffer out of its bounds.
    #[error(
        "kernel `{kernel}`: block {block}, thread {thread}: {access} `{buf}`[{index}] is out of \
         bounds ({len} elements)"
    )]
    OutOfBounds {
        /// The kernel's name.
        kernel: String,
        /// `load of`, `store to` or `atomic add to`.
        access: &'static str,
        /// The buffer.
        buf: String,
        /// The element index.
        index: i128,
        /// The buffer's length in elements.
        len: usize,
        /// The block.
        block: u32,
        /// The thread in the block.
        thread: u32,
    },
    /// A thread did something undefined on a GPU (a shuffle with an inactive lane, a barrier in
    /// divergent code, a read of an unset variable).
    #[error("kernel `{kernel}`: block {block}, thread {thread}: {msg}")]
    Fault {
        /// The kernel's name.
        kernel: String,
        /// The block.
        block: u32,
        /// The thread in the block.
        thread: u32,
        /// What happened.
        msg: String,
    },
}

impl From<InterpError> for CodegenError {
    fn from(e: InterpError) -> Self {
        CodegenError::Invalid(e.to_string())
    }
}

type Result<T, E = InterpError> = std::result::Result<T, E>;

/// The generated kernels of `step` that [`run_step`] can run: a kernel step's, or the flash half
/// of an attention step (its cuDNN half is a library call); `None` for other library calls.
pub fn host_kernels(step: &CudaStep) -> Option<&StepKernels> {
    match step {
        CudaStep::Kernels(k) | CudaStep::Attention { flash: k, .. } => Some(k),
        _ => None,
    }
}

/// Runs the launches of one step on the host, as a GPU would: `inputs` bind to
/// [`ArgRef::Input`]`(i)`, the output buffer (of type `out`) to [`ArgRef::Output`], a scratch
/// buffer of `step.scratch_bytes` bytes to [`ArgRef::Scratch`] (and each [`ArgRef::ScratchAt`]
/// offset to a region of its own, from there to the end). The output and scratch buffers
/// start filled with [`POISON`] bytes so that elements a kernel forgets to write show up; when
/// `out_init` is `Some`, the output starts as a copy of that tensor instead. A bool output byte
/// other than 0 or 1 (one no kernel wrote) is an error.
pub fn run_step(
    step: &StepKernels,
    inputs: &[&HostTensor],
    out: &TensorType,
    out_init: Option<&HostTensor>,
) -> Result<HostTensor, InterpError> {
    let last_name = || {
        step.launches
            .last()
            .map_or_else(|| "<none>".to_string(), |l| l.kernel.name.clone())
    };
    let step_err = |msg: String| InterpError::Invalid {
        kernel: last_name(),
        msg,
    };
    let mut bufs: Vec<Vec<u8>> = inputs.iter().map(|t| to_bytes(t.data())).collect();
    let out_bytes = match out_init {
        Some(t) => {
            if t.dtype() != out.dtype || t.shape() != &out.shape {
                return Err(step_err(format!(
                    "initial output is {} {}, the step's output is {} {}",
                    t.dtype(),
                    t.shape(),
                    out.dtype,
                    out.shape
                )));
            }
            to_bytes(t.data())
        }
        None => vec![POISON; out.shape.numel() * out.dtype.size_bytes()],
    };
    let (out_buf, scratch_buf) = (bufs.len(), bufs.len() + 1);
    bufs.push(out_bytes);
    bufs.push(vec![POISON; step.scratch_bytes]);
    let mut regions = std::collections::HashMap::new();
    for launch in &step.launches {
        let k = &launch.kernel;
        if launch.args.len() != k.params.len() {
            return Err(invalid(
                k,
                format!(
                    "{} arguments bound for {} parameters",
                    launch.args.len(),
                    k.params.len()
                ),
            ));
        }
        let mut map = Vec::with_capacity(k.params.len());
        for (p, a) in k.params.iter().zip(&launch.args) {
            let (buf, want) = match *a {
                ArgRef::Input(i) => {
                    let Some(t) = inputs.get(i) else {
                        return Err(invalid(
                            k,
                            format!(
                                "parameter `{}` binds input {i} of a step with {} inputs",
                                p.name,
                                inputs.len()
                            ),
                        ));
                    };
                    (i, Some(t.dtype()))
                }
                ArgRef::Output => (out_buf, Some(out.dtype)),
                ArgRef::With(_) | ArgRef::Value(_) => {
                    return Err(invalid(
                        k,
                        format!(
                            "parameter `{}` binds a sibling's result; steps of one result only \
                             are interpreted",
                            p.name
                        ),
                    ))
                }
                ArgRef::Scratch | ArgRef::ScratchAt(0) => (scratch_buf, None),
                // Each offset is a region of its own from there to the scratch's end: steps
                // place disjoint values at distinct offsets (a kernel reaching past its region
                // into the next is not modelled).
                ArgRef::ScratchAt(off) => {
                    let Some(len) = step.scratch_bytes.checked_sub(off) else {
                        return Err(invalid(
                            k,
                            format!(
                                "parameter `{}` binds scratch offset {off} of a {}-byte scratch",
                                p.name, step.scratch_bytes
                            ),
                        ));
                    };
                    let at = *regions.entry(off).or_insert_with(|| {
                        bufs.push(vec![POISON; len]);
                        bufs.len() - 1
                    });
                    (at, None)
                }
            };
            if let Some(d) = want {
                if CTy::storage(d) != p.elem {
                    return Err(invalid(
                        k,
                        format!(
                            "parameter `{}` of {:?} elements binds {a:?}, a {d} tensor",
                            p.name, p.elem
                        ),
                    ));
                }
            }
            map.push(buf);
        }
        let prog = compile(k)?;
        execute(&prog, launch.grid, &mut bufs, &map)?;
    }
    let bytes = std::mem::take(&mut bufs[out_buf]);
    let data = from_bytes(&bytes, out.dtype).map_err(|i| {
        step_err(format!(
            "bool output element {i} was never written (byte {:#04x})",
            bytes[i]
        ))
    })?;
    HostTensor::from_data(data, out.shape.clone()).map_err(|e| step_err(e.to_string()))
}

/// Runs a whole lowered plan on the host: every generated-kernel step through the interpreter
/// over one buffer per plan value (so a multi-tensor launch's [`ArgRef::Value`] arguments bind
/// where its members' would), every library call and sibling through the CPU kernel of its op,
/// and reshapes as copies. Values computed by steps start as [`POISON`] bytes. Returns every
/// value of the plan (`None` for those no step computed). Placement in the arena is not
/// modelled: each value has bytes of its own.
pub fn run_plan(
    plan: &crate::Plan,
    steps: &[CudaStep],
    inputs: &[HostTensor],
    params: &[HostTensor],
) -> Result<Vec<Option<HostTensor>>> {
    let err = |what: &str, msg: String| InterpError::Invalid {
        kernel: what.to_string(),
        msg,
    };
    let mut bufs: Vec<Option<Vec<u8>>> = plan
        .sources
        .iter()
        .map(|src| match src {
            crate::Source::Input(i) => inputs.get(*i).map(|t| to_bytes(t.data())),
            crate::Source::Param(i) => params.get(*i).map(|t| to_bytes(t.data())),
            crate::Source::Const(t) => Some(to_bytes(t.data())),
            crate::Source::Step(_) => None,
        })
        .collect();
    let tensor = |bufs: &[Option<Vec<u8>>], v: usize| -> Result<HostTensor> {
        let ty = &plan.types[v];
        let b = bufs[v]
            .as_ref()
            .ok_or_else(|| err("plan", format!("value {v} is read before it is computed")))?;
        let data = from_bytes(b, ty.dtype).map_err(|i| {
            err(
                "plan",
                format!("value {v}: bool byte {i} was never written"),
            )
        })?;
        HostTensor::from_data(data, ty.shape.clone()).map_err(|e| err("plan", e.to_string()))
    };
    for (i, (s, cs)) in plan.steps.iter().zip(steps).enumerate() {
        let plain = |k: &StepKernels| {
            k.launches
                .iter()
                .all(|l| l.args.iter().all(|a| !matches!(a, ArgRef::With(_))))
        };
        match cs {
            CudaStep::Alias => bufs[s.output] = bufs[s.inputs[0]].clone(),
            CudaStep::Merged(f) => {
                if bufs[s.output].is_none() {
                    return Err(err(
                        "plan",
                        format!("step {i}: the launch of step {f} did not compute its result"),
                    ));
                }
            }
            CudaStep::Kernels(k) if plain(k) => {
                // A reshape's bytes are its operand's, whether or not its own (copying) step
                // ran yet.
                let root = |mut v: usize| {
                    while let crate::Storage::Alias(of) = plan.storage[v] {
                        v = of;
                    }
                    v
                };
                // The step's scratch: each offset a region of its own to the end (as in
                // `run_step`), kept from one launch to the next.
                let mut scratch: HashMap<usize, Vec<u8>> = HashMap::new();
                for l in &k.launches {
                    #[derive(PartialEq)]
                    enum Buf {
                        Value(usize),
                        Scratch(usize),
                    }
                    let mut taken: Vec<Buf> = vec![];
                    let mut local: Vec<Vec<u8>> = vec![];
                    let mut map = Vec::with_capacity(l.args.len());
                    for a in &l.args {
                        let b = match *a {
                            ArgRef::Input(j) => Buf::Value(root(s.inputs[j])),
                            ArgRef::Output => Buf::Value(root(s.output)),
                            ArgRef::Value(v) => Buf::Value(root(v)),
                            ArgRef::ScratchAt(off) => Buf::Scratch(off),
                            _ => Buf::Scratch(0),
                        };
                        if let Some(p) = taken.iter().position(|t| *t == b) {
                            map.push(p);
                            continue;
                        }
                        local.push(match b {
                            Buf::Value(v) => bufs[v]
                                .take()
                                .unwrap_or_else(|| vec![POISON; plan.types[v].size_bytes()]),
                            Buf::Scratch(off) => scratch.remove(&off).unwrap_or_else(|| {
                                vec![POISON; k.scratch_bytes.saturating_sub(off)]
                            }),
                        });
                        taken.push(b);
                        map.push(local.len() - 1);
                    }
                    let run = compile(&l.kernel)
                        .and_then(|prog| execute(&prog, l.grid, &mut local, &map));
                    for (b, bytes) in taken.into_iter().zip(local) {
                        match b {
                            Buf::Value(v) => bufs[v] = Some(bytes),
                            Buf::Scratch(off) => {
                                scratch.insert(off, bytes);
                            }
                        }
                    }
                    run?;
                }
            }
            _ => {
                let ins = s
                    .inputs
                    .iter()
                    .map(|&v| tensor(&bufs, v))
                    .collect::<Result<Vec<_>>>()?;
                let refs: Vec<&HostTensor> = ins.iter().collect();
                let out = rustytorch_ops::eval_cpu(&s.op, &refs)
                    .map_err(|e| err(s.op.name(), format!("step {i} on the CPU: {e}")))?;
                bufs[s.output] = Some(to_bytes(out.data()));
            }
        }
    }
    (0..bufs.len())
        .map(|v| bufs[v].as_ref().map(|_| tensor(&bufs, v)).transpose())
        .collect()
}

/// Runs one launch of `grid` blocks over raw little-endian byte buffers (one per kernel parameter,
/// in order).
pub fn run_launch(kernel: &Kernel, grid: u32, bufs: &mut [Vec<u8>]) -> Result<(), InterpError> {
    if bufs.len() != kernel.params.len() {
        return Err(invalid(
            kernel,
            format!(
                "{} buffers given for {} parameters",
                bufs.len(),
                kernel.params.len()
            ),
        ));
    }
    let prog = compile(kernel)?;
    let map: Vec<usize> = (0..bufs.len()).collect();
    execute(&prog, grid, bufs, &map)
}

fn invalid(k: &Kernel, msg: String) -> InterpError {
    InterpError::Invalid {
        kernel: k.name.clone(),
        msg,
    }
}

// ---- host tensors as bytes ----

fn to_bytes(d: &Data) -> Vec<u8> {
    fn flat<T, const N: usize>(v: &[T], f: impl Fn(&T) -> [u8; N]) -> Vec<u8> {
        v.iter().flat_map(f).collect()
    }
    match d {
        Data::F32(v) => flat(v, |x| x.to_le_bytes()),
        Data::F64(v) => flat(v, |x| x.to_le_bytes()),
        Data::F16(v) => flat(v, |x| x.to_bits().to_le_bytes()),
        Data::BF16(v) => flat(v, |x| x.to_bits().to_le_bytes()),
        Data::I32(v) => flat(v, |x| x.to_le_bytes()),
        Data::I64(v) => flat(v, |x| x.to_le_bytes()),
        Data::U8(v) => v.to_vec(),
        Data::Bool(v) => v.iter().map(|&b| b as u8).collect(),
        Data::I8(v) => flat(v, |x| x.to_le_bytes()),
        Data::I16(v) => flat(v, |x| x.to_le_bytes()),
        Data::U16(v) => flat(v, |x| x.to_le_bytes()),
        Data::U32(v) => flat(v, |x| x.to_le_bytes()),
        Data::U64(v) => flat(v, |x| x.to_le_bytes()),
    }
}

/// Decodes storage of `dtype`; the error is the index of a bool byte other than 0 or 1.
fn from_bytes(b: &[u8], dtype: DType) -> Result<Data, usize> {
    fn chunks<T, const N: usize>(b: &[u8], f: impl Fn([u8; N]) -> T) -> Vec<T> {
        b.chunks_exact(N).map(|c| f(le(c, 0))).collect()
    }
    Ok(match dtype {
        DType::F32 => Data::F32(chunks(b, f32::from_le_bytes).into()),
        DType::F64 => Data::F64(chunks(b, f64::from_le_bytes).into()),
        DType::F16 => Data::F16(chunks(b, |c| f16::from_bits(u16::from_le_bytes(c))).into()),
        DType::BF16 => Data::BF16(chunks(b, |c| bf16::from_bits(u16::from_le_bytes(c))).into()),
        DType::I32 => Data::I32(chunks(b, i32::from_le_bytes).into()),
        DType::I64 => Data::I64(chunks(b, i64::from_le_bytes).into()),
        DType::U8 => Data::U8(b.to_vec().into()),
        DType::Bool => {
            if let Some(i) = b.iter().position(|&x| x > 1) {
                return Err(i);
            }
            Data::Bool(b.iter().map(|&x| x == 1).collect())
        }
        DType::I8 => Data::I8(chunks(b, i8::from_le_bytes).into()),
        DType::I16 => Data::I16(chunks(b, i16::from_le_bytes).into()),
        DType::U16 => Data::U16(chunks(b, u16::from_le_bytes).into()),
        DType::U32 => Data::U32(chunks(b, u32::from_le_bytes).into()),
        DType::U64 => Data::U64(chunks(b, u64::from_le_bytes).into()),
    })
}

/// The `i`-th `N`-byte chunk of `b` (the caller checks the bounds).
fn le<const N: usize>(b: &[u8], i: usize) -> [u8; N] {
    let mut a = [0u8; N];
    a.copy_from_slice(&b[i * N..i * N + N]);
    a
}

// ---- values ----

/// A compute value of one thread.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Value {
    /// A variable not yet set (never read by a well-formed kernel).
    Undef,
    Bool(bool),
    U8(u8),
    I32(i32),
    U32(u32),
    I64(i64),
    U64(u64),
    F32(f32),
    F64(f64),
}

macro_rules! as_num {
    ($v:expr, $t:ty) => {
        match $v {
            Value::F32(x) => x as $t,
            Value::F64(x) => x as $t,
            Value::I32(x) => x as $t,
            Value::I64(x) => x as $t,
            Value::U32(x) => x as $t,
            Value::U64(x) => x as $t,
            Value::U8(x) => x as $t,
            Value::Bool(b) => b as u8 as $t,
            Value::Undef => 0 as $t,
        }
    };
}

fn truthy(v: Value) -> bool {
    match v {
        Value::Bool(b) => b,
        Value::F32(x) => x != 0.0,
        Value::F64(x) => x != 0.0,
        Value::U8(x) => x != 0,
        Value::I32(x) => x != 0,
        Value::U32(x) => x != 0,
        Value::I64(x) => x != 0,
        Value::U64(x) => x != 0,
        Value::Undef => false,
    }
}

/// A C conversion to `t` (Rust `as` semantics, which are the GPU's: float→int saturates with
/// NaN→0, int→int wraps); f16/bf16 targets round to that format and give its f32 value.
#[allow(clippy::unnecessary_cast)]
fn convert(v: Value, t: CTy) -> Value {
    if v == Value::Undef {
        return v;
    }
    match t {
        CTy::F32 => Value::F32(as_num!(v, f32)),
        CTy::F64 => Value::F64(as_num!(v, f64)),
        CTy::F16 => Value::F32(match v {
            Value::F64(x) => f16::from_f64(x).to_f32(),
            _ => f16::from_f32(as_num!(v, f32)).to_f32(),
        }),
        CTy::BF16 => Value::F32(bf16::from_f32(as_num!(v, f32)).to_f32()),
        CTy::I32 => Value::I32(as_num!(v, i32)),
        CTy::I64 => Value::I64(as_num!(v, i64)),
        CTy::U32 => Value::U32(as_num!(v, u32)),
        CTy::U64 => Value::U64(as_num!(v, u64)),
        CTy::U8 => Value::U8(as_num!(v, u8)),
        CTy::Bool => Value::Bool(truthy(v)),
        // The storage-only narrow integers hold their values in int.
        CTy::I8 => Value::I32(as_num!(v, i8) as i32),
        CTy::I16 => Value::I32(as_num!(v, i16) as i32),
        CTy::U16 => Value::I32(as_num!(v, u16) as i32),
    }
}

/// A value as a buffer index (`None` for floats).
fn index_of(v: Value) -> Option<i128> {
    Some(match v {
        Value::Bool(b) => b as i128,
        Value::U8(x) => x as i128,
        Value::I32(x) => x as i128,
        Value::U32(x) => x as i128,
        Value::I64(x) => x as i128,
        Value::U64(x) => x as i128,
        Value::F32(_) | Value::F64(_) | Value::Undef => return None,
    })
}

fn read_elem(b: &[u8], elem: CTy, i: usize) -> Value {
    match elem {
        CTy::F32 => Value::F32(f32::from_le_bytes(le(b, i))),
        CTy::F64 => Value::F64(f64::from_le_bytes(le(b, i))),
        CTy::F16 => Value::F32(f16::from_bits(u16::from_le_bytes(le(b, i))).to_f32()),
        CTy::BF16 => Value::F32(bf16::from_bits(u16::from_le_bytes(le(b, i))).to_f32()),
        CTy::I32 => Value::I32(i32::from_le_bytes(le(b, i))),
        CTy::I64 => Value::I64(i64::from_le_bytes(le(b, i))),
        CTy::U32 => Value::U32(u32::from_le_bytes(le(b, i))),
        CTy::U64 => Value::U64(u64::from_le_bytes(le(b, i))),
        CTy::U8 => Value::U8(b[i]),
        CTy::Bool => Value::Bool(b[i] != 0),
        CTy::I8 => Value::I32(b[i] as i8 as i32),
        CTy::I16 => Value::I32(i16::from_le_bytes(le(b, i)) as i32),
        CTy::U16 => Value::I32(u16::from_le_bytes(le(b, i)) as i32),
    }
}

/// Writes `v` (already of `elem`'s compute type; f16/bf16 values already rounded).
fn write_elem(b: &mut [u8], elem: CTy, i: usize, v: Value) -> Option<()> {
    fn put<const N: usize>(b: &mut [u8], i: usize, x: [u8; N]) {
        b[i * N..i * N + N].copy_from_slice(&x);
    }
    match (elem, v) {
        (CTy::F32, Value::F32(x)) => put(b, i, x.to_le_bytes()),
        (CTy::F64, Value::F64(x)) => put(b, i, x.to_le_bytes()),
        (CTy::F16, Value::F32(x)) => put(b, i, f16::from_f32(x).to_bits().to_le_bytes()),
        (CTy::BF16, Value::F32(x)) => put(b, i, bf16::from_f32(x).to_bits().to_le_bytes()),
        (CTy::I32, Value::I32(x)) => put(b, i, x.to_le_bytes()),
        (CTy::I64, Value::I64(x)) => put(b, i, x.to_le_bytes()),
        (CTy::U32, Value::U32(x)) => put(b, i, x.to_le_bytes()),
        (CTy::U64, Value::U64(x)) => put(b, i, x.to_le_bytes()),
        (CTy::U8, Value::U8(x)) => b[i] = x,
        (CTy::Bool, Value::Bool(x)) => b[i] = x as u8,
        (CTy::I8, Value::I32(x)) => b[i] = x as i8 as u8,
        (CTy::I16, Value::I32(x)) => put(b, i, (x as i16).to_le_bytes()),
        (CTy::U16, Value::I32(x)) => put(b, i, (x as u16).to_le_bytes()),
        _ => return None,
    }
    Some(())
}

// ---- the lowered program: names resolved, every conversion explicit ----

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Arith {
    Add,
    Sub,
    Mul,
    /// The C `/` (integer division by zero gives 0).
    Div,
    /// The C `%` on integers, `fmod` on floats.
    Rem,
    /// `rt_idiv`
    IDiv,
    /// `rt_irem`
    IRem,
    /// `pow` / `rt_ipow`
    Pow,
    /// `rt_max`
    Max,
    /// `rt_min`
    Min,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Cmp {
    Lt,
    Le,
    Gt,
    Ge,
    Eq,
    Ne,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Math {
    Neg,
    Not,
    /// `fabsf` / `fabs`
    FAbs,
    /// `rt_iabs`
    IAbs,
    Exp,
    Log,
    Sqrt,
    Rsqrt,
    Recip,
    Sin,
    Cos,
    Tanh,
    Erf,
    Erfc,
    Floor,
    Ceil,
    Rint,
    IsNan,
    IsInf,
    IsFinite,
}

/// A lowered expression: operands are already converted to the type the operation works in.
#[derive(Clone, Debug)]
enum E {
    Var(usize),
    Const(Value),
    Special(Special),
    Conv(CTy, Box<E>),
    Un(Math, Box<E>),
    Bin(Arith, Box<E>, Box<E>),
    Cmp(Cmp, Box<E>, Box<E>),
    And(Box<E>, Box<E>),
    Or(Box<E>, Box<E>),
    Select(Box<E>, Box<E>, Box<E>),
    Load {
        buf: usize,
        elem: CTy,
        index: Box<E>,
    },
    Shfl(Box<E>, Box<E>),
}

/// A lowered statement.
#[derive(Clone, Debug)]
enum S {
    Set {
        slot: usize,
        value: E,
    },
    Store {
        buf: usize,
        elem: CTy,
        index: E,
        value: E,
    },
    AtomicAdd {
        buf: usize,
        elem: CTy,
        index: E,
        value: E,
    },
    For {
        slot: usize,
        start: E,
        cond: E,
        next: E,
        body: Vec<S>,
    },
    If {
        cond: E,
        then: Vec<S>,
        els: Vec<S>,
    },
    /// Statements run in order in the enclosing scope (a desugared vector access).
    Seq(Vec<S>),
    /// Faults unless `index` is a multiple of `width` (a vector access of `buf`).
    Aligned {
        buf: usize,
        index: E,
        width: usize,
    },
    Sync,
    Return,
    Nop,
}

struct BufInfo {
    name: String,
    elem: CTy,
    writable: bool,
    /// `Some(len)` for a shared array.
    shared: Option<u32>,
}

/// A kernel ready to run.
struct Prog<'k> {
    kernel: &'k Kernel,
    body: Vec<S>,
    slot_names: Vec<String>,
    /// Parameters first, then shared arrays.
    bufs: Vec<BufInfo>,
}

/// A lowered expression with the type [`super::emit`] infers for it (`ety`, which picks the
/// printed form) and the C++ type of the printed expression (`cty`, the type of its value).
struct T {
    e: E,
    ety: CTy,
    cty: CTy,
}

/// emit.rs's `wider`: the common type of two operands as the printer reckons it.
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

/// C++ integer promotion.
fn promote(t: CTy) -> CTy {
    match t {
        CTy::Bool | CTy::U8 => CTy::I32,
        t => t.compute_of(),
    }
}

/// The C++ usual arithmetic conversions of two operand types.
fn usual(a: CTy, b: CTy) -> CTy {
    wider(promote(a), promote(b))
}

/// `x` converted to `to` (no node when it already has that type).
fn conv(x: T, to: CTy) -> E {
    if x.cty == to && !matches!(to, CTy::F16 | CTy::BF16) {
        x.e
    } else {
        E::Conv(to, Box::new(x.e))
    }
}

fn truth(x: T) -> E {
    conv(x, CTy::Bool)
}

fn typed(e: E, ety: CTy, cty: CTy) -> T {
    T { e, ety, cty }
}

fn float_const(v: f64, t: CTy) -> (Value, CTy) {
    if t == CTy::F64 {
        (Value::F64(v), CTy::F64)
    } else {
        (Value::F32(v as f32), CTy::F32)
    }
}

struct Compiler<'k> {
    kernel: &'k Kernel,
    scopes: Vec<Vec<(String, usize)>>,
    slot_ty: Vec<CTy>,
    slot_names: Vec<String>,
    bufs: Vec<BufInfo>,
    buf_names: HashMap<String, usize>,
    shared_bytes: usize,
}

/// Resolves names and makes every conversion of a kernel explicit.
fn compile(k: &Kernel) -> Result<Prog<'_>> {
    let bufs: Vec<BufInfo> = k
        .params
        .iter()
        .map(|p| BufInfo {
            name: p.name.clone(),
            elem: p.elem,
            writable: p.writes,
            shared: None,
        })
        .collect();
    let buf_names = bufs
        .iter()
        .enumerate()
        .map(|(i, b)| (b.name.clone(), i))
        .collect();
    let mut c = Compiler {
        kernel: k,
        scopes: vec![vec![]],
        slot_ty: vec![],
        slot_names: vec![],
        bufs,
        buf_names,
        shared_bytes: 0,
    };
    let body = c.stmts(&k.body)?;
    Ok(Prog {
        kernel: k,
        body,
        slot_names: c.slot_names,
        bufs: c.bufs,
    })
}

impl Compiler<'_> {
    fn err<X>(&self, msg: String) -> Result<X> {
        Err(invalid(self.kernel, msg))
    }

    fn lookup(&self, n: &str) -> Option<usize> {
        self.scopes
            .iter()
            .rev()
            .find_map(|s| s.iter().rev().find(|(m, _)| m == n).map(|&(_, i)| i))
    }

    fn declare(&mut self, n: &str, ty: CTy) -> usize {
        let slot = self.slot_ty.len();
        self.slot_ty.push(ty);
        self.slot_names.push(n.to_string());
        self.scopes
            .last_mut()
            .expect("a scope")
            .push((n.to_string(), slot));
        slot
    }

    fn buf(&self, name: &str, elem: CTy) -> Result<usize> {
        match self.buf_names.get(name) {
            Some(&i) if self.bufs[i].elem == elem => Ok(i),
            Some(&i) => self.err(format!(
                "`{name}` used as {elem:?}, declared {:?}",
                self.bufs[i].elem
            )),
            None => self.err(format!("unknown buffer `{name}`")),
        }
    }

    /// The check of a vector access of `n` elements of `elem` (emit.rs's size rules, then the
    /// index's alignment at run time).
    fn aligned(&self, name: &str, buf: usize, elem: CTy, index: &Expr, n: usize) -> Result<S> {
        let bytes = n * elem_bytes(elem);
        if !n.is_power_of_two() || !(2..=16).contains(&bytes) {
            return self.err(format!(
                "a vector access of `{name}`: {n} × {elem:?} ({bytes} bytes)"
            ));
        }
        Ok(S::Aligned {
            buf,
            index: conv(self.expr(index)?, CTy::I64),
            width: n,
        })
    }

    fn index(&self, buf: &str, index: &Expr) -> Result<E> {
        let i = self.expr(index)?;
        if i.cty.is_float() {
            return self.err(format!("index of `{buf}` is a float"));
        }
        Ok(i.e)
    }

    fn expr(&self, e: &Expr) -> Result<T> {
        Ok(match e {
            Expr::Var(n) => match self.lookup(n) {
                Some(s) => typed(E::Var(s), self.slot_ty[s], self.slot_ty[s]),
                None => return self.err(format!("unknown variable `{n}`")),
            },
            Expr::Lit(Lit::Float(v, t)) => {
                let (c, ct) = float_const(*v, *t);
                typed(E::Const(c), t.compute_of(), ct)
            }
            Expr::Lit(Lit::Int(v, t)) => {
                let v = *v;
                let (c, ct) = match t {
                    CTy::I64 => (Value::I64(v), CTy::I64),
                    CTy::I32 => match i32::try_from(v) {
                        Ok(x) => (Value::I32(x), CTy::I32),
                        Err(_) => (Value::I64(v), CTy::I64),
                    },
                    CTy::U32 => (Value::U32(v as u32), CTy::U32),
                    CTy::U64 => (Value::U64(v as u64), CTy::U64),
                    CTy::U8 => (Value::U8(v as u8), CTy::U8),
                    CTy::Bool => (Value::Bool(v != 0), CTy::Bool),
                    CTy::I8 | CTy::I16 | CTy::U16 => (convert(Value::I64(v), *t), CTy::I32),
                    CTy::F32 | CTy::F64 | CTy::F16 | CTy::BF16 => float_const(v as f64, *t),
                };
                typed(E::Const(c), *t, ct)
            }
            Expr::Lit(Lit::Bool(b)) => typed(E::Const(Value::Bool(*b)), CTy::Bool, CTy::Bool),
            Expr::Special(s) => typed(E::Special(*s), CTy::U32, CTy::U32),
            Expr::Un(f, a) => self.unary(*f, self.expr(a)?)?,
            Expr::Bin(f, a, b) => {
                let positive_lit = matches!(**b, Expr::Lit(Lit::Int(v, _)) if v > 0);
                self.binary(*f, self.expr(a)?, self.expr(b)?, positive_lit)?
            }
            Expr::Select(c, a, b) => {
                let (c, a, b) = (self.expr(c)?, self.expr(a)?, self.expr(b)?);
                let t = wider(a.ety, b.ety);
                let ct = t.compute_of();
                typed(
                    E::Select(
                        Box::new(truth(c)),
                        Box::new(conv(a, t)),
                        Box::new(conv(b, t)),
                    ),
                    t,
                    ct,
                )
            }
            Expr::Cast(t, a) => cast_to(*t, self.expr(a)?),
            Expr::Load { buf, elem, index } => {
                let b = self.buf(buf, *elem)?;
                let index = Box::new(self.index(buf, index)?);
                let t = elem.compute_of();
                typed(
                    E::Load {
                        buf: b,
                        elem: *elem,
                        index,
                    },
                    t,
                    t,
                )
            }
        })
    }

    fn unary(&self, f: UnFn, a: T) -> Result<T> {
        let t = a.ety;
        let ft = if t == CTy::F64 { CTy::F64 } else { CTy::F32 };
        let float_fn = |m: Math, a: T| typed(E::Un(m, Box::new(conv(a, ft))), t, ft);
        let pred = |m: Math, a: T, int_value: bool| {
            if t.is_float() {
                typed(E::Un(m, Box::new(a.e)), CTy::Bool, CTy::Bool)
            } else {
                typed(E::Const(Value::Bool(int_value)), CTy::Bool, CTy::Bool)
            }
        };
        Ok(match f {
            UnFn::Neg => {
                let p = promote(a.cty);
                typed(E::Un(Math::Neg, Box::new(conv(a, p))), t, p)
            }
            UnFn::Not => typed(E::Un(Math::Not, Box::new(truth(a))), CTy::Bool, CTy::Bool),
            UnFn::Abs => {
                if t.is_float() {
                    float_fn(Math::FAbs, a)
                } else if matches!(t, CTy::U8 | CTy::U32 | CTy::U64 | CTy::Bool) {
                    a
                } else {
                    let ct = a.cty;
                    typed(E::Un(Math::IAbs, Box::new(a.e)), t, ct)
                }
            }
            UnFn::Exp => float_fn(Math::Exp, a),
            UnFn::Log => float_fn(Math::Log, a),
            UnFn::Sqrt => float_fn(Math::Sqrt, a),
            UnFn::Rsqrt => float_fn(Math::Rsqrt, a),
            UnFn::Sin => float_fn(Math::Sin, a),
            UnFn::Cos => float_fn(Math::Cos, a),
            UnFn::Tanh => float_fn(Math::Tanh, a),
            UnFn::Erf => float_fn(Math::Erf, a),
            UnFn::Erfc => float_fn(Math::Erfc, a),
            // The hardware approximations are modelled by the exact functions: the interpreter
            // checks a kernel's semantics, and the tests' tolerances cover the approximation.
            UnFn::ExpApprox => float_fn(Math::Exp, a),
            UnFn::TanhApprox => float_fn(Math::Tanh, a),
            UnFn::Recip => float_fn(Math::Recip, a),
            UnFn::Floor => float_fn(Math::Floor, a),
            UnFn::Ceil => float_fn(Math::Ceil, a),
            UnFn::Rint => float_fn(Math::Rint, a),
            UnFn::IsNan => pred(Math::IsNan, a, false),
            UnFn::IsInf => pred(Math::IsInf, a, false),
            UnFn::IsFinite => pred(Math::IsFinite, a, true),
        })
    }

    fn binary(&self, f: BinFn, a: T, b: T, positive_lit: bool) -> Result<T> {
        let t = wider(a.ety, b.ety);
        // A C++ operator: both operands in their usual arithmetic conversion.
        let op = |o: Arith, a: T, b: T| {
            let p = usual(a.cty, b.cty);
            typed(E::Bin(o, Box::new(conv(a, p)), Box::new(conv(b, p))), t, p)
        };
        // A call of `f<T>(a, b)` or of a function of `ct` arguments.
        let call = |o: Arith, a: T, b: T, ct: CTy| {
            let ct = ct.compute_of();
            typed(
                E::Bin(o, Box::new(conv(a, ct)), Box::new(conv(b, ct))),
                t,
                ct,
            )
        };
        let cmp = |c: Cmp, a: T, b: T| {
            let p = usual(a.cty, b.cty);
            let e = E::Cmp(c, Box::new(conv(a, p)), Box::new(conv(b, p)));
            typed(e, CTy::Bool, CTy::Bool)
        };
        let ft = if t == CTy::F64 { CTy::F64 } else { CTy::F32 };
        Ok(match f {
            BinFn::Add => op(Arith::Add, a, b),
            BinFn::Sub => op(Arith::Sub, a, b),
            BinFn::Mul => op(Arith::Mul, a, b),
            BinFn::Div => {
                if t.is_float() || positive_lit || t == CTy::Bool {
                    op(Arith::Div, a, b)
                } else {
                    call(Arith::IDiv, a, b, t)
                }
            }
            BinFn::Rem => {
                if positive_lit {
                    op(Arith::Rem, a, b)
                } else if t.is_float() {
                    call(Arith::Rem, a, b, ft)
                } else {
                    call(Arith::IRem, a, b, t)
                }
            }
            BinFn::Lt => cmp(Cmp::Lt, a, b),
            BinFn::Le => cmp(Cmp::Le, a, b),
            BinFn::Gt => cmp(Cmp::Gt, a, b),
            BinFn::Ge => cmp(Cmp::Ge, a, b),
            BinFn::Eq => cmp(Cmp::Eq, a, b),
            BinFn::Ne => cmp(Cmp::Ne, a, b),
            BinFn::And => typed(
                E::And(Box::new(truth(a)), Box::new(truth(b))),
                CTy::Bool,
                CTy::Bool,
            ),
            BinFn::Or => typed(
                E::Or(Box::new(truth(a)), Box::new(truth(b))),
                CTy::Bool,
                CTy::Bool,
            ),
            BinFn::Pow => call(Arith::Pow, a, b, if t.is_float() { ft } else { t }),
            BinFn::Max => call(Arith::Max, a, b, t),
            BinFn::Min => call(Arith::Min, a, b, t),
            BinFn::ShflXor => {
                // The int overload takes bool and unsigned char.
                let vt = match a.cty {
                    CTy::U8 | CTy::Bool => CTy::I32,
                    c => c,
                };
                let ety = a.ety;
                let e = E::Shfl(Box::new(conv(a, vt)), Box::new(conv(b, CTy::I32)));
                typed(e, ety, vt)
            }
        })
    }

    /// The value of a `Let`/`Assign`/`Store` of non-half type `to`, as emit.rs prints it: a cast
    /// when the printer's type differs, then the implicit conversion.
    fn assigned(&self, to: CTy, x: T) -> E {
        let x = if x.ety == to { x } else { cast_to(to, x) };
        conv(x, to.compute_of())
    }

    fn stmts(&mut self, body: &[Stmt]) -> Result<Vec<S>> {
        let mut out = Vec::with_capacity(body.len());
        for s in body {
            out.push(self.stmt(s)?);
        }
        Ok(out)
    }

    fn scoped(&mut self, body: &[Stmt]) -> Result<Vec<S>> {
        self.scopes.push(vec![]);
        let r = self.stmts(body);
        self.scopes.pop();
        r
    }

    fn stmt(&mut self, s: &Stmt) -> Result<S> {
        Ok(match s {
            Stmt::Let { name, ty, init } => {
                let value = self.assigned(*ty, self.expr(init)?);
                let slot = self.declare(name, ty.compute_of());
                S::Set { slot, value }
            }
            Stmt::Assign { name, value } => {
                let Some(slot) = self.lookup(name) else {
                    return self.err(format!("assignment to unknown `{name}`"));
                };
                let value = self.assigned(self.slot_ty[slot], self.expr(value)?);
                S::Set { slot, value }
            }
            Stmt::Store {
                buf,
                elem,
                index,
                value,
            } => {
                let b = self.buf(buf, *elem)?;
                if !self.bufs[b].writable {
                    return self.err(format!("store to read-only parameter `{buf}`"));
                }
                let v = self.expr(value)?;
                let value = match elem {
                    CTy::F16 => {
                        let via = if v.ety == CTy::F64 {
                            CTy::F64
                        } else {
                            CTy::F32
                        };
                        E::Conv(CTy::F16, Box::new(conv(v, via)))
                    }
                    CTy::BF16 => E::Conv(CTy::BF16, Box::new(conv(v, CTy::F32))),
                    t => self.assigned(*t, v),
                };
                S::Store {
                    buf: b,
                    elem: *elem,
                    index: self.index(buf, index)?,
                    value,
                }
            }
            Stmt::LoadVec {
                buf,
                elem,
                index,
                names,
            } => {
                let b = self.buf(buf, *elem)?;
                let mut seq = vec![self.aligned(buf, b, *elem, index, names.len())?];
                for (k, name) in names.iter().enumerate() {
                    let at = add(index.clone(), i64c(k as i64));
                    seq.push(self.stmt(&Stmt::Let {
                        name: name.clone(),
                        ty: elem.compute_of(),
                        init: load(buf, *elem, at),
                    })?);
                }
                S::Seq(seq)
            }
            Stmt::StoreVec {
                buf,
                elem,
                index,
                values,
            } => {
                let b = self.buf(buf, *elem)?;
                let mut seq = vec![self.aligned(buf, b, *elem, index, values.len())?];
                for (k, value) in values.iter().enumerate() {
                    seq.push(self.stmt(&Stmt::Store {
                        buf: buf.clone(),
                        elem: *elem,
                        index: add(index.clone(), i64c(k as i64)),
                        value: value.clone(),
                    })?);
                }
                S::Seq(seq)
            }
            Stmt::AtomicAdd {
                buf,
                elem,
                index,
                value,
            } => {
                let b = self.buf(buf, *elem)?;
                if !self.bufs[b].writable {
                    return self.err(format!("atomic add to read-only parameter `{buf}`"));
                }
                let v = self.expr(value)?;
                let vt = match elem {
                    CTy::F32 | CTy::F16 | CTy::BF16 => CTy::F32,
                    CTy::F64 => CTy::F64,
                    CTy::I32 => CTy::I32,
                    CTy::U32 | CTy::U8 => CTy::U32,
                    CTy::I64 | CTy::U64 => CTy::U64,
                    CTy::Bool => CTy::Bool,
                    CTy::I8 | CTy::I16 | CTy::U16 => {
                        return self.err(format!("no atomic add to {elem:?} storage"))
                    }
                };
                S::AtomicAdd {
                    buf: b,
                    elem: *elem,
                    index: self.index(buf, index)?,
                    value: conv(v, vt),
                }
            }
            Stmt::For {
                var,
                start,
                end,
                step,
                body,
            } => {
                let start = conv(self.expr(start)?, CTy::I64);
                self.scopes.push(vec![]);
                let slot = self.declare(var, CTy::I64);
                let r = (|| {
                    let v = || typed(E::Var(slot), CTy::I64, CTy::I64);
                    let end = self.expr(end)?;
                    let p = usual(CTy::I64, end.cty);
                    let cond = E::Cmp(Cmp::Lt, Box::new(conv(v(), p)), Box::new(conv(end, p)));
                    let step = self.expr(step)?;
                    let p = usual(CTy::I64, step.cty);
                    let sum = E::Bin(Arith::Add, Box::new(conv(v(), p)), Box::new(conv(step, p)));
                    let next = conv(typed(sum, p, p), CTy::I64);
                    let body = self.stmts(body)?;
                    Ok(S::For {
                        slot,
                        start,
                        cond,
                        next,
                        body,
                    })
                })();
                self.scopes.pop();
                r?
            }
            Stmt::If { cond, then, els } => {
                let cond = truth(self.expr(cond)?);
                S::If {
                    cond,
                    then: self.scoped(then)?,
                    els: self.scoped(els)?,
                }
            }
            Stmt::Shared { name, elem, len } => {
                self.shared_bytes += elem_bytes(*elem) * *len as usize;
                if self.shared_bytes > MAX_SHARED_BYTES {
                    return self.err(format!(
                        "{} bytes of shared memory (at most {MAX_SHARED_BYTES})",
                        self.shared_bytes
                    ));
                }
                self.buf_names.insert(name.clone(), self.bufs.len());
                self.bufs.push(BufInfo {
                    name: name.clone(),
                    elem: *elem,
                    writable: true,
                    shared: Some(*len),
                });
                // Shared arrays are allocated per block before the body runs.
                S::Nop
            }
            Stmt::SyncThreads => S::Sync,
            Stmt::Return => S::Return,
            Stmt::Verbatim(_) => {
                return self.err("verbatim CUDA C (tensor-core code) cannot be interpreted".into())
            }
        })
    }
}

/// emit.rs's `cast`: an explicit conversion to `to`.
fn cast_to(to: CTy, a: T) -> T {
    match to {
        CTy::F16 => {
            let via = if a.ety == CTy::F64 {
                CTy::F64
            } else {
                CTy::F32
            };
            let e = E::Conv(CTy::F16, Box::new(conv(a, via)));
            typed(e, CTy::F32, CTy::F32)
        }
        CTy::BF16 => {
            let e = E::Conv(CTy::BF16, Box::new(conv(a, CTy::F32)));
            typed(e, CTy::F32, CTy::F32)
        }
        // A bool is printed unchanged (whatever the C++ type of its expression).
        CTy::Bool if a.ety == CTy::Bool => typed(a.e, CTy::Bool, a.cty),
        t => typed(conv(a, t), t, t),
    }
}

// ---- per-thread operations ----

fn ipow_u64(mut x: u64, mut b: u64) -> u64 {
    let mut r: u64 = 1;
    while b > 0 {
        if b & 1 == 1 {
            r = r.wrapping_mul(x);
        }
        x = x.wrapping_mul(x);
        b >>= 1;
    }
    r
}

/// `rt_ipow` of a signed type, computed in 64 bits (the caller truncates).
fn ipow_i64(a: i64, b: i64) -> i64 {
    if b < 0 {
        return match a {
            1 => 1,
            -1 => {
                if b & 1 == 1 {
                    -1
                } else {
                    1
                }
            }
            _ => 0,
        };
    }
    ipow_u64(a as u64, b as u64) as i64
}

macro_rules! int_arith {
    ($op:expr, $x:expr, $y:expr, $neg1:expr) => {{
        let (x, y) = ($x, $y);
        match $op {
            Arith::Add => x.wrapping_add(y),
            Arith::Sub => x.wrapping_sub(y),
            Arith::Mul => x.wrapping_mul(y),
            Arith::Div => {
                if y == 0 {
                    0
                } else {
                    x.wrapping_div(y)
                }
            }
            Arith::Rem => {
                if y == 0 {
                    0
                } else {
                    x.wrapping_rem(y)
                }
            }
            Arith::IDiv => {
                if y == 0 {
                    0
                } else if y == $neg1 {
                    x.wrapping_neg()
                } else {
                    x / y
                }
            }
            Arith::IRem => {
                if y == 0 || y == $neg1 {
                    0
                } else {
                    x % y
                }
            }
            Arith::Max => {
                if x > y {
                    x
                } else {
                    y
                }
            }
            Arith::Min => {
                if x < y {
                    x
                } else {
                    y
                }
            }
            Arith::Pow => unreachable!("handled before"),
        }
    }};
}

macro_rules! float_arith {
    ($op:expr, $x:expr, $y:expr) => {{
        let (x, y) = ($x, $y);
        match $op {
            Arith::Add => x + y,
            Arith::Sub => x - y,
            Arith::Mul => x * y,
            Arith::Div => x / y,
            Arith::Rem => x % y,
            Arith::Pow => x.powf(y),
            Arith::Max => {
                if x.is_nan() {
                    x
                } else if y.is_nan() {
                    y
                } else if x > y {
                    x
                } else {
                    y
                }
            }
            Arith::Min => {
                if x.is_nan() {
                    x
                } else if y.is_nan() {
                    y
                } else if x < y {
                    x
                } else {
                    y
                }
            }
            Arith::IDiv | Arith::IRem => return None,
        }
    }};
}

fn arith(op: Arith, a: Value, b: Value) -> Option<Value> {
    use Value as V;
    Some(match (a, b) {
        (V::F32(x), V::F32(y)) => V::F32(float_arith!(op, x, y)),
        (V::F64(x), V::F64(y)) => V::F64(float_arith!(op, x, y)),
        (V::I32(x), V::I32(y)) if op == Arith::Pow => V::I32(ipow_i64(x as i64, y as i64) as i32),
        (V::I64(x), V::I64(y)) if op == Arith::Pow => V::I64(ipow_i64(x, y)),
        (V::U32(x), V::U32(y)) if op == Arith::Pow => V::U32(ipow_u64(x as u64, y as u64) as u32),
        (V::U64(x), V::U64(y)) if op == Arith::Pow => V::U64(ipow_u64(x, y)),
        (V::U8(x), V::U8(y)) if op == Arith::Pow => V::U8(ipow_u64(x as u64, y as u64) as u8),
        (V::I32(x), V::I32(y)) => V::I32(int_arith!(op, x, y, -1)),
        (V::I64(x), V::I64(y)) => V::I64(int_arith!(op, x, y, -1)),
        (V::U32(x), V::U32(y)) => V::U32(int_arith!(op, x, y, u32::MAX)),
        (V::U64(x), V::U64(y)) => V::U64(int_arith!(op, x, y, u64::MAX)),
        (V::U8(x), V::U8(y)) => V::U8(int_arith!(op, x, y, u8::MAX)),
        // The templates instantiated for bool (the operators promote bools to int).
        (V::Bool(x), V::Bool(y)) => V::Bool(match op {
            Arith::Pow => !y || x,
            Arith::Max => x || y,
            Arith::Min => x && y,
            Arith::IRem => false,
            _ => return None,
        }),
        _ => return None,
    })
}

fn compare(op: Cmp, a: Value, b: Value) -> Option<bool> {
    use std::cmp::Ordering;
    use Value as V;
    let ord: Option<Ordering> = match (a, b) {
        (V::F32(x), V::F32(y)) => x.partial_cmp(&y),
        (V::F64(x), V::F64(y)) => x.partial_cmp(&y),
        (V::I32(x), V::I32(y)) => Some(x.cmp(&y)),
        (V::I64(x), V::I64(y)) => Some(x.cmp(&y)),
        (V::U32(x), V::U32(y)) => Some(x.cmp(&y)),
        (V::U64(x), V::U64(y)) => Some(x.cmp(&y)),
        (V::U8(x), V::U8(y)) => Some(x.cmp(&y)),
        (V::Bool(x), V::Bool(y)) => Some(x.cmp(&y)),
        _ => return None,
    };
    Some(match (op, ord) {
        // Unordered (a NaN): only `!=` holds.
        (Cmp::Ne, None) => true,
        (_, None) => false,
        (Cmp::Lt, Some(o)) => o == Ordering::Less,
        (Cmp::Le, Some(o)) => o != Ordering::Greater,
        (Cmp::Gt, Some(o)) => o == Ordering::Greater,
        (Cmp::Ge, Some(o)) => o != Ordering::Less,
        (Cmp::Eq, Some(o)) => o == Ordering::Equal,
        (Cmp::Ne, Some(o)) => o != Ordering::Equal,
    })
}

macro_rules! float_math {
    ($op:expr, $x:expr, $erf:expr, $erfc:expr) => {{
        let x = $x;
        match $op {
            Math::Neg => -x,
            Math::FAbs => x.abs(),
            Math::IAbs => {
                // rt_iabs of a float: a negative value converts to 0 as unsigned.
                if x < 0.0 {
                    0.0
                } else {
                    x
                }
            }
            Math::Exp => x.exp(),
            Math::Log => x.ln(),
            Math::Sqrt => x.sqrt(),
            Math::Rsqrt => 1.0 / x.sqrt(),
            Math::Recip => 1.0 / x,
            Math::Sin => x.sin(),
            Math::Cos => x.cos(),
            Math::Tanh => x.tanh(),
            Math::Erf => $erf(x),
            Math::Erfc => $erfc(x),
            Math::Floor => x.floor(),
            Math::Ceil => x.ceil(),
            Math::Rint => x.round_ties_even(),
            Math::Not | Math::IsNan | Math::IsInf | Math::IsFinite => return None,
        }
    }};
}

fn math(op: Math, a: Value) -> Option<Value> {
    use Value as V;
    match op {
        Math::IsNan | Math::IsInf | Math::IsFinite => {
            let (nan, inf) = match a {
                V::F32(x) => (x.is_nan(), x.is_infinite()),
                V::F64(x) => (x.is_nan(), x.is_infinite()),
                _ => (false, false),
            };
            return Some(V::Bool(match op {
                Math::IsNan => nan,
                Math::IsInf => inf,
                _ => !nan && !inf,
            }));
        }
        Math::Not => return Some(V::Bool(!truthy(a))),
        _ => {}
    }
    Some(match a {
        V::F32(x) => V::F32(float_math!(
            op,
            x,
            |x: f32| erf(x as f64) as f32,
            |x: f32| erfc(x as f64) as f32
        )),
        V::F64(x) => V::F64(float_math!(op, x, erf, erfc)),
        V::I32(x) => V::I32(match op {
            Math::Neg => x.wrapping_neg(),
            Math::IAbs => x.wrapping_abs(),
            _ => return None,
        }),
        V::I64(x) => V::I64(match op {
            Math::Neg => x.wrapping_neg(),
            Math::IAbs => x.wrapping_abs(),
            _ => return None,
        }),
        V::U32(x) => V::U32(match op {
            Math::Neg => x.wrapping_neg(),
            Math::IAbs => x,
            _ => return None,
        }),
        V::U64(x) => V::U64(match op {
            Math::Neg => x.wrapping_neg(),
            Math::IAbs => x,
            _ => return None,
        }),
        V::U8(_) | V::Bool(_) if op == Math::IAbs => a,
        _ => return None,
    })
}

// The error function and its complement in f64: FreeBSD's `s_erf.c`, under this notice:
//
// Copyright (C) 1993 by Sun Microsystems, Inc. All rights reserved.
// Developed at SunPro, a Sun Microsystems, Inc. business. Permission to use, copy, modify, and
// distribute this software is freely granted, provided that this notice is preserved.
//
// Less than 1 ulp of error, so that rounding to f32 gives a correctly rounded `erff`/`erfcf`
// almost everywhere.

use erf_f64::{erf, erfc};

mod erf_f64 {
    #![allow(clippy::excessive_precision)]

    const ERX: f64 = 8.45062911510467529297e-01;
    const EFX8: f64 = 1.02703333676410069053e+00;
    const PP: [f64; 5] = [
        1.28379167095512558561e-01,
        -3.25042107247001499370e-01,
        -2.84817495755985104766e-02,
        -5.77027029648944159157e-03,
        -2.37630166566501626084e-05,
    ];
    const QQ: [f64; 5] = [
        3.97917223959155352819e-01,
        6.50222499887672944485e-02,
        5.08130628187576562776e-03,
        1.32494738004321644526e-04,
        -3.96022827877536812320e-06,
    ];
    const PA: [f64; 7] = [
        -2.36211856075265944077e-03,
        4.14856118683748331666e-01,
        -3.72207876035701323847e-01,
        3.18346619901161753674e-01,
        -1.10894694282396677476e-01,
        3.54783043256182359371e-02,
        -2.16637559486879084300e-03,
    ];
    const QA: [f64; 6] = [
        1.06420880400844228286e-01,
        5.40397917702171048937e-01,
        7.18286544141962662868e-02,
        1.26171219808761642112e-01,
        1.36370839120290507362e-02,
        1.19844998467991074170e-02,
    ];
    const RA: [f64; 8] = [
        -9.86494403484714822705e-03,
        -6.93858572707181764372e-01,
        -1.05586262253232909814e+01,
        -6.23753324503260060396e+01,
        -1.62396669462573470355e+02,
        -1.84605092906711035994e+02,
        -8.12874355063065934246e+01,
        -9.81432934416914548592e+00,
    ];
    const SA: [f64; 8] = [
        1.96512716674392571292e+01,
        1.37657754143519042600e+02,
        4.34565877475229228821e+02,
        6.45387271733267880336e+02,
        4.29008140027567833386e+02,
        1.08635005541779435134e+02,
        6.57024977031928170135e+00,
        -6.04244152148580987438e-02,
    ];
    const RB: [f64; 7] = [
        -9.86494292470009928597e-03,
        -7.99283237680523006574e-01,
        -1.77579549177547519889e+01,
        -1.60636384855821916062e+02,
        -6.37566443368389627722e+02,
        -1.02509513161107724954e+03,
        -4.83519191608651397019e+02,
    ];
    const SB: [f64; 7] = [
        3.03380607434824582924e+01,
        3.25792512996573918826e+02,
        1.53672958608443695994e+03,
        3.19985821950859553908e+03,
        2.55305040643316442583e+03,
        4.74528541206955367215e+02,
        -2.24409524465858183362e+01,
    ];
    const TINY: f64 = 2.2250738585072014e-308;

    /// `c[0] + s*(c[1] + s*(...))`
    fn poly(c: &[f64], s: f64) -> f64 {
        c.iter().rev().fold(0.0, |acc, &k| k + s * acc)
    }

    /// `1 + s*(c[0] + s*(c[1] + ...))`
    fn poly1(c: &[f64], s: f64) -> f64 {
        1.0 + s * poly(c, s)
    }

    /// The high word of `x` without its sign.
    fn high_word(x: f64) -> u32 {
        ((x.to_bits() >> 32) as u32) & 0x7fff_ffff
    }

    /// `(erf(x) - x) / x` for |x| < 0.84375.
    fn erf_small(x: f64) -> f64 {
        let z = x * x;
        poly(&PP, z) / poly1(&QQ, z)
    }

    /// `erf(|x|) - ERX` for 0.84375 <= |x| < 1.25.
    fn erf_mid(x: f64) -> f64 {
        let s = x.abs() - 1.0;
        poly(&PA, s) / poly1(&QA, s)
    }

    /// `erfc(|x|)` for 1.25 <= |x| < 28.
    fn erfc_tail(x: f64) -> f64 {
        let ax = x.abs();
        let s = 1.0 / (ax * ax);
        let (r, q) = if high_word(x) < 0x4006_db6d {
            (poly(&RA, s), poly1(&SA, s))
        } else {
            (poly(&RB, s), poly1(&SB, s))
        };
        let z = f64::from_bits(ax.to_bits() & 0xffff_ffff_0000_0000);
        (-z * z - 0.5625).exp() * ((z - ax) * (z + ax) + r / q).exp() / ax
    }

    /// The error function.
    pub(super) fn erf(x: f64) -> f64 {
        let ix = high_word(x);
        if ix >= 0x7ff0_0000 {
            // erf(nan) = nan, erf(±inf) = ±1
            return if x.is_nan() { x } else { x.signum() };
        }
        if ix < 0x3feb_0000 {
            if ix < 0x3e30_0000 {
                return 0.125 * (8.0 * x + EFX8 * x);
            }
            return x + x * erf_small(x);
        }
        let y = if ix < 0x3ff4_0000 {
            ERX + erf_mid(x)
        } else if ix < 0x4018_0000 {
            1.0 - erfc_tail(x)
        } else {
            1.0 - TINY
        };
        if x < 0.0 {
            -y
        } else {
            y
        }
    }

    /// The complementary error function.
    pub(super) fn erfc(x: f64) -> f64 {
        let ix = high_word(x);
        if ix >= 0x7ff0_0000 {
            // erfc(nan) = nan, erfc(inf) = 0, erfc(-inf) = 2
            return if x.is_nan() {
                x
            } else if x > 0.0 {
                0.0
            } else {
                2.0
            };
        }
        if ix < 0x3feb_0000 {
            if ix < 0x3c70_0000 {
                return 1.0 - x;
            }
            let y = erf_small(x);
            if x < 0.25 {
                return 1.0 - (x + x * y);
            }
            return 0.5 - (x - 0.5 + x * y);
        }
        if ix < 0x3ff4_0000 {
            let p = erf_mid(x);
            return if x >= 0.0 {
                1.0 - ERX - p
            } else {
                1.0 + (ERX + p)
            };
        }
        if ix < 0x403c_0000 {
            let t = erfc_tail(x);
            return if x > 0.0 { t } else { 2.0 - t };
        }
        if x > 0.0 {
            TINY * TINY
        } else {
            2.0 - TINY
        }
    }
}

// ---- execution ----

/// Runs `grid` blocks of a compiled kernel; parameter `i` is `globals[map[i]]`.
fn execute(prog: &Prog, grid: u32, globals: &mut [Vec<u8>], map: &[usize]) -> Result<()> {
    let k = prog.kernel;
    if k.block == 0 || k.block > MAX_BLOCK {
        return Err(invalid(
            k,
            format!("{} threads per block (1 to {MAX_BLOCK})", k.block),
        ));
    }
    if grid == 0 || grid > i32::MAX as u32 {
        return Err(invalid(k, format!("a grid of {grid} blocks")));
    }
    let dim = k.block as usize;
    let mut m = Machine {
        prog,
        globals,
        map,
        shared: prog
            .bufs
            .iter()
            .map(|b| vec![POISON; b.shared.map_or(0, |n| n as usize * elem_bytes(b.elem))])
            .collect(),
        vars: vec![vec![Value::Undef; dim]; prog.slot_names.len()],
        returned: vec![false; dim],
        n_returned: 0,
        block: 0,
        grid,
    };
    let all: Vec<u32> = (0..k.block).collect();
    for block in 0..grid {
        m.block = block;
        for s in &mut m.shared {
            s.fill(POISON);
        }
        m.returned.fill(false);
        m.n_returned = 0;
        m.exec(&prog.body, &all)?;
    }
    Ok(())
}

struct Machine<'a, 'k> {
    prog: &'a Prog<'k>,
    globals: &'a mut [Vec<u8>],
    map: &'a [usize],
    /// Per buffer of the program: the bytes of shared arrays (empty for parameters).
    shared: Vec<Vec<u8>>,
    /// `vars[slot][thread]`
    vars: Vec<Vec<Value>>,
    returned: Vec<bool>,
    n_returned: usize,
    block: u32,
    grid: u32,
}

impl Machine<'_, '_> {
    fn fault(&self, thread: u32, msg: String) -> InterpError {
        InterpError::Fault {
            kernel: self.prog.kernel.name.clone(),
            block: self.block,
            thread,
            msg,
        }
    }

    fn internal(&self, thread: u32, what: &str) -> InterpError {
        self.fault(thread, format!("ill-typed operands of {what}"))
    }

    fn mem(&self, buf: usize) -> &[u8] {
        match self.prog.bufs[buf].shared {
            Some(_) => &self.shared[buf],
            None => &self.globals[self.map[buf]],
        }
    }

    fn mem_mut(&mut self, buf: usize) -> &mut [u8] {
        match self.prog.bufs[buf].shared {
            Some(_) => &mut self.shared[buf],
            None => &mut self.globals[self.map[buf]],
        }
    }

    /// The element index of `v` in `buf`, checked against its bounds.
    fn checked(
        &self,
        access: &'static str,
        buf: usize,
        v: Value,
        thread: u32,
        len: usize,
    ) -> Result<usize> {
        let i = index_of(v).ok_or_else(|| self.internal(thread, access))?;
        if i < 0 || i >= len as i128 {
            return Err(InterpError::OutOfBounds {
                kernel: self.prog.kernel.name.clone(),
                access,
                buf: self.prog.bufs[buf].name.clone(),
                index: i,
                len,
                block: self.block,
                thread,
            });
        }
        Ok(i as usize)
    }

    fn len_of(&self, buf: usize) -> usize {
        self.mem(buf).len() / elem_bytes(self.prog.bufs[buf].elem)
    }

    fn exec(&mut self, body: &[S], lanes: &[u32]) -> Result<()> {
        let mut cur: Cow<[u32]> = Cow::Borrowed(lanes);
        let mut seen = self.n_returned;
        for s in body {
            if cur.is_empty() {
                break;
            }
            self.stmt(s, &cur)?;
            if self.n_returned != seen {
                seen = self.n_returned;
                let live: Vec<u32> = cur
                    .iter()
                    .copied()
                    .filter(|&l| !self.returned[l as usize])
                    .collect();
                cur = Cow::Owned(live);
            }
        }
        Ok(())
    }

    fn set(&mut self, slot: usize, lanes: &[u32], vals: Vec<Value>) {
        let col = &mut self.vars[slot];
        for (&l, v) in lanes.iter().zip(vals) {
            col[l as usize] = v;
        }
    }

    fn stmt(&mut self, s: &S, lanes: &[u32]) -> Result<()> {
        match s {
            S::Set { slot, value } => {
                let v = self.eval(value, lanes)?;
                self.set(*slot, lanes, v);
            }
            S::Store {
                buf,
                elem,
                index,
                value,
            } => {
                let idx = self.eval(index, lanes)?;
                let vals = self.eval(value, lanes)?;
                let len = self.len_of(*buf);
                for ((&l, &i), v) in lanes.iter().zip(&idx).zip(vals) {
                    let i = self.checked("store to", *buf, i, l, len)?;
                    if write_elem(self.mem_mut(*buf), *elem, i, v).is_none() {
                        return Err(self.internal(l, "a store"));
                    }
                }
            }
            S::AtomicAdd {
                buf,
                elem,
                index,
                value,
            } => {
                let idx = self.eval(index, lanes)?;
                let vals = self.eval(value, lanes)?;
                let len = self.len_of(*buf);
                for ((&l, &i), v) in lanes.iter().zip(&idx).zip(vals) {
                    let i = self.checked("atomic add to", *buf, i, l, len)?;
                    let mem = self.mem_mut(*buf);
                    let old = read_elem(mem, *elem, i);
                    let new = atomic_sum(*elem, old, v)
                        .ok_or_else(|| self.internal(l, "an atomic add"))?;
                    write_elem(self.mem_mut(*buf), *elem, i, new)
                        .ok_or_else(|| self.internal(l, "an atomic add"))?;
                }
            }
            S::For {
                slot,
                start,
                cond,
                next,
                body,
            } => {
                let v = self.eval(start, lanes)?;
                self.set(*slot, lanes, v);
                let mut cur: Vec<u32> = lanes.to_vec();
                loop {
                    let c = self.eval(cond, &cur)?;
                    let mut k = 0;
                    cur.retain(|_| {
                        k += 1;
                        c[k - 1] == Value::Bool(true)
                    });
                    if cur.is_empty() {
                        break;
                    }
                    let seen = self.n_returned;
                    self.exec(body, &cur)?;
                    if self.n_returned != seen {
                        cur.retain(|&l| !self.returned[l as usize]);
                        if cur.is_empty() {
                            break;
                        }
                    }
                    let v = self.eval(next, &cur)?;
                    self.set(*slot, &cur, v);
                }
            }
            S::If { cond, then, els } => {
                let c = self.eval(cond, lanes)?;
                let (mut t, mut f) = (vec![], vec![]);
                for (&l, v) in lanes.iter().zip(&c) {
                    if *v == Value::Bool(true) {
                        t.push(l);
                    } else {
                        f.push(l);
                    }
                }
                if !t.is_empty() {
                    self.exec(then, &t)?;
                }
                if !f.is_empty() {
                    self.exec(els, &f)?;
                }
            }
            S::Sync => {
                let live = self.prog.kernel.block as usize - self.n_returned;
                if lanes.len() != live {
                    let missing = (0..self.prog.kernel.block)
                        .find(|l| !self.returned[*l as usize] && !lanes.contains(l))
                        .unwrap_or(0);
                    return Err(self.fault(
                        missing,
                        format!(
                            "__syncthreads in divergent code: {} of {live} live threads arrive, \
                             this one does not",
                            lanes.len()
                        ),
                    ));
                }
            }
            S::Seq(body) => {
                for s in body {
                    self.stmt(s, lanes)?;
                }
            }
            S::Aligned { buf, index, width } => {
                for (&l, i) in lanes.iter().zip(self.eval(index, lanes)?) {
                    let i = index_of(i).ok_or_else(|| self.internal(l, "a vector access"))?;
                    if i % *width as i128 != 0 {
                        return Err(self.fault(
                            l,
                            format!(
                                "vector access of {width} elements of `{}` at {i}, not a \
                                 multiple of {width}",
                                self.prog.bufs[*buf].name
                            ),
                        ));
                    }
                }
            }
            S::Nop => {}
            S::Return => {
                for &l in lanes {
                    self.returned[l as usize] = true;
                }
                self.n_returned += lanes.len();
            }
        }
        Ok(())
    }

    /// Evaluates `e` for each of `lanes` (the result is in the order of `lanes`).
    fn eval(&self, e: &E, lanes: &[u32]) -> Result<Vec<Value>> {
        Ok(match e {
            E::Var(slot) => {
                let col = &self.vars[*slot];
                let mut out = Vec::with_capacity(lanes.len());
                for &l in lanes {
                    let v = col[l as usize];
                    if v == Value::Undef {
                        return Err(self.fault(
                            l,
                            format!("read of `{}` before it is set", self.prog.slot_names[*slot]),
                        ));
                    }
                    out.push(v);
                }
                out
            }
            E::Const(v) => vec![*v; lanes.len()],
            E::Special(s) => match s {
                Special::ThreadIdx => lanes.iter().map(|&l| Value::U32(l)).collect(),
                Special::BlockIdx => vec![Value::U32(self.block); lanes.len()],
                Special::BlockDim => vec![Value::U32(self.prog.kernel.block); lanes.len()],
                Special::GridDim => vec![Value::U32(self.grid); lanes.len()],
            },
            E::Conv(t, a) => {
                let mut v = self.eval(a, lanes)?;
                for x in &mut v {
                    *x = convert(*x, *t);
                }
                v
            }
            E::Un(op, a) => {
                let mut v = self.eval(a, lanes)?;
                for (x, &l) in v.iter_mut().zip(lanes) {
                    *x = math(*op, *x).ok_or_else(|| self.internal(l, "a unary function"))?;
                }
                v
            }
            E::Bin(op, a, b) => {
                let mut va = self.eval(a, lanes)?;
                let vb = self.eval(b, lanes)?;
                for ((x, y), &l) in va.iter_mut().zip(vb).zip(lanes) {
                    *x = arith(*op, *x, y).ok_or_else(|| self.internal(l, "an operator"))?;
                }
                va
            }
            E::Cmp(op, a, b) => {
                let mut va = self.eval(a, lanes)?;
                let vb = self.eval(b, lanes)?;
                for ((x, y), &l) in va.iter_mut().zip(vb).zip(lanes) {
                    let c = compare(*op, *x, y).ok_or_else(|| self.internal(l, "a comparison"))?;
                    *x = Value::Bool(c);
                }
                va
            }
            E::And(a, b) | E::Or(a, b) => {
                // Short-circuit: `b` is evaluated only where `a` does not decide.
                let decides = matches!(e, E::Or(..));
                let mut va = self.eval(a, lanes)?;
                let rest: Vec<u32> = lanes
                    .iter()
                    .zip(&va)
                    .filter(|(_, v)| **v != Value::Bool(decides))
                    .map(|(&l, _)| l)
                    .collect();
                if !rest.is_empty() {
                    let vb = self.eval(b, &rest)?;
                    let mut vb = vb.into_iter();
                    for x in va.iter_mut() {
                        if *x != Value::Bool(decides) {
                            *x = vb.next().expect("one value per undecided lane");
                        }
                    }
                }
                va
            }
            E::Select(c, a, b) => {
                let vc = self.eval(c, lanes)?;
                let (mut tl, mut fl) = (vec![], vec![]);
                for (&l, v) in lanes.iter().zip(&vc) {
                    if *v == Value::Bool(true) {
                        tl.push(l);
                    } else {
                        fl.push(l);
                    }
                }
                let mut va = if tl.is_empty() {
                    vec![].into_iter()
                } else {
                    self.eval(a, &tl)?.into_iter()
                };
                let mut vb = if fl.is_empty() {
                    vec![].into_iter()
                } else {
                    self.eval(b, &fl)?.into_iter()
                };
                vc.iter()
                    .map(|v| {
                        if *v == Value::Bool(true) {
                            va.next()
                        } else {
                            vb.next()
                        }
                        .expect("one value per lane")
                    })
                    .collect()
            }
            E::Load { buf, elem, index } => {
                let idx = self.eval(index, lanes)?;
                let len = self.len_of(*buf);
                let mem = self.mem(*buf);
                let mut out = Vec::with_capacity(lanes.len());
                for (&l, &i) in lanes.iter().zip(&idx) {
                    let i = self.checked("load of", *buf, i, l, len)?;
                    out.push(read_elem(mem, *elem, i));
                }
                out
            }
            E::Shfl(a, m) => {
                let va = self.eval(a, lanes)?;
                let vm = self.eval(m, lanes)?;
                let mut pos = vec![u32::MAX; self.prog.kernel.block as usize];
                for (k, &l) in lanes.iter().enumerate() {
                    pos[l as usize] = k as u32;
                }
                let mut out = Vec::with_capacity(lanes.len());
                for ((&l, &mask), own) in lanes.iter().zip(&vm).zip(&va) {
                    let Value::I32(mask) = mask else {
                        return Err(self.internal(l, "a shuffle"));
                    };
                    let lane = l % WARP;
                    let src_lane = lane ^ mask as u32;
                    if src_lane >= WARP {
                        out.push(*own);
                        continue;
                    }
                    let src = l - lane + src_lane;
                    match pos.get(src as usize) {
                        Some(&k) if k != u32::MAX => out.push(va[k as usize]),
                        _ => {
                            return Err(self.fault(
                                l,
                                format!(
                                    "__shfl_xor_sync with lane {src_lane}, which is inactive \
                                     or outside the block"
                                ),
                            ))
                        }
                    }
                }
                out
            }
        })
    }
}

/// The new value of an atomic add of `v` (converted to the add's type) to `old`.
fn atomic_sum(elem: CTy, old: Value, v: Value) -> Option<Value> {
    use Value as V;
    Some(match (elem, old, v) {
        (CTy::F32, V::F32(o), V::F32(x)) => V::F32(o + x),
        (CTy::F64, V::F64(o), V::F64(x)) => V::F64(o + x),
        (CTy::F16, V::F32(o), V::F32(x)) => V::F32(f16::from_f32(o + x).to_f32()),
        (CTy::BF16, V::F32(o), V::F32(x)) => V::F32(bf16::from_f32(o + x).to_f32()),
        (CTy::I32, V::I32(o), V::I32(x)) => V::I32(o.wrapping_add(x)),
        (CTy::U32, V::U32(o), V::U32(x)) => V::U32(o.wrapping_add(x)),
        (CTy::I64, V::I64(o), V::U64(x)) => V::I64((o as u64).wrapping_add(x) as i64),
        (CTy::U64, V::U64(o), V::U64(x)) => V::U64(o.wrapping_add(x)),
        (CTy::U8, V::U8(o), V::U32(x)) => V::U8((o as u32).wrapping_add(x) as u8),
        (CTy::Bool, V::Bool(o), V::Bool(x)) => V::Bool(o || x),
        _ => return None,
    })
}

/// Runs a cuBLASLt step on the host as cuBLASLt would, then its launches: each call of `desc`
/// computes `D = op(A)·op(B)` in column-major terms (A is the step's operand 1, B its operand 0,
/// with the descriptor's transposes, leading dimensions, batch strides and per-call offsets),
/// accumulating in f64, then applies the epilogue — the bias (operand 2, one value per row of D)
/// and ReLU or the tanh GELU (also keeping the pre-activation: `GELU_AUX_BIAS`), or the tanh
/// GELU's derivative at the aux input (operand 2, laid out as D: `DGELU`) — after adding C (the operand [`super::matmul::MatmulDesc::c_operand`]
/// names, laid out as D) when the call accumulates, and rounds once to the output's dtype; `after` then runs through
/// [`run_step`] on that result. Elements no call writes are zero.
pub fn run_matmul_step(
    desc: &super::matmul::MatmulDesc,
    after: &StepKernels,
    inputs: &[&HostTensor],
    out: &TensorType,
) -> Result<HostTensor, InterpError> {
    Ok(run_matmul_bgrad(desc, after, inputs, out, None)?.0)
}

/// [`run_matmul_step`] with the bias gradient of a `bgrad` descriptor: the epilogue's results
/// summed over D's columns before rounding (`DGELU_BGRAD`), or A summed over the inner dimension
/// (`BGRADA`), rounded once to `sum_out` (`m` values). `sum_out` is ignored without `bgrad`.
/// With the `GeluTanhAux` epilogue, D is the GELU and the second result the pre-activation
/// (`A·B + bias`, laid out and rounded as D).
pub fn run_matmul_bgrad(
    desc: &super::matmul::MatmulDesc,
    after: &StepKernels,
    inputs: &[&HostTensor],
    out: &TensorType,
    sum_out: Option<&TensorType>,
) -> Result<(HostTensor, Option<HostTensor>), InterpError> {
    use super::matmul::LtActivation;
    let bad = |msg: String| InterpError::Invalid {
        kernel: "cublasLt matmul".into(),
        msg,
    };
    let need = (2 + desc.reads_operand2() as usize).max(desc.c_operand().map_or(0, |i| i + 1));
    if inputs.len() < need {
        return Err(bad(format!("{} operands bound", inputs.len())));
    }
    let (b, a) = (inputs[0].to_f64_vec(), inputs[1].to_f64_vec());
    let extra = desc.reads_operand2().then(|| inputs[2].to_f64_vec());
    let c = desc.c_operand().map(|i| inputs[i].to_f64_vec());
    let mut d = vec![0f64; out.shape.numel()];
    let (m, n, k) = (desc.m as usize, desc.n as usize, desc.k as usize);
    let mut bias_grad = vec![0f64; if desc.bgrad { m } else { 0 }];
    let aux_out = desc.act == LtActivation::GeluTanhAux;
    let mut pre = vec![0f64; if aux_out { d.len() } else { 0 }];
    if desc.bgrad && (desc.bias || desc.batch != 1 || desc.calls.len() != 1) {
        return Err(bad("a bias gradient needs one call without a bias".into()));
    }
    let (lda, ldb, ldd) = (desc.lda as usize, desc.ldb as usize, desc.ldd as usize);
    let at = |v: &[f64], i: usize, what: &str| {
        v.get(i)
            .copied()
            .ok_or_else(|| bad(format!("{what} read at {i} of {}", v.len())))
    };
    let gelu = |x: f64| {
        let c = (2.0 / std::f64::consts::PI).sqrt();
        0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())
    };
    let dgelu = |x: f64| {
        let c = (2.0 / std::f64::consts::PI).sqrt();
        let t = (c * (x + 0.044715 * x * x * x)).tanh();
        0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * x * x)
    };
    for &(oa, ob, od) in &desc.calls {
        for bi in 0..desc.batch as usize {
            let off = |base: u64, stride: i64| (base as i64 + stride * bi as i64) as usize;
            let (pa, pb, pd) = (
                off(oa, desc.stride_a),
                off(ob, desc.stride_b),
                off(od, desc.stride_d),
            );
            for j in 0..n {
                for i in 0..m {
                    let mut acc = 0.0;
                    for l in 0..k {
                        let ai = if desc.trans_a {
                            l + i * lda
                        } else {
                            i + l * lda
                        };
                        let bj = if desc.trans_b {
                            j + l * ldb
                        } else {
                            l + j * ldb
                        };
                        let av = at(&a, pa + ai, "A")?;
                        if desc.bgrad && desc.act != LtActivation::DGeluTanh && j == 0 {
                            bias_grad[i] += av;
                        }
                        acc += av * at(&b, pb + bj, "B")?;
                    }
                    let di = pd + i + j * ldd;
                    if let Some(c) = &c {
                        acc += at(c, di, "C")?;
                    }
                    if desc.bias {
                        acc += at(extra.as_deref().unwrap_or(&[]), i, "bias")?;
                    }
                    acc = match desc.act {
                        LtActivation::None => acc,
                        LtActivation::Relu => acc.max(0.0),
                        LtActivation::GeluTanh => gelu(acc),
                        LtActivation::DGeluTanh => {
                            acc * dgelu(at(extra.as_deref().unwrap_or(&[]), di, "aux")?)
                        }
                        LtActivation::GeluTanhAux => {
                            if let Some(p) = pre.get_mut(di) {
                                *p = acc;
                            }
                            gelu(acc)
                        }
                    };
                    if desc.bgrad && desc.act == LtActivation::DGeluTanh {
                        bias_grad[i] += acc;
                    }
                    *d.get_mut(di)
                        .ok_or_else(|| bad(format!("D written at {di} of {}", out.shape)))? = acc;
                }
            }
        }
    }
    let gemm = HostTensor::from_f64_slice(out, &d).map_err(|e| bad(e.to_string()))?;
    let sum = match (desc.bgrad, sum_out) {
        (true, Some(ty)) => {
            Some(HostTensor::from_f64_slice(ty, &bias_grad).map_err(|e| bad(e.to_string()))?)
        }
        (true, None) => return Err(bad("the bias gradient's type is missing".into())),
        (false, _) if aux_out => {
            Some(HostTensor::from_f64_slice(out, &pre).map_err(|e| bad(e.to_string()))?)
        }
        (false, _) => None,
    };
    if after.launches.is_empty() {
        return Ok((gemm, sum));
    }
    Ok((run_step(after, inputs, out, Some(&gemm))?, sum))
}

#[cfg(test)]
mod tests {
    use super::super::ir::*;
    use super::super::{grid_for, Launch};
    use super::*;

    fn param(name: &str, elem: CTy, writes: bool) -> Param {
        Param {
            name: name.into(),
            elem,
            writes,
            map: None,
        }
    }

    /// A test kernel (which the CUDA printer accepts too).
    fn kernel(params: Vec<Param>, block: u32, body: Vec<Stmt>) -> Kernel {
        let k = Kernel {
            name: "k_test".into(),
            params,
            block,
            smem: 0,
            body,
        };
        super::super::emit::emit_kernel(&k).unwrap();
        k
    }

    fn f32_bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    fn f32s(b: &[u8]) -> Vec<f32> {
        b.chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }

    fn i32_bytes(v: &[i32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    fn i32s(b: &[u8]) -> Vec<i32> {
        b.chunks_exact(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }

    fn tid() -> Expr {
        special(Special::ThreadIdx)
    }

    /// `y[i] = (f32)(f16)x[i]` over a grid-stride loop that wraps around more than once.
    #[test]
    fn grid_stride_copy_rounds_through_f16() {
        let n = 1000;
        let k = kernel(
            vec![param("x", CTy::F32, false), param("y", CTy::F32, true)],
            128,
            vec![grid_stride(
                "i",
                n,
                vec![store(
                    "y",
                    CTy::F32,
                    var("i"),
                    cast(CTy::F16, load("x", CTy::F32, var("i"))),
                )],
            )],
        );
        let mut x: Vec<f32> = (0..n).map(|i| (i as f32 - 500.0) * 0.013_7).collect();
        // Ties round to even: 1 + 2^-11 is halfway between 1 and 1 + 2^-10.
        x[0] = 1.0 + 2f32.powi(-11);
        x[1] = 1.0 + 3.0 * 2f32.powi(-11);
        x[2] = 70000.0;
        let mut bufs = vec![f32_bytes(&x), vec![POISON; 4 * n as usize]];
        run_launch(&k, 3, &mut bufs).unwrap();
        let y = f32s(&bufs[1]);
        for (i, (&a, &b)) in x.iter().zip(&y).enumerate() {
            assert_eq!(b, f16::from_f32(a).to_f32(), "element {i}");
        }
        assert_eq!(y[0], 1.0);
        assert_eq!(y[1], 1.0 + 2f32.powi(-9));
        assert_eq!(y[2], f32::INFINITY);
        assert_ne!(y[3], x[3], "the value was rounded");
    }

    /// The same copy as a step over host tensors, into an f16 output.
    #[test]
    fn run_step_binds_tensors_and_poisons_unwritten_elements() {
        let n = 300;
        let copy = kernel(
            vec![param("x", CTy::F32, false), param("y", CTy::F16, true)],
            64,
            vec![grid_stride(
                "i",
                n,
                vec![store(
                    "y",
                    CTy::F16,
                    var("i"),
                    load("x", CTy::F32, var("i")),
                )],
            )],
        );
        let x = HostTensor::from_vec(
            (0..n).map(|i| i as f32 / 3.0).collect::<Vec<_>>(),
            vec![n as usize],
        )
        .unwrap();
        let out = TensorType::new(DType::F16, vec![n as usize]);
        let step = StepKernels {
            launches: vec![Launch::simple(copy, 1, grid_for(n as u64, 64))],
            scratch_bytes: 0,
        };
        let y = run_step(&step, &[&x], &out, None).unwrap();
        let want: Vec<f16> = (0..n).map(|i| f16::from_f32(i as f32 / 3.0)).collect();
        assert_eq!(y.to_vec::<f16>().unwrap(), want);

        // Writing only the even elements leaves the poison in the odd ones.
        let half = kernel(
            vec![param("x", CTy::F32, false), param("y", CTy::F32, true)],
            64,
            vec![grid_stride(
                "i",
                n / 2,
                vec![store(
                    "y",
                    CTy::F32,
                    mul(var("i"), i64c(2)),
                    load("x", CTy::F32, var("i")),
                )],
            )],
        );
        let out = TensorType::new(DType::F32, vec![n as usize]);
        let step = StepKernels {
            launches: vec![Launch::simple(half, 1, 2)],
            scratch_bytes: 0,
        };
        let y = run_step(&step, &[&x], &out, None)
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        assert_eq!(y[2], 1.0 / 3.0);
        assert_eq!(y[1].to_bits(), 0xA5A5_A5A5);

        // A parameter whose type is not its tensor's is an error.
        let mut bad = step.clone();
        bad.launches[0].kernel.params[0].elem = CTy::F64;
        let e = run_step(&bad, &[&x], &out, None).unwrap_err();
        assert!(e.to_string().contains("k_test"), "{e}");
    }

    /// A warp sum by butterfly shuffles: every lane ends with its warp's total.
    #[test]
    fn warp_shuffle_sum() {
        let mut body = vec![let_("v", CTy::F32, load("x", CTy::F32, tid()))];
        for off in [16, 8, 4, 2, 1] {
            body.push(assign(
                "v",
                add(var("v"), bin(BinFn::ShflXor, var("v"), i32c(off))),
            ));
        }
        body.push(store("y", CTy::F32, tid(), var("v")));
        let k = kernel(
            vec![param("x", CTy::F32, false), param("y", CTy::F32, true)],
            96,
            body,
        );
        let x: Vec<f32> = (0..96).map(|i| (i * i % 17) as f32).collect();
        let mut bufs = vec![f32_bytes(&x), vec![POISON; 4 * 96]];
        run_launch(&k, 1, &mut bufs).unwrap();
        let y = f32s(&bufs[1]);
        for w in 0..3 {
            let s: f32 = x[w * 32..w * 32 + 32].iter().sum();
            assert!(y[w * 32..w * 32 + 32].iter().all(|&v| v == s), "warp {w}");
        }
    }

    /// A shuffle that reads a lane which took the other branch is an error.
    #[test]
    fn shuffle_with_inactive_lane_is_an_error() {
        let k = kernel(
            vec![param("y", CTy::I32, true)],
            32,
            vec![
                let_("v", CTy::I32, cast(CTy::I32, tid())),
                if_(
                    lt(tid(), i64c(16)),
                    vec![assign("v", bin(BinFn::ShflXor, var("v"), i32c(16)))],
                ),
                store("y", CTy::I32, tid(), var("v")),
            ],
        );
        let mut bufs = vec![vec![0; 4 * 32]];
        let e = run_launch(&k, 1, &mut bufs).unwrap_err();
        assert!(matches!(e, InterpError::Fault { .. }), "{e}");
        assert!(e.to_string().contains("k_test"), "{e}");
    }

    /// A block reduction through shared memory: `out[b]` is the sum of block `b`'s chunk.
    fn block_sum(n: i64, with_tail_sync: bool) -> Kernel {
        let g = "g";
        let mut body = vec![
            Stmt::Shared {
                name: "sh".into(),
                elem: CTy::F32,
                len: 256,
            },
            let_(g, CTy::I64, global_thread()),
            store(
                "sh",
                CTy::F32,
                tid(),
                select(
                    lt(var(g), i64c(n)),
                    load("x", CTy::F32, var(g)),
                    fc(0.0, CTy::F32),
                ),
            ),
            Stmt::SyncThreads,
        ];
        for s in [128, 64, 32, 16, 8, 4, 2, 1] {
            body.push(if_(
                lt(tid(), i64c(s)),
                vec![store(
                    "sh",
                    CTy::F32,
                    tid(),
                    add(
                        load("sh", CTy::F32, tid()),
                        load("sh", CTy::F32, add(tid(), i64c(s))),
                    ),
                )],
            ));
            if with_tail_sync {
                body.push(Stmt::SyncThreads);
            }
        }
        body.push(if_(
            bin(BinFn::Eq, tid(), i64c(0)),
            vec![store(
                "y",
                CTy::F32,
                special(Special::BlockIdx),
                load("sh", CTy::F32, i64c(0)),
            )],
        ));
        kernel(
            vec![param("x", CTy::F32, false), param("y", CTy::F32, true)],
            256,
            body,
        )
    }

    #[test]
    fn shared_memory_block_reduction() {
        let n = 1000;
        let k = block_sum(n, true);
        let x: Vec<f32> = (0..n).map(|i| (i % 7) as f32 - 3.0).collect();
        let mut bufs = vec![f32_bytes(&x), vec![POISON; 4 * 4]];
        run_launch(&k, 4, &mut bufs).unwrap();
        let y = f32s(&bufs[1]);
        for b in 0..4 {
            let s: f32 = x[b * 256..((b + 1) * 256).min(n as usize)].iter().sum();
            assert_eq!(y[b], s, "block {b}");
        }
        // A barrier reached by part of the block is an error.
        let mut k = block_sum(n, false);
        let Stmt::If { then, .. } = &mut k.body[4] else {
            panic!("the first reduction step")
        };
        then.push(Stmt::SyncThreads);
        let e = run_launch(&k, 4, &mut bufs).unwrap_err();
        assert!(e.to_string().contains("__syncthreads"), "{e}");
    }

    /// Threads past the end return early; a return inside a loop retires the thread for good.
    #[test]
    fn if_return_early_exit() {
        let n = 200;
        let k = kernel(
            vec![param("x", CTy::F32, false), param("y", CTy::F32, true)],
            128,
            vec![
                let_("i", CTy::I64, global_thread()),
                if_(bin(BinFn::Ge, var("i"), i64c(n)), vec![Stmt::Return]),
                store(
                    "y",
                    CTy::F32,
                    var("i"),
                    mul(load("x", CTy::F32, var("i")), fc(2.0, CTy::F32)),
                ),
            ],
        );
        let x: Vec<f32> = (0..n).map(|i| i as f32).collect();
        let mut bufs = vec![f32_bytes(&x), vec![POISON; 4 * n as usize]];
        run_launch(&k, 2, &mut bufs).unwrap();
        assert_eq!(
            f32s(&bufs[1]),
            x.iter().map(|v| v * 2.0).collect::<Vec<_>>()
        );

        let k = kernel(
            vec![param("c", CTy::I32, true)],
            4,
            vec![
                for_(
                    "j",
                    i64c(0),
                    i64c(4),
                    i64c(1),
                    vec![
                        if_(
                            bin(
                                BinFn::And,
                                bin(BinFn::Eq, tid(), i64c(1)),
                                bin(BinFn::Eq, var("j"), i64c(2)),
                            ),
                            vec![Stmt::Return],
                        ),
                        Stmt::AtomicAdd {
                            buf: "c".into(),
                            elem: CTy::I32,
                            index: tid(),
                            value: i32c(1),
                        },
                    ],
                ),
                Stmt::AtomicAdd {
                    buf: "c".into(),
                    elem: CTy::I32,
                    index: tid(),
                    value: i32c(100),
                },
            ],
        );
        let mut bufs = vec![vec![0; 16]];
        run_launch(&k, 1, &mut bufs).unwrap();
        assert_eq!(i32s(&bufs[0]), vec![104, 2, 104, 104]);
    }

    /// Per-thread trip counts: thread t runs t iterations.
    #[test]
    fn loops_have_per_thread_trip_counts() {
        let k = kernel(
            vec![param("y", CTy::I64, true)],
            8,
            vec![
                let_("s", CTy::I64, i64c(0)),
                for_(
                    "j",
                    i64c(0),
                    tid(),
                    i64c(1),
                    vec![assign("s", add(var("s"), var("j")))],
                ),
                store("y", CTy::I64, tid(), var("s")),
            ],
        );
        let mut bufs = vec![vec![0; 64]];
        run_launch(&k, 1, &mut bufs).unwrap();
        let y: Vec<i64> = bufs[0]
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(y, (0..8).map(|t| t * (t - 1) / 2).collect::<Vec<i64>>());
    }

    /// Integer division never traps: by 0 gives 0, by -1 wraps; and the casts of the prelude.
    #[test]
    fn integer_division_and_casts() {
        let a = [7, 7, 7, -7, i32::MIN, -7, 0, 9];
        let b = [0, -1, -2, 2, -1, 0, 5, 3];
        let k = kernel(
            vec![
                param("a", CTy::I32, false),
                param("b", CTy::I32, false),
                param("q", CTy::I32, true),
                param("r", CTy::I32, true),
            ],
            8,
            vec![
                let_("x", CTy::I32, load("a", CTy::I32, tid())),
                let_("y", CTy::I32, load("b", CTy::I32, tid())),
                store("q", CTy::I32, tid(), div(var("x"), var("y"))),
                store("r", CTy::I32, tid(), rem(var("x"), var("y"))),
            ],
        );
        let mut bufs = vec![i32_bytes(&a), i32_bytes(&b), vec![0; 32], vec![0; 32]];
        run_launch(&k, 1, &mut bufs).unwrap();
        assert_eq!(i32s(&bufs[2]), vec![0, -7, -3, -3, i32::MIN, 0, 0, 3]);
        assert_eq!(i32s(&bufs[3]), vec![0, 0, 1, -1, 0, 0, 0, 0]);

        // One expression per thread, each stored as i64.
        let cases: Vec<(Expr, i64)> = vec![
            (cast(CTy::I32, fc(f64::NAN, CTy::F32)), 0),
            (cast(CTy::I32, fc(1e10, CTy::F32)), i32::MAX as i64),
            (cast(CTy::I64, fc(-2.7, CTy::F64)), -2),
            (cast(CTy::U8, fc(-3.0, CTy::F32)), 0),
            (cast(CTy::U8, fc(300.0, CTy::F32)), 255),
            (cast(CTy::U8, i32c(300)), 44),
            (cast(CTy::I32, i64c(1 << 33)), 0),
            // bool and unsigned char operands are promoted to int.
            (add(lit(200.0, CTy::U8), lit(100.0, CTy::U8)), 300),
            (bin(BinFn::Pow, i64c(3), i64c(5)), 243),
            (bin(BinFn::Pow, i64c(-1), i64c(-3)), -1),
            (bin(BinFn::Pow, i64c(2), i64c(-1)), 0),
            (bin(BinFn::Max, i32c(-4), i64c(3)), 3),
            (cast(CTy::I64, un(UnFn::Rint, fc(2.5, CTy::F32))), 2),
            (cast(CTy::I64, un(UnFn::Rint, fc(3.5, CTy::F64))), 4),
            (
                cast(CTy::I64, lt(i32c(-1), Expr::Lit(Lit::Int(1, CTy::U32)))),
                0,
            ),
            (cast(CTy::I64, cast(CTy::Bool, fc(f64::NAN, CTy::F32))), 1),
        ];
        let n = cases.len();
        let body = cases
            .iter()
            .enumerate()
            .map(|(t, (e, _))| {
                if_(
                    bin(BinFn::Eq, tid(), i64c(t as i64)),
                    vec![store("y", CTy::I64, tid(), e.clone())],
                )
            })
            .collect();
        let k = kernel(vec![param("y", CTy::I64, true)], n as u32, body);
        let mut bufs = vec![vec![0; 8 * n]];
        run_launch(&k, 1, &mut bufs).unwrap();
        for (t, (c, (e, want))) in bufs[0].chunks_exact(8).zip(&cases).enumerate() {
            let got = i64::from_le_bytes(c.try_into().unwrap());
            assert_eq!(got, *want, "case {t}: {e:?}");
        }
    }

    /// Float functions: erf, NaN-propagating max/min, rsqrt.
    #[test]
    fn float_functions() {
        let cases: Vec<(Expr, f64, f64)> = vec![
            (
                un(UnFn::Erf, fc(0.5, CTy::F64)),
                0.520_499_877_813_046_5,
                3e-16,
            ),
            (
                un(UnFn::Erf, fc(1.0, CTy::F64)),
                0.842_700_792_949_714_9,
                3e-16,
            ),
            (
                un(UnFn::Erf, fc(2.0, CTy::F64)),
                0.995_322_265_018_952_7,
                3e-16,
            ),
            (
                un(UnFn::Erf, fc(-3.0, CTy::F64)),
                -0.999_977_909_503_001_4,
                3e-16,
            ),
            (
                un(UnFn::Erf, fc(1e-3, CTy::F64)),
                1.128_378_790_969_236_5e-3,
                3e-16,
            ),
            (
                un(UnFn::Erfc, fc(0.1, CTy::F64)),
                0.887_537_083_981_715_2,
                3e-16,
            ),
            (
                un(UnFn::Erfc, fc(0.5, CTy::F64)),
                0.479_500_122_186_953_5,
                3e-16,
            ),
            (
                un(UnFn::Erfc, fc(-1.0, CTy::F64)),
                1.842_700_792_949_715,
                3e-16,
            ),
            (
                un(UnFn::Erfc, fc(2.0, CTy::F64)),
                4.677_734_981_047_265e-3,
                3e-16,
            ),
            (
                un(UnFn::Erfc, fc(10.0, CTy::F64)),
                2.088_487_583_762_545e-45,
                1e-15,
            ),
            (un(UnFn::Erfc, fc(-30.0, CTy::F64)), 2.0, 0.0),
            (un(UnFn::Erf, fc(7.0, CTy::F64)), 1.0, 0.0),
            (
                cast(CTy::F64, un(UnFn::Erf, fc(0.3, CTy::F32))),
                0.328_626_781_702_041_6, // erf(0.3f) rounded to f32
                0.0,
            ),
            (cast(CTy::F64, un(UnFn::Rsqrt, fc(4.0, CTy::F32))), 0.5, 0.0),
            (
                bin(BinFn::Max, fc(1.0, CTy::F64), fc(f64::NAN, CTy::F64)),
                f64::NAN,
                0.0,
            ),
            (
                bin(BinFn::Min, fc(f64::NAN, CTy::F64), fc(1.0, CTy::F64)),
                f64::NAN,
                0.0,
            ),
            (
                bin(BinFn::Max, fc(-1.0, CTy::F64), fc(2.0, CTy::F64)),
                2.0,
                0.0,
            ),
            (rem(fc(-7.5, CTy::F64), fc(2.0, CTy::F64)), -1.5, 0.0),
            (div(i64c(7), fc(2.0, CTy::F64)), 3.5, 0.0),
        ];
        let n = cases.len();
        let body = cases
            .iter()
            .enumerate()
            .map(|(t, (e, ..))| {
                if_(
                    bin(BinFn::Eq, tid(), i64c(t as i64)),
                    vec![store("y", CTy::F64, tid(), e.clone())],
                )
            })
            .collect();
        let k = kernel(vec![param("y", CTy::F64, true)], n as u32, body);
        let mut bufs = vec![vec![0; 8 * n]];
        run_launch(&k, 1, &mut bufs).unwrap();
        for (c, (e, want, tol)) in bufs[0].chunks_exact(8).zip(&cases) {
            let got = f64::from_le_bytes(c.try_into().unwrap());
            if want.is_nan() {
                assert!(got.is_nan(), "{e:?}: {got}");
            } else {
                let err = (got - want).abs() / want.abs().max(f64::MIN_POSITIVE);
                assert!(err <= *tol, "{e:?}: {got} vs {want}");
            }
        }
    }

    /// A histogram by atomic adds of every thread (several threads hit each bin at once), in a
    /// step of three launches that share a scratch buffer.
    #[test]
    fn atomic_add_histogram() {
        let n = 5000usize;
        let bins = 10usize;
        let data: Vec<i64> = (0..n).map(|i| ((i * 7919) % 97 % bins) as i64).collect();
        let clear = kernel(
            vec![param("s", CTy::Bool, true)],
            32,
            vec![if_(
                lt(tid(), i64c(bins as i64)),
                vec![store("s", CTy::Bool, tid(), bc(false))],
            )],
        );
        let hist = kernel(
            vec![
                param("x", CTy::I64, false),
                param("h", CTy::I32, true),
                param("s", CTy::Bool, true),
            ],
            256,
            vec![grid_stride(
                "i",
                n as i64,
                vec![
                    Stmt::AtomicAdd {
                        buf: "h".into(),
                        elem: CTy::I32,
                        index: load("x", CTy::I64, var("i")),
                        value: i32c(1),
                    },
                    // Marks the bin of element 3.
                    Stmt::AtomicAdd {
                        buf: "s".into(),
                        elem: CTy::Bool,
                        index: load("x", CTy::I64, var("i")),
                        value: bin(BinFn::Eq, var("i"), i64c(3)),
                    },
                ],
            )],
        );
        let mark = kernel(
            vec![param("s", CTy::Bool, false), param("h", CTy::I32, true)],
            32,
            vec![if_(
                bin(
                    BinFn::And,
                    lt(tid(), i64c(bins as i64)),
                    load("s", CTy::Bool, tid()),
                ),
                vec![store(
                    "h",
                    CTy::I32,
                    tid(),
                    add(load("h", CTy::I32, tid()), i32c(1000)),
                )],
            )],
        );
        let step = StepKernels {
            launches: vec![
                Launch {
                    kernel: clear,
                    args: vec![ArgRef::Scratch],
                    grid: 1,
                },
                Launch {
                    kernel: hist,
                    args: vec![ArgRef::Input(0), ArgRef::Output, ArgRef::Scratch],
                    grid: 4,
                },
                Launch {
                    kernel: mark,
                    args: vec![ArgRef::Scratch, ArgRef::Output],
                    grid: 1,
                },
            ],
            scratch_bytes: bins,
        };
        let x = HostTensor::from_vec(data.clone(), vec![n]).unwrap();
        let h0 = HostTensor::from_vec(vec![0i32; bins], vec![bins]).unwrap();
        let h = run_step(&step, &[&x], &h0.ty(), Some(&h0)).unwrap();
        let mut want = vec![0i32; bins];
        for &d in &data {
            want[d as usize] += 1;
        }
        want[data[3] as usize] += 1000;
        assert_eq!(h.to_vec::<i32>().unwrap(), want);

        // f16 atomics round after every add, in thread order.
        let k = kernel(
            vec![param("h", CTy::F16, true)],
            64,
            vec![Stmt::AtomicAdd {
                buf: "h".into(),
                elem: CTy::F16,
                index: i64c(0),
                value: fc(0.1, CTy::F32),
            }],
        );
        let mut bufs = vec![vec![0; 2]];
        run_launch(&k, 1, &mut bufs).unwrap();
        let mut acc = f16::from_f32(0.0);
        for _ in 0..64 {
            acc = f16::from_f32(acc.to_f32() + 0.1f32);
        }
        assert_eq!(bufs[0], acc.to_bits().to_le_bytes());
    }

    /// Loads and stores out of bounds are errors naming the kernel and buffer; a guarded load in
    /// the untaken arm of a select is not.
    #[test]
    fn out_of_bounds_access_is_an_error() {
        let k = kernel(
            vec![param("x", CTy::F32, false), param("y", CTy::F32, true)],
            32,
            vec![grid_stride(
                "i",
                64,
                vec![store(
                    "y",
                    CTy::F32,
                    var("i"),
                    load("x", CTy::F32, add(var("i"), i64c(1))),
                )],
            )],
        );
        let mut bufs = vec![vec![0; 4 * 64], vec![0; 4 * 64]];
        let e = run_launch(&k, 2, &mut bufs).unwrap_err();
        match &e {
            InterpError::OutOfBounds {
                kernel,
                buf,
                index,
                len,
                block,
                thread,
                ..
            } => {
                assert_eq!(
                    (kernel.as_str(), buf.as_str(), *index, *len, *block, *thread),
                    ("k_test", "x", 64, 64, 1, 31)
                );
            }
            e => panic!("{e}"),
        }
        assert!(e.to_string().contains("`x`[64]"), "{e}");

        let guarded = kernel(
            vec![param("x", CTy::F32, false), param("y", CTy::F32, true)],
            32,
            vec![grid_stride(
                "i",
                64,
                vec![store(
                    "y",
                    CTy::F32,
                    var("i"),
                    select(
                        lt(add(var("i"), i64c(1)), i64c(64)),
                        load("x", CTy::F32, add(var("i"), i64c(1))),
                        fc(0.0, CTy::F32),
                    ),
                )],
            )],
        );
        run_launch(&guarded, 2, &mut bufs).unwrap();

        let negative = kernel(
            vec![param("y", CTy::F32, true)],
            32,
            vec![store("y", CTy::F32, sub(tid(), i64c(1)), fc(1.0, CTy::F32))],
        );
        let e = run_launch(&negative, 1, &mut bufs[1..]).unwrap_err();
        assert!(e.to_string().contains("store to `y`[-1]"), "{e}");

        let read_only = kernel(
            vec![param("x", CTy::F32, false)],
            32,
            vec![store("x", CTy::F32, tid(), fc(1.0, CTy::F32))],
        );
        let e = run_launch(&read_only, 1, &mut bufs[..1]).unwrap_err();
        assert!(matches!(e, InterpError::Invalid { .. }), "{e}");
        let e: CodegenError = e.into();
        assert!(matches!(e, CodegenError::Invalid(_)));
    }

    /// A bool output no kernel wrote is reported.
    #[test]
    fn unwritten_bool_output_is_an_error() {
        let k = kernel(
            vec![param("y", CTy::Bool, true)],
            32,
            vec![if_(
                lt(tid(), i64c(8)),
                vec![store("y", CTy::Bool, tid(), bc(true))],
            )],
        );
        let step = StepKernels {
            launches: vec![Launch::simple(k, 0, 1)],
            scratch_bytes: 0,
        };
        let out = TensorType::new(DType::Bool, vec![8]);
        let y = run_step(&step, &[], &out, None).unwrap();
        assert_eq!(y.to_vec::<bool>().unwrap(), vec![true; 8]);
        let out = TensorType::new(DType::Bool, vec![32]);
        let e = run_step(&step, &[], &out, None).unwrap_err();
        assert!(e.to_string().contains("element 8"), "{e}");
    }

    /// 100k elements through a few blocks of 256 threads, as the template tests run them.
    #[test]
    fn large_elementwise_kernel() {
        let n = 100_000usize;
        let k = kernel(
            vec![param("x", CTy::F32, false), param("y", CTy::BF16, true)],
            256,
            vec![grid_stride(
                "i",
                n as i64,
                vec![
                    let_("v", CTy::F32, load("x", CTy::F32, var("i"))),
                    store(
                        "y",
                        CTy::BF16,
                        var("i"),
                        mul(
                            var("v"),
                            add(
                                fc(1.0, CTy::F32),
                                un(UnFn::Tanh, mul(var("v"), fc(0.5, CTy::F32))),
                            ),
                        ),
                    ),
                ],
            )],
        );
        let x: Vec<f32> = (0..n).map(|i| (i as f32 / n as f32) * 8.0 - 4.0).collect();
        let mut bufs = vec![f32_bytes(&x), vec![POISON; 2 * n]];
        let t = std::time::Instant::now();
        run_launch(&k, grid_for(n as u64, 256), &mut bufs).unwrap();
        let dt = t.elapsed();
        for (i, c) in bufs[1].chunks_exact(2).enumerate() {
            let v = x[i];
            let want = bf16::from_f32(v * (1.0 + (v * 0.5).tanh()));
            assert_eq!(
                u16::from_le_bytes([c[0], c[1]]),
                want.to_bits(),
                "element {i}"
            );
        }
        assert!(dt.as_secs_f64() < 5.0, "{dt:?}");
    }
}
