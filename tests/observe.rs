//! Seeing inside: Graphviz pictures of canonical graphs before and after the passes (insta
//! snapshots of the DOT), the Chrome trace of a CPU run, the profile table and the memory
//! report. Update the snapshots with `INSTA_UPDATE=always cargo test --test observe` and review
//! the diff.

// The graph builders come first: the DOT's hover labels hold their source lines.

use rustytorch::compiler::inspect::dot::{to_dot, DotOptions, LayerView, Panel};
use rustytorch::compiler::passes::{run, Compiled, Options};
use rustytorch::models::{causal_attention_primitives, gelu_tanh_primitives, gpt2, Gpt2Config};
use rustytorch::prelude::*;
use rustytorch::profile::{profile, ProfileOptions};
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

fn mlp() -> GraphBuilder {
    let g = GraphBuilder::new();
    let x = g.input("x", DType::F32, [4, 16]);
    let w1 = g.param("w1", [16, 32], Init::kaiming_uniform(16, 1));
    let b1 = g.param("b1", [32], Init::zeros());
    let w2 = g.param("w2", [32, 8], Init::kaiming_uniform(32, 2));
    let b2 = g.param("b2", [8], Init::zeros());
    let h = gelu_tanh_primitives(&x.matmul(&w1).add(&b1));
    g.output("y", &h.matmul(&w2).add(&b2).relu());
    g
}

fn attention() -> GraphBuilder {
    let g = GraphBuilder::new();
    let q = g.input("q", DType::F32, [1, 2, 8, 4]);
    let k = g.input("k", DType::F32, [1, 2, 8, 4]);
    let v = g.input("v", DType::F32, [1, 2, 8, 4]);
    let o = causal_attention_primitives(&q, &k, &v);
    // A residual and a scale after it, so fusion has an elementwise chain to group.
    g.output("o", &o.add(&q).mul_scalar(0.5).tanh());
    g
}

fn compiled(g: &GraphBuilder, optimize: bool) -> Compiled {
    let opts = Options {
        optimize,
        fuse: optimize,
        dump: vec![],
        ..Options::default()
    };
    run(&g.graph().unwrap(), &opts).unwrap()
}

fn before_after(g: &GraphBuilder) -> String {
    let (a, b) = (compiled(g, false), compiled(g, true));
    let panels = [
        Panel {
            title: "before",
            graph: &a.graph,
            memory: a.report.memory.as_ref(),
        },
        Panel {
            title: "after",
            graph: &b.graph,
            memory: b.report.memory.as_ref(),
        },
    ];
    let opts = DotOptions {
        baseline: Some(&a.graph),
        legend: false,
        ..DotOptions::default()
    };
    to_dot(&panels, &opts).text
}

#[test]
fn dot_of_an_mlp_before_and_after() {
    let dot = before_after(&mlp());
    // The optimizer's GEMM epilogues are marked as recognized; the source has none.
    assert!(dot.contains("gemm + epilogue (recognized)"), "{dot}");
    insta::assert_snapshot!(dot);
}

#[test]
fn dot_of_an_attention_block_before_and_after() {
    let dot = before_after(&attention());
    assert!(dot.contains("attention (recognized)"), "{dot}");
    // The elementwise tail is one fused kernel drawn as a cluster of its ops.
    assert!(dot.contains("fused kernel, 3 ops"), "{dot}");
    insta::assert_snapshot!(dot);
}

#[test]
fn dot_tooltips_hold_sources_and_memory_offsets() {
    let dot = before_after(&mlp());
    assert!(dot.contains("built at tests/observe.rs:"), "{dot}");
    assert!(dot.contains("arena [0x"), "{dot}");
    // Every cluster and node statement is balanced (a cheap syntax check without Graphviz).
    assert_eq!(dot.matches('{').count(), dot.matches('}').count());
}

#[test]
fn repeated_layers_collapse_into_one_box_each() {
    let g = GraphBuilder::new();
    let cfg = Gpt2Config {
        layers: 4,
        batch: 1,
        seq: 4,
        d_model: 8,
        heads: 2,
    };
    let (_, h) = gpt2(&g, &cfg);
    g.output("h", &h);
    let c = compiled(&g, true);
    let panel = [Panel {
        title: "gpt2",
        graph: &c.graph,
        memory: None,
    }];
    let opts = DotOptions {
        layers: LayerView::Only(BTreeSet::from([1])),
        ..DotOptions::default()
    };
    let dot = to_dot(&panel, &opts);
    assert_eq!(dot.collapsed, ["h0", "h2", "h3"]);
    assert!(dot.text.contains("label=\"h1\""), "layer h1 is a cluster");
    assert_eq!(dot.text.matches("(collapsed)").count(), 3);
    // Automatic: a small limit collapses every layer but the first.
    let auto = DotOptions {
        collapse_above: 10,
        ..DotOptions::default()
    };
    assert_eq!(to_dot(&panel, &auto).collapsed, ["h1", "h2", "h3"]);
    let all = to_dot(&panel, &DotOptions::default());
    assert!(all.collapsed.is_empty());
}

fn scratch(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("observe-{name}"));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn input(dims: &[usize], seed: u64) -> HostTensor {
    rustytorch::ops::testing::rand_tensor(
        &TensorType::new(DType::F32, dims.to_vec()),
        seed,
        -1.0,
        1.0,
    )
}

#[test]
fn the_trace_of_a_cpu_run_has_one_event_per_step() {
    let g = mlp();
    let mut exe = compile_graph(
        &g.graph().unwrap(),
        Device::Cpu,
        &CompileOptions::inference(),
    )
    .unwrap();
    let path = scratch("trace").join("mlp.json");
    exe.trace_to(&path).unwrap();
    let x = input(&[4, 16], 1);
    for _ in 0..2 {
        exe.run(&[("x", x.clone())]).unwrap();
        // The file is complete JSON after every run.
        let _: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    }
    let trace: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let events = trace["traceEvents"].as_array().expect("traceEvents array");
    for e in events {
        let ph = e["ph"].as_str().expect("every event has a phase");
        assert!(ph == "X" || ph == "M", "{e}");
        assert!(e["pid"].is_u64() && e["name"].is_string(), "{e}");
        if ph == "X" {
            assert!(
                e["ts"].is_number() && e["dur"].as_f64().unwrap() >= 0.0,
                "{e}"
            );
            assert!(e["tid"].is_u64(), "{e}");
        }
    }
    let of = |cat: &str| -> Vec<&Value> {
        events
            .iter()
            .filter(|e| e["cat"].as_str() == Some(cat))
            .collect()
    };
    let passes: Vec<&str> = of("pass")
        .iter()
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        passes,
        [
            "verify",
            "optimize",
            "attention_layout",
            "accumulate",
            "fuse",
            "plan",
            "lower",
            "prepare"
        ]
    );
    assert_eq!(of("run").len(), 2);
    let infos = exe.step_infos();
    assert_eq!(infos.len(), exe.plan().steps.len());
    let steps = of("step");
    assert_eq!(steps.len(), 2 * infos.len(), "one event per step per run");
    for (e, info) in steps.iter().zip(infos.iter().chain(&infos)) {
        let name = e["name"].as_str().unwrap();
        assert_eq!(name, info.name());
        assert!(
            name.starts_with(exe.plan().steps[info.step].op.name()),
            "{name}"
        );
        // The builder's source location names the step.
        assert!(name.contains(" @ tests/observe.rs:"), "{name}");
        assert_eq!(e["args"]["step"].as_u64(), Some(info.step as u64));
        assert_eq!(e["args"]["bytes"].as_u64(), Some(info.bytes));
        assert_eq!(e["args"]["flops"].as_u64(), Some(info.flops));
    }
    // The two GEMMs of [4,16]x[16,32] and [4,32]x[32,8].
    let gemm_flops: u64 = infos
        .iter()
        .filter(|i| i.op.starts_with("matmul"))
        .map(|i| i.flops)
        .sum();
    assert_eq!(gemm_flops, 2 * 4 * 16 * 32 + 2 * 4 * 32 * 8);
    // Steps nest inside their run.
    let run1 = of("run")[0];
    let (t0, t1) = (
        run1["ts"].as_f64().unwrap(),
        run1["ts"].as_f64().unwrap() + run1["dur"].as_f64().unwrap(),
    );
    for e in &steps[..infos.len()] {
        let ts = e["ts"].as_f64().unwrap();
        assert!(ts >= t0 - 1.0 && ts <= t1 + 1.0, "{e} outside {t0}..{t1}");
    }
    exe.stop_trace();
    exe.run(&[("x", x)]).unwrap();
    let after: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(after["traceEvents"].as_array().unwrap().len(), events.len());
}

#[test]
fn step_timing_is_off_by_default_and_times_every_step_when_on() {
    let mut exe = compile_graph(
        &mlp().graph().unwrap(),
        Device::Cpu,
        &CompileOptions::inference(),
    )
    .unwrap();
    let x = input(&[4, 16], 2);
    exe.run(&[("x", x.clone())]).unwrap();
    assert!(exe.step_times().is_none());
    assert!(exe.set_step_timing(true), "the cpu times steps");
    exe.run(&[("x", x)]).unwrap();
    let t = exe.step_times().expect("times of the last run");
    assert_eq!(t.clock, rustytorch::runtime::StepClock::Host);
    let ids: Vec<usize> = t.steps.iter().map(|s| s.step).collect();
    assert_eq!(ids, (0..exe.plan().steps.len()).collect::<Vec<_>>());
    assert!(t.steps.windows(2).all(|w| w[1].start_us >= w[0].start_us));
}

#[test]
fn the_profile_table_lists_every_op_kind_it_runs() {
    let g = GraphBuilder::new();
    let x = g.input("x", DType::F32, [8, 16]);
    let w = g.param("w", [16, 16], Init::kaiming_uniform(16, 3));
    let b = g.param("b", [16], Init::zeros());
    let h = x.matmul(&w).add(&b).relu();
    let p = h.softmax(-1);
    g.output("p", &p);
    g.output("s", &h.sum(&[1], false).exp());
    let opts = CompileOptions {
        optimize: false,
        ..CompileOptions::inference()
    };
    let mut exe = compile_graph(&g.graph().unwrap(), Device::Cpu, &opts).unwrap();
    let x = input(&[8, 16], 4);
    let runs = 3;
    let prof = profile(
        &mut exe,
        &[("x", x)],
        &ProfileOptions {
            runs,
            warmup: 1,
            ..ProfileOptions::default()
        },
    )
    .unwrap();
    let mut want: BTreeMap<&str, u64> = BTreeMap::new();
    for s in &exe.plan().steps {
        *want.entry(s.op.name()).or_default() += runs as u64;
    }
    for k in ["matmul", "add", "relu", "softmax", "reduce_sum", "exp"] {
        assert!(want.contains_key(k), "the plan runs {k}: {want:?}");
    }
    let got: BTreeMap<&str, u64> = prof
        .rows
        .iter()
        .map(|r| (r.name.as_str(), r.calls))
        .collect();
    assert_eq!(got, want);
    let table = prof.to_string();
    for k in want.keys() {
        assert!(
            table.lines().any(|l| l.starts_with(&format!("{k} "))),
            "{k} missing from\n{table}"
        );
    }
    assert!(
        table.contains("Calls") && table.contains("TFLOP/s"),
        "{table}"
    );
    let share: f64 = prof.rows.iter().map(|r| r.share).sum();
    assert!(
        (share - 100.0).abs() < 1e-6 || prof.step_ms_per_run == 0.0,
        "{share}"
    );
    assert!(prof.rows.windows(2).all(|w| w[0].total_ms >= w[1].total_ms));
    let json: Value = serde_json::from_str(&prof.to_json()).unwrap();
    assert_eq!(json["rows"].as_array().unwrap().len(), want.len());
    // Timing is off again afterwards.
    exe.run(&[("x", input(&[8, 16], 5))]).unwrap();
    assert!(exe.step_times().is_none());
}

#[test]
fn the_memory_report_names_the_largest_values_at_the_peak() {
    let g = GraphBuilder::new();
    let x = g.input("x", DType::F32, [32, 64]);
    let w = g.param("w", [64, 256], Init::kaiming_uniform(64, 1));
    let h = x.matmul(&w).relu(); // [32, 256]: the largest value
    g.output("y", &h.sum(&[1], false));
    let exe = compile_graph(
        &g.graph().unwrap(),
        Device::Cpu,
        &CompileOptions::inference(),
    )
    .unwrap();
    let r = exe.memory_report().expect("a memory plan");
    assert_eq!(r.arena_bytes, exe.plan().arena_bytes);
    assert_eq!(r.at_peak[0].ty.shape.dims(), &[32, 256]);
    assert!(r.at_peak[0].op.starts_with("matmul"), "{r:?}");
    let text = r.to_string();
    assert!(text.contains("peak: "), "{text}");
    assert!(text.contains("built at tests/observe.rs:"), "{text}");
}
