//! Channels-last convolutions on CUDA against the CPU kernels: the ops themselves (cuDNN on NHWC
//! descriptors over the operands, no staging), channels-last pooling (the generated kernels;
//! cuDNN's NHWC pooling with `RUSTYTORCH_CUDNN_POOLING=1`), and whole NHWC conv → bias → ReLU →
//! pool stacks with their gradients compiled for CUDA, where the layout pass makes them
//! channels-last, in f32, f16 and bf16. On CUDA where `RUSTYTORCH_TEST_CUDA=1`
//! (the GPU machine; there a missing GPU fails); elsewhere through the CPU executable, which keeps
//! every case valid.

use rustytorch::compiler::{grad, ConvOpts, Graph, GraphBuilder, Init, NodeId};

use rustytorch::ops::{eval_cpu, ConvGeom, Layout, Op, PoolKind};
use rustytorch::prelude::*;

#[path = "common/conv_check.rs"]
mod conv_check;
use conv_check::{cuda, device, rnd, scaled_close};

const FLOATS: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// Runs `g` compiled for the test device (default options: optimized, and on CUDA with the
/// channels-last pass) and its node-by-node CPU evaluation; compares every output.
fn check_graph(what: &str, g: &Graph, inputs: &[(String, HostTensor)], d: DType) {
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
                eval_cpu(op, &ins).unwrap_or_else(|e| panic!("{what}: cpu: {e}"))
            }
        };
        vals.insert(n, v);
    }
    let mut exe = rustytorch::compile_graph(g, device(), &CompileOptions::inference())
        .unwrap_or_else(|e| panic!("{what}: compile: {e}"));
    if cuda() {
        // The pass ran: no channels-first convolution is left.
        let ir = exe.optimized_ir();
        assert!(ir.contains("channels_last"), "{what}: {ir}");
    }
    let args: Vec<(&str, HostTensor)> = inputs
        .iter()
        .map(|(k, v)| (k.as_str(), v.clone()))
        .collect();
    let outs = exe
        .run(&args)
        .unwrap_or_else(|e| panic!("{what}: run: {e}"));
    for (k, (name, id)) in g.outputs.iter().enumerate() {
        scaled_close(
            &outs[k].to_f64_vec(),
            &vals[id].to_f64_vec(),
            d,
            &format!("{what} output {name}"),
        );
    }
}

/// Runs one channels-last op on the device (unoptimized) against the CPU kernel.
fn check_op(what: &str, op: Op, inputs: Vec<HostTensor>, d: DType) {
    let refs: Vec<&HostTensor> = inputs.iter().collect();
    let want = eval_cpu(&op, &refs).unwrap_or_else(|e| panic!("{what}: cpu: {e}"));
    let mut g = Graph::new();
    let ids: Vec<NodeId> = inputs
        .iter()
        .enumerate()
        .map(|(i, x)| g.add_input(&format!("x{i}"), x.ty()).unwrap())
        .collect();
    let y = g.add(op, &ids).unwrap();
    g.add_output("y", y).unwrap();
    let opts = CompileOptions {
        optimize: false,
        ..CompileOptions::default()
    };
    let mut exe = rustytorch::compile_graph(&g, device(), &opts)
        .unwrap_or_else(|e| panic!("{what}: compile: {e}"));
    let names: Vec<String> = (0..inputs.len()).map(|i| format!("x{i}")).collect();
    let args: Vec<(&str, HostTensor)> = names.iter().map(|n| n.as_str()).zip(inputs).collect();
    let got = exe
        .run(&args)
        .unwrap_or_else(|e| panic!("{what}: run: {e}"));
    assert_eq!(got[0].ty(), want.ty(), "{what}");
    scaled_close(&got[0].to_f64_vec(), &want.to_f64_vec(), d, what);
}

/// Channels-last convolutions and their gradients (NHWC / NDHWC, KRSC filters), with and
/// without bias, strided and dilated, and channels-last pooling.
#[test]
fn channels_last_ops() {
    // (x NHWC, w OHWI, stride, padding, dilation, bias)
    let cases: [(&[usize], &[usize], usize, usize, usize, bool); 4] = [
        (&[2, 10, 9, 16], &[32, 3, 3, 16], 1, 1, 1, true),
        (&[2, 11, 13, 8], &[8, 3, 3, 8], 2, 2, 2, false),
        (&[1, 5, 6, 7, 8], &[16, 3, 3, 3, 8], 1, 1, 1, true),
        (&[2, 9, 7, 6], &[4, 1, 1, 6], 1, 0, 1, true),
    ];
    for (k, &(xd, wd, s, p, dil, bias)) in cases.iter().enumerate() {
        let n = xd.len() - 2;
        let geom =
            ConvGeom::new(vec![s; n], vec![p; n], vec![dil; n]).with_layout(Layout::ChannelsLast);
        for (j, d) in FLOATS.into_iter().enumerate() {
            let seed = 3000 + 10 * k as u64 + j as u64;
            let (x, w) = (rnd(d, xd, seed), rnd(d, wd, seed + 1));
            let fwd = Op::Conv {
                geom: geom.clone(),
                groups: 1,
                bias,
                act: rustytorch_ops::Activation::None,
            };
            let mut ins = vec![x.clone(), w.clone()];
            if bias {
                ins.push(rnd(d, &[wd[0]], seed + 2));
            }
            let what = format!("channels-last conv {xd:?} * {wd:?} {d:?}");
            let y = {
                let refs: Vec<&HostTensor> = ins.iter().collect();
                eval_cpu(&fwd, &refs).unwrap()
            };
            check_op(&what, fwd, ins, d);
            let gy = rnd(d, y.dims(), seed + 3);
            let gi = Op::ConvGradInput {
                geom: geom.clone(),
                groups: 1,
                input_shape: Shape::new(xd.to_vec()),
            };
            check_op(&format!("{what} grad input"), gi, vec![gy.clone(), w], d);
            let gw = Op::ConvGradWeight {
                geom: geom.clone(),
                groups: 1,
                weight_shape: Shape::new(wd.to_vec()),
            };
            check_op(&format!("{what} grad weight"), gw, vec![x, gy], d);
        }
    }
    for (j, d) in FLOATS.into_iter().enumerate() {
        let geom =
            ConvGeom::new(vec![2, 2], vec![1, 1], vec![1, 1]).with_layout(Layout::ChannelsLast);
        // Distinct values (as in device_ops), so the max's winner is the same on both.
        let n: usize = 2 * 9 * 11 * 8;
        let vals: Vec<f64> = (0..n)
            .map(|i| ((i * 37) % 251) as f64 / 8.0 - 15.0)
            .collect();
        let x = HostTensor::from_vec(vals, [2, 9, 11, 8]).unwrap();
        let x = eval_cpu(&Op::Cast { to: d }, &[&x]).unwrap();
        for kind in [
            PoolKind::Max,
            PoolKind::Avg {
                count_include_pad: false,
            },
        ] {
            let op = Op::Pool {
                kind,
                kernel: vec![3, 3],
                geom: geom.clone(),
            };
            let y = eval_cpu(&op, &[&x]).unwrap();
            check_op(
                &format!("channels-last pool {kind:?} {d:?}"),
                op,
                vec![x.clone()],
                d,
            );
            let gy = rnd(d, y.dims(), 3500 + j as u64);
            let op = Op::PoolGrad {
                kind,
                kernel: vec![3, 3],
                geom: geom.clone(),
            };
            check_op(
                &format!("channels-last pool_grad {kind:?} {d:?}"),
                op,
                vec![x.clone(), gy],
                d,
            );
        }
    }
}

/// An NHWC stack (input and weights stored channels-last, permuted to NCHW/OIHW by the user):
/// conv + bias (`[C, 1, 1]` add) + ReLU, max pool, conv + bias + ReLU, permuted back; forward and
/// gradients of every parameter. f32 graphs stay channels-first on CUDA (the target's choice);
/// f16/bf16 run channels-last with no transpose of activations.
#[test]
fn nhwc_stacks_and_their_gradients() {
    for (j, d) in FLOATS.into_iter().enumerate() {
        let b = GraphBuilder::new();
        let c = 16;
        let x = b.input("x", d, [2, 12, 10, c]);
        let p = |name: &str, dims: &[usize], fan: usize, seed: u64| {
            b.param_typed(
                name,
                TensorType::new(d, Shape::new(dims.to_vec())),
                Init::kaiming_uniform(fan, seed),
                true,
            )
        };
        let w1 = p("w1", &[c, 3, 3, c], 9 * c, 1).permute(&[0, 3, 1, 2]);
        let b1 = p("b1", &[c, 1, 1], c, 2);
        let w2 = p("w2", &[c, 3, 3, c], 9 * c, 3).permute(&[0, 3, 1, 2]);
        let b2 = p("b2", &[c, 1, 1], c, 4);
        let opts = ConvOpts {
            padding: vec![1],
            ..Default::default()
        };
        let h = x
            .permute(&[0, 3, 1, 2])
            .conv(&w1, None, &opts)
            .add(&b1)
            .relu();
        let h = h.max_pool(&[2, 2], &[], &[0, 0]);
        let y = h
            .conv(&w2, None, &opts)
            .add(&b2)
            .relu()
            .permute(&[0, 2, 3, 1]);
        let loss = y.mul(&y).mean(&[0, 1, 2, 3], false);
        b.output("y", &y);
        b.output("loss", &loss);
        let mut g = b.graph().unwrap();
        let loss_id = g.outputs[1].1;
        let params: Vec<NodeId> = g.params.iter().map(|p| p.node).collect();
        let grads = grad(&mut g, loss_id, &params).unwrap();
        for (k, dp) in grads.into_iter().enumerate() {
            g.add_output(&format!("d{k}"), dp).unwrap();
        }
        let inputs = vec![("x".to_string(), rnd(d, &[2, 12, 10, c], 3600 + j as u64))];
        if d == DType::F32 && cuda() {
            // f32 is not a channels-last dtype for CUDA: compiled channels-first, still right.
            let mut exe =
                rustytorch::compile_graph(&g, device(), &CompileOptions::inference()).unwrap();
            assert!(!exe.optimized_ir().contains("channels_last"));
            let _ = exe.run(&[("x", inputs[0].1.clone())]).unwrap();
            continue;
        }
        check_graph(&format!("nhwc stack {d:?}"), &g, &inputs, d);
    }
}
