//! The public API end to end: compile and run (on every test device), build-site errors, input
//! checking, outputs by name, exporting a trained graph to a file and loading it back, parameter
//! state files (all or nothing), and automatic placement.

use rustytorch::compiler::format::{self, ParamStorage};
use rustytorch::compiler::CompileError;
use rustytorch::ops::testing::{assert_close, rand_tensor};
use rustytorch::prelude::*;
use rustytorch::runtime::device::test_devices;
use rustytorch::{Error, TensorType};
use std::path::PathBuf;

/// A fresh scratch directory for one test.
fn scratch(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("api-{name}"));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn f32_ty(dims: &[usize]) -> TensorType {
    TensorType::new(DType::F32, dims)
}

/// `tanh(x·w + b)` in float64, x [m, k], w [k, n], b [n].
fn linear_tanh_ref(x: &[f64], w: &[f64], b: &[f64], m: usize, k: usize, n: usize) -> Vec<f64> {
    let mut y = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            let mut s = b[j];
            for p in 0..k {
                s += x[i * k + p] * w[p * n + j];
            }
            y[i * n + j] = s.tanh();
        }
    }
    y
}

/// x [3, 4] -> tanh(x·w + b) with w [4, 5], b [5] (seeded initializers); output "y".
fn small_graph() -> (GraphBuilder, Tensor) {
    let g = GraphBuilder::new();
    let x = g.input("x", DType::F32, [3, 4]);
    let w = g.param("w", [4, 5], Init::kaiming_uniform(4, 11));
    let b = g.param("b", [5], Init::kaiming_uniform(4, 12));
    let y = x.matmul(&w).add(&b).tanh();
    g.output("y", &y);
    (g, y)
}

#[test]
fn compile_and_run_matches_f64_reference() {
    for device in test_devices() {
        let (g, y) = small_graph();
        let mut exe = rustytorch::compile(&g, &[&y], device).unwrap();
        assert_eq!(exe.device(), device);
        let x = rand_tensor(&f32_ty(&[3, 4]), 1, -2.0, 2.0);
        let out = exe.run(&[("x", x.clone())]).unwrap();
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].ty(), f32_ty(&[3, 5]));
        let w = exe.param("w").unwrap().to_f64_vec();
        let b = exe.param("b").unwrap().to_f64_vec();
        // The initializers are not zero: the comparison can fail.
        assert!(w.iter().all(|v| *v != 0.0) && b.iter().all(|v| *v != 0.0));
        let want = linear_tanh_ref(&x.to_f64_vec(), &w, &b, 3, 4, 5);
        assert_close(
            &out[0].to_f64_vec(),
            &want,
            1e-5,
            &format!("tanh(x·w + b) on {device}"),
        );
        // Running again gives the same result (no state updates in this graph).
        let again = exe.run(&[("x", x)]).unwrap();
        assert_eq!(again[0].to_f64_vec(), out[0].to_f64_vec(), "{device}");
    }
}

#[test]
fn compile_graph_with_inference_options() {
    let (g, _) = small_graph();
    let graph = g.graph().unwrap();
    let mut exe =
        rustytorch::compile_graph(&graph, Device::Cpu, &CompileOptions::inference()).unwrap();
    let x = rand_tensor(&f32_ty(&[3, 4]), 2, -1.0, 1.0);
    let out = exe.run(&[("x", x.clone())]).unwrap();
    let w = exe.param("w").unwrap().to_f64_vec();
    let b = exe.param("b").unwrap().to_f64_vec();
    let want = linear_tanh_ref(&x.to_f64_vec(), &w, &b, 3, 4, 5);
    assert_close(&out.get("y").unwrap().to_f64_vec(), &want, 1e-5, "y");
    assert!(!exe.optimized_ir().is_empty());
    assert_eq!(exe.device_name(), "cpu");
    assert_eq!(exe.placement().requested, Device::Cpu);
    assert_eq!(exe.placement().reason, "requested");
    // The CPU has no device pool and copies nothing.
    assert!(exe.memory_stats().is_none());
    assert_eq!(exe.transfers(), Default::default());
}

#[test]
fn auto_places_a_tiny_graph_on_the_cpu() {
    let (g, y) = small_graph();
    let mut exe = rustytorch::compile(&g, &[&y], Device::Auto).unwrap();
    assert_eq!(exe.device(), Device::Cpu, "{}", exe.placement());
    let p = exe.placement();
    assert_eq!(p.requested, Device::Auto);
    assert_eq!(p.device, Device::Cpu);
    assert!(
        p.reason.starts_with("auto: estimated") && p.reason.contains("FLOPs"),
        "{p}"
    );
    let x = rand_tensor(&f32_ty(&[3, 4]), 1, -2.0, 2.0);
    assert_eq!(exe.run(&[("x", x)]).unwrap()[0].dims(), &[3, 5]);
    // The estimate the decision used: a 3×4 by 4×5 matmul and a few elementwise kernels.
    let w = rustytorch::workload(exe.optimized_graph(), exe.plan());
    assert!(w.flops >= 2 * 3 * 4 * 5 && w.flops < 1000, "{w:?}");
    assert!(
        w.kernels >= 1 && w.bytes > 0 && w.io_bytes == (12 + 15) * 4,
        "{w:?}"
    );
}

#[test]
fn shape_error_names_the_call_site_op_shapes_and_dtypes() {
    let g = GraphBuilder::new();
    let a = g.input("a", DType::F32, [2, 3]);
    let b = g.input("b", DType::F32, [4, 5]);
    let line = line!() + 1;
    let bad = a.matmul(&b);
    // Later ops on the failed value do not hide the first error.
    let y = bad.relu();
    let err = match rustytorch::compile(&g, &[&y], Device::Cpu) {
        Ok(_) => panic!("matmul of [2,3] by [4,5] compiled"),
        Err(e) => e,
    };
    let msg = err.to_string();
    assert!(
        matches!(err, Error::Compile(CompileError::Build { .. })),
        "not a build error: {err:?}"
    );
    let site = format!("tests{}api.rs:{line}:", std::path::MAIN_SEPARATOR);
    assert!(msg.contains(&site), "no call site `{site}` in: {msg}");
    for part in ["matmul", "[2,3]", "[4,5]", "f32"] {
        assert!(msg.contains(part), "`{part}` missing from: {msg}");
    }
    // The builder reports the same error before compiling.
    assert!(g.check().unwrap_err().to_string().contains(&site));
}

#[test]
fn dtype_error_names_both_dtypes() {
    let g = GraphBuilder::new();
    let a = g.input("a", DType::F32, [3]);
    let b = g.input("b", DType::F64, [3]);
    let line = line!() + 1;
    let y = a.add(&b);
    let msg = match rustytorch::compile(&g, &[&y], Device::Cpu) {
        Ok(_) => panic!("f32 + f64 compiled"),
        Err(e) => e.to_string(),
    };
    assert!(msg.contains(&format!("api.rs:{line}:")), "{msg}");
    for part in ["add", "f32[3]", "f64[3]"] {
        assert!(msg.contains(part), "`{part}` missing from: {msg}");
    }
}

#[test]
fn wrong_inputs_are_named() {
    let (g, y) = small_graph();
    let mut exe = rustytorch::compile(&g, &[&y], Device::Cpu).unwrap();
    let good = rand_tensor(&f32_ty(&[3, 4]), 3, -1.0, 1.0);

    // Unknown name: the error names it and lists the graph's inputs.
    let e = exe.run(&[("z", good.clone())]).unwrap_err();
    let msg = e.to_string();
    assert!(
        matches!(&e, Error::Input { name, .. } if name == "z"),
        "{e:?}"
    );
    assert!(msg.contains("`z`") && msg.contains("x"), "{msg}");

    // Wrong dtype.
    let e = exe
        .run(&[(
            "x",
            rand_tensor(&TensorType::new(DType::F64, [3, 4]), 3, -1.0, 1.0),
        )])
        .unwrap_err();
    let msg = e.to_string();
    assert!(
        matches!(&e, Error::Input { name, .. } if name == "x"),
        "{e:?}"
    );
    assert!(
        msg.contains("f32[3,4]") && msg.contains("f64[3,4]"),
        "{msg}"
    );

    // Wrong shape.
    let e = exe
        .run(&[("x", rand_tensor(&f32_ty(&[4, 3]), 3, -1.0, 1.0))])
        .unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("`x`") && msg.contains("f32[3,4]") && msg.contains("f32[4,3]"),
        "{msg}"
    );

    // Missing.
    let e = exe.run(&[]).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("`x`") && msg.contains("missing") && msg.contains("f32[3,4]"),
        "{msg}"
    );

    // The executable still works after the errors.
    assert_eq!(exe.run(&[("x", good)]).unwrap()[0].dims(), &[3, 5]);
}

#[test]
fn outputs_by_name_and_position() {
    let g = GraphBuilder::new();
    let a = g.input("a", DType::F32, [2, 3]);
    let b = g.input("b", DType::F32, [2, 3]);
    let s = a.add(&b);
    let p = a.mul(&b);
    let m = s.sum(&[1], false);
    g.output("sum", &s);
    g.output("prod", &p);
    let mut exe = rustytorch::compile(&g, &[&s, &p, &m], Device::Cpu).unwrap();
    let av = rand_tensor(&f32_ty(&[2, 3]), 4, -1.0, 1.0);
    let bv = rand_tensor(&f32_ty(&[2, 3]), 5, -1.0, 1.0);
    // Inputs in any order.
    let out = exe.run(&[("b", bv.clone()), ("a", av.clone())]).unwrap();
    assert_eq!(out.names(), &["sum", "prod", "output2"]);
    let (x, y) = (av.to_f64_vec(), bv.to_f64_vec());
    let sum: Vec<f64> = x.iter().zip(&y).map(|(p, q)| p + q).collect();
    let prod: Vec<f64> = x.iter().zip(&y).map(|(p, q)| p * q).collect();
    let rows: Vec<f64> = sum.chunks(3).map(|r| r.iter().sum()).collect();
    assert_close(&out.get("sum").unwrap().to_f64_vec(), &sum, 1e-6, "sum");
    assert_close(&out.get("prod").unwrap().to_f64_vec(), &prod, 1e-6, "prod");
    assert_close(
        &out.get("output2").unwrap().to_f64_vec(),
        &rows,
        1e-6,
        "rows",
    );
    assert_eq!(out[1].to_f64_vec(), out.get("prod").unwrap().to_f64_vec());
    assert!(out.get("nope").is_none());
    let names: Vec<&str> = out.iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["sum", "prod", "output2"]);
}

/// A linear regression trained with SGD: the loss output and the prediction output "y".
fn regression() -> (GraphBuilder, Tensor, Tensor) {
    let g = GraphBuilder::new();
    let x = g.input("x", DType::F32, [8, 4]);
    let t = g.input("t", DType::F32, [8, 2]);
    let w = g.param("w", [4, 2], Init::kaiming_uniform(4, 21));
    let b = g.param("b", [2], Init::kaiming_uniform(4, 22));
    let y = x.matmul(&w).add(&b);
    g.output("y", &y);
    let d = y.sub(&t);
    let loss = d.mul(&d).mean_all();
    g.output("loss", &loss);
    g.train_step(&loss, Sgd::new(0.1), &StepOptions::default())
        .unwrap();
    (g, y, loss)
}

#[test]
fn export_graph_save_load_gives_the_same_outputs() {
    let dir = scratch("export");
    let (g, y, loss) = regression();
    let mut train = rustytorch::compile(&g, &[&y, &loss], Device::Cpu).unwrap();
    let x = rand_tensor(&f32_ty(&[8, 4]), 6, -1.0, 1.0);
    let t = rand_tensor(&f32_ty(&[8, 2]), 7, -1.0, 1.0);
    let w0 = train.param("w").unwrap().to_f64_vec();
    let mut losses = Vec::new();
    for _ in 0..5 {
        let out = train.run(&[("x", x.clone()), ("t", t.clone())]).unwrap();
        losses.push(out.get("loss").unwrap().to_f64_vec()[0]);
    }
    assert!(
        losses[4] < losses[0],
        "training did not reduce the loss: {losses:?}"
    );
    assert_ne!(
        train.param("w").unwrap().to_f64_vec(),
        w0,
        "no update applied"
    );

    let path = dir.join("trained.rtg");
    format::save(
        &train.export_graph().unwrap(),
        &path,
        ParamStorage::Embedded,
    )
    .unwrap();
    let loaded = format::load(&path).unwrap();
    let mut a =
        rustytorch::compile_graph(&loaded, Device::Cpu, &CompileOptions::inference()).unwrap();
    let mut b =
        rustytorch::compile_graph(&loaded, Device::Cpu, &CompileOptions::inference()).unwrap();
    for p in ["w", "b"] {
        assert_eq!(
            a.param(p).unwrap().to_f64_vec(),
            train.param(p).unwrap().to_f64_vec(),
            "parameter {p} after load"
        );
    }
    let ins = [("x", x.clone()), ("t", t.clone())];
    let ya = a.run(&ins).unwrap().get("y").unwrap().to_f64_vec();
    // Inference runs apply no update: a second run is identical.
    let ya2 = a.run(&ins).unwrap().get("y").unwrap().to_f64_vec();
    let yb = b.run(&ins).unwrap().get("y").unwrap().to_f64_vec();
    assert_eq!(ya, ya2);
    assert_eq!(ya, yb);
    // ... and equal to the trained weights applied in float64.
    let w = train.param("w").unwrap().to_f64_vec();
    let bias = train.param("b").unwrap().to_f64_vec();
    let xs = x.to_f64_vec();
    let want: Vec<f64> = (0..16)
        .map(|k| {
            let (i, j) = (k / 2, k % 2);
            bias[j] + (0..4).map(|p| xs[i * 4 + p] * w[p * 2 + j]).sum::<f64>()
        })
        .collect();
    assert_close(&ya, &want, 1e-5, "y of the loaded graph");
}

#[test]
fn save_state_load_state_round_trip() {
    for device in test_devices() {
        save_load_round_trip(device);
    }
}

fn save_load_round_trip(device: Device) {
    let dir = scratch(&format!("state-{device}").replace(':', "-"));
    let (g, y, loss) = regression();
    let mut train = rustytorch::compile(&g, &[&y, &loss], device).unwrap();
    let x = rand_tensor(&f32_ty(&[8, 4]), 8, -1.0, 1.0);
    let t = rand_tensor(&f32_ty(&[8, 2]), 9, -1.0, 1.0);
    for _ in 0..3 {
        train.run(&[("x", x.clone()), ("t", t.clone())]).unwrap();
    }
    let path = dir.join("state.safetensors");
    train.save_state(&path).unwrap();

    let mut fresh = rustytorch::compile(&g, &[&y, &loss], device).unwrap();
    assert_ne!(
        fresh.param("w").unwrap().to_f64_vec(),
        train.param("w").unwrap().to_f64_vec()
    );
    let n = fresh.load_state(&path).unwrap();
    assert_eq!(n, train.params().unwrap().len());
    for (name, v) in train.params().unwrap() {
        let got = fresh.param(&name).unwrap();
        assert_eq!(got.ty(), v.ty(), "{name}");
        assert_eq!(got.to_f64_vec(), v.to_f64_vec(), "{name}");
    }
    // Both continue identically (the step counter is state too).
    let ins = [("x", x), ("t", t)];
    let a = train.run(&ins).unwrap();
    let b = fresh.run(&ins).unwrap();
    assert_eq!(
        a.get("loss").unwrap().to_f64_vec(),
        b.get("loss").unwrap().to_f64_vec()
    );
    assert_eq!(
        train.param("w").unwrap().to_f64_vec(),
        fresh.param("w").unwrap().to_f64_vec()
    );

    // A state file of another graph is refused, naming the parameter.
    let (g2, y2) = small_graph();
    let mut other = rustytorch::compile(&g2, &[&y2], device).unwrap();
    let msg = other.load_state(&path).unwrap_err().to_string();
    assert!(msg.contains('`'), "{msg}");
    // A missing file is an error naming the path.
    let missing = dir.join("nope.safetensors");
    let msg = fresh.load_state(&missing).unwrap_err().to_string();
    assert!(msg.contains("nope.safetensors"), "{msg}");
}

#[test]
fn load_state_is_all_or_nothing() {
    let dir = scratch("partial");
    for device in test_devices() {
        let (g, y, loss) = regression();
        let mut exe = rustytorch::compile(&g, &[&y, &loss], device).unwrap();
        let before = exe.params().unwrap();
        let good_b = HostTensor::from_vec(vec![7.0f32, 8.0], [2]).unwrap();
        // One good tensor and one of the wrong shape; the names sort the good one first, then
        // the other way round.
        let mistyped = dir.join("mistyped.safetensors");
        let w_t = HostTensor::from_vec(vec![1.0f32; 8], [2, 4]).unwrap();
        rustytorch::npy::save_safetensors(
            &mistyped,
            &[("b".into(), good_b.clone()), ("w".into(), w_t)],
        )
        .unwrap();
        let good_w = HostTensor::from_vec(vec![1.0f32; 8], [4, 2]).unwrap();
        let bad_b = HostTensor::from_vec(vec![1.0f64, 2.0], [2]).unwrap();
        let mistyped_b = dir.join("mistyped_b.safetensors");
        rustytorch::npy::save_safetensors(
            &mistyped_b,
            &[("b".into(), bad_b), ("w".into(), good_w.clone())],
        )
        .unwrap();
        // A good tensor and one the graph does not have.
        let unknown = dir.join("unknown.safetensors");
        rustytorch::npy::save_safetensors(
            &unknown,
            &[("b".into(), good_b.clone()), ("zz".into(), good_w)],
        )
        .unwrap();
        for (file, bad, parts) in [
            (&mistyped, "w", &["f32[4,2]", "f32[2,4]"][..]),
            (&mistyped_b, "b", &["f32[2]", "f64[2]"][..]),
            (&unknown, "zz", &["no such parameter"][..]),
        ] {
            let e = exe.load_state(file).unwrap_err();
            let msg = e.to_string();
            assert!(msg.contains(&format!("`{bad}`")), "{device}: {msg}");
            assert!(msg.contains(file.to_str().unwrap()), "{device}: {msg}");
            for part in parts {
                assert!(msg.contains(part), "{device}: `{part}` missing from {msg}");
            }
            // Nothing changed, not even the good tensor.
            let now = exe.params().unwrap();
            for ((name, a), (_, b)) in before.iter().zip(&now) {
                assert_eq!(a.to_f64_vec(), b.to_f64_vec(), "{device}: {name} changed");
            }
        }
        // A good file loads.
        let good = dir.join("good.safetensors");
        rustytorch::npy::save_safetensors(&good, &[("b".into(), good_b)]).unwrap();
        assert_eq!(exe.load_state(&good).unwrap(), 1);
        assert_eq!(exe.param("b").unwrap().to_f64_vec(), [7.0, 8.0]);
    }
}
