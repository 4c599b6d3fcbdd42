//! The graph IR: typed nodes over a petgraph `StableDiGraph`, with the graph's named inputs,
//! parameters (with initializers), constants, outputs and state updates.

use crate::{CompileError, Result};
use petgraph::stable_graph::{NodeIndex, StableDiGraph};
use petgraph::Direction;
use rustytorch_ops::{infer, HostTensor, Op, TensorType};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::panic::Location;

/// Checks a declared leaf type against the size limits (the error names the op, as inference's).
fn check_leaf(op: &Op, ty: &TensorType) -> Result<()> {
    rustytorch_ops::shape::check_type_limits(op, ty).map_err(CompileError::Op)
}

/// A node's id (stable across removals).
pub type NodeId = NodeIndex<u32>;

/// One operation in the graph.
#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    /// The op with its attributes.
    pub op: Op,
    /// Operands, in order.
    pub inputs: Vec<NodeId>,
    /// The result type (always equal to the op's inference over the operands' types).
    pub ty: TensorType,
    /// An optional name (for printing and debugging).
    pub name: Option<String>,
}

/// How a parameter gets its initial value.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Init {
    /// Every element `value`.
    Full(f64),
    /// Seeded uniform in [low, high).
    Uniform {
        /// Lower bound.
        low: f64,
        /// Upper bound.
        high: f64,
        /// Seed.
        seed: u64,
    },
    /// Seeded normal.
    Normal {
        /// Mean.
        mean: f64,
        /// Standard deviation.
        std: f64,
        /// Seed.
        seed: u64,
    },
    /// Given values (embedded in the graph, or loaded from a safetensors file beside it).
    Data,
}

impl Init {
    /// Zeros.
    pub fn zeros() -> Init {
        Init::Full(0.0)
    }
    /// Ones.
    pub fn ones() -> Init {
        Init::Full(1.0)
    }
    /// PyTorch's default for linear and conv weights: uniform in ±1/√fan_in (kaiming uniform with
    /// a = √5).
    pub fn kaiming_uniform(fan_in: usize, seed: u64) -> Init {
        let b = 1.0 / (fan_in.max(1) as f64).sqrt();
        Init::Uniform {
            low: -b,
            high: b,
            seed,
        }
    }
    /// Materializes the initial value of a tensor of type `ty`.
    pub fn materialize(&self, ty: &TensorType) -> Result<HostTensor> {
        use rustytorch_ops::{eval_cpu, F64Bits};
        let op = match self {
            Init::Full(v) => Op::Full {
                value: F64Bits::new(*v),
                ty: ty.clone(),
            },
            Init::Uniform { low, high, seed } => Op::RandUniform {
                low: F64Bits::new(*low),
                high: F64Bits::new(*high),
                seed: *seed,
                ty: ty.clone(),
            },
            Init::Normal { mean, std, seed } => Op::RandNormal {
                mean: F64Bits::new(*mean),
                std: F64Bits::new(*std),
                seed: *seed,
                ty: ty.clone(),
            },
            Init::Data => {
                return Err(CompileError::Invalid(
                    "parameter has no data and no initializer".into(),
                ))
            }
        };
        Ok(eval_cpu(&op, &[])?)
    }
}

/// A named graph input.
#[derive(Clone, Debug, PartialEq)]
pub struct InputDef {
    /// The name users pass values by.
    pub name: String,
    /// Declared type.
    pub ty: TensorType,
    /// The `Op::Input` node.
    pub node: NodeId,
}

/// A parameter or other persistent state (optimizer moments, step counters).
#[derive(Clone, Debug, PartialEq)]
pub struct ParamDef {
    /// Name (unique).
    pub name: String,
    /// Type.
    pub ty: TensorType,
    /// Initializer.
    pub init: Init,
    /// Values given with the graph (trained weights), overriding `init`.
    pub data: Option<HostTensor>,
    /// Whether gradients may be taken with respect to it (false for optimizer state).
    pub trainable: bool,
    /// The `Op::Param` node.
    pub node: NodeId,
}

/// A computation graph.
#[derive(Clone, Debug, Default)]
pub struct Graph {
    pub(crate) g: StableDiGraph<Node, u32, u32>,
    /// Inputs, in order (`Op::Input { index }` refers to this list).
    pub inputs: Vec<InputDef>,
    /// Parameters and state, in order (`Op::Param { index }` refers to this list).
    pub params: Vec<ParamDef>,
    /// Constant tensors (`Op::Constant { index }` refers to this list).
    pub constants: Vec<HostTensor>,
    /// Named outputs, in order.
    pub outputs: Vec<(String, NodeId)>,
    /// State updates applied after each run: parameter index ← value.
    pub updates: Vec<(u32, NodeId)>,
    /// Bool scalars that must all be true for the updates to be applied (gradient finiteness per
    /// parameter); the name says what failed.
    pub guards: Vec<(String, NodeId)>,
    /// Where the nodes were built in the user's source (not saved in graph files).
    pub provenance: Provenance,
    /// Named dims and the symbolic shapes of the nodes that depend on them (see
    /// [`crate::dims`]).
    pub dims: crate::dims::Dims,
}

/// A source location recorded by the builder API (`file:line:col` when displayed).
pub type SourceLocation = &'static Location<'static>;

/// A side table of where each node was built: the caller location of the builder call that
/// made it, carried through the compile passes (a node a pass makes takes the location of the
/// node it replaces where that is known), and for each fused kernel the location of each
/// instruction's original node. Used to name the source of a run-time anomaly.
#[derive(Clone, Debug, Default)]
pub struct Provenance {
    /// The source location of each node that has one.
    pub locations: HashMap<NodeId, SourceLocation>,
    /// Per `Op::Fused` node: the location of each instruction's original node, by instruction.
    pub fused: HashMap<NodeId, Vec<Option<SourceLocation>>>,
}

impl Graph {
    /// An empty graph.
    pub fn new() -> Graph {
        Graph::default()
    }

    /// Adds an op over existing nodes, inferring its type; errors name the op, shapes and dtypes.
    pub fn add(&mut self, op: Op, inputs: &[NodeId]) -> Result<NodeId> {
        let mut tys = Vec::with_capacity(inputs.len());
        for &i in inputs {
            tys.push(
                &self
                    .g
                    .node_weight(i)
                    .ok_or_else(|| CompileError::Invalid(format!("unknown node %{}", i.index())))?
                    .ty,
            );
        }
        let ty = infer(&op, &tys)?;
        Ok(self.add_typed(op, inputs, ty))
    }

    /// Adds a node whose type the caller has already inferred.
    pub(crate) fn add_typed(&mut self, op: Op, inputs: &[NodeId], ty: TensorType) -> NodeId {
        let id = self.g.add_node(Node {
            op,
            inputs: inputs.to_vec(),
            ty,
            name: None,
        });
        // A reused id must not inherit the symbolic shape of a removed node.
        self.dims.shapes.remove(&id);
        for (k, &i) in inputs.iter().enumerate() {
            self.g.add_edge(i, id, k as u32);
        }
        id
    }

    /// Declares a named input.
    pub fn add_input(&mut self, name: &str, ty: TensorType) -> Result<NodeId> {
        let index = self.inputs.len() as u32;
        check_leaf(
            &Op::Input {
                index,
                ty: ty.clone(),
            },
            &ty,
        )?;
        if self.inputs.iter().any(|i| i.name == name) {
            return Err(CompileError::Invalid(format!(
                "input `{name}` declared twice"
            )));
        }
        let index = self.inputs.len() as u32;
        let node = self.add_typed(
            Op::Input {
                index,
                ty: ty.clone(),
            },
            &[],
            ty.clone(),
        );
        self.g[node].name = Some(name.to_string());
        self.inputs.push(InputDef {
            name: name.to_string(),
            ty,
            node,
        });
        Ok(node)
    }

    /// Declares a parameter (trainable) or state (not trainable).
    pub fn add_param(
        &mut self,
        name: &str,
        ty: TensorType,
        init: Init,
        trainable: bool,
    ) -> Result<NodeId> {
        let index = self.params.len() as u32;
        check_leaf(
            &Op::Param {
                index,
                ty: ty.clone(),
            },
            &ty,
        )?;
        if self.params.iter().any(|p| p.name == name) {
            return Err(CompileError::Invalid(format!(
                "parameter `{name}` declared twice"
            )));
        }
        let index = self.params.len() as u32;
        let node = self.add_typed(
            Op::Param {
                index,
                ty: ty.clone(),
            },
            &[],
            ty.clone(),
        );
        self.g[node].name = Some(name.to_string());
        self.params.push(ParamDef {
            name: name.to_string(),
            ty,
            init,
            data: None,
            trainable,
            node,
        });
        Ok(node)
    }

    /// Adds a constant tensor.
    pub fn add_constant(&mut self, value: HostTensor) -> NodeId {
        let index = self.constants.len() as u32;
        let ty = value.ty();
        self.constants.push(value);
        self.add_typed(
            Op::Constant {
                index,
                ty: ty.clone(),
            },
            &[],
            ty,
        )
    }

    /// Marks a node as a named output.
    pub fn add_output(&mut self, name: &str, node: NodeId) -> Result<()> {
        self.node(node)?;
        if self.outputs.iter().any(|(n, _)| n == name) {
            return Err(CompileError::Invalid(format!(
                "output `{name}` declared twice"
            )));
        }
        self.outputs.push((name.to_string(), node));
        Ok(())
    }

    /// The node with this id.
    pub fn node(&self, id: NodeId) -> Result<&Node> {
        self.g
            .node_weight(id)
            .ok_or_else(|| CompileError::Invalid(format!("unknown node %{}", id.index())))
    }

    /// Mutable access to a node (the caller keeps `ty` consistent).
    pub fn node_mut(&mut self, id: NodeId) -> Option<&mut Node> {
        self.g.node_weight_mut(id)
    }

    /// The type of a node.
    pub fn ty(&self, id: NodeId) -> &TensorType {
        &self.g[id].ty
    }

    /// Number of nodes.
    pub fn len(&self) -> usize {
        self.g.node_count()
    }

    /// Whether the graph has no nodes.
    pub fn is_empty(&self) -> bool {
        self.g.node_count() == 0
    }

    /// All node ids, in insertion order.
    pub fn node_ids(&self) -> Vec<NodeId> {
        self.g.node_indices().collect()
    }

    /// The nodes that use `id`, each once.
    pub fn users(&self, id: NodeId) -> Vec<NodeId> {
        let mut u: Vec<NodeId> = self.g.neighbors_directed(id, Direction::Outgoing).collect();
        u.sort();
        u.dedup();
        u
    }

    /// The ids of the output nodes (in order, possibly repeated).
    pub fn output_nodes(&self) -> Vec<NodeId> {
        self.outputs.iter().map(|(_, n)| *n).collect()
    }

    /// The roots that must be kept alive: outputs and update values.
    pub fn roots(&self) -> Vec<NodeId> {
        let mut r = self.output_nodes();
        r.extend(self.updates.iter().map(|(_, n)| *n));
        r.extend(self.guards.iter().map(|(_, n)| *n));
        r
    }

    /// A topological order of every node (inputs before users); errors on a cycle.
    pub fn topo_order(&self) -> Result<Vec<NodeId>> {
        petgraph::algo::toposort(&self.g, None).map_err(|c| {
            CompileError::Invalid(format!("cycle through node %{}", c.node_id().index()))
        })
    }

    /// A topological order of the nodes the roots depend on (stable: follows insertion order
    /// where dependencies allow).
    pub fn live_order(&self) -> Vec<NodeId> {
        let mut seen = std::collections::HashSet::new();
        let mut order = Vec::new();
        let mut stack: Vec<(NodeId, usize)> = Vec::new();
        for r in self.roots() {
            if seen.contains(&r) {
                continue;
            }
            stack.push((r, 0));
            seen.insert(r);
            while let Some((n, k)) = stack.pop() {
                let ins = &self.g[n].inputs;
                if k < ins.len() {
                    stack.push((n, k + 1));
                    let c = ins[k];
                    if seen.insert(c) {
                        stack.push((c, 0));
                    }
                } else {
                    order.push(n);
                }
            }
        }
        order
    }

    /// Replaces every use of `old` (operands, outputs, updates) with `new` (same type).
    pub fn replace_uses(&mut self, old: NodeId, new: NodeId) {
        if old == new {
            return;
        }
        for u in self.users(old) {
            let ins: Vec<NodeId> = self.g[u]
                .inputs
                .iter()
                .map(|&i| if i == old { new } else { i })
                .collect();
            self.set_inputs(u, ins);
        }
        for o in &mut self.outputs {
            if o.1 == old {
                o.1 = new;
            }
        }
        for o in self
            .updates
            .iter_mut()
            .map(|u| &mut u.1)
            .chain(self.guards.iter_mut().map(|g| &mut g.1))
        {
            if *o == old {
                *o = new;
            }
        }
    }

    /// Sets a node's operands (edges follow).
    pub fn set_inputs(&mut self, id: NodeId, inputs: Vec<NodeId>) {
        let old: Vec<_> = self
            .g
            .edges_directed(id, Direction::Incoming)
            .map(|e| petgraph::visit::EdgeRef::id(&e))
            .collect();
        for e in old {
            self.g.remove_edge(e);
        }
        for (k, &i) in inputs.iter().enumerate() {
            self.g.add_edge(i, id, k as u32);
        }
        self.g[id].inputs = inputs;
    }

    /// Where node `id` was built, when known.
    pub fn location(&self, id: NodeId) -> Option<SourceLocation> {
        self.provenance.locations.get(&id).copied()
    }

    /// Records where node `id` was built.
    pub fn set_location(&mut self, id: NodeId, at: SourceLocation) {
        self.provenance.locations.insert(id, at);
    }

    /// Removes a node and its provenance.
    pub(crate) fn remove_node(&mut self, id: NodeId) {
        self.g.remove_node(id);
        self.dims.shapes.remove(&id);
        self.provenance.locations.remove(&id);
        self.provenance.fused.remove(&id);
    }

    /// Takes the source locations of `src`, a graph this one was rewritten from with the same
    /// inputs, parameters, constants and roots in the same order. A node equal to a node of
    /// `src` (same op over corresponding operands) takes its location; a node in the place of
    /// another (a root at the same position, or the same operand of corresponding users) takes
    /// the location of the node it replaces; any other node takes the location of its first
    /// located user.
    pub fn inherit_provenance(&mut self, src: &Graph) {
        let order = self.live_order();
        let mut map: HashMap<NodeId, NodeId> = HashMap::new();
        for (a, b) in self.inputs.iter().zip(&src.inputs) {
            map.insert(a.node, b.node);
        }
        for (a, b) in self.params.iter().zip(&src.params) {
            map.insert(a.node, b.node);
        }
        let by_key: HashMap<(&Op, &[NodeId]), NodeId> = src
            .g
            .node_indices()
            .map(|n| ((&src.g[n].op, src.g[n].inputs.as_slice()), n))
            .collect();
        // Equal nodes, operands first.
        for &n in &order {
            if map.contains_key(&n) {
                continue;
            }
            let node = &self.g[n];
            let ins: Option<Vec<NodeId>> =
                node.inputs.iter().map(|i| map.get(i).copied()).collect();
            if let Some(s) = ins.and_then(|ins| by_key.get(&(&node.op, ins.as_slice())).copied()) {
                map.insert(n, s);
            }
        }
        // Replacements, users first.
        for (a, b) in self.roots().into_iter().zip(src.roots()) {
            if self.g[a].ty == src.g[b].ty {
                map.entry(a).or_insert(b);
            }
        }
        for &n in order.iter().rev() {
            let Some(&s) = map.get(&n) else { continue };
            for (k, &i) in self.g[n].inputs.iter().enumerate() {
                if let Some(&si) = src.g[s].inputs.get(k) {
                    if self.g[i].ty == src.g[si].ty {
                        map.entry(i).or_insert(si);
                    }
                }
            }
        }
        let mut locations = HashMap::new();
        let mut fused = HashMap::new();
        for (&n, &s) in &map {
            if let Some(l) = src.location(s) {
                locations.insert(n, l);
            }
            if let (Some(f), true) = (src.provenance.fused.get(&s), self.g[n].op == src.g[s].op) {
                fused.insert(n, f.clone());
            }
        }
        for &n in order.iter().rev() {
            if locations.contains_key(&n) {
                continue;
            }
            let at = self
                .users(n)
                .into_iter()
                .find_map(|u| locations.get(&u).copied());
            if let Some(at) = at {
                locations.insert(n, at);
            }
        }
        self.provenance = Provenance { locations, fused };
    }

    /// Removes nodes no root depends on (leaves that are declared inputs or parameters stay).
    pub fn remove_dead(&mut self) {
        let live: std::collections::HashSet<NodeId> = self.live_order().into_iter().collect();
        let dead: Vec<NodeId> = self
            .g
            .node_indices()
            .filter(|n| {
                !live.contains(n) && !matches!(self.g[*n].op, Op::Input { .. } | Op::Param { .. })
            })
            .collect();
        for n in dead {
            self.remove_node(n);
        }
    }

    /// Checks every invariant: operands exist and form a DAG; each node's type is its op's
    /// inference (which checks the attributes and every type against the size limits of
    /// [`rustytorch_ops::shape`]); leaves agree with the input/parameter/constant tables; input,
    /// parameter and output names are unique; parameter values have the parameter's type;
    /// outputs, updates and guards name existing nodes, updates of the parameter's type and guards
    /// bool scalars; named dims are declared once and every symbolic shape gives its node's
    /// shape at the default sizes. Graphs read from IR text and graph files are verified before they are
    /// returned, so both formats pass exactly these checks.
    pub fn verify(&self) -> Result<()> {
        self.verify_tables()?;
        self.verify_dims()?;
        for id in self.g.node_indices() {
            let n = &self.g[id];
            let mut tys = Vec::with_capacity(n.inputs.len());
            for &i in &n.inputs {
                let t = self.g.node_weight(i).ok_or_else(|| {
                    CompileError::Invalid(format!(
                        "node %{} ({}) reads missing node %{}",
                        id.index(),
                        n.op.name(),
                        i.index()
                    ))
                })?;
                tys.push(&t.ty);
            }
            let ty = infer(&n.op, &tys)
                .map_err(|e| CompileError::Invalid(format!("node %{}: {e}", id.index())))?;
            if ty != n.ty {
                return Err(CompileError::Invalid(format!(
                    "node %{} ({}) has type {} but its op infers {}",
                    id.index(),
                    n.op.name(),
                    n.ty,
                    ty
                )));
            }
            let leaf_ok = match &n.op {
                Op::Input { index, .. } => self
                    .inputs
                    .get(*index as usize)
                    .is_some_and(|d| d.node == id && d.ty == n.ty),
                Op::Param { index, .. } => self
                    .params
                    .get(*index as usize)
                    .is_some_and(|d| d.node == id && d.ty == n.ty),
                Op::Constant { index, .. } => self
                    .constants
                    .get(*index as usize)
                    .is_some_and(|c| c.ty() == n.ty),
                _ => true,
            };
            if !leaf_ok {
                return Err(CompileError::Invalid(format!(
                    "leaf node %{} ({}) does not match the graph's tables",
                    id.index(),
                    n.op.name()
                )));
            }
        }
        for (name, o) in &self.outputs {
            self.node(*o).map_err(|_| {
                CompileError::Invalid(format!("output `{name}` names a missing node"))
            })?;
        }
        for (name, o) in &self.guards {
            let t = &self
                .node(*o)
                .map_err(|_| CompileError::Invalid(format!("guard `{name}` names a missing node")))?
                .ty;
            if t.dtype != rustytorch_ops::DType::Bool || t.shape.rank() != 0 {
                return Err(CompileError::Invalid(format!(
                    "guard `{name}` is {t}, not a bool scalar"
                )));
            }
        }
        for (p, o) in &self.updates {
            let def = self.params.get(*p as usize).ok_or_else(|| {
                CompileError::Invalid(format!("update of missing parameter #{p}"))
            })?;
            let t = &self.node(*o)?.ty;
            if *t != def.ty {
                return Err(CompileError::Invalid(format!(
                    "update of `{}` has type {t}, the parameter is {}",
                    def.name, def.ty
                )));
            }
        }
        self.topo_order()?;
        Ok(())
    }

    /// The table checks of [`Graph::verify`]: unique names and parameter values of the declared
    /// type.
    fn verify_tables(&self) -> Result<()> {
        let mut seen = std::collections::HashSet::new();
        for d in &self.inputs {
            if !seen.insert(d.name.as_str()) {
                return Err(CompileError::Invalid(format!(
                    "input `{}` declared twice",
                    d.name
                )));
            }
        }
        seen.clear();
        for d in &self.params {
            if !seen.insert(d.name.as_str()) {
                return Err(CompileError::Invalid(format!(
                    "parameter `{}` declared twice",
                    d.name
                )));
            }
            if let Some(t) = &d.data {
                if t.ty() != d.ty {
                    return Err(CompileError::Invalid(format!(
                        "parameter `{}` is {} but its values are {}",
                        d.name,
                        d.ty,
                        t.ty()
                    )));
                }
            }
        }
        seen.clear();
        for (name, _) in &self.outputs {
            if !seen.insert(name.as_str()) {
                return Err(CompileError::Invalid(format!(
                    "output `{name}` declared twice"
                )));
            }
        }
        Ok(())
    }

    /// The input with this name.
    pub fn input_by_name(&self, name: &str) -> Option<&InputDef> {
        self.inputs.iter().find(|i| i.name == name)
    }

    /// The parameter with this name.
    pub fn param_by_name(&self, name: &str) -> Option<&ParamDef> {
        self.params.iter().find(|p| p.name == name)
    }

    /// The number of trainable parameter elements.
    pub fn param_count(&self) -> usize {
        self.params
            .iter()
            .filter(|p| p.trainable)
            .fold(0usize, |n, p| n.saturating_add(p.ty.shape.numel()))
    }
}
