//! Reductions, arg-reductions, softmax/log-softmax, layer_norm/rms_norm and cross-entropy (and its
//! gradient) kernels.
//!
//! Every op here is a set of *rows*: a row is one output element (or one normalized vector) whose
//! elements lie at `base(row) + offset(k)` for `k` in `0..n`, both offsets decoded from literal
//! sizes and strides. One template places rows on threads in one of three ways ([`Strat`]):
//!
//! - a warp per row (8 rows per 256-thread block): lanes stride over `k` and combine with butterfly
//!   shuffles, so that every lane holds the result;
//! - a block per row, for few long rows: warps combine through shared memory, then shuffles again;
//! - 32 rows per block and 8 threads per row, when the rows' elements are strided and neighbouring
//!   rows are neighbours in memory (a reduction over a non-last axis), so that a warp reads 32
//!   consecutive elements; the 8 partials combine through shared memory.
//!
//! Softmax, log-softmax and the norms over a contiguous last axis take the one-pass kernels of
//! [`super::rows`] when the rows fit in registers; the kernels here are their general form.
//!
//! A reduction with few outputs and a long reduced extent runs in two launches: partials of chunks
//! of each output's elements into scratch, then a reduction of the partials.
//!
//! Numerics follow the CPU kernels: f16/bf16/f32 accumulate in f32 and f64 in f64, integers in i64
//! (wrapping, truncated on store), bool any/all as 0/1; mean divides the sum once; NaN propagates
//! through max/min; argmax/argmin return the first index of the extreme, NaN counting as the
//! extreme. Only the order of additions differs (lane-strided partials combined in a tree).
//! Cross entropy cannot fail at run time: a target outside `0..C` that is not `ignore_index` (an
//! error on the CPU) gives a NaN loss, and NaN gradients for its row.

use super::ir::{
    add, assign, bin, cast, div, elem_bytes, fc, for_, global_thread, i32c, i64c, if_,
    lane_and_warp, let_, lit, load, load_vec, lt, mul, rem, select, special, store, store_vec, sub,
    un, var, warp_row_loop, BinFn, CTy, Expr, Kernel, Lit, Param, Special, Stmt, UnFn,
};
use super::rows::{self, RowOp};
use super::{finish, grid_for, ArgRef, Launch, StepKernels};
use crate::{CodegenError, Result};
use rustytorch_ops::{ArgKind, DType, FusedKernel, Op, OpError, ReduceKind, Reduction, TensorType};

/// Threads per block of every kernel here.
const BLOCK: u32 = 256;
/// Threads per warp.
const WARP: i64 = 32;
/// Warps per block (also the threads per row of [`Strat::Cols`]).
const WARPS: i64 = BLOCK as i64 / WARP;

/// Lowers a reduction-shaped op: `Reduce`, `ArgReduce`, `Softmax`, `LogSoftmax`, `LayerNorm`,
/// `RmsNorm`, `CrossEntropy` and `CrossEntropyGrad`. An output without elements needs no launch.
pub fn lower(op: &Op, inputs: &[&TensorType], out: &TensorType) -> Result<StepKernels> {
    super::ir::check_dtypes(op, inputs, out)?;
    let want = rustytorch_ops::infer(op, inputs)?;
    if &want != out {
        return Err(CodegenError::Invalid(format!(
            "{}: result type {out} does not match the inferred {want}",
            op.name()
        )));
    }
    if out.shape.numel() == 0 {
        return Ok(StepKernels::default());
    }
    let x = inputs[0];
    match op {
        Op::Reduce { kind, axes, .. } => {
            // A float reduction over a contiguous last axis whose rows fit in registers: the
            // one-pass row kernel (16-byte loads).
            if axes.as_slice() == [x.shape.rank().wrapping_sub(1)] {
                if let Some(step) = rows::lower_reduce(*kind, x, out)? {
                    return Ok(step);
                }
            }
            reduce(*kind, axes, x, out)
        }
        Op::ArgReduce { kind, axis, .. } => arg_reduce(op, *kind, *axis, x),
        Op::Softmax { axis } => softmax(*axis, false, x),
        Op::LogSoftmax { axis } => softmax(*axis, true, x),
        Op::LayerNorm { eps, weight, bias } => norm(x, eps.get(), *weight, *bias, true),
        Op::RmsNorm { eps, weight } => norm(x, eps.get(), *weight, false, false),
        Op::CrossEntropy {
            reduction,
            ignore_index,
        } => cross_entropy(x, inputs[1], *reduction, *ignore_index),
        Op::CrossEntropyGrad {
            reduction,
            ignore_index,
        } => cross_entropy_grad(x, inputs[1], *reduction, *ignore_index),
        _ => Err(CodegenError::Invalid(format!(
            "{}: not a reduction-shaped op",
            op.name()
        ))),
    }
}

// ---------------------------------------------------------------------------------------------
// Index spaces

/// One dim of an index space: (size, stride in elements).
pub(super) type Dim = (usize, usize);

/// Drops size-1 dims and merges neighbours that are contiguous with each other.
pub(super) fn coalesce(dims: impl IntoIterator<Item = Dim>) -> Vec<Dim> {
    let mut out: Vec<Dim> = Vec::new();
    for (size, stride) in dims {
        if size == 1 {
            continue;
        }
        match out.last_mut() {
            Some(last) if last.1 == size * stride => *last = (last.0 * size, stride),
            _ => out.push((size, stride)),
        }
    }
    out
}

/// The offset of flat row-major index `idx` (a variable) of the space `dims`.
pub(super) fn offset(idx: &str, dims: &[Dim]) -> Expr {
    let mut inner = 1usize;
    let mut terms = Vec::new();
    for (j, &(size, stride)) in dims.iter().enumerate().rev() {
        let mut c = var(idx);
        if inner > 1 {
            c = div(c, i64c(inner as i64));
        }
        if j > 0 {
            c = rem(c, i64c(size as i64));
        }
        if stride != 1 {
            c = mul(c, i64c(stride as i64));
        }
        terms.push(c);
        inner *= size;
    }
    terms
        .into_iter()
        .rev()
        .reduce(add)
        .unwrap_or_else(|| i64c(0))
}

/// A split of every row's `0..n` into `parts` chunks of `chunk` (the first stage of a two-stage
/// reduction): launch row `r` is output `r / parts`, chunk `r % parts`.
#[derive(Clone, Copy, Debug)]
struct Split {
    parts: usize,
    chunk: usize,
}

/// The rows of one launch.
#[derive(Clone, Debug)]
struct Rows {
    /// Rows the launch covers (outputs × parts when split).
    count: usize,
    /// Output index → base offset.
    kept: Vec<Dim>,
    /// Index in the row → offset from the base.
    red: Vec<Dim>,
    /// Elements per row.
    n: usize,
    split: Option<Split>,
}

impl Rows {
    fn new(count: usize, kept: Vec<Dim>, red: Vec<Dim>, n: usize) -> Rows {
        Rows {
            count,
            kept,
            red: if n == 0 { vec![] } else { red },
            n,
            split: None,
        }
    }

    /// The offset of element `k` of the current row.
    fn at(&self) -> Expr {
        add(var("base"), offset("k", &self.red))
    }
}

/// How rows are placed on threads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Strat {
    /// A warp per row.
    Warp,
    /// A block per row.
    Block,
    /// 32 rows per block, 8 threads per row.
    Cols,
}

/// The placement for `rows` rows of `n` elements: columns when the unit-stride dim is kept (a row's
/// elements are strided), a warp per row when rows are short or many, else a block per row.
fn choose(rows: &Rows) -> Strat {
    if rows.kept.last().is_some_and(|d| d.1 == 1) {
        Strat::Cols
    } else if rows.n <= 1024 || rows.count >= 2048 {
        Strat::Warp
    } else {
        Strat::Block
    }
}

/// Chunks per output of a two-stage reduction (1: one stage): enough blocks to fill the GPU when
/// outputs are few and long (column reductions split by [`ColPlan::parts`]).
fn parts_for(strat: Strat, outputs: usize, n: usize) -> usize {
    match strat {
        // Chunks of 8192 (32 elements a thread), up to ~512 blocks in all.
        Strat::Block if outputs < 128 && n >= 32_768 => {
            n.div_ceil(8192).min(512usize.div_ceil(outputs))
        }
        _ => 1,
    }
}

// ---------------------------------------------------------------------------------------------
// Accumulators

/// How partial states combine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Comb {
    Sum,
    Prod,
    Max,
    Min,
    /// Max over 0/1.
    Any,
    /// Min over 0/1.
    All,
    /// (value, index): the extreme, NaN first, then the lowest index.
    ArgMax,
    ArgMin,
}

/// An accumulator: its combination and value type.
#[derive(Clone, Copy, Debug)]
struct Acc {
    comb: Comb,
    ty: CTy,
}

/// The accumulation type of a dtype (as the CPU kernels).
fn acc_ty(d: DType) -> CTy {
    match d {
        DType::F64 => CTy::F64,
        DType::F32 | DType::F16 | DType::BF16 => CTy::F32,
        DType::Bool => CTy::I32,
        DType::I8 | DType::I16 | DType::I32 | DType::I64 | DType::U8 | DType::U16 | DType::U32 => {
            CTy::I64
        }
        DType::U64 => CTy::U64,
    }
}

/// `ty`'s float compute type for the normalization and loss kernels (f64 for f64, else f32).
fn real_ty(d: DType) -> CTy {
    if d == DType::F64 {
        CTy::F64
    } else {
        CTy::F32
    }
}

fn eq(a: Expr, b: Expr) -> Expr {
    bin(BinFn::Eq, a, b)
}
fn and(a: Expr, b: Expr) -> Expr {
    bin(BinFn::And, a, b)
}
fn or(a: Expr, b: Expr) -> Expr {
    bin(BinFn::Or, a, b)
}
fn not(a: Expr) -> Expr {
    un(UnFn::Not, a)
}
fn nan(ty: CTy) -> Expr {
    fc(f64::NAN, ty)
}

/// A load converted to `ty` (no conversion when the buffer's compute type is already `ty`).
fn load_as(buf: &str, elem: CTy, index: Expr, ty: CTy) -> Expr {
    let l = load(buf, elem, index);
    if elem.compute_of() == ty {
        l
    } else {
        cast(ty, l)
    }
}

/// A kernel parameter.
fn param(name: &str, elem: CTy, writes: bool) -> Param {
    Param {
        name: name.into(),
        elem,
        writes,
        map: None,
    }
}

impl Acc {
    fn new(comb: Comb, ty: CTy) -> Acc {
        Acc { comb, ty }
    }

    fn is_arg(&self) -> bool {
        matches!(self.comb, Comb::ArgMax | Comb::ArgMin)
    }

    /// The state variables of accumulator `p`.
    fn vars(&self, p: &str) -> Vec<(String, CTy)> {
        if self.is_arg() {
            vec![(format!("{p}_v"), self.ty), (format!("{p}_i"), CTy::I64)]
        } else {
            vec![(p.to_string(), self.ty)]
        }
    }

    /// The identity state.
    fn identity(&self) -> Vec<Expr> {
        let ty = self.ty;
        let (lowest, highest) = if ty.is_float() {
            (fc(f64::NEG_INFINITY, ty), fc(f64::INFINITY, ty))
        } else {
            (
                Expr::Lit(Lit::Int(i64::MIN, ty)),
                Expr::Lit(Lit::Int(i64::MAX, ty)),
            )
        };
        match self.comb {
            Comb::Sum | Comb::Any => vec![lit(0.0, ty)],
            Comb::Prod | Comb::All => vec![lit(1.0, ty)],
            Comb::Max => vec![lowest],
            Comb::Min => vec![highest],
            Comb::ArgMax => vec![lowest, i64c(i64::MAX)],
            Comb::ArgMin => vec![highest, i64c(i64::MAX)],
        }
    }

    /// Declares the state at its identity.
    fn init(&self, p: &str) -> Vec<Stmt> {
        self.vars(p)
            .into_iter()
            .zip(self.identity())
            .map(|((v, t), e)| let_(&v, t, e))
            .collect()
    }

    /// Resets the state to its identity.
    fn reset(&self, p: &str) -> Vec<Stmt> {
        self.vars(p)
            .into_iter()
            .zip(self.identity())
            .map(|((v, _), e)| assign(&v, e))
            .collect()
    }

    /// The value a finished state stands for (the index for arg-reductions).
    fn result(&self, p: &str) -> Expr {
        if self.is_arg() {
            var(&format!("{p}_i"))
        } else {
            var(p)
        }
    }

    /// `p = combine(p, other)`; an arg-reduction's `other` must be variables (used several times)
    /// and `tmp` names its decision.
    fn merge(&self, p: &str, other: &[Expr], tmp: &str) -> Vec<Stmt> {
        let a = var(p);
        let o = other[0].clone();
        let op = |f| vec![assign(p, bin(f, a.clone(), o.clone()))];
        match self.comb {
            Comb::Sum => op(BinFn::Add),
            Comb::Prod => op(BinFn::Mul),
            Comb::Max | Comb::Any => op(BinFn::Max),
            Comb::Min | Comb::All => op(BinFn::Min),
            Comb::ArgMax | Comb::ArgMin => {
                let (vn, inn) = (format!("{p}_v"), format!("{p}_i"));
                let (v, i) = (var(&vn), var(&inn));
                let (bv, bi) = (other[0].clone(), other[1].clone());
                let better = if self.comb == Comb::ArgMax {
                    bin(BinFn::Gt, bv.clone(), v.clone())
                } else {
                    bin(BinFn::Lt, bv.clone(), v.clone())
                };
                let nan_v = un(UnFn::IsNan, v.clone());
                let nan_b = un(UnFn::IsNan, bv.clone());
                let earlier = lt(bi.clone(), i.clone());
                // NaN beats everything; among NaNs, or equal values, the lower index wins.
                let take = or(
                    and(nan_b, or(not(nan_v.clone()), earlier.clone())),
                    and(
                        not(nan_v),
                        or(better, and(eq(bv.clone(), v.clone()), earlier)),
                    ),
                );
                vec![
                    let_(tmp, CTy::Bool, take),
                    assign(&vn, select(var(tmp), bv, v)),
                    assign(&inn, select(var(tmp), bi, i)),
                ]
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The row template

/// A kernel under construction: its placement, shared arrays and a counter for fresh names.
struct Tpl {
    strat: Strat,
    shared: Vec<Stmt>,
    uid: usize,
}

impl Tpl {
    fn new(strat: Strat) -> Tpl {
        Tpl {
            strat,
            shared: Vec::new(),
            uid: 0,
        }
    }

    fn fresh(&mut self, p: &str) -> String {
        self.uid += 1;
        format!("{p}{}", self.uid)
    }

    /// Threads per row.
    fn lanes(&self) -> i64 {
        match self.strat {
            Strat::Warp => WARP,
            Strat::Block => BLOCK as i64,
            Strat::Cols => WARPS,
        }
    }

    /// `for (k = kb + lane; k < ke; k += lanes) body`: this thread's share of the row.
    fn kloop(&self, body: Vec<Stmt>) -> Stmt {
        for_(
            "k",
            add(var("kb"), var("lane")),
            var("ke"),
            i64c(self.lanes()),
            body,
        )
    }

    /// Whether this thread writes the row's single result.
    fn leader(&self) -> Expr {
        let first = eq(var("lane"), i64c(0));
        if self.strat == Strat::Cols {
            and(first, var("act"))
        } else {
            first
        }
    }

    /// Folds one element (`x`, at index `k`) into accumulator `p`.
    fn step(&mut self, acc: &Acc, p: &str, x: Expr) -> Vec<Stmt> {
        let tmp = self.fresh("take");
        if acc.is_arg() {
            let xv = self.fresh("x");
            let mut s = vec![let_(&xv, acc.ty, x)];
            s.extend(acc.merge(p, &[var(&xv), var("k")], &tmp));
            s
        } else {
            acc.merge(p, &[x], &tmp)
        }
    }

    /// Combines `p` with `other` (one expression per state variable, all evaluated first).
    fn combine(&mut self, acc: &Acc, p: &str, other: Vec<Expr>) -> Vec<Stmt> {
        let tmp = self.fresh("take");
        if !acc.is_arg() {
            return acc.merge(p, &other, &tmp);
        }
        let t = self.fresh("o");
        let mut s = Vec::new();
        let mut names = Vec::new();
        for (j, (e, (_, ty))) in other.into_iter().zip(acc.vars(p)).enumerate() {
            let n = format!("{t}_{j}");
            s.push(let_(&n, ty, e));
            names.push(var(&n));
        }
        s.extend(acc.merge(p, &names, &tmp));
        s
    }

    /// A warp's butterfly: every lane ends with the combination of the warp's 32 states.
    fn butterfly(&mut self, acc: &Acc, p: &str) -> Vec<Stmt> {
        let mut s = Vec::new();
        for off in [16, 8, 4, 2, 1] {
            let other = acc
                .vars(p)
                .iter()
                .map(|(v, _)| bin(BinFn::ShflXor, var(v), i32c(off)))
                .collect();
            s.extend(self.combine(acc, p, other));
        }
        s
    }

    fn shared_arrays(&mut self, acc: &Acc, p: &str, len: u32) -> Vec<(String, String, CTy)> {
        acc.vars(p)
            .into_iter()
            .map(|(v, ty)| {
                let sh = self.fresh("sh");
                self.shared.push(Stmt::Shared {
                    name: sh.clone(),
                    elem: ty,
                    len,
                });
                (v, sh, ty)
            })
            .collect()
    }

    /// Combines accumulator `p` over the threads of a row; every one of them ends with the result.
    fn reduce(&mut self, acc: &Acc, p: &str) -> Vec<Stmt> {
        match self.strat {
            Strat::Warp => self.butterfly(acc, p),
            Strat::Block => {
                let mut s = self.butterfly(acc, p);
                let arrays = self.shared_arrays(acc, p, WARPS as u32);
                s.push(if_(
                    eq(var("wl"), i64c(0)),
                    arrays
                        .iter()
                        .map(|(v, sh, ty)| store(sh, *ty, var("wid"), var(v)))
                        .collect(),
                ));
                s.push(Stmt::SyncThreads);
                s.extend(acc.reset(p));
                s.push(if_(
                    lt(var("wl"), i64c(WARPS)),
                    arrays
                        .iter()
                        .map(|(v, sh, ty)| assign(v, load(sh, *ty, var("wl"))))
                        .collect(),
                ));
                s.extend(self.butterfly(acc, p));
                s
            }
            Strat::Cols => {
                let arrays = self.shared_arrays(acc, p, BLOCK);
                let mut s: Vec<Stmt> = arrays
                    .iter()
                    .map(|(v, sh, ty)| {
                        store(
                            sh,
                            *ty,
                            add(mul(var("lane"), i64c(WARP)), var("col")),
                            var(v),
                        )
                    })
                    .collect();
                s.push(Stmt::SyncThreads);
                s.extend(acc.reset(p));
                let other = arrays
                    .iter()
                    .map(|(_, sh, ty)| load(sh, *ty, add(mul(var("j"), i64c(WARP)), var("col"))))
                    .collect();
                let body = self.combine(acc, p, other);
                s.push(for_("j", i64c(0), i64c(WARPS), i64c(1), body));
                s
            }
        }
    }

    /// The finished kernel and its grid: the thread geometry, then a loop over `rows` that
    /// defines `row`, `o` (the output), `base`, `kb`/`ke` (the row's range of `k`), `lane` (the
    /// thread's place in the row) and, for columns, `act` (whether the row exists) before `body`.
    fn kernel(
        self,
        prefix: &str,
        params: Vec<Param>,
        rows: &Rows,
        body: Vec<Stmt>,
    ) -> Result<(Kernel, u32)> {
        let r = rows.count as i64;
        let n = rows.n as i64;
        let (o, kb, ke) = match rows.split {
            None => (var("row"), i64c(0), i64c(n)),
            Some(sp) => {
                let m = i64c(sp.parts as i64);
                let (o, part) = (div(var("row"), m.clone()), rem(var("row"), m));
                let kb = mul(part, i64c(sp.chunk as i64));
                let ke = bin(BinFn::Min, add(var("kb"), i64c(sp.chunk as i64)), i64c(n));
                (o, kb, ke)
            }
        };
        let ke = if self.strat == Strat::Cols {
            select(var("act"), ke, i64c(0))
        } else {
            ke
        };
        let mut decode = vec![
            let_("o", CTy::I64, o),
            let_("kb", CTy::I64, kb),
            let_("ke", CTy::I64, ke),
            let_("base", CTy::I64, offset("o", &rows.kept)),
        ];
        decode.extend(body);
        let tid = || special(Special::ThreadIdx);
        let (pre, looped, grid) = match self.strat {
            Strat::Warp => (
                lane_and_warp(),
                warp_row_loop(r, WARPS, decode),
                grid_for(rows.count as u64, WARPS as u64),
            ),
            Strat::Block => {
                decode.push(Stmt::SyncThreads);
                (
                    vec![
                        let_("lane", CTy::I64, tid()),
                        let_("wl", CTy::I64, rem(var("lane"), i64c(WARP))),
                        let_("wid", CTy::I64, div(var("lane"), i64c(WARP))),
                    ],
                    for_(
                        "row",
                        special(Special::BlockIdx),
                        i64c(r),
                        special(Special::GridDim),
                        decode,
                    ),
                    grid_for(rows.count as u64, 1),
                )
            }
            Strat::Cols => {
                let mut inner = vec![
                    let_("act", CTy::Bool, lt(add(var("rb"), var("col")), i64c(r))),
                    // Threads past the last row work on it without storing.
                    let_(
                        "row",
                        CTy::I64,
                        bin(BinFn::Min, add(var("rb"), var("col")), i64c(r - 1)),
                    ),
                ];
                inner.extend(decode);
                inner.push(Stmt::SyncThreads);
                (
                    vec![
                        let_("col", CTy::I64, rem(tid(), i64c(WARP))),
                        let_("lane", CTy::I64, div(tid(), i64c(WARP))),
                    ],
                    for_(
                        "rb",
                        mul(special(Special::BlockIdx), i64c(WARP)),
                        i64c(r),
                        mul(special(Special::GridDim), i64c(WARP)),
                        inner,
                    ),
                    grid_for(rows.count as u64, WARP as u64),
                )
            }
        };
        let mut all = self.shared;
        all.extend(pre);
        all.push(looped);
        let k = finish(
            prefix,
            Kernel {
                name: String::new(),
                params,
                block: BLOCK,
                smem: 0,
                body: all,
            },
        )?;
        Ok((k, grid))
    }
}

/// A one-kernel step.
fn single(k: (Kernel, u32), args: Vec<ArgRef>) -> StepKernels {
    StepKernels {
        launches: vec![Launch {
            kernel: k.0,
            args,
            grid: k.1,
        }],
        scratch_bytes: 0,
    }
}

/// A kernel that reduces each row of `src` with `acc` and stores `fin(result)` at `dst[row]`.
fn reduce_kernel(
    prefix: &str,
    rows: &Rows,
    strat: Strat,
    acc: Acc,
    src: (&str, CTy),
    dst: (&str, CTy),
    fin: impl Fn(Expr) -> Expr,
) -> Result<(Kernel, u32)> {
    fused_reduce_kernel(prefix, rows, strat, acc, src, dst, fin, None, None)
}

/// An elementwise program fused into a reduction's loads (a prologue, over the reduced tensor's
/// elements) or its stores (an epilogue, over the outputs), with the operands it loads.
pub(super) struct Prog<'a> {
    /// The program.
    pub k: &'a FusedKernel,
    /// Per program input: its parameter name, storage type and offset space (the operand's
    /// broadcast strides over the tensor the program runs over), or `None` for the epilogue's
    /// input 0 (the reduction's result).
    pub ops: Vec<Option<(String, CTy, Vec<Dim>)>>,
    /// The dtype of each program input.
    pub dtypes: Vec<DType>,
    /// The storage type the program's value is rounded to (the reduced tensor's for a prologue,
    /// the result's for an epilogue).
    pub round: CTy,
    /// The storage type input 0 is rounded to when it is not loaded (the reduction's result, as
    /// the unfused graph stores it).
    pub first: CTy,
}

/// `v` held in `from`, rounded to storage type `e`, held in `to`.
fn rounded(v: Expr, from: CTy, e: CTy, to: CTy) -> Expr {
    let ec = e.compute_of();
    let v = if from == ec { v } else { cast(ec, v) };
    let v = if e == ec { v } else { cast(ec, cast(e, v)) };
    if ec == to {
        v
    } else {
        cast(to, v)
    }
}

impl Prog<'_> {
    /// The parameters of the loaded operands.
    fn params(&self) -> Vec<Param> {
        self.ops
            .iter()
            .flatten()
            .map(|(n, e, _)| param(n, *e, false))
            .collect()
    }

    /// The program's value at flat index `idx` (a variable), `first` standing for input 0 when it
    /// is not loaded, rounded to [`Prog::round`] and held in `ty`; statements go to `s`.
    fn value(
        &self,
        s: &mut Vec<Stmt>,
        tag: &str,
        idx: &str,
        first: Option<Expr>,
        ty: CTy,
    ) -> Result<Expr> {
        let mut args = Vec::with_capacity(self.ops.len());
        for (j, o) in self.ops.iter().enumerate() {
            args.push(match o {
                Some((name, elem, dims)) => {
                    let v = format!("{tag}a{j}");
                    s.push(let_(
                        &v,
                        elem.compute_of(),
                        load(name, *elem, offset(idx, dims)),
                    ));
                    var(&v)
                }
                None => {
                    let f = first.clone().unwrap_or_else(|| lit(0.0, ty));
                    let fc = self.first.compute_of();
                    let v = format!("{tag}a{j}");
                    s.push(let_(&v, fc, rounded(f, ty, self.first, fc)));
                    var(&v)
                }
            });
        }
        self.value_of(s, tag, &args, ty)
    }

    /// The program's value over the operand values `args` (each in its compute type), rounded to
    /// [`Prog::round`] and held in `ty`; statements go to `s`.
    fn value_of(&self, s: &mut Vec<Stmt>, tag: &str, args: &[Expr], ty: CTy) -> Result<Expr> {
        let v = super::elementwise::program_value(s, tag, self.k, args, &self.dtypes)?;
        let c = super::elementwise::program_compute(self.k, &self.dtypes);
        Ok(rounded(v, c, self.round, ty))
    }
}

/// [`reduce_kernel`] with the loads computed by the prologue `pro` (its operands replace `src`)
/// and the stores mapped through the epilogue `epi` (its operands' parameters follow the
/// sources').
#[allow(clippy::too_many_arguments)]
fn fused_reduce_kernel(
    prefix: &str,
    rows: &Rows,
    strat: Strat,
    acc: Acc,
    src: (&str, CTy),
    dst: (&str, CTy),
    fin: impl Fn(Expr) -> Expr,
    pro: Option<&Prog>,
    epi: Option<&Prog>,
) -> Result<(Kernel, u32)> {
    let mut t = Tpl::new(strat);
    let mut body = acc.init("a");
    let mut each = Vec::new();
    let x = match pro {
        Some(p) => {
            each.push(let_("xi", CTy::I64, rows.at()));
            p.value(&mut each, "pt", "xi", None, acc.ty)?
        }
        None => load_as(src.0, src.1, rows.at(), acc.ty),
    };
    each.extend(t.step(&acc, "a", x));
    body.push(t.kloop(each));
    body.extend(t.reduce(&acc, "a"));
    let mut last = Vec::new();
    let y = match epi {
        Some(p) => {
            last.push(let_("r0", acc.ty, fin(acc.result("a"))));
            p.value(&mut last, "et", "row", Some(var("r0")), dst.1.compute_of())?
        }
        None => fin(acc.result("a")),
    };
    last.push(store(dst.0, dst.1, var("row"), y));
    body.push(if_(t.leader(), last));
    let mut params = match pro {
        Some(p) => p.params(),
        None => vec![param(src.0, src.1, false)],
    };
    if let Some(p) = epi {
        params.extend(p.params());
    }
    params.push(param(dst.0, dst.1, true));
    t.kernel(prefix, params, rows, body)
}

// ---------------------------------------------------------------------------------------------
// Reduce and ArgReduce

/// Copies `x` to the output (a reduction over no axes).
fn copy(prefix: &str, x: &TensorType) -> Result<StepKernels> {
    let e = CTy::storage(x.dtype);
    let n = x.shape.numel();
    let body = vec![super::ir::grid_stride(
        "i",
        n as i64,
        vec![store("y", e, var("i"), load("x", e, var("i")))],
    )];
    let k = finish(
        &format!("{prefix}_copy"),
        Kernel {
            name: String::new(),
            params: vec![param("x", e, false), param("y", e, true)],
            block: BLOCK,
            smem: 0,
            body,
        },
    )?;
    Ok(single(
        (k, grid_for(n as u64, BLOCK as u64)),
        vec![ArgRef::Input(0), ArgRef::Output],
    ))
}

/// Max (min) over an empty axis: every output is the identity, −∞ (+∞), or the type's least
/// (greatest) value for integers, as on the CPU (ONNX's definition of the max of nothing).
fn identity_fill(prefix: &str, max: bool, out: &TensorType) -> Result<StepKernels> {
    let e = CTy::storage(out.dtype);
    let ct = CTy::compute(out.dtype);
    let v = match out.dtype {
        DType::I32 => Expr::Lit(Lit::Int(if max { i32::MIN } else { i32::MAX } as i64, ct)),
        DType::I64 => Expr::Lit(Lit::Int(if max { i64::MIN } else { i64::MAX }, ct)),
        DType::U8 => Expr::Lit(Lit::Int(if max { 0 } else { 255 }, ct)),
        DType::Bool => super::ir::bc(!max),
        _ => fc(
            if max {
                f64::NEG_INFINITY
            } else {
                f64::INFINITY
            },
            ct,
        ),
    };
    let n = out.shape.numel();
    let body = vec![super::ir::grid_stride(
        "i",
        n as i64,
        vec![store("y", e, var("i"), v)],
    )];
    let k = finish(
        &format!("{prefix}_identity"),
        Kernel {
            name: String::new(),
            params: vec![param("y", e, true)],
            block: BLOCK,
            smem: 0,
            body,
        },
    )?;
    Ok(single(
        (k, grid_for(n as u64, BLOCK as u64)),
        vec![ArgRef::Output],
    ))
}

fn empty_error(op: &Op, what: &str, x: &TensorType) -> CodegenError {
    CodegenError::Op(OpError::Runtime {
        op: op.name(),
        reason: format!("{what} of an empty axis of {x} is undefined"),
    })
}

fn reduce(
    kind: ReduceKind,
    axes: &[usize],
    x: &TensorType,
    out: &TensorType,
) -> Result<StepKernels> {
    fused_reduce(kind, axes, x, out, None, None).map(|s| s.expect("a plain reduction lowers"))
}

/// The kernels of a reduction of `x` (the reduced tensor's type) to `out` with the prologue `pro`
/// computing `x`'s elements from its operands, the step's first inputs (else input 0 is `x`), and
/// the epilogue `epi` mapping the results, its operands the step's next inputs. `None` when
/// fused programs are given and the reduction is one without a reduced extent (a copy, or the
/// identity fill of a max or min over an empty axis).
pub(super) fn fused_reduce(
    kind: ReduceKind,
    axes: &[usize],
    x: &TensorType,
    out: &TensorType,
    pro: Option<&Prog>,
    epi: Option<&Prog>,
) -> Result<Option<StepKernels>> {
    let fused = pro.is_some() || epi.is_some();
    let n_src = pro.map_or(1, |p| p.ops.iter().flatten().count());
    let n_epi = epi.map_or(0, |p| p.ops.iter().flatten().count());
    let src_args: Vec<ArgRef> = (0..n_src).map(ArgRef::Input).collect();
    let epi_args: Vec<ArgRef> = (n_src..n_src + n_epi).map(ArgRef::Input).collect();
    let (name, comb) = match kind {
        ReduceKind::Sum => ("sum", Comb::Sum),
        ReduceKind::Mean => ("mean", Comb::Sum),
        ReduceKind::Max => ("max", Comb::Max),
        ReduceKind::Min => ("min", Comb::Min),
        ReduceKind::Prod => ("prod", Comb::Prod),
        ReduceKind::Any => ("any", Comb::Any),
        ReduceKind::All => ("all", Comb::All),
    };
    let prefix = format!("{}reduce_{name}", if fused { "fused_" } else { "" });
    if axes.is_empty() {
        return (!fused).then(|| copy(&prefix, x)).transpose();
    }
    let dims = x.shape.dims();
    let strides = x.shape.strides();
    let n: usize = axes.iter().map(|&a| dims[a]).product();
    if n == 0 && matches!(kind, ReduceKind::Max | ReduceKind::Min) {
        return (!fused)
            .then(|| identity_fill(&prefix, kind == ReduceKind::Max, out))
            .transpose();
    }
    let outputs = out.shape.numel();
    let dim = |a: usize| (dims[a], strides[a]);
    let kept = coalesce((0..dims.len()).filter(|a| !axes.contains(a)).map(dim));
    let red = coalesce(axes.iter().map(|&a| dim(a)));
    let rows = Rows::new(outputs, kept, red, n);
    let acc = Acc::new(comb, acc_ty(x.dtype));
    let (xs, ys) = (CTy::storage(x.dtype), CTy::storage(out.dtype));
    let fin = |e: Expr| {
        if kind == ReduceKind::Mean {
            div(e, fc(n as f64, acc.ty))
        } else {
            e
        }
    };
    let strat = choose(&rows);
    if strat == Strat::Cols {
        let args = (src_args, epi_args);
        return col_reduce(&prefix, &rows, acc, (xs, ys), &fin, pro, epi, args).map(Some);
    }
    let parts = parts_for(strat, outputs, n);
    if parts <= 1 {
        let k = fused_reduce_kernel(
            &prefix,
            &rows,
            strat,
            acc,
            ("x", xs),
            ("y", ys),
            fin,
            pro,
            epi,
        )?;
        let mut args = src_args;
        args.extend(epi_args);
        args.push(ArgRef::Output);
        return Ok(Some(single(k, args)));
    }
    // Two stages: partials of chunks into scratch, laid out [outputs, parts].
    let chunk = n.div_ceil(parts);
    let parts = n.div_ceil(chunk);
    let mut first = rows.clone();
    first.count = outputs * parts;
    first.split = Some(Split { parts, chunk });
    let k1 = fused_reduce_kernel(
        &format!("{prefix}_partial"),
        &first,
        strat,
        acc,
        ("x", xs),
        ("part", acc.ty),
        |e| e,
        pro,
        None,
    )?;
    let second = Rows::new(
        outputs,
        coalesce([(outputs, parts)]),
        coalesce([(parts, 1)]),
        parts,
    );
    let k2 = fused_reduce_kernel(
        &prefix,
        &second,
        choose(&second),
        acc,
        ("part", acc.ty),
        ("y", ys),
        fin,
        None,
        epi,
    )?;
    Ok(Some(two_stage(
        k1,
        k2,
        src_args,
        epi_args,
        outputs * parts * elem_bytes(acc.ty),
    )))
}

// ---------------------------------------------------------------------------------------------
// Column reductions

/// Blocks a split column reduction aims for: four of 256 threads on each of an H200's 132 SMs.
const COL_BLOCKS: usize = 4 * 132;
/// Rows each thread reads at least in a chunk of a split column reduction, so that the partials
/// stay a small fraction of the input.
const COL_MIN_ROWS: usize = 8;
/// Bytes a thread loads before it accumulates them (independent loads in flight: eight 16-byte
/// vectors of one input, four of each of two).
const COL_BYTES_IN_FLIGHT: usize = 128;

/// The placement of a column reduction (one that keeps the unit-stride dim): each thread owns
/// `vec` adjacent outputs (one 16-byte vector of the input where the kept extent and the strides
/// allow, else a shorter one or a scalar), `lanes` neighbouring threads cover `lanes · vec`
/// outputs of a row (a warp reads 512 contiguous bytes when `lanes` is 32), and a block's
/// `slots = 256 / lanes` groups of lanes walk different rows, `unroll` rows at a time,
/// accumulating in registers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct ColPlan {
    vec: usize,
    lanes: usize,
    slots: usize,
    unroll: usize,
    /// Blocks of `lanes · vec` outputs.
    col_blocks: usize,
}

impl ColPlan {
    /// The plan for `rows` (the kept dims end with a unit-stride one) read from buffers whose
    /// narrowest element is `elem` bytes wide and whose elements take `per_elem` bytes together.
    fn new(rows: &Rows, elem: usize, per_elem: usize) -> ColPlan {
        let (unit, outer) = rows
            .kept
            .split_last()
            .map_or((1, &[][..]), |(last, outer)| (last.0, outer));
        let mut vec = (16 / elem.max(1)).clamp(1, 8);
        let fits = |v: usize| unit % v == 0 && outer.iter().chain(&rows.red).all(|d| d.1 % v == 0);
        while vec > 1 && !fits(vec) {
            vec /= 2;
        }
        let nv = rows.count / vec;
        let lanes = nv.next_power_of_two().min(WARP as usize);
        let unroll = (COL_BYTES_IN_FLIGHT / (vec * per_elem).max(1)).clamp(1, 8);
        ColPlan {
            vec,
            lanes,
            slots: BLOCK as usize / lanes,
            // A power of two.
            unroll: 1 << unroll.ilog2(),
            col_blocks: nv.div_ceil(lanes),
        }
    }

    /// (parts, chunk): chunks of the `n` rows for the first of two stages, or `None` for one
    /// stage: enough blocks for [`COL_BLOCKS`], each thread reading at least [`COL_MIN_ROWS`]
    /// rows, and every chunk but the last whole groups of `slots · unroll` rows.
    fn split(&self, n: usize) -> Option<(usize, usize)> {
        if self.col_blocks >= COL_BLOCKS / 2 {
            return None;
        }
        let parts = COL_BLOCKS
            .div_ceil(self.col_blocks)
            .min(n / (self.slots * COL_MIN_ROWS));
        if parts <= 1 {
            return None;
        }
        let chunk = n.div_ceil(parts).next_multiple_of(self.slots * self.unroll);
        let parts = n.div_ceil(chunk);
        (parts > 1).then_some((parts, chunk))
    }
}

/// How a prologue operand's `vec` elements at a vector's flat indices are read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Access {
    /// One vector access (contiguous and aligned).
    Vector,
    /// One element for all (broadcast along the vector).
    Same,
    /// An element each.
    Scalar,
}

/// The access of an operand with offset space `dims` over `vec`-aligned runs of `vec` flat
/// indices.
fn access(dims: &[Dim], vec: usize) -> Access {
    let Some((&(size, stride), outer)) = dims.split_last() else {
        return Access::Same;
    };
    if vec == 1 || size % vec != 0 {
        Access::Scalar
    } else if stride == 0 {
        Access::Same
    } else if stride == 1 && outer.iter().all(|d| d.1 % vec == 0) {
        Access::Vector
    } else {
        Access::Scalar
    }
}

/// Loads `names.len()` consecutive elements of `buf` from `index` (aligned to their count) in
/// accesses of at most 16 bytes, declaring `names` in the element's compute type.
fn load_run(s: &mut Vec<Stmt>, buf: &str, elem: CTy, index: Expr, names: &[String]) {
    if names.len() == 1 {
        s.push(let_(&names[0], elem.compute_of(), load(buf, elem, index)));
        return;
    }
    let w = (16 / elem_bytes(elem)).min(names.len());
    for (c, part) in names.chunks(w).enumerate() {
        let at = add(index.clone(), i64c((c * w) as i64));
        s.push(load_vec(buf, elem, at, part.to_vec()));
    }
}

/// Stores `values` to consecutive elements of `buf` from `index` (aligned to their count) in
/// accesses of at most 16 bytes.
fn store_run(s: &mut Vec<Stmt>, buf: &str, elem: CTy, index: Expr, values: Vec<Expr>) {
    if values.len() == 1 {
        s.push(store(buf, elem, index, values[0].clone()));
        return;
    }
    let w = (16 / elem_bytes(elem)).min(values.len());
    for (c, part) in values.chunks(w).enumerate() {
        let at = add(index.clone(), i64c((c * w) as i64));
        s.push(store_vec(buf, elem, at, part.to_vec()));
    }
}

/// The `plan.vec` values (in `acc.ty`) of the input row at `at` (the element offset of the
/// thread's first output in that row): its loads go to `loads`, the prologue's arithmetic to
/// `math`, so that a thread issues the loads of several rows before it needs them.
#[allow(clippy::too_many_arguments)]
fn col_values(
    loads: &mut Vec<Stmt>,
    math: &mut Vec<Stmt>,
    tag: &str,
    at: Expr,
    vec: usize,
    src: (&str, CTy),
    pro: Option<&Prog>,
    ty: CTy,
) -> Result<Vec<Expr>> {
    let names = |op: &str| -> Vec<String> { (0..vec).map(|j| format!("{tag}{op}_{j}")).collect() };
    let Some(p) = pro else {
        let n = names("x");
        load_run(loads, src.0, src.1, at, &n);
        return Ok(n
            .iter()
            .map(|v| {
                if src.1.compute_of() == ty {
                    var(v)
                } else {
                    cast(ty, var(v))
                }
            })
            .collect());
    };
    let xi = format!("{tag}i");
    loads.push(let_(&xi, CTy::I64, at));
    // Per operand, the variable holding each of the vector's elements.
    let mut per_op: Vec<Vec<Expr>> = Vec::new();
    for (o, (name, elem, dims)) in p.ops.iter().flatten().enumerate() {
        let n = names(&format!("a{o}"));
        match access(dims, vec) {
            Access::Vector => {
                load_run(loads, name, *elem, offset(&xi, dims), &n);
                per_op.push(n.iter().map(|v| var(v)).collect());
            }
            Access::Same => {
                loads.push(let_(
                    &n[0],
                    elem.compute_of(),
                    load(name, *elem, offset(&xi, dims)),
                ));
                per_op.push(vec![var(&n[0]); vec]);
            }
            Access::Scalar => {
                for (j, v) in n.iter().enumerate() {
                    let ij = format!("{v}i");
                    loads.push(let_(&ij, CTy::I64, add(var(&xi), i64c(j as i64))));
                    loads.push(let_(
                        v,
                        elem.compute_of(),
                        load(name, *elem, offset(&ij, dims)),
                    ));
                }
                per_op.push(n.iter().map(|v| var(v)).collect());
            }
        }
    }
    (0..vec)
        .map(|j| {
            let args: Vec<Expr> = per_op.iter().map(|a| a[j].clone()).collect();
            p.value_of(math, &format!("{tag}p{j}_"), &args, ty)
        })
        .collect()
}

/// A column-reduction kernel placed by `plan` (see [`ColPlan`]) over `rows` (`count` outputs):
/// stores `fin` of output `o`'s result at `dst[o]` or, with `split` (parts, chunk), the partial
/// of chunk `c` at `dst[c · outputs + o]`. Loads go through the prologue `pro` and stores through
/// the epilogue `epi` (not with `split`).
#[allow(clippy::too_many_arguments)]
fn col_kernel(
    prefix: &str,
    rows: &Rows,
    plan: ColPlan,
    split: Option<(usize, usize)>,
    acc: Acc,
    src: (&str, CTy),
    dst: (&str, CTy),
    fin: &dyn Fn(Expr) -> Expr,
    pro: Option<&Prog>,
    epi: Option<&Prog>,
) -> Result<(Kernel, u32)> {
    let ColPlan {
        vec,
        lanes,
        slots,
        unroll,
        col_blocks,
    } = plan;
    let n = rows.n;
    let outputs = rows.count;
    let nv = (outputs / vec) as i64;
    let (parts, chunk) = split.unwrap_or((1, n));
    let total = col_blocks * parts;
    let a = |j: usize| format!("a{j}");
    let cb = i64c(col_blocks as i64);
    let mut body = vec![
        let_(
            "cv",
            CTy::I64,
            add(
                mul(rem(var("blk"), cb.clone()), i64c(lanes as i64)),
                var("lane"),
            ),
        ),
        let_("act", CTy::Bool, lt(var("cv"), i64c(nv))),
        // Threads past the last vector read it without storing.
        let_(
            "o",
            CTy::I64,
            mul(bin(BinFn::Min, var("cv"), i64c(nv - 1)), i64c(vec as i64)),
        ),
        let_("kb", CTy::I64, mul(div(var("blk"), cb), i64c(chunk as i64))),
        let_(
            "ke",
            CTy::I64,
            select(
                var("act"),
                bin(
                    BinFn::Min,
                    add(var("kb"), i64c(chunk as i64)),
                    i64c(n as i64),
                ),
                var("kb"),
            ),
        ),
        let_("base", CTy::I64, offset("o", &rows.kept)),
    ];
    for j in 0..vec {
        body.extend(acc.init(&a(j)));
    }
    // The rows of this thread: `unroll` at a time (their loads first) while whole groups
    // remain, then the rest of the chunk once, `unroll` at a time as well, rows past its end
    // reading the first one again and not counting it.
    let group = (slots * unroll) as i64;
    body.push(let_(
        "kf",
        CTy::I64,
        add(
            var("kb"),
            mul(div(sub(var("ke"), var("kb")), i64c(group)), i64c(group)),
        ),
    ));
    for tail in [false, true] {
        let k = if tail { "kt" } else { "k" };
        let (mut loads, mut math) = (Vec::new(), Vec::new());
        let mut xs = Vec::new();
        for u in 0..unroll {
            let (ku, valid) = (format!("k{u}"), format!("v{u}"));
            let at = add(var(k), i64c((u * slots) as i64));
            if tail && u > 0 {
                loads.push(let_(&valid, CTy::Bool, lt(at.clone(), var("ke"))));
                loads.push(let_(&ku, CTy::I64, select(var(&valid), at, var(k))));
            } else {
                loads.push(let_(&ku, CTy::I64, at));
            }
            let at = add(var("base"), offset(&ku, &rows.red));
            let tag = format!("u{u}");
            let x = col_values(&mut loads, &mut math, &tag, at, vec, src, pro, acc.ty)?;
            xs.push((tail && u > 0, valid, x));
        }
        for (guarded, valid, x) in xs {
            for (j, v) in x.into_iter().enumerate() {
                let m = acc.merge(&a(j), &[v], "take");
                math.extend(if guarded {
                    vec![if_(var(&valid), m)]
                } else {
                    m
                });
            }
        }
        loads.extend(math);
        if tail {
            body.push(let_(k, CTy::I64, add(var("kf"), var("slot"))));
            body.push(if_(lt(var(k), var("ke")), loads));
        } else {
            body.push(for_(
                k,
                add(var("kb"), var("slot")),
                var("kf"),
                i64c(group),
                loads,
            ));
        }
    }
    // Combine the slots' states through shared memory, halving the slots each step.
    let sh = "sh";
    let at = |j: usize, s: Expr| {
        add(
            mul(add(i64c((j * slots) as i64), s), i64c(lanes as i64)),
            var("lane"),
        )
    };
    for j in 0..vec {
        body.push(store(sh, acc.ty, at(j, var("slot")), var(&a(j))));
    }
    body.push(Stmt::SyncThreads);
    let mut h = slots / 2;
    while h >= 1 {
        let mut then = Vec::new();
        for j in 0..vec {
            let other = load(sh, acc.ty, at(j, add(var("slot"), i64c(h as i64))));
            then.extend(acc.merge(&a(j), &[other], "take"));
            then.push(store(sh, acc.ty, at(j, var("slot")), var(&a(j))));
        }
        body.push(if_(lt(var("slot"), i64c(h as i64)), then));
        body.push(Stmt::SyncThreads);
        h /= 2;
    }
    // The results.
    let mut last = Vec::new();
    let oi = match split {
        Some(_) => add(
            mul(
                div(var("blk"), i64c(col_blocks as i64)),
                i64c(outputs as i64),
            ),
            var("o"),
        ),
        None => var("o"),
    };
    match epi {
        None => {
            let ys = (0..vec).map(|j| fin(acc.result(&a(j)))).collect();
            store_run(&mut last, dst.0, dst.1, oi, ys);
        }
        Some(p) => {
            for j in 0..vec {
                let (r0, oj) = (format!("r{j}"), format!("o{j}"));
                last.push(let_(&r0, acc.ty, fin(acc.result(&a(j)))));
                last.push(let_(&oj, CTy::I64, add(var("o"), i64c(j as i64))));
                let y = p.value(
                    &mut last,
                    &format!("e{j}_"),
                    &oj,
                    Some(var(&r0)),
                    dst.1.compute_of(),
                )?;
                last.push(store(dst.0, dst.1, var(&oj), y));
            }
        }
    }
    body.push(if_(and(eq(var("slot"), i64c(0)), var("act")), last));
    let tid = || special(Special::ThreadIdx);
    let all = vec![
        Stmt::Shared {
            name: sh.into(),
            elem: acc.ty,
            len: BLOCK * vec as u32,
        },
        let_("lane", CTy::I64, rem(tid(), i64c(lanes as i64))),
        let_("slot", CTy::I64, div(tid(), i64c(lanes as i64))),
        for_(
            "blk",
            special(Special::BlockIdx),
            i64c(total as i64),
            special(Special::GridDim),
            body,
        ),
    ];
    let mut params = match pro {
        Some(p) => p.params(),
        None => vec![param(src.0, src.1, false)],
    };
    if let Some(p) = epi {
        params.extend(p.params());
    }
    params.push(param(dst.0, dst.1, true));
    let k = finish(
        prefix,
        Kernel {
            name: String::new(),
            params,
            block: BLOCK,
            smem: 0,
            body: all,
        },
    )?;
    Ok((k, grid_for(total as u64, 1)))
}

/// A column reduction (see [`ColPlan`]) of `rows` with storage types `(x, y)`: one kernel, or
/// partials of chunks of rows into scratch (laid out [parts, outputs], so that both stages read
/// and write neighbouring outputs together) and a second column reduction of the partials.
#[allow(clippy::too_many_arguments)]
fn col_reduce(
    prefix: &str,
    rows: &Rows,
    acc: Acc,
    (xs, ys): (CTy, CTy),
    fin: &dyn Fn(Expr) -> Expr,
    pro: Option<&Prog>,
    epi: Option<&Prog>,
    (src_args, epi_args): (Vec<ArgRef>, Vec<ArgRef>),
) -> Result<StepKernels> {
    // Vectors as wide as 16 bytes of the narrowest buffer read (a bf16 operand of an f32
    // prologue reads 8 elements at a time).
    let narrowest = match pro {
        Some(p) => p.ops.iter().flatten().map(|o| elem_bytes(o.1)).min(),
        None => Some(elem_bytes(xs)),
    };
    let per_elem = match pro {
        Some(p) => p.ops.iter().flatten().map(|o| elem_bytes(o.1)).sum(),
        None => elem_bytes(xs),
    };
    let plan = ColPlan::new(rows, narrowest.unwrap_or(elem_bytes(xs)), per_elem);
    let (n, outputs) = (rows.n, rows.count);
    let Some((parts, chunk)) = plan.split(n) else {
        let k = col_kernel(
            prefix,
            rows,
            plan,
            None,
            acc,
            ("x", xs),
            ("y", ys),
            fin,
            pro,
            epi,
        )?;
        let mut args = src_args;
        args.extend(epi_args);
        args.push(ArgRef::Output);
        return Ok(single(k, args));
    };
    let k1 = col_kernel(
        &format!("{prefix}_partial"),
        rows,
        plan,
        Some((parts, chunk)),
        acc,
        ("x", xs),
        ("part", acc.ty),
        &|e| e,
        pro,
        None,
    )?;
    let second = Rows::new(
        outputs,
        coalesce([(outputs, 1)]),
        coalesce([(parts, outputs)]),
        parts,
    );
    let k2 = col_kernel(
        prefix,
        &second,
        ColPlan::new(&second, elem_bytes(acc.ty), elem_bytes(acc.ty)),
        None,
        acc,
        ("part", acc.ty),
        ("y", ys),
        fin,
        None,
        epi,
    )?;
    Ok(two_stage(
        k1,
        k2,
        src_args,
        epi_args,
        outputs * parts * elem_bytes(acc.ty),
    ))
}

/// The two launches of a two-stage reduction: the partials of `k1` (over the sources) into the
/// scratch, then `k2` from the scratch (and the epilogue's operands) into the output.
fn two_stage(
    k1: (Kernel, u32),
    k2: (Kernel, u32),
    src_args: Vec<ArgRef>,
    epi_args: Vec<ArgRef>,
    scratch_bytes: usize,
) -> StepKernels {
    let mut args1 = src_args;
    args1.push(ArgRef::Scratch);
    let mut args2 = vec![ArgRef::Scratch];
    args2.extend(epi_args);
    args2.push(ArgRef::Output);
    StepKernels {
        launches: vec![
            Launch {
                kernel: k1.0,
                args: args1,
                grid: k1.1,
            },
            Launch {
                kernel: k2.0,
                args: args2,
                grid: k2.1,
            },
        ],
        scratch_bytes,
    }
}

fn arg_reduce(op: &Op, kind: ArgKind, axis: usize, x: &TensorType) -> Result<StepKernels> {
    let dims = x.shape.dims();
    let strides = x.shape.strides();
    let n = dims[axis];
    if n == 0 {
        return Err(empty_error(op, "argmax/argmin", x));
    }
    let kept = coalesce(
        (0..dims.len())
            .filter(|&a| a != axis)
            .map(|a| (dims[a], strides[a])),
    );
    let red = coalesce([(n, strides[axis])]);
    let rows = Rows::new(x.shape.numel() / n, kept, red, n);
    let (prefix, comb) = match kind {
        ArgKind::ArgMax => ("argmax", Comb::ArgMax),
        ArgKind::ArgMin => ("argmin", Comb::ArgMin),
    };
    let acc = Acc::new(comb, acc_ty(x.dtype));
    let k = reduce_kernel(
        prefix,
        &rows,
        choose(&rows),
        acc,
        ("x", CTy::storage(x.dtype)),
        ("y", CTy::I64),
        |e| e,
    )?;
    Ok(single(k, vec![ArgRef::Input(0), ArgRef::Output]))
}

// ---------------------------------------------------------------------------------------------
// Softmax and normalization

/// Max then sum of `exp(x - max)` of the current row into `m` and `s` (every thread of the row
/// ends with both).
fn lse_stats(t: &mut Tpl, x: &dyn Fn() -> Expr, ct: CTy) -> Vec<Stmt> {
    let max = Acc::new(Comb::Max, ct);
    let sum = Acc::new(Comb::Sum, ct);
    let mut body = max.init("m");
    let step = t.step(&max, "m", x());
    body.push(t.kloop(step));
    body.extend(t.reduce(&max, "m"));
    body.extend(sum.init("s"));
    let step = t.step(&sum, "s", un(UnFn::Exp, sub(x(), var("m"))));
    body.push(t.kloop(step));
    body.extend(t.reduce(&sum, "s"));
    body
}

fn softmax(axis: usize, log: bool, x: &TensorType) -> Result<StepKernels> {
    let dims = x.shape.dims();
    let n = dims[axis];
    let outer: usize = dims[..axis].iter().product();
    let inner: usize = dims[axis + 1..].iter().product();
    if inner == 1 {
        let op = if log {
            RowOp::LogSoftmax
        } else {
            RowOp::Softmax
        };
        if let Some(step) = rows::lower(op, x)? {
            return Ok(step);
        }
    }
    let rows = Rows::new(
        outer * inner,
        coalesce([(outer, n * inner), (inner, 1)]),
        coalesce([(n, inner)]),
        n,
    );
    let strat = choose(&rows);
    let e = CTy::storage(x.dtype);
    let ct = real_ty(x.dtype);
    let xv = || load_as("x", e, rows.at(), ct);
    let mut t = Tpl::new(strat);
    let mut body = lse_stats(&mut t, &xv, ct);
    let y = if log {
        body.push(let_("ls", ct, un(UnFn::Log, var("s"))));
        sub(sub(xv(), var("m")), var("ls"))
    } else {
        body.push(let_("inv", ct, div(lit(1.0, ct), var("s"))));
        mul(un(UnFn::Exp, sub(xv(), var("m"))), var("inv"))
    };
    body.push(t.kloop(vec![store("y", e, rows.at(), y)]));
    let prefix = if log { "log_softmax" } else { "softmax" };
    let params = vec![param("x", e, false), param("y", e, true)];
    let k = t.kernel(prefix, params, &rows, body)?;
    Ok(single(k, vec![ArgRef::Input(0), ArgRef::Output]))
}

/// LayerNorm (`centered`) or RMSNorm over the last dim, as the CPU: the mean, then the mean of
/// squared deviations, `rstd = 1 / sqrt(var + eps)`, `y = (x - mean) * rstd * w + b`.
fn norm(x: &TensorType, eps: f64, weight: bool, bias: bool, centered: bool) -> Result<StepKernels> {
    let d = *x
        .shape
        .dims()
        .last()
        .expect("rank >= 1 (checked by inference)");
    let op = if centered {
        RowOp::LayerNorm { eps, weight, bias }
    } else {
        RowOp::RmsNorm { eps, weight }
    };
    if let Some(step) = rows::lower(op, x)? {
        return Ok(step);
    }
    let count = x.shape.numel() / d;
    let rows = Rows::new(count, coalesce([(count, d)]), coalesce([(d, 1)]), d);
    let strat = choose(&rows);
    let e = CTy::storage(x.dtype);
    let ct = real_ty(x.dtype);
    let xv = || load_as("x", e, rows.at(), ct);
    let dn = fc(d as f64, ct);
    let sum = Acc::new(Comb::Sum, ct);
    let mut t = Tpl::new(strat);
    let mut body = Vec::new();
    let centre = |v: Expr| {
        if centered {
            sub(v, var("mean"))
        } else {
            v
        }
    };
    if centered {
        body.extend(sum.init("s"));
        let step = t.step(&sum, "s", xv());
        body.push(t.kloop(step));
        body.extend(t.reduce(&sum, "s"));
        body.push(let_("mean", ct, div(var("s"), dn.clone())));
    }
    body.extend(sum.init("ss"));
    let step = vec![
        let_("c", ct, centre(xv())),
        assign("ss", add(var("ss"), mul(var("c"), var("c")))),
    ];
    body.push(t.kloop(step));
    body.extend(t.reduce(&sum, "ss"));
    body.push(let_(
        "rstd",
        ct,
        un(UnFn::Rsqrt, add(div(var("ss"), dn), fc(eps, ct))),
    ));
    let mut y = mul(centre(xv()), var("rstd"));
    let mut params = vec![param("x", e, false)];
    if weight {
        y = mul(y, load_as("w", e, var("k"), ct));
        params.push(param("w", e, false));
    }
    if bias {
        y = add(y, load_as("b", e, var("k"), ct));
        params.push(param("b", e, false));
    }
    params.push(param("y", e, true));
    body.push(t.kloop(vec![store("y", e, rows.at(), y)]));
    let prefix = if centered { "layer_norm" } else { "rms_norm" };
    let n_in = params.len() - 1;
    let k = t.kernel(prefix, params, &rows, body)?;
    Ok(single(
        k,
        (0..n_in)
            .map(ArgRef::Input)
            .chain([ArgRef::Output])
            .collect(),
    ))
}

// ---------------------------------------------------------------------------------------------
// Cross entropy

/// The rows of logits `[N, C]`.
fn logit_rows(logits: &TensorType) -> Rows {
    let (n, c) = (logits.shape.dims()[0], logits.shape.dims()[1]);
    Rows::new(n, coalesce([(n, c)]), coalesce([(c, 1)]), c)
}

/// Declares, for the current row `o`: `tg` (its target as i64), `ign` (it is ignored) and `valid`
/// (it is a class).
fn target_stmts(te: CTy, ignore: i64, c: usize) -> Vec<Stmt> {
    vec![
        let_("tg", CTy::I64, load_as("tgt", te, var("o"), CTy::I64)),
        let_("ign", CTy::Bool, eq(var("tg"), i64c(ignore))),
        let_(
            "valid",
            CTy::Bool,
            and(
                bin(BinFn::Ge, var("tg"), i64c(0)),
                lt(var("tg"), i64c(c as i64)),
            ),
        ),
    ]
}

/// A one-row kernel over the `N` targets that counts the non-ignored ones into `c` (and, with
/// `losses`, sums the per-row losses of the scratch into `s`), then runs `tail` in the row's
/// leader thread.
fn batch_kernel(
    prefix: &str,
    n: usize,
    te: CTy,
    ignore: i64,
    losses: Option<CTy>,
    outputs: Vec<Param>,
    tail: Vec<Stmt>,
) -> Result<(Kernel, u32)> {
    let rows = Rows::new(1, vec![], vec![(n, 1)], n);
    let mut t = Tpl::new(choose(&rows));
    let count = Acc::new(Comb::Sum, CTy::I64);
    let mut body = count.init("c");
    let mut step = vec![assign(
        "c",
        add(
            var("c"),
            select(
                eq(load_as("tgt", te, var("k"), CTy::I64), i64c(ignore)),
                i64c(0),
                i64c(1),
            ),
        ),
    )];
    if let Some(ct) = losses {
        let sum = Acc::new(Comb::Sum, ct);
        body.extend(sum.init("s"));
        step.extend(t.step(&sum, "s", load("part", ct, var("k"))));
        body.push(t.kloop(step));
        body.extend(t.reduce(&count, "c"));
        body.extend(t.reduce(&sum, "s"));
    } else {
        body.push(t.kloop(step));
        body.extend(t.reduce(&count, "c"));
    }
    let params = losses
        .map(|ct| param("part", ct, false))
        .into_iter()
        .chain([param("tgt", te, false)])
        .chain(outputs)
        .collect();
    body.push(if_(t.leader(), tail));
    t.kernel(prefix, params, &rows, body)
}

fn cross_entropy(
    logits: &TensorType,
    targets: &TensorType,
    reduction: Reduction,
    ignore: i64,
) -> Result<StepKernels> {
    let (n, c) = (logits.shape.dims()[0], logits.shape.dims()[1]);
    let e = CTy::storage(logits.dtype);
    let te = CTy::storage(targets.dtype);
    let ct = real_ty(logits.dtype);
    if n == 0 {
        // Nothing to sum: 0, and the mean over no rows is NaN.
        let v = if reduction == Reduction::Mean {
            nan(ct)
        } else {
            lit(0.0, ct)
        };
        let body = vec![if_(
            eq(global_thread(), i64c(0)),
            vec![store("y", e, i64c(0), v)],
        )];
        let k = finish(
            "cross_entropy_empty",
            Kernel {
                name: String::new(),
                params: vec![param("y", e, true)],
                block: BLOCK,
                smem: 0,
                body,
            },
        )?;
        return Ok(single((k, 1), vec![ArgRef::Output]));
    }
    let rows = logit_rows(logits);
    let mut t = Tpl::new(choose(&rows));
    let xv = || load_as("x", e, rows.at(), ct);
    let mut body = target_stmts(te, ignore, c);
    body.extend(lse_stats(&mut t, &xv, ct));
    body.push(let_("xt", ct, nan(ct)));
    body.push(if_(
        var("valid"),
        vec![assign(
            "xt",
            load_as("x", e, add(var("base"), var("tg")), ct),
        )],
    ));
    let loss = add(sub(var("m"), var("xt")), un(UnFn::Log, var("s")));
    let loss = select(
        var("ign"),
        lit(0.0, ct),
        select(var("valid"), loss, nan(ct)),
    );
    let (dst, dst_elem) = if reduction == Reduction::None {
        ("y", e)
    } else {
        ("part", ct)
    };
    body.push(if_(
        t.leader(),
        vec![store(dst, dst_elem, var("row"), loss)],
    ));
    let params = vec![
        param("x", e, false),
        param("tgt", te, false),
        param(dst, dst_elem, true),
    ];
    let k1 = t.kernel("cross_entropy", params, &rows, body)?;
    if reduction == Reduction::None {
        return Ok(single(
            k1,
            vec![ArgRef::Input(0), ArgRef::Input(1), ArgRef::Output],
        ));
    }
    let total = if reduction == Reduction::Mean {
        div(var("s"), cast(ct, var("c")))
    } else {
        var("s")
    };
    let k2 = batch_kernel(
        "cross_entropy_total",
        n,
        te,
        ignore,
        Some(ct),
        vec![param("y", e, true)],
        vec![store("y", e, i64c(0), total)],
    )?;
    Ok(StepKernels {
        launches: vec![
            Launch {
                kernel: k1.0,
                args: vec![ArgRef::Input(0), ArgRef::Input(1), ArgRef::Scratch],
                grid: k1.1,
            },
            Launch {
                kernel: k2.0,
                args: vec![ArgRef::Scratch, ArgRef::Input(1), ArgRef::Output],
                grid: k2.1,
            },
        ],
        scratch_bytes: n * elem_bytes(ct),
    })
}

fn cross_entropy_grad(
    logits: &TensorType,
    targets: &TensorType,
    reduction: Reduction,
    ignore: i64,
) -> Result<StepKernels> {
    let (n, c) = (logits.shape.dims()[0], logits.shape.dims()[1]);
    let e = CTy::storage(logits.dtype);
    let te = CTy::storage(targets.dtype);
    let ct = real_ty(logits.dtype);
    let mut launches = Vec::new();
    let mut scratch_bytes = 0;
    if reduction == Reduction::Mean {
        // The count of non-ignored targets first, into scratch.
        let k = batch_kernel(
            "cross_entropy_count",
            n,
            te,
            ignore,
            None,
            vec![param("cnt", CTy::I64, true)],
            vec![store("cnt", CTy::I64, i64c(0), var("c"))],
        )?;
        launches.push(Launch {
            kernel: k.0,
            args: vec![ArgRef::Input(1), ArgRef::Scratch],
            grid: k.1,
        });
        scratch_bytes = elem_bytes(CTy::I64);
    }
    let rows = logit_rows(logits);
    let mut t = Tpl::new(choose(&rows));
    let xv = || load_as("x", e, rows.at(), ct);
    let mut body = target_stmts(te, ignore, c);
    let gr = match reduction {
        Reduction::None => load_as("g", e, var("o"), ct),
        Reduction::Sum => load_as("g", e, i64c(0), ct),
        Reduction::Mean => div(
            load_as("g", e, i64c(0), ct),
            cast(ct, load("cnt", CTy::I64, i64c(0))),
        ),
    };
    body.push(let_("gr", ct, gr));
    body.extend(lse_stats(&mut t, &xv, ct));
    body.push(let_("l", ct, un(UnFn::Log, var("s"))));
    let d = vec![
        let_(
            "e",
            ct,
            mul(un(UnFn::Exp, sub(sub(xv(), var("m")), var("l"))), var("gr")),
        ),
        let_(
            "d",
            ct,
            select(eq(var("k"), var("tg")), sub(var("e"), var("gr")), var("e")),
        ),
        store(
            "y",
            e,
            rows.at(),
            select(
                var("ign"),
                lit(0.0, ct),
                select(var("valid"), var("d"), nan(ct)),
            ),
        ),
    ];
    body.push(t.kloop(d));
    let mut params = vec![
        param("x", e, false),
        param("tgt", te, false),
        param("g", e, false),
    ];
    let mut args = vec![ArgRef::Input(0), ArgRef::Input(1), ArgRef::Input(2)];
    if reduction == Reduction::Mean {
        params.push(param("cnt", CTy::I64, false));
        args.push(ArgRef::Scratch);
    }
    params.push(param("y", e, true));
    args.push(ArgRef::Output);
    let k = t.kernel("cross_entropy_grad", params, &rows, body)?;
    launches.push(Launch {
        kernel: k.0,
        args,
        grid: k.1,
    });
    Ok(StepKernels {
        launches,
        scratch_bytes,
    })
}
