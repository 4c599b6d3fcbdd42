//! Named dims end to end: one executable runs a graph with a named batch at every batch size,
//! compiling each new shape once and keeping the compiled plans in a bounded cache; parameters
//! are shared by every shape; graph files and IR text keep the names; the runner runs and
//! inspects such graphs.

use rustytorch::compiler::format::{self, ParamStorage};
use rustytorch::compiler::text;
use rustytorch::npy::{read_npy, write_npy};
use rustytorch::ops::testing::{assert_close, rand_tensor};
use rustytorch::prelude::*;
use rustytorch::Error;
use std::path::PathBuf;
use std::process::{Command, Output};

/// The digits CNN's shape: `[batch, 1, 8, 8]` images, two convolutions, max pooling, a flatten
/// and two linear layers; outputs the class probabilities and the class.
fn cnn(g: &GraphBuilder, batch: DimExpr) -> (Tensor, Tensor) {
    let x = g.input_dims("x", DType::F32, &[batch, 1.into(), 8.into(), 8.into()]);
    let c1 = g.param("conv1.w", [8, 1, 3, 3], Init::kaiming_uniform(9, 11));
    let b1 = g.param("conv1.b", [8], Init::kaiming_uniform(9, 12));
    let c2 = g.param("conv2.w", [16, 8, 3, 3], Init::kaiming_uniform(72, 13));
    let w3 = g.param("fc1.w", [256, 32], Init::kaiming_uniform(256, 15));
    let b3 = g.param("fc1.b", [32], Init::kaiming_uniform(256, 16));
    let w4 = g.param("fc2.w", [32, 10], Init::kaiming_uniform(32, 17));
    let same = ConvOpts::default().padding(&[1]);
    let h = x.conv(&c1, Some(&b1), &same).relu();
    let h = h.conv(&c2, None, &same).relu();
    let h = h.max_pool(&[2], &[2], &[0]).flatten(1); // [batch, 256]
    let logits = h.matmul(&w3).add(&b3).gelu().matmul(&w4);
    (x, logits)
}

/// The classifier with a named batch (default 16).
fn classifier() -> Graph {
    let g = GraphBuilder::new();
    let batch = g.dim("batch", 16);
    let (_, logits) = cnn(&g, batch);
    g.output("probs", &logits.softmax(-1));
    g.output("class", &logits.argmax(-1, false));
    g.graph().unwrap()
}

fn rnd(dtype: DType, dims: &[usize], seed: u64) -> HostTensor {
    rand_tensor(&TensorType::new(dtype, dims.to_vec()), seed, -1.0, 1.0)
}

fn images(n: usize, seed: u64) -> HostTensor {
    rnd(DType::F32, &[n, 1, 8, 8], seed)
}

/// The first `n` rows of a `[rows, ...]` tensor's values.
fn rows(t: &HostTensor, n: usize) -> Vec<f64> {
    let per: usize = t.dims()[1..].iter().product();
    t.to_f64_vec()[..n * per].to_vec()
}

#[test]
fn one_executable_runs_batches_of_1_5_and_16() {
    let mut exe = compile_graph(&classifier(), Device::Cpu, &CompileOptions::inference()).unwrap();
    assert_eq!(exe.shape_cache().compiled, 1);
    assert_eq!(exe.current_dims(), "batch=16");
    let x16 = images(16, 7);
    // Each image's result does not depend on the batch it is in: compare against batch 16.
    let want = exe.run(&[("x", x16.clone())]).unwrap();
    assert_eq!(want.get("probs").unwrap().dims(), &[16, 10]);
    for b in [1usize, 5, 16] {
        let xb = HostTensor::from_vec(
            rows(&x16, b).iter().map(|&v| v as f32).collect(),
            [b, 1, 8, 8],
        )
        .unwrap();
        let out = exe.run(&[("x", xb)]).unwrap();
        assert_eq!(exe.current_dims(), format!("batch={b}"));
        let probs = out.get("probs").unwrap();
        assert_eq!(probs.dims(), &[b, 10]);
        assert_eq!(out.get("class").unwrap().dims(), &[b]);
        assert_close(
            &probs.to_f64_vec(),
            &rows(want.get("probs").unwrap(), b),
            1e-5,
            &format!("batch {b}"),
        );
        assert_eq!(
            out.get("class").unwrap().to_vec::<i64>().unwrap(),
            want.get("class").unwrap().to_vec::<i64>().unwrap()[..b]
        );
    }
    let s = exe.shape_cache();
    assert_eq!(
        (s.compiled, s.cached, s.misses, s.hits),
        (3, 3, 2, 2),
        "{s}"
    );
    // Every shape is compiled now: the next runs are cache hits.
    for b in [5, 1, 16, 5] {
        exe.run(&[("x", images(b, 9))]).unwrap();
    }
    let s = exe.shape_cache();
    assert_eq!(
        (s.compiled, s.misses, s.hits, s.evictions),
        (3, 2, 6, 0),
        "{s}"
    );
    assert!(
        s.to_string()
            .starts_with("3 shapes compiled, 3 of at most 8 cached"),
        "{s}"
    );
}

#[test]
fn the_cache_is_bounded_and_drops_the_least_recently_used() {
    let opts = CompileOptions {
        shape_cache: 2,
        ..CompileOptions::inference()
    };
    let mut exe = compile_graph(&classifier(), Device::Cpu, &opts).unwrap();
    for b in [1, 2, 1, 3, 1, 2] {
        let out = exe.run(&[("x", images(b, b as u64))]).unwrap();
        assert_eq!(out[0].dims(), &[b, 10]);
    }
    // 16 (compiled) → 1 miss, 2 miss (16 dropped), 1 hit, 3 miss (2 dropped), 1 hit, 2 miss
    // (3 dropped).
    let s = exe.shape_cache();
    assert_eq!(
        (s.compiled, s.cached, s.misses, s.hits, s.evictions),
        (5, 2, 4, 2, 3),
        "{s}"
    );
}

#[test]
fn parameters_are_shared_by_every_shape() {
    let mut exe = compile_graph(&classifier(), Device::Cpu, &CompileOptions::inference()).unwrap();
    exe.run(&[("x", images(3, 1))]).unwrap(); // batch 3 current, 16 cached
    let zeros = HostTensor::from_vec(vec![0f32; 320], [32, 10]).unwrap();
    exe.set_param("fc2.w", zeros).unwrap();
    // A cached shape and a new one both see the new weights: uniform probabilities.
    for b in [16, 4, 3] {
        let out = exe.run(&[("x", images(b, 2))]).unwrap();
        for p in out.get("probs").unwrap().to_f64_vec() {
            assert!((p - 0.1).abs() < 1e-6, "batch {b}: {p}");
        }
        let w = exe.param("fc2.w").unwrap().to_f64_vec();
        assert!(w.iter().all(|&v| v == 0.0));
    }
}

#[test]
fn inputs_that_disagree_on_a_named_dim_are_named() {
    let g = GraphBuilder::new();
    let batch = g.dim("batch", 4);
    let x = g.input_dims("x", DType::F32, &[batch.clone(), 3.into()]);
    let y = g.input_dims("y", DType::I64, &[batch]);
    let loss = x.cross_entropy(&y);
    let mut exe = compile_with(&g, &[&loss], Device::Cpu, &CompileOptions::inference()).unwrap();
    let labels = |n: usize| HostTensor::from_vec(vec![1i64; n], [n]).unwrap();
    exe.run(&[("x", rnd(DType::F32, &[6, 3], 1)), ("y", labels(6))])
        .unwrap();
    let e = exe
        .run(&[("x", rnd(DType::F32, &[6, 3], 1)), ("y", labels(5))])
        .unwrap_err();
    let m = e.to_string();
    assert!(matches!(e, Error::Input { .. }), "{m}");
    assert!(
        m.contains("input `y`") && m.contains("`batch` is 5 here but 6 in input `x`"),
        "{m}"
    );
    let m = exe
        .run(&[("x", rnd(DType::F32, &[6, 4], 1)), ("y", labels(6))])
        .unwrap_err()
        .to_string();
    assert!(
        m.contains("input `x`") && m.contains("expected f32[batch,3]"),
        "{m}"
    );
    let m = exe
        .run(&[("x", rnd(DType::F64, &[6, 3], 1)), ("y", labels(6))])
        .unwrap_err()
        .to_string();
    assert!(m.contains("expected f32[batch,3], got f64[6,3]"), "{m}");
}

#[test]
fn a_shape_error_at_another_size_names_the_op_and_shapes() {
    // The reshape is written with a fixed target, so only batch 16 fits it.
    let src = "graph {\n  dim batch = 16\n  %0 = input x : f32[batch,4]\n  \
               %1 = reshape[shape=64](%0) : f32[64]\n  %2 = exp(%1) : f32[64]\n  \
               output y = %2\n}\n";
    let graph = text::parse(src).unwrap();
    let mut exe = compile_graph(&graph, Device::Cpu, &CompileOptions::inference()).unwrap();
    exe.run(&[("x", rnd(DType::F32, &[16, 4], 1))]).unwrap();
    let m = exe
        .run(&[("x", rnd(DType::F32, &[5, 4], 1))])
        .unwrap_err()
        .to_string();
    assert!(m.starts_with("at batch=5: reshape"), "{m}");
    assert!(m.contains("[5,4]") && m.contains("64"), "{m}");
    // The executable still runs the shapes it has.
    exe.run(&[("x", rnd(DType::F32, &[16, 4], 2))]).unwrap();
}

#[test]
fn a_training_step_runs_at_the_size_it_was_built_at() {
    let g = GraphBuilder::new();
    let batch = g.dim("batch", 8);
    let (_, logits) = cnn(&g, batch.clone());
    let y = g.input_dims("y", DType::I64, &[batch]);
    let loss = logits.cross_entropy(&y);
    g.train_step(&loss, AdamW::new(1e-3), &StepOptions::default())
        .unwrap();
    let mut exe = compile(&g, &[&loss], Device::Cpu).unwrap();
    let labels = |n: usize| HostTensor::from_vec(vec![3i64; n], [n]).unwrap();
    exe.run(&[("x", images(8, 1)), ("y", labels(8))]).unwrap();
    let m = exe
        .run(&[("x", images(4, 1)), ("y", labels(4))])
        .unwrap_err()
        .to_string();
    assert!(m.contains("training step") && m.contains("batch=8"), "{m}");
    // Its inference executable runs at any batch, with the trained weights.
    let mut infer =
        compile_with(&g, &[&logits], Device::Cpu, &CompileOptions::inference()).unwrap();
    assert!(infer.copy_params_from(&exe).unwrap() >= 6);
    let out = infer.run(&[("x", images(3, 1)), ("y", labels(3))]).unwrap();
    assert_eq!(out[0].dims(), &[3, 10]);
}

#[test]
fn a_saved_graph_keeps_its_named_batch_in_both_formats() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("named-dims-files");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let graph = classifier();
    let mut exe = compile_graph(&graph, Device::Cpu, &CompileOptions::inference()).unwrap();
    let x5 = images(5, 3);
    let want = exe.run(&[("x", x5.clone())]).unwrap();
    let exported = exe.export_graph().unwrap();
    let rtg = dir.join("cnn.rtg");
    format::save(&exported, &rtg, ParamStorage::Embedded).unwrap();
    let ir = text::print(&exported);
    assert!(ir.contains("dim batch = 16") && ir.contains("input x : f32[batch,1,8,8]"));
    let from_file = format::load(&rtg).unwrap();
    let from_text = text::parse(&ir).unwrap();
    assert_eq!(text::print(&from_file), ir);
    assert_eq!(text::print(&from_text), ir);
    // Text → file → text, too.
    format::save(&from_text, &dir.join("again.rtg"), ParamStorage::Embedded).unwrap();
    assert_eq!(
        text::print(&format::load(&dir.join("again.rtg")).unwrap()),
        ir
    );
    for g in [from_file, from_text] {
        let mut exe = compile_graph(&g, Device::Cpu, &CompileOptions::inference()).unwrap();
        let out = exe.run(&[("x", x5.clone())]).unwrap();
        assert_close(
            &out.get("probs").unwrap().to_f64_vec(),
            &want.get("probs").unwrap().to_f64_vec(),
            1e-6,
            "probs after a round trip",
        );
    }
}

// ---------------------------------------------------------------- the runner

fn cli(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_rustytorch"))
        .args(args)
        .output()
        .expect("the rustytorch binary runs")
}

fn ok(o: &Output) -> String {
    assert!(
        o.status.success(),
        "rustytorch failed ({:?}):\n{}",
        o.status,
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn the_runner_runs_and_inspects_a_graph_with_a_named_batch() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("named-dims-runner");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut graph = classifier();
    for p in &mut graph.params {
        p.data = Some(p.init.materialize(&p.ty).unwrap());
    }
    let rtg = dir.join("cnn.rtg");
    format::save(&graph, &rtg, ParamStorage::Embedded).unwrap();
    let mut exe = compile_graph(&graph, Device::Cpu, &CompileOptions::inference()).unwrap();
    let (rtg_s, dir_s) = (rtg.to_str().unwrap(), dir.to_str().unwrap());
    for b in [5, 16] {
        let x = images(b, 11);
        let xp = dir.join(format!("x{b}.npy"));
        write_npy(&xp, &x).unwrap();
        let arg = format!("x={}", xp.display());
        ok(&cli(&["run", rtg_s, "--input", &arg, "--out", dir_s]));
        let probs = read_npy(&dir.join("probs.npy")).unwrap();
        assert_eq!(probs.dims(), &[b, 10]);
        let want = exe.run(&[("x", x)]).unwrap();
        assert_close(
            &probs.to_f64_vec(),
            &want.get("probs").unwrap().to_f64_vec(),
            1e-6,
            "runner probs",
        );
    }
    // A wrong fixed dim is refused with the declared type.
    let bad = dir.join("bad.npy");
    write_npy(&bad, &rnd(DType::F32, &[5, 1, 8, 9], 1)).unwrap();
    let o = cli(&["run", rtg_s, "--input", &format!("x={}", bad.display())]);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("f32[batch,1,8,8]"), "{err}");
    // inspect: the default size, or the one asked for.
    let out = ok(&cli(&["inspect", rtg_s, "--device", "cpu"]));
    assert!(out.contains("input x : f32[batch,1,8,8]"), "{out}");
    assert!(out.contains("named dims: batch=16 (default)"), "{out}");
    let at8 = ok(&cli(&[
        "inspect", rtg_s, "--device", "cpu", "--dim", "batch=8",
    ]));
    assert!(at8.contains("named dims: batch=8"), "{at8}");
    let flops = |s: &str| {
        s.lines()
            .find_map(|l| l.strip_prefix("flops: "))
            .and_then(|l| l.split(' ').next())
            .and_then(|n| n.parse::<f64>().ok())
            .unwrap_or_else(|| panic!("no flops line in:\n{s}"))
    };
    assert!((flops(&out) / flops(&at8) - 2.0).abs() < 1e-9);
    let o = cli(&["inspect", rtg_s, "--dim", "seq=8"]);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("`seq`") && err.contains("batch"), "{err}");
}

#[test]
fn the_ir_and_the_trace_follow_the_current_shape() {
    let mut exe = compile_graph(&classifier(), Device::Cpu, &CompileOptions::inference()).unwrap();
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("named-dims-trace");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("trace.json");
    exe.trace_to(&path).unwrap();
    exe.run(&[("x", images(16, 1))]).unwrap();
    let at16 = exe.step_infos();
    assert!(exe.optimized_ir().contains("f32[16,10]"));
    exe.run(&[("x", images(2, 1))]).unwrap();
    assert!(exe.optimized_ir().contains("f32[2,10]"));
    let at2 = exe.step_infos();
    let trace: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let steps: Vec<u64> = trace["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["cat"].as_str() == Some("step"))
        .map(|e| e["args"]["bytes"].as_u64().unwrap())
        .collect();
    let bytes = |infos: &[rustytorch::trace::StepInfo]| -> Vec<u64> {
        infos.iter().map(|i| i.bytes).collect()
    };
    assert_eq!(steps.len(), at16.len() + at2.len());
    assert_eq!(steps[..at16.len()], bytes(&at16)[..]);
    assert_eq!(steps[at16.len()..], bytes(&at2)[..]);
    assert_ne!(bytes(&at16), bytes(&at2));
}
