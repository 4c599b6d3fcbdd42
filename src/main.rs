//! The `rustytorch` command-line runner: run a graph file on `.npy` inputs, inspect a graph (IR,
//! parameter count, FLOPs, what each compile pass did), convert between graph files and IR
//! text, and import ONNX models.
//!
//! ```text
//! rustytorch run model.rtg --input x=x.npy --out results/ --device auto --memory-stats
//! rustytorch run model.rtg --input x=x.npy --anomaly
//! rustytorch run model.rtg --input x=x.npy --devices cuda:0,cuda:1
//! rustytorch inspect model.rtg --passes --device cuda
//! rustytorch inspect model.rtg --svg -o model.svg
//! rustytorch profile model.rtg --input x=x.npy --runs 20
//! rustytorch run model.rtg --input x=x.npy --trace run.json
//! rustytorch convert model.rtg --to text -o model.rtir
//! rustytorch import model.onnx -o model.rtg --dim batch=8
//! rustytorch run model.onnx --input x=x.npy
//! rustytorch embed --model ~/.cache/rustytorch/models/all-MiniLM-L6-v2 "A sentence." --out e.npy
//! ```

mod cli_observe;
mod embed;
mod onnx_cli;

use clap::{Parser, Subcommand, ValueEnum};
use rustytorch::compiler::{format, passes, text, Graph};
use rustytorch::{npy, stats, CompileOptions, DType, Device, Executable, HostTensor};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// Runs, inspects and converts RustyTorch graph files.
#[derive(Parser, Debug)]
#[command(name = "rustytorch", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Compiles a graph for inference and runs it on `.npy` inputs; writes each output as
    /// `<out>/<name>.npy` (names that sanitize to the same file get `_1`, `_2`, ... suffixes).
    Run {
        /// The graph: a graph file (`.rtg`), IR text (`.txt`, `.rtir`) or an ONNX model (`.onnx`).
        graph: PathBuf,
        /// An input as NAME=FILE.npy (repeat for each graph input).
        #[arg(short, long = "input", value_name = "NAME=FILE.npy")]
        inputs: Vec<String>,
        /// Directory for the output `.npy` files (created if missing).
        #[arg(short, long, default_value = ".")]
        out: PathBuf,
        /// Device: `cpu`, `cuda`, `cuda:N` or `auto` (the CPU for graphs too small for a GPU to
        /// win, else `cuda:0` when one is usable).
        #[arg(short, long, default_value = "cpu")]
        device: String,
        /// Data-parallel: one replica per listed device (`cpu,cpu` or `cuda:0,cuda:1`, all of one
        /// kind), each running an equal share of the batch (every input split along its first
        /// dim); the outputs are the replicas' outputs concatenated along their first dim.
        #[arg(long, value_name = "LIST", conflicts_with = "device")]
        devices: Option<String>,
        /// Also print the optimized IR.
        #[arg(short, long)]
        print: bool,
        /// After the run, print the device memory pool's statistics and the host↔device copies.
        #[arg(long)]
        memory_stats: bool,
        /// Anomaly mode: stop at the first NaN or infinite value any op produces and name the op
        /// (also on when `RUSTYTORCH_ANOMALY=1`; runs on the cpu).
        #[arg(long)]
        anomaly: bool,
        /// Write a Chrome trace (Perfetto, chrome://tracing) of the compile and the run, each
        /// step named by its op and source location (also `RUSTYTORCH_TRACE=FILE.json`).
        #[arg(long, value_name = "FILE.json")]
        trace: Option<PathBuf>,
    },
    /// Prints the IR text, the parameter count, a FLOP estimate and where `run --device` would
    /// place the graph.
    Inspect {
        /// The graph: a graph file (`.rtg`), IR text (`.txt`, `.rtir`) or an ONNX model (`.onnx`).
        graph: PathBuf,
        /// Also print the IR after each compile pass, pass timings and the memory plan.
        #[arg(long)]
        passes: bool,
        /// The device to show the placement for: `cpu`, `cuda`, `cuda:N` or `auto`.
        #[arg(short, long, default_value = "auto")]
        device: String,
        /// The size of a named dim to inspect the graph at, as NAME=SIZE (repeatable; a named
        /// dim not given keeps its default size).
        #[arg(long = "dim", value_name = "NAME=SIZE")]
        dims: Vec<String>,
        #[command(flatten)]
        picture: cli_observe::PictureArgs,
    },
    /// Times every step of a graph over several runs and prints per-op totals (calls, time,
    /// share, achieved GB/s and TFLOP/s against the device's limits), longest first.
    Profile(cli_observe::ProfileArgs),
    /// Sentence embeddings from a sentence-transformers BERT model folder, as JSON
    /// (`{"model":..., "dim":..., "embeddings":[[...], ...]}`) on stdout or in `--out`.
    Embed(embed::EmbedArgs),
    /// Imports an ONNX model (`.onnx`) as a graph file. `run`, `inspect`, `profile` and
    /// `convert` also take `.onnx` files directly, importing them on the fly.
    Import(onnx_cli::ImportArgs),
    /// Converts between a graph file and IR text.
    Convert {
        /// The graph: a graph file (`.rtg`), IR text (`.txt`, `.rtir`) or an ONNX model (`.onnx`).
        graph: PathBuf,
        /// The target format.
        #[arg(long, value_enum)]
        to: Target,
        /// The output path (default: the input's path with the target's extension).
        #[arg(short, long)]
        output: Option<PathBuf>,
    },
}

/// A file format to convert to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Target {
    /// IR text (`.rtir`).
    Text,
    /// A graph file with embedded parameters (`.rtg`).
    Rtg,
}

/// A user-facing error: one message, printed on stderr, exit code 1.
struct Failure(String);

impl<E: std::fmt::Display> From<E> for Failure {
    fn from(e: E) -> Failure {
        Failure(e.to_string())
    }
}

type Res<T> = Result<T, Failure>;

fn fail<T>(msg: impl Into<String>) -> Res<T> {
    Err(Failure(msg.into()))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match cli.command {
        Command::Run {
            graph,
            inputs,
            out,
            device,
            devices,
            print,
            memory_stats,
            anomaly,
            trace,
        } => match devices {
            Some(list) => run_parallel(&graph, &inputs, &out, &list, anomaly),
            None => run(
                &graph,
                &inputs,
                &out,
                &device,
                print,
                memory_stats,
                anomaly,
                trace.as_deref(),
            ),
        },
        Command::Inspect {
            graph,
            passes,
            device,
            dims,
            picture,
        } => inspect(&graph, passes, &device, &dims, &picture),
        Command::Profile(args) => cli_observe::run_profile(args),
        Command::Convert { graph, to, output } => convert(&graph, to, output),
        Command::Embed(args) => embed::run(args).map_err(Failure),
        Command::Import(args) => onnx_cli::run_import(args),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure(msg)) => {
            eprintln!("error: {msg}");
            ExitCode::FAILURE
        }
    }
}

/// Whether a path names IR text rather than a graph file.
fn is_text(path: &Path) -> bool {
    matches!(
        path.extension().and_then(|e| e.to_str()),
        Some("txt" | "rtir")
    )
}

/// Loads a graph file, IR text or an ONNX model.
fn load_graph(path: &Path) -> Res<Graph> {
    if onnx_cli::is_onnx(path) {
        onnx_cli::import_default(path)
    } else if is_text(path) {
        let src = std::fs::read_to_string(path)
            .map_err(|e| Failure(format!("{}: {e}", path.display())))?;
        text::parse(&src).map_err(|e| Failure(format!("{}: {e}", path.display())))
    } else {
        format::load(path).map_err(|e| Failure(format!("{}: {e}", path.display())))
    }
}

/// The graph's inputs, one per line, for error messages.
fn list_inputs(graph: &Graph) -> String {
    if graph.inputs.is_empty() {
        return "the graph has no inputs".into();
    }
    let mut s = String::from("the graph's inputs are:");
    for i in &graph.inputs {
        let _ = write!(s, "\n  {}: {}", i.name, graph.sym_type_text(i.node));
    }
    s
}

/// Parses the `NAME=FILE` arguments and reads each file as the graph input it names, converting
/// f32 data to bf16 where the input is bf16 (numpy has no bf16). Inputs not given are left out.
fn read_given_inputs(graph: &Graph, args: &[String]) -> Res<BTreeMap<String, HostTensor>> {
    let mut given: BTreeMap<String, HostTensor> = BTreeMap::new();
    for a in args {
        let Some((name, file)) = a.split_once('=') else {
            return fail(format!("--input `{a}`: expected NAME=FILE.npy"));
        };
        let Some(index) = graph.inputs.iter().position(|d| d.name == name) else {
            return fail(format!(
                "--input `{name}`: the graph has no input named `{name}`; {}",
                list_inputs(graph)
            ));
        };
        if given.contains_key(name) {
            return fail(format!("--input `{name}` is given twice"));
        }
        let def = &graph.inputs[index];
        let mut t =
            npy::read_npy(Path::new(file)).map_err(|e| Failure(format!("input `{name}`: {e}")))?;
        if def.ty.dtype == DType::BF16 && t.dtype() == DType::F32 {
            t = t.cast(DType::BF16);
        }
        // Named dims take any size here; the executable checks that the inputs agree on them.
        let (dtype_bad, shape_bad) = (
            t.dtype() != def.ty.dtype,
            !graph.input_fits(index, t.shape()),
        );
        if dtype_bad || shape_bad {
            let what = if dtype_bad && shape_bad {
                "dtype and shape"
            } else if dtype_bad {
                "dtype"
            } else {
                "shape"
            };
            let hint = if def.ty.dtype == DType::BF16 {
                " (bf16 inputs are read from f32 .npy files)"
            } else {
                ""
            };
            return fail(format!(
                "input `{name}` ({file}): wrong {what}: expected {}, got {}{hint}",
                graph.sym_type_text(def.node),
                t.ty()
            ));
        }
        given.insert(name.to_string(), t);
    }
    Ok(given)
}

/// [`read_given_inputs`], requiring every graph input; in the graph's input order.
fn read_inputs(graph: &Graph, args: &[String]) -> Res<Vec<(String, HostTensor)>> {
    let mut given = read_given_inputs(graph, args)?;
    let missing: Vec<&str> = graph
        .inputs
        .iter()
        .filter(|i| !given.contains_key(&i.name))
        .map(|i| i.name.as_str())
        .collect();
    if !missing.is_empty() {
        return fail(format!(
            "missing input{} {}: pass each as --input NAME=FILE.npy; {}",
            if missing.len() == 1 { "" } else { "s" },
            missing
                .iter()
                .map(|m| format!("`{m}`"))
                .collect::<Vec<_>>()
                .join(", "),
            list_inputs(graph)
        ));
    }
    // In the graph's input order.
    Ok(graph
        .inputs
        .iter()
        .filter_map(|i| given.remove_entry(&i.name))
        .collect())
}

/// A file name for an output: characters other than letters, digits, `-`, `_` and `.` become `_`.
fn file_stem(name: &str) -> String {
    let s: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                c
            } else {
                '_'
            }
        })
        .collect();
    if s.is_empty() || s.chars().all(|c| c == '.') {
        format!("output_{s}")
    } else {
        s
    }
}

/// A distinct file stem per output, in order: the sanitized name ([`file_stem`]), or for a
/// later output whose stem an earlier one already has (compared without case, for
/// case-insensitive file systems), the stem with the first free `_1`, `_2`, ... suffix.
fn file_stems<'a>(names: impl IntoIterator<Item = &'a str>) -> Vec<String> {
    let stems: Vec<String> = names.into_iter().map(file_stem).collect();
    let key = |s: &str| s.to_lowercase();
    let mut taken: std::collections::HashSet<String> = stems.iter().map(|s| key(s)).collect();
    let mut first: std::collections::HashSet<String> = std::collections::HashSet::new();
    stems
        .into_iter()
        .map(|stem| {
            if first.insert(key(&stem)) {
                return stem;
            }
            let free = (1..)
                .map(|k| format!("{stem}_{k}"))
                .find(|c| !taken.contains(&key(c)))
                .expect("a free suffix exists");
            taken.insert(key(&free));
            free
        })
        .collect()
}

/// One line describing an output: type, the first values, and per-row argmax of `[N, C]` logits.
fn summary(name: &str, t: &HostTensor) -> String {
    const SHOW: usize = 8;
    let v = t.to_f64_vec();
    let fmt_val = |x: f64| {
        if t.dtype().is_float() {
            format!("{x:.6}")
        } else {
            format!("{x}")
        }
    };
    let mut s = format!("{name}: {}", t.ty());
    let head: Vec<String> = v.iter().take(SHOW).map(|&x| fmt_val(x)).collect();
    let _ = write!(
        s,
        " = [{}{}]",
        head.join(", "),
        if v.len() > SHOW { ", ..." } else { "" }
    );
    if let [n, c] = t.dims() {
        if t.dtype().is_float() && *c > 1 && *n > 0 {
            let am: Vec<String> = v
                .chunks(*c)
                .take(SHOW * 2)
                .map(|row| {
                    let mut best = 0;
                    for (j, &x) in row.iter().enumerate() {
                        if x > row[best] {
                            best = j;
                        }
                    }
                    best.to_string()
                })
                .collect();
            let _ = write!(
                s,
                "; argmax per row: [{}{}]",
                am.join(", "),
                if *n > SHOW * 2 { ", ..." } else { "" }
            );
        }
    }
    s
}

/// Parses `--device`.
fn parse_device(device: &str) -> Res<Device> {
    Device::parse(device).map_or_else(
        || {
            fail(format!(
                "--device `{device}`: expected `cpu`, `cuda`, `cuda:N` or `auto`"
            ))
        },
        Ok,
    )
}

/// Compiles `graph` for inference on `device` (as `run` does), in anomaly mode when asked (or
/// when `RUSTYTORCH_ANOMALY=1`).
fn compile_for(graph: &Graph, device: Device, anomaly: bool) -> Res<Executable> {
    let mut opts = CompileOptions::inference();
    opts.anomaly |= anomaly;
    Ok(rustytorch::compile_graph(graph, device, &opts)?)
}

fn run(
    graph_path: &Path,
    args: &[String],
    out: &Path,
    device: &str,
    print: bool,
    memory_stats: bool,
    anomaly: bool,
    trace: Option<&Path>,
) -> Res<()> {
    let device = parse_device(device)?;
    let graph = if onnx_cli::is_onnx(graph_path) {
        onnx_cli::import_for_run(graph_path, args)?
    } else {
        load_graph(graph_path)?
    };
    if graph.outputs.is_empty() {
        return fail(format!(
            "{}: the graph declares no outputs; nothing to run",
            graph_path.display()
        ));
    }
    let inputs = read_inputs(&graph, args)?;
    let mut exe = compile_for(&graph, device, anomaly)?;
    if let Some(t) = trace {
        exe.trace_to(t)?;
    }
    if device == Device::Auto {
        println!("placement: {}", exe.placement());
    }
    if print {
        println!("{}", text::print_elided(exe.optimized_graph(), ELIDE));
    }
    let named: Vec<(&str, HostTensor)> = inputs
        .iter()
        .map(|(n, t)| (n.as_str(), t.clone()))
        .collect();
    let outs = exe.run(&named)?;
    if graph.has_named_dims() {
        println!("named dims: {}", exe.current_dims());
    }
    write_outputs(out, outs.iter())?;
    if memory_stats {
        cli_observe::print_memory_report(&exe);
        match exe.memory_stats() {
            Some(m) => println!("memory pool ({}):\n{m}", exe.device()),
            None => println!(
                "memory pool: the {} backend has no device pool (tensors are host memory)",
                exe.device()
            ),
        }
        let t = exe.transfers();
        println!(
            "transfers: {} host-to-device copies ({} bytes), {} device-to-host copies ({} bytes)",
            t.htod_copies, t.htod_bytes, t.dtoh_copies, t.dtoh_bytes
        );
    }
    Ok(())
}

/// Writes each output as `<out>/<stem>.npy` and prints a summary line per output.
fn write_outputs<'a>(out: &Path, outs: impl Iterator<Item = (&'a str, &'a HostTensor)>) -> Res<()> {
    std::fs::create_dir_all(out).map_err(|e| Failure(format!("{}: {e}", out.display())))?;
    let outs: Vec<(&str, &HostTensor)> = outs.collect();
    let stems = file_stems(outs.iter().map(|(n, _)| *n));
    for ((name, t), stem) in outs.into_iter().zip(stems) {
        let path = out.join(format!("{stem}.npy"));
        npy::write_npy(&path, t)?;
        println!("{}  -> {}", summary(name, t), path.display());
    }
    Ok(())
}

/// `run --devices LIST`: the inference graph data-parallel, one replica per listed device, each
/// on its shard of every input; each output the replicas' outputs concatenated along dim 0.
fn run_parallel(
    graph_path: &Path,
    args: &[String],
    out: &Path,
    list: &str,
    anomaly: bool,
) -> Res<()> {
    let devices = rustytorch::parallel::parse_devices(list)?;
    let graph = if onnx_cli::is_onnx(graph_path) {
        onnx_cli::import_for_run(graph_path, args)?
    } else {
        load_graph(graph_path)?
    };
    if graph.outputs.is_empty() {
        return fail(format!(
            "{}: the graph declares no outputs; nothing to run",
            graph_path.display()
        ));
    }
    if !graph.has_named_dims() {
        return fail(format!(
            "{}: --devices runs each replica on a shard of the batch, which needs a named batch \
             dim (this graph's shapes are fixed); run it with --device",
            graph_path.display()
        ));
    }
    let inputs = read_inputs(&graph, args)?;
    let mut opts = CompileOptions::inference();
    opts.anomaly |= anomaly;
    let mut dp = rustytorch::parallel::DataParallel::new(&graph, &devices, &opts)?;
    println!("data-parallel over {list}: {} replicas", dp.world());
    let named: Vec<(&str, HostTensor)> = inputs
        .iter()
        .map(|(n, t)| (n.as_str(), t.clone()))
        .collect();
    let outs = dp.run(&named)?;
    let mut gathered = Vec::with_capacity(outs[0].len());
    for (i, name) in outs[0].names().iter().enumerate() {
        let parts: Vec<&HostTensor> = outs.iter().map(|o| &o[i]).collect();
        if parts[0].shape().dims().is_empty() {
            return fail(format!(
                "output `{name}` is a scalar: --devices splits every input along its first dim \
                 and concatenates the outputs along theirs; run this graph with --device"
            ));
        }
        let op = rustytorch::ops::Op::Concat { axis: 0 };
        gathered.push((name.as_str(), rustytorch::ops::eval_cpu(&op, &parts)?));
    }
    write_outputs(out, gathered.iter().map(|(n, t)| (*n, t)))
}

/// Tensors with more elements than this print as `[... N values]` in `inspect`.
const ELIDE: usize = 16;

/// The sizes of the graph's named dims: the defaults, with `NAME=SIZE` arguments applied.
fn dim_sizes(graph: &Graph, args: &[String]) -> Res<Vec<usize>> {
    let named = &graph.dims.named;
    let mut sizes = graph.dims.defaults();
    let known = || {
        if named.is_empty() {
            "the graph has no named dims".to_string()
        } else {
            let n: Vec<String> = named
                .iter()
                .map(|d| format!("`{}` (default {})", d.name, d.size))
                .collect();
            format!("the graph's named dims are {}", n.join(", "))
        }
    };
    for a in args {
        let Some((name, size)) = a.split_once('=') else {
            return fail(format!("--dim `{a}`: expected NAME=SIZE"));
        };
        let Some(k) = named.iter().position(|d| d.name == name) else {
            return fail(format!("--dim `{a}`: no named dim `{name}`; {}", known()));
        };
        sizes[k] = match size.parse::<usize>() {
            Ok(n) if n > 0 => n,
            _ => return fail(format!("--dim `{a}`: the size must be a positive integer")),
        };
    }
    Ok(sizes)
}

fn inspect(
    graph_path: &Path,
    show_passes: bool,
    device: &str,
    dims: &[String],
    picture: &cli_observe::PictureArgs,
) -> Res<()> {
    let device = parse_device(device)?;
    // An ONNX model is imported with the given sizes as its named dims' defaults: its
    // `Shape`-derived values fold at import, so specializing afterwards could not follow them.
    let source = if onnx_cli::is_onnx(graph_path) {
        onnx_cli::import_with_defaults(graph_path, dims)?
    } else {
        load_graph(graph_path)?
    };
    // A graph with named dims is inspected at one size of them (the defaults unless given).
    let sizes = dim_sizes(&source, dims)?;
    let graph = source.specialize(&sizes)?;
    if picture.wanted() {
        cli_observe::picture(&graph, show_passes, picture)?;
        if picture.output.is_none() {
            // The picture is stdout.
            return Ok(());
        }
    }
    println!("{}", text::print_elided(&source, ELIDE));
    if source.has_named_dims() {
        let at: Vec<String> = source
            .dims
            .named
            .iter()
            .zip(&sizes)
            .map(|(d, &n)| {
                if n == d.size {
                    format!("{}={n} (default)", d.name)
                } else {
                    format!("{}={n}", d.name)
                }
            })
            .collect();
        println!(
            "named dims: {} (the figures below are for these sizes; --dim NAME=SIZE)",
            at.join(", ")
        );
    }
    let trainable = graph.params.iter().filter(|p| p.trainable).count();
    println!(
        "parameters: {} elements in {} trainable tensors ({} tensors in all)",
        graph.param_count(),
        trainable,
        graph.params.len()
    );
    let f = stats::flops(&graph);
    println!("flops: {f} ({}FLOP per run)", stats::si(f));
    if !graph.outputs.is_empty() {
        // Where `run --device` puts it: the inference graph, compiled as `run` compiles it.
        let exe = compile_for(&graph, device, false)?;
        println!("placement (--device {device}): {}", exe.placement());
        cli_observe::print_memory_report(&exe);
    }
    if show_passes {
        let opts = passes::Options {
            dump: vec!["all".into()],
            ..Default::default()
        };
        let compiled = passes::run(&graph, &opts)?;
        let r = &compiled.report;
        for (pass, ir) in &r.dumps {
            // The dumps hold every value; show them with long tensors elided like the source.
            let shown = text::parse(ir)
                .map(|g| text::print_elided(&g, ELIDE))
                .unwrap_or_else(|_| ir.clone());
            println!("\n=== after {pass} ===\n{shown}");
        }
        println!("\npasses:");
        for p in &r.passes {
            println!(
                "  {:<10} {:>10.3} ms  {:>6} nodes",
                p.name, p.millis, p.nodes
            );
        }
        if let Some(o) = &r.optimize {
            println!(
                "optimize: {:?} after {} iterations, {} e-nodes, cost {:.3e} -> {:.3e}",
                o.stop_reason, o.iterations, o.egraph_nodes, o.cost_before, o.cost_after
            );
        }
        if let Some(m) = &r.memory {
            let saved = if m.naive_bytes > 0 {
                100.0 * (1.0 - m.arena_bytes as f64 / m.naive_bytes as f64)
            } else {
                0.0
            };
            println!(
                "memory plan: peak {} bytes vs naive {} bytes ({saved:.1}% saved), {} values, {} in place",
                m.arena_bytes,
                m.naive_bytes,
                m.slots.len(),
                m.inplace_count()
            );
        }
    }
    Ok(())
}

fn convert(graph_path: &Path, to: Target, output: Option<PathBuf>) -> Res<()> {
    let graph = load_graph(graph_path)?;
    let out = output.unwrap_or_else(|| {
        graph_path.with_extension(match to {
            Target::Text => "rtir",
            Target::Rtg => "rtg",
        })
    });
    if out == graph_path {
        return fail(format!(
            "{}: the output would overwrite the input; give -o",
            out.display()
        ));
    }
    match to {
        Target::Text => std::fs::write(&out, text::print(&graph))
            .map_err(|e| Failure(format!("{}: {e}", out.display())))?,
        Target::Rtg => format::save(&graph, &out, format::ParamStorage::Embedded)
            .map_err(|e| Failure(format!("{}: {e}", out.display())))?,
    }
    println!("wrote {}", out.display());
    Ok(())
}
