//! Step timing and traces on the test device (CUDA where `RUSTYTORCH_TEST_CUDA=1`, else the CPU):
//! a GPT-2 block's run traced to a Chrome trace whose step events sum to the run's time, and
//! CUDA graph replay as a compile option.

use rustytorch::models::{gpt2_block, Gpt2Config};
use rustytorch::prelude::*;
use rustytorch::runtime::StepClock;
use serde_json::Value;

fn cuda() -> bool {
    std::env::var("RUSTYTORCH_TEST_CUDA").as_deref() == Ok("1")
}

/// One GPT-2-small block traced on the device: the trace is valid JSON
/// with one step event per plan step, and the steps' device times account for the run: their
/// sum is within 10% of the span from the first step's start to the last step's end, and of the
/// plan's run time measured on its own.
#[test]
fn a_traced_gpt2_block_accounts_for_its_run_time() {
    let device = if cuda() { Device::Cuda(0) } else { Device::Cpu };
    // GPT-2-small's shape on CUDA (batch 8 × 1024 tokens); a smaller batch on the CPU.
    let (batch, seq) = if cuda() { (8, 1024) } else { (2, 256) };
    let cfg = Gpt2Config {
        layers: 1,
        batch,
        seq,
        d_model: 768,
        heads: 12,
    };
    let g = GraphBuilder::new();
    let x = g.input("x", DType::F32, [cfg.batch, cfg.seq, cfg.d_model]);
    let y = gpt2_block(&g, &cfg, 0, &x);
    g.output("y", &y);
    let mut exe = compile_graph(&g.graph().unwrap(), device, &CompileOptions::inference()).unwrap();
    let dir = std::env::temp_dir().join(format!("rustytorch-device-trace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("gpt2_block.json");
    exe.trace_to(&path).unwrap();
    let xv = rustytorch::ops::testing::rand_tensor(&x.ty().unwrap(), 3, -1.0, 1.0);
    for _ in 0..3 {
        exe.run(&[("x", xv.clone())]).unwrap();
    }
    let times = exe.step_times().expect("step times of the last run");
    let want_clock = if cuda() {
        StepClock::Device
    } else {
        StepClock::Host
    };
    assert_eq!(times.clock, want_clock);
    let ids: Vec<usize> = times.steps.iter().map(|s| s.step).collect();
    assert_eq!(ids, (0..exe.plan().steps.len()).collect::<Vec<_>>());
    let first = times.steps.first().unwrap().start_us;
    let last = times
        .steps
        .iter()
        .map(|s| s.start_us + s.dur_us)
        .fold(0.0, f64::max);
    let span = last - first;
    let sum = times.total_us();
    println!(
        "{} steps: sum {sum:.1} us, span {span:.1} us on {device}",
        ids.len()
    );
    assert!(
        span > 0.0 && sum <= span * 1.001 + 1.0,
        "sum {sum} span {span}"
    );
    assert!(sum >= 0.9 * span, "steps cover {sum} us of a {span} us run");
    // And against the run time measured on its own: the whole plan between two device
    // timestamps (a device session's `time_steps`; the CPU has no such clock).
    if cuda() {
        let run_us = exe.time_steps(5).unwrap() * 1e3;
        println!("run time measured alone: {run_us:.1} us");
        assert!(
            (sum - run_us).abs() <= 0.1 * run_us,
            "steps sum to {sum} us, the run takes {run_us} us"
        );
    }
    // The file is Trace Event Format JSON with one step event per step per run.
    let trace: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let events = trace["traceEvents"].as_array().expect("traceEvents");
    let steps = events
        .iter()
        .filter(|e| e["cat"].as_str() == Some("step"))
        .count();
    assert_eq!(steps, 3 * exe.plan().steps.len());
    let _ = std::fs::remove_dir_all(&dir);
}

/// `CompileOptions::graph_replay`: on the GPU a session with it on replays its captured plan from
/// the second run and computes what an eager one does; with it off it never replays (the CPU
/// never does).
#[test]
fn graph_replay_follows_the_compile_option() {
    let device = if cuda() { Device::Cuda(0) } else { Device::Cpu };
    let g = GraphBuilder::new();
    let x = g.input("x", DType::F32, [4, 32]);
    let w = g.param("w", [32, 32], Init::kaiming_uniform(32, 1));
    let y = x.matmul(&w).gelu().softmax(-1);
    g.output("y", &y);
    let graph = g.graph().unwrap();
    let xv = rustytorch::ops::testing::rand_tensor(&x.ty().unwrap(), 5, -1.0, 1.0);
    let mut outs = vec![];
    for replay in [false, true] {
        let opts = CompileOptions {
            graph_replay: replay,
            ..CompileOptions::inference()
        };
        let mut exe = compile_graph(&graph, device, &opts).unwrap();
        let mut last = None;
        for _ in 0..4 {
            last = Some(exe.run(&[("x", xv.clone())]).unwrap().into_vec().remove(0));
        }
        let replays = exe.graph_replays();
        if cuda() && replay {
            assert!(replays >= 2, "{replays} replays in 4 runs");
        } else {
            assert_eq!(replays, 0);
        }
        outs.push(last.unwrap().to_f64_vec());
    }
    assert_eq!(outs[0], outs[1], "replayed and eager runs differ");
}
