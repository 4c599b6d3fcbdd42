//! A report of a static memory plan: the arena's size (the plan's peak), the step at which the
//! most bytes are live, and the largest values live then with the ops that made them and where
//! the builder made those.

use super::{human_bytes, node_numbers, op_summary};
use crate::graph::{Graph, NodeId};
use crate::plan::MemoryPlan;
use rustytorch_ops::TensorType;
use std::fmt::{self, Write as _};

/// One value of the arena live at the peak.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LiveValue {
    /// The node (its `%N` number in the IR text).
    pub number: usize,
    /// The node's id in the graph.
    pub node: NodeId,
    /// The op that made it ([`op_summary`]).
    pub op: String,
    /// Its type.
    pub ty: TensorType,
    /// Bytes reserved for it in the arena.
    pub bytes: usize,
    /// Its arena offset.
    pub offset: usize,
    /// The schedule positions it is live over (defined at `first`, last read at `last`).
    pub first: usize,
    /// See `first`; past the schedule's end for values the caller reads.
    pub last: usize,
    /// Where the builder made it, when known.
    pub location: Option<String>,
}

/// What a memory plan holds at its peak.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryReport {
    /// The arena's size: the plan's peak (placement included).
    pub arena_bytes: usize,
    /// One buffer per value instead.
    pub naive_bytes: usize,
    /// Values with an arena slot.
    pub values: usize,
    /// Values written in place over an operand.
    pub inplace: usize,
    /// Values that alias another's bytes (reshapes).
    pub aliases: usize,
    /// The most bytes live at one step (at most `arena_bytes`; less when placement leaves gaps).
    pub peak_live_bytes: usize,
    /// The schedule position of that step.
    pub peak_position: usize,
    /// The node computed at that step, with its `%N` number.
    pub peak_node: Option<(usize, String)>,
    /// The steps in the schedule.
    pub schedule_len: usize,
    /// The arena values live at that step, largest first.
    pub at_peak: Vec<LiveValue>,
}

/// The report of `plan`, the memory plan of `graph`.
pub fn memory_report(graph: &Graph, plan: &MemoryPlan) -> MemoryReport {
    let numbers = node_numbers(graph);
    let len = plan.schedule.len();
    // Bytes live at each position: a slot from `first` to `last`, except that a value written
    // in place shares its donor's bytes at the step that defines it.
    let mut delta = vec![0i64; len + 2];
    for s in plan.slots.values() {
        delta[s.first.min(len)] += s.size as i64;
        delta[(s.last + 1).min(len + 1)] -= s.size as i64;
        if s.inplace_of.is_some() {
            delta[s.first.min(len)] -= s.size as i64;
            delta[(s.first + 1).min(len + 1)] += s.size as i64;
        }
    }
    let (mut live, mut best, mut at) = (0i64, 0i64, 0usize);
    for (t, d) in delta.iter().enumerate().take(len.max(1)) {
        live += d;
        if live > best {
            best = live;
            at = t;
        }
    }
    let mut at_peak: Vec<LiveValue> = plan
        .slots
        .iter()
        .filter(|(_, s)| s.first <= at && at <= s.last)
        .filter(|(_, s)| !(s.inplace_of.is_some() && s.first == at && s.size > 0))
        .filter_map(|(&n, s)| {
            let node = graph.node(n).ok()?;
            Some(LiveValue {
                number: numbers.get(&n).copied().unwrap_or(usize::MAX),
                node: n,
                op: op_summary(&node.op),
                ty: node.ty.clone(),
                bytes: s.size,
                offset: s.offset,
                first: s.first,
                last: s.last,
                location: graph.location(n).map(|l| l.to_string()),
            })
        })
        .collect();
    at_peak.sort_by(|a, b| b.bytes.cmp(&a.bytes).then(a.number.cmp(&b.number)));
    let peak_node = plan.schedule.get(at).and_then(|&n| {
        let node = graph.node(n).ok()?;
        Some((numbers.get(&n).copied()?, op_summary(&node.op)))
    });
    MemoryReport {
        arena_bytes: plan.arena_bytes,
        naive_bytes: plan.naive_bytes,
        values: plan.slots.len(),
        inplace: plan.inplace_count(),
        aliases: plan.aliases.len(),
        peak_live_bytes: best.max(0) as usize,
        peak_position: at,
        peak_node,
        schedule_len: len,
        at_peak,
    }
}

impl MemoryReport {
    /// The report as text, listing at most `top` values.
    pub fn render(&self, top: usize) -> String {
        let mut s = String::new();
        let saved = if self.naive_bytes > 0 {
            100.0 * (1.0 - self.arena_bytes as f64 / self.naive_bytes as f64)
        } else {
            0.0
        };
        let _ = writeln!(
            s,
            "memory plan: arena {} (one buffer per value: {}, {saved:.1}% saved); {} values in \
             the arena, {} in place, {} aliases",
            human_bytes(self.arena_bytes as u64),
            human_bytes(self.naive_bytes as u64),
            self.values,
            self.inplace,
            self.aliases
        );
        if self.at_peak.is_empty() {
            return s;
        }
        let at = match &self.peak_node {
            Some((k, op)) => format!(" (%{k} {op})"),
            None => String::new(),
        };
        let _ = writeln!(
            s,
            "peak: {} live at step {} of {}{at}; largest values live then:",
            human_bytes(self.peak_live_bytes as u64),
            self.peak_position,
            self.schedule_len
        );
        for v in self.at_peak.iter().take(top) {
            let last = if v.last >= self.schedule_len {
                "end".to_string()
            } else {
                v.last.to_string()
            };
            let _ = write!(
                s,
                "  {:>10}  %{:<5} {:<28} {:<18} @{:#08x} steps {}..={last}",
                human_bytes(v.bytes as u64),
                v.number,
                clip(&v.op, 28),
                v.ty.to_string(),
                v.offset,
                v.first
            );
            if let Some(l) = &v.location {
                let _ = write!(s, "  built at {l}");
            }
            s.push('\n');
        }
        if self.at_peak.len() > top {
            let rest: usize = self.at_peak[top..].iter().map(|v| v.bytes).sum();
            let _ = writeln!(
                s,
                "  ... and {} smaller values ({})",
                self.at_peak.len() - top,
                human_bytes(rest as u64)
            );
        }
        s
    }
}

impl fmt::Display for MemoryReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.render(8))
    }
}

fn clip(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        return s.to_string();
    }
    let mut t: String = s.chars().take(max - 1).collect();
    t.push('…');
    t
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::GraphBuilder;
    use rustytorch_ops::DType;

    #[test]
    fn the_peak_holds_the_largest_live_values() {
        let g = GraphBuilder::new();
        let x = g.input("x", DType::F32, [64, 64]);
        let big = x.matmul(&x); // 16 KiB
        let small = big.sum(&[1], false); // 256 B
        let y = small.exp();
        g.output("y", &y);
        let graph = g.graph().unwrap();
        let plan = crate::plan::plan(&graph).unwrap();
        let r = memory_report(&graph, &plan);
        assert_eq!(r.arena_bytes, plan.arena_bytes);
        assert!(r.peak_live_bytes <= r.arena_bytes, "{r:?}");
        assert_eq!(r.at_peak[0].ty.shape.dims(), &[64, 64], "{r:?}");
        assert!(r.at_peak[0].op.starts_with("matmul"), "{r:?}");
        assert!(r.at_peak[0]
            .location
            .as_deref()
            .is_some_and(|l| l.contains("memory.rs")));
        let text = r.render(1);
        assert_eq!(r.peak_live_bytes, 64 * 64 * 4 + 256, "{r:?}");
        assert!(text.contains("peak: 16.2 KiB live"), "{text}");
        assert!(text.contains("matmul"), "{text}");
    }
}
