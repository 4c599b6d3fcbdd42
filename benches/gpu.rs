//! The GPU bench harness: the workloads the CUDA backend is measured on, timed on the device
//! (CUDA events around back-to-back executions of a prepared plan: no host copies), printed as a
//! table and written as JSON to `$OUT/rustytorch_gpu.json`. Run it on the GPU machine through the
//! `../shared/gpu` loop (`stage --bench`, then `run.sh --bench`) beside
//! `../shared/peers/torch_peers.py`, which measures PyTorch on the same workloads in the same run.
//!
//! Without a GPU it prints why and exits successfully (CI builds it; only the GPU machine runs it).

use rustytorch::codegen::lower;
use rustytorch::compiler::{passes, Graph};
use rustytorch::ops::{ConvGeom, Op, PoolKind};
use rustytorch::prelude::*;
use rustytorch::runtime::{Backend, CudaBackend, Session};
use std::sync::Arc;

struct Row {
    name: String,
    ms: f64,
    kernels: usize,
    metric: String,
    value: f64,
}

/// Compiles the graph of `g` computing `outs` (inference), prepares it on cuda:0 with every
/// parameter resident, runs it once, then times `iters` executions of its steps.
fn time(g: &GraphBuilder, outs: &[&Tensor], iters: usize, replay: bool) -> (f64, usize) {
    let mut graph = g.graph().expect("graph");
    for (i, t) in outs.iter().enumerate() {
        graph
            .add_output(&format!("out{i}"), t.node().expect("node"))
            .expect("output");
    }
    time_graph(&graph, iters, replay)
}

/// [`time`] for a graph whose outputs are set.
fn time_graph(graph: &Graph, iters: usize, replay: bool) -> (f64, usize) {
    time_graph_with(graph, iters, replay, cuda_opts())
}

/// The compile passes as a CUDA compile runs them (attention reads its heads in place).
fn cuda_opts() -> passes::Options {
    passes::Options {
        attention_layout: true,
        attention_packed: true,
        defer_updates: true,
        ..Default::default()
    }
}

/// [`time_graph`] compiled with `opts` (the conv rows turn the CUDA channels-last pass on).
/// `RUSTYTORCH_BENCH_ITERS=N` times N steps instead of the row's own count, and
/// `RUSTYTORCH_CUDA_GRAPH=0` launches each step's kernels instead of replaying its graph, so
/// that a row can be timed as a peer is.
fn time_graph_with(
    graph: &Graph,
    iters: usize,
    replay: bool,
    opts: passes::Options,
) -> (f64, usize) {
    let iters = std::env::var("RUSTYTORCH_BENCH_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(iters);
    let replay = replay && std::env::var("RUSTYTORCH_CUDA_GRAPH").as_deref() != Ok("0");
    let compiled = passes::run(graph, &opts).expect("compile");
    let memory = compiled.report.memory.expect("memory plan");
    let plan = Arc::new(lower(&compiled.graph, &memory).expect("lower"));
    let (mut s, inputs) = session(graph, &plan);
    s.set_graph_replay(replay);
    s.run(&inputs).expect("run");
    s.run(&inputs).expect("run"); // captures the CUDA graph when replay is on
    let _ = s.time_steps(2).expect("warm-up");
    (s.time_steps(iters).expect("timing"), plan.kernel_count())
}

/// [`time_graph_with`], and the device pool's peaks over it (started over before: its
/// parameters, activations, inputs and workspaces, what the graph needs on the device, as
/// `torch.cuda.max_memory_allocated` counts it).
fn time_graph_peak(
    graph: &Graph,
    iters: usize,
    replay: bool,
    opts: passes::Options,
) -> ((f64, usize), rustytorch::runtime::MemoryStats) {
    let backend = CudaBackend::new(0).expect("cuda:0");
    backend.reset_peak_memory_stats();
    let t = time_graph_with(graph, iters, replay, opts);
    (t, backend.memory_stats())
}

/// A cuda:0 session of `plan` (lowered from `graph`) with every parameter initialized and
/// resident, and random inputs for it.
fn session(
    graph: &Graph,
    plan: &Arc<rustytorch::codegen::Plan>,
) -> (Box<dyn Session>, Vec<Arc<HostTensor>>) {
    let params: Vec<Arc<HostTensor>> = graph
        .params
        .iter()
        .map(|p| Arc::new(p.init.materialize(&p.ty).expect("init")))
        .collect();
    let backend = CudaBackend::new(0).expect("cuda:0");
    let s: Box<dyn Session> = backend.prepare(plan.clone(), params).expect("prepare");
    let inputs: Vec<Arc<HostTensor>> = plan
        .inputs
        .iter()
        .map(|(_, ty)| Arc::new(rustytorch::ops::testing::rand_tensor(ty, 1, -1.0, 1.0)))
        .collect();
    (s, inputs)
}

fn p(g: &GraphBuilder, name: &str, dtype: DType, dims: &[usize]) -> Tensor {
    g.param_typed(
        name,
        TensorType::new(dtype, Shape::new(dims.to_vec())),
        Init::kaiming_uniform(*dims.last().unwrap_or(&1), name.len() as u64),
        false,
    )
}

fn tt(d: DType, dims: &[usize]) -> TensorType {
    TensorType::new(d, Shape::new(dims.to_vec()))
}

/// A graph of one convolution: forward only, or forward and both gradients (from a given output
/// gradient, as a training step computes them). Inputs x, w (and dy).
fn conv_graph(x: &[usize], w: &[usize], pad: usize, d: DType, backward: bool) -> Graph {
    let n = x.len() - 2;
    let geom = ConvGeom {
        stride: vec![1; n],
        padding: vec![pad; n],
        dilation: vec![1; n],
        layout: Default::default(),
    };
    let mut g = Graph::new();
    let xi = g.add_input("x", tt(d, x)).expect("x");
    let wi = g.add_input("w", tt(d, w)).expect("w");
    let fwd = Op::Conv {
        geom: geom.clone(),
        groups: 1,
        bias: false,
        act: rustytorch_ops::Activation::None,
    };
    let y = g.add(fwd, &[xi, wi]).expect("conv");
    g.add_output("y", y).expect("y");
    if backward {
        let yt = g.node(y).expect("node").ty.clone();
        let dy = g.add_input("dy", yt).expect("dy");
        let gi = Op::ConvGradInput {
            geom: geom.clone(),
            groups: 1,
            input_shape: Shape::new(x.to_vec()),
        };
        let gw = Op::ConvGradWeight {
            geom,
            groups: 1,
            weight_shape: Shape::new(w.to_vec()),
        };
        let dx = g.add(gi, &[dy, wi]).expect("dx");
        let dw = g.add(gw, &[xi, dy]).expect("dw");
        g.add_output("dx", dx).expect("dx");
        g.add_output("dw", dw).expect("dw");
    }
    g
}

/// [`conv_graph`] as a channels-last user writes it: x and dy NHWC (NDHWC), w OHWI (ODHWI), each
/// permuted channels-first before the convolution and the results permuted back, so that
/// compiled for CUDA (the channels-last pass) no transpose is left. `x` and `w` are given
/// channels-first.
fn conv_graph_nhwc(x: &[usize], w: &[usize], pad: usize, d: DType, backward: bool) -> Graph {
    let r = x.len();
    let to_first: Vec<usize> = [0, r - 1].into_iter().chain(1..r - 1).collect();
    let to_last: Vec<usize> = std::iter::once(0).chain(2..r).chain([1]).collect();
    let last = |dims: &[usize]| to_last.iter().map(|&a| dims[a]).collect::<Vec<_>>();
    let n = r - 2;
    let geom = ConvGeom::new(vec![1; n], vec![pad; n], vec![1; n]);
    let mut g = Graph::new();
    let perm = |g: &mut Graph, v, p: &[usize]| {
        g.add(Op::Permute { perm: p.to_vec() }, &[v])
            .expect("permute")
    };
    let xl = g.add_input("x", tt(d, &last(x))).expect("x");
    let wl = g.add_input("w", tt(d, &last(w))).expect("w");
    let (xi, wi) = (perm(&mut g, xl, &to_first), perm(&mut g, wl, &to_first));
    let fwd = Op::Conv {
        geom: geom.clone(),
        groups: 1,
        bias: false,
        act: rustytorch_ops::Activation::None,
    };
    let y = g.add(fwd, &[xi, wi]).expect("conv");
    let y_out = perm(&mut g, y, &to_last);
    g.add_output("y", y_out).expect("y");
    if backward {
        let yt = g.node(y).expect("node").ty.clone();
        let dyl = g
            .add_input("dy", tt(d, &last(yt.shape.dims())))
            .expect("dy");
        let dy = perm(&mut g, dyl, &to_first);
        let gi = Op::ConvGradInput {
            geom: geom.clone(),
            groups: 1,
            input_shape: Shape::new(x.to_vec()),
        };
        let gw = Op::ConvGradWeight {
            geom,
            groups: 1,
            weight_shape: Shape::new(w.to_vec()),
        };
        let dx = g.add(gi, &[dy, wi]).expect("dx");
        let dw = g.add(gw, &[xi, dy]).expect("dw");
        let (dx, dw) = (perm(&mut g, dx, &to_last), perm(&mut g, dw, &to_last));
        g.add_output("dx", dx).expect("dx");
        g.add_output("dw", dw).expect("dw");
    }
    g
}

/// A graph of one pooling (and its gradient with `backward`) over `x`.
fn pool_graph(
    x: &[usize],
    kind: PoolKind,
    k: usize,
    s: usize,
    pad: usize,
    backward: bool,
) -> Graph {
    let geom = ConvGeom {
        stride: vec![s; 2],
        padding: vec![pad; 2],
        dilation: vec![1; 2],
        layout: Default::default(),
    };
    let mut g = Graph::new();
    let xi = g.add_input("x", tt(DType::F16, x)).expect("x");
    let fwd = Op::Pool {
        kind,
        kernel: vec![k; 2],
        geom: geom.clone(),
    };
    let y = g.add(fwd, &[xi]).expect("pool");
    g.add_output("y", y).expect("y");
    if backward {
        let yt = g.node(y).expect("node").ty.clone();
        let dy = g.add_input("dy", yt).expect("dy");
        let bwd = Op::PoolGrad {
            kind,
            kernel: vec![k; 2],
            geom,
        };
        let dx = g.add(bwd, &[xi, dy]).expect("dx");
        g.add_output("dx", dx).expect("dx");
    }
    g
}

/// Convolutions and pooling through cuDNN (NCHW), at the shapes PyTorch is measured on.
fn conv_rows(push: &mut dyn FnMut(&str, (f64, usize), &str, f64)) {
    let f16 = DType::F16;
    let tflops = |fl: f64, ms: f64| fl / (ms * 1e-3) / 1e12;
    // (shape label, x, w, dtype, forward+backward too, timed runs); padding 1, stride 1.
    type ConvRow<'a> = (&'a str, &'a [usize], &'a [usize], DType, bool, usize);
    let rows: [ConvRow; 4] = [
        (
            "conv2d 3x3 64c 56x56 b64 f16",
            &[64, 64, 56, 56],
            &[64, 64, 3, 3],
            f16,
            true,
            10,
        ),
        (
            "conv2d 3x3 64c 56x56 b64 f32",
            &[64, 64, 56, 56],
            &[64, 64, 3, 3],
            DType::F32,
            false,
            10,
        ),
        (
            "conv1d k3 256c L4096 b32 f16",
            &[32, 256, 4096],
            &[256, 256, 3],
            f16,
            true,
            10,
        ),
        (
            "conv3d 3x3x3 64c 16x56x56 b8 f16",
            &[8, 64, 16, 56, 56],
            &[64, 64, 3, 3, 3],
            f16,
            true,
            5,
        ),
    ];
    // The channels-last pass, as a CUDA compile turns it on.
    let cl_opts = || passes::Options {
        channels_last: Some(rustytorch::codegen::cuda::dnn::channels_last()),
        ..cuda_opts()
    };
    for (label, x, w, d, with_bwd, iters) in rows {
        // Same-size output: 2·N·K·(C·window)·spatial multiply-adds.
        let fwd = 2.0
            * (x[0] * x[2..].iter().product::<usize>()) as f64
            * w.iter().product::<usize>() as f64;
        let passes: &[bool] = if with_bwd { &[false, true] } else { &[false] };
        for &bwd in passes {
            let g = conv_graph(x, w, 1, d, bwd);
            let t = time_graph(&g, iters, true);
            let (name, fl) = if bwd {
                ("fwd+bwd", 3.0 * fwd)
            } else {
                ("fwd", fwd)
            };
            push(&format!("{label} {name}"), t, "TFLOP/s", tflops(fl, t.0));
            // The same workload on channels-last graph tensors (PyTorch's NHWC/NDHWC rows).
            if d != DType::F32 && x.len() >= 4 {
                let g = conv_graph_nhwc(x, w, 1, d, bwd);
                let t = time_graph_with(&g, iters, true, cl_opts());
                let label = label.replacen(" f16", " f16 channels-last", 1);
                push(&format!("{label} {name}"), t, "TFLOP/s", tflops(fl, t.0));
            }
        }
    }
    // Pooling: bytes of the input plus the output over the time.
    let x = [64usize, 64, 112, 112];
    let n: usize = x.iter().product();
    let tb = |bytes: f64, ms: f64| bytes / (ms * 1e-3) / 1e12;
    let g = pool_graph(&x, PoolKind::Max, 3, 2, 1, false);
    let t = time_graph(&g, 20, true);
    push(
        "max pool 3x3 s2 64x64x112x112 f16 fwd",
        t,
        "TB/s",
        tb(n as f64 * 2.0 * 1.25, t.0),
    );
    let g = pool_graph(&x, PoolKind::Max, 3, 2, 1, true);
    let t = time_graph(&g, 20, true);
    push("max pool 3x3 s2 64x64x112x112 f16 fwd+bwd", t, "ms", t.0);
    let avg = PoolKind::Avg {
        count_include_pad: true,
    };
    let g = pool_graph(&x, avg, 2, 2, 0, false);
    let t = time_graph(&g, 20, true);
    push(
        "avg pool 2x2 64x64x112x112 f16 fwd",
        t,
        "TB/s",
        tb(n as f64 * 2.0 * 1.25, t.0),
    );
    // The copy bandwidth the pooling rows are held to, in the same run: a copy-like `neg` of the
    // same input (one read, one write).
    let g = GraphBuilder::new();
    let xi = p(&g, "x", f16, &x);
    let y = xi.neg();
    let t = time(&g, &[&y], 20, true);
    push(
        "copy-like neg 64x64x112x112 f16",
        t,
        "TB/s",
        tb(n as f64 * 2.0 * 2.0, t.0),
    );
}

/// cuDNN's graph API against its legacy `Find` path on channels-last f16 forward convolutions
/// (`RUSTYTORCH_CUDNN_GRAPH=0` set for the legacy rows: the runtime reads it when it prepares a
/// step), and a channels-last conv2d + bias + ReLU, the bias and ReLU pointwise nodes of the
/// convolution's cuDNN graph, against `benches/gpu_conv_peer.py` (eager and `torch.compile`).
fn conv_graph_api_rows(push: &mut dyn FnMut(&str, (f64, usize), &str, f64)) {
    let f16 = DType::F16;
    let tflops = |fl: f64, ms: f64| fl / (ms * 1e-3) / 1e12;
    let cl_opts = || passes::Options {
        channels_last: Some(rustytorch::codegen::cuda::dnn::channels_last()),
        ..cuda_opts()
    };
    let timed = |g: &Graph, iters: usize, graph_api: bool| {
        if graph_api {
            std::env::remove_var("RUSTYTORCH_CUDNN_GRAPH");
        } else {
            std::env::set_var("RUSTYTORCH_CUDNN_GRAPH", "0");
        }
        let t = time_graph_with(g, iters, true, cl_opts());
        std::env::remove_var("RUSTYTORCH_CUDNN_GRAPH");
        t
    };
    type Row<'a> = (&'a str, &'a [usize], &'a [usize], usize);
    let rows: [Row; 2] = [
        (
            "conv2d 3x3 64c 56x56 b64",
            &[64, 64, 56, 56],
            &[64, 64, 3, 3],
            10,
        ),
        (
            "conv3d 3x3x3 64c 16x56x56 b8",
            &[8, 64, 16, 56, 56],
            &[64, 64, 3, 3, 3],
            5,
        ),
    ];
    for (label, x, w, iters) in rows {
        let fl = 2.0
            * (x[0] * x[2..].iter().product::<usize>()) as f64
            * w.iter().product::<usize>() as f64;
        let g = conv_graph_nhwc(x, w, 1, f16, false);
        for (api, name) in [(true, "graph API"), (false, "legacy")] {
            let t = timed(&g, iters, api);
            push(
                &format!("{label} f16 channels-last fwd {name}"),
                t,
                "TFLOP/s",
                tflops(fl, t.0),
            );
        }
    }
    // conv2d + bias + ReLU on NHWC tensors (the op's own layout: no transposes).
    let (x, w) = ([64usize, 56, 56, 64], [64usize, 3, 3, 64]);
    let mut g = Graph::new();
    let xi = g.add_input("x", tt(f16, &x)).expect("x");
    let wi = g.add_input("w", tt(f16, &w)).expect("w");
    let bi = g.add_input("b", tt(f16, &[64])).expect("b");
    let conv = Op::Conv {
        geom: ConvGeom::new(vec![1; 2], vec![1; 2], vec![1; 2])
            .with_layout(rustytorch::ops::Layout::ChannelsLast),
        groups: 1,
        bias: true,
        act: rustytorch_ops::Activation::Relu,
    };
    let y = g.add(conv, &[xi, wi, bi]).expect("conv");
    g.add_output("y", y).expect("y");
    let fl = 2.0 * (64 * 56 * 56) as f64 * (64 * 64 * 9) as f64;
    for (api, name) in [(true, "graph API"), (false, "legacy")] {
        let t = timed(&g, 10, api);
        push(
            &format!("conv2d+bias+relu 3x3 64c 56x56 b64 f16 channels-last fwd {name}"),
            t,
            "TFLOP/s",
            tflops(fl, t.0),
        );
    }
}

/// SpGEMM through cuSPARSE on device CSR matrices (f32, i32 indices, random square matrices; the
/// wall time of `DeviceCsr::matmul`, which waits for the result: its size is data-dependent), and
/// SpMM in a graph (a constant pattern, values and x as inputs). The same shapes as
/// `benches/gpu_sparse_peer.py` measures with torch.sparse.
fn sparse_rows(push: &mut dyn FnMut(&str, (f64, usize), &str, f64)) {
    use rustytorch::runtime::cuda::DeviceCsr;
    use rustytorch::sparse::random_csr;
    for (n, density) in [(16384usize, 1e-3), (65536, 1e-4), (8192, 1e-2)] {
        let a = random_csr(n, n, density, DType::F32, DType::I32, 1).expect("a");
        let b = random_csr(n, n, density, DType::F32, DType::I32, 2).expect("b");
        let (da, db) = (
            DeviceCsr::upload(0, &a).expect("upload"),
            DeviceCsr::upload(0, &b).expect("upload"),
        );
        let mut nnz = 0;
        let mut times = vec![];
        for _ in 0..7 {
            let t0 = std::time::Instant::now();
            let c = da.matmul(&db).expect("spgemm");
            times.push(t0.elapsed().as_secs_f64() * 1e3);
            nnz = c.nnz();
        }
        times.sort_by(f64::total_cmp);
        push(
            &format!("spgemm f32 n {n} density {density:e}"),
            (times[times.len() / 2], 0),
            "M nnz(C)",
            nnz as f64 / 1e6,
        );
    }
    let (n, density, cols) = (16384usize, 1e-3, 256usize);
    let a = random_csr(n, n, density, DType::F32, DType::I32, 3).expect("a");
    let g = GraphBuilder::new();
    let pattern = rustytorch::compiler::CsrPattern::constant(&g, &a);
    let v = p(&g, "v", DType::F32, &[a.nnz()]);
    let x = p(&g, "x", DType::F32, &[n, cols]);
    let y = pattern.matmul(&v, &x);
    let t = time(&g, &[&y], 20, true);
    // Bytes: A once (values and column indices), x gathered once per entry row-wise, y written.
    let gb = ((a.nnz() * 8 + (n + 1) * 4) + 2 * n * cols * 4) as f64;
    push(
        &format!("spmm f32 n {n} density {density:e} x {cols} cols"),
        t,
        "GB/s (A + x + y)",
        gb / (t.0 * 1e-3) / 1e9,
    );
}

/// A tiny MLP at batch 1 (4 × (linear 64→64 + bias + GELU), softmax): launch-bound. Its run time
/// with and without CUDA graph replay, and the sum of its kernels' own times (CUDA events around
/// each step of an eager run: the floor that replay approaches).
/// Attention forward on the shapes PyTorch's SDPA is compared on (bf16; TFLOP/s counted as
/// 4·B·H·Sq·Sk·D, halved for causal; the decoding row also in TB/s of K and V read).
fn attention_rows(push: &mut dyn FnMut(&str, (f64, usize), &str, f64), backward: bool) {
    // These rows are the flash kernel's (the cuDNN and auto rows follow in
    // `attention_cudnn_rows`), unless the variable already picks an implementation.
    let pinned = std::env::var_os("RUSTYTORCH_ATTENTION").is_none();
    if pinned {
        std::env::set_var("RUSTYTORCH_ATTENTION", "flash");
    }
    attention_flash_rows(push, backward);
    if pinned {
        std::env::remove_var("RUSTYTORCH_ATTENTION");
    }
}

/// The forward, and the forward with the three gradients, of the attention shapes through
/// cuDNN's fused attention forced (`RUSTYTORCH_ATTENTION=cudnn`) and in the default mode, which
/// times cuDNN against the flash kernels once per shape and keeps the faster; both layouts.
/// `forced` false measures the default mode only.
fn attention_cudnn_rows(push: &mut dyn FnMut(&str, (f64, usize), &str, f64), forced: bool) {
    use rustytorch::ops::{AttnLayout, AttnMask, Causal, F64Bits};
    let bf = DType::BF16;
    let before = std::env::var_os("RUSTYTORCH_ATTENTION");
    let modes: &[(&str, Option<&str>)] = if forced {
        &[("cudnn", Some("cudnn")), ("auto", None)]
    } else {
        &[("auto", None)]
    };
    for &(mode, env) in modes {
        match env {
            Some(v) => std::env::set_var("RUSTYTORCH_ATTENTION", v),
            None => std::env::remove_var("RUSTYTORCH_ATTENTION"),
        }
        for (b, h, sq, sk, d, causal) in ATTN_SHAPES {
            for layout in [AttnLayout::Bhsd, AttnLayout::Bshd] {
                let dims = |s: usize| layout.from_bhsd([b, h, s, d]);
                let mut graph = Graph::new();
                let q = graph.add_input("q", tt(bf, &dims(sq))).expect("q");
                let k = graph.add_input("k", tt(bf, &dims(sk))).expect("k");
                let v = graph.add_input("v", tt(bf, &dims(sk))).expect("v");
                let op = Op::Attention {
                    causal: if causal {
                        Causal::TopLeft
                    } else {
                        Causal::None
                    },
                    mask: AttnMask::None,
                    scale: F64Bits::new(1.0 / (d as f64).sqrt()),
                    layout,
                };
                let y = graph.add(op, &[q, k, v]).expect("attention");
                graph.add_output("y", y).expect("y");
                let t = time_graph(&graph, 10, true);
                let flops = 4.0 * (b * h * sq * sk * d) as f64 * if causal { 0.5 } else { 1.0 };
                let name = format!(
                    "{mode} attention bf16 {layout:?} B{b} H{h} Sq{sq} Sk{sk} D{d} {}",
                    if causal { "causal" } else { "full" }
                );
                push(&name, t, "TFLOP/s", flops / (t.0 * 1e-3) / 1e12);
                if sq == 1 {
                    continue;
                }
                let dy = tt(bf, &dims(sq));
                fwd_bwd_row(&mut graph, [q, k, v, y], dy, &name, flops, push);
            }
        }
    }
    match before {
        Some(v) => std::env::set_var("RUSTYTORCH_ATTENTION", v),
        None => std::env::remove_var("RUSTYTORCH_ATTENTION"),
    }
}

/// The attention shapes of the bench rows: (B, H, Sq, Sk, D, causal), as in the SDPA table.
const ATTN_SHAPES: [(usize, usize, usize, usize, usize, bool); 8] = [
    (4, 32, 4096, 4096, 128, false),
    (4, 32, 4096, 4096, 128, true),
    (16, 16, 1024, 1024, 64, false),
    (16, 16, 1024, 1024, 64, true),
    (4, 32, 4096, 4096, 64, true),
    (2, 16, 8192, 8192, 128, true),
    (8, 32, 512, 8192, 128, false),
    (8, 32, 1, 8192, 128, false),
];

/// Adds to `graph`'s attention `y` over `q, k, v` an input `dy` of type `dy_ty` and the three
/// gradients as outputs (one sibling group), times forward and backward together and pushes the
/// row `{name} fwd+bwd` (the backward counted as 2.5× the forward's `flops`, as for SDPA).
fn fwd_bwd_row(
    graph: &mut Graph,
    [q, k, v, y]: [rustytorch::compiler::NodeId; 4],
    dy_ty: TensorType,
    name: &str,
    flops: f64,
    push: &mut dyn FnMut(&str, (f64, usize), &str, f64),
) {
    let attention = graph.node(y).expect("y").op.clone();
    let dy = graph.add_input("dy", dy_ty).expect("dy");
    for wrt in 0..3u8 {
        let op = attention
            .attention_grad(wrt)
            .unwrap_or_else(|| panic!("{name}: not an attention node"));
        let dx = graph.add(op, &[q, k, v, dy]).expect("grad");
        graph.add_output(&format!("d{wrt}"), dx).expect("d");
    }
    let t = time_graph(graph, 5, true);
    push(
        &format!("{name} fwd+bwd"),
        t,
        "TFLOP/s",
        3.5 * flops / (t.0 * 1e-3) / 1e12,
    );
}

/// The flash kernel's rows of [`attention_rows`].
fn attention_flash_rows(push: &mut dyn FnMut(&str, (f64, usize), &str, f64), backward: bool) {
    use rustytorch::ops::{AttnMask, Causal, F64Bits};
    let bf = DType::BF16;
    // `bench-gpu attention-decode`: the one-query-row shapes only.
    let decode_only = std::env::args().any(|a| a == "attention-decode");
    // `RUSTYTORCH_BENCH_ROWS=TEXT|TEXT…` keeps the shapes whose row name contains one TEXT (for
    // measurements of one shape under a profiler or a knob).
    let rows = std::env::var("RUSTYTORCH_BENCH_ROWS").ok();
    for (b, h, sq, sk, d, causal) in ATTN_SHAPES {
        if decode_only && sq != 1 {
            continue;
        }
        let mut graph = Graph::new();
        let q = graph.add_input("q", tt(bf, &[b, h, sq, d])).expect("q");
        let k = graph.add_input("k", tt(bf, &[b, h, sk, d])).expect("k");
        let v = graph.add_input("v", tt(bf, &[b, h, sk, d])).expect("v");
        let op = Op::Attention {
            causal: if causal {
                Causal::TopLeft
            } else {
                Causal::None
            },
            mask: AttnMask::None,
            scale: F64Bits::new(1.0 / (d as f64).sqrt()),
            layout: rustytorch::ops::AttnLayout::Bhsd,
        };
        let name = format!(
            "flash attention bf16 B{b} H{h} Sq{sq} Sk{sk} D{d} {}",
            if causal { "causal" } else { "full" }
        );
        if rows
            .as_ref()
            .is_some_and(|r| !r.split('|').any(|t| name.contains(t)))
        {
            continue;
        }
        let y = graph.add(op, &[q, k, v]).expect("attention");
        graph.add_output("y", y).expect("y");
        let t = time_graph(&graph, 10, true);
        let flops = 4.0 * (b * h * sq * sk * d) as f64 * if causal { 0.5 } else { 1.0 };
        push(&name, t, "TFLOP/s", flops / (t.0 * 1e-3) / 1e12);
        if sq == 1 {
            let kv = (2 * b * h * sk * d * 2) as f64;
            push(
                &format!("{name} K+V read"),
                t,
                "TB/s",
                kv / (t.0 * 1e-3) / 1e12,
            );
            continue;
        }
        if !backward {
            continue;
        }
        fwd_bwd_row(
            &mut graph,
            [q, k, v, y],
            tt(bf, &[b, h, sq, d]),
            &name,
            flops,
            push,
        );
    }
}

/// GPT-2 small (12 layers, d 768, 12 heads, batch 8 × 1024): under bf16 autocast (f32
/// parameters, matmuls and attention in bf16) the forward and a training step (forward,
/// backward of the mean square of the hidden states, SGD update); and the forward of the same
/// model with bf16 parameters and activations (as PyTorch's `model.to(torch.bfloat16)`).
fn gpt2_rows(push: &mut dyn FnMut(&str, (f64, usize), &str, f64)) {
    let cfg = rustytorch::models::Gpt2Config::small();
    // Attention reads its heads in place (the CUDA target's default) or, off, the heads are
    // transposed around it as written, for comparison; the last field is the bias gradients'
    // mode (see `with_bgrad`).
    let rows: [(&str, bool, bool, bool, Option<&str>); 6] = [
        ("forward autocast bf16", false, false, true, None),
        ("forward bf16 weights", false, true, true, None),
        (
            "forward bf16 weights, heads transposed",
            false,
            true,
            false,
            None,
        ),
        ("training step autocast bf16", true, false, true, None),
        ("training step bf16 weights", true, true, true, None),
        (
            "training step bf16 weights, bias grads timed against epilogues",
            true,
            true,
            true,
            Some("auto"),
        ),
    ];
    for (label, train, typed, in_place, bgrad) in rows {
        let g = GraphBuilder::new();
        let dt = if typed { DType::BF16 } else { DType::F32 };
        let (_, hid) = rustytorch::models::gpt2_typed(&g, &cfg, dt);
        let loss = hid.mul(&hid).mean_all();
        if train {
            g.train_step(&loss, Sgd::new(1e-4), &StepOptions::default())
                .expect("train step");
        }
        let mut graph = g.graph().expect("graph");
        let out = if train { &loss } else { &hid };
        graph
            .add_output("out", out.node().expect("node"))
            .expect("output");
        let opts = passes::Options {
            autocast: (!typed).then_some(DType::BF16),
            attention_layout: in_place,
            ..cuda_opts()
        };
        let compiled = passes::run(&graph, &opts).expect("compile");
        let arena = compiled.report.memory.as_ref().expect("plan").arena_bytes;
        println!(
            "gpt2-small {label}: activations arena {:.1} MiB",
            arena as f64 / (1 << 20) as f64
        );
        with_bgrad(bgrad, || {
            let (t, mem) = time_graph_peak(&graph, 10, true, opts);
            push(&format!("gpt2-small {label} b8 s1024"), t, "ms", t.0);
            let mib = |b: u64| b as f64 / (1 << 20) as f64;
            println!(
                "gpt2-small {label}: device pool peak {:.1} MiB allocated, {:.1} MiB reserved",
                mib(mem.allocated_bytes.peak),
                mib(mem.reserved_bytes.peak)
            );
        });
        if train && typed && bgrad.is_none() {
            for line in rustytorch::runtime::cuda::attention_choices() {
                println!("  cuDNN attention: {line}");
            }
            for line in rustytorch::runtime::cuda::matmul_choices() {
                println!("  cuBLASLt: {line}");
            }
        }
        if train && typed && bgrad.is_none() && std::env::var_os("GPT2_PROFILE").is_some() {
            gpt2_train_profile(&graph);
        }
    }
}

/// Where the GPT-2 training step's time goes, per op (`GPT2_PROFILE=1 bench-gpu gpt2`): the
/// same graph through `Executable` with an event around every step of eager runs.
fn gpt2_train_profile(graph: &Graph) {
    let opts = CompileOptions {
        graph_replay: false,
        ..CompileOptions::default()
    };
    let mut exe = rustytorch::compile_graph(graph, Device::Cuda(0), &opts).expect("compile");
    let inputs: Vec<(String, HostTensor)> = exe
        .input_types()
        .into_iter()
        .map(|(name, ty)| {
            let t = rustytorch::ops::testing::rand_tensor(ty, 1, -1.0, 1.0);
            (name.to_string(), t)
        })
        .collect();
    let ins: Vec<(&str, HostTensor)> = inputs
        .iter()
        .map(|(n, t)| (n.as_str(), t.clone()))
        .collect();
    let popts = rustytorch::profile::ProfileOptions {
        runs: 5,
        warmup: 2,
        group_by: rustytorch::profile::GroupBy::Op,
        limits: None,
    };
    println!(
        "{}",
        rustytorch::profile::profile(&mut exe, &ins, &popts).expect("profile")
    );
}

/// One eager run of GPT-2 small's bf16 training step between `cuProfilerStart` and
/// `cuProfilerStop`, for a kernel profiler started with collection off (`ncu
/// --profile-from-start off`), after warm-up runs; first it lists the plan's steps with what each
/// runs on CUDA, so the profiler's kernels can be matched to ops in launch order.
fn gpt2_ncu() {
    let (graph, plan) = gpt2_step_plan(false);
    let (mut s, inputs) = session(&graph, &plan);
    s.set_graph_replay(false);
    for _ in 0..3 {
        s.run(&inputs).expect("run");
    }
    rustytorch::runtime::cuda_profiler(true).expect("profiler start");
    s.run(&inputs).expect("run");
    rustytorch::runtime::cuda_profiler(false).expect("profiler stop");
    println!("gpt2-ncu: one profiled run done");
}

/// GPT-2 small's bf16 training-step graph and its plan; with `list`, prints each plan step's op,
/// result type and what it runs on CUDA.
fn gpt2_step_plan(list: bool) -> (Graph, Arc<rustytorch::codegen::Plan>) {
    use rustytorch::codegen::cuda::{lower_plan, CudaStep};
    let cfg = rustytorch::models::Gpt2Config::small();
    let g = GraphBuilder::new();
    let (_, hid) = rustytorch::models::gpt2_typed(&g, &cfg, DType::BF16);
    let loss = hid.mul(&hid).mean_all();
    g.train_step(&loss, Sgd::new(1e-4), &StepOptions::default())
        .expect("train step");
    let mut graph = g.graph().expect("graph");
    graph
        .add_output("out", loss.node().expect("node"))
        .expect("output");
    let opts = cuda_opts();
    let compiled = passes::run(&graph, &opts).expect("compile");
    let memory = compiled.report.memory.expect("memory plan");
    let plan = Arc::new(lower(&compiled.graph, &memory).expect("lower"));
    let cuda = lower_plan(&plan).expect("cuda lowering");
    for (i, (st, cs)) in plan.steps.iter().zip(&cuda).enumerate().filter(|_| list) {
        let what = match cs {
            CudaStep::Kernels(k) => k
                .launches
                .iter()
                .map(|l| format!("{}[{}]", l.kernel.name, l.grid))
                .collect::<Vec<_>>()
                .join(" "),
            CudaStep::Matmul { desc, after, .. } => format!(
                "gemm m{} n{} k{} b{} ta{} tb{}{} +{}",
                desc.m,
                desc.n,
                desc.k,
                desc.batch,
                desc.trans_a as u8,
                desc.trans_b as u8,
                if desc.accumulate.is_some() {
                    " acc"
                } else {
                    ""
                },
                after.launches.len()
            ),
            CudaStep::Merged(first) => format!("merged into {first}"),
            CudaStep::Alias => "alias".into(),
            CudaStep::Sibling => "sibling".into(),
            other => format!("{other:?}").chars().take(40).collect(),
        };
        println!(
            "step {i} {} {} :: {what}",
            st.op.name(),
            plan.types[st.output]
        );
        // `GPT2_SRC=NAME` prints the CUDA C of the generated kernel NAME too.
        if let (CudaStep::Kernels(k), Ok(want)) = (cs, std::env::var("GPT2_SRC")) {
            for l in k.launches.iter().filter(|l| l.kernel.name == want) {
                println!(
                    "{}",
                    rustytorch::codegen::cuda::emit::emit(&l.kernel).expect("emit")
                );
            }
        }
    }
    (graph, plan)
}

/// Runs `body` with `RUSTYTORCH_LT_BGRAD` set to `mode` (read when a graph is compiled): `None`
/// the default (each bias gradient's sum as its own kernel), `Some("auto")` the runtime's timed
/// choice, `Some("1")` always cuBLASLt's epilogue.
fn with_bgrad(mode: Option<&str>, body: impl FnOnce()) {
    match mode {
        Some(v) => std::env::set_var("RUSTYTORCH_LT_BGRAD", v),
        None => std::env::remove_var("RUSTYTORCH_LT_BGRAD"),
    }
    body();
    std::env::remove_var("RUSTYTORCH_LT_BGRAD");
}

/// One MLP block's forward and backward in bf16 (`x [8192, 768] → linear 3072 → GELU tanh →
/// linear 768`, the loss `Σ out ⊙ dy` so that the backward starts from a given `dy`; gradients of
/// x and of every parameter are outputs): with `(dy·W2ᵀ) ⊙ gelu'(h)` as one cuBLASLt `DGELU` call
/// (`matmul_act_grad`), and with that rule disabled (the GEMM then a fused kernel). `bench-gpu
/// mlp-grad` runs these rows only; `benches/gpu_mlp_grad_peer.py` is PyTorch's side.
fn mlp_grad_rows(push: &mut dyn FnMut(&str, (f64, usize), &str, f64)) {
    let (t, d, h) = (8192usize, 768usize, 3072usize);
    let bf = DType::BF16;
    let g = GraphBuilder::new();
    let x = g.input("x", bf, [t, d]);
    let dy = g.input("dy", bf, [t, d]);
    // Trainable parameters (the bench's `p` makes frozen ones, which have no gradient).
    let p = |name: &str, dims: &[usize]| {
        g.param_typed(
            name,
            tt(bf, dims),
            Init::kaiming_uniform(dims[0], name.len() as u64),
            true,
        )
    };
    let (w1, b1, w2, b2) = (
        p("w1", &[d, h]),
        p("b1", &[h]),
        p("w2", &[h, d]),
        p("b2", &[d]),
    );
    let out = x.matmul(&w1).add(&b1).gelu_tanh().matmul(&w2).add(&b2);
    let loss = out.mul(&dy).sum_all();
    let mut graph = g.graph().expect("graph");
    let wrt: Vec<_> = [&x, &w1, &b1, &w2, &b2]
        .iter()
        .map(|v| v.node().expect("node"))
        .collect();
    let grads = rustytorch::compiler::autodiff::grad(&mut graph, loss.node().expect("node"), &wrt)
        .expect("grad");
    graph
        .add_output("out", out.node().expect("node"))
        .expect("output");
    for (i, gr) in grads.into_iter().enumerate() {
        graph.add_output(&format!("grad{i}"), gr).expect("output");
    }
    // Forward 2 GEMMs, backward 4 (dx, dW1, dh, dW2), each 2·t·d·h FLOPs.
    let flops = 6.0 * 2.0 * (t * d * h) as f64;
    // The last field: bias gradients as the runtime chooses (=auto: from the GEMMs' epilogues,
    // DGELU_BGRAD and BGRADA, where cuBLASLt's are faster), from the epilogues always
    // (RUSTYTORCH_LT_BGRAD=1), or each sum as its own kernel (the default). Twice over, so
    // that no row is measured only while the clocks rise.
    for pass in 1..=2 {
        for (label, disabled, bgrad) in [
            (
                "mlp block fwd+bwd bf16, dgelu in the gemm",
                vec![],
                Some("auto"),
            ),
            (
                "mlp block fwd+bwd bf16, dgelu+bgrad in the gemm",
                vec![],
                Some("1"),
            ),
            (
                "mlp block fwd+bwd bf16, dgelu in the gemm, bias grads as kernels",
                vec![],
                Some("0"),
            ),
            (
                "mlp block fwd+bwd bf16, dgelu as a kernel",
                vec!["matmul-dgelu-tanh".to_string()],
                Some("0"),
            ),
        ] {
            let mut opts = cuda_opts();
            opts.optimize_config.disabled_rules = disabled;
            with_bgrad(bgrad, || {
                let r = time_graph_with(&graph, 20, true, opts);
                push(
                    &format!("{label} (pass {pass})"),
                    r,
                    "TFLOP/s",
                    flops / (r.0 * 1e-3) / 1e12,
                );
            });
        }
    }
}

fn tiny_mlp_rows(push: &mut dyn FnMut(&str, (f64, usize), &str, f64)) {
    let build = || {
        let g = GraphBuilder::new();
        let x = p(&g, "x", DType::F32, &[1, 64]);
        let mut hdn = x;
        for l in 0..4 {
            let w = p(&g, &format!("w{l}"), DType::F32, &[64, 64]);
            let b = p(&g, &format!("b{l}"), DType::F32, &[64]);
            hdn = hdn.matmul(&w).add(&b).gelu();
        }
        let y = hdn.softmax(-1);
        (g, y)
    };
    for replay in [false, true] {
        let (g, y) = build();
        let t = time(&g, &[&y], 200, replay);
        let label = if replay {
            "tiny mlp b1, graph replay"
        } else {
            "tiny mlp b1, launches"
        };
        push(label, t, "us/run", t.0 * 1e3);
    }
    let (g, y) = build();
    let mut exe = compile(&g, &[&y], Device::Cuda(0)).expect("compile");
    exe.set_step_timing(true);
    let mut sums = vec![];
    for _ in 0..50 {
        exe.run(&[]).expect("run");
        let times = exe.step_times().expect("step times");
        sums.push(times.total_us());
    }
    sums.sort_by(f64::total_cmp);
    let kernels = exe.plan().steps.len();
    push(
        "tiny mlp b1, sum of its kernels' times",
        (sums[sums.len() / 2] / 1e3, kernels),
        "us/run",
        sums[sums.len() / 2],
    );
}

/// The all-MiniLM-L6-v2-shaped BERT encoder (6 layers, width 384, 12 heads, MLP 1536; random
/// weights; mean pooling and L2 normalization) through `Executable`: throughput at 256 sentences
/// of 128 tokens and latency at 8 × 32, in bf16 and f16, each against `benches/gpu_bert_peer.py`
/// (transformers' BertModel of the same shape) in the same run. The time is the plan's steps
/// replayed back to back (`time_steps`, no host copies), and for latency also a whole `run`
/// (inputs in, embeddings out).
fn bert_rows(push: &mut dyn FnMut(&str, (f64, usize), &str, f64)) {
    use rustytorch::models::bert::{bert_encoder, BertConfig};
    let cfg = BertConfig::minilm_l6();
    for dtype in [DType::BF16, DType::F16] {
        for (b, s) in [(256usize, 128usize), (8, 32)] {
            let g = GraphBuilder::new();
            let m = bert_encoder(&g, &cfg, dtype, b, s);
            let mut exe = compile_with(
                &g,
                &[&m.embeddings],
                Device::Cuda(0),
                &CompileOptions::inference(),
            )
            .expect("compile");
            let ids: Vec<i64> = (0..(b * s) as i64).map(|i| 1 + i * 7919 % 30000).collect();
            let ids = HostTensor::from_vec(ids, [b, s]).expect("ids");
            let mask = HostTensor::from_vec(vec![1f32; b * s], [b, s]).expect("mask");
            let args = [("input_ids", ids), ("attention_mask", mask)];
            for _ in 0..3 {
                exe.run(&args).expect("run");
            }
            let ms = exe.time_steps(20).expect("timing");
            let kernels = exe.plan().steps.len();
            let name = format!("minilm encoder {dtype} {b}x{s}");
            push(&name, (ms, kernels), "sentences/s", b as f64 / (ms * 1e-3));
            if b == 8 {
                let mut runs = vec![];
                for _ in 0..20 {
                    let t0 = std::time::Instant::now();
                    exe.run(&args).expect("run");
                    runs.push(t0.elapsed().as_secs_f64() * 1e3);
                }
                runs.sort_by(f64::total_cmp);
                let med = runs[runs.len() / 2];
                push(
                    &format!("{name}, whole run()"),
                    (med, kernels),
                    "sentences/s",
                    b as f64 / (med * 1e-3),
                );
            }
        }
    }
}

/// NCCL all-reduce and broadcast of f32 buffers of 1 MiB to 1 GiB over every GPU, timed as
/// `../shared/peers/torch_peers2.py nccl` times torch.distributed (20 calls after 5, wall clock
/// to the streams' end; bus bandwidth = bytes / time × 2(n−1)/n for all-reduce, × 1 for
/// broadcast).
fn nccl_rows(push: &mut dyn FnMut(&str, (f64, usize), &str, f64)) {
    use rustytorch::runtime::cuda::{Collective, DeviceTensor, ReduceOp};
    let n = rustytorch::runtime::cuda_device_count().expect("devices");
    if n < 2 {
        println!("nccl: {n} GPU(s); the collectives need two");
        return;
    }
    let devs: Vec<usize> = (0..n).collect();
    let coll = Collective::new(&devs).expect("communicator");
    for mib in [1usize, 16, 256, 1024] {
        let len = mib * (1 << 20) / 4;
        let host = HostTensor::from_vec(vec![1f32; len], [len]).expect("host");
        let mut bufs: Vec<DeviceTensor> = devs
            .iter()
            .map(|&d| DeviceTensor::upload(d, &host).expect("upload"))
            .collect();
        for op in ["all_reduce", "broadcast"] {
            let run = |bufs: &mut [DeviceTensor]| match op {
                "all_reduce" => coll.all_reduce(bufs, ReduceOp::Sum).expect("all_reduce"),
                _ => coll.broadcast(bufs, 0).expect("broadcast"),
            };
            for _ in 0..5 {
                run(&mut bufs);
            }
            coll.synchronize().expect("sync");
            let iters = 20;
            let t0 = std::time::Instant::now();
            for _ in 0..iters {
                run(&mut bufs);
            }
            coll.synchronize().expect("sync");
            let s = t0.elapsed().as_secs_f64() / iters as f64;
            let algbw = (mib << 20) as f64 / s / 1e9;
            let factor = if op == "all_reduce" {
                2.0 * (n - 1) as f64 / n as f64
            } else {
                1.0
            };
            push(
                &format!("nccl {op} f32 {mib} MiB on {n} GPUs"),
                (s * 1e3, 0),
                "GB/s bus",
                algbw * factor,
            );
        }
    }
}

/// Norms, softmax and reductions with elementwise producers and consumers fused in (one kernel
/// each), bf16 32768x4096; bandwidth counts the bytes of the inputs the kernel reads and of its
/// output (weights, biases and masks of one row are negligible). `benches/gpu_fused_peer.py`
/// measures torch.compile on the same workloads.
fn fused_row_rows(push: &mut dyn FnMut(&str, (f64, usize), &str, f64)) {
    let (r, c) = (32768usize, 4096usize);
    let bf = DType::BF16;
    let tb = |bytes: usize, ms: f64| bytes as f64 / (ms * 1e-3) / 1e12;
    let plane = r * c * 2;
    let cases: [(&str, usize); 7] = [
        ("fused layer_norm(x + y) bf16 32768x4096", 3 * plane),
        ("fused rms_norm(x + bias) bf16 32768x4096", 2 * plane),
        ("fused softmax(x * 0.125 + mask) bf16 32768x4096", 2 * plane),
        ("fused layer_norm(x) * 0.5 + z bf16 32768x4096", 3 * plane),
        ("fused f32(softmax(x)) bf16 32768x4096", plane + 2 * plane),
        ("fused sum(x * y, -1) bf16 32768x4096", 2 * plane),
        ("fused sqrt(mean(x * x, -1)) bf16 32768x4096", plane),
    ];
    for (i, (name, bytes)) in cases.into_iter().enumerate() {
        let g = GraphBuilder::new();
        let x = p(&g, "x", bf, &[r, c]);
        let y = match i {
            0 => {
                let (y, w, b) = (
                    p(&g, "y", bf, &[r, c]),
                    p(&g, "w", bf, &[c]),
                    p(&g, "b", bf, &[c]),
                );
                x.add(&y).layer_norm(Some(&w), Some(&b), 1e-5)
            }
            1 => {
                let (bias, w) = (p(&g, "bias", bf, &[c]), p(&g, "w", bf, &[c]));
                x.add(&bias).rms_norm(Some(&w), 1e-6)
            }
            2 => {
                // Scores [8, 16, 256, 4096] and a per-batch mask [8, 1, 1, 4096].
                let s = x.reshape([8usize, 16, 256, 4096]);
                let mask = p(&g, "mask", bf, &[8, 1, 1, c]);
                s.mul_scalar(0.125).add(&mask).softmax(-1)
            }
            3 => {
                let z = p(&g, "z", bf, &[r, c]);
                x.layer_norm(None, None, 1e-5).mul_scalar(0.5).add(&z)
            }
            4 => x.softmax(-1).cast(DType::F32),
            5 => {
                let y = p(&g, "y", bf, &[r, c]);
                x.mul(&y).sum(&[-1], false)
            }
            _ => x.mul(&x).mean(&[-1], true).sqrt(),
        };
        let t = time(&g, &[&y], 20, true);
        push(name, t, "TB/s", tb(bytes, t.0));
    }
}

/// Column reductions (the kept dim unit-stride), bytes read over time: GPT-2's bias gradients
/// `sum(dY, 0)` to f32 from bf16 [8192, 768] and [8192, 3072], an f32 one, and
/// LayerNorm-backward's `sum(dY * x, 0)` in bf16; and one of 96 MiB, which the L2 cache cannot
/// hold between back-to-back runs (the GPT-2 sizes, 12 to 48 MiB, may stay there).
fn col_reduce_rows(push: &mut dyn FnMut(&str, (f64, usize), &str, f64)) {
    let bf = DType::BF16;
    let tb = |bytes: usize, ms: f64| bytes as f64 / (ms * 1e-3) / 1e12;
    let cases: [(&str, DType, usize, usize, usize); 5] = [
        ("sum(f32(x), 0) bf16 8192x768", bf, 8192, 768, 0),
        ("sum(f32(x), 0) bf16 8192x3072", bf, 8192, 3072, 0),
        ("sum(x, 0) f32 8192x768", DType::F32, 8192, 768, 1),
        ("fused sum(dY * x, 0) bf16 8192x768", bf, 8192, 768, 2),
        ("sum(f32(x), 0) bf16 65536x768", bf, 65536, 768, 0),
    ];
    for (name, d, r, c, which) in cases {
        let g = GraphBuilder::new();
        let x = p(&g, "x", d, &[r, c]);
        let (y, bytes) = match which {
            0 => (x.cast(DType::F32).sum(&[0], false), r * c * 2),
            1 => (x.sum(&[0], false), r * c * 4),
            _ => {
                let dy = p(&g, "dy", d, &[r, c]);
                (dy.mul(&x).sum(&[0], false), 2 * r * c * 2)
            }
        };
        let t = time(&g, &[&y], 50, true);
        push(name, t, "TB/s", tb(bytes, t.0));
    }
}

fn main() {
    // `bench-gpu gpt2-steps`: the step listing of `gpt2-ncu` only (no device needed).
    if std::env::args().skip(1).any(|a| a == "gpt2-steps") {
        gpt2_step_plan(true);
        return;
    }
    if let Err(e) = rustytorch::runtime::cuda_device_count() {
        println!("gpu bench: no CUDA device here ({e}); run it on the GPU machine");
        return;
    }
    let bf = DType::BF16;
    let mut rows: Vec<Row> = vec![];
    let mut push = |name: &str, (ms, kernels): (f64, usize), metric: &str, value: f64| {
        println!("{name:<44} {ms:>9.4} ms  {kernels:>3} kernels  {value:>8.2} {metric}");
        rows.push(Row {
            name: name.into(),
            ms,
            kernels,
            metric: metric.into(),
            value,
        });
    };
    // `bench-gpu conv` measures the convolution rows only, `bench-gpu sparse` the sparse ones.
    let only = |w: &str| std::env::args().skip(1).any(|a| a == w);
    // `bench-gpu tiny` the launch-bound tiny MLP only, `bench-gpu bert` the MiniLM encoder only,
    // `bench-gpu nccl` the collectives only (two or more GPUs), `bench-gpu attention` the
    // attention shapes compared with PyTorch's SDPA, `bench-gpu gpt2` GPT-2 small under bf16
    // autocast.
    if only("nccl") {
        nccl_rows(&mut push);
        return;
    }
    if only("attention") {
        attention_rows(&mut push, true);
        attention_cudnn_rows(&mut push, true);
        return;
    }
    // `bench-gpu attention-flash`: the flash kernel's forward rows only (on Hopper its
    // warpgroup-MMA kernel; `RUSTYTORCH_FLASH=portable` measures the portable one).
    if only("attention-flash") || only("attention-decode") {
        attention_rows(&mut push, false);
        return;
    }
    // `bench-gpu attention-flash-bwd`: the flash kernels' forward and forward+backward rows.
    if only("attention-flash-bwd") {
        attention_rows(&mut push, true);
        return;
    }
    // `bench-gpu attention-auto`: the default mode's rows only.
    if only("attention-auto") {
        attention_cudnn_rows(&mut push, false);
        return;
    }
    if only("gpt2") {
        gpt2_rows(&mut push);
        return;
    }
    if only("gpt2-ncu") {
        gpt2_ncu();
        return;
    }
    if only("mlp-grad") {
        mlp_grad_rows(&mut push);
        return;
    }
    // `bench-gpu fused` the fused norm, softmax and reduction rows only.
    if only("fused") {
        fused_row_rows(&mut push);
        col_reduce_rows(&mut push);
        return;
    }
    let (only_conv, only_sparse, only_tiny, only_bert) =
        (only("conv"), only("sparse"), only("tiny"), only("bert"));
    if only_tiny {
        tiny_mlp_rows(&mut push);
    }
    if only_bert {
        bert_rows(&mut push);
    }
    let lone = only_tiny || only_bert;
    let (only_conv, only_sparse) = (only_conv || lone, only_sparse || lone);
    if !only_sparse {
        conv_rows(&mut push);
        conv_graph_api_rows(&mut push);
    }
    if !only_conv {
        sparse_rows(&mut push);
    }
    if !only_conv && !only_sparse {
        let (r, c) = (32768usize, 4096usize);
        let tb = |bytes: f64, ms: f64| bytes / (ms * 1e-3) / 1e12;

        // Copy-equivalent: one read and one write of 256 MiB.
        let g = GraphBuilder::new();
        let x = p(&g, "x", bf, &[r, c]);
        let y = x.neg();
        let t = time(&g, &[&y], 20, true);
        push(
            "copy-like neg bf16 32768x4096",
            t,
            "TB/s",
            tb((2 * r * c * 2) as f64, t.0),
        );

        // GEMMs: plain, +bias+GELU(tanh), +bias+GELU(erf).
        let (m, k, n) = (8192usize, 4096usize, 16384usize);
        let flops = 2.0 * (m * k * n) as f64;
        for (label, which) in [
            ("gemm", 0),
            ("linear+bias+gelu_tanh", 1),
            ("linear+bias+gelu_erf", 2),
        ] {
            let g = GraphBuilder::new();
            let x = p(&g, "x", bf, &[m, k]);
            let w = p(&g, "w", bf, &[k, n]);
            let b = p(&g, "b", bf, &[n]);
            let y = match which {
                0 => x.matmul(&w),
                1 => x.matmul(&w).add(&b).gelu_tanh(),
                _ => x.matmul(&w).add(&b).gelu(),
            };
            let t = time(&g, &[&y], 10, true);
            push(
                &format!("{label} bf16 8192x4096->16384"),
                t,
                "TFLOP/s",
                flops / (t.0 * 1e-3) / 1e12,
            );
        }

        // Norms and softmax, bf16 32768x4096: bytes of input + output.
        let nb = (2 * r * c * 2) as f64;
        for which in ["rms_norm", "layer_norm", "softmax"] {
            let g = GraphBuilder::new();
            let x = p(&g, "x", bf, &[r, c]);
            let w = p(&g, "w", bf, &[c]);
            let b = p(&g, "b", bf, &[c]);
            let y = match which {
                "rms_norm" => x.rms_norm(Some(&w), 1e-6),
                "layer_norm" => x.layer_norm(Some(&w), Some(&b), 1e-5),
                _ => x.softmax(-1),
            };
            let t = time(&g, &[&y], 20, true);
            push(&format!("{which} bf16 32768x4096"), t, "TB/s", tb(nb, t.0));
        }
        fused_row_rows(&mut push);

        // The elementwise chain tanh(silu(a)·b + 0.5·a)·2: inputs a, b and the output.
        let g = GraphBuilder::new();
        let a = p(&g, "a", bf, &[r, c]);
        let b = p(&g, "b", bf, &[r, c]);
        let y = a
            .silu()
            .mul(&b)
            .add(&a.mul_scalar(0.5))
            .tanh()
            .mul_scalar(2.0);
        let t = time(&g, &[&y], 20, true);
        push(
            "elementwise chain bf16 32768x4096",
            t,
            "TB/s",
            tb((3 * r * c * 2) as f64, t.0),
        );

        // GPT-2-small LayerNorm + MLP stack, 12 layers, 8x1024 tokens.
        let (tokens, d, h) = (8 * 1024, 768, 3072);
        let g = GraphBuilder::new();
        let mut x = p(&g, "x", bf, &[tokens, d]);
        for l in 0..12 {
            let lw = p(&g, &format!("h{l}.ln.w"), bf, &[d]);
            let lb = p(&g, &format!("h{l}.ln.b"), bf, &[d]);
            let w1 = p(&g, &format!("h{l}.fc.w"), bf, &[d, h]);
            let b1 = p(&g, &format!("h{l}.fc.b"), bf, &[h]);
            let w2 = p(&g, &format!("h{l}.proj.w"), bf, &[h, d]);
            let b2 = p(&g, &format!("h{l}.proj.b"), bf, &[d]);
            let y = x.layer_norm(Some(&lw), Some(&lb), 1e-5);
            x = x.add(&y.matmul(&w1).add(&b1).gelu_tanh().matmul(&w2).add(&b2));
        }
        let t = time(&g, &[&x], 10, true);
        let mlp_flops = 4.0 * (tokens * d * h) as f64 * 12.0;
        push(
            "mlp stack 12x (ln, fc+gelu, proj, residual)",
            t,
            "TFLOP/s",
            mlp_flops / (t.0 * 1e-3) / 1e12,
        );

        // Causal attention, GPT-2-small heads (batch 8, 12 heads, 1024 tokens, head size 64).
        let (bsz, heads, seq, hd) = (8usize, 12usize, 1024usize, 64usize);
        let g = GraphBuilder::new();
        let q = p(&g, "q", bf, &[bsz, heads, seq, hd]);
        let k = p(&g, "k", bf, &[bsz, heads, seq, hd]);
        let v = p(&g, "v", bf, &[bsz, heads, seq, hd]);
        let y = rustytorch::models::causal_attention_primitives(&q, &k, &v);
        let t = time(&g, &[&y], 5, true);
        // Causal: half of the 4·B·H·S²·D multiply-adds of full attention.
        let att_flops = 2.0 * (bsz * heads * seq * seq * hd) as f64;
        push(
            "attention causal bf16 b8 h12 s1024 d64",
            t,
            "TFLOP/s",
            att_flops / (t.0 * 1e-3) / 1e12,
        );
        // Forward and the three gradients (the backward counted as 2.5× the forward, as
        // PyTorch's SDPA figures are).
        let mut graph = Graph::new();
        let ty = tt(bf, &[bsz, heads, seq, hd]);
        let ids: Vec<_> = ["q", "k", "v", "dy"]
            .iter()
            .map(|n| graph.add_input(n, ty.clone()).expect("input"))
            .collect();
        let attn = |wrt: Option<u8>| match wrt {
            None => Op::Attention {
                causal: rustytorch::ops::Causal::TopLeft,
                mask: rustytorch::ops::AttnMask::None,
                scale: rustytorch::ops::F64Bits::new(0.125),
                layout: rustytorch::ops::AttnLayout::Bhsd,
            },
            Some(wrt) => Op::AttentionGrad {
                causal: rustytorch::ops::Causal::TopLeft,
                mask: rustytorch::ops::AttnMask::None,
                scale: rustytorch::ops::F64Bits::new(0.125),
                wrt,
                layout: rustytorch::ops::AttnLayout::Bhsd,
            },
        };
        let y = graph.add(attn(None), &ids[..3]).expect("attention");
        graph.add_output("y", y).expect("y");
        for wrt in 0..3u8 {
            let d = graph.add(attn(Some(wrt)), &ids).expect("grad");
            graph.add_output(&format!("d{wrt}"), d).expect("d");
        }
        let t = time_graph(&graph, 5, true);
        push(
            "attention causal bf16 b8 h12 s1024 d64 fwd+bwd",
            t,
            "TFLOP/s",
            3.5 * att_flops / (t.0 * 1e-3) / 1e12,
        );

        // GPT-2 small forward (f32, batch 8 x 1024): the CPU-side compile, then lowering and
        // preparing for CUDA (kernels from NVRTC or the kernel caches), twice in this process.
        let cfg = rustytorch::models::Gpt2Config::small();
        let g = GraphBuilder::new();
        let (_, hid) = rustytorch::models::gpt2(&g, &cfg);
        let mut graph = g.graph().expect("graph");
        graph
            .add_output("h", hid.node().expect("node"))
            .expect("output");
        let t0 = std::time::Instant::now();
        let compiled = passes::run(&graph, &cuda_opts()).expect("compile");
        let compile_s = t0.elapsed().as_secs_f64();
        println!("gpt2-small forward: CPU-side compile {compile_s:.3} s");
        let params: Vec<Arc<HostTensor>> = graph
            .params
            .iter()
            .map(|p| Arc::new(p.init.materialize(&p.ty).expect("init")))
            .collect();
        let backend = CudaBackend::new(0).expect("cuda:0");
        let mut session = None;
        for attempt in ["first", "again"] {
            let t0 = std::time::Instant::now();
            let memory = compiled.report.memory.clone().expect("memory plan");
            let plan = Arc::new(lower(&compiled.graph, &memory).expect("lower"));
            let lower_s = t0.elapsed().as_secs_f64();
            let s = backend
                .prepare(plan.clone(), params.clone())
                .expect("prepare");
            let total = t0.elapsed().as_secs_f64();
            println!(
            "gpt2-small forward: lower {lower_s:.3} s, lower + prepare ({attempt} in this process) {total:.3} s, {} kernels",
            plan.kernel_count()
        );
            session = Some((s, plan));
        }
        let (mut s, plan) = session.expect("a session");
        let inputs: Vec<Arc<HostTensor>> = plan
            .inputs
            .iter()
            .map(|(_, ty)| Arc::new(rustytorch::ops::testing::rand_tensor(ty, 1, -1.0, 1.0)))
            .collect();
        s.run(&inputs).expect("run");
        s.run(&inputs).expect("run");
        let _ = s.time_steps(1).expect("warm-up");
        let ms = s.time_steps(5).expect("timing");
        push(
            "gpt2-small forward f32 b8 s1024",
            (ms, plan.kernel_count()),
            "ms",
            ms,
        );
        drop(s);
    }
    if !only_conv && !only_sparse {
        tiny_mlp_rows(&mut push);
        bert_rows(&mut push);
    }
    let json: Vec<String> = rows
        .iter()
        .map(|r| {
            format!(
                "  {{\"name\": \"{}\", \"ms\": {:.6}, \"kernels\": {}, \"{}\": {:.4}}}",
                r.name, r.ms, r.kernels, r.metric, r.value
            )
        })
        .collect();
    let out = std::env::var("OUT").unwrap_or_else(|_| "target".into());
    let path = std::path::Path::new(&out).join("rustytorch_gpu.json");
    let _ = std::fs::create_dir_all(&out);
    match std::fs::write(&path, format!("[\n{}\n]\n", json.join(",\n"))) {
        Ok(()) => println!("wrote {}", path.display()),
        Err(e) => println!("could not write {}: {e}", path.display()),
    }
}
