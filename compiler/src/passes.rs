//! The compile pipeline: the one place that lists the passes in order. Each pass is a plain
//! function over the graph, timed in a `tracing` span, verified after it runs, and dumpable as IR
//! text (`RUSTYTORCH_DUMP=optimize,fuse` or `all` prints the graph after those passes to stderr).
//!
//! verify → layout (channels-last convolution stacks, when the target asks) → optimize (e-graph)
//! → autocast (mixed precision, when asked) → attention layout (attention reads its heads in
//! place, when the target asks) → accumulate (sums folded into matmuls) → fuse → plan memory

use crate::accumulate::{accumulate, AccumulateReport};
use crate::attn_layout::{attention_layout, AttnLayoutReport};
use crate::attn_packed::{attention_packed, AttnPackedReport};
use crate::autocast::{autocast, AutocastReport};
use crate::fuse::{fuse, FuseReport};
use crate::graph::Graph;
use crate::layout::{channels_last, ChannelsLast, LayoutReport};
use crate::optimize::{optimize, OptimizeConfig, OptimizeReport};
use crate::plan::{plan_with, MemoryPlan, PlanOptions};
use crate::Result;
use rustytorch_ops::DType;
use std::time::Instant;

/// Pipeline options.
#[derive(Clone, Debug)]
pub struct Options {
    /// Run the e-graph optimizer.
    pub optimize: bool,
    /// Run fusion.
    pub fuse: bool,
    /// Limits of the e-graph run.
    pub optimize_config: OptimizeConfig,
    /// Run convolution stacks channels-last where this accepts them (decided by the target:
    /// `None`, the default, on the CPU). Runs only with `optimize`.
    pub channels_last: Option<ChannelsLast>,
    /// Run matmuls, attention and convolutions of f32 graphs in this type (bf16 or f16; see
    /// [`crate::autocast`]). `None`, the default, leaves types as written.
    pub autocast: Option<DType>,
    /// Let attention read and write `[B, S, H, D]` heads in place instead of transposing them
    /// (decided by the target: its attention must take that layout; off by default). Runs only
    /// with `optimize`.
    pub attention_layout: bool,
    /// With `attention_layout`, whether attention gradients move to the `[B, S, H, D]` layout too
    /// (on by default; a target whose gradient kernel would transpose its operands itself keeps
    /// the graph's transposes, which the forward's rewrite leaves for the gradients).
    pub attention_layout_grads: bool,
    /// With `attention_layout`, whether attention reads q, k and v sliced from one tensor in
    /// place ([`crate::attn_packed`]; decided by the target, off by default).
    pub attention_packed: bool,
    /// Schedule the optimizer's per-parameter kernels (updates and finiteness guards) after the
    /// backward, level by level ([`crate::plan::PlanOptions::defer_tail`]), so that the target
    /// can launch each level as one multi-tensor kernel (decided by the target: on for CUDA, off
    /// by default, as it keeps every gradient live until then).
    pub defer_updates: bool,
    /// Fold `add(c, matmul)` into the matmul as an accumulated operand ([`crate::accumulate`]; on
    /// by default). Runs only with `optimize`.
    pub accumulate: bool,
    /// Passes whose output to keep as text (`all` for every pass); defaults to `RUSTYTORCH_DUMP`.
    pub dump: Vec<String>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            optimize: true,
            fuse: true,
            optimize_config: OptimizeConfig::default(),
            channels_last: None,
            autocast: None,
            attention_layout: false,
            attention_layout_grads: true,
            attention_packed: false,
            defer_updates: false,
            accumulate: true,
            dump: std::env::var("RUSTYTORCH_DUMP")
                .map(|s| s.split(',').map(|p| p.trim().to_string()).collect())
                .unwrap_or_default(),
        }
    }
}

/// One pass's timing.
#[derive(Clone, Debug)]
pub struct PassTiming {
    /// Pass name.
    pub name: &'static str,
    /// Wall time in milliseconds.
    pub millis: f64,
    /// Nodes in the graph after the pass.
    pub nodes: usize,
}

/// What the pipeline did.
#[derive(Clone, Debug, Default)]
pub struct Report {
    /// Each pass, in order.
    pub passes: Vec<PassTiming>,
    /// The channels-last pass.
    pub layout: Option<LayoutReport>,
    /// The e-graph run.
    pub optimize: Option<OptimizeReport>,
    /// The autocast pass.
    pub autocast: Option<AutocastReport>,
    /// The attention layout pass.
    pub attention_layout: Option<AttnLayoutReport>,
    /// The packed-attention pass.
    pub attention_packed: Option<AttnPackedReport>,
    /// The accumulate pass.
    pub accumulate: Option<AccumulateReport>,
    /// Fusion.
    pub fuse: Option<FuseReport>,
    /// The static memory plan.
    pub memory: Option<MemoryPlan>,
    /// IR text after each requested pass: (pass, text).
    pub dumps: Vec<(String, String)>,
}

/// The pipeline's result.
#[derive(Clone, Debug)]
pub struct Compiled {
    /// The final graph.
    pub graph: Graph,
    /// What happened.
    pub report: Report,
}

fn step(
    report: &mut Report,
    opts: &Options,
    name: &'static str,
    g: Graph,
    f: impl FnOnce(&Graph) -> Result<Graph>,
) -> Result<Graph> {
    let span = tracing::info_span!("pass", name);
    let _e = span.enter();
    let t = Instant::now();
    let out = f(&g)?;
    let millis = t.elapsed().as_secs_f64() * 1e3;
    if cfg!(debug_assertions) {
        out.verify()?;
    }
    tracing::debug!(pass = name, millis, nodes = out.len(), "pass done");
    report.passes.push(PassTiming {
        name,
        millis,
        nodes: out.len(),
    });
    if opts.dump.iter().any(|d| d == name || d == "all") {
        let text = crate::text::print(&out);
        eprintln!("=== after {name} ===\n{text}");
        report.dumps.push((name.to_string(), text));
    }
    Ok(out)
}

/// Runs the passes in order.
pub fn run(graph: &Graph, opts: &Options) -> Result<Compiled> {
    let mut report = Report::default();
    let mut g = step(&mut report, opts, "verify", graph.clone(), |g| {
        g.verify()?;
        let mut g = g.clone();
        g.remove_dead();
        Ok(g)
    })?;
    if let (true, Some(target)) = (opts.optimize, &opts.channels_last) {
        let mut rep = None;
        g = step(&mut report, opts, "layout", g, |g| {
            let (out, r) = channels_last(g, target)?;
            rep = Some(r);
            Ok(out)
        })?;
        report.layout = rep;
    }
    if opts.optimize {
        let mut rep = None;
        g = step(&mut report, opts, "optimize", g, |g| {
            let (mut out, r) = optimize(g, &opts.optimize_config)?;
            out.inherit_provenance(g);
            rep = Some(r);
            Ok(out)
        })?;
        report.optimize = rep;
    }
    if let Some(to) = opts.autocast {
        let mut rep = None;
        g = step(&mut report, opts, "autocast", g, |g| {
            let (mut out, r) = autocast(g, to)?;
            out.inherit_provenance(g);
            rep = Some(r);
            Ok(out)
        })?;
        report.autocast = rep;
    }
    if opts.optimize && opts.attention_layout {
        let mut rep = None;
        g = step(&mut report, opts, "attention_layout", g, |g| {
            let (out, r) = attention_layout(g, opts.attention_layout_grads)?;
            rep = Some(r);
            Ok(out)
        })?;
        report.attention_layout = rep;
    }
    if opts.optimize && opts.attention_layout && opts.attention_packed {
        let mut rep = None;
        g = step(&mut report, opts, "attention_packed", g, |g| {
            let (out, r) = attention_packed(g, opts.attention_layout_grads)?;
            rep = Some(r);
            Ok(out)
        })?;
        report.attention_packed = rep;
    }
    if opts.optimize && opts.accumulate {
        let mut rep = None;
        g = step(&mut report, opts, "accumulate", g, |g| {
            let (out, r) = accumulate(g)?;
            rep = Some(r);
            Ok(out)
        })?;
        report.accumulate = rep;
    }
    if opts.fuse {
        let mut rep = None;
        g = step(&mut report, opts, "fuse", g, |g| {
            let (out, r) = fuse(g)?;
            rep = Some(r);
            Ok(out)
        })?;
        report.fuse = rep;
    }
    let t = Instant::now();
    let mem = plan_with(
        &g,
        PlanOptions {
            defer_tail: opts.defer_updates,
        },
    )?;
    report.passes.push(PassTiming {
        name: "plan",
        millis: t.elapsed().as_secs_f64() * 1e3,
        nodes: g.len(),
    });
    report.memory = Some(mem);
    Ok(Compiled { graph: g, report })
}
