//! Property test: random graphs over many op kinds with random broadcastable shapes compute the
//! same values before and after the optimizer and fusion, on the CPU. Each case is generated from
//! one seed (printed on failure), so a failure reproduces with `PROPTEST_CASES=1` and that seed.
//! Where `RUSTYTORCH_TEST_CUDA=1`, the same optimized graphs also run on CUDA against the CPU.

use proptest::prelude::*;
use rustytorch::codegen::lower;
use rustytorch::ops::rng::uniform01;
use rustytorch::ops::testing::{assert_close, rand_tensor};
use rustytorch::prelude::*;
use rustytorch::runtime::{Backend, CpuBackend};
use std::sync::Arc;

struct Gen {
    seed: u64,
    i: u64,
}

impl Gen {
    fn next(&mut self) -> f64 {
        self.i += 1;
        uniform01(self.seed, self.i)
    }
    fn below(&mut self, n: usize) -> usize {
        ((self.next() * n as f64) as usize).min(n - 1)
    }
}

/// Builds a random graph of f32 ops; returns the builder, its output and the input values.
fn random_graph(seed: u64, n_ops: usize) -> (GraphBuilder, Tensor, Vec<(String, HostTensor)>) {
    let mut r = Gen { seed, i: 0 };
    let g = GraphBuilder::new();
    let (m, n) = (1 + r.below(5), 1 + r.below(6));
    let shapes = [vec![m, n], vec![n], vec![m, 1], vec![1, n], vec![2, m, n]];
    let mut pool: Vec<Tensor> = Vec::new();
    let mut inputs = Vec::new();
    for k in 0..3 {
        let s = shapes[r.below(shapes.len())].clone();
        let name = format!("x{k}");
        let ty = TensorType::new(DType::F32, Shape::new(s.clone()));
        inputs.push((
            name.clone(),
            rand_tensor(&ty, seed ^ (k as u64 + 1), -1.5, 1.5),
        ));
        pool.push(g.input(&name, DType::F32, s));
    }
    for _ in 0..n_ops {
        let a = pool[r.below(pool.len())].clone();
        let b = pool[r.below(pool.len())].clone();
        let ra = a.rank().unwrap();
        let last = *a.dims().last().unwrap();
        let t = match r.below(26) {
            0 => a.exp().minimum_scalar(50.0),
            1 => a.tanh(),
            2 => a.sigmoid(),
            3 => a.relu(),
            4 => a.gelu(),
            5 => a.gelu_tanh(),
            6 => a.silu(),
            7 => a.abs().add_scalar(0.5).log(),
            8 => a.neg(),
            9 => a.sin(),
            10 | 11 => {
                if rustytorch::Shape::broadcast(&a.shape().unwrap(), &b.shape().unwrap()).is_some()
                {
                    match r.below(5) {
                        0 => a.add(&b),
                        1 => a.sub(&b),
                        2 => a.mul(&b),
                        3 => a.maximum(&b),
                        _ => a.div(&b.abs().add_scalar(0.5)),
                    }
                } else {
                    a.mul_scalar(1.5)
                }
            }
            12 => {
                if rustytorch::Shape::broadcast(&a.shape().unwrap(), &b.shape().unwrap()).is_some()
                {
                    g.where_(&a.gt(&b), &a, &b.mul_scalar(0.5))
                } else {
                    a.add_scalar(1.0)
                }
            }
            13 => a.sum(&[-1], true),
            14 => a.mean(&[0], false).reshape_infer(&[-1]).unsqueeze(0),
            15 => a.max(&[-1], true),
            16 => a.softmax(-1),
            17 => a.log_softmax(-1),
            18 => {
                let w = g.param(
                    &format!("w{}", r.i),
                    [last, 3],
                    Init::kaiming_uniform(last, r.i),
                );
                a.matmul(&w)
            }
            19 => {
                if ra >= 2 {
                    a.t()
                } else {
                    a.unsqueeze(0)
                }
            }
            20 => a.reshape_infer(&[-1]),
            21 => {
                let w = g.param(&format!("ln{}", r.i), [last], Init::ones());
                let bb = g.param(&format!("lb{}", r.i), [last], Init::Full(0.1));
                a.layer_norm(Some(&w), Some(&bb), 1e-5)
            }
            22 => a.rms_norm(None, 1e-5),
            23 => a.slice(-1, 0, last.div_ceil(2), 1 + r.below(2)),
            24 => {
                let mut pads = vec![(0, 0); ra];
                pads[ra - 1] = (1, r.below(2));
                a.pad(&pads, 0.25)
            }
            _ => g.concat(&[&a, &a.mul_scalar(2.0)], -1),
        };
        pool.push(t);
    }
    // The output mixes the last value with a reduction so every value reaches it cheaply.
    let out = pool.last().unwrap().clone();
    (g, out, inputs)
}

/// Runs `graph` as built (no optimizer, no fusion) on the CPU backend.
fn run_plain(graph: &Graph, inputs: &[(String, HostTensor)]) -> Vec<f64> {
    let memory = rustytorch::compiler::plan::plan(graph).unwrap();
    let plan = Arc::new(lower(graph, &memory).unwrap());
    let ins: Vec<Arc<HostTensor>> = graph
        .inputs
        .iter()
        .map(|d| Arc::new(inputs.iter().find(|(n, _)| *n == d.name).unwrap().1.clone()))
        .collect();
    let params: Vec<Arc<HostTensor>> = graph
        .params
        .iter()
        .map(|p| Arc::new(p.init.materialize(&p.ty).unwrap()))
        .collect();
    let mut session = CpuBackend.prepare(plan, params).unwrap();
    let r = session.run(&ins).unwrap();
    r.outputs[0].to_f64_vec()
}

fn check(seed: u64, n_ops: usize) {
    let (g, out, inputs) = random_graph(seed, n_ops);
    g.output("out", &out);
    let graph = g.graph().unwrap_or_else(|e| panic!("seed {seed}: {e}"));
    let want = run_plain(&graph, &inputs);
    let mut exe = compile_graph(&graph, Device::Cpu, &CompileOptions::inference())
        .unwrap_or_else(|e| panic!("seed {seed}: {e}"));
    let refs: Vec<(&str, HostTensor)> = inputs
        .iter()
        .map(|(n, t)| (n.as_str(), t.clone()))
        .collect();
    let got = exe.run(&refs).unwrap()[0].to_f64_vec();
    assert_close(&got, &want, 2e-4, &format!("seed {seed} ({n_ops} ops)"));
}

/// The same optimized graph on CUDA against the CPU (where `RUSTYTORCH_TEST_CUDA=1`).
fn check_cuda(seed: u64, n_ops: usize) {
    if std::env::var("RUSTYTORCH_TEST_CUDA").as_deref() != Ok("1") {
        return;
    }
    let (g, out, inputs) = random_graph(seed, n_ops);
    g.output("out", &out);
    let graph = g.graph().unwrap_or_else(|e| panic!("seed {seed}: {e}"));
    let refs: Vec<(&str, HostTensor)> = inputs
        .iter()
        .map(|(n, t)| (n.as_str(), t.clone()))
        .collect();
    let run = |device| {
        let mut exe = compile_graph(&graph, device, &CompileOptions::inference())
            .unwrap_or_else(|e| panic!("seed {seed} on {device}: {e}"));
        exe.run(&refs).unwrap()[0].to_f64_vec()
    };
    let want = run(Device::Cpu);
    let got = run(Device::Cuda(0));
    assert_close(
        &got,
        &want,
        1e-4,
        &format!("seed {seed} ({n_ops} ops) cuda vs cpu"),
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]
    #[test]
    fn cuda_matches_cpu_on_optimized_graphs(seed in any::<u64>(), n_ops in 1usize..12) {
        check_cuda(seed, n_ops);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]
    #[test]
    fn optimize_and_fuse_preserve_values(seed in any::<u64>(), n_ops in 1usize..12) {
        check(seed, n_ops);
    }
}
