//! The e-graph optimizer: [`optimize`] turns a [`Graph`] into an e-graph over the [`Op`] language
//! ([`lang`]), with each class's type from the ops crate's inference ([`analysis`]), saturates it
//! with the rules of [`rules`] under node, iteration and time limits, and extracts the cheapest
//! graph under the cost model of [`extract`] (a DAG cost, with fusions that would recompute a
//! value used elsewhere refused). The result has the same inputs, parameters, constants, outputs,
//! updates and guards as the input.

pub mod analysis;
pub mod extract;
pub mod lang;
pub mod rules;

pub use extract::CostModel;

use crate::graph::{Graph, InputDef, NodeId, ParamDef};
use crate::{CompileError, Result};
use analysis::{TensorAnalysis, EG};
use egg::{Id, Runner, StopReason};
use lang::TNode;
use rustytorch_ops::{DType, Op, TensorType};
use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

/// Limits and cost model of [`optimize`].
#[derive(Clone, Debug)]
pub struct OptimizeConfig {
    /// Stop growing the e-graph past this many e-nodes (checked between iterations).
    pub node_limit: usize,
    /// At most this many rule iterations.
    pub iter_limit: usize,
    /// Stop saturating after this long.
    pub time_limit: Duration,
    /// Prices ops for extraction.
    pub cost: CostModel,
    /// Rules left out of the run: a rule is skipped when its name starts with one of these
    /// (`"matmul-dgelu-tanh"` skips both orders of that recognition); for measuring what a rule
    /// buys. Empty by default.
    pub disabled_rules: Vec<String>,
}

impl Default for OptimizeConfig {
    fn default() -> Self {
        OptimizeConfig {
            node_limit: 100_000,
            iter_limit: 30,
            time_limit: Duration::from_secs(1),
            cost: CostModel::default(),
            disabled_rules: vec![],
        }
    }
}

/// What [`optimize`] did.
#[derive(Clone, Debug)]
pub struct OptimizeReport {
    /// Why saturation stopped (`Saturated` when every rule was exhausted).
    pub stop_reason: StopReason,
    /// Rule iterations run.
    pub iterations: usize,
    /// E-nodes at the end.
    pub egraph_nodes: usize,
    /// E-classes at the end.
    pub egraph_classes: usize,
    /// Time building the e-graph and saturating it.
    pub saturation_time: Duration,
    /// Time extracting and building the result graph.
    pub extraction_time: Duration,
    /// Cost of the input graph's live nodes under the cost model (seconds).
    pub cost_before: f64,
    /// Cost of the result (seconds).
    pub cost_after: f64,
    /// Extraction rounds.
    pub extraction_rounds: usize,
    /// Fused nodes the extractor refused because they would recompute a shared value.
    pub refused_fusions: usize,
    /// Per rule, the number of applications that changed the e-graph (rules that never fired
    /// are left out), sorted by name.
    pub applied: Vec<(String, usize)>,
}

/// Whether constant `t` is a causal mask: bool of rank >= 2, true exactly where column <= row in
/// every trailing `[rows, cols]` block (with `keep == false`, exactly where column > row).
fn is_causal_constant(t: &rustytorch_ops::HostTensor, keep: bool) -> bool {
    let dims = t.dims();
    if t.dtype() != DType::Bool || dims.len() < 2 {
        return false;
    }
    let (rows, cols) = (dims[dims.len() - 2], dims[dims.len() - 1]);
    let v = t.to_f64_vec();
    v.iter().enumerate().all(|(i, &x)| {
        let (r, c) = ((i / cols) % rows.max(1), i % cols);
        (x != 0.0) == ((c <= r) == keep)
    })
}

/// Optimizes a graph with the e-graph rules and returns the result with a report.
pub fn optimize(graph: &Graph, cfg: &OptimizeConfig) -> Result<(Graph, OptimizeReport)> {
    let t0 = Instant::now();
    let err = |m: String| CompileError::Optimize(m);

    // Graph -> e-graph.
    let analysis = TensorAnalysis {
        causal_constants: graph
            .constants
            .iter()
            .enumerate()
            .filter(|(_, c)| is_causal_constant(c, true))
            .map(|(i, _)| i as u32)
            .collect(),
        causal_drop_constants: graph
            .constants
            .iter()
            .enumerate()
            .filter(|(_, c)| is_causal_constant(c, false))
            .map(|(i, _)| i as u32)
            .collect(),
        ..Default::default()
    };
    let mut eg = EG::new(analysis);
    let order = graph.live_order();
    let mut class_of: HashMap<NodeId, Id> = HashMap::with_capacity(order.len());
    let mut original: Vec<TNode> = Vec::with_capacity(order.len());
    let mut cost_before = 0.0;
    for &n in &order {
        let node = graph.node(n)?;
        let children: Vec<Id> = node.inputs.iter().map(|i| class_of[i]).collect();
        let tys: Vec<&TensorType> = node.inputs.iter().map(|&i| graph.ty(i)).collect();
        cost_before += cfg.cost.op_cost(&node.op, &node.ty, &tys);
        let tn = TNode::new(node.op.clone(), children);
        let id = eg.add(tn.clone());
        if eg[id].data.ty.as_ref() != Some(&node.ty) {
            return Err(err(format!(
                "node %{} ({}) has type {} but its op infers {:?}",
                n.index(),
                node.op.name(),
                node.ty,
                eg[id].data.ty
            )));
        }
        class_of.insert(n, id);
        original.push(tn);
    }
    let roots: Vec<Id> = graph.roots().iter().map(|r| class_of[r]).collect();

    // Saturation.
    let runner = Runner::default()
        .with_egraph(eg)
        .with_node_limit(cfg.node_limit)
        .with_iter_limit(cfg.iter_limit)
        .with_time_limit(cfg.time_limit)
        .with_scheduler(egg::SimpleScheduler)
        .run(rules::all_rules().iter().filter(|r| {
            let name = r.name.as_str();
            !cfg.disabled_rules
                .iter()
                .any(|d| name.starts_with(d.as_str()))
        }));
    let stop_reason = runner
        .stop_reason
        .clone()
        .unwrap_or(StopReason::Other("not run".into()));
    let iterations = runner.iterations.len();
    let mut applied: HashMap<String, usize> = HashMap::new();
    for it in &runner.iterations {
        for (rule, n) in &it.applied {
            *applied.entry(rule.to_string()).or_default() += n;
        }
    }
    let mut applied: Vec<(String, usize)> = applied.into_iter().filter(|(_, n)| *n > 0).collect();
    applied.sort();
    let eg = runner.egraph;
    let saturation_time = t0.elapsed();
    tracing::info!(
        ?stop_reason,
        iterations,
        nodes = eg.total_size(),
        classes = eg.number_of_classes(),
        ?saturation_time,
        "e-graph saturation"
    );
    if let Some(c) = eg.analysis.conflicts.first() {
        return Err(err(format!("unsound rewrite: {c}")));
    }

    // Extraction.
    let t1 = Instant::now();
    let original: Vec<TNode> = original
        .into_iter()
        .map(|n| TNode::new(n.op, n.children.iter().map(|&c| eg.find(c)).collect()))
        .collect();
    let roots: Vec<Id> = roots.iter().map(|&r| eg.find(r)).collect();
    let root_class: HashMap<NodeId, Id> = graph
        .roots()
        .iter()
        .map(|r| (*r, eg.find(class_of[r])))
        .collect();
    let ex = extract::extract(&eg, &roots, &original, &cfg.cost).map_err(err)?;
    let out = build_graph(graph, &eg, &ex.choice, &root_class)?;
    out.verify()?;
    let extraction_time = t1.elapsed();
    tracing::info!(
        cost_before,
        cost_after = ex.cost,
        rounds = ex.rounds,
        refused = ex.refused,
        ?extraction_time,
        "extraction"
    );
    let report = OptimizeReport {
        stop_reason,
        iterations,
        egraph_nodes: eg.total_size(),
        egraph_classes: eg.number_of_classes(),
        saturation_time,
        extraction_time,
        cost_before,
        cost_after: ex.cost,
        extraction_rounds: ex.rounds,
        refused_fusions: ex.refused,
        applied,
    };
    Ok((out, report))
}

/// Builds the result graph from the chosen nodes: the input's tables, then every needed class in
/// dependency order (iteratively: graphs are deep).
fn build_graph(
    src: &Graph,
    eg: &EG,
    choice: &HashMap<Id, TNode>,
    root_class: &HashMap<NodeId, Id>,
) -> Result<Graph> {
    let err = |m: String| CompileError::Optimize(m);
    let mut g = Graph::new();
    // The tables are copied as they are (their names are already unique).
    for (index, def) in src.inputs.iter().enumerate() {
        let op = Op::Input {
            index: index as u32,
            ty: def.ty.clone(),
        };
        let node = g.add_typed(op, &[], def.ty.clone());
        g.g[node].name = Some(def.name.clone());
        g.inputs.push(InputDef {
            node,
            ..def.clone()
        });
    }
    for (index, def) in src.params.iter().enumerate() {
        let op = Op::Param {
            index: index as u32,
            ty: def.ty.clone(),
        };
        let node = g.add_typed(op, &[], def.ty.clone());
        g.g[node].name = Some(def.name.clone());
        g.params.push(ParamDef {
            node,
            ..def.clone()
        });
    }
    g.constants = src.constants.clone();

    let mut made: HashMap<Id, NodeId> = HashMap::with_capacity(choice.len());
    let mut on_stack: HashSet<Id> = HashSet::new();
    let pick = |c: Id| -> Result<&TNode> {
        choice
            .get(&eg.find(c))
            .ok_or_else(|| err(format!("no choice for class {c}")))
    };
    let roots: Vec<Id> = src.roots().iter().map(|r| root_class[r]).collect();
    for &root in &roots {
        let mut stack: Vec<(Id, bool)> = vec![(root, false)];
        while let Some((c, expanded)) = stack.pop() {
            if made.contains_key(&c) {
                continue;
            }
            let node = pick(c)?;
            if !expanded {
                if !on_stack.insert(c) {
                    return Err(err(format!("cyclic choice through class {c}")));
                }
                stack.push((c, true));
                for &ch in node.children.iter().rev() {
                    let ch = eg.find(ch);
                    if !made.contains_key(&ch) {
                        stack.push((ch, false));
                    }
                }
                continue;
            }
            on_stack.remove(&c);
            let id = match &node.op {
                Op::Input { index, .. } => src
                    .inputs
                    .get(*index as usize)
                    .map(|_| g.inputs[*index as usize].node)
                    .ok_or_else(|| err(format!("input #{index} is not declared")))?,
                Op::Param { index, .. } => src
                    .params
                    .get(*index as usize)
                    .map(|_| g.params[*index as usize].node)
                    .ok_or_else(|| err(format!("parameter #{index} is not declared")))?,
                op => {
                    let ins: Vec<NodeId> =
                        node.children.iter().map(|&ch| made[&eg.find(ch)]).collect();
                    g.add(op.clone(), &ins)?
                }
            };
            made.insert(c, id);
        }
    }
    let node_of = |r: NodeId| -> Result<NodeId> { Ok(made[&root_class[&r]]) };
    for (name, r) in &src.outputs {
        g.outputs.push((name.clone(), node_of(*r)?));
    }
    for (p, r) in &src.updates {
        g.updates.push((*p, node_of(*r)?));
    }
    for (name, r) in &src.guards {
        g.guards.push((name.clone(), node_of(*r)?));
    }
    Ok(g)
}
