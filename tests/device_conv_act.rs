//! Convolutions with a fused bias and activation (`conv[..., act=...]`) on CUDA against the CPU
//! kernels: the op itself in f32, f16 and bf16, channels-first and channels-last, 1-D, 2-D and
//! 3-D, grouped and strided, with its gradients; whole conv (+ bias) + ReLU / GELU stacks that the
//! optimizer fuses; and `Device::Auto` making conv stacks channels-last when it places them on a
//! GPU. On CUDA where `RUSTYTORCH_TEST_CUDA=1` (the GPU machine; there a missing GPU fails);
//! elsewhere through the CPU executable, which keeps every case valid. The generated kernels
//! (the bias + activation pass, the transpose back with its activation) also compile with NVRTC
//! where it is present (`RUSTYTORCH_TEST_NVRTC=1` makes its absence a failure).

use rustytorch::codegen::cuda::{lower_step, source, CudaStep};
use rustytorch::compiler::{grad, ConvOpts, Graph, GraphBuilder, Init, NodeId};
use rustytorch::ops::testing::assert_close;
use rustytorch::ops::{eval_cpu, Activation, BinaryOp, ConvGeom, Layout, Op};
use rustytorch::prelude::*;
use rustytorch::runtime::cuda::compile::KernelCompiler;

#[path = "common/conv_check.rs"]
mod conv_check;
use conv_check::{cuda, device, rnd, scaled_close};

const FLOATS: [DType; 3] = [DType::F32, DType::F16, DType::BF16];
const ACTS: [Activation; 3] = [Activation::Relu, Activation::GeluErf, Activation::GeluTanh];

/// Every output of `g` node by node with the CPU kernels.
fn cpu_values(g: &Graph, inputs: &[(String, HostTensor)]) -> Vec<HostTensor> {
    let mut vals: std::collections::HashMap<NodeId, HostTensor> = Default::default();
    for n in g.live_order() {
        let node = g.node(n).unwrap();
        let v = match &node.op {
            Op::Input { index, .. } => {
                let name = &g.inputs[*index as usize].name;
                inputs.iter().find(|(k, _)| k == name).unwrap().1.clone()
            }
            Op::Param { index, .. } => {
                let p = &g.params[*index as usize];
                p.init.materialize(&p.ty).unwrap()
            }
            Op::Constant { index, .. } => g.constants[*index as usize].clone(),
            op => {
                let ins: Vec<&HostTensor> = node.inputs.iter().map(|i| &vals[i]).collect();
                eval_cpu(op, &ins).unwrap_or_else(|e| panic!("cpu {op}: {e}"))
            }
        };
        vals.insert(n, v);
    }
    g.outputs.iter().map(|(_, id)| vals[id].clone()).collect()
}

/// Compiles `g` for the test device with `opts`, runs it and compares every output with the CPU
/// kernels; returns the executable.
fn check_graph(
    what: &str,
    g: &Graph,
    inputs: &[(String, HostTensor)],
    d: DType,
    opts: &CompileOptions,
) -> Executable {
    let want = cpu_values(g, inputs);
    let mut exe = rustytorch::compile_graph(g, device(), opts)
        .unwrap_or_else(|e| panic!("{what}: compile: {e}"));
    let args: Vec<(&str, HostTensor)> = inputs
        .iter()
        .map(|(k, v)| (k.as_str(), v.clone()))
        .collect();
    let outs = exe
        .run(&args)
        .unwrap_or_else(|e| panic!("{what}: run: {e}"));
    for (k, (name, _)) in g.outputs.iter().enumerate() {
        assert_eq!(outs[k].ty(), want[k].ty(), "{what} output {name}");
        scaled_close(
            &outs[k].to_f64_vec(),
            &want[k].to_f64_vec(),
            d,
            &format!("{what} output {name}"),
        );
    }
    exe
}

/// (x channels-first, w channels-first, stride, padding, groups, bias)
type Case = (
    &'static [usize],
    &'static [usize],
    usize,
    usize,
    usize,
    bool,
);

const CASES: [Case; 5] = [
    // 1-D, grouped, strided.
    (&[2, 8, 19], &[16, 4, 3], 2, 1, 2, true),
    // 2-D, tensor-core channel counts (channels-last on CUDA in half precision).
    (&[2, 16, 10, 9], &[32, 16, 3, 3], 1, 1, 1, true),
    // 2-D, odd channels, strided, no bias.
    (&[2, 6, 11, 13], &[4, 6, 3, 3], 2, 0, 1, false),
    // 2-D depthwise.
    (&[1, 8, 9, 7], &[8, 1, 3, 3], 1, 1, 8, true),
    // 3-D.
    (&[1, 8, 5, 6, 7], &[16, 8, 3, 3, 3], 1, 1, 1, true),
];

/// One `conv[act]` op (channels-first and channels-last) and the gradients of a loss through it
/// with respect to x, w and the bias, compiled unoptimized (the op as written reaches the
/// device) and optimized (the layout pass and fusion on top).
#[test]
fn conv_act_ops_and_gradients() {
    for (k, &(xd, wd, s, p, groups, bias)) in CASES.iter().enumerate() {
        let n = xd.len() - 2;
        for layout in [Layout::ChannelsFirst, Layout::ChannelsLast] {
            for (j, d) in FLOATS.into_iter().enumerate() {
                let act = ACTS[(k + j) % 3];
                let geom = ConvGeom::new(vec![s; n], vec![p; n], vec![1; n]).with_layout(layout);
                let mut g = Graph::new();
                let xs = layout.dims_from_first(xd);
                let ws = layout.dims_from_first(wd);
                let ty = |dims: &[usize]| TensorType::new(d, Shape::new(dims.to_vec()));
                let x = g.add_input("x", ty(&xs)).unwrap();
                let w = g.add_input("w", ty(&ws)).unwrap();
                let mut ins = vec![x, w];
                if bias {
                    ins.push(g.add_input("b", ty(&[wd[0]])).unwrap());
                }
                let op = Op::Conv {
                    geom,
                    groups,
                    bias,
                    act,
                };
                let y = g.add(op, &ins).unwrap();
                let sq = g.add(Op::Binary(BinaryOp::Mul), &[y, y]).unwrap();
                let rank = xs.len();
                let loss = g
                    .add(
                        Op::Reduce {
                            kind: rustytorch::ops::ReduceKind::Mean,
                            axes: (0..rank).collect(),
                            keep_dims: false,
                        },
                        &[sq],
                    )
                    .unwrap();
                g.add_output("y", y).unwrap();
                let grads = grad(&mut g, loss, &ins).unwrap();
                for (i, dg) in grads.into_iter().enumerate() {
                    g.add_output(&format!("d{i}"), dg).unwrap();
                }
                let seed = 7000 + 100 * k as u64 + 10 * j as u64;
                let mut inputs = vec![
                    ("x".to_string(), rnd(d, &xs, seed)),
                    ("w".to_string(), rnd(d, &ws, seed + 1)),
                ];
                if bias {
                    inputs.push(("b".to_string(), rnd(d, &[wd[0]], seed + 2)));
                }
                let what = format!("conv[{act:?}] {xd:?}*{wd:?} g{groups} s{s} {layout:?} {d:?}");
                let plain = CompileOptions {
                    optimize: false,
                    ..CompileOptions::default()
                };
                check_graph(&what, &g, &inputs, d, &plain);
                check_graph(
                    &format!("{what} optimized"),
                    &g,
                    &inputs,
                    d,
                    &CompileOptions::default(),
                );
            }
        }
    }
}

/// conv (+ bias) + activation stacks spelled with separate ops: the optimizer fuses each
/// activation into its convolution (checked in the optimized IR on every device), and the
/// fused forward matches the CPU's unfused one.
#[test]
fn conv_act_stacks_fuse_and_match() {
    for (j, d) in FLOATS.into_iter().enumerate() {
        for (k, (xd, c)) in [(vec![2, 16, 12, 10], 16), (vec![2, 8, 33], 8)]
            .into_iter()
            .enumerate()
        {
            let b = GraphBuilder::new();
            let x = b.input("x", d, xd.clone());
            let n = xd.len() - 2;
            let p = |name: &str, dims: Vec<usize>, fan: usize, seed: u64| {
                b.param_typed(
                    name,
                    TensorType::new(d, Shape::new(dims)),
                    Init::kaiming_uniform(fan, seed),
                    true,
                )
            };
            let kernel = [vec![c, c], vec![3; n]].concat();
            let w1 = p("w1", kernel.clone(), 9 * c, 1);
            let b1 = p("b1", vec![c], c, 2);
            let w2 = p("w2", kernel, 9 * c, 3);
            let opts = ConvOpts {
                padding: vec![1],
                ..Default::default()
            };
            let h = x.conv(&w1, Some(&b1), &opts).relu();
            let y = h.conv(&w2, None, &opts).gelu();
            b.output("y", &y);
            let g = b.graph().unwrap();
            let inputs = vec![(
                "x".to_string(),
                rnd(d, &xd, 7500 + 10 * j as u64 + k as u64),
            )];
            let what = format!("stack {xd:?} {d:?}");
            let exe = check_graph(&what, &g, &inputs, d, &CompileOptions::inference());
            let ir = exe.optimized_ir();
            assert!(
                ir.contains("bias,act=relu") && ir.contains("act=gelu"),
                "{what}: {ir}"
            );
            assert!(
                !ir.contains("relu(") && !ir.contains("gelu("),
                "{what}: {ir}"
            );
        }
    }
}

/// The convolution and pooling nodes of an optimized graph that run channels-last.
fn channels_last_nodes(g: &Graph) -> usize {
    g.live_order()
        .into_iter()
        .filter(|&n| {
            matches!(&g.node(n).unwrap().op,
                Op::Conv { geom, .. } | Op::ConvGradInput { geom, .. }
                | Op::ConvGradWeight { geom, .. } | Op::Pool { geom, .. }
                | Op::PoolGrad { geom, .. } if geom.layout == Layout::ChannelsLast)
        })
        .count()
}

/// `Device::Auto` on a conv stack big enough for the GPU: on the GPU machine it is placed on
/// CUDA and compiled with CUDA's layout pass (its convolutions channels-last, as with
/// `Device::Cuda(0)`); elsewhere it runs on the CPU, channels-first. Either way the values match
/// the CPU's.
#[test]
fn auto_places_conv_stacks_channels_last() {
    let d = DType::BF16;
    let b = GraphBuilder::new();
    // About 3.7 GFLOP: the cost model puts it on a GPU when one is present.
    let (c, hw) = (64, 56);
    let x = b.input("x", d, [2, c, hw, hw]);
    let p = |name: &str, dims: Vec<usize>, seed: u64| {
        b.param_typed(
            name,
            TensorType::new(d, Shape::new(dims)),
            Init::kaiming_uniform(9 * c, seed),
            true,
        )
    };
    let opts = ConvOpts {
        padding: vec![1],
        ..Default::default()
    };
    let mut h = x;
    for l in 0..4 {
        let w = p(&format!("w{l}"), vec![c, c, 3, 3], 2 * l);
        let bias = p(&format!("b{l}"), vec![c], 2 * l + 1);
        h = h.conv(&w, Some(&bias), &opts).relu();
    }
    b.output("y", &h);
    let g = b.graph().unwrap();
    let xv = rnd(d, &[2, c, hw, hw], 7900);
    let mut exe = rustytorch::compile_graph(&g, Device::Auto, &CompileOptions::inference())
        .unwrap_or_else(|e| panic!("compile: {e}"));
    let placed = exe.placement().device;
    let convs = channels_last_nodes(exe.optimized_graph());
    if cuda() {
        assert!(
            matches!(placed, Device::Cuda(_)),
            "Auto should pick the GPU for this stack: {}",
            exe.placement()
        );
        assert_eq!(convs, 4, "{}", exe.optimized_ir());
        let cuda_exe =
            rustytorch::compile_graph(&g, Device::Cuda(0), &CompileOptions::inference()).unwrap();
        assert_eq!(channels_last_nodes(cuda_exe.optimized_graph()), 4);
    } else if placed == Device::Cpu {
        assert_eq!(convs, 0, "{}", exe.optimized_ir());
    }
    let got = exe.run(&[("x", xv.clone())]).unwrap();
    let want = cpu_values(&g, &[("x".to_string(), xv)]);
    scaled_close(&got[0].to_f64_vec(), &want[0].to_f64_vec(), d, "auto stack");
}

/// The lowering leaves on a cuDNN descriptor exactly the activations the runtime applies.
#[test]
fn lowering_and_runtime_agree_on_activations() {
    for act in [
        Activation::None,
        Activation::Relu,
        Activation::GeluErf,
        Activation::GeluTanh,
    ] {
        assert_eq!(
            rustytorch::codegen::cuda::dnn::runtime_applies(act),
            rustytorch::runtime::cuda::dnn::fused_act_supported(act),
            "{act:?}"
        );
    }
}

/// The generated kernels of conv[act] steps compile with NVRTC for sm_80 and sm_90: the
/// bias + activation pass (f32, f64, grouped half; both layouts) and the staged half-precision
/// transpose back with its activation.
#[test]
fn conv_act_kernels_compile() {
    let required = std::env::var("RUSTYTORCH_TEST_NVRTC").as_deref() == Ok("1");
    let compilers: Result<Vec<_>, _> = [(8, 0), (9, 0)]
        .into_iter()
        .map(|cc| KernelCompiler::with_dir(cc, None))
        .collect();
    let compilers = match compilers {
        Ok(c) => c,
        Err(e) if required => panic!("RUSTYTORCH_TEST_NVRTC=1 but NVRTC is unavailable: {e}"),
        Err(e) => {
            eprintln!("skipped: {e}");
            return;
        }
    };
    let mut sources = vec![];
    let t = |d: DType, dims: &[usize]| TensorType::new(d, Shape::new(dims.to_vec()));
    for act in ACTS {
        for (d, c, groups, layout) in [
            (DType::F32, 16, 1, Layout::ChannelsFirst),
            (DType::F32, 6, 1, Layout::ChannelsLast),
            (DType::F64, 16, 1, Layout::ChannelsLast),
            (DType::F16, 16, 2, Layout::ChannelsFirst),
            (DType::BF16, 6, 1, Layout::ChannelsFirst),
            (DType::F16, 16, 1, Layout::ChannelsFirst),
            (DType::BF16, 16, 1, Layout::ChannelsFirst),
        ] {
            for bias in [true, false] {
                let op = Op::Conv {
                    geom: ConvGeom::new(vec![1, 1], vec![1, 1], vec![1, 1]).with_layout(layout),
                    groups,
                    bias,
                    act,
                };
                let x = t(d, &layout.dims_from_first(&[2, 16, 8, 9]));
                let w = t(d, &layout.dims_from_first(&[c, 16 / groups, 3, 3]));
                let bt = t(d, &[c]);
                let mut ins = vec![&x, &w];
                if bias {
                    ins.push(&bt);
                }
                let out = rustytorch::ops::infer(&op, &ins).unwrap();
                let CudaStep::Dnn(step) = lower_step(&op, &ins, &out).unwrap() else {
                    panic!("a convolution lowers to a cuDNN step");
                };
                // A ReLU on an unstaged step is the runtime's (cuDNN's); anything else is a
                // generated kernel.
                let staged = !step.before.is_empty();
                assert_eq!(
                    step.after.is_empty(),
                    !staged && act == Activation::Relu,
                    "{op}: {d:?}"
                );
                assert!(rustytorch::codegen::cuda::dnn::runtime_applies(
                    step.desc.act
                ));
                for l in step.before.iter().chain(&step.after) {
                    sources.push((l.kernel.name.clone(), source(&l.kernel).unwrap()));
                }
            }
        }
    }
    sources.sort();
    sources.dedup();
    for c in &compilers {
        c.cubins(&sources)
            .unwrap_or_else(|e| panic!("{}: {e}", c.arch()));
    }
}

/// The convolutions of `g` that carry an activation.
fn fused_convs(g: &Graph) -> usize {
    g.live_order()
        .into_iter()
        .filter(
            |&n| matches!(&g.node(n).unwrap().op, Op::Conv { act, .. } if *act != Activation::None),
        )
        .count()
}

/// A small CNN (conv + bias + ReLU, conv + GELU, pooling, a linear head) trained for a few SGD
/// steps optimized and unoptimized: the same losses and parameters. A census of the optimized
/// graphs: the forward alone has both activations fused into their convolutions; in the training
/// step the gradients of ReLU and GELU read the convolutions' own results (the pre-activations),
/// so the extractor refuses both fusions there (fusing would compute each convolution twice).
#[test]
fn optimized_cnn_training_matches_unoptimized() {
    let d = DType::F32;
    let build = |train: bool| {
        let g = GraphBuilder::new();
        let x = g.input("x", d, [4, 3, 10, 10]);
        let y = g.input("y", DType::I64, [4]);
        let w1 = g.param("w1", [8, 3, 3, 3], Init::kaiming_uniform(27, 1));
        let b1 = g.param("b1", [8], Init::kaiming_uniform(8, 2));
        let w2 = g.param("w2", [8, 8, 3, 3], Init::kaiming_uniform(72, 3));
        let head = g.param("head", [8 * 5 * 5, 3], Init::kaiming_uniform(200, 4));
        let opts = ConvOpts {
            padding: vec![1],
            ..Default::default()
        };
        let h = x.conv(&w1, Some(&b1), &opts).relu();
        let h = h.conv(&w2, None, &opts).gelu();
        let h = h.max_pool(&[2, 2], &[], &[0, 0]).reshape([4, 200]);
        let loss = h.matmul(&head).cross_entropy(&y);
        if train {
            g.train_step(&loss, Sgd::new(0.05), &StepOptions::default())
                .unwrap();
        }
        (g, loss)
    };
    let (fwd, loss) = build(false);
    let exe = rustytorch::compile(&fwd, &[&loss], device()).unwrap();
    assert_eq!(
        fused_convs(exe.optimized_graph()),
        2,
        "{}",
        exe.optimized_ir()
    );
    let xv = rnd(d, &[4, 3, 10, 10], 8100);
    let yv = HostTensor::from_vec(vec![0i64, 2, 1, 2], [4]).unwrap();
    let mut runs = vec![];
    for optimize in [true, false] {
        let (g, loss) = build(true);
        let opts = CompileOptions {
            optimize,
            ..CompileOptions::default()
        };
        let mut exe = rustytorch::compile_with(&g, &[&loss], device(), &opts).unwrap();
        let losses: Vec<f64> = (0..4)
            .map(|_| {
                let out = exe.run(&[("x", xv.clone()), ("y", yv.clone())]).unwrap();
                out[0].to_f64_vec()[0]
            })
            .collect();
        assert_eq!(
            fused_convs(exe.optimized_graph()),
            0,
            "{}",
            exe.optimized_ir()
        );
        runs.push((losses, exe));
    }
    let ((l1, e1), (l2, e2)) = (&runs[0], &runs[1]);
    assert!(l1[3] < l1[0], "the loss falls: {l1:?}");
    assert_close(l1, l2, 1e-4, "losses optimized vs unoptimized");
    for (name, _) in e1.param_types() {
        let (a, b) = (e1.param(name).unwrap(), e2.param(name).unwrap());
        assert_close(&a.to_f64_vec(), &b.to_f64_vec(), 1e-4, name);
    }
}

/// Times `conv[bias, act]` against `conv[bias]` followed by the activation as a second op, on
/// the CPU kernels (f32, best of 5). Prints; asserts nothing about time. Run with
/// `cargo test --release --test device_conv_act -- --ignored --nocapture`.
#[test]
#[ignore]
fn conv_act_cpu_timings() {
    let cases: [(&[usize], &[usize]); 3] = [
        (&[8, 64, 28, 28], &[64, 64, 3, 3]),
        (&[32, 32, 16, 16], &[32, 32, 1, 1]),
        (&[4, 64, 1024], &[64, 64, 3]),
    ];
    println!("| x | w | act | conv + act (ms) | conv[act] (ms) |");
    println!("| --- | --- | --- | --- | --- |");
    for (k, (xd, wd)) in cases.into_iter().enumerate() {
        let n = xd.len() - 2;
        let d = DType::F32;
        let x = rnd(d, xd, 8200 + k as u64);
        let w = rnd(d, wd, 8300 + k as u64);
        let b = rnd(d, &[wd[0]], 8400 + k as u64);
        for act in [Activation::Relu, Activation::GeluErf] {
            let conv = |act| Op::Conv {
                geom: ConvGeom::new(vec![1; n], vec![wd[2] / 2; n], vec![1; n]),
                groups: 1,
                bias: true,
                act,
            };
            let u = match act {
                Activation::Relu => rustytorch::ops::UnaryOp::Relu,
                _ => rustytorch::ops::UnaryOp::GeluErf,
            };
            let best = |f: &dyn Fn() -> HostTensor| {
                (0..5)
                    .map(|_| {
                        let t = std::time::Instant::now();
                        std::hint::black_box(f());
                        t.elapsed().as_secs_f64() * 1e3
                    })
                    .fold(f64::INFINITY, f64::min)
            };
            let two = best(&|| {
                let y = eval_cpu(&conv(Activation::None), &[&x, &w, &b]).unwrap();
                eval_cpu(&Op::Unary(u), &[&y]).unwrap()
            });
            let one = best(&|| eval_cpu(&conv(act), &[&x, &w, &b]).unwrap());
            println!("| {xd:?} | {wd:?} | {act:?} | {two:.2} | {one:.2} |");
        }
    }
}
