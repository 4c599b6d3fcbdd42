//! The runner's views inside a graph: `inspect --dot/--svg` (Graphviz pictures before and after
//! the passes), the memory report, and `profile` (per-op totals over timed runs).

use crate::{fail, load_graph, parse_device, read_given_inputs, Failure, Res};
use clap::Args;
use rustytorch::compiler::inspect::dot::{to_dot, DotOptions, LayerView, Panel};
use rustytorch::compiler::inspect::{find_layers, parse_layer_list};
use rustytorch::compiler::passes::{self, Compiled};
use rustytorch::compiler::Graph;
use rustytorch::profile::{fill_inputs, profile, GroupBy, ProfileOptions};
use rustytorch::{stats, CompileOptions, HostTensor};
use std::io::Write as _;
use std::path::PathBuf;
use std::process::{Command, Stdio};

/// Options of `inspect` that draw the graph.
#[derive(Args, Debug, Default)]
pub struct PictureArgs {
    /// Write the graph as Graphviz DOT: before and after optimization side by side (with
    /// `--passes`, after each pass), fused kernels as clusters of the ops they absorbed,
    /// recognized library ops marked, memory-plan offsets in hover labels. Printed on stdout
    /// unless `-o` names a file.
    #[arg(long)]
    pub dot: bool,
    /// Render the picture as SVG with Graphviz's `dot` program (install it with
    /// `apt-get install graphviz`, `brew install graphviz` or from graphviz.org).
    #[arg(long)]
    pub svg: bool,
    /// The file for `--dot` or `--svg` (the rest of `inspect`'s report still prints).
    #[arg(short = 'o', long = "output", value_name = "FILE")]
    pub output: Option<PathBuf>,
    /// Repeated layers (found from parameter names such as `h3.attn.q.w`) to draw in full,
    /// e.g. `0`, `0,11` or `2-4`; the others are drawn as one box each. `all` draws every
    /// layer; by default a picture of more than 400 nodes draws only the first in full.
    #[arg(long, value_name = "LIST")]
    pub layers: Option<String>,
}

impl PictureArgs {
    /// Whether a picture was asked for.
    pub fn wanted(&self) -> bool {
        self.dot || self.svg
    }
}

/// Runs the passes with the given steps on, as `passes::run` would for a compile.
fn stage(graph: &Graph, optimize: bool, fuse: bool) -> Res<Compiled> {
    let opts = passes::Options {
        optimize,
        fuse,
        dump: vec![],
        ..Default::default()
    };
    Ok(passes::run(graph, &opts)?)
}

/// Draws `graph` before and after the passes (each pass with `per_pass`) and writes the DOT
/// or SVG where asked.
pub fn picture(graph: &Graph, per_pass: bool, args: &PictureArgs) -> Res<()> {
    let layers = match args.layers.as_deref() {
        None => LayerView::Auto,
        Some("all") => LayerView::All,
        Some(list) => LayerView::Only(
            parse_layer_list(list).map_err(|e| Failure(format!("--layers {e} (or `all`)")))?,
        ),
    };
    if args.layers.is_some() && find_layers(graph).is_none() {
        eprintln!(
            "--layers: this graph has no repeated layers (three or more layers of parameters \
             named like `h0.…` or `layers.3.…`), so every node is drawn"
        );
    }
    let before = stage(graph, false, false)?;
    let mut stages: Vec<(String, Compiled)> = Vec::new();
    if per_pass {
        stages.push(("after optimize".into(), stage(graph, true, false)?));
        stages.push(("after fuse (final)".into(), stage(graph, true, true)?));
    } else {
        stages.push(("after optimization".into(), stage(graph, true, true)?));
    }
    let title = |what: &str, c: &Compiled| {
        let kernels = c
            .graph
            .live_order()
            .into_iter()
            .filter(|&n| c.graph.node(n).is_ok_and(|x| !x.op.is_leaf()))
            .count();
        format!("{what}: {kernels} ops")
    };
    let titles: Vec<String> = std::iter::once(title("before optimization", &before))
        .chain(stages.iter().map(|(w, c)| title(w, c)))
        .collect();
    let mut panels = vec![Panel {
        title: &titles[0],
        graph: &before.graph,
        memory: before.report.memory.as_ref(),
    }];
    for (i, (_, c)) in stages.iter().enumerate() {
        panels.push(Panel {
            title: &titles[i + 1],
            graph: &c.graph,
            memory: c.report.memory.as_ref(),
        });
    }
    let flops = |g: &Graph, n| {
        let f = stats::node_flops(g, n);
        (f > 0).then(|| format!("{}FLOP per run", stats::si(f)))
    };
    let opts = DotOptions {
        layers,
        baseline: Some(&before.graph),
        annotate: Some(&flops),
        ..DotOptions::default()
    };
    let dot = to_dot(&panels, &opts);
    if !dot.collapsed.is_empty() {
        eprintln!(
            "collapsed layers {} into one box each (draw them with --layers LIST or --layers all)",
            dot.collapsed.join(", ")
        );
    }
    let bytes = if args.svg {
        render_svg(&dot.text)?
    } else {
        dot.text.into_bytes()
    };
    match &args.output {
        Some(path) => {
            std::fs::write(path, &bytes)
                .map_err(|e| Failure(format!("{}: {e}", path.display())))?;
            println!("wrote {}", path.display());
        }
        None => std::io::stdout()
            .write_all(&bytes)
            .map_err(|e| Failure(format!("stdout: {e}")))?,
    }
    Ok(())
}

/// SVG from DOT through Graphviz's `dot`.
fn render_svg(dot: &str) -> Res<Vec<u8>> {
    let child = Command::new("dot")
        .arg("-Tsvg")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut child =
        match child {
            Ok(c) => c,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return fail(
                "--svg needs Graphviz's `dot` program, which is not installed: install it with \
                 `apt-get install graphviz` (Debian, Ubuntu), `dnf install graphviz`, `brew \
                 install graphviz` or from graphviz.org; or write DOT with --dot and render it \
                 elsewhere",
            ),
            Err(e) => return fail(format!("cannot run Graphviz's `dot`: {e}")),
        };
    // Feed stdin from a thread so a large picture cannot deadlock on full pipes.
    let mut stdin = child.stdin.take().expect("stdin is piped");
    let text = dot.to_string();
    let writer = std::thread::spawn(move || stdin.write_all(text.as_bytes()));
    let out = child
        .wait_with_output()
        .map_err(|e| Failure(format!("Graphviz's `dot`: {e}")))?;
    let _ = writer.join();
    if !out.status.success() {
        return fail(format!(
            "Graphviz's `dot` failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(out.stdout)
}

/// Arguments of `profile`.
#[derive(Args, Debug)]
pub struct ProfileArgs {
    /// The graph: a graph file (`.rtg`) or IR text (`.txt`, `.rtir`).
    graph: PathBuf,
    /// An input as NAME=FILE.npy (repeatable). Inputs not given are filled with seeded random
    /// values (floats uniform in [-1, 1), integers 0 or 1, bools random), and the report says
    /// which.
    #[arg(short, long = "input", value_name = "NAME=FILE.npy")]
    inputs: Vec<String>,
    /// Device: `cpu`, `cuda`, `cuda:N` or `auto`.
    #[arg(short, long, default_value = "cpu")]
    device: String,
    /// Timed runs.
    #[arg(long, default_value_t = 10)]
    runs: usize,
    /// Untimed runs before them.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Print the profile as JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// One row per op and source location instead of per op.
    #[arg(long)]
    by_source: bool,
    /// Also write a Chrome trace of the runs (Perfetto, chrome://tracing).
    #[arg(long, value_name = "FILE.json")]
    trace: Option<PathBuf>,
}

/// `rustytorch profile`.
pub fn run_profile(a: ProfileArgs) -> Res<()> {
    let device = parse_device(&a.device)?;
    let graph = load_graph(&a.graph)?;
    if graph.outputs.is_empty() {
        return fail(format!(
            "{}: the graph declares no outputs; nothing to run",
            a.graph.display()
        ));
    }
    if a.runs == 0 {
        return fail("--runs must be at least 1");
    }
    let given: Vec<(String, HostTensor)> =
        read_given_inputs(&graph, &a.inputs)?.into_iter().collect();
    let (inputs, made) = fill_inputs(&graph, given, 0x5eed);
    let mut exe = rustytorch::compile_graph(&graph, device, &CompileOptions::inference())?;
    if let Some(t) = &a.trace {
        exe.trace_to(t)?;
    }
    let named: Vec<(&str, HostTensor)> = inputs
        .iter()
        .map(|(n, t)| (n.as_str(), t.clone()))
        .collect();
    let opts = ProfileOptions {
        runs: a.runs,
        warmup: a.warmup,
        group_by: if a.by_source {
            GroupBy::Source
        } else {
            GroupBy::Op
        },
        limits: None,
    };
    let p = profile(&mut exe, &named, &opts)?;
    if a.json {
        println!("{}", p.to_json());
    } else {
        if !made.is_empty() {
            println!("random inputs (not given): {}", made.join(", "));
        }
        print!("{p}");
        if let Some(t) = &a.trace {
            println!("trace: {}", t.display());
        }
    }
    Ok(())
}

/// Prints the static memory plan's report of a compiled graph.
pub fn print_memory_report(exe: &rustytorch::Executable) {
    if let Some(r) = exe.memory_report() {
        print!("{}", r.render(8));
    }
}
