//! Multi-tensor launches: independent single-kernel steps that a plan runs near each other (the
//! optimizer's per-parameter updates and finiteness guards, which the memory plan's deferred tail
//! schedules level by level) become one launch. The merged kernel gives each member a range of
//! its blocks: a member's body runs unchanged in its range, with `blockIdx.x` counted from the
//! range's start and `gridDim.x` its own grid, over its own (renamed) parameters. A launch costs
//! a few microseconds however little it does; GPT-2 small's training step has about 600 such
//! kernels.
//!
//! The merged launch runs at its first member's step; every other member's step then runs
//! nothing ([`CudaStep::Merged`]). Moving a member earlier is safe when, against every step
//! between the first member and it (members or not), it reads no bytes they write and writes
//! no bytes they read or write — checked on the memory plan's placement, so a value whose
//! bytes the arena reuses is a conflict too.

use super::ir::{CTy, Expr, Kernel, Lit, Param, Special, Stmt};
use super::{finish, ArgRef, CudaStep, Launch, StepKernels};
use crate::{Plan, Source, Storage, ValueId};
use rustytorch_ops::{DType, Op};
use std::collections::BTreeMap;

/// Most members of one merged launch.
const MAX_MEMBERS: usize = 64;
/// Most pointer parameters of one merged launch (2 KiB of the 4 KiB parameter space).
const MAX_PARAMS: usize = 256;
/// Most bytes of static shared memory the members' arrays may add up to.
const MAX_SHARED: usize = 24 * 1024;
/// Most plan steps from a merged launch's first member to its last.
const MAX_SPAN: usize = 512;
/// Most blocks of one merged launch.
const MAX_BLOCKS: u64 = i32::MAX as u64;

/// The bytes a value occupies: an arena range, or a provided buffer of its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Place {
    Arena(usize, usize),
    Buffer(ValueId),
}

impl Place {
    fn of(plan: &Plan, mut v: ValueId) -> Place {
        loop {
            match plan.storage[v] {
                Storage::Alias(u) => v = u,
                Storage::Arena { offset, size } => return Place::Arena(offset, offset + size),
                Storage::Provided => return Place::Buffer(v),
            }
        }
    }

    fn overlaps(self, o: Place) -> bool {
        match (self, o) {
            (Place::Arena(a, b), Place::Arena(c, d)) => a < d && c < b && a < b && c < d,
            (Place::Buffer(a), Place::Buffer(b)) => a == b,
            _ => false,
        }
    }
}

/// What one step reads and writes when it runs.
#[derive(Default)]
struct Touch {
    reads: Vec<Place>,
    writes: Vec<Place>,
}

fn touch(plan: &Plan, steps: &[CudaStep], i: usize) -> Touch {
    let s = &plan.steps[i];
    match &steps[i] {
        // Computed (and written) by an earlier step, or nothing run.
        CudaStep::Alias | CudaStep::Sibling | CudaStep::Merged(_) => Touch::default(),
        // Generated kernels touch what their arguments bind (a folded cast's result too).
        CudaStep::Kernels(k) => {
            let mut t = Touch::default();
            for l in &k.launches {
                for (p, a) in l.kernel.params.iter().zip(&l.args) {
                    let v = match *a {
                        ArgRef::Input(j) => s.inputs[j],
                        ArgRef::Output => s.output,
                        ArgRef::With(j) => s.with[j],
                        ArgRef::Value(v) => v,
                        ArgRef::Scratch | ArgRef::ScratchAt(_) => continue,
                    };
                    let place = Place::of(plan, v);
                    if p.writes {
                        t.writes.push(place);
                    } else {
                        t.reads.push(place);
                    }
                }
            }
            t
        }
        _ => Touch {
            reads: s.inputs.iter().map(|&v| Place::of(plan, v)).collect(),
            writes: std::iter::once(s.output)
                .chain(s.with.iter().copied())
                .map(|v| Place::of(plan, v))
                .collect(),
        },
    }
}

/// The launches of a step that merged kernels can take, launch by launch: generated kernels
/// over the step's operands, result and scratch, with no verbatim source (a two-pass reduction,
/// such as a large parameter's finiteness guard, is two). A member's scratch becomes its own
/// region of the merged step's.
fn launches_of<'a>(step: &'a CudaStep, s: &crate::Step) -> Option<&'a [Launch]> {
    let CudaStep::Kernels(k) = step else {
        return None;
    };
    let ok = |l: &Launch| {
        l.grid > 0
            && !l.kernel.body.iter().any(verbatim)
            && l.args.iter().all(|a| {
                matches!(
                    a,
                    ArgRef::Input(_)
                        | ArgRef::Output
                        | ArgRef::Value(_)
                        | ArgRef::Scratch
                        | ArgRef::ScratchAt(_)
                )
            })
    };
    (!k.launches.is_empty()
        && s.with.is_empty()
        && s.sibling_of.is_none()
        && k.launches.iter().all(ok))
    .then_some(k.launches.as_slice())
}

/// A step's scratch bytes ([`StepKernels::scratch_bytes`]; 0 for other steps).
fn scratch_of(step: &CudaStep) -> usize {
    match step {
        CudaStep::Kernels(k) => k.scratch_bytes,
        _ => 0,
    }
}

/// The alignment of each member's scratch region in a merged step (that of
/// [`ArgRef::ScratchAt`]).
const SCRATCH_ALIGN: usize = 256;

/// The one launch of a step that a merged kernel can take and a cast can fold into: a step of
/// [`launches_of`] with a single launch and no scratch.
fn single<'a>(step: &'a CudaStep, s: &crate::Step) -> Option<&'a Launch> {
    match launches_of(step, s)? {
        [l] if scratch_of(step) == 0
            && !l
                .args
                .iter()
                .any(|a| matches!(a, ArgRef::Scratch | ArgRef::ScratchAt(_))) =>
        {
            Some(l)
        }
        _ => None,
    }
}

fn verbatim(s: &Stmt) -> bool {
    match s {
        Stmt::Verbatim(_) => true,
        Stmt::For { body, .. } => body.iter().any(verbatim),
        Stmt::If { then, els, .. } => then.iter().chain(els).any(verbatim),
        _ => false,
    }
}

fn shared_bytes(body: &[Stmt]) -> usize {
    body.iter()
        .map(|s| match s {
            Stmt::Shared { elem, len, .. } => super::ir::elem_bytes(*elem) * *len as usize,
            Stmt::For { body, .. } => shared_bytes(body),
            Stmt::If { then, els, .. } => shared_bytes(then) + shared_bytes(els),
            _ => 0,
        })
        .sum()
}

/// A merged step being collected: its members have the same number of launches, with the same
/// block size launch by launch; the limits hold for each merged launch.
struct Group {
    first: usize,
    members: Vec<usize>,
    params: Vec<usize>,
    shared: Vec<usize>,
    blocks: Vec<u64>,
    /// Reads and writes of every step from `first` on (members or not).
    reads: Vec<Place>,
    writes: Vec<Place>,
}

impl Group {
    fn new(first: usize) -> Group {
        Group {
            first,
            members: vec![],
            params: vec![],
            shared: vec![],
            blocks: vec![],
            reads: vec![],
            writes: vec![],
        }
    }

    /// Whether step `i` (touching `t`) may run at the group's first step.
    fn admits(&self, t: &Touch) -> bool {
        let hit = |p: &Place, set: &[Place]| set.iter().any(|q| p.overlaps(*q));
        !t.reads.iter().any(|p| hit(p, &self.writes))
            && !t
                .writes
                .iter()
                .any(|p| hit(p, &self.writes) || hit(p, &self.reads))
    }

    fn fits(&self, ls: &[Launch], i: usize) -> bool {
        fn at<T: Copy + Default>(v: &[T], k: usize) -> T {
            v.get(k).copied().unwrap_or_default()
        }
        self.members.len() < MAX_MEMBERS
            && i - self.first < MAX_SPAN
            && ls.iter().enumerate().all(|(k, l)| {
                at(&self.params, k) + l.kernel.params.len() <= MAX_PARAMS
                    && at(&self.shared, k) + shared_bytes(&l.kernel.body) <= MAX_SHARED
                    && at(&self.blocks, k) + l.grid as u64 <= MAX_BLOCKS
            })
    }

    fn add(&mut self, ls: &[Launch], i: usize) {
        self.members.push(i);
        let n = ls.len();
        self.params.resize(n, 0);
        self.shared.resize(n, 0);
        self.blocks.resize(n, 0);
        for (k, l) in ls.iter().enumerate() {
            self.params[k] += l.kernel.params.len();
            self.shared[k] += shared_bytes(&l.kernel.body);
            self.blocks[k] += l.grid as u64;
        }
    }

    fn record(&mut self, t: Touch) {
        self.reads.extend(t.reads);
        self.writes.extend(t.writes);
    }
}

/// Folds casts into their operand's kernel: a cast of an f32 result to f16 or bf16, where that
/// result is a single generated kernel's (and the bytes allow it, as for a merged member), is
/// stored by that kernel as well, rounded from the same f32 value as the cast would round the
/// stored one; the cast's step then runs nothing (an f32 master weight and the 16-bit parameter
/// rounded from it, in one pass). Returns how many casts were folded.
pub fn fold_casts(plan: &Plan, steps: &mut [CudaStep]) -> crate::Result<usize> {
    let mut folded = 0;
    for c in 0..steps.len() {
        let cs = &plan.steps[c];
        let (
            Op::Cast {
                to: DType::F16 | DType::BF16,
            },
            &[v],
        ) = (&cs.op, cs.inputs.as_slice())
        else {
            continue;
        };
        let Source::Step(u) = plan.sources[v] else {
            continue;
        };
        if single(&steps[c], cs).is_none()
            || plan.types[v].dtype != DType::F32
            || plan.types[v].shape.numel() != plan.types[cs.output].shape.numel()
        {
            continue;
        }
        let Some(l) = single(&steps[u], &plan.steps[u]) else {
            continue;
        };
        // The kernel's result parameter: stored with scalar or vector stores only.
        let Some(out) = l
            .kernel
            .params
            .iter()
            .zip(&l.args)
            .find(|(_, a)| **a == ArgRef::Output)
            .map(|(p, _)| p.clone())
        else {
            continue;
        };
        if out.elem != CTy::F32 || !stores_plainly(&l.kernel.body, &out.name) {
            continue;
        }
        // The cast's result is written at step `u`: nothing from there to the cast may read or
        // write its bytes.
        let dst = Place::of(plan, cs.output);
        let clash = (u..c).any(|i| {
            let t = touch(plan, steps, i);
            t.reads.iter().chain(&t.writes).any(|p| p.overlaps(dst))
        });
        if clash {
            continue;
        }
        let elem = CTy::storage(plan.types[cs.output].dtype);
        let mut kernel = l.kernel.clone();
        let name = format!("{}_cast", out.name);
        kernel.params.push(Param {
            name: name.clone(),
            elem,
            writes: true,
            map: None,
        });
        let mut fresh = 0;
        kernel.body = also_store(&kernel.body, &out.name, &name, elem, &mut fresh);
        let mut launch = l.clone();
        launch.kernel = finish(&format!("{}_cast", prefix(&l.kernel.name)), kernel)?;
        launch.args.push(ArgRef::Value(cs.output));
        steps[u] = CudaStep::Kernels(StepKernels {
            launches: vec![launch],
            scratch_bytes: 0,
        });
        steps[c] = CudaStep::Merged(u);
        folded += 1;
    }
    Ok(folded)
}

/// A finished kernel's name without its hash.
fn prefix(name: &str) -> &str {
    name.rsplit_once('_').map_or(name, |(p, _)| p)
}

/// Whether `buf` is written only by `Store`/`StoreVec` (no atomics), so that a second store of
/// each value mirrors it.
fn stores_plainly(body: &[Stmt], buf: &str) -> bool {
    body.iter().all(|s| match s {
        Stmt::AtomicAdd { buf: b, .. } => b != buf,
        Stmt::For { body, .. } => stores_plainly(body, buf),
        Stmt::If { then, els, .. } => stores_plainly(then, buf) && stores_plainly(els, buf),
        Stmt::Verbatim(_) => false,
        _ => true,
    })
}

/// `body` with every store to `from` followed by the same value's store to `to` (of `elem`
/// storage): each value is bound to an f32 variable first, so both stores read it once.
fn also_store(body: &[Stmt], from: &str, to: &str, elem: CTy, fresh: &mut usize) -> Vec<Stmt> {
    let mut out = Vec::with_capacity(body.len());
    let bind = |value: &Expr, out: &mut Vec<Stmt>, fresh: &mut usize| {
        let n = format!("rt_folded{}", *fresh);
        *fresh += 1;
        out.push(Stmt::Let {
            name: n.clone(),
            ty: CTy::F32,
            init: value.clone(),
        });
        Expr::Var(n)
    };
    for s in body {
        match s {
            Stmt::Store {
                buf,
                elem: e,
                index,
                value,
            } if buf == from => {
                let v = bind(value, &mut out, fresh);
                out.push(Stmt::Store {
                    buf: buf.clone(),
                    elem: *e,
                    index: index.clone(),
                    value: v.clone(),
                });
                out.push(Stmt::Store {
                    buf: to.to_string(),
                    elem,
                    index: index.clone(),
                    value: v,
                });
            }
            Stmt::StoreVec {
                buf,
                elem: e,
                index,
                values,
            } if buf == from => {
                let vs: Vec<Expr> = values.iter().map(|x| bind(x, &mut out, fresh)).collect();
                out.push(Stmt::StoreVec {
                    buf: buf.clone(),
                    elem: *e,
                    index: index.clone(),
                    values: vs.clone(),
                });
                out.push(Stmt::StoreVec {
                    buf: to.to_string(),
                    elem,
                    index: index.clone(),
                    values: vs,
                });
            }
            Stmt::For {
                var,
                start,
                end,
                step,
                body,
            } => out.push(Stmt::For {
                var: var.clone(),
                start: start.clone(),
                end: end.clone(),
                step: step.clone(),
                body: also_store(body, from, to, elem, fresh),
            }),
            Stmt::If { cond, then, els } => out.push(Stmt::If {
                cond: cond.clone(),
                then: also_store(then, from, to, elem, fresh),
                els: also_store(els, from, to, elem, fresh),
            }),
            _ => out.push(s.clone()),
        }
    }
    out
}

/// Merges independent generated-kernel steps of `steps` (the CUDA lowering of `plan`, in step
/// order) into multi-tensor launches (steps of several launches with steps of as many, launch by
/// launch); returns how many launches were saved.
pub fn merge_launches(plan: &Plan, steps: &mut [CudaStep]) -> crate::Result<usize> {
    // Open groups by the block sizes of their launches: a merged kernel has one.
    let mut open: BTreeMap<Vec<u32>, Group> = BTreeMap::new();
    let mut done: Vec<Group> = vec![];
    for i in 0..steps.len() {
        let t = touch(plan, steps, i);
        let cand = launches_of(&steps[i], &plan.steps[i]).map(|ls| {
            let blocks: Vec<u32> = ls.iter().map(|l| l.kernel.block).collect();
            (blocks, ls)
        });
        if let Some((blocks, ls)) = &cand {
            let g = open.entry(blocks.clone()).or_insert_with(|| Group::new(i));
            if !(g.admits(&t) && g.fits(ls, i)) {
                done.push(std::mem::replace(g, Group::new(i)));
            }
        }
        // Every open group's window holds this step, member or not.
        for (blocks, g) in open.iter_mut() {
            if let Some((b, ls)) = &cand {
                if b == blocks {
                    g.add(ls, i);
                }
            }
            g.record(Touch {
                reads: t.reads.clone(),
                writes: t.writes.clone(),
            });
        }
        // A group no later step could join any more is closed.
        open.retain(|_, g| {
            let keep = i + 1 - g.first < MAX_SPAN;
            if !keep {
                done.push(std::mem::replace(g, Group::new(i)));
            }
            keep
        });
    }
    done.extend(open.into_values());
    let mut saved = 0;
    for g in done.into_iter().filter(|g| g.members.len() > 1) {
        // Each member's scratch: a region of its own in the merged step's.
        let mut offsets = Vec::with_capacity(g.members.len());
        let mut scratch = 0usize;
        for &i in &g.members {
            offsets.push(scratch);
            scratch += scratch_of(&steps[i]).div_ceil(SCRATCH_ALIGN) * SCRATCH_ALIGN;
        }
        let n = g.params.len();
        let mut merged = Vec::with_capacity(n);
        for k in 0..n {
            let launches: Vec<&Launch> = g
                .members
                .iter()
                .map(|&i| &launches_of(&steps[i], &plan.steps[i]).expect("a member's launches")[k])
                .collect();
            merged.push(merged_launch(plan, &g.members, &launches, &offsets)?);
        }
        saved += (g.members.len() - 1) * n;
        steps[g.members[0]] = CudaStep::Kernels(StepKernels {
            launches: merged,
            scratch_bytes: scratch,
        });
        for &i in &g.members[1..] {
            steps[i] = CudaStep::Merged(g.members[0]);
        }
    }
    Ok(saved)
}

/// One kernel running `launches` (of the steps `members`, whose scratch regions start at
/// `scratch` in the merged step's) in consecutive block ranges.
fn merged_launch(
    plan: &Plan,
    members: &[usize],
    launches: &[&Launch],
    scratch: &[usize],
) -> crate::Result<Launch> {
    let mut params = vec![];
    let mut args = vec![];
    let mut body = vec![];
    let mut start = 0u64;
    for (j, (&i, l)) in members.iter().zip(launches).enumerate() {
        let s = &plan.steps[i];
        let rename: BTreeMap<&str, String> = l
            .kernel
            .params
            .iter()
            .map(|p| (p.name.as_str(), format!("m{j}_{}", p.name)))
            .collect();
        for (p, a) in l.kernel.params.iter().zip(&l.args) {
            params.push(Param {
                name: rename[p.name.as_str()].clone(),
                ..p.clone()
            });
            args.push(match *a {
                ArgRef::Input(k) => ArgRef::Value(s.inputs[k]),
                ArgRef::Value(v) => ArgRef::Value(v),
                ArgRef::Scratch => ArgRef::ScratchAt(scratch[j]),
                ArgRef::ScratchAt(o) => ArgRef::ScratchAt(scratch[j] + o),
                _ => ArgRef::Value(s.output),
            });
        }
        let geo = Geometry {
            start,
            grid: l.grid,
        };
        let member: Vec<Stmt> = l
            .kernel
            .body
            .iter()
            .map(|st| stmt(st, &rename, geo))
            .collect();
        let end = start + l.grid as u64;
        let block = special(Special::BlockIdx);
        let lit = |v: u64| Expr::Lit(Lit::Int(v as i64, super::ir::CTy::U32));
        let below = Expr::Bin(
            super::ir::BinFn::Lt,
            Box::new(block.clone()),
            Box::new(lit(end)),
        );
        let cond = if start == 0 {
            below
        } else {
            Expr::Bin(
                super::ir::BinFn::And,
                Box::new(Expr::Bin(
                    super::ir::BinFn::Ge,
                    Box::new(block),
                    Box::new(lit(start)),
                )),
                Box::new(below),
            )
        };
        body.push(Stmt::If {
            cond,
            then: member,
            els: vec![],
        });
        start = end;
    }
    let kernel = finish(
        "multi",
        Kernel {
            name: String::new(),
            params,
            block: launches[0].kernel.block,
            smem: 0,
            body,
        },
    )?;
    Ok(Launch {
        kernel,
        args,
        grid: start as u32,
    })
}

fn special(s: Special) -> Expr {
    Expr::Special(s)
}

/// A member's block range in the merged grid.
#[derive(Clone, Copy)]
struct Geometry {
    start: u64,
    grid: u32,
}

fn name(n: &str, rename: &BTreeMap<&str, String>) -> String {
    rename.get(n).cloned().unwrap_or_else(|| n.to_string())
}

fn stmt(s: &Stmt, r: &BTreeMap<&str, String>, g: Geometry) -> Stmt {
    let e = |x: &Expr| expr(x, r, g);
    let body = |b: &[Stmt]| b.iter().map(|s| stmt(s, r, g)).collect::<Vec<_>>();
    match s {
        Stmt::Let { name: n, ty, init } => Stmt::Let {
            name: n.clone(),
            ty: *ty,
            init: e(init),
        },
        Stmt::Assign { name: n, value } => Stmt::Assign {
            name: n.clone(),
            value: e(value),
        },
        Stmt::Store {
            buf,
            elem,
            index,
            value,
        } => Stmt::Store {
            buf: name(buf, r),
            elem: *elem,
            index: e(index),
            value: e(value),
        },
        Stmt::LoadVec {
            buf,
            elem,
            index,
            names,
        } => Stmt::LoadVec {
            buf: name(buf, r),
            elem: *elem,
            index: e(index),
            names: names.clone(),
        },
        Stmt::StoreVec {
            buf,
            elem,
            index,
            values,
        } => Stmt::StoreVec {
            buf: name(buf, r),
            elem: *elem,
            index: e(index),
            values: values.iter().map(e).collect(),
        },
        Stmt::AtomicAdd {
            buf,
            elem,
            index,
            value,
        } => Stmt::AtomicAdd {
            buf: name(buf, r),
            elem: *elem,
            index: e(index),
            value: e(value),
        },
        Stmt::For {
            var,
            start,
            end,
            step,
            body: b,
        } => Stmt::For {
            var: var.clone(),
            start: e(start),
            end: e(end),
            step: e(step),
            body: body(b),
        },
        Stmt::If { cond, then, els } => Stmt::If {
            cond: e(cond),
            then: body(then),
            els: body(els),
        },
        Stmt::Shared { .. } | Stmt::SyncThreads | Stmt::Return | Stmt::Verbatim(_) => s.clone(),
    }
}

fn expr(x: &Expr, r: &BTreeMap<&str, String>, g: Geometry) -> Expr {
    let e = |y: &Expr| Box::new(expr(y, r, g));
    match x {
        Expr::Var(n) => Expr::Var(name(n, r)),
        Expr::Lit(_) => x.clone(),
        Expr::Special(Special::BlockIdx) if g.start > 0 => Expr::Bin(
            super::ir::BinFn::Sub,
            Box::new(special(Special::BlockIdx)),
            Box::new(Expr::Lit(Lit::Int(g.start as i64, super::ir::CTy::U32))),
        ),
        Expr::Special(Special::GridDim) => Expr::Lit(Lit::Int(g.grid as i64, super::ir::CTy::U32)),
        Expr::Special(_) => x.clone(),
        Expr::Un(f, a) => Expr::Un(*f, e(a)),
        Expr::Bin(f, a, b) => Expr::Bin(*f, e(a), e(b)),
        Expr::Select(c, a, b) => Expr::Select(e(c), e(a), e(b)),
        Expr::Cast(t, a) => Expr::Cast(*t, e(a)),
        Expr::Load { buf, elem, index } => Expr::Load {
            buf: name(buf, r),
            elem: *elem,
            index: e(index),
        },
    }
}

/// Most guards one gather kernel reads (its pointer parameters stay under 4 KiB).
pub const GATHER_MAX: usize = 256;

/// A kernel copying `n` bool scalars (one pointer parameter each, `g0`…) into consecutive bytes
/// of `out`, so that a run's finiteness guards come back in one copy instead of one each.
pub fn gather_guards(n: usize) -> crate::Result<Kernel> {
    if n == 0 || n > GATHER_MAX {
        return Err(crate::CodegenError::Invalid(format!(
            "gather of {n} guards (1 to {GATHER_MAX})"
        )));
    }
    let mut params: Vec<Param> = (0..n)
        .map(|i| Param {
            name: format!("g{i}"),
            elem: CTy::Bool,
            writes: false,
            map: None,
        })
        .collect();
    params.push(Param {
        name: "out".into(),
        elem: CTy::Bool,
        writes: true,
        map: None,
    });
    let stores = (0..n)
        .map(|i| Stmt::Store {
            buf: "out".into(),
            elem: CTy::Bool,
            index: super::ir::i64c(i as i64),
            value: Expr::Load {
                buf: format!("g{i}"),
                elem: CTy::Bool,
                index: Box::new(super::ir::i64c(0)),
            },
        })
        .collect();
    let first = Expr::Bin(
        super::ir::BinFn::Eq,
        Box::new(special(Special::ThreadIdx)),
        Box::new(Expr::Lit(Lit::Int(0, CTy::U32))),
    );
    finish(
        "gather_guards",
        Kernel {
            name: String::new(),
            params,
            block: 32,
            smem: 0,
            body: vec![Stmt::If {
                cond: first,
                then: stores,
                els: vec![],
            }],
        },
    )
}
