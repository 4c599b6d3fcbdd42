//! Attention forward through cuDNN's fused attention: the operation graph of one
//! [`AttnDnnDesc`] in the form cudnn-frontend gives its SDPA node (the form cuDNN's fused
//! attention engines recognize), its plans, and the choice between them and the flash kernel.
//!
//! The graph, every intermediate virtual (f32 unless noted):
//!
//! 1. `S = Q·Kᵀ` (MATMUL; Kᵀ is k's descriptor with its last two strides swapped);
//! 2. `S ·= scale` (POINTWISE MUL by a by-value f32);
//! 3. causal: `row = GEN_INDEX(S, 2)`, `col = GEN_INDEX(S, 3)` (int32), for bottom-right
//!    alignment `row = row + Sk − Sq` (an ADD of Sk then a SUB of Sq, by-value int32s, as the
//!    frontend spells it), `keep = row >= col` (CMP_GE, boolean), `S = keep ? S : lowest f32`
//!    (BINARY_SELECT); a top-left mask, and a bottom-right one with `Sq <= Sk` (the only one
//!    eligible), leave key 0 visible to every row, so no row is fully masked;
//! 4. softmax: `m = max_j S` (REDUCTION MAX), `E = exp(S − m)`, `l = Σ_j E` (REDUCTION ADD), the
//!    statistics `m + log l` (a virtual output, as the frontend's inference graph keeps it), and
//!    `P = E / l` in the operands' type (the second product's A must be f16/bf16);
//! 5. `O = P·V` (MATMUL) into the output, in the op's layout (strides, no copies).
//!
//! [`prepare`] builds the plans once per step; [`choose`] times the fastest cuDNN plan against
//! the flash kernel on buffers of its own (filled with ones) and caches the outcome per
//! description for the process (`RUSTYTORCH_ATTENTION=cudnn|flash` forces one).
//!
//! cuDNN 9.14's SDPA backward graph (dQ, dK, dV from Q, K, V, O, dO and the statistics) would
//! cover the same shapes, but it produces the three gradients in one call while `AttentionGrad`
//! is one op per gradient and needs the forward's statistics, which this graph keeps virtual: the
//! gradients stay on the generated kernels.

use super::dnn::{time, Buffers};
use super::dnn_graph::{
    data_type, matmul_node, plans_of, pointwise_node, reduction_node, tensor_desc, Desc, GraphPlan,
    OpGraph,
};
use crate::{Result, RuntimeError};
use cudarc::cudnn::sys;
use cudarc::driver::sys as ds;
use rustytorch_codegen::cuda::attention_cudnn::Choice;
use rustytorch_codegen::cuda::AttnDnnDesc;
use rustytorch_ops::Causal;
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use sys::cudnnDataType_t as Dt;
use sys::cudnnPointwiseMode_t as Pw;

/// Unique ids of the attention graph's tensors.
pub(crate) mod uid {
    /// Queries.
    pub const Q: i64 = 1;
    /// Keys (as Kᵀ).
    pub const K: i64 = 2;
    /// Values.
    pub const V: i64 = 3;
    /// The output.
    pub const O: i64 = 4;
    /// The scale (by value).
    pub const SCALE: i64 = 5;
    /// The masked-score fill (by value).
    pub const FILL: i64 = 6;
    /// Sk, added to the row index for bottom-right alignment (by value, int32).
    pub const SK: i64 = 7;
    /// Sq, subtracted from it (by value, int32).
    pub const SQ: i64 = 8;
    /// Virtual intermediates take the ids after this one.
    pub const S: i64 = 10;
}

/// Plans tried per description (the first ones the heuristics rank).
const MAX_PLANS: usize = 4;

/// The uids a call binds to device pointers, in [`GraphPlan::execute`]'s order.
pub(crate) const VARIANT: [i64; 4] = [uid::Q, uid::K, uid::V, uid::O];

fn f32_dims(dims: [i64; 4]) -> [i64; 4] {
    [dims[1] * dims[2] * dims[3], dims[2] * dims[3], dims[3], 1]
}

/// The operation graph of `d` (see the module docs); `p_io` makes `P` the operands' type (the
/// frontend's form) rather than f32.
fn op_graph(handle: sys::cudnnHandle_t, d: &AttnDnnDesc, p_io: bool) -> Result<OpGraph> {
    let io = data_type(d.dtype);
    let f = Dt::CUDNN_DATA_FLOAT;
    let (b, h, sq, sk) = (d.b as i64, d.h as i64, d.sq as i64, d.sk as i64);
    let s_dims = [b, h, sq, sk];
    let s_st = f32_dims(s_dims);
    let r_dims = [b, h, sq, 1];
    let r_st = f32_dims(r_dims);
    let one = [1i64; 4];

    let (qd, qs) = d.dims_strides(d.sq);
    let (kd, ks) = d.k_transposed();
    let (vd, vs) = d.dims_strides(d.sk);
    let mut parts: Vec<Desc> = vec![];
    let mut next = uid::S;
    let mut virt = |dt: Dt, dims: &[i64], st: &[i64]| {
        next += 1;
        tensor_desc(next, dt, dims, st, true, false)
    };

    let q = tensor_desc(uid::Q, io, &qd, &qs, false, false)?;
    let k = tensor_desc(uid::K, io, &kd, &ks, false, false)?;
    let v = tensor_desc(uid::V, io, &vd, &vs, false, false)?;
    let o = tensor_desc(uid::O, io, &qd, &qs, false, false)?;
    let scale = tensor_desc(uid::SCALE, f, &one, &one, false, true)?;
    let s = virt(f, &s_dims, &s_st)?;
    let scaled = virt(f, &s_dims, &s_st)?;
    let mut ops: Vec<[Desc; 2]> = vec![
        matmul_node(&q, &k, &s)?,
        pointwise_node(
            Pw::CUDNN_POINTWISE_MUL,
            f,
            None,
            &s,
            Some(&scale),
            None,
            &scaled,
        )?,
    ];
    let mut scores = scaled;
    let mut tensors = vec![q, k, scale, s];
    if d.causal != Causal::None {
        let mut row = virt(Dt::CUDNN_DATA_INT32, &s_dims, &s_st)?;
        let col = virt(Dt::CUDNN_DATA_INT32, &s_dims, &s_st)?;
        let keep = virt(Dt::CUDNN_DATA_BOOLEAN, &s_dims, &s_st)?;
        let fill = tensor_desc(uid::FILL, f, &one, &one, false, true)?;
        let masked = virt(f, &s_dims, &s_st)?;
        let int = Dt::CUDNN_DATA_INT32;
        ops.push(pointwise_node(
            Pw::CUDNN_POINTWISE_GEN_INDEX,
            int,
            Some(2),
            &scores,
            None,
            None,
            &row,
        )?);
        if d.causal == Causal::BottomRight {
            for (id, mode) in [
                (uid::SK, Pw::CUDNN_POINTWISE_ADD),
                (uid::SQ, Pw::CUDNN_POINTWISE_SUB),
            ] {
                let c = tensor_desc(id, int, &one, &one, false, true)?;
                let shifted = virt(int, &s_dims, &s_st)?;
                ops.push(pointwise_node(
                    mode,
                    int,
                    None,
                    &row,
                    Some(&c),
                    None,
                    &shifted,
                )?);
                tensors.push(std::mem::replace(&mut row, shifted));
                tensors.push(c);
            }
        }
        ops.push(pointwise_node(
            Pw::CUDNN_POINTWISE_GEN_INDEX,
            int,
            Some(3),
            &scores,
            None,
            None,
            &col,
        )?);
        ops.push(pointwise_node(
            Pw::CUDNN_POINTWISE_CMP_GE,
            Dt::CUDNN_DATA_BOOLEAN,
            None,
            &row,
            Some(&col),
            None,
            &keep,
        )?);
        ops.push(pointwise_node(
            Pw::CUDNN_POINTWISE_BINARY_SELECT,
            f,
            None,
            &scores,
            Some(&fill),
            Some(&keep),
            &masked,
        )?);
        tensors.extend([scores, row, col, keep, fill]);
        scores = masked;
    }
    let max = virt(f, &r_dims, &r_st)?;
    let sub = virt(f, &s_dims, &s_st)?;
    let exp = virt(f, &s_dims, &s_st)?;
    let sum = virt(f, &r_dims, &r_st)?;
    let log = virt(f, &r_dims, &r_st)?;
    let stats = virt(f, &r_dims, &r_st)?;
    let p = virt(if p_io { io } else { f }, &s_dims, &s_st)?;
    use sys::cudnnReduceTensorOp_t as R;
    ops.push(reduction_node(R::CUDNN_REDUCE_TENSOR_MAX, &scores, &max)?);
    ops.push(pointwise_node(
        Pw::CUDNN_POINTWISE_SUB,
        f,
        None,
        &scores,
        Some(&max),
        None,
        &sub,
    )?);
    ops.push(pointwise_node(
        Pw::CUDNN_POINTWISE_EXP,
        f,
        None,
        &sub,
        None,
        None,
        &exp,
    )?);
    ops.push(reduction_node(R::CUDNN_REDUCE_TENSOR_ADD, &exp, &sum)?);
    ops.push(pointwise_node(
        Pw::CUDNN_POINTWISE_LOG,
        f,
        None,
        &sum,
        None,
        None,
        &log,
    )?);
    ops.push(pointwise_node(
        Pw::CUDNN_POINTWISE_ADD,
        f,
        None,
        &max,
        Some(&log),
        None,
        &stats,
    )?);
    ops.push(pointwise_node(
        Pw::CUDNN_POINTWISE_DIV,
        f,
        None,
        &exp,
        Some(&sum),
        None,
        &p,
    )?);
    ops.push(matmul_node(&p, &v, &o)?);
    tensors.extend([scores, max, sub, exp, sum, log, stats, p, v, o]);

    let op_refs: Vec<&Desc> = ops.iter().map(|[op, _]| op).collect();
    let graph = OpGraph::new(handle, &op_refs, vec![])?;
    for [op, node] in ops {
        parts.push(op);
        parts.push(node);
    }
    parts.extend(tensors);
    Ok(graph.with_parts(parts))
}

/// The plans of `d`: the frontend's form of the graph first, then `P` in f32 if cuDNN refuses
/// that one. An error when neither makes a plan.
pub(crate) fn plans(handle: sys::cudnnHandle_t, d: &AttnDnnDesc) -> Result<Vec<GraphPlan>> {
    let mut errors = vec![];
    for p_io in [true, false] {
        let made = op_graph(handle, d, p_io).and_then(|g| {
            plans_of(
                handle,
                g,
                VARIANT.to_vec(),
                scalars(d),
                d.dtype,
                false,
                MAX_PLANS,
                &format!("{d:?}"),
            )
        });
        match made {
            Ok(v) if !v.is_empty() => return Ok(v),
            Ok(_) => errors.push(format!("P in {}: no engine made a plan", p_name(p_io))),
            Err(e) => errors.push(format!("P in {}: {e}", p_name(p_io))),
        }
    }
    Err(RuntimeError::Device(format!(
        "cuDNN fused attention for {d:?}: {}",
        errors.join("; ")
    )))
}

fn p_name(p_io: bool) -> &'static str {
    if p_io {
        "the operands' type"
    } else {
        "f32"
    }
}

/// The by-value scalars of `d`'s graph as 32-bit patterns: the scale (f32), and when causal the
/// fill of masked scores (the lowest finite f32, as the frontend uses), and for bottom-right
/// alignment Sk and Sq (int32).
pub(crate) fn scalars(d: &AttnDnnDesc) -> Vec<(i64, u32)> {
    let mut v = vec![(uid::SCALE, d.scale().to_bits())];
    if d.causal != Causal::None {
        v.push((uid::FILL, f32::MIN.to_bits()));
    }
    if d.causal == Causal::BottomRight {
        v.push((uid::SK, d.sk as i32 as u32));
        v.push((uid::SQ, d.sq as i32 as u32));
    }
    v
}

/// Outcome of a choice, cached per description for the process: the engine of the cuDNN plan
/// that won, or `None` for the flash kernel.
fn cache() -> &'static Mutex<HashMap<AttnDnnDesc, Option<i64>>> {
    static C: OnceLock<Mutex<HashMap<AttnDnnDesc, Option<i64>>>> = OnceLock::new();
    C.get_or_init(Default::default)
}

/// What [`prepare`] made for one step.
pub(crate) struct Prepared {
    /// Candidate plans (empty when the flash kernel is the choice or cuDNN failed).
    pub plans: Vec<GraphPlan>,
    /// Whether the choice is already known (forced, or cached from an earlier step).
    pub decided: bool,
}

impl Prepared {
    /// Bytes of workspace the largest candidate needs.
    pub(crate) fn workspace(&self) -> usize {
        self.plans.iter().map(|p| p.workspace).max().unwrap_or(0)
    }
}

/// Builds the plans of `d` under `choice`: none for [`Choice::Flash`] or a cached flash choice;
/// for [`Choice::Cudnn`] an error when cuDNN makes none; in auto mode a cuDNN failure means
/// the flash kernel (logged).
pub(crate) fn prepare(
    handle: sys::cudnnHandle_t,
    d: &AttnDnnDesc,
    choice: Choice,
) -> Result<Prepared> {
    let cached = cache().lock().expect("attention cache").get(d).copied();
    let none = |decided| Prepared {
        plans: vec![],
        decided,
    };
    match (choice, cached) {
        (Choice::Flash, _) | (Choice::Auto, Some(None)) => return Ok(none(true)),
        _ => {}
    }
    match plans(handle, d) {
        Ok(mut v) => {
            let decided = match (choice, cached) {
                (Choice::Auto, Some(Some(engine))) => {
                    // Keep the engine that won before, if it is still proposed.
                    match v.iter().position(|p| p.engine == engine) {
                        Some(i) => {
                            v = vec![v.swap_remove(i)];
                            true
                        }
                        None => false,
                    }
                }
                _ => false,
            };
            Ok(Prepared { plans: v, decided })
        }
        Err(e) if choice == Choice::Cudnn => Err(RuntimeError::Device(format!(
            "RUSTYTORCH_ATTENTION=cudnn: {e}"
        ))),
        Err(e) => {
            tracing::debug!("attention falls back to the flash kernel: {e}");
            cache()
                .lock()
                .expect("attention cache")
                .insert(d.clone(), None);
            Ok(none(true))
        }
    }
}

/// The flash launch of a step, for timing.
pub(crate) struct FlashLaunch<'a> {
    /// The compiled kernel.
    pub func: &'a cudarc::driver::CudaFunction,
    /// Blocks.
    pub grid: u32,
    /// Threads per block.
    pub block: u32,
}

/// Picks the plan to run for `d` from `p`: the only one when decided; else times each plan
/// and the flash kernel on buffers of the step's sizes and keeps the fastest (forced cuDNN keeps
/// the fastest plan). Returns `None` for the flash kernel. In auto mode a failure means flash.
pub(crate) fn choose(
    handle: sys::cudnnHandle_t,
    d: &AttnDnnDesc,
    mut p: Prepared,
    choice: Choice,
    flash: Option<FlashLaunch>,
    stream: ds::CUstream,
) -> Result<Option<GraphPlan>> {
    if p.plans.is_empty() {
        return Ok(None);
    }
    if p.decided && p.plans.len() == 1 {
        return Ok(p.plans.pop());
    }
    // A forced cuDNN needs only the fastest plan.
    let flash = flash.filter(|_| choice != Choice::Cudnn);
    let timed = time_all(handle, d, &mut p.plans, flash, stream);
    let (best, flash_ms) = match timed {
        Ok(t) => t,
        Err(e) if choice == Choice::Cudnn => return Err(e),
        Err(e) => {
            tracing::debug!("attention {d:?}: timing failed ({e}); the flash kernel runs");
            cache()
                .lock()
                .expect("attention cache")
                .insert(d.clone(), None);
            return Ok(None);
        }
    };
    let (i, ms) = best;
    let plan = p.plans.swap_remove(i);
    if choice == Choice::Cudnn || flash_ms.is_none_or(|f| ms < f) {
        tracing::debug!(
            "attention {d:?}: cuDNN engine {} ({ms:.4} ms) over flash ({flash_ms:?} ms)",
            plan.engine
        );
        if choice == Choice::Auto {
            cache()
                .lock()
                .expect("attention cache")
                .insert(d.clone(), Some(plan.engine));
        }
        Ok(Some(plan))
    } else {
        tracing::debug!(
            "attention {d:?}: flash ({flash_ms:?} ms) over cuDNN engine {} ({ms:.4} ms)",
            plan.engine
        );
        cache()
            .lock()
            .expect("attention cache")
            .insert(d.clone(), None);
        Ok(None)
    }
}

/// The index and time of the fastest plan, and the flash kernel's time.
fn time_all(
    handle: sys::cudnnHandle_t,
    d: &AttnDnnDesc,
    plans: &mut [GraphPlan],
    flash: Option<FlashLaunch>,
    stream: ds::CUstream,
) -> Result<((usize, f32), Option<f32>)> {
    let ws = plans.iter().map(|g| g.workspace).max().unwrap_or(0);
    let bufs = Buffers::new(
        &[
            d.bytes(d.sq),
            d.bytes(d.sk),
            d.bytes(d.sk),
            d.bytes(d.sq),
            ws,
        ],
        d.dtype,
        stream,
    )?;
    let ptrs = bufs.ptrs[..4].to_vec();
    let workspace = bufs.ptrs[4];
    // SAFETY: the handle is live and the stream belongs to the current context.
    unsafe { cudarc::cudnn::result::set_stream(handle, stream as _) }
        .map_err(|e| RuntimeError::Device(format!("cuDNN set stream: {e:?}")))?;
    let mut best: Option<(usize, f32)> = None;
    for (i, g) in plans.iter_mut().enumerate() {
        match time(stream, || g.execute(handle, &ptrs, workspace)) {
            Ok(t) if best.is_none_or(|(_, b)| t < b) => best = Some((i, t)),
            Ok(_) => {}
            Err(e) => tracing::trace!("cuDNN engine {} failed on {d:?}: {e}", g.engine),
        }
    }
    let best = best.ok_or_else(|| {
        RuntimeError::Device(format!("cuDNN fused attention: no plan of {d:?} ran"))
    })?;
    let flash_ms = match flash {
        Some(f) => Some(time(stream, || {
            // SAFETY: the flash kernel's parameters are q, k, v and the output, in that order;
            // the buffers hold the sizes of the step's tensors.
            unsafe { super::launch_pointers(f.func, f.grid, f.block, &ptrs, stream) }
                .map_err(|e| RuntimeError::Device(format!("timing the flash kernel: {e}")))
        })?),
        None => None,
    };
    Ok((best, flash_ms))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustytorch_ops::{AttnLayout, DType};

    fn desc(causal: Causal) -> AttnDnnDesc {
        AttnDnnDesc {
            dtype: DType::BF16,
            b: 2,
            h: 4,
            sq: 3,
            sk: 5,
            d: 64,
            causal,
            scale_bits: 0.125f32.to_bits(),
            layout: AttnLayout::Bshd,
        }
    }

    #[test]
    fn scalars_per_causal_kind() {
        let (scale, fill) = (0.125f32.to_bits(), f32::MIN.to_bits());
        assert_eq!(scalars(&desc(Causal::None)), vec![(uid::SCALE, scale)]);
        assert_eq!(
            scalars(&desc(Causal::TopLeft)),
            vec![(uid::SCALE, scale), (uid::FILL, fill)]
        );
        assert_eq!(
            scalars(&desc(Causal::BottomRight)),
            vec![
                (uid::SCALE, scale),
                (uid::FILL, fill),
                (uid::SK, 5),
                (uid::SQ, 3)
            ]
        );
    }

    #[test]
    fn reduced_and_score_strides() {
        assert_eq!(f32_dims([2, 4, 3, 5]), [60, 15, 5, 1]);
        assert_eq!(f32_dims([2, 4, 3, 1]), [12, 3, 1, 1]);
        assert_eq!(VARIANT, [uid::Q, uid::K, uid::V, uid::O]);
    }
}
