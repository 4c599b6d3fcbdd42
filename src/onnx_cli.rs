//! The runner's ONNX side: `rustytorch import`, and `.onnx` files given to `run`, `inspect`,
//! `profile` and `convert` (imported on the fly).

use crate::{Failure, Res};
use rustytorch::compiler::{format, Graph};
use rustytorch::npy;
use rustytorch_onnx::{ImportOptions, OPSET_MAX, OPSET_MIN};
use std::path::{Path, PathBuf};

/// Imports an ONNX model as a graph file.
#[derive(clap::Args, Debug)]
pub struct ImportArgs {
    /// The ONNX model (`.onnx`); external data files are read from beside it.
    model: Option<PathBuf>,
    /// The graph file to write (default: the model's path with `.rtg`; `.rtir` writes IR text).
    #[arg(short, long)]
    output: Option<PathBuf>,
    /// The default size of a symbolic dimension, which becomes a named dim of the graph, as
    /// NAME=N (repeat for each; 1 where not given).
    #[arg(long = "dim", value_name = "NAME=N")]
    dims: Vec<String>,
    /// List the ONNX ops the importer converts, and exit.
    #[arg(long)]
    supported_ops: bool,
}

/// Whether a path names an ONNX model.
pub fn is_onnx(path: &Path) -> bool {
    path.extension().and_then(|e| e.to_str()) == Some("onnx")
}

/// Parses `NAME=N` dimension sizes.
fn parse_dims(args: &[String]) -> Res<ImportOptions> {
    let mut opts = ImportOptions::default();
    for a in args {
        let parsed = a
            .split_once('=')
            .and_then(|(n, v)| Some((n, v.parse::<usize>().ok()?)));
        let Some((name, n)) = parsed.filter(|(n, _)| !n.is_empty()) else {
            return Err(Failure(format!("--dim `{a}`: expected NAME=N")));
        };
        opts.dims.insert(name.to_string(), n);
    }
    Ok(opts)
}

fn import(path: &Path, opts: &ImportOptions) -> Res<Graph> {
    rustytorch_onnx::import_file(path, opts)
        .map_err(|e| Failure(format!("{}: {e}", path.display())))
}

/// `rustytorch import`.
pub fn run_import(args: ImportArgs) -> Res<()> {
    if args.supported_ops {
        println!(
            "ai.onnx opsets {OPSET_MIN}..={OPSET_MAX}; {} ops:",
            rustytorch_onnx::supported_ops().len()
        );
        for op in rustytorch_onnx::supported_ops() {
            println!("{op}");
        }
        return Ok(());
    }
    let Some(model) = args.model else {
        return Err(Failure(
            "give the model to import (or --supported-ops)".into(),
        ));
    };
    let opts = parse_dims(&args.dims)?;
    let graph = import(&model, &opts)?;
    let out = args.output.unwrap_or_else(|| model.with_extension("rtg"));
    let wrote = if matches!(
        out.extension().and_then(|e| e.to_str()),
        Some("rtir" | "txt")
    ) {
        std::fs::write(&out, rustytorch::compiler::text::print(&graph)).map_err(|e| e.to_string())
    } else {
        format::save(&graph, &out, format::ParamStorage::Embedded).map_err(|e| e.to_string())
    };
    wrote.map_err(|e| Failure(format!("{}: {e}", out.display())))?;
    println!(
        "imported {} nodes, {} inputs, {} parameters ({} elements), {} outputs -> {}",
        graph.len(),
        graph.inputs.len(),
        graph.params.len(),
        graph.param_count(),
        graph.outputs.len(),
        out.display()
    );
    Ok(())
}

/// Imports a model for `inspect`, `profile` and `convert`: symbolic dimensions become named
/// dims of default size 1 (`rustytorch import --dim NAME=N` gives other defaults).
pub fn import_default(path: &Path) -> Res<Graph> {
    import(path, &ImportOptions::default())
}

/// Imports a model for `inspect --dim NAME=N ...`: the symbolic dims named in `dims` take those
/// sizes as their defaults (the others 1).
pub fn import_with_defaults(path: &Path, dims: &[String]) -> Res<Graph> {
    import(path, &parse_dims(dims)?)
}

/// Integer inputs larger than this are not offered to the importer as known values.
const MAX_BOUND: usize = 1 << 16;
/// Other inputs up to this many elements are offered too.
const MAX_BOUND_FLOAT: usize = 16;

/// Imports a model for `run`: each symbolic dimension takes its size from the `.npy` input
/// that has it.
pub fn import_for_run(path: &Path, inputs: &[String]) -> Res<Graph> {
    let bytes = std::fs::read(path).map_err(|e| Failure(format!("{}: {e}", path.display())))?;
    let model = rustytorch_onnx::decode_model(&bytes)
        .map_err(|e| Failure(format!("{}: {e}", path.display())))?;
    let mut opts = ImportOptions {
        fixed_dims: true,
        ..Default::default()
    };
    // Integer inputs (and small float ones) are given to the importer too: where one sets a
    // shape, axes, pads, scales or a depth, the graph is specialized on its value.
    for a in inputs {
        if let Some((name, file)) = a.split_once('=') {
            if let Ok(t) = npy::read_npy(Path::new(file)) {
                let small = t.numel() <= MAX_BOUND_FLOAT;
                if (t.dtype().is_int() && t.numel() <= MAX_BOUND) || small {
                    opts.input_values.insert(name.to_string(), t);
                }
            }
        }
    }
    for (input, axis, name) in rustytorch_onnx::symbolic_dims(&model) {
        let Some(file) = inputs
            .iter()
            .filter_map(|a| a.split_once('='))
            .find(|(n, _)| *n == input)
            .map(|(_, f)| f)
        else {
            continue; // reported as a missing input
        };
        let t =
            npy::read_npy(Path::new(file)).map_err(|e| Failure(format!("input `{input}`: {e}")))?;
        let Some(&n) = t.dims().get(axis) else {
            return Err(Failure(format!(
                "input `{input}` ({file}): rank {} has no dim {axis} (`{name}`)",
                t.dims().len()
            )));
        };
        if let Some(&m) = opts.dims.get(&name) {
            if m != n {
                return Err(Failure(format!(
                    "symbolic dimension `{name}` is {m} in one input and {n} in `{input}`"
                )));
            }
        }
        opts.dims.insert(name, n);
    }
    let dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
    let dir = if dir.as_os_str().is_empty() {
        PathBuf::from(".")
    } else {
        dir
    };
    rustytorch_onnx::import_bytes(&bytes, Some(&dir), &opts)
        .map_err(|e| Failure(format!("{}: {e}", path.display())))
}
