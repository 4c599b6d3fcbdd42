//! The runner's views inside a graph end to end: `inspect --dot/--svg` and its memory report,
//! `profile` (table and JSON, random inputs when none are given), `run --trace` and
//! `run --memory-stats`.

use rustytorch::compiler::format::{self, ParamStorage};
use rustytorch::prelude::*;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn scratch(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("observe-cli-{name}"));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A small MLP graph file in `dir`.
fn mlp_file(dir: &Path) -> PathBuf {
    let g = GraphBuilder::new();
    let x = g.input("x", DType::F32, [4, 16]);
    let w1 = g.param("w1", [16, 32], Init::kaiming_uniform(16, 1));
    let b1 = g.param("b1", [32], Init::zeros());
    let w2 = g.param("w2", [32, 8], Init::kaiming_uniform(32, 2));
    let h = x.matmul(&w1).add(&b1).gelu();
    g.output("y", &h.matmul(&w2).softmax(-1));
    let path = dir.join("mlp.rtg");
    format::save(&g.graph().unwrap(), &path, ParamStorage::Embedded).unwrap();
    path
}

fn cli(args: &[&str], path_env: Option<&str>) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_rustytorch"));
    c.args(args);
    if let Some(p) = path_env {
        c.env("PATH", p);
    }
    c.output().expect("the rustytorch binary runs")
}

fn ok(o: &Output) -> String {
    assert!(
        o.status.success(),
        "rustytorch failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn inspect_draws_dot_and_reports_memory() {
    let dir = scratch("inspect");
    let g = mlp_file(&dir);
    let gs = g.to_str().unwrap();
    let dot = ok(&cli(&["inspect", gs, "--dot"], None));
    assert!(dot.starts_with("digraph rustytorch {"), "{dot}");
    assert!(dot.contains("before optimization") && dot.contains("after optimization"));
    let per_pass = ok(&cli(&["inspect", gs, "--dot", "--passes"], None));
    assert!(per_pass.contains("after optimize") && per_pass.contains("after fuse (final)"));
    let file = dir.join("mlp.dot");
    let out = ok(&cli(
        &["inspect", gs, "--dot", "-o", file.to_str().unwrap()],
        None,
    ));
    assert!(std::fs::read_to_string(&file)
        .unwrap()
        .starts_with("digraph"));
    // With -o, the usual report prints too, the memory plan's among it.
    assert!(out.contains("memory plan: arena"), "{out}");
    assert!(out.contains("peak: "), "{out}");
    // A layer filter on a graph without repeated layers says that it draws everything.
    let o = cli(&["inspect", gs, "--dot", "--layers", "0"], None);
    assert!(ok(&o).starts_with("digraph"));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("no repeated layers"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn svg_needs_graphviz_and_says_how_to_install_it() {
    let dir = scratch("svg");
    let g = mlp_file(&dir);
    let empty = dir.join("empty-path");
    std::fs::create_dir_all(&empty).unwrap();
    let o = cli(
        &["inspect", g.to_str().unwrap(), "--svg"],
        Some(empty.to_str().unwrap()),
    );
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("apt-get install graphviz"), "{err}");
    // Where Graphviz is installed, the SVG is written.
    if Command::new("dot").arg("-V").output().is_ok() {
        let svg = dir.join("mlp.svg");
        ok(&cli(
            &[
                "inspect",
                g.to_str().unwrap(),
                "--svg",
                "-o",
                svg.to_str().unwrap(),
            ],
            None,
        ));
        let text = std::fs::read_to_string(&svg).unwrap();
        assert!(text.contains("<svg"), "{text}");
    }
}

#[test]
fn profile_prints_a_table_and_json_with_random_inputs() {
    let dir = scratch("profile");
    let g = mlp_file(&dir);
    let gs = g.to_str().unwrap();
    let table = ok(&cli(&["profile", gs, "--runs", "2"], None));
    assert!(table.contains("random inputs (not given): x"), "{table}");
    for col in ["Name", "Calls", "Share", "GB/s", "TFLOP/s"] {
        assert!(table.contains(col), "{col}: {table}");
    }
    assert!(table.contains("matmul_epilogue"), "{table}");
    let json: Value = serde_json::from_str(&ok(&cli(
        &["profile", gs, "--runs", "2", "--json", "--by-source"],
        None,
    )))
    .unwrap();
    assert_eq!(json["runs"].as_u64(), Some(2));
    let rows = json["rows"].as_array().unwrap();
    assert!(!rows.is_empty());
    let calls: u64 = rows.iter().map(|r| r["calls"].as_u64().unwrap()).sum();
    assert_eq!(calls, 2 * json["steps"].as_u64().unwrap());
}

#[test]
fn run_writes_a_trace_and_memory_stats() {
    let dir = scratch("trace");
    let g = mlp_file(&dir);
    let x = dir.join("x.npy");
    rustytorch::npy::write_npy(
        &x,
        &HostTensor::from_vec((0..64).map(|i| i as f32 / 64.0).collect(), [4, 16]).unwrap(),
    )
    .unwrap();
    let trace = dir.join("run.json");
    let out = ok(&cli(
        &[
            "run",
            g.to_str().unwrap(),
            "--input",
            &format!("x={}", x.display()),
            "--out",
            dir.to_str().unwrap(),
            "--trace",
            trace.to_str().unwrap(),
            "--memory-stats",
        ],
        None,
    ));
    assert!(out.contains("memory plan: arena"), "{out}");
    let t: Value = serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let ev = t["traceEvents"].as_array().unwrap();
    let steps: Vec<&str> = ev
        .iter()
        .filter(|e| e["cat"] == "step")
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    assert!(!steps.is_empty());
    assert!(
        steps.iter().any(|s| s.starts_with("matmul_epilogue")),
        "{steps:?}"
    );
    assert!(steps.iter().any(|s| s.starts_with("softmax")), "{steps:?}");
}
