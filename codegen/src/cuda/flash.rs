//! Flash attention on the tensor cores: f16/bf16 attention forward in one kernel whose scores
//! never reach memory, for head sizes that are multiples of 16 up to 128.
//!
//! # The kernel
//!
//! A block of four warps owns 64 query rows of one (batch, head); each warp owns 16 of them and
//! keeps their query fragments in registers for the whole walk over the keys (loaded once, as
//! `mma.m16n8k16` A fragments). The keys and values go through shared memory in tiles of 64
//! rows, loaded with `cp.async` (16-byte chunks; rows past the end are zero-filled): the value
//! tile of step `j` loads while the scores of step `j` are computed, and the key tile of `j + 1`
//! while the probabilities of `j` meet the values. Per tile and warp:
//!
//! 1. `S = Q·Kᵀ` (16 × 64, f32 accumulators) with `mma.sync.m16n8k16`, the key fragments read by
//!    `ldmatrix` from rows padded by 16 bytes (no bank conflicts);
//! 2. the scores scaled into the base-2 domain (`scale · log2 e`), the causal limit, the end of
//!    the keys and the mask applied only on tiles that cross them, then the online softmax: the
//!    row maximum over the four lanes that share a row (two shuffles), the running sum rescaled,
//!    the output accumulators rescaled, `P = 2^(S − m)`;
//! 3. `O += P·V` with `P` rounded to the operands' type and reused straight from the score
//!    accumulators as A fragments (the m16n8 accumulator layout is the A layout of two k-halves),
//!    the value fragments read by `ldmatrix.trans`.
//!
//! At the end each row is divided by its sum (reduced over its four lanes). The semantics are
//! those of the CPU kernel (`rustytorch_ops::attention`): statistics in f32; masked keys (causal,
//! a false bool mask, a −∞ additive mask) weigh nothing; a row whose keys are all masked is zero;
//! a NaN score makes its row NaN. Differences are rounding only: `P` is rounded to f16/bf16
//! before `P·V` (as every flash kernel does) and `2^x` is the hardware approximation.
//!
//! For causal attention a block walks only the key tiles its rows can see, and the blocks are
//! scheduled heaviest first. The grid is one block per (batch·head, query tile), strided when it
//! exceeds the launch limit.
//!
//! This is the `mma.sync` kernel every GPU from sm_80 on runs (Hopper included); what it leaves to
//! a Hopper-specific kernel (warpgroup MMA, TMA loads, warp specialization) is noted in
//! docs/performance.md with its measured speed.

mod backward;
mod decode;
mod hopper;
mod hopper_bwd;
mod hopper_ws;

use super::ir::{CTy, Kernel, Param, Stmt};
use super::{finish, grid_for, ArgRef, Launch, StepKernels};
use crate::Result;
use rustytorch_ops::{AttnLayout, AttnMask, Causal, DType, Op, Shape, TensorType, ATTN_WRT_PACKED};

/// Query rows per block (four warps of 16).
const BR: usize = 64;
/// Keys per shared-memory tile.
const BC: usize = 64;
/// Threads per block.
const THREADS: u32 = 128;
/// The largest head size (query/key and value) the kernel holds in registers.
pub const MAX_HEAD: usize = 128;

/// Whether the flash kernel runs attention over `inputs`: f16/bf16 operands with head sizes
/// that are multiples of 16 up to [`MAX_HEAD`]. `RUSTYTORCH_ATTENTION=gemm` or `=kernel` selects
/// the other implementations instead.
pub fn supported(inputs: &[&TensorType]) -> bool {
    let (q, v) = (inputs[0], inputs[2]);
    // The head sizes are the last dims in every layout (a packed operand is [B, S, 3, H, D]).
    let last = |t: &TensorType| t.shape.dims().last().copied().unwrap_or(0);
    let (d, dv) = (last(q), last(v));
    let env = std::env::var("RUSTYTORCH_ATTENTION");
    matches!(q.dtype, DType::F16 | DType::BF16)
        && [d, dv]
            .iter()
            .all(|&h| h > 0 && h % 16 == 0 && h <= MAX_HEAD)
        && !matches!(env.as_deref(), Ok("gemm") | Ok("kernel"))
}

/// Which tensor of attention a pointer or stride is for: q, k or v (or the gradient with
/// respect to it), or O (the result, or dO). Q, K and V are also their index in a packed
/// `[B, S, 3, H, D]` tensor.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Part {
    Q = 0,
    K = 1,
    V = 2,
    O = 3,
}

/// Sizes, types and the mask of one attention op, as the kernels are specialized on them.
struct Spec {
    bsz: usize,
    heads: usize,
    sq: usize,
    sk: usize,
    d: usize,
    dv: usize,
    causal: Causal,
    scale: f64,
    layout: AttnLayout,
    e: CTy,
    /// The statement that applies the mask to score `x` of query `row`, key `key` (head `bh`).
    mask: Option<String>,
    /// q, k, v and the mask's parameters.
    params: Vec<Param>,
}

impl Spec {
    /// Checks `out` against the inferred type; None for an empty result.
    fn new(op: &Op, inputs: &[&TensorType], out: &TensorType) -> Result<Option<Spec>> {
        let (causal, mask, scale, layout) = match op {
            Op::Attention {
                causal,
                mask,
                scale,
                layout,
            }
            | Op::AttentionGrad {
                causal,
                mask,
                scale,
                layout,
                ..
            } => (*causal, *mask, scale.get(), *layout),
            _ => {
                return Err(crate::CodegenError::Invalid(format!(
                    "{} is not attention",
                    op.name()
                )))
            }
        };
        super::attention::check_result(op, inputs, out)?;
        if out.shape.numel() == 0 {
            return Ok(None);
        }
        let (qd, kd, vd) = (
            layout.to_bhsd(inputs[0].shape.dims()),
            layout.to_bhsd(inputs[1].shape.dims()),
            layout.to_bhsd(inputs[2].shape.dims()),
        );
        let (bsz, heads, sq, d, sk, dv) = (qd[0], qd[1], qd[2], qd[3], kd[2], vd[3]);
        let e = CTy::storage(inputs[0].dtype);
        let mut params = vec![
            param("q", e, false),
            param("k", e, false),
            param("v", e, false),
        ];
        let mask = match mask {
            AttnMask::None => None,
            AttnMask::Additive | AttnMask::Bool => {
                let m = inputs[3];
                let me = CTy::storage(m.dtype);
                params.push(param("mask", me, false));
                let st = m.shape.broadcast_strides(&Shape::new([bsz, heads, sq, sk]));
                let index = format!(
                    "(bh / {heads}LL) * {}LL + (bh % {heads}LL) * {}LL + (long long)row * {}LL + (long long)key * {}LL",
                    st[0], st[1], st[2], st[3]
                );
                Some(match (mask, me) {
                    (AttnMask::Bool, _) => format!("x = mask[{index}] ? x : RT_NEG_INF;"),
                    (_, CTy::F16) => format!("x += rt_h2f(mask[{index}]) * RT_LOG2E;"),
                    (_, CTy::BF16) => format!("x += rt_bf2f(mask[{index}]) * RT_LOG2E;"),
                    _ => format!("x += (float)mask[{index}] * RT_LOG2E;"),
                })
            }
        };
        Ok(Some(Spec {
            bsz,
            heads,
            sq,
            sk,
            d,
            dv,
            causal,
            scale,
            layout,
            e,
            mask,
            params,
        }))
    }

    /// The rows and row width of `part`'s tensor (a gradient has its operand's).
    fn extent(&self, part: Part) -> (usize, usize) {
        match part {
            Part::Q => (self.sq, self.d),
            Part::K => (self.sk, self.d),
            Part::V => (self.sk, self.dv),
            Part::O => (self.sq, self.dv),
        }
    }

    /// The C expression of head `bh`'s first element in `part`'s tensor (q, k or v and their
    /// gradients; O for the result and dO). A packed q, k or v lies in one `[B, S, 3, H, D]`
    /// tensor, at its index in the third dim.
    fn head(&self, part: Part) -> String {
        let (rows, width) = self.extent(part);
        let h = self.heads;
        match (self.layout, part) {
            (AttnLayout::Bhsd, _) => format!("bh * {rows}LL * {width}LL"),
            (AttnLayout::Packed, Part::Q | Part::K | Part::V) => format!(
                "(bh / {h}LL) * {}LL + (bh % {h}LL) * {width}LL + {}LL",
                rows * 3 * h * width,
                part as usize * h * width
            ),
            (AttnLayout::Bshd | AttnLayout::Packed, _) => format!(
                "(bh / {h}LL) * {}LL + (bh % {h}LL) * {width}LL",
                rows * h * width
            ),
        }
    }

    /// Elements between consecutive rows of one head in `part`'s tensor.
    fn stride(&self, part: Part) -> usize {
        let (_, width) = self.extent(part);
        match (self.layout, part) {
            (AttnLayout::Bhsd, _) => width,
            (AttnLayout::Packed, Part::Q | Part::K | Part::V) => 3 * self.heads * width,
            (AttnLayout::Bshd | AttnLayout::Packed, _) => self.heads * width,
        }
    }

    /// The tensor map over `part`'s tensor (q, k, v or dO) as a `[B, H, rows, width]` view, dims
    /// innermost first (width, rows, heads, batch), for copies of `box_rows` rows of 64
    /// columns into 128-byte-swizzled tiles: rows past a head's end are outside the view, so a
    /// copy zero-fills them.
    fn tensor_map(&self, part: Part, box_rows: u32) -> super::ir::TensorMap {
        let (rows, width) = self.extent(part);
        let h = self.heads;
        let row = self.stride(part);
        // Elements between heads and between batches, and the view's first element.
        let (head, batch, first) = match (self.layout, part) {
            (AttnLayout::Bhsd, _) => (rows * width, h * rows * width, 0),
            (AttnLayout::Packed, Part::Q | Part::K | Part::V) => {
                (width, rows * row, part as usize * h * width)
            }
            (AttnLayout::Bshd | AttnLayout::Packed, _) => (width, rows * row, 0),
        };
        let bytes = |e: usize| e as u64 * 2;
        super::ir::TensorMap {
            elem: self.e,
            offset: bytes(first),
            dims: vec![width as u64, rows as u64, h as u64, self.bsz as u64],
            strides: vec![bytes(row), bytes(head), bytes(batch)],
            boxes: vec![64, box_rows, 1, 1],
            swizzle128: true,
        }
    }

    fn elem(&self) -> &'static str {
        if self.e == CTy::BF16 {
            "bf16"
        } else {
            "f16"
        }
    }

    /// Blocks of `BR` query rows (or `BC` keys) over every (batch, head).
    fn tiles(&self, rows: usize) -> usize {
        self.bsz * self.heads * rows.div_ceil(BR)
    }

    /// The forward source, ending as `tail` says.
    fn forward(&self, tail: Tail) -> String {
        source(&self.shape2(tail))
    }

    /// What the forward kernels are specialized on.
    fn shape2(&self, tail: Tail) -> Shape2 {
        Shape2 {
            sq: self.sq,
            sk: self.sk,
            d: self.d,
            dv: self.dv,
            tiles: self.tiles(self.sq),
            causal: self.causal,
            scale_log2: self.scale * std::f64::consts::LOG2_E,
            elem: self.elem(),
            mask: self.mask.clone(),
            tail,
            heads: [
                self.head(Part::Q),
                self.head(Part::K),
                self.head(Part::V),
                self.head(Part::O),
            ],
            strides: [
                self.stride(Part::Q),
                self.stride(Part::K),
                self.stride(Part::V),
                self.stride(Part::O),
            ],
        }
    }

    /// Whether the forward runs the Hopper kernel: the lowering targets Hopper
    /// ([`super::target`]), the shape suits it, and `RUSTYTORCH_FLASH=portable` does not ask
    /// for the portable kernel.
    fn hopper(&self) -> bool {
        super::target() == super::Target::Hopper
            && hopper::supported(self)
            && std::env::var("RUSTYTORCH_FLASH").as_deref() != Ok("portable")
    }

    /// Whether the fused backward runs the Hopper kernel ([`hopper_bwd`]): the lowering targets
    /// Hopper, the shape suits it, and `RUSTYTORCH_FLASH=portable` does not ask for the
    /// portable kernel.
    fn hopper_backward(&self) -> bool {
        super::target() == super::Target::Hopper
            && hopper_bwd::supported(self)
            && std::env::var("RUSTYTORCH_FLASH").as_deref() != Ok("portable")
    }

    /// The forward kernel over `params` (what `tail` writes) and its grid: the Hopper kernel
    /// where [`Spec::hopper`] says so, else the portable one.
    ///
    /// A kernel that reads q, k and v through tensor maps takes them as three more parameters
    /// after `params`, bound to the operands 0, 1 and 2: the returned arguments, which the
    /// caller appends to its own.
    fn forward_launch(
        &self,
        prefix: &str,
        mut params: Vec<Param>,
        tail: Tail,
    ) -> Result<(Kernel, u32, Vec<ArgRef>)> {
        if self.hopper() {
            let mut built = hopper::build(&self.shape2(tail), self);
            let grid;
            (built.source, grid) =
                hopper::launch(built.source, built.blocks, built.per_sm, built.persistent);
            let mut extra = vec![];
            if let Some(rows) = built.maps {
                for (part, name) in [(Part::Q, "qmap"), (Part::K, "kmap"), (Part::V, "vmap")] {
                    params.push(Param {
                        map: Some(self.tensor_map(part, rows[part as usize])),
                        ..param(name, self.e, false)
                    });
                    extra.push(ArgRef::Input(part as usize));
                }
            }
            if let Some(rows) = built.out_map {
                params.push(Param {
                    map: Some(self.tensor_map(Part::O, rows)),
                    ..param("omap", self.e, true)
                });
                extra.push(ArgRef::Output);
            }
            let kernel = verbatim(
                &format!("{prefix}_sm90"),
                params,
                built.threads,
                built.smem,
                built.source,
            )?;
            return Ok((kernel, grid, extra));
        }
        let kernel = verbatim(prefix, params, THREADS, 0, self.forward(tail))?;
        Ok((kernel, grid_for(self.tiles(self.sq) as u64, 1), vec![]))
    }

    /// The forward as a step of one launch over the `n_in` operands and the output.
    fn forward_step(&self, n_in: usize, prefix: &str, tail: Tail) -> Result<StepKernels> {
        let mut params = self.params.clone();
        params.push(param("out", self.e, true));
        let (kernel, grid, extra) = self.forward_launch(prefix, params, tail)?;
        let mut step = StepKernels::over_operands(kernel, n_in, grid);
        step.launches[0].args.extend(extra);
        Ok(step)
    }
}

/// Lowers `Attention` (operands q, k, v and the mask when it has one) to the flash kernel, or
/// for one query row to the split-key decoding kernels ([`decode`]). The caller checks
/// [`supported`].
pub fn lower(op: &Op, inputs: &[&TensorType], out: &TensorType) -> Result<StepKernels> {
    let Some(sp) = Spec::new(op, inputs, out)? else {
        return Ok(StepKernels::default());
    };
    if decode::supported(&sp) {
        return decode::lower(&sp, inputs.len());
    }
    sp.forward_step(inputs.len(), "flash_attention", Tail::Out)
}

/// Lowers `Attention` as [`lower`] does (never the decoding kernels), the kernel also writing
/// each query row's natural log-sum-exp of the scaled scores (f32 `[B, H, Sq]`, +∞ for a row
/// that sees no key) `stats_at` bytes past the output's start, where the memory plan keeps
/// room for them (`rustytorch_compiler::plan::stats_offset`): the statistics a gradient step
/// then reads ([`Saved`]) instead of recomputing the forward.
pub fn lower_saving(
    op: &Op,
    inputs: &[&TensorType],
    out: &TensorType,
    stats_at: usize,
) -> Result<StepKernels> {
    let Some(sp) = Spec::new(op, inputs, out)? else {
        return Ok(StepKernels::default());
    };
    sp.forward_step(inputs.len(), "flash_attention_saving", Tail::Save(stats_at))
}

/// Lowers `AttentionGrad` (operands q, k, v, [mask], dO) to two kernels: the forward in its
/// statistics form (per query row the base-2 log-sum-exp of the scaled scores and
/// `D = rowsum(dO ∘ O)`, f32 into the step's scratch), then the gradient:
///
/// - `wrt` q: per block of 64 query rows (a warp's 16 rows keep their q and dO fragments in
///   registers), over the key tiles they see: `S = Q·Kᵀ`, `P = 2^(S − lse)`, `dP = dO·Vᵀ`,
///   `dS = P∘(dP − D)`, `dQ += dS·K`;
/// - `wrt` k or v: per block of 64 keys (k and v fragments in registers), over the query tiles
///   that see them: `Sᵀ = K·Qᵀ`, `Pᵀ`, then `dV += Pᵀ·dO`, or `dPᵀ = V·dOᵀ`, `dSᵀ`,
///   `dK += dSᵀ·Q`;
///
/// `dQ` and `dK` end scaled by the attention scale. Masked pairs have `P = 0`; a fully masked
/// query row has an infinite log-sum-exp, so it contributes nothing. The packed gradient (all
/// three into one tensor) runs the fused backward after the statistics, as
/// [`lower_grad_group`] does.
pub fn lower_grad(op: &Op, inputs: &[&TensorType], out: &TensorType) -> Result<StepKernels> {
    lower_grad_saved(op, inputs, out, None)
}

/// Where a gradient step finds its forward's saved output and statistics: O is the value
/// bound at `o` (the forward's result, in the op's layout), and the f32 natural log-sum-exp of
/// each query row (`[B, H, Sq]`, as [`lower_saving`] and cuDNN's forward with statistics write
/// it) lies `stats_at` bytes past O's start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Saved {
    /// The forward's result.
    pub o: ArgRef,
    /// Byte offset of the statistics from O's start.
    pub stats_at: usize,
}

/// [`lower_grad`], reading the forward's statistics where `saved` says instead of recomputing
/// the forward: the first kernel then only computes `D = rowsum(dO ∘ O)` from the saved O.
pub fn lower_grad_saved(
    op: &Op,
    inputs: &[&TensorType],
    out: &TensorType,
    saved: Option<Saved>,
) -> Result<StepKernels> {
    let Op::AttentionGrad { wrt, .. } = op else {
        return Err(crate::CodegenError::Invalid(format!(
            "{} is not an attention gradient",
            op.name()
        )));
    };
    let Some(sp) = Spec::new(op, inputs, out)? else {
        return Ok(StepKernels::default());
    };
    if *wrt == ATTN_WRT_PACKED {
        // dq, dk and dv into one [B, S, 3, H, D] result, each where its operand lies.
        let all: Vec<(u8, ArgRef)> = (0..3).map(|w| (w, ArgRef::Output)).collect();
        return grad_kernels(&sp, inputs.len(), &all, saved);
    }
    grad_kernels(&sp, inputs.len(), &[(*wrt, ArgRef::Output)], saved)
}

/// Lowers a group of `AttentionGrad` siblings (the same attention's gradients, `ops[i]` with
/// result type `outs[i]`, in increasing `wrt`) to one step: the statistics kernel once, then,
/// when `dQ` is asked for with `dK` and/or `dV`, the fused backward ([`backward`]: all of them
/// in one kernel per key tile, `dQ` through an f32 buffer); else `dK` and `dV` together in one
/// kernel per key tile (for head sizes up to [`KV_BOTH_HEAD`], else one kernel each). Result
/// `i` binds to [`ArgRef::Output`] for the first member and [`ArgRef::With`]`(i - 1)` for the
/// others. The caller checks [`supported`].
pub fn lower_grad_group(
    ops: &[&Op],
    inputs: &[&TensorType],
    outs: &[&TensorType],
) -> Result<StepKernels> {
    lower_grad_group_saved(ops, inputs, outs, None)
}

/// [`lower_grad_group`], reading the forward's statistics where `saved` says (see
/// [`lower_grad_saved`]).
pub fn lower_grad_group_saved(
    ops: &[&Op],
    inputs: &[&TensorType],
    outs: &[&TensorType],
    saved: Option<Saved>,
) -> Result<StepKernels> {
    let mut wanted = vec![];
    for (i, (op, out)) in ops.iter().zip(outs).enumerate() {
        let Op::AttentionGrad { wrt, .. } = op else {
            return Err(crate::CodegenError::Invalid(format!(
                "{} is not an attention gradient",
                op.name()
            )));
        };
        // Each member's type is checked against its own op.
        super::attention::check_result(op, inputs, out)?;
        let at = if i == 0 {
            ArgRef::Output
        } else {
            ArgRef::With(i - 1)
        };
        wanted.push((*wrt, at));
    }
    let Some(sp) = Spec::new(ops[0], inputs, outs[0])? else {
        return Ok(StepKernels::default());
    };
    grad_kernels(&sp, inputs.len(), &wanted, saved)
}

/// Head sizes up to which one kernel computes `dK` and `dV` together (their fragments and
/// accumulators must fit a thread's registers).
pub const KV_BOTH_HEAD: usize = 64;

/// The statistics kernel (or, with `saved`, the kernel deriving them from the saved forward),
/// then the gradient kernels of `wanted` (`wrt` and where its result goes).
fn grad_kernels(
    sp: &Spec,
    n_in: usize,
    wanted: &[(u8, ArgRef)],
    saved: Option<Saved>,
) -> Result<StepKernels> {
    let rows = sp.bsz * sp.heads * sp.sq;
    let delta_at = delta_offset(sp);
    let mut base = sp.params.clone();
    base.push(param("dout", sp.e, false));
    let stats_params: Vec<Param> = base
        .iter()
        .cloned()
        .chain([param("lse", CTy::F32, true), param("delta", CTy::F32, true)])
        .collect();
    let grad_params: Vec<Param> = base
        .into_iter()
        .chain([
            param("lse", CTy::F32, false),
            param("delta", CTy::F32, false),
        ])
        .collect();
    let ins = || (0..n_in).map(ArgRef::Input);
    let scratch = [ArgRef::ScratchAt(0), ArgRef::ScratchAt(delta_at)];
    let at = |w: u8| wanted.iter().find(|(x, _)| *x == w).map(|(_, a)| *a);
    if let Some(w) = wanted.iter().map(|(w, _)| *w).find(|&w| w > 2) {
        return Err(crate::CodegenError::Invalid(format!(
            "attention gradient with respect to operand {w}"
        )));
    }
    let fused = at(0).is_some() && (at(1).is_some() || at(2).is_some());
    let mut launches = match saved {
        None => {
            let (stats, stats_grid, extra) =
                sp.forward_launch("flash_attention_stats", stats_params, Tail::Stats)?;
            vec![Launch {
                kernel: stats,
                args: ins().chain(scratch).chain(extra).collect(),
                grid: stats_grid,
            }]
        }
        // The fused backward builds it, zeroing its dQ buffer too.
        Some(_) if fused => vec![],
        Some(saved) => vec![delta_launch(sp, n_in, saved, None)?],
    };
    if let (Some(q), true) = (at(0), fused) {
        let base: Vec<ArgRef> = ins().chain(scratch).collect();
        let used = delta_at + rows * 4;
        let saved = saved.map(|s| (s, n_in));
        return fused_grads(
            sp,
            &grad_params,
            &base,
            used,
            launches,
            saved,
            q,
            [at(1), at(2)],
        );
    }
    // (body, its outputs' names and places, tiles)
    let mut grads: Vec<(String, Vec<(&str, ArgRef)>, usize)> = vec![];
    if let Some(q) = at(0) {
        grads.push((grad_q(sp), vec![("out", q)], sp.tiles(sp.sq)));
    }
    match (at(1), at(2)) {
        (Some(k), Some(v)) if sp.d <= KV_BOTH_HEAD && sp.dv <= KV_BOTH_HEAD => grads.push((
            grad_kv(sp, Kv::Both),
            vec![("out_k", k), ("out_v", v)],
            sp.tiles(sp.sk),
        )),
        (k, v) => {
            for (which, a) in [(Kv::K, k), (Kv::V, v)] {
                if let Some(a) = a {
                    grads.push((grad_kv(sp, which), vec![("out", a)], sp.tiles(sp.sk)));
                }
            }
        }
    }
    for (body, outs, tiles) in grads {
        let mut params = grad_params.clone();
        params.extend(outs.iter().map(|(name, _)| param(name, sp.e, true)));
        let kernel = verbatim("flash_attention_grad", params, THREADS, 0, body)?;
        launches.push(Launch {
            kernel,
            args: ins()
                .chain(scratch)
                .chain(outs.iter().map(|(_, a)| *a))
                .collect(),
            grid: grid_for(tiles as u64, 1),
        });
    }
    Ok(StepKernels {
        launches,
        scratch_bytes: delta_at + rows * 4,
    })
}

/// Where the statistics scratch puts `delta` (after `lse`, one f32 a query row).
fn delta_offset(sp: &Spec) -> usize {
    (sp.bsz * sp.heads * sp.sq * 4).next_multiple_of(256)
}

/// The kernel deriving `lse` and `D` from the saved forward ([`backward::delta_source`]) into
/// the scratch's first bytes; with `zero = Some((at, n))` it also zeroes the `n` floats of the
/// `dQ` buffer at scratch offset `at`.
fn delta_launch(
    sp: &Spec,
    n_in: usize,
    saved: Saved,
    zero: Option<(usize, usize)>,
) -> Result<Launch> {
    let threads = backward::BUFFER_THREADS;
    let rows = sp.bsz * sp.heads * sp.sq;
    let mut params = vec![
        param("dout", sp.e, false),
        param("o", sp.e, false),
        param("lse", CTy::F32, true),
        param("delta", CTy::F32, true),
    ];
    let mut args = vec![
        ArgRef::Input(n_in - 1),
        saved.o,
        ArgRef::ScratchAt(0),
        ArgRef::ScratchAt(delta_offset(sp)),
    ];
    if let Some((at, _)) = zero {
        params.push(param("dq_acc", CTy::F32, true));
        args.push(ArgRef::ScratchAt(at));
    }
    // A thread a row's 16-byte piece; a thread two floats of the buffer.
    let work = (rows * backward::delta_lanes(sp.dv)).max(zero.map_or(0, |(_, n)| n / 2));
    let source = backward::delta_source(sp, saved.stats_at, zero.map(|(_, n)| n));
    Ok(Launch {
        kernel: verbatim("flash_attention_delta", params, threads, 0, source)?,
        args,
        grid: grid_for(work as u64, threads as u64),
    })
}

/// After the statistics kernel (`launches`): the fused backward ([`backward`]) for `dQ` (into
/// `q`) with `dK` and/or `dV` (into `kv`), between a kernel zeroing its f32 `dQ` buffer and one
/// rounding it into the result. The gradient kernels' parameters `grad_params` bind to `base`
/// (the operands, the statistics in the first `used` bytes of scratch); the buffer follows.
/// Where the statistics come from a saved forward (`saved`, with the operand count),
/// `launches` is empty and their kernel, built here, also zeroes the buffer.
#[allow(clippy::too_many_arguments)]
fn fused_grads(
    sp: &Spec,
    grad_params: &[Param],
    base: &[ArgRef],
    used: usize,
    mut launches: Vec<Launch>,
    saved: Option<(Saved, usize)>,
    q: ArgRef,
    [k, v]: [Option<ArgRef>; 2],
) -> Result<StepKernels> {
    let key_tiles = |keys: usize| sp.bsz * sp.heads * sp.sk.div_ceil(keys);
    let (built, prefix, grid) = if sp.hopper_backward() {
        let mut built = hopper_bwd::build(
            sp,
            k.is_some(),
            v.is_some(),
            hopper_bwd::Variant::from_env(),
        );
        let grid;
        (built.source, grid) = hopper::launch(built.source, key_tiles(built.keys), 1, true);
        (built, "flash_attention_bwd_sm90", grid)
    } else {
        let built = backward::build(sp, k.is_some(), v.is_some());
        let grid = grid_for(key_tiles(built.keys) as u64, 1);
        (built, "flash_attention_bwd", grid)
    };
    let acc_at = used.next_multiple_of(256);
    // A blocked buffer holds whole query tiles.
    let rows = match &built.dq_blocked {
        Some((br, _)) => sp.sq.next_multiple_of(*br),
        None => sp.sq,
    };
    let acc_len = sp.bsz * sp.heads * rows * sp.d;
    let buffer = |name: &str, writes: bool| param(name, CTy::F32, writes);
    let small = |prefix: &str, params: Vec<Param>, body: String| {
        verbatim(prefix, params, backward::BUFFER_THREADS, 0, body)
    };
    let buffer_grid = grid_for(acc_len as u64 / 2, backward::BUFFER_THREADS as u64);
    match saved {
        Some((saved, n_in)) => {
            launches.push(delta_launch(sp, n_in, saved, Some((acc_at, acc_len)))?);
        }
        None => launches.push(Launch {
            kernel: small(
                "flash_attention_bwd_zero",
                vec![buffer("dq_acc", true)],
                backward::zero_source(acc_len),
            )?,
            args: vec![ArgRef::ScratchAt(acc_at)],
            grid: buffer_grid,
        }),
    }
    let mut params = grad_params.to_vec();
    params.push(buffer("dq_acc", true));
    let mut args: Vec<ArgRef> = base
        .iter()
        .copied()
        .chain([ArgRef::ScratchAt(acc_at)])
        .collect();
    for (name, at) in [("out_k", k), ("out_v", v)] {
        if let Some(at) = at {
            params.push(param(name, sp.e, true));
            args.push(at);
        }
    }
    if let Some([q_rows, k_rows]) = built.maps {
        // The tensor maps after the other parameters, over q, k, v and dO (the last operand).
        let dout = *base
            .iter()
            .rev()
            .find(|a| matches!(a, ArgRef::Input(_)))
            .expect("dO is an operand");
        for (part, name, rows, at) in [
            (Part::Q, "qmap", q_rows, ArgRef::Input(0)),
            (Part::K, "kmap", k_rows, ArgRef::Input(1)),
            (Part::V, "vmap", k_rows, ArgRef::Input(2)),
            (Part::O, "gmap", q_rows, dout),
        ] {
            params.push(Param {
                map: Some(sp.tensor_map(part, rows)),
                ..param(name, sp.e, false)
            });
            args.push(at);
        }
        // Then the maps the kernel writes dK and dV through, over its outputs.
        if built.out_maps {
            for (part, name, at) in [(Part::K, "okmap", k), (Part::V, "ovmap", v)] {
                if let Some(at) = at {
                    params.push(Param {
                        map: Some(sp.tensor_map(part, k_rows)),
                        ..param(name, sp.e, true)
                    });
                    args.push(at);
                }
            }
        }
    }
    launches.push(Launch {
        kernel: verbatim(prefix, params, built.threads, built.smem, built.source)?,
        args,
        grid,
    });
    launches.push(Launch {
        kernel: small(
            "flash_attention_bwd_dq",
            vec![buffer("dq_acc", false), param("out", sp.e, true)],
            backward::dq_source(sp, built.dq_blocked.clone()),
        )?,
        args: vec![ArgRef::ScratchAt(acc_at), q],
        grid: buffer_grid,
    });
    Ok(StepKernels {
        launches,
        scratch_bytes: acc_at + acc_len * 4,
    })
}

/// A kernel named after `prefix` whose body is the CUDA C `source` (see [`finish`]).
fn verbatim(
    prefix: &str,
    params: Vec<Param>,
    block: u32,
    smem: u32,
    source: String,
) -> Result<Kernel> {
    finish(
        prefix,
        Kernel {
            name: String::new(),
            params,
            block,
            smem,
            body: vec![Stmt::Verbatim(source)],
        },
    )
}

fn param(name: &str, elem: CTy, writes: bool) -> Param {
    Param {
        name: name.into(),
        elem,
        writes,
        map: None,
    }
}

/// What the forward kernel writes at its end.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Tail {
    /// The output.
    Out,
    /// The backward's statistics instead of the output: each query row's base-2 log-sum-exp
    /// of the scaled scores (`lse`) and `D = rowsum(dO ∘ O)` (`delta`).
    Stats,
    /// The output and, `.0` bytes past its start, each query row's natural log-sum-exp of the
    /// scaled scores (f32 `[B, H, Sq]`, +∞ for a row that sees no key): the statistics a
    /// gradient step reads ([`lower_saving`]), in the form cuDNN's forward writes them.
    Save(usize),
}

/// What the forward source is specialized on.
struct Shape2 {
    sq: usize,
    sk: usize,
    d: usize,
    dv: usize,
    tiles: usize,
    causal: Causal,
    scale_log2: f64,
    /// `f16` or `bf16` (the PTX type name).
    elem: &'static str,
    /// The statement that applies the mask to score `x` of row `row`, key `key`.
    mask: Option<String>,
    /// What the kernel writes at its end.
    tail: Tail,
    /// The offsets of head `bh` in q, k, v and the output (or dO), as C expressions.
    heads: [String; 4],
    /// Elements between a head's consecutive rows in q, k, v and the output (or dO).
    strides: [usize; 4],
}

/// `pack` (two f32 into the operands' type `$E`, the first in the low half), the helper every
/// flash kernel that rounds its results defines.
const PACK: &str = r#"auto pack = [](float lo, float hi) -> unsigned {
  unsigned r; asm("cvt.rn.$Ex2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo)); return r;
};
"#;

/// The helpers the flash kernels define after their thread indices: `lim_of` (the end of the
/// keys row `i` sees, `$LIM`), [`PACK`] and `ex2` (the hardware 2^x). The caller substitutes
/// `$LIM` and `$E`.
fn helpers() -> String {
    [
        "auto lim_of = [](long long i) -> int { return (int)($LIM); };\n",
        PACK,
        "auto ex2 = [](float x) -> float { float y; asm(\"ex2.approx.ftz.f32 %0, %1;\" : \"=f\"(y) : \"f\"(x)); return y; };\n",
    ]
    .concat()
}

/// The end of the keys row `i` sees, as C over `long long i`.
fn limit(causal: Causal, sq: usize, sk: usize) -> String {
    match causal {
        Causal::None => format!("{sk}LL"),
        Causal::TopLeft => format!("min(i + 1LL, {sk}LL)"),
        Causal::BottomRight => {
            let off = 1 + sk as i64 - sq as i64;
            format!("max(min(i + ({off}LL), {sk}LL), 0LL)")
        }
    }
}

/// The forward's end: the normalized output rows, or the backward's statistics.
fn tail(s: &Shape2) -> String {
    tail_with(s, None)
}

/// [`tail`], with `store` (where given) writing the normalized output rows instead of each
/// thread's stores.
fn tail_with(s: &Shape2, store: Option<String>) -> String {
    let (sq, dv, elem) = (s.sq, s.dv, s.elem);
    let (head, rs) = (&s.heads[3], s.strides[3]);
    let widen = if elem == "bf16" { "rt_bf2f" } else { "rt_h2f" };
    let out = store.unwrap_or_else(|| format!(
        r#"  unsigned short* op = (unsigned short*)out + {head};
  #pragma unroll
  for (int n = 0; n < {dv8}; ++n) {{
    const int c = n * 8 + t4 * 2;
    if (i0 < {sq}) *(unsigned*)(op + (long long)i0 * {rs} + c) = pack(o[n][0] * inv0, o[n][1] * inv0);
    if (i1 < {sq}) *(unsigned*)(op + (long long)i1 * {rs} + c) = pack(o[n][2] * inv1, o[n][3] * inv1);
  }}"#,
        dv8 = dv / 8
    ));
    match s.tail {
        Tail::Out => return out,
        Tail::Save(at) => {
            return out
                + &format!(
                    r#"
  // The natural log-sum-exp of the scaled scores (m is in the base-2 domain), +∞ for a row
  // that sees nothing, at the statistics' place past the output.
  if (t4 == 0) {{
    float* st = (float*)((unsigned char*)out + {at}LL) + bh * {sq}LL;
    if (i0 < {sq}) st[i0] = l0 == 0.f ? __int_as_float(0x7f800000) : (m0 + __log2f(l0)) * 0.6931471805599453f;
    if (i1 < {sq}) st[i1] = l1 == 0.f ? __int_as_float(0x7f800000) : (m1 + __log2f(l1)) * 0.6931471805599453f;
  }}"#
                )
        }
        Tail::Stats => {}
    }
    format!(
        r#"  // D = rowsum(dO ∘ O) and the base-2 log-sum-exp (+∞ for a row that sees nothing).
  const unsigned short* dp = (const unsigned short*)dout + {head};
  float dd0 = 0.f, dd1 = 0.f;
  #pragma unroll
  for (int n = 0; n < {dv8}; ++n) {{
    const int c = n * 8 + t4 * 2;
    if (i0 < {sq}) {{
      const unsigned u = *(const unsigned*)(dp + (long long)i0 * {rs} + c);
      dd0 += {widen}((unsigned short)(u & 0xffffu)) * o[n][0] + {widen}((unsigned short)(u >> 16)) * o[n][1];
    }}
    if (i1 < {sq}) {{
      const unsigned u = *(const unsigned*)(dp + (long long)i1 * {rs} + c);
      dd1 += {widen}((unsigned short)(u & 0xffffu)) * o[n][2] + {widen}((unsigned short)(u >> 16)) * o[n][3];
    }}
  }}
  dd0 += __shfl_xor_sync(0xffffffffu, dd0, 1);
  dd0 += __shfl_xor_sync(0xffffffffu, dd0, 2);
  dd1 += __shfl_xor_sync(0xffffffffu, dd1, 1);
  dd1 += __shfl_xor_sync(0xffffffffu, dd1, 2);
  if (t4 == 0) {{
    if (i0 < {sq}) {{
      lse[bh * {sq}LL + i0] = l0 == 0.f ? __int_as_float(0x7f800000) : m0 + __log2f(l0);
      delta[bh * {sq}LL + i0] = dd0 * inv0;
    }}
    if (i1 < {sq}) {{
      lse[bh * {sq}LL + i1] = l1 == 0.f ? __int_as_float(0x7f800000) : m1 + __log2f(l1);
      delta[bh * {sq}LL + i1] = dd1 * inv1;
    }}
  }}"#,
        dv8 = dv / 8
    )
}

/// The running maxima `mx0`, `mx1` of a warp's two rows over the score fragments `s[n8][4]`
/// and the four lanes that share each row (C statements, each line indented by `indent`).
fn row_maxima(n8: &str, indent: &str) -> String {
    [
        "float mx0 = RT_NEG_INF, mx1 = RT_NEG_INF;".to_string(),
        "#pragma unroll".into(),
        format!("for (int n = 0; n < {n8}; ++n) {{"),
        "  mx0 = fmaxf(mx0, fmaxf(s[n][0], s[n][1]));".into(),
        "  mx1 = fmaxf(mx1, fmaxf(s[n][2], s[n][3]));".into(),
        "}".into(),
        "mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));".into(),
        "mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));".into(),
        "mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));".into(),
        "mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));".into(),
    ]
    .iter()
    .map(|l| format!("{indent}{l}\n"))
    .collect()
}

/// The kernel body (see the module docs).
fn source(s: &Shape2) -> String {
    let Shape2 {
        sq,
        sk,
        d,
        dv,
        tiles,
        causal,
        scale_log2,
        elem,
        ref mask,
        ref heads,
        strides: [q_rs, k_rs, v_rs, _],
        ..
    } = *s;
    let qt = sq.div_ceil(BR);
    let (ks, vs) = (d + 8, dv + 8);
    let lim = limit(causal, sq, sk);
    let helpers = helpers().replace("$LIM", &lim).replace("$E", elem);
    let has_mask = mask.is_some();
    let mask_stmt = mask.clone().unwrap_or_default();
    format!(
        r#"// Flash attention forward: {BR} query rows a block, key tiles of {BC}, mma.sync m16n8k16 ({elem}).
#define RT_NEG_INF __int_as_float(0xff800000)
#define RT_LOG2E 1.4426950408889634f
__shared__ __align__(16) unsigned short ks[{BC} * {ks}];
__shared__ __align__(16) unsigned short vs[{BC} * {vs}];
const unsigned ks_base = (unsigned)__cvta_generic_to_shared(ks);
const unsigned vs_base = (unsigned)__cvta_generic_to_shared(vs);
const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
const int g = lane >> 2, t4 = lane & 3;
{helpers}for (long long tile = blockIdx.x; tile < {tiles}LL; tile += gridDim.x) {{
  const long long bh = tile / {qt}LL;
  const int qt = (int)({qt}LL - 1LL - tile % {qt}LL);
  const int i0 = qt * {BR} + warp * 16 + g, i1 = i0 + 8;
  const unsigned short* qp = (const unsigned short*)q + {qh};
  const unsigned short* kp = (const unsigned short*)k + {kh};
  const unsigned short* vp = (const unsigned short*)v + {vh};
  // This warp's 16 query rows as A fragments, for the whole walk.
  unsigned qa[{dq16}][4];
  #pragma unroll
  for (int kk = 0; kk < {dq16}; ++kk) {{
    const int c = kk * 16 + t4 * 2;
    qa[kk][0] = i0 < {sq} ? *(const unsigned*)(qp + (long long)i0 * {q_rs} + c) : 0u;
    qa[kk][1] = i1 < {sq} ? *(const unsigned*)(qp + (long long)i1 * {q_rs} + c) : 0u;
    qa[kk][2] = i0 < {sq} ? *(const unsigned*)(qp + (long long)i0 * {q_rs} + c + 8) : 0u;
    qa[kk][3] = i1 < {sq} ? *(const unsigned*)(qp + (long long)i1 * {q_rs} + c + 8) : 0u;
  }}
  const int lim0 = lim_of(i0), lim1 = lim_of(i1);
  const int lim_first = lim_of(qt * {BR});
  const int kend = lim_of(min(qt * {BR} + {BR} - 1, {sq} - 1));
  const int ntiles = (kend + {BC} - 1) / {BC};
  float o[{dv8}][4];
  #pragma unroll
  for (int n = 0; n < {dv8}; ++n) {{ o[n][0] = 0.f; o[n][1] = 0.f; o[n][2] = 0.f; o[n][3] = 0.f; }}
  float m0 = RT_NEG_INF, m1 = RT_NEG_INF, l0 = 0.f, l1 = 0.f;
  // Tile `j` of keys (or values) into shared memory, rows past the end zero-filled.
  auto load_tile = [&](const unsigned short* src, unsigned base, int j, int width, int stride, int gstride) {{
    const int chunks = width / 8;
    for (int c = tid; c < {BC} * chunks; c += {THREADS}) {{
      const int r = c / chunks, c8 = c - r * chunks;
      const int key = j * {BC} + r;
      const unsigned short* from = src + (long long)(key < {sk} ? key : 0) * gstride + c8 * 8;
      const unsigned to = base + (unsigned)((r * stride + c8 * 8) * 2);
      const int bytes = key < {sk} ? 16 : 0;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(to), "l"(from), "r"(bytes));
    }}
    asm volatile("cp.async.commit_group;");
  }};
  if (ntiles > 0) load_tile(kp, ks_base, 0, {d}, {ks}, {k_rs});
  for (int j = 0; j < ntiles; ++j) {{
    asm volatile("cp.async.wait_group 0;");
    __syncthreads();
    load_tile(vp, vs_base, j, {dv}, {vs}, {v_rs});
    // S = Q·Kᵀ for this warp's rows and the tile's 64 keys.
    float s[8][4];
    #pragma unroll
    for (int n = 0; n < 8; ++n) {{ s[n][0] = 0.f; s[n][1] = 0.f; s[n][2] = 0.f; s[n][3] = 0.f; }}
    #pragma unroll
    for (int kk = 0; kk < {dq16}; ++kk) {{
      #pragma unroll
      for (int np = 0; np < 4; ++np) {{
        const int row = np * 16 + (lane & 7) + (lane >> 4) * 8;
        const int col = kk * 16 + ((lane >> 3) & 1) * 8;
        unsigned b0, b1, b2, b3;
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {{%0,%1,%2,%3}}, [%4];"
                     : "=r"(b0), "=r"(b1), "=r"(b2), "=r"(b3) : "r"(ks_base + (unsigned)((row * {ks} + col) * 2)));
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.{elem}.{elem}.f32 {{%0,%1,%2,%3}}, {{%4,%5,%6,%7}}, {{%8,%9}}, {{%0,%1,%2,%3}};"
                     : "+f"(s[2 * np][0]), "+f"(s[2 * np][1]), "+f"(s[2 * np][2]), "+f"(s[2 * np][3])
                     : "r"(qa[kk][0]), "r"(qa[kk][1]), "r"(qa[kk][2]), "r"(qa[kk][3]), "r"(b0), "r"(b1));
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.{elem}.{elem}.f32 {{%0,%1,%2,%3}}, {{%4,%5,%6,%7}}, {{%8,%9}}, {{%0,%1,%2,%3}};"
                     : "+f"(s[2 * np + 1][0]), "+f"(s[2 * np + 1][1]), "+f"(s[2 * np + 1][2]), "+f"(s[2 * np + 1][3])
                     : "r"(qa[kk][0]), "r"(qa[kk][1]), "r"(qa[kk][2]), "r"(qa[kk][3]), "r"(b2), "r"(b3));
      }}
    }}
    __syncthreads();
    if (j + 1 < ntiles) load_tile(kp, ks_base, j + 1, {d}, {ks}, {k_rs});
    else asm volatile("cp.async.commit_group;");
    // Scale into base 2; limits and the mask only where the tile crosses them.
    const int kb = j * {BC};
    const bool edge = {has_mask} || kb + {BC} > lim_first;
    #pragma unroll
    for (int n = 0; n < 8; ++n) {{
      #pragma unroll
      for (int e = 0; e < 4; ++e) {{
        float x = s[n][e] * {scale_log2:?}f;
        if (edge) {{
          const int key = kb + n * 8 + t4 * 2 + (e & 1);
          const int row = e < 2 ? i0 : i1;
          if (key >= (e < 2 ? lim0 : lim1) || row >= {sq}) {{
            x = RT_NEG_INF;
          }} else {{
            {mask_stmt}
          }}
        }}
        s[n][e] = x;
      }}
    }}
    // Online softmax: the rows' maxima over the four lanes that share them.
{row_maxima}    const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
    // A row with nothing visible yet keeps a finite reference so that 2^(−∞ − ref) is 0.
    const float r0 = mn0 == RT_NEG_INF ? 0.f : mn0, r1 = mn1 == RT_NEG_INF ? 0.f : mn1;
    const float a0 = ex2(m0 - r0), a1 = ex2(m1 - r1);
    m0 = mn0; m1 = mn1;
    l0 *= a0; l1 *= a1;
    #pragma unroll
    for (int n = 0; n < {dv8}; ++n) {{ o[n][0] *= a0; o[n][1] *= a0; o[n][2] *= a1; o[n][3] *= a1; }}
    #pragma unroll
    for (int n = 0; n < 8; ++n) {{
      s[n][0] = ex2(s[n][0] - r0); s[n][1] = ex2(s[n][1] - r0);
      s[n][2] = ex2(s[n][2] - r1); s[n][3] = ex2(s[n][3] - r1);
      l0 += s[n][0] + s[n][1]; l1 += s[n][2] + s[n][3];
    }}
    asm volatile("cp.async.wait_group 1;");
    __syncthreads();
    // O += P·V: the score accumulators of key halves 2kk and 2kk+1 are P's A fragment.
    #pragma unroll
    for (int kk = 0; kk < 4; ++kk) {{
      const unsigned pa0 = pack(s[2 * kk][0], s[2 * kk][1]);
      const unsigned pa1 = pack(s[2 * kk][2], s[2 * kk][3]);
      const unsigned pa2 = pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      const unsigned pa3 = pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
      #pragma unroll
      for (int dp = 0; dp < {dv16}; ++dp) {{
        const int row = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
        const int col = dp * 16 + (lane >> 4) * 8;
        unsigned b0, b1, b2, b3;
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {{%0,%1,%2,%3}}, [%4];"
                     : "=r"(b0), "=r"(b1), "=r"(b2), "=r"(b3) : "r"(vs_base + (unsigned)((row * {vs} + col) * 2)));
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.{elem}.{elem}.f32 {{%0,%1,%2,%3}}, {{%4,%5,%6,%7}}, {{%8,%9}}, {{%0,%1,%2,%3}};"
                     : "+f"(o[2 * dp][0]), "+f"(o[2 * dp][1]), "+f"(o[2 * dp][2]), "+f"(o[2 * dp][3])
                     : "r"(pa0), "r"(pa1), "r"(pa2), "r"(pa3), "r"(b0), "r"(b1));
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.{elem}.{elem}.f32 {{%0,%1,%2,%3}}, {{%4,%5,%6,%7}}, {{%8,%9}}, {{%0,%1,%2,%3}};"
                     : "+f"(o[2 * dp + 1][0]), "+f"(o[2 * dp + 1][1]), "+f"(o[2 * dp + 1][2]), "+f"(o[2 * dp + 1][3])
                     : "r"(pa0), "r"(pa1), "r"(pa2), "r"(pa3), "r"(b2), "r"(b3));
      }}
    }}
  }}
  // Each row's sum over its four lanes; a row that saw nothing is zero, a NaN row stays NaN.
  l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
  l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
  const float inv0 = l0 == 0.f ? 0.f : 1.f / l0, inv1 = l1 == 0.f ? 0.f : 1.f / l1;
{tail}
  __syncthreads();
}}"#,
        tail = tail(s),
        row_maxima = row_maxima("8", "    "),
        qh = heads[0],
        kh = heads[1],
        vh = heads[2],
        dq16 = d / 16,
        dv8 = dv / 8,
        dv16 = dv / 16,
        scale_log2 = scale_log2 as f32,
    )
}

/// Definitions the gradient kernels share: constants, conversions, the `mma`/`ldmatrix`
/// macros, the causal limit and a tile loader.
fn grad_prelude(sp: &Spec) -> String {
    grad_defs(sp)
        + r#"// Rows [j·64, j·64 + 64) of an [n, width] matrix (rows gstride apart) into shared memory,
// rows past n zero.
auto load_tile = [&](const unsigned short* src, unsigned base, int j, int width, int stride, int n, int gstride) {
  const int chunks = width / 8;
  for (int c = tid; c < 64 * chunks; c += 128) {
    const int r = c / chunks, c8 = c - r * chunks;
    const int row = j * 64 + r;
    const unsigned short* from = src + (long long)(row < n ? row : 0) * gstride + c8 * 8;
    const unsigned to = base + (unsigned)((r * stride + c8 * 8) * 2);
    const int bytes = row < n ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(to), "l"(from), "r"(bytes));
  }
  asm volatile("cp.async.commit_group;");
};
// A fragments of rows r0 and r0 + 8 of an [n, width] matrix, rows rs apart (zero past n).
auto frag = [](const unsigned short* p, int r0, int n, int rs, int c) -> unsigned {
  return r0 < n ? *(const unsigned*)(p + (long long)r0 * rs + c) : 0u;
};
"#
}

/// The constants, `mma`/`ldmatrix` macros, thread coordinates, causal limit and conversions
/// every gradient kernel starts with.
fn grad_defs(sp: &Spec) -> String {
    let elem = sp.elem();
    r#"#define RT_NEG_INF __int_as_float(0xff800000)
#define RT_POS_INF __int_as_float(0x7f800000)
#define RT_LOG2E 1.4426950408889634f
#define RT_MMA(c, a, b0, b1) asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.$E.$E.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};" : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))
#define RT_LDSM(b0, b1, b2, b3, addr) asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];" : "=r"(b0), "=r"(b1), "=r"(b2), "=r"(b3) : "r"(addr))
#define RT_LDSM_T(b0, b1, b2, b3, addr) asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];" : "=r"(b0), "=r"(b1), "=r"(b2), "=r"(b3) : "r"(addr))
const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
const int g = lane >> 2, t4 = lane & 3;
$HELPERS"#
    .replace("$HELPERS", &helpers())
    .replace("$E", elem)
    .replace("$LIM", &limit(sp.causal, sp.sq, sp.sk))
}

/// Loads A fragments `name[width/16][4]` of rows `r0`/`r0 + 8` of `ptr` (n rows, `rs` apart).
fn a_frags(name: &str, ptr: &str, r0: &str, n: usize, width: usize, rs: usize) -> String {
    format!(
        r#"  unsigned {name}[{w16}][4];
  #pragma unroll
  for (int kk = 0; kk < {w16}; ++kk) {{
    const int c = kk * 16 + t4 * 2;
    {name}[kk][0] = frag({ptr}, {r0}, {n}, {rs}, c);
    {name}[kk][1] = frag({ptr}, {r0} + 8, {n}, {rs}, c);
    {name}[kk][2] = frag({ptr}, {r0}, {n}, {rs}, c + 8);
    {name}[kk][3] = frag({ptr}, {r0} + 8, {n}, {rs}, c + 8);
  }}
"#,
        w16 = width / 16
    )
}

/// `acc[8][4] += A·Bᵀ` over `k16` steps: A fragments `a[k16][4]`, B's 64 rows (the n dimension)
/// in shared memory at `base` with row stride `stride` (non-transposed `ldmatrix`).
fn mma_abt(acc: &str, a: &str, base: &str, stride: usize, k16: usize) -> String {
    abt(acc, "", &format!("{a}[kk]"), base, stride, k16)
}

/// `acc[8][4] += A·Bᵀ` as [`mma_abt`], the A fragment of step `kk` named `a` after the
/// statement `load_a` (empty when `a` is already in registers).
fn abt(acc: &str, load_a: &str, a: &str, base: &str, stride: usize, k16: usize) -> String {
    format!(
        r#"  #pragma unroll
  for (int kk = 0; kk < {k16}; ++kk) {{
{load_a}    #pragma unroll
    for (int np = 0; np < 4; ++np) {{
      const int row = np * 16 + (lane & 7) + (lane >> 4) * 8;
      const int col = kk * 16 + ((lane >> 3) & 1) * 8;
      unsigned b0, b1, b2, b3;
      RT_LDSM(b0, b1, b2, b3, {base} + (unsigned)((row * {stride} + col) * 2));
      RT_MMA({acc}[2 * np], {a}, b0, b1);
      RT_MMA({acc}[2 * np + 1], {a}, b2, b3);
    }}
  }}
"#
    )
}

/// `acc[width/8][4] += P·B` for `P` the 16 × 64 f32 tile `p[8][4]` (rounded into A fragments)
/// and B the 64 × width tile in shared memory at `base` (transposed `ldmatrix`).
fn mma_pb(acc: &str, p: &str, base: &str, stride: usize, width: usize) -> String {
    format!(
        r#"  #pragma unroll
  for (int kk = 0; kk < 4; ++kk) {{
    const unsigned pa[4] = {{pack({p}[2 * kk][0], {p}[2 * kk][1]), pack({p}[2 * kk][2], {p}[2 * kk][3]),
                             pack({p}[2 * kk + 1][0], {p}[2 * kk + 1][1]), pack({p}[2 * kk + 1][2], {p}[2 * kk + 1][3])}};
    #pragma unroll
    for (int dp = 0; dp < {w16}; ++dp) {{
      const int row = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
      const int col = dp * 16 + (lane >> 4) * 8;
      unsigned b0, b1, b2, b3;
      RT_LDSM_T(b0, b1, b2, b3, {base} + (unsigned)((row * {stride} + col) * 2));
      RT_MMA({acc}[2 * dp], pa, b0, b1);
      RT_MMA({acc}[2 * dp + 1], pa, b2, b3);
    }}
  }}
"#,
        w16 = width / 16
    )
}

/// Declares `name[n][4]` zeroed.
fn zeros(name: &str, n: usize) -> String {
    format!(
        "  float {name}[{n}][4];\n  #pragma unroll\n  for (int n = 0; n < {n}; ++n) {{ {name}[n][0] = 0.f; {name}[n][1] = 0.f; {name}[n][2] = 0.f; {name}[n][3] = 0.f; }}\n"
    )
}

/// Stores `acc[width/8][4]` (times `scale`) as rows `r0`/`r0 + 8` of `ptr` (n rows, `rs` apart).
fn store_rows(
    acc: &str,
    ptr: &str,
    r0: &str,
    n: usize,
    width: usize,
    rs: usize,
    scale: f32,
) -> String {
    format!(
        r#"  #pragma unroll
  for (int n = 0; n < {w8}; ++n) {{
    const int c = n * 8 + t4 * 2;
    if ({r0} < {n}) *(unsigned*)({ptr} + (long long)({r0}) * {rs} + c) = pack({acc}[n][0] * {scale:?}f, {acc}[n][1] * {scale:?}f);
    if ({r0} + 8 < {n}) *(unsigned*)({ptr} + (long long)({r0} + 8) * {rs} + c) = pack({acc}[n][2] * {scale:?}f, {acc}[n][3] * {scale:?}f);
  }}
"#,
        w8 = width / 8
    )
}

/// The gradient kernels' pointers to head `bh` of q, k, v and dO (`qp`, `kp`, `vp`, `gp`).
fn head_pointers(sp: &Spec) -> String {
    format!(
        r#"  const unsigned short* qp = (const unsigned short*)q + {};
  const unsigned short* kp = (const unsigned short*)k + {};
  const unsigned short* vp = (const unsigned short*)v + {};
  const unsigned short* gp = (const unsigned short*)dout + {};
"#,
        sp.head(Part::Q),
        sp.head(Part::K),
        sp.head(Part::V),
        sp.head(Part::O)
    )
}

/// The gradient with respect to q (see [`lower_grad`]).
fn grad_q(sp: &Spec) -> String {
    let (sq, sk, d, dv) = (sp.sq, sp.sk, sp.d, sp.dv);
    let (ks, vs) = (d + 8, dv + 8);
    let (krs, vrs) = (sp.stride(Part::K), sp.stride(Part::V));
    let qt = sq.div_ceil(BR);
    let sl2 = (sp.scale * std::f64::consts::LOG2_E) as f32;
    let mask = sp.mask.clone().unwrap_or_default();
    let mut c = grad_prelude(sp);
    c += &format!(
        r#"__shared__ __align__(16) unsigned short ks[64 * {ks}];
__shared__ __align__(16) unsigned short vs[64 * {vs}];
const unsigned ks_base = (unsigned)__cvta_generic_to_shared(ks);
const unsigned vs_base = (unsigned)__cvta_generic_to_shared(vs);
for (long long tile = blockIdx.x; tile < {tiles}LL; tile += gridDim.x) {{
  const long long bh = tile / {qt}LL;
  const int qt = (int)({qt}LL - 1LL - tile % {qt}LL);
  const int i0 = qt * 64 + warp * 16 + g, i1 = i0 + 8;
{ptrs}"#,
        ptrs = head_pointers(sp),
        tiles = sp.tiles(sq)
    );
    c += &a_frags("qa", "qp", "i0", sq, d, sp.stride(Part::Q));
    c += &a_frags("ga", "gp", "i0", sq, dv, sp.stride(Part::O));
    c += &format!(
        r#"  const float lse0 = i0 < {sq} ? lse[bh * {sq}LL + i0] : RT_POS_INF;
  const float lse1 = i1 < {sq} ? lse[bh * {sq}LL + i1] : RT_POS_INF;
  const float dl0 = i0 < {sq} ? delta[bh * {sq}LL + i0] : 0.f;
  const float dl1 = i1 < {sq} ? delta[bh * {sq}LL + i1] : 0.f;
  const int lim0 = lim_of(i0), lim1 = lim_of(i1);
  const int ntiles = (lim_of(min(qt * 64 + 63, {sq} - 1)) + 63) / 64;
"#
    );
    c += &zeros("acc", d / 8);
    c += &format!(
        r#"  for (int j = 0; j < ntiles; ++j) {{
    load_tile(kp, ks_base, j, {d}, {ks}, {sk}, {krs});
    load_tile(vp, vs_base, j, {dv}, {vs}, {sk}, {vrs});
    asm volatile("cp.async.wait_group 0;");
    __syncthreads();
"#
    );
    c += &zeros("s", 8);
    c += &mma_abt("s", "qa", "ks_base", ks, d / 16);
    c += &zeros("dpv", 8);
    c += &mma_abt("dpv", "ga", "vs_base", vs, dv / 16);
    c += &format!(
        r#"    // dS = P∘(dP − D), P = 2^(scaled score − lse); masked pairs 0.
    #pragma unroll
    for (int n = 0; n < 8; ++n) {{
      #pragma unroll
      for (int e = 0; e < 4; ++e) {{
        const int key = j * 64 + n * 8 + t4 * 2 + (e & 1);
        const int row = e < 2 ? i0 : i1;
        float p = 0.f;
        if (key < (e < 2 ? lim0 : lim1) && row < {sq}) {{
          float x = s[n][e] * {sl2:?}f;
          {mask}
          p = ex2(x - (e < 2 ? lse0 : lse1));
        }}
        s[n][e] = p * (dpv[n][e] - (e < 2 ? dl0 : dl1));
      }}
    }}
"#
    );
    c += &mma_pb("acc", "s", "ks_base", ks, d);
    c += "    __syncthreads();\n  }\n";
    c += &format!(
        "  unsigned short* op = (unsigned short*)out + {};\n",
        sp.head(Part::Q)
    );
    c += &store_rows(
        "acc",
        "op",
        "i0",
        sq,
        d,
        sp.stride(Part::Q),
        sp.scale as f32,
    );
    c += "}\n";
    c
}

/// The loop over a warp's `Sᵀ` tile (`s[br / 8][4]`: its keys `j0`/`j1`, the `br` queries of
/// tile `it`) computing each `p = 2^(score·scale·log2 e − lse)` (masked pairs 0, the base-2
/// log-sum-exp of query `local` read from `ls[local]`), then running `assign` over `p`; `what`
/// names the result in the loop's comment.
fn transposed_probabilities(sp: &Spec, what: &str, ls: &str, assign: &str, br: usize) -> String {
    let sq = sp.sq;
    let sl2 = (sp.scale * std::f64::consts::LOG2_E) as f32;
    let mask = sp.mask.clone().unwrap_or_default();
    format!(
        r#"    // {what} for this warp's keys and the tile's queries; masked pairs 0.
    #pragma unroll
    for (int n = 0; n < {n8}; ++n) {{
      #pragma unroll
      for (int e = 0; e < 4; ++e) {{
        const int local = n * 8 + t4 * 2 + (e & 1);
        const int row = it * {br} + local;
        const int key = e < 2 ? j0 : j1;
        float p = 0.f;
        if (row < {sq} && key < lim_of(row)) {{
          float x = s[n][e] * {sl2:?}f;
          {mask}
          p = ex2(x - {ls}[local]);
        }}
        {assign}
      }}
    }}
"#,
        n8 = br / 8
    )
}

/// The first query that sees key `kb`, as C over `int kb`.
fn first_query(sp: &Spec) -> String {
    match sp.causal {
        Causal::None => "0".to_string(),
        Causal::TopLeft => "kb".to_string(),
        Causal::BottomRight => format!("max(kb - ({}), 0)", sp.sk as i64 - sp.sq as i64),
    }
}

/// Which key-side gradients a kernel computes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kv {
    K,
    V,
    /// Both, into `out_k` and `out_v`.
    Both,
}

/// The gradient with respect to k, v or both (see [`lower_grad`]).
fn grad_kv(sp: &Spec, which: Kv) -> String {
    let (sq, sk, d, dv) = (sp.sq, sp.sk, sp.d, sp.dv);
    let (wk, wv) = (which != Kv::V, which != Kv::K);
    let (qs, gs) = (d + 8, dv + 8);
    let (qrs, grs) = (sp.stride(Part::Q), sp.stride(Part::O));
    let (qt, kt) = (sq.div_ceil(BR), sk.div_ceil(BC));
    let first = first_query(sp);
    let mut c = grad_prelude(sp);
    c += &format!(
        r#"__shared__ __align__(16) unsigned short qs[64 * {qs}];
__shared__ __align__(16) unsigned short gs[64 * {gs}];
__shared__ float ls[64], dls[64];
const unsigned qs_base = (unsigned)__cvta_generic_to_shared(qs);
const unsigned gs_base = (unsigned)__cvta_generic_to_shared(gs);
for (long long tile = blockIdx.x; tile < {tiles}LL; tile += gridDim.x) {{
  const long long bh = tile / {kt}LL;
  const int kb = (int)(tile % {kt}LL) * 64;
  const int j0 = kb + warp * 16 + g, j1 = j0 + 8;
{ptrs}"#,
        ptrs = head_pointers(sp),
        tiles = sp.tiles(sk)
    );
    c += &a_frags("ka", "kp", "j0", sk, d, sp.stride(Part::K));
    if wk {
        c += &a_frags("va", "vp", "j0", sk, dv, sp.stride(Part::V));
        c += &zeros("acck", d / 8);
    }
    if wv {
        c += &zeros("accv", dv / 8);
    }
    c += &format!(
        r#"  const int it0 = ({first}) / 64;
  for (int it = it0; it < {qt}; ++it) {{
    load_tile(qp, qs_base, it, {d}, {qs}, {sq}, {qrs});
    load_tile(gp, gs_base, it, {dv}, {gs}, {sq}, {grs});
    if (tid < 64) {{
      const int i = it * 64 + tid;
      ls[tid] = i < {sq} ? lse[bh * {sq}LL + i] : RT_POS_INF;
      dls[tid] = i < {sq} ? delta[bh * {sq}LL + i] : 0.f;
    }}
    asm volatile("cp.async.wait_group 0;");
    __syncthreads();
"#
    );
    c += &zeros("s", 8);
    c += &mma_abt("s", "ka", "qs_base", qs, d / 16);
    if wk {
        c += &zeros("dpt", 8);
        c += &mma_abt("dpt", "va", "gs_base", gs, dv / 16);
    }
    if which == Kv::Both {
        c += "    float pt[8][4];\n";
    }
    let value = match which {
        Kv::K => "p * (dpt[n][e] - dls[local])",
        Kv::V => "p",
        Kv::Both => "p * (dpt[n][e] - dls[local]);\n        pt[n][e] = p",
    };
    c += &transposed_probabilities(
        sp,
        "Pᵀ (and/or dSᵀ)",
        "ls",
        &format!("s[n][e] = {value};"),
        BR,
    );
    match which {
        Kv::K => c += &mma_pb("acck", "s", "qs_base", qs, d),
        Kv::V => c += &mma_pb("accv", "s", "gs_base", gs, dv),
        Kv::Both => {
            c += &mma_pb("accv", "pt", "gs_base", gs, dv);
            c += &mma_pb("acck", "s", "qs_base", qs, d);
        }
    }
    c += "    __syncthreads();\n  }\n";
    let (ko, vo) = match which {
        Kv::Both => ("out_k", "out_v"),
        _ => ("out", "out"),
    };
    c += &store_kv(sp, wk.then_some(ko), wv.then_some(vo));
    c += "}\n";
    c
}

/// Stores a key tile's `acck` (times the scale) into `dK` at `k` and `accv` into `dV` at `v`
/// (rows `j0`/`j0 + 8`), each when named.
fn store_kv(sp: &Spec, k: Option<&str>, v: Option<&str>) -> String {
    let mut c = String::new();
    if let Some(ko) = k {
        c += &format!(
            "  unsigned short* okp = (unsigned short*){ko} + {};\n",
            sp.head(Part::K)
        );
        c += &store_rows(
            "acck",
            "okp",
            "j0",
            sp.sk,
            sp.d,
            sp.stride(Part::K),
            sp.scale as f32,
        );
    }
    if let Some(vo) = v {
        c += &format!(
            "  unsigned short* ovp = (unsigned short*){vo} + {};\n",
            sp.head(Part::V)
        );
        c += &store_rows("accv", "ovp", "j0", sp.sk, sp.dv, sp.stride(Part::V), 1.0);
    }
    c
}

#[cfg(test)]
mod tests {
    use super::{Part, Spec};
    use rustytorch_ops::{AttnLayout, AttnMask, Causal, DType, F64Bits, Op, TensorType};

    /// The element a tensor map addresses at (column, row, head, batch) is the one the layout
    /// puts there, for q, k and v in every layout (a packed one at its index in the third
    /// dim), and rows past the sequence are outside the map's view.
    #[test]
    fn tensor_maps_address_the_layouts_elements() {
        let (b, h, sq, sk, d) = (2usize, 3usize, 70usize, 50usize, 128usize);
        for layout in [AttnLayout::Bhsd, AttnLayout::Bshd, AttnLayout::Packed] {
            let ty = |s: usize| match layout {
                AttnLayout::Packed => TensorType::new(DType::BF16, [b, s, 3, h, d]),
                _ => TensorType::new(DType::BF16, layout.from_bhsd([b, h, s, d])),
            };
            let (sk, ins) = if layout == AttnLayout::Packed {
                (sq, [ty(sq), ty(sq), ty(sq)])
            } else {
                (sk, [ty(sq), ty(sk), ty(sk)])
            };
            let refs: Vec<&TensorType> = ins.iter().collect();
            let op = Op::Attention {
                causal: Causal::None,
                mask: AttnMask::None,
                scale: F64Bits::new(0.1),
                layout,
            };
            let out = rustytorch_ops::infer(&op, &refs).expect("infer");
            let sp = Spec::new(&op, &refs, &out)
                .expect("spec")
                .expect("not empty");
            for (part, rows) in [(Part::Q, sq), (Part::K, sk), (Part::V, sk), (Part::O, sq)] {
                let m = sp.tensor_map(part, 128);
                assert_eq!(m.dims, [d as u64, rows as u64, h as u64, b as u64]);
                assert_eq!(m.boxes, [64, 128, 1, 1]);
                assert!(
                    m.offset.is_multiple_of(16) && m.strides.iter().all(|s| s.is_multiple_of(16))
                );
                for (bi, hi, r, c) in [(0, 0, 0, 0), (1, 2, rows - 1, 127), (1, 0, 5, 64)] {
                    let at = m.offset
                        + 2 * c as u64
                        + r as u64 * m.strides[0]
                        + hi as u64 * m.strides[1]
                        + bi as u64 * m.strides[2];
                    // dO is [B, S, H, D] in both the Bshd and the packed layout.
                    let want = match (layout, part) {
                        (AttnLayout::Bhsd, _) => ((bi * h + hi) * rows + r) * d + c,
                        (AttnLayout::Bshd, _) | (AttnLayout::Packed, Part::O) => {
                            ((bi * rows + r) * h + hi) * d + c
                        }
                        (AttnLayout::Packed, _) => {
                            (((bi * rows + r) * 3 + part as usize) * h + hi) * d + c
                        }
                    };
                    assert_eq!(at, 2 * want as u64, "{layout:?} part {}", part as usize);
                }
            }
        }
    }
}
