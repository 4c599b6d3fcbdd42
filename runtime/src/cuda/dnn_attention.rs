//! Attention through cuDNN's fused attention: the forward's operation graph of one
//! [`AttnDnnDesc`] in the form cudnn-frontend gives its SDPA node (the form cuDNN's fused
//! attention engines recognize), its plans, and the choice between them and the flash kernel;
//! and the gradient's two graphs (see below).
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
//! The gradient (dQ, dK, dV of one attention from q, k, v and dO, as one step): cuDNN's fused
//! backward needs the forward's output O and its statistics, which the step does not keep, so
//! [`prepare_grad`] builds two graphs: the forward above with the statistics written out (f32
//! `[B, H, Sq, 1]` natural-log log-sum-exp, non-virtual, as cudnn-frontend's training forward
//! makes them) and O, both into the step's workspace; and the SDPA backward graph node for node
//! as cudnn-frontend's `CompositeSDPABackwardNode` builds it (see [`bwd_graph`]), trying the
//! frontend's form first and two variants after it ([`bwd_forms`]; with cuDNN <= 9.15 and Sk
//! not a multiple of 128 all with the padding mask of full lengths the frontend adds there,
//! [`needs_padding`]). It keeps the fastest plan of each; [`GradPlans::run`] enqueues the
//! forward then the backward. The workspace ([`GradLayout`]) holds O, the statistics, the
//! backward's f32 row sums and dQ accumulator (zeroed before each call only for cuDNN < 9.6, as
//! the frontend does), the padding form's length tensors and the plans' shared workspace. The session times the pair against the flash kernels ([`GradPlans::time`]) and
//! records the outcome per description ([`remember_grad`]); `RUSTYTORCH_ATTENTION` forces one
//! as for the forward.

use super::dnn::{time, time_replayed, Buffers};
use super::dnn_graph::{
    data_type, matmul_node, matmul_node_with, plans_of, pointwise_node, reduction_node,
    reshape_node, tensor_desc, Desc, GraphPlan, OpGraph,
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
    /// The softmax statistics `max + log Σ exp` (f32 `[B, H, Sq, 1]`; the gradient's forward
    /// writes them, its backward reads them).
    pub const STATS: i64 = 9;
    /// The output's gradient dO (the backward).
    pub const DO: i64 = 1001;
    /// dQ.
    pub const DQ: i64 = 1002;
    /// dK.
    pub const DK: i64 = 1003;
    /// dV.
    pub const DV: i64 = 1004;
    /// The row sums `Σ_d dO·O` (f32 `[B, H, Sq, 1]`, in the workspace).
    pub const SOFTMAX_SUM: i64 = 1005;
    /// dQ accumulated in f32 (`[B, H, Sq, D]`, in the workspace).
    pub const DQ_ACCUM: i64 = 1006;
    /// The constant 1 (by value, f32) the frontend scales the row sums by without dropout.
    pub const ONE: i64 = 1007;
    /// Sq per batch (int32 `[B, 1, 1, 1]`, in the workspace) for the backward's padding form.
    pub const SEQ_LEN_Q: i64 = 1008;
    /// Sk per batch, likewise.
    pub const SEQ_LEN_KV: i64 = 1009;
    /// The padding mask's fill (by value, f32 −∞ as the frontend gives it from cuDNN 9.10 on).
    pub const PAD_FILL: i64 = 1010;
    /// Virtual intermediates take the ids after this one.
    pub const S: i64 = 10;
}

/// Plans tried per description (the first ones the heuristics rank).
const MAX_PLANS: usize = 4;

/// The uids a call binds to device pointers, in [`GraphPlan::execute`]'s order.
pub(crate) const VARIANT: [i64; 4] = [uid::Q, uid::K, uid::V, uid::O];

/// The uids the gradient's forward (with statistics) binds.
pub(crate) const FWD_STATS_VARIANT: [i64; 5] = [uid::Q, uid::K, uid::V, uid::O, uid::STATS];

fn f32_dims(dims: [i64; 4]) -> [i64; 4] {
    [dims[1] * dims[2] * dims[3], dims[2] * dims[3], dims[3], 1]
}

/// A tensor of a [`Builder`] (its index).
type Tid = usize;

/// An operation graph under construction: its tensors, its operations in order and the
/// descriptors they reference, all kept alive with the finished graph.
struct Builder {
    tensors: Vec<Desc>,
    ops: Vec<Desc>,
    aux: Vec<Desc>,
    next: i64,
}

impl Builder {
    fn new() -> Builder {
        Builder {
            tensors: vec![],
            ops: vec![],
            aux: vec![],
            next: uid::S,
        }
    }

    fn add(&mut self, t: Desc) -> Tid {
        self.tensors.push(t);
        self.tensors.len() - 1
    }

    /// A tensor bound to memory at each call.
    fn real(&mut self, id: i64, dt: Dt, (dims, st): ([i64; 4], [i64; 4])) -> Result<Tid> {
        let t = tensor_desc(id, dt, &dims, &st, false, false)?;
        Ok(self.add(t))
    }

    /// A by-value scalar (`[1, 1, 1, 1]`).
    fn scalar(&mut self, id: i64, dt: Dt) -> Result<Tid> {
        let one = [1i64; 4];
        let t = tensor_desc(id, dt, &one, &one, false, true)?;
        Ok(self.add(t))
    }

    /// A virtual intermediate (the next free uid).
    fn virt(&mut self, dt: Dt, (dims, st): ([i64; 4], [i64; 4])) -> Result<Tid> {
        self.next += 1;
        let t = tensor_desc(self.next, dt, &dims, &st, true, false)?;
        Ok(self.add(t))
    }

    fn node(&mut self, [op, aux]: [Desc; 2]) {
        self.ops.push(op);
        self.aux.push(aux);
    }

    fn matmul(&mut self, a: Tid, b: Tid, c: Tid) -> Result<()> {
        let t = &self.tensors;
        let n = matmul_node(&t[a], &t[b], &t[c])?;
        self.node(n);
        Ok(())
    }

    /// `c = a·b` with the GEMM's M, N, K overridden by the tensors `mnk` (when given).
    fn matmul_with(&mut self, a: Tid, b: Tid, c: Tid, mnk: [Option<Tid>; 3]) -> Result<()> {
        let t = &self.tensors;
        let n = matmul_node_with(&t[a], &t[b], &t[c], mnk.map(|o| o.map(|i| &t[i])))?;
        self.node(n);
        Ok(())
    }

    /// `y = mode(x[, b][, cond])` computed in `prec` (`axis` for GEN_INDEX).
    #[allow(clippy::too_many_arguments)]
    fn pointwise(
        &mut self,
        mode: Pw,
        prec: Dt,
        axis: Option<i64>,
        x: Tid,
        b: Option<Tid>,
        cond: Option<Tid>,
        y: Tid,
    ) -> Result<()> {
        let t = &self.tensors;
        let n = pointwise_node(
            mode,
            prec,
            axis,
            &t[x],
            b.map(|b| &t[b]),
            cond.map(|c| &t[c]),
            &t[y],
        )?;
        self.node(n);
        Ok(())
    }

    /// `y = mode(x[, b])` in f32.
    fn pw(&mut self, mode: Pw, x: Tid, b: Option<Tid>, y: Tid) -> Result<()> {
        self.pointwise(mode, Dt::CUDNN_DATA_FLOAT, None, x, b, None, y)
    }

    fn reduce(&mut self, how: sys::cudnnReduceTensorOp_t, x: Tid, y: Tid) -> Result<()> {
        let n = reduction_node(how, &self.tensors[x], &self.tensors[y])?;
        self.node(n);
        Ok(())
    }

    fn reshape(&mut self, x: Tid, y: Tid) -> Result<()> {
        let op = reshape_node(&self.tensors[x], &self.tensors[y])?;
        self.ops.push(op);
        Ok(())
    }

    /// The finalized graph over the operations, in the order they were added.
    fn finish(self, handle: sys::cudnnHandle_t) -> Result<OpGraph> {
        let refs: Vec<&Desc> = self.ops.iter().collect();
        let graph = OpGraph::new(handle, &refs, vec![])?;
        let mut parts = self.ops;
        parts.extend(self.aux);
        parts.extend(self.tensors);
        Ok(graph.with_parts(parts))
    }
}

/// Dims and strides of the f32 `[B, H, Sq, Sk]` scores.
fn score_geometry(d: &AttnDnnDesc) -> ([i64; 4], [i64; 4]) {
    let dims = [d.b as i64, d.h as i64, d.sq as i64, d.sk as i64];
    (dims, f32_dims(dims))
}

/// Dims and strides of the f32 per-row `[B, H, Sq, 1]` values (the statistics).
fn row_geometry(d: &AttnDnnDesc) -> ([i64; 4], [i64; 4]) {
    let dims = [d.b as i64, d.h as i64, d.sq as i64, 1];
    (dims, f32_dims(dims))
}

/// Dims and strides of a transposed `[B, H, Sk, Sq]` view of the scores (what the backward's
/// reshapes make of `P` and `dS`).
fn transposed_score_geometry(d: &AttnDnnDesc) -> ([i64; 4], [i64; 4]) {
    let (b, h, sq, sk) = (d.b as i64, d.h as i64, d.sq as i64, d.sk as i64);
    ([b, h, sk, sq], [h * sq * sk, sq * sk, 1, sk])
}

/// `S = Q·Kᵀ` and `S ·= scale` (steps 1 and 2 of the module docs); returns the scaled scores.
fn scaled_scores(g: &mut Builder, d: &AttnDnnDesc, q: Tid, kt: Tid, scale: Tid) -> Result<Tid> {
    let f = Dt::CUDNN_DATA_FLOAT;
    let s = g.virt(f, score_geometry(d))?;
    let scaled = g.virt(f, score_geometry(d))?;
    g.matmul(q, kt, s)?;
    g.pw(Pw::CUDNN_POINTWISE_MUL, s, Some(scale), scaled)?;
    Ok(scaled)
}

/// The causal mask on `scores` (step 3 of the module docs) when `d` has one; returns the
/// masked scores (`scores` itself without a mask). `seq` (Sq and Sk per batch, as tensors)
/// replaces the by-value Sq and Sk of bottom-right alignment, as the frontend does when the
/// graph has a padding mask.
fn causal_mask(
    g: &mut Builder,
    d: &AttnDnnDesc,
    scores: Tid,
    seq: Option<(Tid, Tid)>,
) -> Result<Tid> {
    if d.causal == Causal::None {
        return Ok(scores);
    }
    let (f, int) = (Dt::CUDNN_DATA_FLOAT, Dt::CUDNN_DATA_INT32);
    let geo = score_geometry(d);
    let mut row = g.virt(int, geo)?;
    let col = g.virt(int, geo)?;
    let keep = g.virt(Dt::CUDNN_DATA_BOOLEAN, geo)?;
    let fill = g.scalar(uid::FILL, f)?;
    let masked = g.virt(f, geo)?;
    g.pointwise(
        Pw::CUDNN_POINTWISE_GEN_INDEX,
        int,
        Some(2),
        scores,
        None,
        None,
        row,
    )?;
    if d.causal == Causal::BottomRight {
        for (i, (id, mode)) in [
            (uid::SK, Pw::CUDNN_POINTWISE_ADD),
            (uid::SQ, Pw::CUDNN_POINTWISE_SUB),
        ]
        .into_iter()
        .enumerate()
        {
            let c = match seq {
                Some((sq, sk)) => [sk, sq][i],
                None => g.scalar(id, int)?,
            };
            let shifted = g.virt(int, geo)?;
            g.pointwise(mode, int, None, row, Some(c), None, shifted)?;
            row = shifted;
        }
    }
    g.pointwise(
        Pw::CUDNN_POINTWISE_GEN_INDEX,
        int,
        Some(3),
        scores,
        None,
        None,
        col,
    )?;
    keep_or_fill(
        g,
        Pw::CUDNN_POINTWISE_CMP_GE,
        [row, col],
        keep,
        [scores, fill],
        masked,
    )
}

/// The forward operation graph of `d` (see the module docs); `p_io` makes `P` the operands'
/// type (the frontend's form) rather than f32; `stats` writes the statistics to
/// [`uid::STATS`] (f32 `[B, H, Sq, 1]`, the frontend's training forward) instead of keeping them
/// virtual.
fn op_graph(
    handle: sys::cudnnHandle_t,
    d: &AttnDnnDesc,
    p_io: bool,
    stats: bool,
) -> Result<OpGraph> {
    use sys::cudnnReduceTensorOp_t as R;
    let io = data_type(d.dtype);
    let f = Dt::CUDNN_DATA_FLOAT;
    let mut g = Builder::new();
    let q = g.real(uid::Q, io, d.operand(d.sq))?;
    let k = g.real(uid::K, io, d.k_transposed())?;
    let v = g.real(uid::V, io, d.operand(d.sk))?;
    let o = g.real(uid::O, io, d.dims_strides(d.sq))?;
    let scale = g.scalar(uid::SCALE, f)?;
    let scores = scaled_scores(&mut g, d, q, k, scale)?;
    let scores = causal_mask(&mut g, d, scores, None)?;
    let (sg, rg) = (score_geometry(d), row_geometry(d));
    let max = g.virt(f, rg)?;
    let sub = g.virt(f, sg)?;
    let exp = g.virt(f, sg)?;
    let sum = g.virt(f, rg)?;
    let log = g.virt(f, rg)?;
    let lse = if stats {
        g.real(uid::STATS, f, rg)?
    } else {
        g.virt(f, rg)?
    };
    let p = g.virt(if p_io { io } else { f }, sg)?;
    g.reduce(R::CUDNN_REDUCE_TENSOR_MAX, scores, max)?;
    g.pw(Pw::CUDNN_POINTWISE_SUB, scores, Some(max), sub)?;
    g.pw(Pw::CUDNN_POINTWISE_EXP, sub, None, exp)?;
    g.reduce(R::CUDNN_REDUCE_TENSOR_ADD, exp, sum)?;
    g.pw(Pw::CUDNN_POINTWISE_LOG, sum, None, log)?;
    g.pw(Pw::CUDNN_POINTWISE_ADD, max, Some(log), lse)?;
    g.pw(Pw::CUDNN_POINTWISE_DIV, exp, Some(sum), p)?;
    g.matmul(p, v, o)?;
    g.finish(handle)
}

/// The plans of `d`: the frontend's form of the graph first, then `P` in f32 if cuDNN refuses
/// that one. An error when neither makes a plan.
pub(crate) fn plans(handle: sys::cudnnHandle_t, d: &AttnDnnDesc) -> Result<Vec<GraphPlan>> {
    forward_plans(handle, d, false)
}

/// [`plans`] of the forward graph, with the statistics written out when `stats`.
fn forward_plans(
    handle: sys::cudnnHandle_t,
    d: &AttnDnnDesc,
    stats: bool,
) -> Result<Vec<GraphPlan>> {
    let uids = if stats {
        FWD_STATS_VARIANT.to_vec()
    } else {
        VARIANT.to_vec()
    };
    let mut errors = vec![];
    for p_io in [true, false] {
        let made = op_graph(handle, d, p_io, stats).and_then(|g| {
            plans_of(
                handle,
                g,
                uids.clone(),
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
    let what = if stats {
        " forward with statistics"
    } else {
        ""
    };
    Err(RuntimeError::Device(format!(
        "cuDNN fused attention{what} for {d:?}: {}",
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

/// Which form of the backward graph to build ([`bwd_forms`] lists them in the order tried).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct BwdForm {
    /// The reshape of Kᵀ back to K for `dS·K` gives K in the operands' type (else in f32, the
    /// type the frontend's reshape infers for that virtual tensor).
    pub k_io: bool,
    /// `dS·K` accumulates into [`uid::DQ_ACCUM`] (f32, in the workspace) and an IDENTITY
    /// writes dQ from it (the frontend's form from cuDNN 9.0 on); else it writes dQ directly
    /// (the form of the frontend's deterministic / dP-workspace path).
    pub accum: bool,
    /// The padding mask the frontend adds for cuDNN <= 9.15 when Sk is not a multiple of 128
    /// ([`needs_padding`]): Sq and Sk per batch as int32 tensors in the workspace, overriding
    /// the products' M, N, K, and a padding select on the scaled scores.
    pub pad: bool,
}

/// Whether cudnn-frontend gives the backward a padding mask (of the full lengths): for cuDNN up
/// to 9.15.0 when Sk is not a multiple of 128 (its workaround of a cuDNN fault in that case;
/// `version` as `major·10000 + minor·100 + patch`).
pub(crate) fn needs_padding(version: usize, sk: usize) -> bool {
    version <= 91500 && !sk.is_multiple_of(128)
}

/// The backward graph's forms, in the order [`bwd_plans`] tries them: the frontend's first (K
/// reshaped to f32, dQ through the accumulator), then K in the operands' type, then dQ
/// written directly; all with the frontend's padding choice `pad`.
pub(crate) fn bwd_forms(pad: bool) -> [BwdForm; 3] {
    let form = |k_io, accum| BwdForm { k_io, accum, pad };
    [form(false, true), form(true, true), form(false, false)]
}

/// The uids the backward of `form` binds, in [`GraphPlan::execute`]'s order.
pub(crate) fn bwd_uids(form: BwdForm) -> Vec<i64> {
    let mut v = vec![
        uid::Q,
        uid::K,
        uid::V,
        uid::O,
        uid::DO,
        uid::STATS,
        uid::SOFTMAX_SUM,
    ];
    if form.accum {
        v.push(uid::DQ_ACCUM);
    }
    v.extend([uid::DQ, uid::DK, uid::DV]);
    if form.pad {
        v.extend([uid::SEQ_LEN_Q, uid::SEQ_LEN_KV]);
    }
    v
}

/// The by-value scalars of the backward in `form`: the forward's ([`scalars`]; without Sq and
/// Sk when the padding form takes them from its tensors), the constant 1, and the padding fill.
pub(crate) fn grad_scalars(d: &AttnDnnDesc, form: BwdForm) -> Vec<(i64, u32)> {
    let mut v = scalars(d);
    if form.pad {
        v.retain(|&(id, _)| id != uid::SK && id != uid::SQ);
    }
    v.push((uid::ONE, 1.0f32.to_bits()));
    if form.pad {
        v.push((uid::PAD_FILL, f32::NEG_INFINITY.to_bits()));
    }
    v
}

/// The padding mask on `scores`, node for node as cudnn-frontend's `padding_mask` score
/// modifier: `row < Sq ∧ col < Sk` (GEN_INDEX, CMP_LT against the per-batch lengths `seq_q` and
/// `seq_kv`, LOGICAL_AND) selects the score, else −∞.
fn padding_mask(
    g: &mut Builder,
    d: &AttnDnnDesc,
    scores: Tid,
    seq_q: Tid,
    seq_kv: Tid,
) -> Result<Tid> {
    let (f, int, boolean) = (
        Dt::CUDNN_DATA_FLOAT,
        Dt::CUDNN_DATA_INT32,
        Dt::CUDNN_DATA_BOOLEAN,
    );
    let geo = score_geometry(d);
    let row = g.virt(int, geo)?;
    let col = g.virt(int, geo)?;
    let row_in = g.virt(boolean, geo)?;
    let col_in = g.virt(boolean, geo)?;
    let keep = g.virt(boolean, geo)?;
    let fill = g.scalar(uid::PAD_FILL, f)?;
    let masked = g.virt(f, geo)?;
    let gen = Pw::CUDNN_POINTWISE_GEN_INDEX;
    g.pointwise(gen, int, Some(2), scores, None, None, row)?;
    g.pointwise(gen, int, Some(3), scores, None, None, col)?;
    let lt = Pw::CUDNN_POINTWISE_CMP_LT;
    g.pointwise(lt, boolean, None, row, Some(seq_q), None, row_in)?;
    g.pointwise(lt, boolean, None, col, Some(seq_kv), None, col_in)?;
    keep_or_fill(
        g,
        Pw::CUDNN_POINTWISE_LOGICAL_AND,
        [row_in, col_in],
        keep,
        [scores, fill],
        masked,
    )
}

/// `keep = pred(a, b)` (boolean), then `masked = keep ? scores : fill` (f32): the end of both
/// masks.
fn keep_or_fill(
    g: &mut Builder,
    pred: Pw,
    [a, b]: [Tid; 2],
    keep: Tid,
    [scores, fill]: [Tid; 2],
    masked: Tid,
) -> Result<Tid> {
    g.pointwise(pred, Dt::CUDNN_DATA_BOOLEAN, None, a, Some(b), None, keep)?;
    g.pointwise(
        Pw::CUDNN_POINTWISE_BINARY_SELECT,
        Dt::CUDNN_DATA_FLOAT,
        None,
        scores,
        Some(fill),
        Some(keep),
        masked,
    )?;
    Ok(masked)
}

/// The SDPA backward graph of `d` in `form`, node for node as cudnn-frontend's
/// `CompositeSDPABackwardNode` builds it without bias, dropout or a user's padding mask (every
/// intermediate virtual and f32 unless noted; K and V are bound as Kᵀ and Vᵀ, `[B, H, D, Sk]`):
///
/// 1. `dO·O` (POINTWISE MUL), `Σ_d` (REDUCTION ADD), `·1` (MUL by a by-value f32) into the
///    row sums [`uid::SOFTMAX_SUM`] (non-virtual f32 `[B, H, Sq, 1]`);
/// 2. `S = Q·Kᵀ`, `S ·= scale`, in the padding form the padding mask, `S −= stats` (SUB of
///    [`uid::STATS`]), the causal mask, `P = exp(S)`;
/// 3. `Pᵀ` (RESHAPE to `[B, H, Sk, Sq]` in the operands' type), `dV = Pᵀ·dO`;
/// 4. `dP = dO·Vᵀ`, `dS = (dP − sums)·P·scale` (SUB, MUL, MUL);
/// 5. `dSᵀ` (RESHAPE, operands' type), `dK = dSᵀ·Q`;
/// 6. K (RESHAPE of Kᵀ), `dQ = dS·K` (through [`uid::DQ_ACCUM`] and an IDENTITY, by `form`).
///
/// In the padding form every product's M, N and K over Sq or Sk are overridden by the length
/// tensors, and a bottom-right causal mask shifts by them instead of by-value lengths.
fn bwd_graph(handle: sys::cudnnHandle_t, d: &AttnDnnDesc, form: BwdForm) -> Result<OpGraph> {
    let io = data_type(d.dtype);
    let f = Dt::CUDNN_DATA_FLOAT;
    let (b, h, sq, hd) = (d.b as i64, d.h as i64, d.sq as i64, d.d as i64);
    let mut g = Builder::new();
    let q = g.real(uid::Q, io, d.operand(d.sq))?;
    let kt = g.real(uid::K, io, d.k_transposed())?;
    // V has K's sizes and layout: Vᵀ is the same view.
    let vt = g.real(uid::V, io, d.k_transposed())?;
    let o = g.real(uid::O, io, d.dims_strides(d.sq))?;
    let dout = g.real(uid::DO, io, d.dims_strides(d.sq))?;
    let stats = g.real(uid::STATS, f, row_geometry(d))?;
    let dq = g.real(uid::DQ, io, d.operand(d.sq))?;
    let dk = g.real(uid::DK, io, d.operand(d.sk))?;
    let dv = g.real(uid::DV, io, d.operand(d.sk))?;
    let scale = g.scalar(uid::SCALE, f)?;
    let one = g.scalar(uid::ONE, f)?;
    let seq = if form.pad {
        let geo = ([b, 1, 1, 1], [1, 1, 1, 1]);
        let int = Dt::CUDNN_DATA_INT32;
        Some((
            g.real(uid::SEQ_LEN_Q, int, geo)?,
            g.real(uid::SEQ_LEN_KV, int, geo)?,
        ))
    } else {
        None
    };
    let (lq, lk) = (seq.map(|s| s.0), seq.map(|s| s.1));

    // 1. The row sums (the frontend's strides for the product, verbatim).
    let prod = g.virt(f, ([b, h, sq, hd], [h * sq * hd, sq * hd, h * hd, 1]))?;
    let rowsum = g.virt(f, row_geometry(d))?;
    let sums = g.real(uid::SOFTMAX_SUM, f, row_geometry(d))?;
    g.pw(Pw::CUDNN_POINTWISE_MUL, dout, Some(o), prod)?;
    g.reduce(
        sys::cudnnReduceTensorOp_t::CUDNN_REDUCE_TENSOR_ADD,
        prod,
        rowsum,
    )?;
    g.pw(Pw::CUDNN_POINTWISE_MUL, rowsum, Some(one), sums)?;

    // 2. P recomputed from the statistics.
    let s = g.virt(f, score_geometry(d))?;
    g.matmul_with(q, kt, s, [lq, lk, None])?;
    let mut scores = g.virt(f, score_geometry(d))?;
    g.pw(Pw::CUDNN_POINTWISE_MUL, s, Some(scale), scores)?;
    if let Some((sq_t, sk_t)) = seq {
        scores = padding_mask(&mut g, d, scores, sq_t, sk_t)?;
    }
    let centered = g.virt(f, score_geometry(d))?;
    g.pw(Pw::CUDNN_POINTWISE_SUB, scores, Some(stats), centered)?;
    let masked = causal_mask(&mut g, d, centered, seq)?;
    let p = g.virt(f, score_geometry(d))?;
    g.pw(Pw::CUDNN_POINTWISE_EXP, masked, None, p)?;

    // 3. dV = Pᵀ·dO.
    let pt = g.virt(io, transposed_score_geometry(d))?;
    g.reshape(p, pt)?;
    g.matmul_with(pt, dout, dv, [lk, None, lq])?;

    // 4. dS = (dO·Vᵀ − sums)·P·scale.
    let dp = g.virt(f, score_geometry(d))?;
    g.matmul_with(dout, vt, dp, [lq, lk, None])?;
    let centered_dp = g.virt(f, score_geometry(d))?;
    g.pw(Pw::CUDNN_POINTWISE_SUB, dp, Some(sums), centered_dp)?;
    let dsp = g.virt(f, score_geometry(d))?;
    g.pw(Pw::CUDNN_POINTWISE_MUL, centered_dp, Some(p), dsp)?;
    let ds = g.virt(f, score_geometry(d))?;
    g.pw(Pw::CUDNN_POINTWISE_MUL, dsp, Some(scale), ds)?;

    // 5. dK = dSᵀ·Q.
    let dst = g.virt(io, transposed_score_geometry(d))?;
    g.reshape(ds, dst)?;
    g.matmul_with(dst, q, dk, [lk, None, lq])?;

    // 6. dQ = dS·K.
    let k = g.virt(if form.k_io { io } else { f }, d.operand(d.sk))?;
    g.reshape(kt, k)?;
    if form.accum {
        let accum = g.real(uid::DQ_ACCUM, f, accum_geometry(d))?;
        g.matmul_with(ds, k, accum, [lq, None, lk])?;
        g.pw(Pw::CUDNN_POINTWISE_IDENTITY, accum, None, dq)?;
    } else {
        g.matmul_with(ds, k, dq, [lq, None, lk])?;
    }
    g.finish(handle)
}

/// Dims and strides of the f32 dQ accumulator: `[B, H, Sq, D]`, packed in that order.
fn accum_geometry(d: &AttnDnnDesc) -> ([i64; 4], [i64; 4]) {
    let dims = [d.b as i64, d.h as i64, d.sq as i64, d.d as i64];
    (dims, f32_dims(dims))
}

/// The backward plans of `d`: those of the first form of [`bwd_forms`] (with the padding the
/// frontend would give cuDNN `version`) that cuDNN makes plans for, and that form. An error
/// naming every form's failure when none does.
fn bwd_plans(
    handle: sys::cudnnHandle_t,
    d: &AttnDnnDesc,
    version: usize,
) -> Result<(Vec<GraphPlan>, BwdForm)> {
    let mut errors = vec![];
    for form in bwd_forms(needs_padding(version, d.sk)) {
        let made = bwd_graph(handle, d, form).and_then(|g| {
            plans_of(
                handle,
                g,
                bwd_uids(form),
                grad_scalars(d, form),
                d.dtype,
                false,
                MAX_PLANS,
                &format!("backward {d:?}"),
            )
        });
        match made {
            Ok(v) if !v.is_empty() => return Ok((v, form)),
            Ok(_) => errors.push(format!("{form:?}: no engine made a plan")),
            Err(e) => errors.push(format!("{form:?}: {e}")),
        }
    }
    Err(RuntimeError::Device(format!(
        "cuDNN fused attention backward for {d:?}: {}",
        errors.join("; ")
    )))
}

/// Where the gradient keeps its intermediates in the step's workspace (byte offsets, each
/// aligned to [`GRAD_ALIGN`]): the recomputed output, the statistics, the row sums, the dQ
/// accumulator and the length tensors (when the form has them) and the plans' own workspace
/// (shared: the forward and the backward run one after the other).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct GradLayout {
    /// O (`[B, H, Sq, D]` in q's type and layout).
    pub o: usize,
    /// The statistics (f32 `[B, H, Sq, 1]`).
    pub stats: usize,
    /// The row sums (f32 `[B, H, Sq, 1]`).
    pub sums: usize,
    /// The f32 dQ accumulator `[B, H, Sq, D]`.
    pub accum: Option<usize>,
    /// Sq and Sk per batch (int32 `[B]` each) of the padding form.
    pub seq: Option<(usize, usize)>,
    /// The plans' workspace.
    pub plan: usize,
    /// Bytes in all.
    pub total: usize,
}

/// Alignment of each region of [`GradLayout`].
pub(crate) const GRAD_ALIGN: usize = 256;

impl GradLayout {
    /// The layout for `d` in `form` with `plan_workspace` bytes for the plans.
    pub(crate) fn new(d: &AttnDnnDesc, form: BwdForm, plan_workspace: usize) -> GradLayout {
        let rows = d.b * d.h * d.sq * 4;
        let accum = if form.accum { rows * d.d } else { 0 };
        let seq = if form.pad { d.b * 4 } else { 0 };
        let sizes = [d.bytes(d.sq), rows, rows, accum, seq, seq, plan_workspace];
        let mut at = [0usize; 7];
        let mut next = 0;
        for (a, n) in at.iter_mut().zip(sizes) {
            *a = next;
            next += n.div_ceil(GRAD_ALIGN) * GRAD_ALIGN;
        }
        GradLayout {
            o: at[0],
            stats: at[1],
            sums: at[2],
            accum: form.accum.then_some(at[3]),
            seq: form.pad.then_some((at[4], at[5])),
            plan: at[6],
            total: next,
        }
    }
}

/// Whether the dQ accumulator must be zeroed before each backward: cudnn-frontend memsets it
/// before cuDNN 9.6 and leaves it to cuDNN from 9.6 on (`version` as `major·10000 + minor·100
/// + patch`).
pub(crate) fn accum_needs_zeroing(version: usize) -> bool {
    version < 90600
}

/// Device addresses of one gradient step's tensors (q, k, v, dO in; dQ, dK, dV out; all in
/// the op's layout), and the forward's O and statistics when a forward with statistics
/// ([`prepare_saving`]) wrote them (0 for none: the step recomputes them).
// Entry point of the attention-gradient step, which the CUDA session wires.
#[allow(dead_code)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct GradPtrs {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub dout: u64,
    pub dq: u64,
    pub dk: u64,
    pub dv: u64,
    pub o: u64,
    pub stats: u64,
}

impl GradPtrs {
    /// Whether O and the statistics come from the forward.
    pub(crate) fn saved(&self) -> bool {
        self.o != 0 && self.stats != 0
    }
}

/// The cuDNN plans of one attention gradient: the forward that writes O and the statistics into
/// the workspace, and the backward that reads them (see [`bwd_graph`]).
// Entry point of the attention-gradient step, which the CUDA session wires.
#[allow(dead_code)]
pub(crate) struct GradPlans {
    d: AttnDnnDesc,
    fwd: GraphPlan,
    bwd: GraphPlan,
    form: BwdForm,
    layout: GradLayout,
    zero_accum: bool,
    /// Whether the choice is already made (forced, or cached from an earlier step): the caller
    /// need not time it against the flash kernels.
    pub decided: bool,
    /// Mean ms of the chosen forward and backward plans when [`prepare_grad`] timed them.
    pub fwd_ms: Option<f32>,
    /// See `fwd_ms`.
    pub bwd_ms: Option<f32>,
}

/// Outcome of the gradient's choice, cached per description for the process: the configurations
/// ([`GraphPlan::config`]; forward, backward) of the cuDNN plans that won, or `None` for the
/// flash kernels.
fn grad_cache() -> &'static Mutex<HashMap<AttnDnnDesc, Option<(usize, usize)>>> {
    static C: OnceLock<Mutex<HashMap<AttnDnnDesc, Option<(usize, usize)>>>> = OnceLock::new();
    C.get_or_init(Default::default)
}

/// The configurations (forward, backward) cuDNN's timing in [`pick`] chose per description,
/// for the process.
fn pick_cache() -> &'static Mutex<HashMap<AttnDnnDesc, (usize, usize)>> {
    static C: OnceLock<Mutex<HashMap<AttnDnnDesc, (usize, usize)>>> = OnceLock::new();
    C.get_or_init(Default::default)
}

/// Builds the forward-with-statistics and backward plans of `d` under `choice`, keeping per
/// graph the fastest plan (timed on buffers of its own, filled with ones): `None` for
/// [`Choice::Flash`] or when the flash kernels won before; for [`Choice::Cudnn`] an error when
/// cuDNN makes no plan; in auto mode a cuDNN failure means the flash kernels (logged and
/// cached). In auto mode an undecided result ([`GradPlans::decided`] false) is to be timed
/// against the flash kernels ([`GradPlans::time`]) and the outcome given to [`remember_grad`].
/// It runs plans on `stream` (on buffers of its own), so it must not be called during stream
/// capture; the context must be bound.
// Entry point of the attention-gradient step, which the CUDA session wires.
#[allow(dead_code)]
pub(crate) fn prepare_grad(
    handle: sys::cudnnHandle_t,
    d: &AttnDnnDesc,
    choice: Choice,
    stream: ds::CUstream,
) -> Result<Option<GradPlans>> {
    let cached = grad_cache()
        .lock()
        .expect("attention gradient cache")
        .get(d)
        .copied();
    match (choice, cached) {
        (Choice::Flash, _) | (Choice::Auto, Some(None)) => return Ok(None),
        _ => {}
    }
    let engines = cached.flatten().filter(|_| choice == Choice::Auto);
    let made = forward_plans(handle, d, true).and_then(|fwd| {
        let (bwd, form) = bwd_plans(handle, d, super::dnn::Dnn::version())?;
        pick(handle, d, fwd, bwd, form, engines, stream)
    });
    match made {
        Ok(mut p) => {
            p.decided |= choice == Choice::Cudnn;
            Ok(Some(p))
        }
        Err(e) if choice == Choice::Cudnn => Err(RuntimeError::Device(format!(
            "RUSTYTORCH_ATTENTION=cudnn: {e}"
        ))),
        Err(e) => {
            tracing::debug!("attention gradient falls back to the flash kernels: {e}");
            remember_grad(d, None);
            Ok(None)
        }
    }
}

/// Records the outcome of the choice for `d` (auto mode): the engines of `won`, or the flash
/// kernels for `None`. Later [`prepare_grad`] calls follow it without timing.
// Entry point of the attention-gradient step, which the CUDA session wires.
#[allow(dead_code)]
pub(crate) fn remember_grad(d: &AttnDnnDesc, won: Option<&GradPlans>) {
    grad_cache()
        .lock()
        .expect("attention gradient cache")
        .insert(d.clone(), won.map(GradPlans::configs));
}

/// The plans to keep: those of the configurations (`engines`, [`GraphPlan::config`]) that won
/// before when both are still proposed (no timing), else the fastest forward and the fastest
/// backward.
fn pick(
    handle: sys::cudnnHandle_t,
    d: &AttnDnnDesc,
    mut fwd: Vec<GraphPlan>,
    mut bwd: Vec<GraphPlan>,
    form: BwdForm,
    engines: Option<(usize, usize)>,
    stream: ds::CUstream,
) -> Result<GradPlans> {
    let zero_accum = form.accum && accum_needs_zeroing(super::dnn::Dnn::version());
    let make = |fwd: GraphPlan, bwd: GraphPlan, decided, fwd_ms, bwd_ms| {
        let layout = GradLayout::new(d, form, fwd.workspace.max(bwd.workspace));
        GradPlans {
            d: d.clone(),
            fwd,
            bwd,
            form,
            layout,
            zero_accum,
            decided,
            fwd_ms,
            bwd_ms,
        }
    };
    // The configurations that won the whole choice before (decided), else those cuDNN's own
    // timing picked for this shape before (the comparison with the flash kernels still due):
    // every layer of a model then runs the same kernels.
    let picked = pick_cache()
        .lock()
        .expect("attention gradient cache")
        .get(d)
        .copied();
    for (known, decided) in [(engines, true), (picked, false)] {
        let Some((fe, be)) = known else { continue };
        let i = fwd.iter().position(|p| p.config == fe);
        let j = bwd.iter().position(|p| p.config == be);
        if let (Some(i), Some(j)) = (i, j) {
            return Ok(make(
                fwd.swap_remove(i),
                bwd.swap_remove(j),
                decided,
                None,
                None,
            ));
        }
    }
    let ws = fwd
        .iter()
        .chain(&bwd)
        .map(|p| p.workspace)
        .max()
        .unwrap_or(0);
    let layout = GradLayout::new(d, form, ws);
    let sq = d.bytes(d.sq);
    let (pq, pk) = (d.operand_bytes(d.sq), d.operand_bytes(d.sk));
    let bufs = Buffers::new(&[pq, pk, pk, sq, pq, pk, pk, layout.total], d.dtype, stream)?;
    let b = &bufs.ptrs;
    // Packed operands lie at their offsets into buffers of the packed size.
    let ptrs = GradPtrs {
        q: b[0] + d.part_offset(0),
        k: b[1] + d.part_offset(1),
        v: b[2] + d.part_offset(2),
        dout: b[3],
        dq: b[4] + d.part_offset(0),
        dk: b[5] + d.part_offset(1),
        dv: b[6] + d.part_offset(2),
        o: 0,
        stats: 0,
    };
    let ws = b[7];
    set_stream(handle, stream)?;
    let fwd_ptrs = fwd_pointers(&ptrs, &layout, ws);
    let (best_fwd, fwd_times) = fastest_of(fwd.len(), |i| {
        let g = &mut fwd[i];
        time_plan(handle, stream, |_| {
            g.execute(handle, &fwd_ptrs, ws + layout.plan as u64)
        })
        .inspect_err(|e| tracing::trace!("cuDNN engine {} failed on {d:?}: {e}", g.engine))
    });
    let (i, fwd_ms) = best_fwd.ok_or_else(|| {
        RuntimeError::Device(format!(
            "cuDNN fused attention forward with statistics: no plan of {d:?} ran"
        ))
    })?;
    // The statistics the backward reads are those of the last forward run.
    fwd[i].execute(handle, &fwd_ptrs, ws + layout.plan as u64)?;
    let bwd_ptrs = bwd_pointers(&ptrs, &layout, ws);
    let (best_bwd, bwd_times) = fastest_of(bwd.len(), |j| {
        let g = &mut bwd[j];
        time_plan(handle, stream, |s| {
            fill_workspace(&layout, zero_accum, ws, d, s)?;
            g.execute(handle, &bwd_ptrs, ws + layout.plan as u64)
        })
        .inspect_err(|e| tracing::trace!("cuDNN engine {} failed on backward {d:?}: {e}", g.engine))
    });
    let (j, bwd_ms) = best_bwd.ok_or_else(|| {
        RuntimeError::Device(format!(
            "cuDNN fused attention backward: no plan of {d:?} ran"
        ))
    })?;
    log_choice("gradient's forward", d, &fwd, &fwd_times);
    log_choice("gradient's backward", d, &bwd, &bwd_times);
    let (f, bw) = (fwd.swap_remove(i), bwd.swap_remove(j));
    pick_cache()
        .lock()
        .expect("attention gradient cache")
        .insert(d.clone(), (f.config, bw.config));
    tracing::debug!(
        "attention gradient {d:?}: forward engine {} ({fwd_ms:.4} ms), backward engine {} \
         ({bwd_ms:.4} ms), {form:?}",
        f.engine,
        bw.engine
    );
    Ok(make(f, bw, false, Some(fwd_ms), Some(bwd_ms)))
}

/// Device milliseconds per call of `f` (given the stream to enqueue on) with `handle`, as a
/// replayed step runs it ([`time_replayed`]: cuDNN's per-call host work left out, which would
/// otherwise favour plans whose kernels are slower but cheaper to set up); the eager timing on
/// `stream` when the call cannot be captured. The handle's stream is `stream` again after.
fn time_plan(
    handle: sys::cudnnHandle_t,
    stream: ds::CUstream,
    mut f: impl FnMut(ds::CUstream) -> Result<()>,
) -> Result<f32> {
    let replayed = time_replayed(|s| {
        set_stream(handle, s)?;
        f(s)
    });
    set_stream(handle, stream)?;
    match replayed {
        Ok(Some(ms)) => Ok(ms),
        other => {
            let why = match other {
                Err(e) => e.to_string(),
                _ => "the call could not be captured".into(),
            };
            choice_log()
                .lock()
                .expect("attention choices")
                .push(format!("timed eagerly: {why}"));
            time(stream, || f(stream))
        }
    }
}

/// Rounds of timing per candidate plan: each candidate's best round counts, so that a clock
/// still rising from idle while the first candidates run does not decide the choice.
const TIMING_ROUNDS: usize = 2;

/// The index and time of the fastest of `n` candidates, each timed by `time_one` in every one
/// of [`TIMING_ROUNDS`] rounds (candidate by candidate) and counted by its best round; a
/// candidate that fails drops out (`None` when none ran); and every candidate's best time
/// (`None` for one that failed).
fn fastest_of(
    n: usize,
    mut time_one: impl FnMut(usize) -> Result<f32>,
) -> (Option<(usize, f32)>, Vec<Option<f32>>) {
    let mut best: Vec<Option<f32>> = vec![Some(f32::INFINITY); n];
    for _ in 0..TIMING_ROUNDS {
        for (i, b) in best.iter_mut().enumerate() {
            if let Some(t0) = *b {
                *b = time_one(i).ok().map(|t| t.min(t0));
            }
        }
    }
    let won = best
        .iter()
        .enumerate()
        .filter_map(|(i, t)| t.filter(|t| t.is_finite()).map(|t| (i, t)))
        .min_by(|a, b| a.1.total_cmp(&b.1));
    (won, best)
}

/// The choices cuDNN attention timing made in this process, one line each: the candidates
/// (engine, configuration, milliseconds per call as a replayed step runs them) and the one
/// kept. For profiles and benchmarks that want to say which kernels ran.
pub fn attention_choices() -> Vec<String> {
    choice_log().lock().expect("attention choices").clone()
}

fn choice_log() -> &'static Mutex<Vec<String>> {
    static C: OnceLock<Mutex<Vec<String>>> = OnceLock::new();
    C.get_or_init(Default::default)
}

/// Records a timed choice among `plans` (see [`attention_choices`]).
fn log_choice(what: &str, d: &AttnDnnDesc, plans: &[GraphPlan], times: &[Option<f32>]) {
    let cands: Vec<String> = plans
        .iter()
        .zip(times)
        .map(|(p, t)| match t {
            Some(t) => format!("engine {} config {}: {t:.4} ms", p.engine, p.config),
            None => format!("engine {} config {}: failed", p.engine, p.config),
        })
        .collect();
    let line = format!(
        "{what} b{} h{} sq{} sk{} d{} {:?}: {}",
        d.b,
        d.h,
        d.sq,
        d.sk,
        d.d,
        d.causal,
        cands.join(", ")
    );
    choice_log().lock().expect("attention choices").push(line);
}

fn set_stream(handle: sys::cudnnHandle_t, stream: ds::CUstream) -> Result<()> {
    // SAFETY: the handle is live and the stream belongs to the current context.
    unsafe { cudarc::cudnn::result::set_stream(handle, stream as _) }
        .map_err(|e| RuntimeError::Device(format!("cuDNN set stream: {e:?}")))
}

/// The forward's pointers ([`FWD_STATS_VARIANT`] order).
fn fwd_pointers(p: &GradPtrs, l: &GradLayout, ws: u64) -> Vec<u64> {
    vec![p.q, p.k, p.v, ws + l.o as u64, ws + l.stats as u64]
}

/// The backward's pointers ([`bwd_uids`] order): O and the statistics the forward saved, else
/// those of the workspace.
fn bwd_pointers(p: &GradPtrs, l: &GradLayout, ws: u64) -> Vec<u64> {
    let at = |off: usize| ws + off as u64;
    let (o, stats) = if p.saved() {
        (p.o, p.stats)
    } else {
        (at(l.o), at(l.stats))
    };
    let mut v = vec![p.q, p.k, p.v, o, p.dout, stats, at(l.sums)];
    v.extend(l.accum.map(at));
    v.extend([p.dq, p.dk, p.dv]);
    if let Some((sq, sk)) = l.seq {
        v.extend([at(sq), at(sk)]);
    }
    v
}

/// Prepares the backward's workspace tensors on `stream`: Sq and Sk in the length tensors (the
/// padding form; the frontend writes them before each call), and zeroes the dQ accumulator when
/// `zero_accum`.
fn fill_workspace(
    l: &GradLayout,
    zero_accum: bool,
    ws: u64,
    d: &AttnDnnDesc,
    stream: ds::CUstream,
) -> Result<()> {
    let mut fills = vec![];
    if let Some((sq, sk)) = l.seq {
        fills.push((sq, d.sq as u32, d.b));
        fills.push((sk, d.sk as u32, d.b));
    }
    if let Some(at) = l.accum.filter(|_| zero_accum) {
        fills.push((at, 0, d.b * d.h * d.sq * d.d));
    }
    for (at, value, n) in fills {
        // SAFETY: each region of the workspace holds `n` 32-bit values (the layout's contract;
        // the caller's workspace has `l.total` bytes); the memset is ordered on `stream`.
        unsafe { ds::cuMemsetD32Async(ws + at as u64, value, n, stream) }
            .result()
            .map_err(|e| RuntimeError::Device(format!("filling the gradient's workspace: {e}")))?;
    }
    Ok(())
}

// Entry point of the attention-gradient step, which the CUDA session wires.
#[allow(dead_code)]
impl GradPlans {
    /// Workspace bytes a call needs: O, the statistics, the row sums, the dQ accumulator and the
    /// plans' workspace ([`GradLayout`]).
    pub(crate) fn workspace(&self) -> usize {
        self.layout.total
    }

    /// The engines of the forward and the backward plan.
    pub(crate) fn engines(&self) -> (i64, i64) {
        (self.fwd.engine, self.bwd.engine)
    }

    /// The configurations ([`GraphPlan::config`]) of the forward and the backward plan.
    pub(crate) fn configs(&self) -> (usize, usize) {
        (self.fwd.config, self.bwd.config)
    }

    /// The backward graph's form.
    pub(crate) fn form(&self) -> BwdForm {
        self.form
    }

    /// Enqueues the gradient on `stream`: the forward with statistics into the workspace, then
    /// the backward into dq, dk and dv. `workspace` holds at least [`GradPlans::workspace`]
    /// bytes; every pointer must be 16-byte aligned.
    pub(crate) fn run(
        &mut self,
        handle: sys::cudnnHandle_t,
        ptrs: &GradPtrs,
        workspace: u64,
        stream: ds::CUstream,
    ) -> Result<()> {
        let mut all = vec![ptrs.q, ptrs.k, ptrs.v, ptrs.dout, ptrs.dq, ptrs.dk, ptrs.dv];
        if ptrs.saved() {
            all.extend([ptrs.o, ptrs.stats]);
        }
        if !GraphPlan::aligned(&all, workspace) {
            return Err(RuntimeError::Invalid(format!(
                "cuDNN attention gradient of {:?}: pointers {all:x?} / workspace {workspace:#x} \
                 are not 16-byte aligned",
                self.d
            )));
        }
        set_stream(handle, stream)?;
        self.enqueue(handle, ptrs, workspace, stream)
    }

    fn enqueue(
        &mut self,
        handle: sys::cudnnHandle_t,
        ptrs: &GradPtrs,
        ws: u64,
        stream: ds::CUstream,
    ) -> Result<()> {
        let plan_ws = ws + self.layout.plan as u64;
        if !ptrs.saved() {
            self.fwd
                .execute(handle, &fwd_pointers(ptrs, &self.layout, ws), plan_ws)?;
        }
        fill_workspace(&self.layout, self.zero_accum, ws, &self.d, stream)?;
        self.bwd
            .execute(handle, &bwd_pointers(ptrs, &self.layout, ws), plan_ws)
    }

    /// Mean ms of one full gradient ([`GradPlans::run`]) on the step's own buffers, for the
    /// choice against the flash kernels (it writes dq, dk, dv and the workspace).
    pub(crate) fn time(
        &mut self,
        handle: sys::cudnnHandle_t,
        ptrs: &GradPtrs,
        workspace: u64,
        stream: ds::CUstream,
    ) -> Result<f64> {
        self.run(handle, ptrs, workspace, stream)?;
        let ms = time_plan(handle, stream, |s| self.enqueue(handle, ptrs, workspace, s))?;
        Ok(ms as f64)
    }
}

/// Outcome of a choice, cached per description for the process: the configuration
/// ([`GraphPlan::config`]) of the cuDNN plan that won, or `None` for the flash kernel.
fn cache() -> &'static Mutex<HashMap<AttnDnnDesc, Option<usize>>> {
    static C: OnceLock<Mutex<HashMap<AttnDnnDesc, Option<usize>>>> = OnceLock::new();
    C.get_or_init(Default::default)
}

/// The configuration of the forward-with-statistics plan chosen for each description, for the
/// process: every attention of a model with the same shape then runs the same kernels, timed
/// once.
fn saving_cache() -> &'static Mutex<HashMap<AttnDnnDesc, usize>> {
    static C: OnceLock<Mutex<HashMap<AttnDnnDesc, usize>>> = OnceLock::new();
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
                (Choice::Auto, Some(Some(config))) => {
                    // Keep the configuration that won before, if it is still proposed.
                    match v.iter().position(|p| p.config == config) {
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

/// The forward with its statistics written out for the gradient's step (see the module docs):
/// the fastest of cuDNN's plans for `d`, timed on buffers of its own filled with ones (q, k, v,
/// O, the statistics, the plan's workspace). Its [`GraphPlan::execute`] binds
/// [`FWD_STATS_VARIANT`]. It runs plans on `stream`, so it must not be called during stream
/// capture; the context must be bound.
pub(crate) fn prepare_saving(
    handle: sys::cudnnHandle_t,
    d: &AttnDnnDesc,
    stream: ds::CUstream,
) -> Result<GraphPlan> {
    let mut plans = forward_plans(handle, d, true)?;
    let known = saving_cache()
        .lock()
        .expect("attention cache")
        .get(d)
        .copied();
    if let Some(i) = known.and_then(|c| plans.iter().position(|p| p.config == c)) {
        return Ok(plans.swap_remove(i));
    }
    let (i, ms) = fastest_forward(handle, d, &mut plans, true, None, stream)?.0;
    let plan = plans.swap_remove(i);
    saving_cache()
        .lock()
        .expect("attention cache")
        .insert(d.clone(), plan.config);
    tracing::debug!(
        "attention {d:?}: forward with statistics, cuDNN engine {} ({ms:.4} ms)",
        plan.engine
    );
    Ok(plan)
}

/// Runs the flash kernels of the step on the given stream, over the step's own buffers (at
/// prepare nothing in them is live): what [`choose`] times against cuDNN's plans.
pub(crate) type FlashRun<'a> = &'a dyn Fn(ds::CUstream) -> Result<()>;

/// Picks the plan to run for `d` from `p`: the only one when decided; else times each plan
/// and the flash kernel on buffers of the step's sizes and keeps the fastest (forced cuDNN keeps
/// the fastest plan). Returns `None` for the flash kernel. In auto mode a failure means flash.
pub(crate) fn choose(
    handle: sys::cudnnHandle_t,
    d: &AttnDnnDesc,
    mut p: Prepared,
    choice: Choice,
    flash: Option<FlashRun>,
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
    let timed = fastest_forward(handle, d, &mut p.plans, false, flash, stream);
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
                .insert(d.clone(), Some(plan.config));
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

/// The index and time of the fastest of the forward `plans` of `d` (with the statistics written
/// out when `stats`), and the flash kernels' time when given: the plans on buffers of their own
/// filled with ones (q, k, v, O, [the statistics,] the plans' workspace), the flash kernels on
/// the step's buffers.
fn fastest_forward(
    handle: sys::cudnnHandle_t,
    d: &AttnDnnDesc,
    plans: &mut [GraphPlan],
    stats: bool,
    flash: Option<FlashRun>,
    stream: ds::CUstream,
) -> Result<((usize, f32), Option<f32>)> {
    let ws = plans.iter().map(|g| g.workspace).max().unwrap_or(0);
    let mut sizes = vec![
        d.operand_bytes(d.sq),
        d.operand_bytes(d.sk),
        d.operand_bytes(d.sk),
        d.bytes(d.sq),
    ];
    if stats {
        sizes.push(d.b * d.h * d.sq * 4);
    }
    sizes.push(ws);
    let bufs = Buffers::new(&sizes, d.dtype, stream)?;
    let n = sizes.len() - 1;
    // Packed q, k and v lie at their offsets into buffers of the packed size.
    let mut ptrs = bufs.ptrs[..n].to_vec();
    for (j, p) in ptrs.iter_mut().take(3).enumerate() {
        *p += d.part_offset(j);
    }
    let workspace = bufs.ptrs[n];
    set_stream(handle, stream)?;
    let (best, times) = fastest_of(plans.len(), |i| {
        let g = &mut plans[i];
        time_plan(handle, stream, |_| g.execute(handle, &ptrs, workspace))
            .inspect_err(|e| tracing::trace!("cuDNN engine {} failed on {d:?}: {e}", g.engine))
    });
    let (label, what) = if stats {
        ("forward with statistics", " forward with statistics")
    } else {
        ("forward", "")
    };
    log_choice(label, d, plans, &times);
    let best = best.ok_or_else(|| {
        RuntimeError::Device(format!("cuDNN fused attention{what}: no plan of {d:?} ran"))
    })?;
    let flash_ms = match flash {
        Some(f) => Some(time(stream, || f(stream))?),
        None => None,
    };
    Ok((best, flash_ms))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustytorch_ops::{AttnLayout, DType};

    /// The choice counts each candidate's best round (a clock rising during the first round
    /// does not decide it) and drops a candidate that fails.
    #[test]
    fn fastest_takes_each_candidates_best_round() {
        let times = [[5.0f32, 1.0], [2.0, 2.0]];
        let mut calls = [0usize; 3];
        let best = fastest_of(3, |i| {
            let k = calls[i];
            calls[i] += 1;
            match times.get(i) {
                Some(t) => Ok(t[k]),
                None => Err(RuntimeError::Device("no plan".into())),
            }
        })
        .0;
        assert_eq!(best, Some((0, 1.0)));
        assert_eq!(calls, [2, 2, 1]);
        assert_eq!(fastest_of(0, |_| Ok(1.0)).0, None);
        assert_eq!(
            fastest_of(2, |_| Err(RuntimeError::Device("no plan".into()))).0,
            None
        );
    }

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

    #[test]
    fn backward_forms_and_bindings() {
        // The frontend's form first: K's reshape in f32, dQ through the f32 accumulator.
        for pad in [false, true] {
            let forms = bwd_forms(pad);
            assert_eq!(
                forms[0],
                BwdForm {
                    k_io: false,
                    accum: true,
                    pad
                }
            );
            assert!(forms.iter().all(|f| f.pad == pad));
            assert!(forms[1].k_io && forms[1].accum);
            assert!(!forms[2].k_io && !forms[2].accum);
        }
        let [plain, _, direct] = bwd_forms(false);
        let padded = bwd_forms(true)[0];
        let head = [
            uid::Q,
            uid::K,
            uid::V,
            uid::O,
            uid::DO,
            uid::STATS,
            uid::SOFTMAX_SUM,
        ];
        let tail = [uid::DQ, uid::DK, uid::DV];
        assert_eq!(
            bwd_uids(plain),
            [&head[..], &[uid::DQ_ACCUM], &tail].concat()
        );
        assert_eq!(bwd_uids(direct), [&head[..], &tail].concat());
        assert_eq!(
            bwd_uids(padded),
            [
                &head[..],
                &[uid::DQ_ACCUM],
                &tail,
                &[uid::SEQ_LEN_Q, uid::SEQ_LEN_KV]
            ]
            .concat()
        );
        assert_eq!(
            FWD_STATS_VARIANT,
            [uid::Q, uid::K, uid::V, uid::O, uid::STATS]
        );
        // Fixed uids never collide with each other nor with the virtual ones (from S up).
        let mut ids = bwd_uids(padded);
        ids.extend([
            uid::SCALE,
            uid::FILL,
            uid::SK,
            uid::SQ,
            uid::ONE,
            uid::PAD_FILL,
        ]);
        let n = ids.len();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), n);
        assert!(ids.iter().all(|i| !(uid::S..=1000).contains(i)));
        let one = 1.0f32.to_bits();
        let (scale, fill) = (0.125f32.to_bits(), f32::MIN.to_bits());
        let inf = f32::NEG_INFINITY.to_bits();
        assert_eq!(
            grad_scalars(&desc(Causal::None), plain),
            vec![(uid::SCALE, scale), (uid::ONE, one)]
        );
        assert_eq!(
            grad_scalars(&desc(Causal::BottomRight), plain),
            vec![
                (uid::SCALE, scale),
                (uid::FILL, fill),
                (uid::SK, 5),
                (uid::SQ, 3),
                (uid::ONE, one)
            ]
        );
        // The padding form shifts the bottom-right mask by its length tensors.
        assert_eq!(
            grad_scalars(&desc(Causal::BottomRight), padded),
            vec![
                (uid::SCALE, scale),
                (uid::FILL, fill),
                (uid::ONE, one),
                (uid::PAD_FILL, inf)
            ]
        );
        // The frontend pads for cuDNN <= 9.15.0 when Sk is not a multiple of 128.
        assert!(needs_padding(91400, 127));
        assert!(needs_padding(91500, 64));
        assert!(!needs_padding(91400, 256));
        assert!(!needs_padding(91501, 127));
        assert!(!needs_padding(92000, 127));
    }

    #[test]
    fn gradient_workspace_layout() {
        // b 2, h 4, sq 3, d 64, bf16: O 3072 B, rows 96 B, accumulator 6144 B, lengths 8 B.
        let d = desc(Causal::None);
        let [plain, _, direct] = bwd_forms(false);
        let padded = bwd_forms(true)[0];
        let l = GradLayout::new(&d, plain, 1000);
        assert_eq!(
            l,
            GradLayout {
                o: 0,
                stats: 3072,
                sums: 3328,
                accum: Some(3584),
                seq: None,
                plan: 9728,
                total: 10752
            }
        );
        let l = GradLayout::new(&d, direct, 0);
        assert_eq!((l.accum, l.seq, l.plan, l.total), (None, None, 3584, 3584));
        let l = GradLayout::new(&d, padded, 0);
        assert_eq!(
            (l.accum, l.seq, l.plan, l.total),
            (Some(3584), Some((9728, 9984)), 10240, 10240)
        );
        for form in [plain, direct, padded] {
            let l = GradLayout::new(&d, form, 7);
            let (sq, sk) = l.seq.unwrap_or_default();
            let offs = [l.o, l.stats, l.sums, l.accum.unwrap_or(0), sq, sk, l.plan];
            assert!(offs.iter().chain([&l.total]).all(|o| o % GRAD_ALIGN == 0));
            assert!(offs.windows(2).all(|w| w[0] <= w[1] || w[1] == 0), "{l:?}");
            assert!(l.total >= l.plan + 7);
        }
        // The pointers each graph binds, from the layout.
        let p = GradPtrs {
            q: 1,
            k: 2,
            v: 3,
            dout: 4,
            dq: 5,
            dk: 6,
            dv: 7,
            o: 0,
            stats: 0,
        };
        let w = 1u64 << 20;
        let l = GradLayout::new(&d, plain, 1000);
        assert_eq!(fwd_pointers(&p, &l, w), vec![1, 2, 3, w, w + 3072]);
        assert_eq!(
            bwd_pointers(&p, &l, w),
            vec![1, 2, 3, w, 4, w + 3072, w + 3328, w + 3584, 5, 6, 7]
        );
        let l = GradLayout::new(&d, direct, 1000);
        assert_eq!(
            bwd_pointers(&p, &l, w),
            vec![1, 2, 3, w, 4, w + 3072, w + 3328, 5, 6, 7]
        );
        // O and the statistics a forward saved replace the workspace's.
        let saved = GradPtrs {
            o: 8,
            stats: 9,
            ..p
        };
        assert!(saved.saved() && !p.saved());
        assert_eq!(
            bwd_pointers(&saved, &l, w),
            vec![1, 2, 3, 8, 4, 9, w + 3328, 5, 6, 7]
        );
        let l = GradLayout::new(&d, padded, 1000);
        assert_eq!(
            bwd_pointers(&p, &l, w),
            vec![
                1,
                2,
                3,
                w,
                4,
                w + 3072,
                w + 3328,
                w + 3584,
                5,
                6,
                7,
                w + 9728,
                w + 9984
            ]
        );
        assert_eq!(bwd_pointers(&p, &l, w).len(), bwd_uids(padded).len());
        assert!(accum_needs_zeroing(90500));
        assert!(!accum_needs_zeroing(90600));
        assert!(!accum_needs_zeroing(91400));
        assert_eq!(
            transposed_score_geometry(&d),
            ([2, 4, 5, 3], [60, 15, 1, 5])
        );
        assert_eq!(accum_geometry(&d), ([2, 4, 3, 64], [768, 192, 64, 1]));
        assert_eq!(row_geometry(&d), ([2, 4, 3, 1], [12, 3, 1, 1]));
    }

    /// The gradient through cuDNN against the float64 CPU kernel of `AttentionGrad` (run with
    /// `RUSTYTORCH_TEST_CUDA=1 cargo test -p rustytorch-runtime --release --lib dnn_attention
    /// -- --nocapture` on the GPU machine); prints each shape's engines and times.
    #[test]
    fn gradient_matches_f64_reference_on_gpu() {
        if std::env::var("RUSTYTORCH_TEST_CUDA").as_deref() != Ok("1") {
            eprintln!("skipped: set RUSTYTORCH_TEST_CUDA=1 on a CUDA machine");
            return;
        }
        let dev = crate::cuda::GpuDevice::get(0).expect("CUDA device 0");
        dev.bind().expect("bind");
        eprintln!("cuDNN {}", super::super::dnn::Dnn::version());
        let mut failures = vec![];
        for (i, case) in gpu_cases().into_iter().enumerate() {
            match check_case(&dev, &case, 100 + i as u64) {
                Ok(line) => eprintln!("ok   {line}"),
                Err(e) => {
                    eprintln!("FAIL {case:?}: {e}");
                    failures.push(format!("{case:?}: {e}"));
                }
            }
        }
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }

    /// One GPU case: dtype, layout, causal, (sq, sk), head size (b 2, h 3).
    type Case = (DType, AttnLayout, Causal, (usize, usize), usize);

    fn gpu_cases() -> Vec<Case> {
        use AttnLayout::{Bhsd, Bshd};
        use Causal::{BottomRight as Br, None as No, TopLeft as Tl};
        use DType::{BF16, F16};
        vec![
            (BF16, Bhsd, No, (64, 64), 64),
            (F16, Bhsd, No, (64, 64), 64),
            (BF16, Bshd, Tl, (64, 64), 128),
            (F16, Bshd, Br, (64, 64), 64),
            (BF16, Bhsd, Tl, (127, 127), 64),
            (F16, Bshd, No, (127, 127), 128),
            (BF16, Bhsd, Br, (127, 256), 128),
            (F16, Bhsd, Tl, (256, 127), 64),
            (BF16, Bshd, No, (64, 256), 64),
            (F16, Bshd, Br, (64, 127), 128),
            (BF16, Bshd, Tl, (256, 256), 128),
            (F16, Bhsd, Br, (256, 256), 64),
            (BF16, Bhsd, No, (256, 64), 128),
            (F16, Bshd, Tl, (127, 64), 64),
        ]
    }

    /// Largest |got − want| over the largest |want|.
    fn scaled_error(got: &[f64], want: &[f64]) -> f64 {
        let max = want.iter().fold(0f64, |m, w| m.max(w.abs()));
        let err = got
            .iter()
            .zip(want)
            .fold(0f64, |m, (g, w)| m.max((g - w).abs()));
        if err.is_nan() || got.iter().any(|g| !g.is_finite()) {
            return f64::INFINITY;
        }
        err / max.max(f64::MIN_POSITIVE)
    }

    /// Tolerance on [`scaled_error`]: P and dS are rounded to the operands' type before their
    /// products (the frontend's reshapes), as in the flash kernels.
    fn grad_tol(dt: DType) -> f64 {
        match dt {
            DType::F16 => 5e-3,
            _ => 2e-2,
        }
    }

    fn check_case(
        dev: &crate::cuda::GpuDevice,
        &(dt, layout, causal, (sq, sk), hd): &Case,
        seed: u64,
    ) -> std::result::Result<String, String> {
        use rustytorch_ops::{eval_cpu, testing::rand_tensor, AttnMask, F64Bits, Op, TensorType};
        let (b, h) = (2, 3);
        let scale = 1.0 / (hd as f32).sqrt();
        let d = AttnDnnDesc {
            dtype: dt,
            b,
            h,
            sq,
            sk,
            d: hd,
            causal,
            scale_bits: scale.to_bits(),
            layout,
        };
        let ty = |s| TensorType::new(dt, layout.from_bhsd([b, h, s, hd]));
        let tys = [ty(sq), ty(sk), ty(sk), ty(sq)];
        let host: Vec<_> = tys
            .iter()
            .enumerate()
            .map(|(i, t)| rand_tensor(t, seed * 10 + i as u64, -1.0, 1.0))
            .collect();
        let stream = dev.stream.cu_stream();
        let s = |e: RuntimeError| e.to_string();
        let mut blocks = vec![];
        for t in tys.iter().chain(&tys[..3]) {
            blocks.push(dev.alloc(t.size_bytes()).map_err(s)?);
        }
        for (blk, t) in blocks.iter().zip(&host) {
            super::super::session::htod(blk.addr, t, stream).map_err(s)?;
        }
        let a: Vec<u64> = blocks.iter().map(|b| b.addr).collect();
        let ptrs = GradPtrs {
            q: a[0],
            k: a[1],
            v: a[2],
            dout: a[3],
            dq: a[4],
            dk: a[5],
            dv: a[6],
            o: 0,
            stats: 0,
        };
        let mut plans = dev
            .with_dnn(|dn| prepare_grad(dn.handle, &d, Choice::Cudnn, stream))
            .map_err(s)?
            .ok_or("no cuDNN plans")?;
        let ws = dev.alloc(plans.workspace()).map_err(s)?;
        dev.with_dnn(|dn| plans.run(dn.handle, &ptrs, ws.addr, stream))
            .map_err(s)?;
        dev.sync().map_err(s)?;
        let got: Vec<_> = (0..3)
            .map(|i| super::super::session::dtoh(a[4 + i], &tys[i], stream))
            .collect::<Result<_>>()
            .map_err(s)?;
        let total = dev
            .with_dnn(|dn| plans.time(dn.handle, &ptrs, ws.addr, stream))
            .map_err(s)?;
        dev.free(ws);
        for blk in blocks {
            dev.free(blk);
        }
        let wide: Vec<_> = host.iter().map(|t| t.cast(DType::F64)).collect();
        let refs: Vec<_> = wide.iter().collect();
        let mut errs = vec![];
        for (wrt, g) in got.iter().enumerate() {
            let op = Op::AttentionGrad {
                causal,
                mask: AttnMask::None,
                scale: F64Bits::new(scale as f64),
                wrt: wrt as u8,
                layout,
            };
            let want = eval_cpu(&op, &refs).map_err(|e| e.to_string())?;
            errs.push(scaled_error(&g.to_f64_vec(), &want.to_f64_vec()));
        }
        let (fe, be) = plans.engines();
        let line = format!(
            "{dt:?} {layout:?} {causal:?} sq {sq} sk {sk} d {hd}: engines fwd {fe} bwd {be} \
             {:?}; fwd-with-stats {:.4} ms, bwd {:.4} ms, full gradient {total:.4} ms; \
             error dQ {:.2e} dK {:.2e} dV {:.2e} (tol {:.0e})",
            plans.form(),
            plans.fwd_ms.unwrap_or(f32::NAN),
            plans.bwd_ms.unwrap_or(f32::NAN),
            errs[0],
            errs[1],
            errs[2],
            grad_tol(dt)
        );
        if errs.iter().all(|&e| e <= grad_tol(dt)) {
            Ok(line)
        } else {
            Err(line)
        }
    }
}
