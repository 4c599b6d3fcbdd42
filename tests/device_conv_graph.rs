//! Convolution forward through cuDNN's graph API on CUDA, against a float64 CPU reference and
//! against the legacy path (`RUSTYTORCH_CUDNN_GRAPH=0`): with and without a bias and a ReLU
//! (pointwise nodes of the same cuDNN graph), f32, f16 and bf16, channels-first and
//! channels-last, 2-D and 3-D, groups, strides and dilations. On CUDA where
//! `RUSTYTORCH_TEST_CUDA=1` (the GPU machine); elsewhere it prints a notice and returns.

use rustytorch::compiler::Graph;

use rustytorch::ops::{eval_cpu, Activation, ConvGeom, Layout, Op};
use rustytorch::prelude::*;
use rustytorch::runtime::cuda::dnn::{fused_act_supported, graph_stats};

#[path = "common/conv_check.rs"]
mod conv_check;
use conv_check::{cuda, rnd, scaled_close};

const FLOATS: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// Runs `op` alone (unoptimized) on cuda:0 with the graph API on or off, twice (the second run
/// may replay a captured CUDA graph); returns the second result.
fn run_cuda(what: &str, op: &Op, inputs: &[HostTensor], graph: bool) -> HostTensor {
    // The runtime reads the switch when it prepares a step; this test sets it alone, in one
    // thread.
    std::env::set_var("RUSTYTORCH_CUDNN_GRAPH", if graph { "1" } else { "0" });
    let mut g = Graph::new();
    let ids: Vec<_> = inputs
        .iter()
        .enumerate()
        .map(|(i, x)| g.add_input(&format!("x{i}"), x.ty()).unwrap())
        .collect();
    let y = g.add(op.clone(), &ids).unwrap();
    g.add_output("y", y).unwrap();
    let opts = CompileOptions {
        optimize: false,
        ..CompileOptions::default()
    };
    let mut exe = rustytorch::compile_graph(&g, Device::Cuda(0), &opts)
        .unwrap_or_else(|e| panic!("{what}: compile: {e}"));
    let names: Vec<String> = (0..inputs.len()).map(|i| format!("x{i}")).collect();
    let args: Vec<(&str, HostTensor)> = names
        .iter()
        .map(|n| n.as_str())
        .zip(inputs.iter().cloned())
        .collect();
    let mut out = None;
    for run in 0..2 {
        let got = exe
            .run(&args)
            .unwrap_or_else(|e| panic!("{what}: run {run} (graph API {graph}): {e}"));
        out = Some(got.into_vec().remove(0));
    }
    std::env::remove_var("RUSTYTORCH_CUDNN_GRAPH");
    out.expect("ran")
}

/// One case: x and w dims in the op's layout, stride, padding, dilation, groups.
struct Case {
    x: &'static [usize],
    w: &'static [usize],
    stride: usize,
    pad: usize,
    dil: usize,
    groups: usize,
    layout: Layout,
}

const CASES: &[Case] = &[
    // Channels-last (NHWC / NDHWC, weights O, window, I/groups).
    Case {
        x: &[2, 10, 9, 16],
        w: &[32, 3, 3, 16],
        stride: 1,
        pad: 1,
        dil: 1,
        groups: 1,
        layout: Layout::ChannelsLast,
    },
    Case {
        x: &[2, 11, 13, 16],
        w: &[32, 3, 3, 8],
        stride: 2,
        pad: 1,
        dil: 1,
        groups: 2,
        layout: Layout::ChannelsLast,
    },
    Case {
        x: &[2, 12, 12, 8],
        w: &[16, 3, 3, 8],
        stride: 1,
        pad: 2,
        dil: 2,
        groups: 1,
        layout: Layout::ChannelsLast,
    },
    Case {
        x: &[1, 5, 6, 7, 16],
        w: &[16, 3, 3, 3, 16],
        stride: 1,
        pad: 1,
        dil: 1,
        groups: 1,
        layout: Layout::ChannelsLast,
    },
    // Channels-first (half precision is staged channels-last by the step).
    Case {
        x: &[2, 16, 9, 10],
        w: &[32, 16, 3, 3],
        stride: 1,
        pad: 1,
        dil: 1,
        groups: 1,
        layout: Layout::ChannelsFirst,
    },
    Case {
        x: &[2, 16, 13, 11],
        w: &[16, 4, 3, 3],
        stride: 2,
        pad: 2,
        dil: 2,
        groups: 4,
        layout: Layout::ChannelsFirst,
    },
    Case {
        x: &[1, 8, 5, 6, 7],
        w: &[8, 8, 3, 3, 3],
        stride: 1,
        pad: 1,
        dil: 1,
        groups: 1,
        layout: Layout::ChannelsFirst,
    },
];

#[test]
fn conv_forward_through_the_graph_api() {
    if !cuda() {
        println!("device_conv_graph: RUSTYTORCH_TEST_CUDA is not 1; skipped (CUDA only)");
        return;
    }
    let before = graph_stats();
    for (k, c) in CASES.iter().enumerate() {
        let n = c.x.len() - 2;
        let geom =
            ConvGeom::new(vec![c.stride; n], vec![c.pad; n], vec![c.dil; n]).with_layout(c.layout);
        // The first case in every combination; the others with a bias and a ReLU.
        let variants: &[(bool, Activation)] = if k == 0 {
            &[
                (false, Activation::None),
                (true, Activation::None),
                (false, Activation::Relu),
                (true, Activation::Relu),
            ]
        } else {
            &[(true, Activation::Relu)]
        };
        for &(bias, act) in variants {
            for (j, d) in FLOATS.into_iter().enumerate() {
                let seed = 7000 + 100 * k as u64 + 10 * j as u64 + 2 * bias as u64;
                let mut ins = vec![rnd(d, c.x, seed), rnd(d, c.w, seed + 1)];
                let out_ch = c.w[0];
                if bias {
                    ins.push(rnd(d, &[out_ch], seed + 2));
                }
                let op = Op::Conv {
                    geom: geom.clone(),
                    groups: c.groups,
                    bias,
                    act,
                };
                let what = format!(
                    "conv {:?} * {:?} s{} p{} d{} g{} {:?} bias {bias} {act:?} {d:?}",
                    c.x, c.w, c.stride, c.pad, c.dil, c.groups, c.layout
                );
                // The float64 reference on the same (rounded) inputs.
                let ins64: Vec<HostTensor> = ins.iter().map(|t| t.cast(DType::F64)).collect();
                let refs: Vec<&HostTensor> = ins64.iter().collect();
                let want = eval_cpu(&op, &refs).unwrap_or_else(|e| panic!("{what}: cpu: {e}"));
                let graph = run_cuda(&what, &op, &ins, true);
                let legacy = run_cuda(&what, &op, &ins, false);
                assert_eq!(graph.ty().dtype, d, "{what}");
                let want = want.to_f64_vec();
                scaled_close(
                    &graph.to_f64_vec(),
                    &want,
                    d,
                    &format!("{what} (graph API)"),
                );
                scaled_close(&legacy.to_f64_vec(), &want, d, &format!("{what} (legacy)"));
                scaled_close(
                    &graph.to_f64_vec(),
                    &legacy.to_f64_vec(),
                    d,
                    &format!("{what} (graph API against legacy)"),
                );
                if act == Activation::Relu {
                    assert!(
                        graph.to_f64_vec().iter().all(|&v| v >= 0.0),
                        "{what}: a negative value after ReLU"
                    );
                }
            }
        }
    }
    // Graph-API plans were made and timed against the legacy algorithm for some of the steps.
    let after = graph_stats();
    assert!(
        after.timed > before.timed,
        "no convolution was timed on the graph API: {after:?}"
    );
    println!("cuDNN graph API: {after:?}");
}

#[test]
fn activations_every_step_can_apply() {
    assert!(fused_act_supported(Activation::None));
    assert!(fused_act_supported(Activation::Relu));
    assert!(!fused_act_supported(Activation::GeluErf));
    assert!(!fused_act_supported(Activation::GeluTanh));
}
