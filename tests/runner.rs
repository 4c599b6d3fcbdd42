//! The `rustytorch` command-line runner end to end: graph files and `.npy` inputs in, `.npy`
//! outputs that match the library and a float64 reference; `inspect`; `convert` round trips;
//! devices (`auto`, `--memory-stats`); and clear errors (exit code 1, no panic) for missing,
//! unknown or mistyped inputs, broken files and devices that are not there.

use rustytorch::compiler::format::{self, ParamStorage};
use rustytorch::npy::{read_npy, write_npy};
use rustytorch::ops::testing::{assert_close, rand_tensor};
use rustytorch::prelude::*;
use rustytorch::TensorType;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A fresh scratch directory for one test.
fn scratch(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("runner-{name}"));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Runs the binary with these arguments.
fn cli(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_rustytorch"))
        .args(args)
        .output()
        .expect("the rustytorch binary runs")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Asserts a successful run and returns its stdout.
fn ok(o: &Output) -> String {
    assert!(
        o.status.success(),
        "rustytorch failed ({:?}):\n{}",
        o.status,
        stderr(o)
    );
    stdout(o)
}

/// Asserts a clean failure (exit code 1, an error message, no panic) and returns stderr.
fn fails(o: &Output) -> String {
    let err = stderr(o);
    assert_eq!(
        o.status.code(),
        Some(1),
        "expected exit code 1; stderr:\n{err}"
    );
    assert!(
        err.starts_with("error: "),
        "no error message on stderr:\n{err}"
    );
    assert!(!err.contains("panicked"), "the runner panicked:\n{err}");
    assert!(
        !err.contains("RUST_BACKTRACE"),
        "the runner panicked:\n{err}"
    );
    err
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// erf in float64 (Abramowitz & Stegun 7.1.26, |error| <= 1.5e-7).
fn erf(x: f64) -> f64 {
    let t = 1.0 / (1.0 + 0.3275911 * x.abs());
    let poly = t
        * (0.254829592
            + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))));
    let y = 1.0 - poly * (-x * x).exp();
    if x < 0.0 {
        -y
    } else {
        y
    }
}

/// `x·w + b` in float64, x [m, k], w [k, n], b [n].
fn linear(x: &[f64], w: &[f64], b: &[f64], m: usize, k: usize, n: usize) -> Vec<f64> {
    (0..m * n)
        .map(|idx| {
            let (i, j) = (idx / n, idx % n);
            b[j] + (0..k).map(|p| x[i * k + p] * w[p * n + j]).sum::<f64>()
        })
        .collect()
}

/// The MLP x [4, 16] -> linear 16x32 + gelu -> linear 32x10 -> softmax, output "probs", with
/// its parameter values embedded.
fn mlp() -> Graph {
    let g = GraphBuilder::new();
    let x = g.input("x", DType::F32, [4, 16]);
    let w1 = g.param("w1", [16, 32], Init::kaiming_uniform(16, 1));
    let b1 = g.param("b1", [32], Init::kaiming_uniform(16, 2));
    let w2 = g.param("w2", [32, 10], Init::kaiming_uniform(32, 3));
    let b2 = g.param("b2", [10], Init::kaiming_uniform(32, 4));
    let probs = x
        .linear(&w1, Some(&b1))
        .gelu()
        .linear(&w2, Some(&b2))
        .softmax(-1);
    g.output("probs", &probs);
    let mut graph = g.graph().unwrap();
    for p in &mut graph.params {
        p.data = Some(p.init.materialize(&p.ty).unwrap());
    }
    graph
}

/// The MLP's output in float64 from the graph's embedded parameters.
fn mlp_ref(graph: &Graph, x: &[f64]) -> Vec<f64> {
    let p = |n: &str| {
        graph
            .param_by_name(n)
            .and_then(|d| d.data.as_ref())
            .unwrap()
            .to_f64_vec()
    };
    let h: Vec<f64> = linear(x, &p("w1"), &p("b1"), 4, 16, 32)
        .into_iter()
        .map(|v| 0.5 * v * (1.0 + erf(v / std::f64::consts::SQRT_2)))
        .collect();
    let z = linear(&h, &p("w2"), &p("b2"), 4, 32, 10);
    z.chunks(10)
        .flat_map(|row| {
            let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = row.iter().map(|v| (v - m).exp()).collect();
            let s: f64 = e.iter().sum();
            e.into_iter().map(move |v| v / s)
        })
        .collect()
}

/// Writes the MLP graph file and an input; returns (graph, graph path, input path, input).
fn mlp_files(dir: &Path) -> (Graph, PathBuf, PathBuf, HostTensor) {
    let graph = mlp();
    let path = dir.join("mlp.rtg");
    format::save(&graph, &path, ParamStorage::Embedded).unwrap();
    let x = rand_tensor(&TensorType::new(DType::F32, [4, 16]), 42, -2.0, 2.0);
    let x_path = dir.join("x.npy");
    write_npy(&x_path, &x).unwrap();
    (graph, path, x_path, x)
}

#[test]
fn run_matches_the_library_and_a_float64_reference() {
    let dir = scratch("run");
    let (graph, path, x_path, x) = mlp_files(&dir);
    let out_dir = dir.join("out");
    let input = format!("x={}", s(&x_path));
    let o = cli(&["run", s(&path), "--input", &input, "--out", s(&out_dir)]);
    let text = ok(&o);
    assert!(
        text.contains("probs") && text.contains("f32[4,10]"),
        "{text}"
    );
    assert!(text.contains("argmax"), "{text}");

    let got = read_npy(&out_dir.join("probs.npy")).unwrap();
    assert_eq!(got.ty(), TensorType::new(DType::F32, [4, 10]));

    let mut exe =
        rustytorch::compile_graph(&graph, Device::Cpu, &CompileOptions::inference()).unwrap();
    let lib = exe.run(&[("x", x.clone())]).unwrap();
    assert_close(
        &got.to_f64_vec(),
        &lib.get("probs").unwrap().to_f64_vec(),
        1e-6,
        "runner vs library",
    );
    let want = mlp_ref(&graph, &x.to_f64_vec());
    assert_close(&got.to_f64_vec(), &want, 1e-5, "runner vs float64");
    // Rows are distributions, and not uniform ones.
    for row in want.chunks(10) {
        assert!((row.iter().sum::<f64>() - 1.0).abs() < 1e-9);
        assert!(row.iter().any(|v| (v - 0.1).abs() > 1e-3));
    }
}

#[test]
fn bf16_inputs_are_read_from_f32_npy() {
    let dir = scratch("bf16");
    let g = GraphBuilder::new();
    let x = g.input("x", DType::BF16, [2, 3]);
    let y = x.cast(DType::F32).mul_scalar(2.0);
    g.output("y", &y);
    let path = dir.join("bf16.rtg");
    format::save(&g.graph().unwrap(), &path, ParamStorage::Embedded).unwrap();
    let xs = rand_tensor(&TensorType::new(DType::F32, [2, 3]), 5, -3.0, 3.0);
    let x_path = dir.join("x.npy");
    write_npy(&x_path, &xs).unwrap();
    let input = format!("x={}", s(&x_path));
    ok(&cli(&["run", s(&path), "-i", &input, "--out", s(&dir)]));
    let got = read_npy(&dir.join("y.npy")).unwrap().to_f64_vec();
    let want: Vec<f64> = xs
        .to_f64_vec()
        .iter()
        .map(|&v| 2.0 * half::bf16::from_f64(v).to_f64())
        .collect();
    assert_close(&got, &want, 0.0, "2·bf16(x)");

    // An f64 file is not silently narrowed.
    let x64 = dir.join("x64.npy");
    write_npy(&x64, &xs.cast(DType::F64)).unwrap();
    let input = format!("x={}", s(&x64));
    let err = fails(&cli(&["run", s(&path), "-i", &input, "--out", s(&dir)]));
    assert!(
        err.contains("`x`") && err.contains("bf16[2,3]") && err.contains("f64[2,3]"),
        "{err}"
    );
}

#[test]
fn inspect_prints_ir_parameters_and_flops() {
    let dir = scratch("inspect");
    let (graph, path, _, _) = mlp_files(&dir);
    let text = ok(&cli(&["inspect", s(&path)]));
    let n = 16 * 32 + 32 + 32 * 10 + 10;
    assert_eq!(graph.param_count(), n);
    assert!(text.contains(&format!("parameters: {n} ")), "{text}");
    let flops = rustytorch::stats::flops(&graph);
    // Two matmuls dominate.
    assert!(flops >= 2 * 4 * 16 * 32 + 2 * 4 * 32 * 10, "{flops}");
    assert!(text.contains(&format!("flops: {flops} ")), "{text}");
    assert!(text.contains("probs"), "{text}");
    // The placement `run --device auto` would make: this graph is too small for a GPU.
    assert!(
        text.contains("placement (--device auto): cpu (auto: estimated"),
        "{text}"
    );
    let text = ok(&cli(&["inspect", s(&path), "--device", "cpu"]));
    assert!(
        text.contains("placement (--device cpu): cpu (requested)"),
        "{text}"
    );

    let text = ok(&cli(&["inspect", s(&path), "--passes"]));
    for part in [
        "=== after verify ===",
        "=== after fuse ===",
        "memory plan: peak",
        "naive",
    ] {
        assert!(text.contains(part), "`{part}` missing:\n{text}");
    }
}

#[test]
fn convert_round_trip_gives_the_same_outputs() {
    let dir = scratch("convert");
    let (_, path, x_path, _) = mlp_files(&dir);
    let input = format!("x={}", s(&x_path));
    let text_path = dir.join("mlp.rtir");
    let back = dir.join("back.rtg");
    ok(&cli(&[
        "convert",
        s(&path),
        "--to",
        "text",
        "-o",
        s(&text_path),
    ]));
    let ir = std::fs::read_to_string(&text_path).unwrap();
    assert!(ir.contains("probs"), "{ir}");
    ok(&cli(&[
        "convert",
        s(&text_path),
        "--to",
        "rtg",
        "-o",
        s(&back),
    ]));

    let mut results = Vec::new();
    for (tag, g) in [("orig", &path), ("text", &text_path), ("back", &back)] {
        let out = dir.join(tag);
        ok(&cli(&["run", s(g), "--input", &input, "--out", s(&out)]));
        results.push(read_npy(&out.join("probs.npy")).unwrap().to_f64_vec());
    }
    assert_eq!(results[0], results[1], "IR text gives other outputs");
    assert_eq!(
        results[0], results[2],
        "rtg -> text -> rtg gives other outputs"
    );
}

#[test]
fn missing_and_unknown_inputs_list_the_graph_inputs() {
    let dir = scratch("missing");
    let (_, path, x_path, _) = mlp_files(&dir);
    let err = fails(&cli(&["run", s(&path), "--out", s(&dir)]));
    assert!(err.contains("missing input `x`"), "{err}");
    assert!(err.contains("x: f32[4,16]"), "{err}");

    let input = format!("y={}", s(&x_path));
    let err = fails(&cli(&["run", s(&path), "--input", &input]));
    assert!(err.contains("`y`") && err.contains("x: f32[4,16]"), "{err}");

    let err = fails(&cli(&["run", s(&path), "--input", "x"]));
    assert!(err.contains("NAME=FILE"), "{err}");

    let err = fails(&cli(&["run", s(&path), "--input", "x=/nonexistent/x.npy"]));
    assert!(
        err.contains("`x`") && err.contains("/nonexistent/x.npy"),
        "{err}"
    );
}

#[test]
fn wrong_shape_names_input_expected_and_got() {
    let dir = scratch("shape");
    let (_, path, _, _) = mlp_files(&dir);
    let bad = dir.join("bad.npy");
    write_npy(
        &bad,
        &rand_tensor(&TensorType::new(DType::F32, [3, 16]), 1, -1.0, 1.0),
    )
    .unwrap();
    let input = format!("x={}", s(&bad));
    let err = fails(&cli(&["run", s(&path), "--input", &input]));
    assert!(err.contains("`x`") && err.contains("shape"), "{err}");
    assert!(
        err.contains("expected f32[4,16]") && err.contains("got f32[3,16]"),
        "{err}"
    );

    let bad = dir.join("bad64.npy");
    write_npy(
        &bad,
        &rand_tensor(&TensorType::new(DType::F64, [4, 16]), 1, -1.0, 1.0),
    )
    .unwrap();
    let input = format!("x={}", s(&bad));
    let err = fails(&cli(&["run", s(&path), "--input", &input]));
    assert!(err.contains("dtype") && err.contains("f64[4,16]"), "{err}");
}

#[test]
fn broken_graph_files_are_clean_errors() {
    let dir = scratch("corrupt");
    let (_, path, x_path, _) = mlp_files(&dir);
    let input = format!("x={}", s(&x_path));
    let bytes = std::fs::read(&path).unwrap();

    // Garbage, a truncated file, flipped bytes in the middle, and a missing file.
    let garbage = dir.join("garbage.rtg");
    std::fs::write(&garbage, b"this is not a graph file at all").unwrap();
    let truncated = dir.join("truncated.rtg");
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
    let flipped = dir.join("flipped.rtg");
    let mut f = bytes.clone();
    let mid = f.len() / 2;
    for b in &mut f[mid..(mid + 16).min(bytes.len())] {
        *b ^= 0x5a;
    }
    std::fs::write(&flipped, &f).unwrap();
    for p in [&garbage, &truncated, &flipped] {
        let err = fails(&cli(&["run", s(p), "--input", &input]));
        assert!(
            err.contains(s(p)),
            "the error does not name the file: {err}"
        );
        let err = fails(&cli(&["inspect", s(p)]));
        assert!(err.contains(s(p)), "{err}");
    }
    let err = fails(&cli(&[
        "run",
        s(&dir.join("absent.rtg")),
        "--input",
        &input,
    ]));
    assert!(err.contains("absent.rtg"), "{err}");

    // Bad IR text.
    let bad_text = dir.join("bad.rtir");
    std::fs::write(&bad_text, "%0 = frobnicate(%7)\n").unwrap();
    let err = fails(&cli(&["inspect", s(&bad_text)]));
    assert!(err.contains("bad.rtir"), "{err}");
}

#[test]
fn bad_device_is_an_error() {
    let dir = scratch("device");
    let (_, path, x_path, _) = mlp_files(&dir);
    let input = format!("x={}", s(&x_path));
    let err = fails(&cli(&[
        "run",
        s(&path),
        "--input",
        &input,
        "--device",
        "tpu",
    ]));
    assert!(
        err.contains("tpu") && err.contains("cuda:N") && err.contains("auto"),
        "{err}"
    );
    let err = fails(&cli(&["inspect", s(&path), "--device", "tpu"]));
    assert!(err.contains("tpu"), "{err}");
}

#[test]
fn cuda_without_a_gpu_is_a_clean_error() {
    if std::env::var("RUSTYTORCH_TEST_CUDA").as_deref() == Ok("1")
        || rustytorch::runtime::cuda_device_count().is_ok_and(|n| n > 0)
    {
        return; // A GPU is present: `--device cuda` is tested where it runs.
    }
    let dir = scratch("nocuda");
    let (_, path, x_path, _) = mlp_files(&dir);
    let input = format!("x={}", s(&x_path));
    for dev in ["cuda", "cuda:1"] {
        let err = fails(&cli(&[
            "run",
            s(&path),
            "--input",
            &input,
            "--out",
            s(&dir),
            "--device",
            dev,
        ]));
        let want = if dev == "cuda" { "cuda:0" } else { dev };
        assert!(err.contains(want), "{err}");
        assert!(!dir.join("probs.npy").exists(), "an output was written");
        let err = fails(&cli(&["inspect", s(&path), "--device", dev]));
        assert!(err.contains(want), "{err}");
    }
}

#[test]
fn auto_device_and_memory_stats() {
    let dir = scratch("auto");
    let (_, path, x_path, _) = mlp_files(&dir);
    let input = format!("x={}", s(&x_path));
    let text = ok(&cli(&[
        "run",
        s(&path),
        "--input",
        &input,
        "--out",
        s(&dir),
        "--device",
        "auto",
        "--memory-stats",
    ]));
    assert!(text.contains("placement: cpu (auto: estimated"), "{text}");
    assert!(text.contains("probs"), "{text}");
    assert!(
        text.contains("the cpu backend has no device pool"),
        "{text}"
    );
    assert!(
        text.contains("transfers: 0 host-to-device copies (0 bytes)"),
        "{text}"
    );
    assert!(dir.join("probs.npy").exists());
}

#[test]
fn outputs_whose_names_sanitize_alike_get_distinct_files() {
    let dir = scratch("collide");
    let g = GraphBuilder::new();
    let x = g.input("x", DType::F32, [2, 3]);
    g.output("a/b", &x.mul_scalar(2.0));
    g.output("a:b", &x.add_scalar(1.0));
    g.output("a_b_1", &x.sub_scalar(3.0));
    g.output("A b", &x.mul_scalar(-1.0));
    let path = dir.join("collide.rtg");
    format::save(&g.graph().unwrap(), &path, ParamStorage::Embedded).unwrap();
    let x = rand_tensor(&TensorType::new(DType::F32, [2, 3]), 7, -1.0, 1.0);
    let x_path = dir.join("x.npy");
    write_npy(&x_path, &x).unwrap();
    let out_dir = dir.join("out");
    let input = format!("x={}", s(&x_path));
    let text = ok(&cli(&[
        "run",
        s(&path),
        "--input",
        &input,
        "--out",
        s(&out_dir),
    ]));
    let xv = x.to_f64_vec();
    // In output order: `a/b` keeps the stem, `a:b` takes the first suffix no output has, and
    // `A b` differs from `a_b` only in case.
    for (file, f) in [
        ("a_b.npy", (|v| v * 2.0) as fn(f64) -> f64),
        ("a_b_2.npy", |v| v + 1.0),
        ("a_b_1.npy", |v| v - 3.0),
        ("A_b_3.npy", |v| -v),
    ] {
        let p = out_dir.join(file);
        assert!(text.contains(s(&p)), "{file} not reported:\n{text}");
        let got = read_npy(&p).unwrap().to_f64_vec();
        let want: Vec<f64> = xv.iter().map(|&v| f(v)).collect();
        assert_close(&got, &want, 1e-6, file);
    }
    assert_eq!(std::fs::read_dir(&out_dir).unwrap().count(), 4);
}
