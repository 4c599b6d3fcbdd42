//! The data-parallel tests' model: a two-layer MLP's training step and its batches, shared by
//! tests/data_parallel.rs (host replicas) and tests/device_data_parallel.rs (CUDA through NCCL)
//! so that both check the same training.

use rustytorch::compiler::GradSync;
use rustytorch::ops::testing::rand_tensor;
use rustytorch::prelude::*;

/// A two-layer MLP's training step at `batch` rows (loss: the batch mean of the squared error),
/// with AdamW and clipping, its gradients averaged over replicas when `sync` is given.
pub fn mlp_step(batch: usize, sync: Option<GradSync>) -> Graph {
    let g = GraphBuilder::new();
    let x = g.input("x", DType::F32, [batch, 12]);
    let y = g.input("y", DType::F32, [batch, 3]);
    let uni = |seed| Init::Uniform {
        low: -0.4,
        high: 0.4,
        seed,
    };
    let w1 = g.param("w1", [12, 16], uni(1));
    let b1 = g.param("b1", [16], uni(2));
    let w2 = g.param("w2", [16, 3], uni(3));
    let b2 = g.param("b2", [3], uni(4));
    let h = x.matmul(&w1).add(&b1).tanh();
    let r = h.matmul(&w2).add(&b2).sub(&y);
    let loss = r.mul(&r).mean_all();
    g.output("loss", &loss);
    let opts = StepOptions {
        clip_norm: Some(10.0),
        grad_sync: sync,
    };
    g.train_step(&loss, AdamW::new(0.05).weight_decay(0.01), &opts)
        .unwrap();
    g.graph().unwrap()
}

pub fn batch(step: usize) -> (HostTensor, HostTensor) {
    let s = step as u64;
    (
        rand_tensor(&TensorType::new(DType::F32, [8, 12]), 100 + s, -1.0, 1.0),
        rand_tensor(&TensorType::new(DType::F32, [8, 3]), 200 + s, -1.0, 1.0),
    )
}
