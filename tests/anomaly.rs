//! Anomaly mode: the first NaN or infinite value any step produces fails the run with an error
//! naming the op, the step, the value's type and where the value was built, down to the original
//! op inside a fused kernel; off, runs are unchanged. Also `RUSTYTORCH_ANOMALY=1` and the
//! runner's `--anomaly`, and `optimize: false` turning fusion off.

use rustytorch::compiler::format::{self, ParamStorage};
use rustytorch::npy::write_npy;
use rustytorch::ops::Op;
use rustytorch::prelude::*;
use rustytorch::{Anomaly, Error};
use std::path::PathBuf;
use std::process::Command;

fn opts(anomaly: bool) -> CompileOptions {
    CompileOptions {
        anomaly,
        ..CompileOptions::inference()
    }
}

/// `x [4, 8]` through an elementwise chain with `log(x - 5.5)` in its middle; returns the
/// builder, the output and the line of the `log`.
fn log_chain() -> (GraphBuilder, Tensor, u32) {
    let g = GraphBuilder::new();
    let x = g.input("x", DType::F32, [4, 8]);
    let c = x.sub_scalar(5.5);
    let (l, log_line) = (c.log(), line!());
    let y = l.mul_scalar(3.0).add(&x).tanh();
    g.output("y", &y);
    (g, y, log_line)
}

/// `10 - i`: `x - 5.5` is negative from element 5 on.
fn descending() -> HostTensor {
    HostTensor::from_vec((0..32).map(|i| 10.0 - i as f32).collect(), [4, 8]).unwrap()
}

/// Positive everywhere past 5.5.
fn large() -> HostTensor {
    HostTensor::from_vec((0..32).map(|i| 6.0 + i as f32).collect(), [4, 8]).unwrap()
}

fn anomaly_of(r: Result<rustytorch::Outputs, Error>) -> Anomaly {
    match r {
        Err(Error::Anomaly(a)) => *a,
        Err(e) => panic!("expected an anomaly, got: {e}"),
        Ok(_) => panic!("expected an anomaly, the run succeeded"),
    }
}

#[test]
fn log_of_a_negative_inside_a_fused_chain_names_log_and_its_line() {
    let (g, y, log_line) = log_chain();
    let mut exe = compile_with(&g, &[&y], Device::Cpu, &opts(true)).unwrap();
    // The chain is one fused kernel.
    let fused = exe
        .plan()
        .steps
        .iter()
        .filter(|s| matches!(s.op, Op::Fused(_)));
    assert_eq!(fused.count(), 1, "{}", exe.optimized_ir());
    let a = anomaly_of(exe.run(&[("x", descending())]));
    let msg = a.to_string();
    assert_eq!(a.op, "fused", "{msg}");
    assert_eq!(a.index, 5, "{msg}");
    assert!(a.value.is_nan(), "{msg}");
    assert_eq!(a.ty, TensorType::new(DType::F32, [4, 8]));
    let origin = a.origin.as_ref().expect("the fused op is named");
    assert_eq!(origin.op, "log", "{msg}");
    let at = format!("{}:{log_line}:", file!());
    assert!(
        origin
            .location
            .as_deref()
            .is_some_and(|l| l.starts_with(&at)),
        "{msg}"
    );
    // The kernel's own location is where its root (the tanh) was built.
    assert!(
        a.location
            .as_deref()
            .is_some_and(|l| l.starts_with(file!())),
        "{msg}"
    );
    assert!(msg.contains("log") && msg.contains(&at), "{msg}");
}

#[test]
fn nan_from_a_matmul_is_named() {
    let g = GraphBuilder::new();
    let x = g.input("x", DType::F32, [2, 3]);
    let w = g.param("w", [3, 4], Init::zeros());
    let (m, mm_line) = (x.matmul(&w), line!());
    let y = m.add_scalar(1.0).exp().mul_scalar(2.0);
    let mut exe = compile_with(&g, &[&y], Device::Cpu, &opts(true)).unwrap();
    // inf · 0 is NaN: the input is not checked (no step made it), the matmul's result is.
    let mut v = vec![1.0f32; 6];
    v[3] = f32::INFINITY;
    let a = anomaly_of(exe.run(&[("x", HostTensor::from_vec(v, [2, 3]).unwrap())]));
    let msg = a.to_string();
    assert_eq!(a.op, "matmul", "{msg}");
    assert_eq!(a.index, 4, "{msg}");
    assert!(a.value.is_nan() && a.origin.is_none(), "{msg}");
    assert!(
        a.location
            .as_deref()
            .is_some_and(|l| l.starts_with(&format!("{}:{mm_line}:", file!()))),
        "{msg}"
    );
    assert!(msg.contains("matmul") && msg.contains("f32[2,4]"), "{msg}");
}

#[test]
fn anomaly_off_gives_no_error_and_the_same_outputs() {
    let (g, y, _) = log_chain();
    let mut on = compile_with(&g, &[&y], Device::Cpu, &opts(true)).unwrap();
    let mut off = compile_with(&g, &[&y], Device::Cpu, &opts(false)).unwrap();
    // Finite: the same bits either way.
    let a = on.run(&[("x", large())]).unwrap();
    let b = off.run(&[("x", large())]).unwrap();
    assert_eq!(a[0], b[0]);
    // Not finite: off, the run succeeds with the NaNs in the output.
    let out = off.run(&[("x", descending())]).unwrap();
    let v = out[0].to_f64_vec();
    assert!(v[..5].iter().all(|x| x.is_finite()) && v[5..].iter().all(|x| x.is_nan()));
}

#[test]
fn without_optimization_there_is_no_fusion_and_the_plain_op_is_named() {
    let (g, y, log_line) = log_chain();
    let o = CompileOptions {
        optimize: false,
        ..opts(true)
    };
    let mut exe = compile_with(&g, &[&y], Device::Cpu, &o).unwrap();
    assert!(exe.report().fuse.is_none() && exe.report().optimize.is_none());
    assert!(
        !exe.plan()
            .steps
            .iter()
            .any(|s| matches!(s.op, Op::Fused(_))),
        "{}",
        exe.optimized_ir()
    );
    let a = anomaly_of(exe.run(&[("x", descending())]));
    assert_eq!(a.op, "log", "{a}");
    assert!(a.origin.is_none(), "{a}");
    let at = format!("{}:{log_line}:", file!());
    assert!(
        a.location.as_deref().is_some_and(|l| l.starts_with(&at)),
        "{a}"
    );
}

#[test]
fn anomaly_mode_on_cuda_is_a_clear_error() {
    let (g, y, _) = log_chain();
    let e = compile_with(&g, &[&y], Device::Cuda(0), &opts(true))
        .err()
        .expect("anomaly mode is refused on cuda");
    assert!(
        e.to_string().contains("anomaly mode runs on the cpu"),
        "{e}"
    );
}

/// The log chain as a graph file with an input file; returns (graph path, input path).
fn files(name: &str) -> (PathBuf, PathBuf) {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("anomaly-{name}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (g, _, _) = log_chain();
    let path = dir.join("chain.rtg");
    format::save(&g.graph().unwrap(), &path, ParamStorage::Embedded).unwrap();
    let x = dir.join("x.npy");
    write_npy(&x, &descending()).unwrap();
    (path, x)
}

fn runner(args: &[&str], env: Option<&str>) -> std::process::Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_rustytorch"));
    c.args(args).env_remove("RUSTYTORCH_ANOMALY");
    if let Some(v) = env {
        c.env("RUSTYTORCH_ANOMALY", v);
    }
    c.output().expect("the rustytorch binary runs")
}

#[test]
fn environment_variable_and_runner_flag_turn_anomaly_mode_on() {
    let (path, x) = files("env");
    let out = path.parent().unwrap().join("out");
    let input = format!("x={}", x.display());
    let args = [
        "run",
        path.to_str().unwrap(),
        "--input",
        &input,
        "--out",
        out.to_str().unwrap(),
    ];
    let plain = runner(&args, None);
    assert!(
        plain.status.success(),
        "{}",
        String::from_utf8_lossy(&plain.stderr)
    );
    let mut flag_args = args.to_vec();
    flag_args.push("--anomaly");
    for o in [runner(&args, Some("1")), runner(&flag_args, None)] {
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{err}");
        // A graph file carries no source locations; the op inside the kernel is still named.
        assert!(
            err.starts_with("error: anomaly:") && err.contains("(log, source location unknown)"),
            "{err}"
        );
    }
    assert!(runner(&args, Some("0")).status.success());
}
