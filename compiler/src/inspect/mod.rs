//! Seeing inside a graph: Graphviz pictures of it before and after the passes ([`dot`]) and a
//! report of its static memory plan ([`memory`]). Both number nodes as the IR text does (`%N`),
//! so a picture, a report and `rustytorch inspect`'s listing name the same node the same way.
//!
//! Repeated layers are found from parameter names ([`find_layers`]): the family of names with an
//! index (`h0.attn.q.w`, `layers.3.mlp.w`) that has the most distinct indices. A picture can
//! draw some layers in full and collapse the others into one box each.

pub mod dot;
pub mod memory;

use crate::graph::{Graph, NodeId};
use rustytorch_ops::Op;
use std::collections::{BTreeMap, BTreeSet, HashMap};

/// The `%N` number of every node, as [`crate::text::print`] writes it.
pub fn node_numbers(graph: &Graph) -> HashMap<NodeId, usize> {
    let (order, _) = crate::text::dense_order(graph);
    order
        .into_iter()
        .enumerate()
        .map(|(k, id)| (id, k))
        .collect()
}

/// The layer a parameter name belongs to: its family (`h#`, `layers.#`) and index, from the
/// first dotted (or `/`-separated) component that is a number (`layers.3`: family `layers.#`)
/// or ends in one after a letter (`h3`, `block12`: family `h#`, `block#`). Leading components
/// before a family-less prefix are ignored, so optimizer state (`adam_m.h3.w`) belongs to the
/// layer of its parameter.
pub fn layer_of_name(name: &str) -> Option<(String, usize)> {
    let parts: Vec<&str> = name.split(['.', '/']).collect();
    for (i, p) in parts.iter().enumerate() {
        if p.is_empty() {
            continue;
        }
        let digits = p.len() - p.trim_end_matches(|c: char| c.is_ascii_digit()).len();
        if digits == 0 || digits > 9 {
            continue;
        }
        let (stem, num) = p.split_at(p.len() - digits);
        let index: usize = num.parse().ok()?;
        if stem.is_empty() {
            if i == 0 {
                continue;
            }
            return Some((format!("{}.#", parts[i - 1]), index));
        }
        if stem.ends_with(|c: char| c.is_ascii_alphabetic() || c == '_') {
            return Some((format!("{stem}#"), index));
        }
    }
    None
}

/// Repeated layers of a graph, from its parameter names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layers {
    /// The name family (`h#` for `h0`, `h1`, ...).
    pub family: String,
    /// The layer indices present, in order.
    pub indices: BTreeSet<usize>,
    /// The layer of each node that belongs to one: a parameter by its name; a computed node by
    /// the parameters it reads directly (the largest index), else by its operands (the largest
    /// of theirs), so a layer holds the work from where its parameters come in until the next
    /// layer's do. Inputs, constants and what follows the last layer's parameters without
    /// reading a layer's parameter belong to the last layer they depend on.
    pub of_node: HashMap<NodeId, usize>,
}

impl Layers {
    /// The display name of layer `i` (`h3`, `layers.3`).
    pub fn name(&self, i: usize) -> String {
        self.family.replace('#', &i.to_string())
    }
}

/// The repeated layers of `graph`: the name family with the most distinct indices among the
/// parameters (at least three: `w1`, `w2` of a two-layer MLP are not repeated layers), None
/// when there is none.
pub fn find_layers(graph: &Graph) -> Option<Layers> {
    let mut families: BTreeMap<String, BTreeSet<usize>> = BTreeMap::new();
    let mut param_layer: HashMap<NodeId, (String, usize)> = HashMap::new();
    for p in &graph.params {
        if let Some((f, i)) = layer_of_name(&p.name) {
            families.entry(f.clone()).or_default().insert(i);
            param_layer.insert(p.node, (f, i));
        }
    }
    let (family, indices) = families
        .into_iter()
        .filter(|(_, ix)| ix.len() >= 3)
        .max_by(|a, b| a.1.len().cmp(&b.1.len()).then_with(|| b.0.cmp(&a.0)))?;
    let mut of_node: HashMap<NodeId, usize> = HashMap::new();
    for n in graph.live_order() {
        let Ok(node) = graph.node(n) else { continue };
        if let Op::Param { .. } = node.op {
            if let Some((f, i)) = param_layer.get(&n) {
                if *f == family {
                    of_node.insert(n, *i);
                }
            }
            continue;
        }
        if node.op.is_leaf() {
            continue;
        }
        let direct = node
            .inputs
            .iter()
            .filter(|i| {
                graph
                    .node(**i)
                    .is_ok_and(|x| matches!(x.op, Op::Param { .. }))
            })
            .filter_map(|i| of_node.get(i).copied())
            .max();
        let layer = direct.or_else(|| {
            node.inputs
                .iter()
                .filter_map(|i| of_node.get(i))
                .max()
                .copied()
        });
        if let Some(l) = layer {
            of_node.insert(n, l);
        }
    }
    Some(Layers {
        family,
        indices,
        of_node,
    })
}

/// Parses a list of layer indices: `3`, `0,2,5`, `1-4` (inclusive), or a mix (`0,4-6`).
pub fn parse_layer_list(s: &str) -> Result<BTreeSet<usize>, String> {
    let mut out = BTreeSet::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let num = |t: &str| {
            t.trim()
                .parse::<usize>()
                .map_err(|_| format!("`{part}`: expected a layer index or a range like 2-5"))
        };
        match part.split_once(['-', '.']) {
            Some((a, b)) => {
                let (a, b) = (num(a)?, num(b.trim_start_matches('.'))?);
                if a > b {
                    return Err(format!("`{part}`: the range is empty"));
                }
                if b - a > 100_000 {
                    return Err(format!("`{part}`: the range is too long"));
                }
                out.extend(a..=b);
            }
            None => {
                out.insert(num(part)?);
            }
        }
    }
    if out.is_empty() {
        return Err("no layer given".into());
    }
    Ok(out)
}

/// A byte count in binary units: `512 B`, `4.0 KiB`, `1.50 MiB`, `2.00 GiB`.
pub fn human_bytes(b: u64) -> String {
    const K: f64 = 1024.0;
    let f = b as f64;
    if b < 1024 {
        format!("{b} B")
    } else if f < K * K {
        format!("{:.1} KiB", f / K)
    } else if f < K * K * K {
        format!("{:.2} MiB", f / (K * K))
    } else {
        format!("{:.2} GiB", f / (K * K * K))
    }
}

/// A short description of the op a node runs: its text (`matmul_epilogue[bias,act=relu]`), or
/// for a fused kernel the ops it holds (`fused(mul, add, tanh)`; a row kernel's prologue, core and
/// epilogue: `fused_row(add -> layer_norm -> mul, add)`).
pub fn op_summary(op: &Op) -> String {
    match op {
        Op::Fused(k) => {
            let ops: Vec<&str> = k
                .instrs
                .iter()
                .filter(|i| !matches!(i.op, Op::Full { .. }))
                .map(|i| i.op.name())
                .collect();
            format!("fused({})", ops.join(", "))
        }
        // `fused_row(add -> layer_norm -> mul, add)`: the prologue's ops, the core, the epilogue's.
        Op::FusedRow(r) => {
            let ops = |k: &Option<rustytorch_ops::FusedKernel>| -> Vec<&str> {
                k.iter()
                    .flat_map(|k| &k.instrs)
                    .filter(|i| !matches!(i.op, Op::Full { .. }))
                    .map(|i| i.op.name())
                    .collect()
            };
            let mut parts = vec![];
            let pro = ops(&r.prologue);
            if !pro.is_empty() {
                parts.push(pro.join(", "));
            }
            parts.push(r.core.name().to_string());
            let epi = ops(&r.epilogue);
            if !epi.is_empty() {
                parts.push(epi.join(", "));
            }
            format!("fused_row({})", parts.join(" -> "))
        }
        op => op.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_names() {
        assert_eq!(layer_of_name("h3.attn.q.w"), Some(("h#".into(), 3)));
        assert_eq!(
            layer_of_name("layers.12.mlp.w"),
            Some(("layers.#".into(), 12))
        );
        assert_eq!(layer_of_name("adam_m.h3.attn.q.w"), Some(("h#".into(), 3)));
        assert_eq!(layer_of_name("conv1.w"), Some(("conv#".into(), 1)));
        assert_eq!(layer_of_name("ln_f.w"), None);
        assert_eq!(layer_of_name("w"), None);
        assert_eq!(layer_of_name("3.w"), None);
    }

    #[test]
    fn layer_lists() {
        assert_eq!(
            parse_layer_list("0, 4-6").unwrap(),
            BTreeSet::from([0, 4, 5, 6])
        );
        assert_eq!(parse_layer_list("2..3").unwrap(), BTreeSet::from([2, 3]));
        assert!(parse_layer_list("5-2").is_err());
        assert!(parse_layer_list("x").is_err());
        assert!(parse_layer_list("").is_err());
    }

    #[test]
    fn bytes() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(4096), "4.0 KiB");
        assert_eq!(human_bytes(3 << 20), "3.00 MiB");
    }
}
