//! Convolution forward through cuDNN's graph (backend) API: the convolution and the pointwise
//! nodes that follow it (the bias add and the activation of [`DnnDesc::act`]) as one operation
//! graph, the engine configurations cuDNN's heuristics propose for it (mode A, then the fallback
//! list), an execution plan per configuration, and a variant pack (tensor uids to device
//! pointers) per call.
//!
//! The graph API offers engines that the legacy `cudnnFind*` does not (the ones PyTorch's
//! benchmark mode reaches through cudnn-frontend), and runtime-fusion engines that apply the
//! bias and the activation in the convolution's epilogue. [`crate::cuda::dnn`] times the plans
//! made here against the legacy algorithm on the same buffers and keeps the fastest.
//!
//! The entry points are resolved from the loaded libcudnn with `int` status codes (cudarc's
//! status enum is that of an older cuDNN, and a code it lacks must not become an enum value);
//! every descriptor is owned by a [`Desc`], destroyed once when dropped.

use super::dnn::{strides, WORKSPACE_LIMIT};
use crate::{Result, RuntimeError};
use cudarc::cudnn::sys;
use rustytorch_codegen::cuda::dnn::DnnDesc;
use rustytorch_ops::{Activation, DType};
use std::ffi::{c_char, c_void, CStr};
use std::sync::{Arc, OnceLock};

use sys::cudnnBackendAttributeName_t as A;
use sys::cudnnBackendAttributeType_t as T;
use sys::cudnnBackendDescriptorType_t as D;
use sys::cudnnPointwiseMode_t as Pw;

type Raw = *mut c_void;
type CreateFn = unsafe extern "C" fn(u32, *mut Raw) -> i32;
type DestroyFn = unsafe extern "C" fn(Raw) -> i32;
type SetFn = unsafe extern "C" fn(Raw, u32, u32, i64, *const c_void) -> i32;
type GetFn = unsafe extern "C" fn(Raw, u32, u32, i64, *mut i64, *mut c_void) -> i32;
type FinalizeFn = unsafe extern "C" fn(Raw) -> i32;
type ExecuteFn = unsafe extern "C" fn(Raw, Raw, Raw) -> i32;
type ErrorStringFn = unsafe extern "C" fn(i32) -> *const c_char;

/// The backend entry points of the loaded libcudnn.
struct Api {
    create: CreateFn,
    destroy: DestroyFn,
    set: SetFn,
    get: GetFn,
    finalize: FinalizeFn,
    execute: ExecuteFn,
    error_string: ErrorStringFn,
}

fn api() -> Result<&'static Api> {
    static API: OnceLock<std::result::Result<Api, String>> = OnceLock::new();
    API.get_or_init(|| {
        // SAFETY: `is_culib_present` only tries to load the library.
        if !unsafe { sys::is_culib_present() } {
            return Err("libcudnn was not found".into());
        }
        // SAFETY: the library is present (checked above); each symbol is looked up by its C name
        // and typed with its C signature (enums as u32, the status as i32).
        unsafe {
            let lib = sys::culib();
            macro_rules! sym {
                ($ty:ty, $name:literal) => {
                    *lib.get::<$ty>(concat!($name, "\0").as_bytes())
                        .map_err(|e| format!("{}: {e}", $name))?
                };
            }
            Ok(Api {
                create: sym!(CreateFn, "cudnnBackendCreateDescriptor"),
                destroy: sym!(DestroyFn, "cudnnBackendDestroyDescriptor"),
                set: sym!(SetFn, "cudnnBackendSetAttribute"),
                get: sym!(GetFn, "cudnnBackendGetAttribute"),
                finalize: sym!(FinalizeFn, "cudnnBackendFinalize"),
                execute: sym!(ExecuteFn, "cudnnBackendExecute"),
                error_string: sym!(ErrorStringFn, "cudnnGetErrorString"),
            })
        }
    })
    .as_ref()
    .map_err(|e| RuntimeError::Device(format!("cuDNN graph API: {e}")))
}

/// An error naming the call, the descriptor and cuDNN's status.
fn check(api: &Api, status: i32, call: &str, what: &str) -> Result<()> {
    if status == 0 {
        return Ok(());
    }
    // SAFETY: cudnnGetErrorString returns a static NUL-terminated string for any code.
    let msg = unsafe {
        let p = (api.error_string)(status);
        if p.is_null() {
            String::new()
        } else {
            CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    };
    Err(RuntimeError::Device(format!(
        "cuDNN {call} ({what}): status {status} {msg}"
    )))
}

/// One backend descriptor, destroyed when dropped.
pub(crate) struct Desc {
    raw: Raw,
    what: &'static str,
    api: &'static Api,
}

// SAFETY: a descriptor is plain host state; the owner ([`super::dnn::Dnn`]) uses it under the
// device's lock, one thread at a time.
unsafe impl Send for Desc {}
// SAFETY: shared descriptors are only read (by plans that reference them), never mutated.
unsafe impl Sync for Desc {}

impl Desc {
    pub(crate) fn new(ty: D, what: &'static str) -> Result<Desc> {
        let api = api()?;
        let mut raw: Raw = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer; `ty` is a descriptor type of this cuDNN.
        let st = unsafe { (api.create)(ty as u32, &mut raw) };
        check(api, st, "cudnnBackendCreateDescriptor", what)?;
        Ok(Desc { raw, what, api })
    }

    /// Sets attribute `name` to the `vals.len()` elements of `vals`, which are of type `ty`.
    pub(crate) fn set<V: Copy>(&self, name: A, ty: T, vals: &[V]) -> Result<()> {
        // SAFETY: the descriptor is live; `vals` holds `vals.len()` elements of the C type that
        // `ty` names (the callers pair them).
        let st = unsafe {
            (self.api.set)(
                self.raw,
                name as u32,
                ty as u32,
                vals.len() as i64,
                vals.as_ptr() as *const c_void,
            )
        };
        check(
            self.api,
            st,
            &format!("cudnnBackendSetAttribute {name:?}"),
            self.what,
        )
    }

    pub(crate) fn set_i64(&self, name: A, vals: &[i64]) -> Result<()> {
        self.set(name, T::CUDNN_TYPE_INT64, vals)
    }

    pub(crate) fn set_descs(&self, name: A, ds: &[&Desc]) -> Result<()> {
        let raws: Vec<Raw> = ds.iter().map(|d| d.raw).collect();
        self.set(name, T::CUDNN_TYPE_BACKEND_DESCRIPTOR, &raws)
    }

    pub(crate) fn set_handle(&self, name: A, handle: sys::cudnnHandle_t) -> Result<()> {
        self.set(name, T::CUDNN_TYPE_HANDLE, &[handle])
    }

    pub(crate) fn finalize(&self) -> Result<()> {
        // SAFETY: the descriptor is live.
        let st = unsafe { (self.api.finalize)(self.raw) };
        check(self.api, st, "cudnnBackendFinalize", self.what)
    }

    /// Reads up to `out.len()` elements of attribute `name` (of type `ty`) into `out`; returns
    /// how many cuDNN has.
    fn get<V>(&self, name: A, ty: T, out: &mut [V]) -> Result<usize> {
        let mut n = 0i64;
        let ptr = if out.is_empty() {
            std::ptr::null_mut()
        } else {
            out.as_mut_ptr() as *mut c_void
        };
        // SAFETY: the descriptor is live; `out` has room for `out.len()` elements of `ty`'s C
        // type (for descriptors: created descriptors of the right type).
        let st = unsafe {
            (self.api.get)(
                self.raw,
                name as u32,
                ty as u32,
                out.len() as i64,
                &mut n,
                ptr,
            )
        };
        check(
            self.api,
            st,
            &format!("cudnnBackendGetAttribute {name:?}"),
            self.what,
        )?;
        Ok(n.max(0) as usize)
    }

    fn get_i64(&self, name: A) -> Result<i64> {
        let mut v = [0i64];
        self.get(name, T::CUDNN_TYPE_INT64, &mut v)?;
        Ok(v[0])
    }
}

impl Drop for Desc {
    fn drop(&mut self) {
        // SAFETY: `raw` was created by cudnnBackendCreateDescriptor and is destroyed only here.
        let _ = unsafe { (self.api.destroy)(self.raw) };
    }
}

/// Unique ids of a graph's tensors (the variant pack maps the real ones to device pointers).
pub(crate) mod uid {
    /// The input.
    pub const X: i64 = 1;
    /// The filter.
    pub const W: i64 = 2;
    /// The output.
    pub const Y: i64 = 3;
    /// The bias `[1, K, 1, 1(, 1)]`.
    pub const BIAS: i64 = 4;
    /// The convolution's result when pointwise nodes follow (virtual).
    pub const CONV_OUT: i64 = 5;
    /// The biased result when an activation follows the bias (virtual).
    pub const BIASED: i64 = 6;
}

/// One pointwise node: `y = mode(x[, b])`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Pointwise {
    pub mode: Pw,
    pub x: i64,
    pub b: Option<i64>,
    pub y: i64,
}

/// The pointwise mode of an activation (`None` for the identity).
pub(crate) fn act_mode(act: Activation) -> Option<Pw> {
    match act {
        Activation::None => None,
        Activation::Relu => Some(Pw::CUDNN_POINTWISE_RELU_FWD),
        Activation::GeluErf => Some(Pw::CUDNN_POINTWISE_GELU_FWD),
        Activation::GeluTanh => Some(Pw::CUDNN_POINTWISE_GELU_APPROX_TANH_FWD),
    }
}

/// The uid the convolution writes and the pointwise nodes after it: the bias add, then the
/// activation, the last one writing [`uid::Y`].
pub(crate) fn pointwise_chain(bias: bool, act: Activation) -> (i64, Vec<Pointwise>) {
    let mut steps = vec![];
    if bias {
        steps.push((Pw::CUDNN_POINTWISE_ADD, Some(uid::BIAS)));
    }
    if let Some(m) = act_mode(act) {
        steps.push((m, None));
    }
    let n = steps.len();
    let conv_out = if n == 0 { uid::Y } else { uid::CONV_OUT };
    let mut cur = conv_out;
    let nodes = steps
        .into_iter()
        .enumerate()
        .map(|(i, (mode, b))| {
            let y = if i + 1 == n { uid::Y } else { uid::BIASED };
            let node = Pointwise { mode, x: cur, b, y };
            cur = y;
            node
        })
        .collect();
    (conv_out, nodes)
}

/// The uids a call binds, in the order of [`GraphPlan::execute`]'s pointers.
pub(crate) fn variant_uids(bias: bool) -> Vec<i64> {
    let mut v = vec![uid::X, uid::W, uid::Y];
    if bias {
        v.push(uid::BIAS);
    }
    v
}

/// Dims and strides (N, C, spatial order; memory order from `nhwc`) of the tensor `id` of `d`.
pub(crate) fn dims_strides(d: &DnnDesc, id: i64) -> (Vec<i64>, Vec<i64>) {
    let dims: Vec<i32> = match id {
        uid::X => d.x.clone(),
        uid::W => d.w.clone(),
        uid::BIAS => {
            let mut b = vec![1; d.y.len()];
            b[1] = d.y[1];
            b
        }
        _ => d.y.clone(),
    };
    let st = strides(&dims, d.nhwc);
    (
        dims.iter().map(|&v| v as i64).collect(),
        st.iter().map(|&v| v as i64).collect(),
    )
}

/// Byte alignment the plans are made for; a call whose pointers are less aligned runs the legacy
/// path instead.
pub(crate) const ALIGNMENT: u64 = 16;

/// Whether the graph path covers `d` (convolution forward in f16, bf16 or f32).
pub(crate) fn covers(d: &DnnDesc) -> bool {
    use rustytorch_codegen::cuda::dnn::DnnKind;
    d.kind == DnnKind::ConvForward
        && matches!(d.dtype, DType::F16 | DType::BF16 | DType::F32)
        && d.pool.is_none()
}

pub(crate) fn data_type(d: DType) -> sys::cudnnDataType_t {
    match d {
        DType::F16 => sys::cudnnDataType_t::CUDNN_DATA_HALF,
        DType::BF16 => sys::cudnnDataType_t::CUDNN_DATA_BFLOAT16,
        _ => sys::cudnnDataType_t::CUDNN_DATA_FLOAT,
    }
}

/// The operation graph of one [`DnnDesc`] with every descriptor it references (kept alive as
/// long as a plan made from it).
pub(crate) struct OpGraph {
    graph: Desc,
    _parts: Vec<Desc>,
}

impl OpGraph {
    /// An operation graph of `handle` over `ops` (in order), keeping `parts` (tensors, node
    /// descriptors, the operations) alive with it.
    pub(crate) fn new(
        handle: sys::cudnnHandle_t,
        ops: &[&Desc],
        parts: Vec<Desc>,
    ) -> Result<OpGraph> {
        let graph = Desc::new(
            D::CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR,
            "operation graph",
        )?;
        graph.set_handle(A::CUDNN_ATTR_OPERATIONGRAPH_HANDLE, handle)?;
        graph.set_descs(A::CUDNN_ATTR_OPERATIONGRAPH_OPS, ops)?;
        graph.finalize()?;
        Ok(OpGraph {
            graph,
            _parts: parts,
        })
    }

    /// The graph keeping `parts` alive (descriptors made before the graph).
    pub(crate) fn with_parts(mut self, parts: Vec<Desc>) -> OpGraph {
        self._parts = parts;
        self
    }
}

fn tensor(d: &DnnDesc, id: i64) -> Result<Desc> {
    let t = Desc::new(D::CUDNN_BACKEND_TENSOR_DESCRIPTOR, "tensor")?;
    let (dims, st) = dims_strides(d, id);
    let virt = id == uid::CONV_OUT || id == uid::BIASED;
    // Intermediates stay in the compute type (f32), as cudnn-frontend makes them.
    let dt = if virt {
        sys::cudnnDataType_t::CUDNN_DATA_FLOAT
    } else {
        data_type(d.dtype)
    };
    t.set(
        A::CUDNN_ATTR_TENSOR_DATA_TYPE,
        T::CUDNN_TYPE_DATA_TYPE,
        &[dt],
    )?;
    t.set_i64(A::CUDNN_ATTR_TENSOR_DIMENSIONS, &dims)?;
    t.set_i64(A::CUDNN_ATTR_TENSOR_STRIDES, &st)?;
    t.set_i64(A::CUDNN_ATTR_TENSOR_UNIQUE_ID, &[id])?;
    t.set_i64(A::CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, &[ALIGNMENT as i64])?;
    t.set(
        A::CUDNN_ATTR_TENSOR_IS_VIRTUAL,
        T::CUDNN_TYPE_BOOLEAN,
        &[virt],
    )?;
    t.finalize()?;
    Ok(t)
}

fn op_graph(handle: sys::cudnnHandle_t, d: &DnnDesc) -> Result<OpGraph> {
    let (conv_out, chain) = pointwise_chain(d.bias, d.act);
    let mut ids = vec![uid::X, uid::W, conv_out];
    for n in &chain {
        ids.extend(n.b);
        ids.push(n.y);
    }
    ids.sort_unstable();
    ids.dedup();
    let tensors: Vec<(i64, Desc)> = ids
        .iter()
        .map(|&id| Ok((id, tensor(d, id)?)))
        .collect::<Result<_>>()?;
    let t = |id: i64| {
        &tensors
            .iter()
            .find(|(i, _)| *i == id)
            .expect("made above")
            .1
    };

    let conv = Desc::new(D::CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR, "convolution")?;
    let i64s = |v: &[i32]| v.iter().map(|&x| x as i64).collect::<Vec<_>>();
    conv.set(
        A::CUDNN_ATTR_CONVOLUTION_COMP_TYPE,
        T::CUDNN_TYPE_DATA_TYPE,
        &[sys::cudnnDataType_t::CUDNN_DATA_FLOAT],
    )?;
    conv.set(
        A::CUDNN_ATTR_CONVOLUTION_CONV_MODE,
        T::CUDNN_TYPE_CONVOLUTION_MODE,
        &[sys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION],
    )?;
    conv.set_i64(
        A::CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS,
        &[d.spatial() as i64],
    )?;
    conv.set_i64(A::CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS, &i64s(&d.pad))?;
    conv.set_i64(A::CUDNN_ATTR_CONVOLUTION_POST_PADDINGS, &i64s(&d.pad))?;
    conv.set_i64(A::CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES, &i64s(&d.stride))?;
    conv.set_i64(A::CUDNN_ATTR_CONVOLUTION_DILATIONS, &i64s(&d.dilation))?;
    conv.finalize()?;

    let fwd = Desc::new(
        D::CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR,
        "convolution forward",
    )?;
    fwd.set_descs(A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_X, &[t(uid::X)])?;
    fwd.set_descs(A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_W, &[t(uid::W)])?;
    fwd.set_descs(
        A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y,
        &[t(conv_out)],
    )?;
    fwd.set_descs(
        A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_CONV_DESC,
        &[&conv],
    )?;
    fwd.set(
        A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA,
        T::CUDNN_TYPE_FLOAT,
        &[1.0f32],
    )?;
    fwd.set(
        A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_BETA,
        T::CUDNN_TYPE_FLOAT,
        &[0.0f32],
    )?;
    fwd.finalize()?;

    let mut ops = vec![fwd];
    let mut modes = vec![];
    for n in &chain {
        let pw = Desc::new(D::CUDNN_BACKEND_POINTWISE_DESCRIPTOR, "pointwise")?;
        pw.set(
            A::CUDNN_ATTR_POINTWISE_MODE,
            T::CUDNN_TYPE_POINTWISE_MODE,
            &[n.mode],
        )?;
        pw.set(
            A::CUDNN_ATTR_POINTWISE_MATH_PREC,
            T::CUDNN_TYPE_DATA_TYPE,
            &[sys::cudnnDataType_t::CUDNN_DATA_FLOAT],
        )?;
        pw.finalize()?;
        let op = Desc::new(
            D::CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR,
            "pointwise operation",
        )?;
        op.set_descs(A::CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, &[&pw])?;
        op.set_descs(A::CUDNN_ATTR_OPERATION_POINTWISE_XDESC, &[t(n.x)])?;
        if let Some(b) = n.b {
            op.set_descs(A::CUDNN_ATTR_OPERATION_POINTWISE_BDESC, &[t(b)])?;
        }
        op.set_descs(A::CUDNN_ATTR_OPERATION_POINTWISE_YDESC, &[t(n.y)])?;
        op.finalize()?;
        ops.push(op);
        modes.push(pw);
    }

    let graph = OpGraph::new(handle, &ops.iter().collect::<Vec<_>>(), vec![])?;
    let mut parts: Vec<Desc> = tensors.into_iter().map(|(_, t)| t).collect();
    parts.push(conv);
    parts.extend(ops);
    parts.extend(modes);
    Ok(graph.with_parts(parts))
}

/// A tensor descriptor: uid `id` of type `dt` with `dims` and `strides`; `is_virtual` for an
/// intermediate that never reaches memory, `by_value` for a scalar the variant pack passes as a
/// host value.
pub(crate) fn tensor_desc(
    id: i64,
    dt: sys::cudnnDataType_t,
    dims: &[i64],
    strides: &[i64],
    is_virtual: bool,
    by_value: bool,
) -> Result<Desc> {
    let t = Desc::new(D::CUDNN_BACKEND_TENSOR_DESCRIPTOR, "tensor")?;
    t.set(
        A::CUDNN_ATTR_TENSOR_DATA_TYPE,
        T::CUDNN_TYPE_DATA_TYPE,
        &[dt],
    )?;
    t.set_i64(A::CUDNN_ATTR_TENSOR_DIMENSIONS, dims)?;
    t.set_i64(A::CUDNN_ATTR_TENSOR_STRIDES, strides)?;
    t.set_i64(A::CUDNN_ATTR_TENSOR_UNIQUE_ID, &[id])?;
    t.set_i64(A::CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, &[ALIGNMENT as i64])?;
    t.set(
        A::CUDNN_ATTR_TENSOR_IS_VIRTUAL,
        T::CUDNN_TYPE_BOOLEAN,
        &[is_virtual],
    )?;
    if by_value {
        t.set(
            A::CUDNN_ATTR_TENSOR_IS_BY_VALUE,
            T::CUDNN_TYPE_BOOLEAN,
            &[true],
        )?;
    }
    t.finalize()?;
    Ok(t)
}

/// A pointwise operation `y = mode(x[, b][, t])` computed in `prec` (`t`: the condition of a
/// binary select; `axis`: the axis of a GEN_INDEX). Returns the operation and its mode
/// descriptor (both to be kept alive with the graph).
pub(crate) fn pointwise_node(
    mode: Pw,
    prec: sys::cudnnDataType_t,
    axis: Option<i64>,
    x: &Desc,
    b: Option<&Desc>,
    t: Option<&Desc>,
    y: &Desc,
) -> Result<[Desc; 2]> {
    let pw = Desc::new(D::CUDNN_BACKEND_POINTWISE_DESCRIPTOR, "pointwise")?;
    pw.set(
        A::CUDNN_ATTR_POINTWISE_MODE,
        T::CUDNN_TYPE_POINTWISE_MODE,
        &[mode],
    )?;
    pw.set(
        A::CUDNN_ATTR_POINTWISE_MATH_PREC,
        T::CUDNN_TYPE_DATA_TYPE,
        &[prec],
    )?;
    if let Some(a) = axis {
        pw.set_i64(A::CUDNN_ATTR_POINTWISE_AXIS, &[a])?;
    }
    pw.finalize()?;
    let op = Desc::new(
        D::CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR,
        "pointwise operation",
    )?;
    op.set_descs(A::CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, &[&pw])?;
    op.set_descs(A::CUDNN_ATTR_OPERATION_POINTWISE_XDESC, &[x])?;
    if let Some(b) = b {
        op.set_descs(A::CUDNN_ATTR_OPERATION_POINTWISE_BDESC, &[b])?;
    }
    if let Some(t) = t {
        op.set_descs(A::CUDNN_ATTR_OPERATION_POINTWISE_TDESC, &[t])?;
    }
    op.set_descs(A::CUDNN_ATTR_OPERATION_POINTWISE_YDESC, &[y])?;
    op.finalize()?;
    Ok([op, pw])
}

/// A batched matmul operation `c = a·b` computed in f32 (and its matmul descriptor).
pub(crate) fn matmul_node(a: &Desc, b: &Desc, c: &Desc) -> Result<[Desc; 2]> {
    matmul_node_with(a, b, c, [None; 3])
}

/// [`matmul_node`] with the GEMM's M, N and K overridden per batch by int32 tensors (`[m, n,
/// k]`, each optional; the padding form of cudnn-frontend's attention matmuls).
pub(crate) fn matmul_node_with(
    a: &Desc,
    b: &Desc,
    c: &Desc,
    overrides: [Option<&Desc>; 3],
) -> Result<[Desc; 2]> {
    let mm = Desc::new(D::CUDNN_BACKEND_MATMUL_DESCRIPTOR, "matmul")?;
    mm.set(
        A::CUDNN_ATTR_MATMUL_COMP_TYPE,
        T::CUDNN_TYPE_DATA_TYPE,
        &[sys::cudnnDataType_t::CUDNN_DATA_FLOAT],
    )?;
    mm.finalize()?;
    let op = Desc::new(
        D::CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR,
        "matmul operation",
    )?;
    op.set_descs(A::CUDNN_ATTR_OPERATION_MATMUL_ADESC, &[a])?;
    op.set_descs(A::CUDNN_ATTR_OPERATION_MATMUL_BDESC, &[b])?;
    op.set_descs(A::CUDNN_ATTR_OPERATION_MATMUL_CDESC, &[c])?;
    op.set_descs(A::CUDNN_ATTR_OPERATION_MATMUL_DESC, &[&mm])?;
    let names = [
        A::CUDNN_ATTR_OPERATION_MATMUL_GEMM_M_OVERRIDE_DESC,
        A::CUDNN_ATTR_OPERATION_MATMUL_GEMM_N_OVERRIDE_DESC,
        A::CUDNN_ATTR_OPERATION_MATMUL_GEMM_K_OVERRIDE_DESC,
    ];
    for (name, t) in names.into_iter().zip(overrides) {
        if let Some(t) = t {
            op.set_descs(name, &[t])?;
        }
    }
    op.finalize()?;
    Ok([op, mm])
}

/// A reduction operation `y = reduce(x)` over the dims where `y` has extent 1, in f32 (and its
/// reduction descriptor).
pub(crate) fn reduction_node(
    how: sys::cudnnReduceTensorOp_t,
    x: &Desc,
    y: &Desc,
) -> Result<[Desc; 2]> {
    let red = Desc::new(D::CUDNN_BACKEND_REDUCTION_DESCRIPTOR, "reduction")?;
    red.set(
        A::CUDNN_ATTR_REDUCTION_OPERATOR,
        T::CUDNN_TYPE_REDUCTION_OPERATOR_TYPE,
        &[how],
    )?;
    red.set(
        A::CUDNN_ATTR_REDUCTION_COMP_TYPE,
        T::CUDNN_TYPE_DATA_TYPE,
        &[sys::cudnnDataType_t::CUDNN_DATA_FLOAT],
    )?;
    red.finalize()?;
    let op = Desc::new(
        D::CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR,
        "reduction operation",
    )?;
    op.set_descs(A::CUDNN_ATTR_OPERATION_REDUCTION_XDESC, &[x])?;
    op.set_descs(A::CUDNN_ATTR_OPERATION_REDUCTION_YDESC, &[y])?;
    op.set_descs(A::CUDNN_ATTR_OPERATION_REDUCTION_DESC, &[&red])?;
    op.finalize()?;
    Ok([op, red])
}

/// A reshape operation: `y` is `x` seen through `y`'s dims, strides and type (cuDNN's
/// RESHAPE; the fused attention backward spells its transposes of virtual tensors so).
pub(crate) fn reshape_node(x: &Desc, y: &Desc) -> Result<Desc> {
    let op = Desc::new(
        D::CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR,
        "reshape operation",
    )?;
    op.set_descs(A::CUDNN_ATTR_OPERATION_RESHAPE_XDESC, &[x])?;
    op.set_descs(A::CUDNN_ATTR_OPERATION_RESHAPE_YDESC, &[y])?;
    op.finalize()?;
    Ok(op)
}

/// Numerical notes that rule an engine out: inputs converted down always; tensor cores for f32
/// unless TF32 is allowed (they would compute in TF32).
pub(crate) fn excluded_note(note: i32, dtype: DType, tf32: bool) -> bool {
    use sys::cudnnBackendNumericalNote_t as N;
    note == N::CUDNN_NUMERICAL_NOTE_DOWN_CONVERT_INPUTS as i32
        || (dtype == DType::F32 && !tf32 && note == N::CUDNN_NUMERICAL_NOTE_TENSOR_CORE as i32)
}

/// A finalized execution plan of one engine configuration.
pub(crate) struct GraphPlan {
    plan: Desc,
    /// Bytes of workspace the plan needs.
    pub workspace: usize,
    /// cuDNN's global index of the engine (for logs).
    pub engine: i64,
    /// The configuration's place among those the heuristics proposed for the graph (mode A's
    /// in order, then the fallback list's): with its knobs, what tells two plans of one engine
    /// apart (such as its Hopper and its Ampere kernels), and stable for the same graph, so a
    /// choice is remembered by it.
    pub config: usize,
    uids: Vec<i64>,
    /// By-value scalars: uid and the host copy (32 bits) the variant pack points to.
    scalars: Vec<(i64, Box<u32>)>,
    /// The variant pack of the last call, reused while the pointers stay the same.
    pack: Option<(Vec<u64>, u64, Desc)>,
    _graph: Arc<OpGraph>,
}

// SAFETY: see `Desc`; the shared op graph is never mutated after it is finalized.
unsafe impl Send for GraphPlan {}
// SAFETY: as for Send.
unsafe impl Send for OpGraph {}
// SAFETY: as for Send.
unsafe impl Sync for OpGraph {}

/// The engine's global index and whether its numerical notes allow it.
fn engine_of(cfg: &Desc, dtype: DType, tf32: bool) -> Result<(i64, bool)> {
    let engine = Desc::new(D::CUDNN_BACKEND_ENGINE_DESCRIPTOR, "engine")?;
    let mut raw = [engine.raw];
    cfg.get(
        A::CUDNN_ATTR_ENGINECFG_ENGINE,
        T::CUDNN_TYPE_BACKEND_DESCRIPTOR,
        &mut raw,
    )?;
    let index = engine.get_i64(A::CUDNN_ATTR_ENGINE_GLOBAL_INDEX)?;
    let mut notes = [0i32; 32];
    let n = engine.get(
        A::CUDNN_ATTR_ENGINE_NUMERICAL_NOTE,
        T::CUDNN_TYPE_NUMERICAL_NOTE,
        &mut notes,
    )?;
    let ok = !notes[..n.min(notes.len())]
        .iter()
        .any(|&note| excluded_note(note, dtype, tf32));
    Ok((index, ok))
}

/// The engine configurations of heuristics mode `mode` (empty when the mode has none).
fn heuristics(graph: &Desc, mode: sys::cudnnBackendHeurMode_t) -> Result<Vec<Desc>> {
    let heur = Desc::new(D::CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, "engine heuristics")?;
    heur.set_descs(A::CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, &[graph])?;
    heur.set(
        A::CUDNN_ATTR_ENGINEHEUR_MODE,
        T::CUDNN_TYPE_HEUR_MODE,
        &[mode],
    )?;
    heur.finalize()?;
    let count = heur.get::<Raw>(
        A::CUDNN_ATTR_ENGINEHEUR_RESULTS,
        T::CUDNN_TYPE_BACKEND_DESCRIPTOR,
        &mut [],
    )?;
    let cfgs: Vec<Desc> = (0..count)
        .map(|_| Desc::new(D::CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, "engine config"))
        .collect::<Result<_>>()?;
    let mut raws: Vec<Raw> = cfgs.iter().map(|c| c.raw).collect();
    let got = heur.get(
        A::CUDNN_ATTR_ENGINEHEUR_RESULTS,
        T::CUDNN_TYPE_BACKEND_DESCRIPTOR,
        &mut raws,
    )?;
    Ok(cfgs.into_iter().take(got).collect())
}

/// Plans for `d`: those of the first engine configurations (heuristics mode A, then the
/// fallback list) that finalize, that no numerical note rules out and whose workspace fits
/// [`WORKSPACE_LIMIT`], at most `max`. An error when the graph itself is refused (no engine
/// supports its pattern); an empty list when no configuration makes a plan.
pub(crate) fn plans(
    handle: sys::cudnnHandle_t,
    d: &DnnDesc,
    tf32: bool,
    max: usize,
) -> Result<Vec<GraphPlan>> {
    let graph = op_graph(handle, d)?;
    plans_of(
        handle,
        graph,
        variant_uids(d.bias),
        vec![],
        d.dtype,
        tf32,
        max,
        &format!("{d:?}"),
    )
}

/// Plans of any operation graph (see [`plans`]): `uids` are the tensors a call binds to device
/// pointers, `scalars` the by-value ones with their values' 32 bits (an f32's or an i32's, as
/// their descriptors say; bound to host copies the plan keeps);
/// `what` names the graph in logs.
#[allow(clippy::too_many_arguments)]
pub(crate) fn plans_of(
    handle: sys::cudnnHandle_t,
    graph: OpGraph,
    uids: Vec<i64>,
    scalars: Vec<(i64, u32)>,
    dtype: DType,
    tf32: bool,
    max: usize,
    what: &str,
) -> Result<Vec<GraphPlan>> {
    let graph = Arc::new(graph);
    let d = what;
    let mut out: Vec<GraphPlan> = vec![];
    let mut seen = vec![];
    let mut ordinal = 0usize;
    for mode in [
        sys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_A,
        sys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_FALLBACK,
    ] {
        let cfgs = match heuristics(&graph.graph, mode) {
            Ok(c) => c,
            Err(e) => {
                tracing::debug!("cuDNN heuristics {mode:?} for {d}: {e}");
                continue;
            }
        };
        for cfg in cfgs {
            if out.len() >= max {
                return Ok(out);
            }
            let config = ordinal;
            ordinal += 1;
            let Ok((engine, ok)) = engine_of(&cfg, dtype, tf32) else {
                continue;
            };
            // The fallback list repeats engines that mode A returned (with default knobs).
            if !ok
                || (mode == sys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_FALLBACK
                    && seen.contains(&engine))
            {
                continue;
            }
            let plan = Desc::new(D::CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, "execution plan")?;
            plan.set_handle(A::CUDNN_ATTR_EXECUTION_PLAN_HANDLE, handle)?;
            plan.set_descs(A::CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, &[&cfg])?;
            if let Err(e) = plan.finalize() {
                tracing::trace!("cuDNN engine {engine} refused {d}: {e}");
                continue;
            }
            let ws = plan.get_i64(A::CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE)?;
            if ws < 0 || ws as usize > WORKSPACE_LIMIT {
                continue;
            }
            seen.push(engine);
            out.push(GraphPlan {
                plan,
                workspace: ws as usize,
                engine,
                config,
                uids: uids.clone(),
                scalars: scalars.iter().map(|&(u, v)| (u, Box::new(v))).collect(),
                pack: None,
                _graph: graph.clone(),
            });
        }
    }
    Ok(out)
}

impl GraphPlan {
    /// Whether every pointer (and the workspace) has the alignment the plan was made for.
    pub(crate) fn aligned(ptrs: &[u64], workspace: u64) -> bool {
        ptrs.iter().chain([&workspace]).all(|&p| p % ALIGNMENT == 0)
    }

    /// Runs the plan on `handle`'s stream with the tensors at `ptrs` (in [`variant_uids`]
    /// order) and `workspace` (at least [`GraphPlan::workspace`] bytes).
    pub(crate) fn execute(
        &mut self,
        handle: sys::cudnnHandle_t,
        ptrs: &[u64],
        workspace: u64,
    ) -> Result<()> {
        if ptrs.len() != self.uids.len() {
            return Err(RuntimeError::Invalid(format!(
                "cuDNN graph call: {} pointers for {} tensors",
                ptrs.len(),
                self.uids.len()
            )));
        }
        let fresh = !matches!(&self.pack, Some((p, w, _)) if p == ptrs && *w == workspace);
        if fresh {
            let pack = Desc::new(D::CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, "variant pack")?;
            let mut data: Vec<*mut c_void> = ptrs.iter().map(|&p| p as *mut c_void).collect();
            let mut uids = self.uids.clone();
            for (u, v) in &self.scalars {
                uids.push(*u);
                // The boxed value lives (at a fixed address) as long as the plan and its pack.
                data.push(&**v as *const u32 as *mut c_void);
            }
            pack.set_i64(A::CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, &uids)?;
            pack.set(
                A::CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS,
                T::CUDNN_TYPE_VOID_PTR,
                &data,
            )?;
            pack.set(
                A::CUDNN_ATTR_VARIANT_PACK_WORKSPACE,
                T::CUDNN_TYPE_VOID_PTR,
                &[workspace as *mut c_void],
            )?;
            pack.finalize()?;
            self.pack = Some((ptrs.to_vec(), workspace, pack));
        }
        let pack = &self.pack.as_ref().expect("made above").2;
        let api = self.plan.api;
        // SAFETY: the handle, plan and variant pack are live and finalized; the pack's pointers
        // address the call's tensors, whose sizes the plan's descriptors fix, and a workspace of
        // at least `self.workspace` bytes (the caller's contract).
        let st = unsafe { (api.execute)(handle as Raw, self.plan.raw, pack.raw) };
        check(
            api,
            st,
            "cudnnBackendExecute",
            &format!("execution plan of engine {}", self.engine),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustytorch_codegen::cuda::dnn::{DnnDesc, DnnKind};
    use rustytorch_codegen::cuda::ArgRef;

    fn desc(nhwc: bool, bias: bool, act: Activation) -> DnnDesc {
        DnnDesc {
            kind: DnnKind::ConvForward,
            dtype: DType::F16,
            x: vec![2, 16, 5, 6, 7],
            w: vec![32, 8, 3, 3, 3],
            y: vec![2, 32, 5, 6, 7],
            pad: vec![1, 1, 1],
            stride: vec![1, 1, 1],
            dilation: vec![1, 1, 1],
            groups: 2,
            bias,
            act,
            pool: None,
            nhwc,
            x_at: ArgRef::Input(0),
            w_at: ArgRef::Input(1),
            y_at: ArgRef::Output,
            staging_bytes: 0,
        }
    }

    #[test]
    fn tensor_dims_and_strides() {
        let d = desc(true, true, Activation::Relu);
        // NDHWC: C innermost.
        assert_eq!(
            dims_strides(&d, uid::X),
            (vec![2, 16, 5, 6, 7], vec![3360, 1, 672, 112, 16])
        );
        // KTRSC filter with C/groups = 8 channels.
        assert_eq!(
            dims_strides(&d, uid::W),
            (vec![32, 8, 3, 3, 3], vec![216, 1, 72, 24, 8])
        );
        // The bias broadcasts over N and the spatial dims.
        assert_eq!(
            dims_strides(&d, uid::BIAS),
            (vec![1, 32, 1, 1, 1], vec![32, 1, 32, 32, 32])
        );
        let d = desc(false, false, Activation::None);
        assert_eq!(
            dims_strides(&d, uid::Y),
            (vec![2, 32, 5, 6, 7], vec![6720, 210, 42, 7, 1])
        );
        assert_eq!(dims_strides(&d, uid::CONV_OUT), dims_strides(&d, uid::Y));
    }

    #[test]
    fn pointwise_nodes_per_bias_and_activation() {
        assert_eq!(pointwise_chain(false, Activation::None), (uid::Y, vec![]));
        let add = |x, y| Pointwise {
            mode: Pw::CUDNN_POINTWISE_ADD,
            x,
            b: Some(uid::BIAS),
            y,
        };
        let act = |mode, x| Pointwise {
            mode,
            x,
            b: None,
            y: uid::Y,
        };
        assert_eq!(
            pointwise_chain(true, Activation::None),
            (uid::CONV_OUT, vec![add(uid::CONV_OUT, uid::Y)])
        );
        assert_eq!(
            pointwise_chain(false, Activation::Relu),
            (
                uid::CONV_OUT,
                vec![act(Pw::CUDNN_POINTWISE_RELU_FWD, uid::CONV_OUT)]
            )
        );
        assert_eq!(
            pointwise_chain(true, Activation::GeluTanh),
            (
                uid::CONV_OUT,
                vec![
                    add(uid::CONV_OUT, uid::BIASED),
                    act(Pw::CUDNN_POINTWISE_GELU_APPROX_TANH_FWD, uid::BIASED)
                ]
            )
        );
    }

    #[test]
    fn activation_modes() {
        assert_eq!(act_mode(Activation::None), None);
        assert_eq!(
            act_mode(Activation::Relu),
            Some(Pw::CUDNN_POINTWISE_RELU_FWD)
        );
        assert_eq!(
            act_mode(Activation::GeluErf),
            Some(Pw::CUDNN_POINTWISE_GELU_FWD)
        );
        assert_eq!(
            act_mode(Activation::GeluTanh),
            Some(Pw::CUDNN_POINTWISE_GELU_APPROX_TANH_FWD)
        );
    }

    #[test]
    fn variant_pack_uids() {
        assert_eq!(variant_uids(false), vec![uid::X, uid::W, uid::Y]);
        assert_eq!(variant_uids(true), vec![uid::X, uid::W, uid::Y, uid::BIAS]);
    }

    #[test]
    fn numerical_notes_and_alignment() {
        use sys::cudnnBackendNumericalNote_t as N;
        let tc = N::CUDNN_NUMERICAL_NOTE_TENSOR_CORE as i32;
        let down = N::CUDNN_NUMERICAL_NOTE_DOWN_CONVERT_INPUTS as i32;
        assert!(excluded_note(tc, DType::F32, false));
        assert!(!excluded_note(tc, DType::F32, true));
        assert!(!excluded_note(tc, DType::F16, false));
        assert!(excluded_note(down, DType::BF16, true));
        assert!(GraphPlan::aligned(&[256, 512], 1024));
        assert!(!GraphPlan::aligned(&[256, 514], 1024));
        assert!(!GraphPlan::aligned(&[256], 8));
    }

    #[test]
    fn covers_forward_convolutions_in_float_types() {
        assert!(covers(&desc(true, false, Activation::None)));
        let mut d = desc(false, false, Activation::None);
        d.dtype = DType::F64;
        assert!(!covers(&d));
        d.dtype = DType::F32;
        d.kind = DnnKind::ConvBackwardData;
        assert!(!covers(&d));
    }
}
