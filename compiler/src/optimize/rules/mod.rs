//! Rewrite rules as data: one named rule a line, grouped by theme in [`algebra`], [`layout`] and
//! [`recognize`], each with a declarative test `input => expected` (`tests/rules.rs`).
//!
//! A rule is a left-hand s-expression pattern over op text (see [`super::lang`]) and a right side
//! that is either another pattern (with an optional condition over the analysis) or a small
//! builder that reads what matched through a [`Ctx`] — the matched attributes of wildcard nodes
//! (`reduce_max*`), types, constant values — and adds the replacement. Every node a rule adds is
//! type-checked with the ops crate's inference first.
//!
//! Policy (cranelift's mid-end): the right side is never worse than the left; no blanket
//! commutativity or associativity (explicit variants instead, and constants are moved to the
//! right of `add`/`mul` so that one spelling of each pattern suffices).

pub mod algebra;
pub mod layout;
pub mod recognize;

use super::analysis::{TensorAnalysis, EG};
use super::lang::TNode;
use egg::{
    Applier, ENodeOrVar, Id, Pattern, PatternAst, RecExpr, Rewrite, Runner, Subst, Symbol, Var,
};
use rustytorch_ops::{infer, Op, TensorType};
use std::sync::{Arc, OnceLock};

/// A rewrite over the optimizer's e-graph.
pub type Rw = Rewrite<TNode, TensorAnalysis>;

type BuildFn = dyn Fn(&mut Ctx<'_>) -> Option<Id> + Send + Sync;

/// Every rule, in the order algebra, layout, recognition (built once).
pub fn all_rules() -> &'static [Rw] {
    static RULES: OnceLock<Vec<Rw>> = OnceLock::new();
    RULES.get_or_init(|| {
        let mut r = algebra::rules();
        r.extend(layout::rules());
        r.extend(recognize::rules());
        r
    })
}

/// What a rule's right side sees of a match.
pub struct Ctx<'a> {
    /// The e-graph (rules add their replacement to it).
    pub eg: &'a mut EG,
    subst: &'a Subst,
    lhs: &'a PatternAst<TNode>,
    /// Per left-side pattern node: the op that matched (None for variables).
    ops: Vec<Option<Op>>,
    /// Per left-side pattern node: the class it matched.
    classes: Vec<Id>,
    root: Id,
}

fn var(name: &str) -> Var {
    name.parse()
        .unwrap_or_else(|_| panic!("`{name}` is not a pattern variable"))
}

impl Ctx<'_> {
    /// The class bound to a pattern variable (`"?x"`).
    pub fn id(&self, v: &str) -> Id {
        let id = self
            .subst
            .get(var(v))
            .unwrap_or_else(|| panic!("rule reads unbound variable {v}"));
        self.eg.find(*id)
    }

    /// The type of a variable's class.
    pub fn ty(&self, v: &str) -> Option<&TensorType> {
        self.eg[self.id(v)].data.ty.as_ref()
    }

    /// The rank of a variable's class (0 if unknown).
    pub fn rank(&self, v: &str) -> usize {
        self.ty(v).map_or(0, |t| t.shape.rank())
    }

    /// The type of the matched (root) class.
    pub fn root_ty(&self) -> Option<&TensorType> {
        self.eg[self.root].data.ty.as_ref()
    }

    /// The value of a variable bound to a uniform constant.
    pub fn konst(&self, v: &str) -> Option<f64> {
        self.eg[self.id(v)].data.konst
    }

    /// The value of a variable bound to a rank-0 constant.
    pub fn scalar(&self, v: &str) -> Option<f64> {
        match self.ty(v) {
            Some(t) if t.shape.rank() == 0 => self.konst(v),
            _ => None,
        }
    }

    /// Whether a variable is a rank-0 constant within `rtol` (relative) of `target`.
    pub fn scalar_near(&self, v: &str, target: f64, rtol: f64) -> bool {
        self.scalar(v)
            .is_some_and(|x| (x - target).abs() <= rtol * target.abs().max(1e-30))
    }

    /// The matched op of the root.
    pub fn top(&self) -> &Op {
        self.ops
            .last()
            .and_then(|o| o.as_ref())
            .expect("a rule's left side is an op")
    }

    /// The matched ops of every left-side node with this op name, innermost first (the pattern's
    /// post-order: operands before their users; the root is last).
    pub fn ops(&self, name: &str) -> Vec<&Op> {
        self.ops
            .iter()
            .flatten()
            .filter(|o| o.name() == name)
            .collect()
    }

    /// The first matched op with this name.
    pub fn op(&self, name: &str) -> Option<&Op> {
        self.ops.iter().flatten().find(|o| o.name() == name)
    }

    /// The type `op(children)` would have, if the ops crate's inference accepts it.
    pub fn infer(&self, op: &Op, children: &[Id]) -> Option<TensorType> {
        let mut tys = Vec::with_capacity(children.len());
        for &c in children {
            tys.push(self.eg[c].data.ty.as_ref()?);
        }
        infer(op, &tys).ok()
    }

    /// Adds `op(children)` if the ops crate's inference accepts it.
    pub fn add(&mut self, op: Op, children: &[Id]) -> Option<Id> {
        self.infer(&op, children)?;
        Some(self.eg.add(TNode::new(op, children.to_vec())))
    }

    /// Adds a fused op and records the intermediate values of the match (every class a non-root,
    /// non-variable pattern node matched) as absorbed by it, for the extractor's check that a
    /// fusion never recomputes a value that is also used elsewhere.
    pub fn fuse(&mut self, op: Op, children: &[Id]) -> Option<Id> {
        let id = self.add(op.clone(), children)?;
        let last = self.lhs.as_ref().len() - 1;
        let absorbed: Vec<Id> = self
            .lhs
            .as_ref()
            .iter()
            .enumerate()
            .filter(|(i, n)| *i != last && matches!(n, ENodeOrVar::ENode(_)))
            .map(|(i, _)| self.classes[i])
            .collect();
        let node = TNode::new(op, children.iter().map(|&c| self.eg.find(c)).collect());
        self.eg.analysis.fusions.push((node, absorbed));
        Some(id)
    }

    /// Adds the instantiation of a right-side pattern.
    fn instantiate(&mut self, rhs: &PatternAst<TNode>) -> Option<Id> {
        let mut ids: Vec<Id> = Vec::with_capacity(rhs.as_ref().len());
        for n in rhs.as_ref() {
            let id = match n {
                ENodeOrVar::Var(v) => self.eg.find(*self.subst.get(*v)?),
                ENodeOrVar::ENode(t) => {
                    let ch: Vec<Id> = t.children.iter().map(|c| ids[usize::from(*c)]).collect();
                    self.add(t.op.clone(), &ch)?
                }
            };
            ids.push(id);
        }
        ids.last().copied()
    }
}

/// Finds the e-nodes a match used: for each pattern node, the op and class it matched.
fn embed(
    eg: &EG,
    ast: &[ENodeOrVar<TNode>],
    i: usize,
    class: Id,
    subst: &Subst,
    ops: &mut [Option<Op>],
    classes: &mut [Id],
) -> bool {
    let class = eg.find(class);
    classes[i] = class;
    match &ast[i] {
        ENodeOrVar::Var(v) => subst.get(*v).is_some_and(|&b| eg.find(b) == class),
        ENodeOrVar::ENode(p) => {
            for n in &eg[class].nodes {
                if egg::Language::matches(p, n)
                    && p.children
                        .iter()
                        .zip(&n.children)
                        .all(|(&pc, &nc)| embed(eg, ast, usize::from(pc), nc, subst, ops, classes))
                {
                    ops[i] = Some(n.op.clone());
                    return true;
                }
            }
            false
        }
    }
}

/// The left side of a rule: a pattern matched by backtracking over the e-graph (egg's compiled
/// matcher looks ground subterms up by hash, which cannot match wildcard nodes).
struct PatSearcher {
    ast: PatternAst<TNode>,
    vars: Vec<Var>,
    /// Variables that must be bound to uniform constants (checked while searching, so that the
    /// common non-matches of rules such as `x * 1` cost nothing at apply time).
    consts: Vec<Var>,
}

impl PatSearcher {
    /// Matches the pairs on `todo` (pattern node, class) under `binds`, pushing each complete
    /// substitution to `out` (at most `limit`).
    fn run(
        &self,
        eg: &EG,
        todo: &mut Vec<(usize, Id)>,
        binds: &mut Vec<(Var, Id)>,
        out: &mut Vec<Subst>,
        limit: usize,
    ) {
        if out.len() >= limit {
            return;
        }
        let Some((i, class)) = todo.pop() else {
            for v in &self.consts {
                if binds
                    .iter()
                    .find(|(b, _)| b == v)
                    .is_none_or(|(_, id)| eg[*id].data.konst.is_none())
                {
                    return;
                }
            }
            let mut s = Subst::default();
            for &(v, id) in binds.iter() {
                s.insert(v, id);
            }
            out.push(s);
            return;
        };
        let class = eg.find(class);
        match &self.ast.as_ref()[i] {
            ENodeOrVar::Var(v) => match binds.iter().find(|(b, _)| b == v) {
                Some(&(_, id)) => {
                    if id == class {
                        self.run(eg, todo, binds, out, limit);
                    }
                }
                None => {
                    binds.push((*v, class));
                    self.run(eg, todo, binds, out, limit);
                    binds.pop();
                }
            },
            ENodeOrVar::ENode(p) => {
                for n in &eg[class].nodes {
                    if !egg::Language::matches(p, n) {
                        continue;
                    }
                    let depth = todo.len();
                    for (&pc, &nc) in p.children.iter().zip(&n.children).rev() {
                        todo.push((usize::from(pc), nc));
                    }
                    self.run(eg, todo, binds, out, limit);
                    todo.truncate(depth);
                    if out.len() >= limit {
                        break;
                    }
                }
            }
        }
        todo.push((i, class));
    }
}

impl PatSearcher {
    /// The matches rooted at `eclass`, reusing the caller's buffers.
    fn search_class<'s>(
        &'s self,
        eg: &EG,
        eclass: Id,
        limit: usize,
        todo: &mut Vec<(usize, Id)>,
        binds: &mut Vec<(Var, Id)>,
    ) -> Option<egg::SearchMatches<'s, TNode>> {
        let mut out = Vec::new();
        todo.clear();
        binds.clear();
        todo.push((self.ast.as_ref().len() - 1, eclass));
        self.run(eg, todo, binds, &mut out, limit);
        out.dedup();
        (!out.is_empty()).then(|| egg::SearchMatches {
            eclass,
            substs: out,
            ast: Some(std::borrow::Cow::Borrowed(&self.ast)),
        })
    }
}

impl egg::Searcher<TNode, TensorAnalysis> for PatSearcher {
    fn search_eclass_with_limit(
        &self,
        egraph: &EG,
        eclass: Id,
        limit: usize,
    ) -> Option<egg::SearchMatches<'_, TNode>> {
        self.search_class(egraph, eclass, limit, &mut Vec::new(), &mut Vec::new())
    }

    fn search_with_limit(
        &self,
        egraph: &EG,
        mut limit: usize,
    ) -> Vec<egg::SearchMatches<'_, TNode>> {
        let ENodeOrVar::ENode(top) = &self.ast.as_ref()[self.ast.as_ref().len() - 1] else {
            return Vec::new();
        };
        let mut ms = Vec::new();
        let Some(classes) = egraph.classes_for_op(&egg::Language::discriminant(top)) else {
            return ms;
        };
        let (mut todo, mut binds) = (Vec::new(), Vec::new());
        for c in classes {
            if limit == 0 {
                break;
            }
            if let Some(m) = self.search_class(egraph, c, limit, &mut todo, &mut binds) {
                limit -= m.substs.len();
                ms.push(m);
            }
        }
        ms
    }

    fn get_pattern_ast(&self) -> Option<&PatternAst<TNode>> {
        Some(&self.ast)
    }

    fn vars(&self) -> Vec<Var> {
        self.vars.clone()
    }
}

struct RuleApplier {
    lhs: PatternAst<TNode>,
    build: Arc<BuildFn>,
}

impl Applier<TNode, TensorAnalysis> for RuleApplier {
    fn apply_one(
        &self,
        eg: &mut EG,
        eclass: Id,
        subst: &Subst,
        _searcher_ast: Option<&PatternAst<TNode>>,
        rule_name: Symbol,
    ) -> Vec<Id> {
        let n = self.lhs.as_ref().len();
        let mut ops = vec![None; n];
        let mut classes = vec![eclass; n];
        if !embed(
            eg,
            self.lhs.as_ref(),
            n - 1,
            eclass,
            subst,
            &mut ops,
            &mut classes,
        ) {
            return vec![];
        }
        let root = eg.find(eclass);
        let mut cx = Ctx {
            eg,
            subst,
            lhs: &self.lhs,
            ops,
            classes,
            root,
        };
        let Some(new) = (self.build)(&mut cx) else {
            return vec![];
        };
        let (a, b) = (&eg[root].data.ty, &eg[new].data.ty);
        if a != b {
            let msg = format!(
                "rule {rule_name} rewrote a value of type {} into one of type {}",
                a.as_ref().map_or("?".into(), |t| t.to_string()),
                b.as_ref().map_or("?".into(), |t| t.to_string()),
            );
            eg.analysis.conflicts.push(msg);
            return vec![];
        }
        if eg.union(root, new) {
            vec![root]
        } else {
            vec![]
        }
    }
}

fn pattern(name: &str, text: &str) -> Pattern<TNode> {
    text.parse()
        .unwrap_or_else(|e| panic!("rule {name}: bad pattern `{text}`: {e}"))
}

/// A rule with a builder right side.
pub fn build(
    name: impl Into<String>,
    lhs: &str,
    f: impl Fn(&mut Ctx<'_>) -> Option<Id> + Send + Sync + 'static,
) -> Rw {
    build_with(name, lhs, &[], f)
}

/// A rule with a builder right side that only matches where the variables `consts` are bound
/// to uniform constants.
pub fn build_with(
    name: impl Into<String>,
    lhs: &str,
    consts: &[&str],
    f: impl Fn(&mut Ctx<'_>) -> Option<Id> + Send + Sync + 'static,
) -> Rw {
    let name = name.into();
    let p = pattern(&name, lhs);
    if matches!(p.ast.as_ref().last(), Some(ENodeOrVar::Var(_)) | None) {
        panic!("rule {name}: the left side must be an op");
    }
    let applier = RuleApplier {
        lhs: p.ast.clone(),
        build: Arc::new(f),
    };
    let searcher = PatSearcher {
        vars: p.vars(),
        consts: consts.iter().map(|v| var(v)).collect(),
        ast: p.ast,
    };
    Rewrite::new(name.clone(), searcher, applier).unwrap_or_else(|e| panic!("rule {name}: {e}"))
}

/// A rule `lhs => rhs` applied where `cond` holds.
pub fn rule_if(
    name: impl Into<String>,
    lhs: &str,
    rhs: &str,
    cond: impl Fn(&Ctx<'_>) -> bool + Send + Sync + 'static,
) -> Rw {
    rule_if_const(name, lhs, &[], rhs, cond)
}

/// [`rule_if`] matching only where the variables `consts` are bound to uniform constants.
pub fn rule_if_const(
    name: impl Into<String>,
    lhs: &str,
    consts: &[&str],
    rhs: &str,
    cond: impl Fn(&Ctx<'_>) -> bool + Send + Sync + 'static,
) -> Rw {
    let name = name.into();
    let rhs: RecExpr<ENodeOrVar<TNode>> = pattern(&name, rhs).ast;
    build_with(name, lhs, consts, move |cx| {
        if cond(cx) {
            cx.instantiate(&rhs)
        } else {
            None
        }
    })
}

/// An unconditional rule `lhs => rhs`.
pub fn rule(name: impl Into<String>, lhs: &str, rhs: &str) -> Rw {
    rule_if(name, lhs, rhs, |_| true)
}

/// The reduction axis of a matched `reduce_*` that reduces exactly the last axis of a rank-`rank`
/// input with `keep_dims`.
pub fn last_axis_keep(op: &Op, rank: usize) -> Option<usize> {
    match op {
        Op::Reduce {
            axes,
            keep_dims: true,
            ..
        } if rank > 0 && axes.as_slice() == [rank - 1] => Some(rank - 1),
        _ => None,
    }
}

/// The single axis of a matched `reduce_*` with `keep_dims` (any axis).
pub fn single_axis_keep(op: &Op) -> Option<usize> {
    match op {
        Op::Reduce {
            axes,
            keep_dims: true,
            ..
        } if axes.len() == 1 => Some(axes[0]),
        _ => None,
    }
}

/// Runs `rules` to saturation on the e-graph of the expression `input` and says whether
/// `expected` ended up in the same class (the declarative rule tests). Errors on unparsable text,
/// on a rule that merged values of different types, and when the run did not saturate.
pub fn rewrites_to(rules: &[Rw], input: &str, expected: &str) -> Result<bool, String> {
    rewrites_to_with(TensorAnalysis::default(), rules, input, expected)
}

/// [`rewrites_to`] with a prepared analysis (to declare causal-mask constants).
pub fn rewrites_to_with(
    analysis: TensorAnalysis,
    rules: &[Rw],
    input: &str,
    expected: &str,
) -> Result<bool, String> {
    let input: RecExpr<TNode> = input.parse().map_err(|e| format!("input: {e}"))?;
    let expected: RecExpr<TNode> = expected.parse().map_err(|e| format!("expected: {e}"))?;
    let mut eg = EG::new(analysis);
    let root = eg.add_expr(&input);
    if eg[root].data.ty.is_none() {
        return Err("the input does not type-check".into());
    }
    let runner = Runner::default()
        .with_egraph(eg)
        .with_iter_limit(30)
        .with_node_limit(10_000)
        .with_scheduler(egg::SimpleScheduler)
        .run(rules);
    if !matches!(runner.stop_reason, Some(egg::StopReason::Saturated)) {
        return Err(format!("did not saturate: {:?}", runner.stop_reason));
    }
    let eg = runner.egraph;
    if let Some(c) = eg.analysis.conflicts.first() {
        return Err(c.clone());
    }
    Ok(eg.lookup_expr(&expected) == Some(eg.find(root)))
}

/// The float unary ops that constant folding covers and that a broadcast is pushed past.
pub(crate) const FLOAT_UNARY: &[&str] = &[
    "neg",
    "abs",
    "exp",
    "log",
    "sqrt",
    "rsqrt",
    "reciprocal",
    "sin",
    "cos",
    "tanh",
    "sigmoid",
    "relu",
    "gelu",
    "gelu_tanh",
    "silu",
    "erf",
];

/// The arithmetic binary ops that constant folding covers and that a broadcast is pushed past.
pub(crate) const ARITH_BINARY: &[&str] = &["add", "sub", "mul", "div", "pow", "maximum", "minimum"];
