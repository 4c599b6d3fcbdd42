//! Graphviz DOT pictures of graphs, one panel per graph side by side (the graph before the
//! passes, after each pass, after all of them).
//!
//! - Nodes are labelled with their `%N` number (as in the IR text), op and type; inputs,
//!   parameters, constants, outputs and state updates have their own shapes and colors.
//! - Library ops (GEMMs and their epilogues, convolutions, pooling, norms, softmax, attention,
//!   losses, sparse products) are amber; one whose kind the baseline graph (the source) does
//!   not contain is marked *recognized*: the optimizer found it in a spelling of primitives.
//! - A fused kernel is a cluster holding the original ops it absorbed, one node per
//!   instruction (`t2 = mul(t1, 0.5)`: immediates are folded into their user), with edges from
//!   the kernel's inputs to the instructions that read them.
//! - Hover labels (SVG tooltips) give the node's IR line, where the builder made it, its place
//!   in the memory plan (arena offset and size, lifetime, in-place reuse or alias) and whatever
//!   the caller's annotation adds (FLOPs).
//! - Large graphs stay readable: with repeated layers ([`super::find_layers`]), the layers not
//!   asked for are drawn as one box each (ops and parameters inside it collapsed), and the
//!   layers drawn in full sit in dashed clusters.

use super::{find_layers, human_bytes, node_numbers, op_summary, Layers};
use crate::graph::{Graph, NodeId};
use crate::plan::MemoryPlan;
use rustytorch_ops::{FusedKernel, Op};
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fmt::Write as _;

/// One graph to draw.
#[derive(Clone, Copy)]
pub struct Panel<'a> {
    /// The panel's title (`before`, `after optimize` ...).
    pub title: &'a str,
    /// The graph.
    pub graph: &'a Graph,
    /// Its memory plan, for the hover labels.
    pub memory: Option<&'a MemoryPlan>,
}

/// Which layers to draw in full.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum LayerView {
    /// Every layer in full, unless the picture would have more than
    /// [`DotOptions::collapse_above`] nodes: then the first layer in full and the others
    /// collapsed.
    #[default]
    Auto,
    /// Every layer in full.
    All,
    /// These layer indices in full, the others collapsed.
    Only(BTreeSet<usize>),
}

/// An extra hover line for a node (the caller's annotation, such as its FLOPs).
pub type Annotate<'a> = &'a dyn Fn(&Graph, NodeId) -> Option<String>;

/// Drawing options.
#[derive(Clone)]
pub struct DotOptions<'a> {
    /// Which layers to draw in full.
    pub layers: LayerView,
    /// Library ops of a kind this graph has no node of are marked *recognized*.
    pub baseline: Option<&'a Graph>,
    /// An extra hover line per node.
    pub annotate: Option<Annotate<'a>>,
    /// With [`LayerView::Auto`], collapse layers when the picture would have more nodes.
    pub collapse_above: usize,
    /// Draw a legend of the node styles.
    pub legend: bool,
}

impl Default for DotOptions<'_> {
    fn default() -> Self {
        DotOptions {
            layers: LayerView::Auto,
            baseline: None,
            annotate: None,
            collapse_above: 400,
            legend: true,
        }
    }
}

/// A picture.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Dot {
    /// The DOT source.
    pub text: String,
    /// Layers drawn collapsed (by name), if any.
    pub collapsed: Vec<String>,
}

/// What kind of node an op makes, for its style.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Input,
    Param,
    Constant,
    Generator,
    Elementwise,
    Reduce,
    Movement,
    Index,
    /// A library kernel, with its family.
    Library(&'static str),
    Fused,
}

fn kind(op: &Op) -> Kind {
    match op {
        Op::Input { .. } => Kind::Input,
        Op::Param { .. } => Kind::Param,
        Op::Constant { .. } => Kind::Constant,
        Op::Full { .. } | Op::Iota { .. } | Op::RandUniform { .. } | Op::RandNormal { .. } => {
            Kind::Generator
        }
        Op::Unary(_) | Op::Binary(_) | Op::Where | Op::Cast { .. } => Kind::Elementwise,
        Op::Reduce { .. } | Op::ArgReduce { .. } => Kind::Reduce,
        Op::Reshape { .. }
        | Op::Permute { .. }
        | Op::Expand { .. }
        | Op::Slice { .. }
        | Op::Concat { .. }
        | Op::Pad { .. } => Kind::Movement,
        Op::Gather { .. }
        | Op::ScatterAdd { .. }
        | Op::IndexSelect { .. }
        | Op::IndexAdd { .. } => Kind::Index,
        Op::Matmul { .. } => Kind::Library("gemm"),
        Op::MatmulEpilogue { .. } => Kind::Library("gemm + epilogue"),
        Op::MatmulActGrad { .. } => Kind::Library("gemm + activation gradient"),
        Op::Softmax { .. } | Op::LogSoftmax { .. } => Kind::Library("softmax"),
        Op::LayerNorm { .. } | Op::RmsNorm { .. } => Kind::Library("norm"),
        Op::Conv { .. } | Op::ConvGradInput { .. } | Op::ConvGradWeight { .. } => {
            Kind::Library("conv")
        }
        Op::Pool { .. } | Op::PoolGrad { .. } => Kind::Library("pool"),
        Op::Attention { .. } | Op::AttentionGrad { .. } => Kind::Library("attention"),
        Op::CrossEntropy { .. } | Op::CrossEntropyGrad { .. } => Kind::Library("loss"),
        Op::SparseMatmul { .. } | Op::SampledMatmul => Kind::Library("sparse"),
        Op::CumSum { .. } | Op::TopK { .. } => Kind::Index,
        Op::Fused(_) | Op::FusedRow(_) => Kind::Fused,
        Op::AllReduce { .. } => Kind::Library("collective"),
    }
}

/// `shape`, `style` and `fillcolor` attributes of a kind.
fn style(k: Kind, recognized: bool) -> &'static str {
    match k {
        Kind::Input => r##"shape=invhouse, style=filled, fillcolor="#c8e6c9""##,
        Kind::Param => r##"shape=note, style=filled, fillcolor="#eeeeee", fontsize=9"##,
        Kind::Constant | Kind::Generator => {
            r##"shape=box, style="dashed,filled", fillcolor="#fafafa", fontsize=9"##
        }
        Kind::Elementwise => r##"shape=box, style="rounded,filled", fillcolor="#ffffff""##,
        Kind::Reduce => r##"shape=box, style="rounded,filled", fillcolor="#bbdefb""##,
        Kind::Movement => r##"shape=box, style="rounded,dashed,filled", fillcolor="#f5f5f5""##,
        Kind::Index => r##"shape=box, style="rounded,filled", fillcolor="#e1bee7""##,
        Kind::Library(_) if recognized => {
            r##"shape=box, style="rounded,filled,bold", fillcolor="#ffb74d", penwidth=2"##
        }
        Kind::Library(_) => r##"shape=box, style="rounded,filled", fillcolor="#ffe082""##,
        Kind::Fused => r##"shape=box, style="rounded,filled", fillcolor="#fff3e0""##,
    }
}

/// Escapes a string for a double-quoted DOT attribute (`\n` stays a line break).
fn esc(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            '\n' => o.push_str("\\n"),
            '\r' => {}
            c if c.is_control() => o.push(' '),
            c => o.push(c),
        }
    }
    o
}

/// At most `max` characters, with `…` when cut.
fn clip(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        return s.to_string();
    }
    let mut t: String = s.chars().take(max.saturating_sub(1)).collect();
    t.push('…');
    t
}

/// The text of one fused instruction, immediates folded (`t2 = mul(t1, 0.5)`).
fn instr_text(k: &FusedKernel, j: usize) -> String {
    let arg = |a: u32| -> String {
        if a < k.n_inputs {
            return format!("in{a}");
        }
        let t = (a - k.n_inputs) as usize;
        match k.instrs.get(t).map(|i| &i.op) {
            Some(Op::Full { value, .. }) => format!("{}", value.get()),
            _ => format!("t{t}"),
        }
    };
    let ins = &k.instrs[j];
    let args: Vec<String> = ins.args.iter().map(|&a| arg(a)).collect();
    let op = match &ins.op {
        Op::Cast { to } => format!("cast<{to}>"),
        op => op.name().to_string(),
    };
    format!("t{j} = {op}({})", args.join(", "))
}

/// Per panel: ids, numbers, layers and what is collapsed.
struct PanelCtx<'a> {
    p: Panel<'a>,
    prefix: String,
    num: HashMap<NodeId, usize>,
    live: Vec<NodeId>,
    layers: Option<Layers>,
    /// Layers drawn collapsed.
    collapsed: BTreeSet<usize>,
}

impl PanelCtx<'_> {
    fn node_id(&self, n: NodeId) -> String {
        format!(
            "{}n{}",
            self.prefix,
            self.num.get(&n).copied().unwrap_or(usize::MAX)
        )
    }
    fn layer(&self, n: NodeId) -> Option<usize> {
        self.layers
            .as_ref()
            .and_then(|l| l.of_node.get(&n).copied())
    }
    fn is_collapsed(&self, n: NodeId) -> bool {
        self.layer(n).is_some_and(|l| self.collapsed.contains(&l))
    }
    fn layer_box(&self, l: usize) -> String {
        format!("{}L{l}", self.prefix)
    }
    /// The DOT node an edge from `n`'s value starts at.
    fn out_port(&self, n: NodeId) -> String {
        if let Some(l) = self.layer(n).filter(|l| self.collapsed.contains(l)) {
            return self.layer_box(l);
        }
        match self.p.graph.node(n).map(|x| &x.op) {
            Ok(Op::Fused(k)) => format!("{}_t{}", self.node_id(n), k.instrs.len() - 1),
            _ => self.node_id(n),
        }
    }
    fn label_num(&self, n: NodeId) -> String {
        match self.num.get(&n) {
            Some(k) => format!("%{k}"),
            None => format!("%?{}", n.index()),
        }
    }
}

/// Draws `panels` side by side in one picture.
pub fn to_dot(panels: &[Panel], opts: &DotOptions) -> Dot {
    let base_kinds: Option<HashSet<usize>> = opts.baseline.map(|b| {
        b.live_order()
            .into_iter()
            .filter_map(|n| b.node(n).ok().map(|x| x.op.variant_index()))
            .collect()
    });
    let mut ctxs: Vec<PanelCtx> = panels
        .iter()
        .enumerate()
        .map(|(i, p)| PanelCtx {
            p: *p,
            prefix: format!("p{i}"),
            num: node_numbers(p.graph),
            live: {
                let mut l = p.graph.live_order();
                let num = node_numbers(p.graph);
                l.sort_by_key(|n| num.get(n).copied().unwrap_or(usize::MAX));
                l
            },
            layers: find_layers(p.graph),
            collapsed: BTreeSet::new(),
        })
        .collect();
    // Which layers to collapse.
    let total: usize = ctxs.iter().map(|c| c.live.len()).sum();
    let mut collapsed_names = BTreeSet::new();
    for c in &mut ctxs {
        let Some(layers) = &c.layers else { continue };
        let keep: BTreeSet<usize> = match &opts.layers {
            LayerView::All => layers.indices.clone(),
            LayerView::Only(s) => s.clone(),
            LayerView::Auto if total > opts.collapse_above && layers.indices.len() >= 3 => {
                layers.indices.iter().take(1).copied().collect()
            }
            LayerView::Auto => layers.indices.clone(),
        };
        c.collapsed = layers.indices.difference(&keep).copied().collect();
        collapsed_names.extend(c.collapsed.iter().map(|&l| (l, layers.name(l))));
    }

    let mut s = String::new();
    s.push_str("digraph rustytorch {\n");
    s.push_str(
        "  graph [rankdir=TB, newrank=true, nodesep=0.25, ranksep=0.35, fontname=\"Helvetica\", \
         fontsize=12];\n",
    );
    s.push_str("  node [fontname=\"Helvetica\", fontsize=10, height=0.3, margin=\"0.08,0.04\"];\n");
    s.push_str("  edge [arrowsize=0.6, color=\"#607d8b\"];\n");
    for c in &ctxs {
        panel(&mut s, c, opts, base_kinds.as_ref());
    }
    if opts.legend {
        legend(&mut s);
    }
    s.push_str("}\n");
    Dot {
        text: s,
        collapsed: collapsed_names.into_iter().map(|(_, n)| n).collect(),
    }
}

/// Whether `n` is a scalar `full` drawn folded into its users' labels.
fn folded(g: &Graph, n: NodeId) -> bool {
    g.node(n)
        .is_ok_and(|x| matches!(x.op, Op::Full { .. }) && x.ty.shape.numel() == 1)
}

/// The value of a scalar `full`.
fn full_value(g: &Graph, n: NodeId) -> Option<f64> {
    match g.node(n).map(|x| &x.op) {
        Ok(Op::Full { value, .. }) => Some(value.get()),
        _ => None,
    }
}

/// An op's name and, when it has any, its attributes (`causal=top_left,scale=0.5`).
fn op_parts(op: &Op) -> (String, Option<String>) {
    let s = op.to_string();
    match s.find('[') {
        Some(i) if s.ends_with(']') => (s[..i].to_string(), Some(s[i + 1..s.len() - 1].into())),
        _ => (s, None),
    }
}

/// The hover text of node `n`.
fn tooltip(c: &PanelCtx, n: NodeId, opts: &DotOptions) -> String {
    let g = c.p.graph;
    let Ok(node) = g.node(n) else {
        return String::new();
    };
    let args: Vec<String> = node.inputs.iter().map(|&i| c.label_num(i)).collect();
    let what = match &node.op {
        Op::Input { index, .. } => {
            format!(
                "input {}",
                g.inputs
                    .get(*index as usize)
                    .map_or("?", |d| d.name.as_str())
            )
        }
        Op::Param { index, .. } => match g.params.get(*index as usize) {
            Some(d) if d.trainable => format!("param {}", d.name),
            Some(d) => format!("state {}", d.name),
            None => "param ?".into(),
        },
        Op::Constant { .. } => "constant".into(),
        op @ Op::Fused(_) => op_summary(op),
        op => clip(&op.to_string(), 200),
    };
    let mut t = format!("{} = {what}", c.label_num(n));
    if !args.is_empty() {
        let _ = write!(t, "({})", args.join(", "));
    }
    let _ = write!(t, " : {}", node.ty);
    if let (Some(name), false) = (&node.name, node.op.is_leaf()) {
        let _ = write!(t, " as {name}");
    }
    if let Some(l) = g.location(n) {
        let _ = write!(t, "\nbuilt at {l}");
    }
    if let Some(m) = c.p.memory {
        if let Some(slot) = m.slot(n) {
            let _ = write!(
                t,
                "\narena [{:#x}, {:#x}) {}, live at steps {}..={}",
                slot.offset,
                slot.offset + slot.size,
                human_bytes(slot.size as u64),
                slot.first,
                slot.last
            );
            if let Some(d) = slot.inplace_of {
                let _ = write!(t, ", in place of {}", c.label_num(d));
            }
        } else if let Some(of) = m.aliases.get(&n) {
            let _ = write!(t, "\naliases the bytes of {} (no copy)", c.label_num(*of));
        } else if node.op.is_leaf() {
            let _ = write!(
                t,
                "\nprovided buffer ({})",
                human_bytes(node.ty.size_bytes() as u64)
            );
        }
    }
    if let Some(f) = opts.annotate {
        if let Some(a) = f(g, n) {
            let _ = write!(t, "\n{a}");
        }
    }
    t
}

/// The visible label of node `n` (not a fused kernel).
fn label(c: &PanelCtx, n: NodeId, recognized: bool) -> String {
    let g = c.p.graph;
    let Ok(node) = g.node(n) else {
        return String::new();
    };
    let num = c.label_num(n);
    match (&node.op, kind(&node.op)) {
        (Op::Input { index, .. }, _) => {
            let name = g
                .inputs
                .get(*index as usize)
                .map_or("?", |d| d.name.as_str());
            format!("{num} input {name}\n{}", node.ty)
        }
        (Op::Param { index, .. }, _) => {
            let (kw, name) = g.params.get(*index as usize).map_or(("param", "?"), |d| {
                (if d.trainable { "param" } else { "state" }, d.name.as_str())
            });
            format!("{num} {kw} {}\n{}", clip(name, 28), node.ty)
        }
        (Op::Constant { .. }, _) => format!("{num} constant\n{}", node.ty),
        (Op::Full { value, .. }, _) => format!("{num} full {}\n{}", value.get(), node.ty),
        (op, k) => {
            let (name, attrs) = op_parts(op);
            let mut l = format!("{num} {name}");
            // Scalar operands folded into the label.
            let scalars: Vec<String> = node
                .inputs
                .iter()
                .filter(|&&i| folded(g, i))
                .filter_map(|&i| full_value(g, i).map(|v| format!("{v}")))
                .collect();
            if !scalars.is_empty() {
                let _ = write!(l, " ({})", scalars.join(", "));
            }
            if let Some(a) = attrs {
                let _ = write!(l, "\n{}", clip(&a, 44));
            }
            let _ = write!(l, "\n{}", node.ty);
            if let Kind::Library(family) = k {
                l.push('\n');
                l.push_str(family);
                if recognized {
                    l.push_str(" (recognized)");
                }
            }
            l
        }
    }
}

fn panel(s: &mut String, c: &PanelCtx, opts: &DotOptions, base: Option<&HashSet<usize>>) {
    let g = c.p.graph;
    let _ = writeln!(s, "  subgraph cluster_{} {{", c.prefix);
    let _ = writeln!(
        s,
        "    label=\"{}\"; labelloc=t; fontsize=16; style=\"rounded\"; color=\"#90a4ae\";",
        esc(c.p.title)
    );
    // Nodes grouped by the layer they are drawn in (None: outside every layer).
    let mut by_layer: BTreeMap<Option<usize>, Vec<NodeId>> = BTreeMap::new();
    let mut collapsed_count: BTreeMap<usize, (usize, usize)> = BTreeMap::new();
    for &n in c.live.iter().filter(|&&n| !folded(g, n)) {
        match c.layer(n) {
            Some(l) if c.collapsed.contains(&l) => {
                let e = collapsed_count.entry(l).or_default();
                if g.node(n).is_ok_and(|x| x.op.is_leaf()) {
                    e.1 += 1;
                } else {
                    e.0 += 1;
                }
            }
            l => by_layer.entry(l).or_default().push(n),
        }
    }
    for (layer, nodes) in &by_layer {
        let indent = if let Some(l) = layer {
            let name = c.layers.as_ref().map(|x| x.name(*l)).unwrap_or_default();
            let _ = writeln!(s, "    subgraph cluster_{}_layer{l} {{", c.prefix);
            let _ = writeln!(
                s,
                "      label=\"{}\"; style=\"dashed,rounded\"; color=\"#7e57c2\"; fontsize=12;",
                esc(&name)
            );
            "      "
        } else {
            "    "
        };
        for &n in nodes {
            node_stmt(s, c, n, opts, base, indent);
        }
        if layer.is_some() {
            let _ = writeln!(s, "    }}");
        }
    }
    for (l, (ops, leaves)) in &collapsed_count {
        let name = c.layers.as_ref().map(|x| x.name(*l)).unwrap_or_default();
        let _ = writeln!(
            s,
            "    {} [label=\"{}\\n{ops} ops, {leaves} parameters\\n(collapsed)\", shape=box3d, \
             style=filled, fillcolor=\"#d1c4e9\", tooltip=\"layer {} drawn as one box; pick \
             layers to draw with --layers\"];",
            c.layer_box(*l),
            esc(&name),
            esc(&name)
        );
    }
    // Edges between drawn nodes (a fused kernel's inputs go to the instructions reading them).
    let mut edges: Vec<(String, String, String)> = Vec::new();
    let mut seen: HashSet<(String, String)> = HashSet::new();
    for &n in &c.live {
        let Ok(node) = g.node(n) else { continue };
        let inner = c.is_collapsed(n);
        for (k, &i) in node.inputs.iter().enumerate() {
            if folded(g, i) || (inner && c.is_collapsed(i) && c.layer(i) == c.layer(n)) {
                continue;
            }
            let from = c.out_port(i);
            let tip = format!("{} : {}", c.label_num(i), g.ty(i));
            let targets: Vec<String> = match (&node.op, inner) {
                (_, true) => vec![c.layer_box(c.layer(n).unwrap_or(0))],
                (Op::Fused(kern), false) => kern
                    .instrs
                    .iter()
                    .enumerate()
                    .filter(|(_, ins)| ins.args.contains(&(k as u32)))
                    .map(|(j, _)| format!("{}_t{j}", c.node_id(n)))
                    .collect(),
                (_, false) => vec![c.node_id(n)],
            };
            for t in targets {
                if t != from && seen.insert((from.clone(), t.clone())) {
                    edges.push((from.clone(), t, tip.clone()));
                }
            }
        }
    }
    for (a, b, tip) in &edges {
        let _ = writeln!(s, "    {a} -> {b} [tooltip=\"{}\"];", esc(tip));
    }
    // Outputs, updates and guards.
    let mut k = 0;
    let mut root = |s: &mut String, text: String, n: NodeId, fill: &str| {
        let id = format!("{}r{k}", c.prefix);
        k += 1;
        let _ = writeln!(
            s,
            "    {id} [label=\"{}\", shape=house, style=filled, fillcolor=\"{fill}\", fontsize=9];",
            esc(&text)
        );
        let _ = writeln!(s, "    {} -> {id};", c.out_port(n));
    };
    for (name, n) in &g.outputs {
        root(s, format!("output {name}"), *n, "#a5d6a7");
    }
    for (p, n) in &g.updates {
        let name = g.params.get(*p as usize).map_or("?", |d| d.name.as_str());
        root(s, format!("update {}", clip(name, 28)), *n, "#ffccbc");
    }
    for (name, n) in &g.guards {
        root(s, format!("guard {}", clip(name, 28)), *n, "#f8bbd0");
    }
    let _ = writeln!(s, "  }}");
}

fn node_stmt(
    s: &mut String,
    c: &PanelCtx,
    n: NodeId,
    opts: &DotOptions,
    base: Option<&HashSet<usize>>,
    indent: &str,
) {
    let g = c.p.graph;
    let Ok(node) = g.node(n) else { return };
    let k = kind(&node.op);
    let tip = tooltip(c, n, opts);
    let id = c.node_id(n);
    if let Op::Fused(kern) = &node.op {
        let _ = writeln!(s, "{indent}subgraph cluster_{id} {{");
        let _ = writeln!(
            s,
            "{indent}  label=\"{} fused kernel, {} ops\\n{}\"; style=\"filled,rounded\"; \
             fillcolor=\"#fff8e1\"; color=\"#ff8f00\"; fontsize=10; tooltip=\"{}\";",
            c.label_num(n),
            kern.instrs
                .iter()
                .filter(|i| !matches!(i.op, Op::Full { .. }))
                .count(),
            node.ty,
            esc(&tip)
        );
        let locs = g.provenance.fused.get(&n);
        for (j, ins) in kern.instrs.iter().enumerate() {
            if matches!(ins.op, Op::Full { .. }) {
                continue;
            }
            let mut itip = format!("{} : {}", instr_text(kern, j), ins.dtype);
            if let Some(Some(l)) = locs.and_then(|v| v.get(j)) {
                let _ = write!(itip, "\nbuilt at {l}");
            }
            if j + 1 == kern.instrs.len() {
                let _ = write!(itip, "\n{tip}");
            }
            let _ = writeln!(
                s,
                "{indent}  {id}_t{j} [label=\"{}\", {}, tooltip=\"{}\"];",
                esc(&clip(&instr_text(kern, j), 40)),
                style(Kind::Elementwise, false),
                esc(&itip)
            );
        }
        for (j, ins) in kern.instrs.iter().enumerate() {
            for &a in &ins.args {
                if a < kern.n_inputs {
                    continue;
                }
                let t = (a - kern.n_inputs) as usize;
                if !matches!(
                    kern.instrs.get(t).map(|i| &i.op),
                    Some(Op::Full { .. }) | None
                ) {
                    let _ = writeln!(s, "{indent}  {id}_t{t} -> {id}_t{j};");
                }
            }
        }
        let _ = writeln!(s, "{indent}}}");
        return;
    }
    let recognized = matches!(k, Kind::Library(_))
        && base.is_some_and(|b| !b.contains(&node.op.variant_index()));
    let _ = writeln!(
        s,
        "{indent}{id} [label=\"{}\", {}, tooltip=\"{}\"];",
        esc(&label(c, n, recognized)),
        style(k, recognized),
        esc(&tip)
    );
}

fn legend(s: &mut String) {
    s.push_str("  subgraph cluster_legend {\n");
    s.push_str("    label=\"legend\"; style=\"rounded\"; color=\"#b0bec5\"; fontsize=11;\n");
    let items: [(&str, Kind, bool); 8] = [
        ("input", Kind::Input, false),
        ("parameter", Kind::Param, false),
        ("elementwise", Kind::Elementwise, false),
        ("reduction", Kind::Reduce, false),
        ("movement", Kind::Movement, false),
        ("library op", Kind::Library(""), false),
        ("recognized by\nthe optimizer", Kind::Library(""), true),
        ("indexing", Kind::Index, false),
    ];
    let mut ids = Vec::new();
    for (i, (text, k, rec)) in items.iter().enumerate() {
        let id = format!("legend{i}");
        let _ = writeln!(
            s,
            "    {id} [label=\"{}\", {}];",
            esc(text),
            style(*k, *rec)
        );
        ids.push(id);
    }
    s.push_str(
        "    legend_fused [label=\"fused kernel\", shape=box, style=\"filled,rounded\", \
         fillcolor=\"#fff8e1\", color=\"#ff8f00\"];\n",
    );
    ids.push("legend_fused".into());
    let _ = writeln!(s, "    {{ rank=same; {}; }}", ids.join("; "));
    s.push_str("  }\n");
}

/// A one-line summary of a node for lists: `%5 matmul_epilogue[bias,act=relu] : f32[4,8]`.
pub fn node_summary(graph: &Graph, n: NodeId, numbers: &HashMap<NodeId, usize>) -> String {
    let num = numbers
        .get(&n)
        .map_or_else(|| format!("%?{}", n.index()), |k| format!("%{k}"));
    match graph.node(n) {
        Ok(node) => format!("{num} {} : {}", op_summary(&node.op), node.ty),
        Err(_) => format!("{num} <missing>"),
    }
}
