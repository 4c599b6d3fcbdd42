//! Data parallelism on host replicas: two replicas on half batches train to the parameters of one
//! replica on the whole batch, stay bitwise equal to each other, skip a step together when one
//! of them sees a NaN, and bucket their gradients without changing the result; plus the
//! bucketing plan, sharding and the device-list parsing.

use rustytorch::compiler::{grad_buckets, GradSync};
use rustytorch::ops::testing::rand_tensor;
use rustytorch::parallel::{parse_devices, shard, DataParallel};
use rustytorch::prelude::*;

const STEPS: usize = 6;

/// A two-layer MLP's training step at `batch` rows (loss: the batch mean of the squared error),
/// with AdamW and clipping, its gradients averaged over replicas when `sync` is given.
fn mlp_step(batch: usize, sync: Option<GradSync>) -> Graph {
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

fn batch(step: usize) -> (HostTensor, HostTensor) {
    let s = step as u64;
    (
        rand_tensor(&TensorType::new(DType::F32, [8, 12]), 100 + s, -1.0, 1.0),
        rand_tensor(&TensorType::new(DType::F32, [8, 3]), 200 + s, -1.0, 1.0),
    )
}

const PARAMS: [&str; 4] = ["w1", "b1", "w2", "b2"];

#[test]
fn two_replicas_train_like_one_on_the_whole_batch() {
    let mut one =
        compile_graph(&mlp_step(8, None), Device::Cpu, &CompileOptions::default()).unwrap();
    let mut two = DataParallel::new(
        &mlp_step(4, Some(GradSync::default())),
        &[Device::Cpu, Device::Cpu],
        &CompileOptions::default(),
    )
    .unwrap();
    assert_eq!(two.world(), 2);
    for step in 0..STEPS {
        let (x, y) = batch(step);
        let full = one.run(&[("x", x.clone()), ("y", y.clone())]).unwrap();
        let parts = two.run(&[("x", x), ("y", y)]).unwrap();
        // The whole batch's mean loss is the mean of the two halves' (equal shards).
        let halves: f64 = parts
            .iter()
            .map(|o| o.get("loss").unwrap().to_f64_vec()[0])
            .sum::<f64>()
            / 2.0;
        let whole = full.get("loss").unwrap().to_f64_vec()[0];
        assert!(
            (halves - whole).abs() <= 1e-5 * whole.abs().max(1.0),
            "step {step}: {halves} vs {whole}"
        );
    }
    for name in PARAMS {
        let want = one.param(name).unwrap().to_f64_vec();
        let r0 = two.replica(0).unwrap().param(name).unwrap().to_f64_vec();
        let r1 = two.replica(1).unwrap().param(name).unwrap().to_f64_vec();
        // Bitwise equal replicas.
        assert_eq!(
            r0.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            r1.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "{name}: the replicas differ"
        );
        for (a, b) in r0.iter().zip(&want) {
            assert!(
                (a - b).abs() <= 2e-5,
                "{name}: {a} vs {b} after {STEPS} steps"
            );
        }
        // And training moved them (the comparison is not between two untouched inits).
        let init = compile_graph(&mlp_step(8, None), Device::Cpu, &CompileOptions::default())
            .unwrap()
            .param(name)
            .unwrap()
            .to_f64_vec();
        assert!(
            r0.iter().zip(&init).any(|(a, b)| (a - b).abs() > 1e-3),
            "{name}"
        );
    }
}

#[test]
fn small_buckets_average_the_same_gradients() {
    // 64-byte buckets: every gradient alone or in small groups; one bucket of everything.
    let run = |bytes: usize| {
        let graph = mlp_step(
            4,
            Some(GradSync {
                bucket_bytes: bytes,
            }),
        );
        let mut dp = DataParallel::new(
            &graph,
            &[Device::Cpu, Device::Cpu],
            &CompileOptions::default(),
        )
        .unwrap();
        for step in 0..3 {
            let (x, y) = batch(step);
            dp.run(&[("x", x), ("y", y)]).unwrap();
        }
        PARAMS.map(|n| dp.param(n).unwrap().to_f64_vec())
    };
    let (small, large) = (run(64), run(1 << 30));
    for (a, b) in small.iter().zip(&large) {
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() <= 1e-6, "{x} vs {y}");
        }
    }
    // The small buckets really are several all_reduce ops, the large one a single one.
    let count = |bytes: usize| {
        let g = mlp_step(
            4,
            Some(GradSync {
                bucket_bytes: bytes,
            }),
        );
        g.topo_order()
            .unwrap()
            .into_iter()
            .filter(|&id| {
                matches!(
                    g.node(id).unwrap().op,
                    rustytorch::ops::Op::AllReduce { .. }
                )
            })
            .count()
    };
    assert_eq!(count(1 << 30), 1);
    assert!(count(64) >= 3, "{}", count(64));
}

#[test]
fn a_nan_on_one_replica_skips_the_step_on_both() {
    let opts = CompileOptions {
        nonfinite: NonFinitePolicy::SkipStep,
        ..Default::default()
    };
    let mut dp = DataParallel::new(
        &mlp_step(4, Some(GradSync::default())),
        &[Device::Cpu, Device::Cpu],
        &opts,
    )
    .unwrap();
    let before = PARAMS.map(|n| dp.param(n).unwrap().to_f64_vec());
    let (x, y) = batch(0);
    let mut xs = [shard("x", &x, 0, 2).unwrap(), shard("x", &x, 1, 2).unwrap()];
    let mut v = xs[1].to_vec::<f32>().unwrap();
    v[5] = f32::NAN;
    xs[1] = HostTensor::from_vec(v, [4, 12]).unwrap();
    let ys = [shard("y", &y, 0, 2).unwrap(), shard("y", &y, 1, 2).unwrap()];
    let outs = dp
        .run_shards(vec![
            vec![("x", xs[0].clone()), ("y", ys[0].clone())],
            vec![("x", xs[1].clone()), ("y", ys[1].clone())],
        ])
        .unwrap();
    for (rank, o) in outs.iter().enumerate() {
        assert!(o.skipped.is_some(), "replica {rank} applied the step");
    }
    for rank in 0..2 {
        for (n, b) in PARAMS.iter().zip(&before) {
            assert_eq!(&dp.replica(rank).unwrap().param(n).unwrap().to_f64_vec(), b);
        }
    }
    // A clean step afterwards trains both.
    let (x, y) = batch(1);
    let outs = dp.run(&[("x", x), ("y", y)]).unwrap();
    assert!(outs.iter().all(|o| o.skipped.is_none()));
}

#[test]
fn a_failing_replica_fails_the_step_without_hanging() {
    let mut dp = DataParallel::new(
        &mlp_step(4, Some(GradSync::default())),
        &[Device::Cpu, Device::Cpu],
        &CompileOptions::default(),
    )
    .unwrap();
    let (x, y) = batch(0);
    let (x0, y0) = (shard("x", &x, 0, 2).unwrap(), shard("y", &y, 0, 2).unwrap());
    // Replica 1 gets a wrongly shaped input: its run fails before its first exchange.
    let bad = rand_tensor(&TensorType::new(DType::F32, [5, 12]), 9, -1.0, 1.0);
    let e = dp
        .run_shards(vec![
            vec![("x", x0.clone()), ("y", y0.clone())],
            vec![("x", bad), ("y", y0)],
        ])
        .unwrap_err()
        .to_string();
    assert!(e.contains("replica 1") && e.contains("x"), "{e}");
}

#[test]
fn replicas_without_gradient_averaging_are_refused() {
    let e = DataParallel::new(
        &mlp_step(4, None),
        &[Device::Cpu, Device::Cpu],
        &CompileOptions::default(),
    )
    .err()
    .expect("refused")
    .to_string();
    assert!(e.contains("grad_sync"), "{e}");
    // One replica may train alone.
    assert!(DataParallel::new(
        &mlp_step(4, None),
        &[Device::Cpu],
        &CompileOptions::default()
    )
    .is_ok());
}

#[test]
fn buckets_group_gradients_from_the_last_by_dtype_and_size() {
    use DType::{BF16, F32};
    // (dtype, bytes) in parameter order.
    let g = [
        (F32, 400),
        (F32, 100),
        (BF16, 50),
        (F32, 300),
        (F32, 300),
        (F32, 2000),
    ];
    assert_eq!(
        grad_buckets(&g, 700),
        vec![vec![5], vec![4, 3], vec![2], vec![1, 0]]
    );
    assert_eq!(
        grad_buckets(&g, 1 << 20),
        vec![vec![5, 4, 3], vec![2], vec![1, 0]]
    );
    assert!(grad_buckets(&[], 100).is_empty());
    // Every gradient lands in exactly one bucket.
    let mut all: Vec<usize> = grad_buckets(&g, 1).concat();
    all.sort();
    assert_eq!(all, (0..g.len()).collect::<Vec<_>>());
}

#[test]
fn shards_split_the_first_dim_evenly() {
    let t = rand_tensor(&TensorType::new(DType::F32, [6, 2]), 1, -1.0, 1.0);
    let v = t.to_f64_vec();
    assert_eq!(shard("t", &t, 1, 3).unwrap().to_f64_vec(), v[4..8].to_vec());
    assert_eq!(shard("t", &t, 2, 3).unwrap().shape().dims(), &[2, 2]);
    let e = shard("t", &t, 0, 4).unwrap_err().to_string();
    assert!(e.contains("`t`") && e.contains("4 equal shards"), "{e}");
    let s = HostTensor::from_vec(vec![2.5f32], Shape::scalar()).unwrap();
    assert_eq!(shard("s", &s, 1, 2).unwrap().to_f64_vec(), vec![2.5]);
}

#[test]
fn device_lists_parse() {
    assert_eq!(
        parse_devices("cpu,cpu").unwrap(),
        vec![Device::Cpu, Device::Cpu]
    );
    assert_eq!(
        parse_devices("cuda:0, cuda:1").unwrap(),
        vec![Device::Cuda(0), Device::Cuda(1)]
    );
    for bad in ["cuda:0,cuda:0", "cpu,tpu", "auto", ""] {
        assert!(parse_devices(bad).is_err(), "{bad}");
    }
    // CUDA replicas are refused with a clear error (their sessions cannot exchange yet).
    let e = DataParallel::new(
        &mlp_step(4, Some(GradSync::default())),
        &[Device::Cuda(0), Device::Cuda(1)],
        &CompileOptions::default(),
    )
    .err()
    .expect("refused")
    .to_string();
    assert!(e.contains("cpu"), "{e}");
}
