//! Norms, softmax and reductions with elementwise producers fused into their input (a prologue)
//! and elementwise consumers into their output (an epilogue), end to end: the cases real models
//! have (BERT's post-LN `layer_norm(x + y)`, a bias add before RMSNorm, `softmax(x · s + mask)`,
//! `layer_norm(x) · 0.5 + z`, `cast(softmax(x))`, `sum(x · y)`, `sqrt(mean(x · x))`), each
//! compiled with fusion against the same graph compiled without it and against the graph in f64,
//! on random inputs, several shapes (odd row lengths included) and f32/f16/bf16; the fused IR of
//! each case (snapshot); GPT-2's pre-LN sum, used twice, which stays unfused; and every fused
//! kernel compiled with NVRTC where NVRTC is present (`RUSTYTORCH_TEST_NVRTC=1` requires it).
//! CUDA where `RUSTYTORCH_TEST_CUDA=1` (the GPU machine); elsewhere the CPU executable.

use rustytorch::codegen::cuda::{lower_step, source, CudaStep};
use rustytorch::compiler::fuse::describe_groups;
use rustytorch::compiler::inspect::op_summary;
use rustytorch::compiler::passes::{run, Options};
use rustytorch::compiler::Graph;
use rustytorch::ops::testing::{assert_close, rand_tensor, tolerance};
use rustytorch::ops::Op;
use rustytorch::prelude::*;

fn cuda() -> bool {
    std::env::var("RUSTYTORCH_TEST_CUDA").as_deref() == Ok("1")
}

fn device() -> Device {
    if cuda() {
        Device::Cuda(0)
    } else {
        Device::Cpu
    }
}

/// The fused cases.
#[derive(Clone, Copy, Debug)]
enum Case {
    /// `layer_norm(x + y, w, b)`.
    PostLn,
    /// `rms_norm(x + bias, w)`, the bias broadcast along the rows.
    BiasRms,
    /// `softmax(x · 0.125 + mask)`, x [2, 3, r, d] and the mask [2, 1, 1, d].
    MaskedSoftmax,
    /// `layer_norm(x) · 0.5 + z`.
    LnEpilogue,
    /// `cast<f32>(softmax(x))` (or to f16 from f32).
    CastSoftmax,
    /// `sum(x · y)` over the last axis.
    SumProduct,
    /// `sqrt(mean(x · x, keep))` over the last axis.
    RootMeanSquare,
}

const CASES: [Case; 7] = [
    Case::PostLn,
    Case::BiasRms,
    Case::MaskedSoftmax,
    Case::LnEpilogue,
    Case::CastSoftmax,
    Case::SumProduct,
    Case::RootMeanSquare,
];

/// The graph of `case` over rows of `d` elements in dtype `dt`, and its inputs' types.
fn build(case: Case, dt: DType, r: usize, d: usize) -> (Graph, Vec<(String, TensorType)>) {
    let g = GraphBuilder::new();
    let mut inputs = vec![];
    let mut input = |name: &str, dims: &[usize]| {
        inputs.push((name.to_string(), TensorType::new(dt, dims.to_vec())));
        g.input(name, dt, dims.to_vec())
    };
    let y = match case {
        Case::PostLn => {
            let (x, y) = (input("x", &[r, d]), input("y", &[r, d]));
            let (w, b) = (input("w", &[d]), input("b", &[d]));
            (&x + &y).layer_norm(Some(&w), Some(&b), 1e-5)
        }
        Case::BiasRms => {
            let (x, bias, w) = (input("x", &[r, d]), input("bias", &[d]), input("w", &[d]));
            (&x + &bias).rms_norm(Some(&w), 1e-6)
        }
        Case::MaskedSoftmax => {
            let x = input("x", &[2, 3, r, d]);
            let mask = input("mask", &[2, 1, 1, d]);
            (&(&x * 0.125) + &mask).softmax(-1)
        }
        Case::LnEpilogue => {
            let (x, z) = (input("x", &[r, d]), input("z", &[r, d]));
            &(&x.layer_norm(None, None, 1e-5) * 0.5) + &z
        }
        Case::CastSoftmax => {
            let x = input("x", &[r, d]);
            let to = if dt == DType::F32 {
                DType::F16
            } else {
                DType::F32
            };
            x.softmax(-1).cast(to)
        }
        Case::SumProduct => {
            let (x, y) = (input("x", &[r, d]), input("y", &[r, d]));
            (&x * &y).sum(&[-1], false)
        }
        Case::RootMeanSquare => {
            let x = input("x", &[r, d]);
            (&x * &x).mean(&[-1], true).sqrt()
        }
    };
    g.output("out", &y);
    (g.graph().unwrap(), inputs)
}

/// Random inputs (uniform in ±2, never zero in practice) of the given types.
fn random(tys: &[(String, TensorType)], seed: u64) -> Vec<(String, HostTensor)> {
    tys.iter()
        .enumerate()
        .map(|(i, (n, t))| (n.clone(), rand_tensor(t, seed + i as u64, -2.0, 2.0)))
        .collect()
}

fn run_on(
    graph: &Graph,
    device: Device,
    optimize: bool,
    inputs: &[(String, HostTensor)],
) -> HostTensor {
    let opts = CompileOptions {
        optimize,
        ..CompileOptions::default()
    };
    let mut exe = rustytorch::compile_graph(graph, device, &opts).unwrap();
    let args: Vec<(&str, HostTensor)> = inputs
        .iter()
        .map(|(n, t)| (n.as_str(), t.clone()))
        .collect();
    exe.run(&args).unwrap().into_vec().remove(0)
}

/// Row kernels the fusion pass forms in `graph`.
fn fused_rows(graph: &Graph) -> usize {
    let c = run(graph, &Options::default()).unwrap();
    c.report.fuse.as_ref().unwrap().rows
}

/// A looser bound for f16/bf16 against f64: the unfused graph rounds the prologue's result and the
/// row op's result to the dtype, and each of those roundings moves the result by up to half a
/// unit of the last place.
fn reference_tol(dt: DType) -> f64 {
    match dt {
        DType::F32 => 1e-4,
        other => 4.0 * tolerance(other),
    }
}

#[test]
fn fused_rows_match_the_unfused_graph_and_f64() {
    for case in CASES {
        for dt in [DType::F32, DType::F16, DType::BF16] {
            // 65 × 768 is large enough for the CPU kernels to split rows over threads.
            for &(r, d) in &[(3, 7), (4, 33), (5, 64), (2, 768), (65, 768)] {
                let what = format!("{case:?} {dt} {r}x{d}");
                let (graph, tys) = build(case, dt, r, d);
                assert_eq!(fused_rows(&graph), 1, "{what}: one row kernel");
                let inputs = random(&tys, 17 * d as u64 + r as u64);
                let fused = run_on(&graph, device(), true, &inputs);
                let unfused = run_on(&graph, device(), false, &inputs);
                assert_eq!(fused.ty(), unfused.ty(), "{what}");
                // The same kernels in the same order on the CPU: equal to the last bit there.
                let tol = if cuda() {
                    2.0 * tolerance(fused.dtype())
                } else {
                    0.0
                };
                assert_close(&fused.to_f64_vec(), &unfused.to_f64_vec(), tol, &what);
                // The graph in f64 on the same values.
                let (g64, _) = build(case, DType::F64, r, d);
                let in64: Vec<(String, HostTensor)> = inputs
                    .iter()
                    .map(|(n, t)| (n.clone(), t.cast(DType::F64)))
                    .collect();
                let want = run_on(&g64, Device::Cpu, false, &in64);
                let tol = reference_tol(dt).max(reference_tol(fused.dtype()));
                assert_close(
                    &fused.to_f64_vec(),
                    &want.to_f64_vec(),
                    tol,
                    &format!("{what} vs f64"),
                );
            }
        }
    }
}

#[test]
fn a_sum_used_twice_stays_out_of_the_norm() {
    // GPT-2's pre-LN residual: h = x + a is an output and the norm's input. A kernel with two
    // results would write both; the row kernel has one, so the sum stays its own kernel.
    let g = GraphBuilder::new();
    let x = g.input("x", DType::F32, [4, 64]);
    let a = g.input("a", DType::F32, [4, 64]);
    let h = &x + &a;
    g.output("h", &h);
    g.output("n", &h.layer_norm(None, None, 1e-5));
    assert_eq!(fused_rows(&g.graph().unwrap()), 0);
}

#[test]
fn gradients_fuse_after_differentiation() {
    // d/dx and d/dw of mean(layer_norm(x + y, w, b)²): fusion runs on the differentiated graph,
    // whose forward and backward both hold fusable rows.
    for dt in [DType::F32, DType::BF16] {
        let g = GraphBuilder::new();
        let (r, d) = (6, 40);
        let x = g.input("x", dt, [r, d]);
        let y = g.input("y", dt, [r, d]);
        let w = g.input("w", dt, [d]);
        let b = g.input("b", dt, [d]);
        let n = (&x + &y).layer_norm(Some(&w), Some(&b), 1e-5);
        let loss = (&n * &n).mean_all();
        g.output("loss", &loss);
        let mut graph = g.graph().unwrap();
        let wrt = [x.id().unwrap(), w.id().unwrap()];
        let grads =
            rustytorch::compiler::autodiff::grad(&mut graph, loss.id().unwrap(), &wrt).unwrap();
        graph.add_output("gx", grads[0]).unwrap();
        graph.add_output("gw", grads[1]).unwrap();
        assert!(fused_rows(&graph) >= 2, "{dt}");
        let tys: Vec<(String, TensorType)> = [
            ("x", vec![r, d]),
            ("y", vec![r, d]),
            ("w", vec![d]),
            ("b", vec![d]),
        ]
        .into_iter()
        .map(|(n, s)| (n.to_string(), TensorType::new(dt, s)))
        .collect();
        let inputs = random(&tys, 99);
        let args: Vec<(&str, HostTensor)> = inputs
            .iter()
            .map(|(n, t)| (n.as_str(), t.clone()))
            .collect();
        let mut outs = vec![];
        for optimize in [true, false] {
            let opts = CompileOptions {
                optimize,
                ..CompileOptions::default()
            };
            let mut exe = rustytorch::compile_graph(&graph, device(), &opts).unwrap();
            outs.push(exe.run(&args).unwrap().into_vec());
        }
        for (f, u) in outs[0].iter().zip(&outs[1]) {
            // The optimizer rewrites the backward graph, so the order of operations differs.
            assert_close(
                &f.to_f64_vec(),
                &u.to_f64_vec(),
                4.0 * tolerance(dt),
                &format!("{dt}"),
            );
        }
    }
}

#[test]
fn fused_ir_of_each_case() {
    let mut s = String::new();
    for case in CASES {
        let (graph, _) = build(case, DType::F32, 4, 64);
        let c = run(&graph, &Options::default()).unwrap();
        let summaries: Vec<String> = c
            .graph
            .topo_order()
            .unwrap()
            .into_iter()
            .map(|id| &c.graph.node(id).unwrap().op)
            .filter(|op| matches!(op, Op::FusedRow(_)))
            .map(op_summary)
            .collect();
        s.push_str(&format!(
            "# {case:?}: {}\n{}\n",
            summaries.join(", "),
            describe_groups(&c.graph)
        ));
    }
    insta::assert_snapshot!(s);
}

/// The row kernels of `case`'s fused graph, lowered for CUDA: (name, source) of every launch.
fn kernels(case: Case, dt: DType, r: usize, d: usize) -> Vec<(String, String)> {
    let (graph, _) = build(case, dt, r, d);
    let g = run(&graph, &Options::default()).unwrap().graph;
    let mut out = vec![];
    for id in g.topo_order().unwrap() {
        let node = g.node(id).unwrap();
        if !matches!(node.op, Op::FusedRow(_)) {
            continue;
        }
        let ins: Vec<TensorType> = node
            .inputs
            .iter()
            .map(|&i| g.node(i).unwrap().ty.clone())
            .collect();
        let refs: Vec<&TensorType> = ins.iter().collect();
        let step = lower_step(&node.op, &refs, &node.ty).unwrap();
        let CudaStep::Kernels(k) = step else {
            panic!("{case:?}: {step:?}")
        };
        for l in &k.launches {
            out.push((l.kernel.name.clone(), source(&l.kernel).unwrap()));
        }
    }
    out
}

#[test]
fn fused_row_kernels_compile_with_nvrtc() {
    use rustytorch::runtime::cuda::compile::KernelCompiler;
    let required = std::env::var("RUSTYTORCH_TEST_NVRTC").as_deref() == Ok("1");
    let compiler = match KernelCompiler::with_dir((9, 0), None) {
        Ok(c) => c,
        Err(e) if required => panic!("RUSTYTORCH_TEST_NVRTC=1 but NVRTC is unavailable: {e}"),
        Err(e) => {
            eprintln!("skipped: {e}");
            return;
        }
    };
    let mut n = 0;
    for case in CASES {
        for dt in [DType::F32, DType::F16, DType::BF16] {
            // One-pass rows (a warp, a block of 128 and of 1024 threads per row), odd rows
            // (the parts in turn) and long reductions (two stages).
            for &(r, d) in &[(8, 64), (4, 4096), (2, 16384), (3, 33), (2, 65536)] {
                for (name, src) in kernels(case, dt, r, d) {
                    compiler
                        .cubin(&name, &src)
                        .unwrap_or_else(|e| panic!("{case:?} {dt} {r}x{d}: {name}: {e}"));
                    n += 1;
                }
            }
        }
    }
    assert!(n > 100, "{n} kernels");
}
