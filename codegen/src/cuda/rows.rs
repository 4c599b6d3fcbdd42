//! One-pass row kernels for softmax, log-softmax, LayerNorm and RMSNorm over a contiguous last
//! axis: each row is read once into registers in 16-byte vectors, its statistics are combined
//! from the registers (warp shuffles, then shared memory across the row's warps), and the result
//! is written once in 16-byte vectors. A row costs one read and one write of its bytes, what a
//! copy costs.
//!
//! A row of `d` elements is `nv = d / w` vectors of `w` elements (16 bytes). `t` threads work on a
//! row (a power of two from 32 to 1024, the fewest that give each thread at most [`MAX_VECTORS`]
//! vectors); thread `lane` holds vectors `lane, lane + t, lane + 2t, ...`, so that a warp reads
//! 512 consecutive bytes at a time. Rows of one warp run four to a block; longer rows run one to
//! a block. Rows whose length is not a multiple of `w`, or too long for the registers (more than
//! `1024 · MAX_VECTORS` vectors), take the three-pass kernels of [`super::reduce`].
//!
//! Numerics match those kernels: statistics in f32 (f64 for f64 data), the mean first and the
//! variance from the deviations (two passes over the registers, not `E[x²] − E[x]²`), the maximum
//! subtracted before `exp`. Each thread sums its values in a pairwise tree; the row's threads
//! combine in a fixed order, so every thread of a row holds the same statistics.

use super::ir::{
    add, assign, bin, div, elem_bytes, fc, for_, i32c, i64c, if_, let_, lit, load, load_vec, mul,
    rem, select, special, store, store_vec, sub, un, var, BinFn, CTy, Expr, Kernel, Param, Special,
    Stmt, UnFn,
};
use super::{elementwise, reduce};
use super::{finish, grid_for, ArgRef, Launch, StepKernels};
use crate::Result;
use rustytorch_ops::{DType, FusedKernel, Op, ReduceKind, RowFusion, Shape, TensorType};

/// Vectors a thread holds at most (32 values of bf16/f16, 16 of f32, 8 of f64).
pub const MAX_VECTORS: usize = 4;
/// Bytes per vector access.
const VECTOR_BYTES: usize = 16;
/// Threads per warp.
const WARP: usize = 32;
/// Most threads per row (one block).
const MAX_THREADS: usize = 1024;

/// What a row kernel computes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RowOp {
    /// `exp(x − max) / Σ exp(x − max)`.
    Softmax,
    /// `x − max − log Σ exp(x − max)`.
    LogSoftmax,
    /// `(x − mean) · rstd · w + b`, `w` and `b` optional.
    LayerNorm {
        /// ε added to the variance.
        eps: f64,
        /// Whether a weight is given.
        weight: bool,
        /// Whether a bias is given.
        bias: bool,
    },
    /// `x · rstd · w`, `w` optional.
    RmsNorm {
        /// ε added to the mean square.
        eps: f64,
        /// Whether a weight is given.
        weight: bool,
    },
    /// A float sum, mean, max or min of each row: one result per row.
    Reduce(ReduceKind),
}

/// The thread geometry of rows of `d` elements of `x`'s dtype: (elements per vector, vectors per
/// row, threads per row, vectors per thread), or `None` when the rows take the three-pass kernels.
fn geometry(x: &TensorType, d: usize) -> Option<(usize, usize, usize, usize)> {
    let w = VECTOR_BYTES / elem_bytes(CTy::storage(x.dtype));
    if w < 2 || d == 0 || !d.is_multiple_of(w) {
        return None;
    }
    let nv = d / w;
    let mut t = WARP;
    while t * MAX_VECTORS < nv {
        t *= 2;
    }
    if t > MAX_THREADS {
        return None;
    }
    Some((w, nv, t, nv.div_ceil(t)))
}

/// Whether rows of `d` elements of `x` run as one-pass row kernels.
pub fn eligible(x: &TensorType, d: usize) -> bool {
    x.dtype.is_float() && geometry(x, d).is_some()
}

/// Names and counts while a kernel is built.
struct Row {
    /// Compute type of the statistics.
    ct: CTy,
    w: usize,
    nv: usize,
    t: usize,
    v: usize,
    shared: Vec<Stmt>,
    uid: usize,
}

impl Row {
    /// The name of element `k` of this thread's vector `j`.
    fn x(&self, j: usize, k: usize) -> String {
        format!("x{j}_{k}")
    }

    /// Whether vector `j` of every thread lies in the row (else a guard is needed).
    fn always(&self, j: usize) -> bool {
        (j + 1) * self.t <= self.nv
    }

    /// The vector index of this thread's vector `j` in the row.
    fn vi(&self, j: usize) -> Expr {
        vector_index(j, self.t)
    }

    /// Whether this thread's vector `j` lies in the row.
    fn valid(&self, j: usize) -> Expr {
        bin(BinFn::Lt, self.vi(j), i64c(self.nv as i64))
    }

    /// `s` when vector `j` always lies in the row, else `if (valid) s`.
    fn guarded(&self, j: usize, s: Vec<Stmt>) -> Vec<Stmt> {
        if self.always(j) {
            s
        } else {
            vec![if_(self.valid(j), s)]
        }
    }

    /// `value(x)` for every element this thread holds, `fill` for those past the row's end.
    fn each(&self, value: impl Fn(Expr) -> Expr, fill: Expr) -> Vec<Expr> {
        let mut out = Vec::with_capacity(self.v * self.w);
        for j in 0..self.v {
            for k in 0..self.w {
                let e = value(var(&self.x(j, k)));
                out.push(if self.always(j) {
                    e
                } else {
                    select(self.valid(j), e, fill.clone())
                });
            }
        }
        out
    }

    /// Declares `name` as the combination of `vals` over the row (every thread of the row ends
    /// with it): a pairwise tree in the thread, a butterfly in the warp, then the warps' values in
    /// order through shared memory.
    fn combine(&mut self, name: &str, f: BinFn, vals: Vec<Expr>) -> Vec<Stmt> {
        let mut level = vals;
        while level.len() > 1 {
            let mut next = Vec::with_capacity(level.len().div_ceil(2));
            let mut it = level.into_iter();
            while let Some(a) = it.next() {
                next.push(match it.next() {
                    Some(b) => bin(f, a, b),
                    None => a,
                });
            }
            level = next;
        }
        let mut s = vec![let_(name, self.ct, level.pop().expect("a value"))];
        for off in [16, 8, 4, 2, 1] {
            s.push(assign(
                name,
                bin(f, var(name), bin(BinFn::ShflXor, var(name), i32c(off))),
            ));
        }
        if self.t > WARP {
            let warps = self.t / WARP;
            self.uid += 1;
            let sh = format!("sh{}", self.uid);
            self.shared.push(Stmt::Shared {
                name: sh.clone(),
                elem: self.ct,
                len: warps as u32,
            });
            s.push(if_(
                bin(BinFn::Eq, rem(var("lane"), i64c(WARP as i64)), i64c(0)),
                vec![store(
                    &sh,
                    self.ct,
                    div(var("lane"), i64c(WARP as i64)),
                    var(name),
                )],
            ));
            s.push(Stmt::SyncThreads);
            let all = (0..warps)
                .map(|k| load(&sh, self.ct, i64c(k as i64)))
                .reduce(|a, b| bin(f, a, b))
                .expect("two warps or more");
            s.push(assign(name, all));
        }
        s
    }
}

/// The one-pass kernel of `op` over the rows of `x` (last axis, contiguous), or `None` when the
/// rows are not [`eligible`].
pub fn lower(op: RowOp, x: &TensorType) -> Result<Option<StepKernels>> {
    lower_with(op, x, None, None, x)
}

/// A fused program of a row kernel and the operands it loads.
struct Io<'a> {
    /// The program.
    k: &'a FusedKernel,
    /// Per program input: the operand loaded for it, or `None` for the epilogue's input 0 (the
    /// row op's result, in registers).
    ops: Vec<Option<Operand>>,
    /// The dtype of each program input.
    dtypes: Vec<DType>,
}

/// An operand of a fused program, broadcast to the rows.
struct Operand {
    /// Its parameter name.
    name: String,
    /// Its storage type.
    elem: CTy,
    /// Its offset at the start of a row (an expression of `row`).
    base: Expr,
    /// Whether it varies along the row (loaded in vectors), else one value per row.
    along: bool,
}

impl Operand {
    /// The operand `name` of type `t` broadcast to `rows` (the rows' shape), or `None` when it is
    /// not a float tensor.
    fn new(name: String, t: &TensorType, rows: &Shape) -> Option<Operand> {
        if !t.dtype.is_float() {
            return None;
        }
        let st = t.shape.broadcast_strides(rows);
        let dims = rows.dims();
        let r = dims.len() - 1;
        let lead = reduce::coalesce((0..r).map(|i| (dims[i], st[i])));
        Some(Operand {
            name,
            elem: CTy::storage(t.dtype),
            base: reduce::offset("row", &lead),
            along: st[r] == 1 && dims[r] > 1,
        })
    }

    /// The variable holding element `k` of vector `j` (or the row's value).
    fn value(&self, j: usize, k: usize) -> Expr {
        if self.along {
            var(&format!("{}{j}_{k}", self.name))
        } else {
            var(&format!("{}_r", self.name))
        }
    }

    /// The statements at the start of a row: its base offset, and its value when constant along
    /// the row.
    fn row_stmts(&self) -> Vec<Stmt> {
        let b = format!("{}_b", self.name);
        let mut s = vec![let_(&b, CTy::I64, self.base.clone())];
        if !self.along {
            s.push(let_(
                &format!("{}_r", self.name),
                self.elem.compute_of(),
                load(&self.name, self.elem, var(&b)),
            ));
        }
        s
    }

    /// Loads vector `j` (`w` elements at element `at` of the row) in accesses of 16 bytes or less.
    fn load(&self, j: usize, w: usize, at: &Expr) -> Vec<Stmt> {
        if !self.along {
            return vec![];
        }
        let names: Vec<String> = (0..w).map(|k| format!("{}{j}_{k}", self.name)).collect();
        chunked(w, self.elem, |lo, n| {
            load_vec(
                &self.name,
                self.elem,
                add(var(&format!("{}_b", self.name)), plus(at.clone(), lo)),
                names[lo..lo + n].to_vec(),
            )
        })
    }
}

/// Accesses of `w` consecutive elements of storage type `elem` split into vectors of 16 bytes or
/// less: `access(first, count)` for each.
fn chunked(w: usize, elem: CTy, access: impl Fn(usize, usize) -> Stmt) -> Vec<Stmt> {
    let per = (VECTOR_BYTES / elem_bytes(elem)).clamp(1, w);
    (0..w)
        .step_by(per)
        .map(|lo| access(lo, per.min(w - lo)))
        .collect()
}

/// `e + k` (`e` itself for 0).
fn plus(e: Expr, k: usize) -> Expr {
    if k == 0 {
        e
    } else {
        add(e, i64c(k as i64))
    }
}

/// `v`, held in compute type `from`, rounded to storage type `e` and held in `e`'s compute type
/// (what storing and reloading it does).
fn round_to(v: Expr, from: CTy, e: CTy) -> Expr {
    let ct = e.compute_of();
    let v = if from == ct {
        v
    } else {
        super::ir::cast(ct, v)
    };
    if e == ct {
        v
    } else {
        super::ir::cast(ct, super::ir::cast(e, v))
    }
}

impl Io<'_> {
    /// The program's value at element `k` of vector `j`, `first` standing for input 0 when it is
    /// not loaded; statements go to `s`. The result is held in the program's compute type.
    fn value(
        &self,
        s: &mut Vec<Stmt>,
        tag: &str,
        j: usize,
        k: usize,
        first: Option<Expr>,
    ) -> Result<(Expr, CTy)> {
        let args: Vec<Expr> = self
            .ops
            .iter()
            .map(|o| match o {
                Some(o) => o.value(j, k),
                None => first.clone().unwrap_or_else(|| lit(0.0, CTy::F32)),
            })
            .collect();
        let v =
            elementwise::program_value(s, &format!("{tag}{j}_{k}_"), self.k, &args, &self.dtypes)?;
        Ok((v, elementwise::program_compute(self.k, &self.dtypes)))
    }

    fn loaded(&self) -> impl Iterator<Item = &Operand> {
        self.ops.iter().flatten()
    }
}

/// The one-pass kernel of a fused row op (prologue, core and epilogue; `x` the core's input
/// type), or `None` when its rows are not [`eligible`] or an operand or the result is not a
/// float tensor.
pub fn lower_fused(
    r: &RowFusion,
    inputs: &[&TensorType],
    x: &TensorType,
    out: &TensorType,
) -> Result<Option<StepKernels>> {
    let rank = x.shape.rank();
    let op = match &r.core {
        Op::Softmax { axis } if axis + 1 == rank => RowOp::Softmax,
        Op::LogSoftmax { axis } if axis + 1 == rank => RowOp::LogSoftmax,
        Op::LayerNorm { eps, weight, bias } => RowOp::LayerNorm {
            eps: eps.get(),
            weight: *weight,
            bias: *bias,
        },
        Op::RmsNorm { eps, weight } => RowOp::RmsNorm {
            eps: eps.get(),
            weight: *weight,
        },
        Op::Reduce { kind, axes, .. } if axes.as_slice() == [rank.wrapping_sub(1)] => {
            match reduce_row_op(*kind) {
                Some(op) => op,
                None => return Ok(None),
            }
        }
        _ => return Ok(None),
    };
    let reduces = matches!(op, RowOp::Reduce(_));
    if rank == 0
        || !out.dtype.is_float()
        || (!reduces && out.shape != x.shape)
        || (reduces && out.shape.numel() * x.shape.dims()[rank - 1] != x.shape.numel())
    {
        return Ok(None);
    }
    let (pro, _, epi) = r.split(inputs);
    // A reduction's results are one per row: its epilogue's operands broadcast over the rows
    // with a last dim of 1 (the result's shape, kept dims or not, with a trailing 1).
    let lead = &x.shape.dims()[..rank - 1];
    let kept = Shape::new([lead, &[1]].concat());
    let trailing_one =
        |t: &TensorType| TensorType::new(t.dtype, Shape::new([t.shape.dims(), &[1]].concat()));
    let operands = |tys: &[&TensorType], tag: &str, skip: usize| -> Option<Vec<Option<Operand>>> {
        let mut v: Vec<Option<Operand>> = (0..skip).map(|_| None).collect();
        for (i, t) in tys.iter().enumerate() {
            let name = format!("{tag}{}", i + skip);
            v.push(Some(if reduces && tag == "q" {
                // Operands of a kept-dims result already end in 1; a trailing 1 more is harmless
                // only when the result dropped the dim, so add it then.
                if out.shape.rank() == rank {
                    Operand::new(name, t, &kept)?
                } else {
                    Operand::new(name, &trailing_one(t), &kept)?
                }
            } else {
                Operand::new(name, t, &x.shape)?
            }));
        }
        Some(v)
    };
    let pro_io = match &r.prologue {
        Some(k) => {
            super::ir::check_dtypes(&Op::Fused(Box::new(k.clone())), pro, x)?;
            let Some(ops) = operands(pro, "p", 0) else {
                return Ok(None);
            };
            Some(Io {
                k,
                ops,
                dtypes: pro.iter().map(|t| t.dtype).collect(),
            })
        }
        None => None,
    };
    let epi_io = match &r.epilogue {
        Some(k) => {
            super::ir::check_dtypes(&Op::Fused(Box::new(k.clone())), epi, out)?;
            let Some(ops) = operands(epi, "q", 1) else {
                return Ok(None);
            };
            let mut dtypes = vec![x.dtype];
            dtypes.extend(epi.iter().map(|t| t.dtype));
            Some(Io { k, ops, dtypes })
        }
        None => None,
    };
    lower_with(op, x, pro_io.as_ref(), epi_io.as_ref(), out)
}

/// The one-pass kernel of `op` over the rows of `x`, computed by the prologue `pro` when given
/// (else loaded from `x`), its results mapped through the epilogue `epi` when given and stored as
/// `out`.
fn lower_with(
    op: RowOp,
    x: &TensorType,
    pro: Option<&Io>,
    epi: Option<&Io>,
    out: &TensorType,
) -> Result<Option<StepKernels>> {
    let d = *x
        .shape
        .dims()
        .last()
        .expect("rank >= 1 (checked by inference)");
    let Some((w, nv, t, v)) = geometry(x, d).filter(|_| x.dtype.is_float()) else {
        return Ok(None);
    };
    let count = x.shape.numel() / d;
    let e = CTy::storage(x.dtype);
    let ct = e.compute_of();
    let mut r = Row {
        ct,
        w,
        nv,
        t,
        v,
        shared: Vec::new(),
        uid: 0,
    };
    let row_elem = |j: usize| add(var("base"), mul(vector_index(j, t), i64c(w as i64)));
    let in_row = |j: usize| mul(vector_index(j, t), i64c(w as i64));
    let mut body = vec![let_("base", CTy::I64, mul(var("row"), i64c(d as i64)))];
    for o in pro.iter().chain(&epi).flat_map(|io| io.loaded()) {
        body.extend(o.row_stmts());
    }
    // The row into registers.
    for j in 0..v {
        let names: Vec<String> = (0..w).map(|k| r.x(j, k)).collect();
        if let Some(io) = pro {
            // The prologue's value of each element, rounded to the row's dtype as the unfused
            // graph stores it.
            let mut s = Vec::new();
            for o in io.loaded() {
                s.extend(o.load(j, w, &in_row(j)));
            }
            let mut vals = Vec::with_capacity(w);
            for k in 0..w {
                let (val, c) = io.value(&mut s, "p", j, k, None)?;
                vals.push(round_to(val, c, e));
            }
            if r.always(j) {
                body.extend(s);
                body.extend(names.iter().zip(vals).map(|(n, val)| let_(n, ct, val)));
            } else {
                for n in &names {
                    body.push(let_(n, ct, lit(0.0, ct)));
                }
                s.extend(names.iter().zip(vals).map(|(n, val)| assign(n, val)));
                body.push(if_(r.valid(j), s));
            }
        } else if r.always(j) {
            body.push(load_vec("x", e, row_elem(j), names));
        } else {
            let tmp: Vec<String> = names.iter().map(|n| format!("l{n}")).collect();
            for n in &names {
                body.push(let_(n, ct, lit(0.0, ct)));
            }
            let mut then = vec![load_vec("x", e, row_elem(j), tmp.clone())];
            then.extend(names.iter().zip(&tmp).map(|(n, l)| assign(n, var(l))));
            body.push(if_(r.valid(j), then));
        }
    }
    let dn = fc(d as f64, ct);
    // The statistics, then the value of each element (an expression of `x`).
    let (mut params, value): (Vec<Param>, Box<dyn Fn(Expr, usize, usize) -> Expr>) = match op {
        RowOp::Softmax | RowOp::LogSoftmax => {
            let vals = r.each(|x| x, fc(f64::NEG_INFINITY, ct));
            body.extend(r.combine("m", BinFn::Max, vals));
            if op == RowOp::Softmax {
                // exp(x − m) replaces x in the registers.
                for j in 0..v {
                    for k in 0..w {
                        let n = r.x(j, k);
                        body.push(assign(&n, un(UnFn::Exp, sub(var(&n), var("m")))));
                    }
                }
                let vals = r.each(|x| x, lit(0.0, ct));
                body.extend(r.combine("s", BinFn::Add, vals));
                body.push(let_("inv", ct, div(lit(1.0, ct), var("s"))));
                (vec![], Box::new(|x, _, _| mul(x, var("inv"))))
            } else {
                let vals = r.each(|x| un(UnFn::Exp, sub(x, var("m"))), lit(0.0, ct));
                body.extend(r.combine("s", BinFn::Add, vals));
                body.push(let_("ls", ct, un(UnFn::Log, var("s"))));
                (vec![], Box::new(|x, _, _| sub(sub(x, var("m")), var("ls"))))
            }
        }
        RowOp::LayerNorm { eps, weight, bias } => {
            let vals = r.each(|x| x, lit(0.0, ct));
            body.extend(r.combine("s", BinFn::Add, vals));
            body.push(let_("mean", ct, div(var("s"), dn.clone())));
            let vals = r.each(
                |x| {
                    let c = sub(x, var("mean"));
                    mul(c.clone(), c)
                },
                lit(0.0, ct),
            );
            body.extend(r.combine("ss", BinFn::Add, vals));
            body.push(let_(
                "rstd",
                ct,
                un(UnFn::Rsqrt, add(div(var("ss"), dn), fc(eps, ct))),
            ));
            let mut params = Vec::new();
            if weight {
                params.push(param("w", e));
            }
            if bias {
                params.push(param("b", e));
            }
            (
                params,
                Box::new(move |x, j, k| {
                    let mut y = mul(sub(x, var("mean")), var("rstd"));
                    if weight {
                        y = mul(y, var(&format!("w{j}_{k}")));
                    }
                    if bias {
                        y = add(y, var(&format!("b{j}_{k}")));
                    }
                    y
                }),
            )
        }
        RowOp::RmsNorm { eps, weight } => {
            let vals = r.each(|x| mul(x.clone(), x), lit(0.0, ct));
            body.extend(r.combine("ss", BinFn::Add, vals));
            body.push(let_(
                "rstd",
                ct,
                un(UnFn::Rsqrt, add(div(var("ss"), dn), fc(eps, ct))),
            ));
            let params = if weight { vec![param("w", e)] } else { vec![] };
            (
                params,
                Box::new(move |x, j, k| {
                    let y = mul(x, var("rstd"));
                    if weight {
                        mul(y, var(&format!("w{j}_{k}")))
                    } else {
                        y
                    }
                }),
            )
        }
        RowOp::Reduce(kind) => {
            let (f, fill) = match kind {
                ReduceKind::Max => (BinFn::Max, fc(f64::NEG_INFINITY, ct)),
                ReduceKind::Min => (BinFn::Min, fc(f64::INFINITY, ct)),
                _ => (BinFn::Add, lit(0.0, ct)),
            };
            let vals = r.each(|x| x, fill);
            body.extend(r.combine("s", f, vals));
            (vec![], Box::new(|x, _, _| x))
        }
    };
    let ye = CTy::storage(out.dtype);
    if let RowOp::Reduce(kind) = op {
        // One result per row, stored by the row's first thread (through the epilogue).
        let mut y = var("s");
        if kind == ReduceKind::Mean {
            y = div(y, fc(d as f64, ct));
        }
        let mut s = Vec::new();
        if let Some(io) = epi {
            s.push(let_("c0", ct, round_to(y, ct, e)));
            let (val, cc) = io.value(&mut s, "e", 0, 0, Some(var("c0")))?;
            let yc = ye.compute_of();
            y = if cc == yc {
                val
            } else {
                super::ir::cast(yc, val)
            };
        }
        s.push(store("y", ye, var("row"), y));
        body.push(if_(bin(BinFn::Eq, var("lane"), i64c(0)), s));
    }
    // The results, one vector store each (weights and biases loaded beside them), through the
    // epilogue when there is one.
    let stores = if matches!(op, RowOp::Reduce(_)) { 0 } else { v };
    for j in 0..stores {
        let mut s = Vec::new();
        for p in &params {
            let names = (0..w).map(|k| format!("{}{j}_{k}", p.name)).collect();
            let at = mul(vector_index(j, t), i64c(w as i64));
            s.push(load_vec(&p.name, e, at, names));
        }
        let mut values: Vec<Expr> = (0..w).map(|k| value(var(&r.x(j, k)), j, k)).collect();
        if let Some(io) = epi {
            for o in io.loaded() {
                s.extend(o.load(j, w, &in_row(j)));
            }
            let mut mapped = Vec::with_capacity(w);
            for (k, y) in values.into_iter().enumerate() {
                // The row op's result as the unfused graph stores it, then the epilogue.
                let c = format!("c{j}_{k}");
                s.push(let_(&c, ct, round_to(y, ct, e)));
                let (val, cc) = io.value(&mut s, "e", j, k, Some(var(&c)))?;
                let yc = ye.compute_of();
                mapped.push(if cc == yc {
                    val
                } else {
                    super::ir::cast(yc, val)
                });
            }
            values = mapped;
        }
        s.extend(chunked(w, ye, |lo, n| {
            store_vec("y", ye, plus(row_elem(j), lo), values[lo..lo + n].to_vec())
        }));
        body.extend(r.guarded(j, s));
    }
    // Parameters: the row's operands (x, or the prologue's), the weight and bias, the
    // epilogue's operands, the result.
    let lead: Vec<Param> = match pro {
        Some(io) => io.loaded().map(|o| param(&o.name, o.elem)).collect(),
        None => vec![param("x", e)],
    };
    let tail: Vec<Param> = epi
        .map(|io| io.loaded().map(|o| param(&o.name, o.elem)).collect())
        .unwrap_or_default();
    let n_in = lead.len() + params.len() + tail.len();
    params.splice(0..0, lead);
    params.extend(tail);
    params.push(Param {
        name: "y".into(),
        elem: ye,
        writes: true,
        map: None,
    });
    // Rows on threads: four rows of a warp each per block, or a block per row.
    let per_block = if t == WARP { 4 } else { 1 };
    let tid = || special(Special::ThreadIdx);
    let mut all = r.shared;
    all.push(let_("lane", CTy::I64, rem(tid(), i64c(t as i64))));
    all.push(let_("g", CTy::I64, div(tid(), i64c(t as i64))));
    if t > WARP {
        // The shared partials of one row are read before the next row's are written.
        body.push(Stmt::SyncThreads);
    }
    all.push(for_(
        "row",
        add(
            mul(special(Special::BlockIdx), i64c(per_block as i64)),
            var("g"),
        ),
        i64c(count as i64),
        mul(special(Special::GridDim), i64c(per_block as i64)),
        body,
    ));
    let prefix = match op {
        RowOp::Softmax => "softmax_rows",
        RowOp::LogSoftmax => "log_softmax_rows",
        RowOp::LayerNorm { .. } => "layer_norm_rows",
        RowOp::RmsNorm { .. } => "rms_norm_rows",
        RowOp::Reduce(ReduceKind::Sum) => "reduce_sum_rows",
        RowOp::Reduce(ReduceKind::Mean) => "reduce_mean_rows",
        RowOp::Reduce(ReduceKind::Max) => "reduce_max_rows",
        RowOp::Reduce(_) => "reduce_min_rows",
    };
    let fused_prefix;
    let prefix = if pro.is_some() || epi.is_some() {
        fused_prefix = format!("fused_{prefix}");
        fused_prefix.as_str()
    } else {
        prefix
    };
    let kernel = finish(
        prefix,
        Kernel {
            name: String::new(),
            params,
            block: (t * per_block) as u32,
            smem: 0,
            body: all,
        },
    )?;
    let grid = grid_for(count as u64, per_block as u64);
    let args = (0..n_in)
        .map(ArgRef::Input)
        .chain([ArgRef::Output])
        .collect();
    Ok(Some(StepKernels {
        launches: vec![Launch { kernel, args, grid }],
        scratch_bytes: 0,
    }))
}

/// The row op of a float reduction the one-pass kernels compute (sum, mean, max, min).
fn reduce_row_op(kind: ReduceKind) -> Option<RowOp> {
    matches!(
        kind,
        ReduceKind::Sum | ReduceKind::Mean | ReduceKind::Max | ReduceKind::Min
    )
    .then_some(RowOp::Reduce(kind))
}

/// The one-pass kernel of a float sum, mean, max or min of `x` over its last axis into `out`,
/// or `None` when the rows are not [`eligible`] or the reduction is another kind.
pub fn lower_reduce(
    kind: ReduceKind,
    x: &TensorType,
    out: &TensorType,
) -> Result<Option<StepKernels>> {
    let Some(op) = reduce_row_op(kind) else {
        return Ok(None);
    };
    if !out.dtype.is_float() {
        return Ok(None);
    }
    lower_with(op, x, None, None, out)
}

/// The vector index of a thread's vector `j` in its row, `t` threads per row.
fn vector_index(j: usize, t: usize) -> Expr {
    if j == 0 {
        var("lane")
    } else {
        add(var("lane"), i64c((j * t) as i64))
    }
}

fn param(name: &str, elem: CTy) -> Param {
    Param {
        name: name.into(),
        elem,
        writes: false,
        map: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustytorch_ops::{DType, Shape};

    #[test]
    fn geometry_by_row_length() {
        let t = |d: DType, n: usize| geometry(&TensorType::new(d, Shape::new(vec![2, n])), n);
        assert_eq!(t(DType::BF16, 4096), Some((8, 512, 128, 4)));
        assert_eq!(t(DType::BF16, 768), Some((8, 96, 32, 3)));
        assert_eq!(t(DType::F32, 4096), Some((4, 1024, 256, 4)));
        assert_eq!(t(DType::F64, 10), Some((2, 5, 32, 1)));
        assert_eq!(t(DType::F64, 9), None);
        assert_eq!(t(DType::F32, 4 * 4 * 1024), Some((4, 4096, 1024, 4)));
        assert_eq!(t(DType::F32, 4 * 4 * 1024 + 4), None);
        assert_eq!(t(DType::F16, 6), None);
    }
}
