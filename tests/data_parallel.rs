//! Data parallelism on host replicas: two replicas on half batches train to the parameters of one
//! replica on the whole batch, stay bitwise equal to each other, skip a step together when one
//! of them sees a NaN, and bucket their gradients without changing the result; plus the
//! bucketing plan, sharding and the device-list parsing; the errors of CUDA lists on a machine
//! without GPUs, and the multi-process environment and unique-id exchange (no GPU needed).

use rustytorch::compiler::{grad_buckets, GradSync};
use rustytorch::ops::testing::rand_tensor;
use rustytorch::parallel::{exchange_id, parse_devices, shard, DataParallel, DistEnv};
use rustytorch::prelude::*;

#[path = "common/dp_mlp.rs"]
mod dp_mlp;
use dp_mlp::{batch, mlp_step};

const STEPS: usize = 6;

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
    for bad in [
        "cuda:0,cuda:0",
        "cpu,tpu",
        "auto",
        "",
        "cpu,cuda:0",
        "cuda:1,cpu",
    ] {
        assert!(parse_devices(bad).is_err(), "{bad}");
    }
    let e = parse_devices("cpu,cuda:1").unwrap_err().to_string();
    assert!(e.contains("all on the cpu or all on CUDA"), "{e}");
}

fn cuda() -> bool {
    std::env::var("RUSTYTORCH_TEST_CUDA").as_deref() == Ok("1")
}

#[test]
fn cuda_lists_without_gpus_are_clear_errors() {
    let graph = mlp_step(4, Some(GradSync::default()));
    // Mixed lists are refused before anything is opened.
    let e = DataParallel::new(
        &graph,
        &[Device::Cpu, Device::Cuda(0)],
        &CompileOptions::default(),
    )
    .err()
    .expect("refused")
    .to_string();
    assert!(
        e.contains("cpu, cuda:0") && e.contains("not a CUDA device"),
        "{e}"
    );
    let e = DataParallel::new(
        &graph,
        &[Device::Cuda(1), Device::Cuda(1)],
        &CompileOptions::default(),
    )
    .err()
    .expect("refused")
    .to_string();
    assert!(e.contains("listed twice"), "{e}");
    if cuda() {
        return; // the GPU half lives in tests/device_data_parallel.rs
    }
    // Without a GPU (or without a driver): the error names the devices and says why.
    let e = DataParallel::new(
        &graph,
        &[Device::Cuda(0), Device::Cuda(1)],
        &CompileOptions::default(),
    )
    .err()
    .expect("refused")
    .to_string();
    println!("{e}");
    assert!(e.contains("cuda:0, cuda:1"), "{e}");
    assert!(e.contains("CUDA"), "{e}");
    // The same from the environment of a multi-process launch.
    let e = DataParallel::from_env(&graph, &CompileOptions::default())
        .err()
        .expect("refused")
        .to_string();
    println!("{e}");
    assert!(e.contains("RANK") || e.contains("CUDA"), "{e}");
}

/// The variables of `pairs` as the environment.
fn env_of(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let map: std::collections::HashMap<String, String> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    move |k| map.get(k).cloned()
}

#[test]
fn the_distributed_environment_parses_like_torchrun_sets_it() {
    let env = DistEnv::parse(env_of(&[
        ("RANK", "3"),
        ("WORLD_SIZE", "4"),
        ("LOCAL_RANK", "1"),
        ("RUSTYTORCH_NCCL_ID_FILE", "/shared/job7/nccl.id"),
    ]))
    .unwrap();
    assert_eq!((env.rank, env.world, env.local_rank), (3, 4, 1), "{env:?}");
    assert_eq!(
        env.id_file.as_deref(),
        Some(std::path::Path::new("/shared/job7/nccl.id"))
    );
    assert_eq!(env.id, None);
    assert_eq!(env.timeout, std::time::Duration::from_secs(300));
    // The id given directly, and a timeout.
    let hex: String = (0..128).map(|i| format!("{:02x}", (i * 5) % 256)).collect();
    let env = DistEnv::parse(env_of(&[
        ("RANK", "0"),
        ("WORLD_SIZE", "2"),
        ("LOCAL_RANK", "0"),
        ("RUSTYTORCH_NCCL_ID", &hex),
        ("RUSTYTORCH_NCCL_ID_TIMEOUT", "2.5"),
    ]))
    .unwrap();
    assert_eq!(env.id.as_deref(), Some(hex.as_str()));
    assert_eq!(env.timeout, std::time::Duration::from_millis(2500));
    // A world of one needs no id.
    assert!(DistEnv::parse(env_of(&[
        ("RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("LOCAL_RANK", "0")
    ]))
    .is_ok());
    // Each mistake names the variable.
    let cases: [(&[(&str, &str)], &str); 7] = [
        (
            &[("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")],
            "RANK is not set",
        ),
        (
            &[("RANK", "0"), ("LOCAL_RANK", "0")],
            "WORLD_SIZE is not set",
        ),
        (
            &[("RANK", "x"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")],
            "RANK=x",
        ),
        (
            &[("RANK", "2"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")],
            "below the world size",
        ),
        (
            &[("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")],
            "RUSTYTORCH_NCCL_ID_FILE",
        ),
        (
            &[
                ("RANK", "1"),
                ("WORLD_SIZE", "2"),
                ("LOCAL_RANK", "0"),
                ("RUSTYTORCH_NCCL_ID", "12ab"),
            ],
            "unique id",
        ),
        (
            &[
                ("RANK", "1"),
                ("WORLD_SIZE", "2"),
                ("LOCAL_RANK", "0"),
                ("RUSTYTORCH_NCCL_ID_FILE", "f"),
                ("RUSTYTORCH_NCCL_ID_TIMEOUT", "-1"),
            ],
            "RUSTYTORCH_NCCL_ID_TIMEOUT=-1",
        ),
    ];
    for (vars, want) in cases {
        let e = DistEnv::parse(env_of(vars)).unwrap_err().to_string();
        assert!(e.contains(want), "{vars:?}: {e}");
    }
}

/// A fresh empty folder for one test.
fn scratch_dir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("rt-dp-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn env_for(rank: usize, world: usize, file: &std::path::Path, timeout: &str) -> DistEnv {
    DistEnv::parse(env_of(&[
        ("RANK", &rank.to_string()),
        ("WORLD_SIZE", &world.to_string()),
        ("LOCAL_RANK", "0"),
        ("RUSTYTORCH_NCCL_ID_FILE", file.to_str().unwrap()),
        ("RUSTYTORCH_NCCL_ID_TIMEOUT", timeout),
    ]))
    .unwrap()
}

#[test]
fn rank_zero_hands_the_id_to_the_others_through_a_file() {
    let dir = scratch_dir("handoff");
    let file = dir.join("nccl.id");
    let hex: String = (0..128)
        .map(|i| format!("{:02x}", (i * 3 + 1) % 256))
        .collect();
    // Ranks 1 and 2 start waiting before rank 0 writes.
    let got: Vec<String> = std::thread::scope(|s| {
        let waiters: Vec<_> = (1..3)
            .map(|r| {
                let env = env_for(r, 3, &file, "20");
                s.spawn(move || exchange_id(&env, || panic!("only rank 0 makes the id")).unwrap())
            })
            .collect();
        std::thread::sleep(std::time::Duration::from_millis(150));
        let env = env_for(0, 3, &file, "20");
        let made = exchange_id(&env, || Ok(hex.clone())).unwrap();
        let mut got = vec![made];
        got.extend(waiters.into_iter().map(|h| h.join().unwrap()));
        got
    });
    assert_eq!(got, vec![hex.clone(); 3]);
    // No temporary file is left behind.
    let names: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
    assert_eq!(names.len(), 1, "{names:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_missing_or_stale_id_file_times_out_with_a_clear_error() {
    let dir = scratch_dir("stale");
    let file = dir.join("nccl.id");
    let env = env_for(1, 2, &file, "0.3");
    let e = exchange_id(&env, || unreachable!())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("rank 1 of 2") && e.contains("nccl.id") && e.contains("rank 0"),
        "{e}"
    );
    // A file left by an earlier run (written long ago) is not taken.
    let hex: String = (0..128).map(|i| format!("{:02x}", i)).collect();
    std::fs::write(&file, &hex).unwrap();
    let old = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
    std::fs::File::options()
        .write(true)
        .open(&file)
        .unwrap()
        .set_modified(old)
        .unwrap();
    assert!(exchange_id(&env, || unreachable!()).is_err());
    // A file of garbage is waited past too.
    std::fs::write(&file, "not an id").unwrap();
    assert!(exchange_id(&env, || unreachable!()).is_err());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Runs the `rustytorch` binary with these arguments: (success, stdout, stderr).
fn cli(args: &[&str]) -> (bool, String, String) {
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_rustytorch"))
        .args(args)
        .output()
        .expect("the rustytorch binary runs");
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn the_runner_splits_a_batch_over_devices() {
    use rustytorch::compiler::format::{self, ParamStorage};
    let dir = scratch_dir("runner");
    // An MLP over a named batch (built at 6), with a scalar output in a second graph.
    let g = GraphBuilder::new();
    let x = g.input_dims("x", DType::F32, &[g.dim("batch", 6), 5.into()]);
    let w = g.param(
        "w",
        [5, 4],
        Init::Uniform {
            low: -1.0,
            high: 1.0,
            seed: 3,
        },
    );
    g.output("y", &x.matmul(&w).tanh());
    let graph = g.graph().unwrap();
    let path = dir.join("mlp.rtg");
    format::save(&graph, &path, ParamStorage::Embedded).unwrap();
    let xs = rand_tensor(&TensorType::new(DType::F32, [6, 5]), 8, -2.0, 2.0);
    let x_path = dir.join("x.npy");
    rustytorch::npy::write_npy(&x_path, &xs).unwrap();
    let input = format!("x={}", x_path.display());
    let (one_dir, two_dir) = (dir.join("one"), dir.join("two"));
    let p = path.to_str().unwrap();
    let (ok1, _, e1) = cli(&["run", p, "-i", &input, "--out", one_dir.to_str().unwrap()]);
    assert!(ok1, "{e1}");
    let (ok2, out2, e2) = cli(&[
        "run",
        p,
        "-i",
        &input,
        "--out",
        two_dir.to_str().unwrap(),
        "--devices",
        "cpu,cpu",
    ]);
    assert!(ok2, "{e2}");
    assert!(out2.contains("2 replicas"), "{out2}");
    let one = rustytorch::npy::read_npy(&one_dir.join("y.npy")).unwrap();
    let two = rustytorch::npy::read_npy(&two_dir.join("y.npy")).unwrap();
    assert_eq!(two.shape().dims(), &[6, 4]);
    // Against a float64 reference of tanh(x·w).
    let (xv, wv) = (
        xs.to_f64_vec(),
        compile_graph(&graph, Device::Cpu, &CompileOptions::inference())
            .unwrap()
            .param("w")
            .unwrap()
            .to_f64_vec(),
    );
    let want: Vec<f64> = (0..6)
        .flat_map(|i| {
            let (xv, wv) = (&xv, &wv);
            (0..4).map(move |j| {
                (0..5)
                    .map(|k| xv[i * 5 + k] * wv[k * 4 + j])
                    .sum::<f64>()
                    .tanh()
            })
        })
        .collect();
    for (a, b) in two.to_f64_vec().iter().zip(&want) {
        assert!((a - b).abs() <= 1e-5, "{a} vs {b}");
    }
    assert_eq!(one.to_f64_vec(), two.to_f64_vec());
    // A batch that does not split, a mixed list, a scalar output and --device with --devices
    // are clear errors.
    let (ok, _, e) = cli(&["run", p, "-i", &input, "--devices", "cpu,cpu,cpu,cpu"]);
    assert!(
        !ok && e.contains("4 equal shards") && !e.contains("panicked"),
        "{e}"
    );
    let (ok, _, e) = cli(&["run", p, "-i", &input, "--devices", "cpu,cuda:0"]);
    assert!(!ok && e.contains("all on the cpu or all on CUDA"), "{e}");
    let (ok, _, e) = cli(&[
        "run",
        p,
        "-i",
        &input,
        "--devices",
        "cpu,cpu",
        "--device",
        "cpu",
    ]);
    assert!(!ok && e.contains("--device"), "{e}");
    let g = GraphBuilder::new();
    let x = g.input_dims("x", DType::F32, &[g.dim("batch", 6), 5.into()]);
    g.output("s", &x.mean_all());
    let spath = dir.join("scalar.rtg");
    format::save(&g.graph().unwrap(), &spath, ParamStorage::Embedded).unwrap();
    let (ok, _, e) = cli(&[
        "run",
        spath.to_str().unwrap(),
        "-i",
        &input,
        "--devices",
        "cpu,cpu",
    ]);
    assert!(!ok && e.contains("`s` is a scalar"), "{e}");
    // A graph of fixed shapes cannot run shards.
    let g = GraphBuilder::new();
    let x = g.input("x", DType::F32, [6, 5]);
    g.output("y", &x.tanh());
    let fpath = dir.join("fixed.rtg");
    format::save(&g.graph().unwrap(), &fpath, ParamStorage::Embedded).unwrap();
    let (ok, _, e) = cli(&[
        "run",
        fpath.to_str().unwrap(),
        "-i",
        &input,
        "--devices",
        "cpu,cpu",
    ]);
    assert!(!ok && e.contains("named batch dim"), "{e}");
    if !cuda() {
        let (ok, _, e) = cli(&["run", p, "-i", &input, "--devices", "cuda:0,cuda:1"]);
        assert!(
            !ok && e.contains("cuda:0, cuda:1") && !e.contains("panicked"),
            "{e}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn all_reduce_lowers_to_a_collective_step_on_cuda() {
    use rustytorch::codegen::cuda::{lower_step, CudaStep};
    use rustytorch::ops::Op;
    let t = TensorType::new(DType::F32, [64, 3]);
    for mean in [true, false] {
        let step = lower_step(&Op::AllReduce { mean }, &[&t], &t).unwrap();
        assert_eq!(step, CudaStep::AllReduce { mean });
    }
    // An operand that is not the result's type is an error, not a step.
    let other = TensorType::new(DType::F32, [3, 64]);
    let e = lower_step(&Op::AllReduce { mean: true }, &[&other], &t)
        .unwrap_err()
        .to_string();
    assert!(e.contains("all_reduce"), "{e}");
    // And the training graph with gradient buckets lowers for CUDA (every step has a CUDA form).
    let graph = mlp_step(4, Some(GradSync { bucket_bytes: 64 }));
    let exe = compile_graph(&graph, Device::Cpu, &CompileOptions::default()).unwrap();
    let steps = rustytorch::codegen::cuda::lower_plan(exe.plan()).unwrap();
    let collectives = steps
        .iter()
        .filter(|s| matches!(s, CudaStep::AllReduce { mean: true }))
        .count();
    assert!(collectives >= 3, "{collectives} all_reduce steps");
}

#[test]
fn state_saved_from_rank_zero_loads_into_every_replica() {
    let mut dp = DataParallel::new(
        &mlp_step(4, Some(GradSync::default())),
        &[Device::Cpu, Device::Cpu],
        &CompileOptions::default(),
    )
    .unwrap();
    let (x, y) = batch(0);
    dp.run(&[("x", x), ("y", y)]).unwrap();
    let path = scratch_dir("state").join("dp.safetensors");
    dp.save_state(&path).unwrap();
    let saved = PARAMS.map(|n| dp.param(n).unwrap().to_f64_vec());
    for step in 1..3 {
        let (x, y) = batch(step);
        dp.run(&[("x", x), ("y", y)]).unwrap();
    }
    assert_ne!(dp.param("w1").unwrap().to_f64_vec(), saved[0]);
    // Parameters and the optimizer's state.
    assert!(dp.load_state(&path).unwrap() > PARAMS.len());
    for rank in 0..2 {
        for (n, b) in PARAMS.iter().zip(&saved) {
            assert_eq!(&dp.replica(rank).unwrap().param(n).unwrap().to_f64_vec(), b);
        }
    }
    // A file that does not fit fails without changing any replica.
    let e = dp.load_state(&path.with_extension("missing")).unwrap_err();
    assert!(e.to_string().contains("missing"), "{e}");
    let (x, y) = batch(3);
    dp.run(&[("x", x), ("y", y)]).unwrap();
    std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
}
