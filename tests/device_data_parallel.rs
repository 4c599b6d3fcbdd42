//! Data-parallel training on CUDA devices through NCCL, where `RUSTYTORCH_TEST_CUDA=1` (elsewhere
//! every test returns at once; the GPU-free half is in tests/data_parallel.rs):
//!
//! - one GPU: a group of one NCCL rank trains bitwise like the plain session of the same graph,
//!   runs eagerly (no CUDA-graph replay in a group), and leaves the group to run alone;
//! - two GPUs (skipped with a notice on a one-GPU machine): two replicas on half batches train
//!   like one GPU on the whole batch and stay bitwise equal to each other; a NaN on one rank's
//!   shard skips the step on both; small and large buckets average the same gradients; state
//!   saved from rank 0 loads back into both; two processes (this binary, started twice with the
//!   variables torchrun sets) train like two threads.

use rustytorch::compiler::GradSync;
use rustytorch::ops::testing::rand_tensor;
use rustytorch::parallel::{shard, DataParallel};
use rustytorch::prelude::*;

#[path = "common/dp_mlp.rs"]
mod dp_mlp;
use dp_mlp::{batch, mlp_step};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const STEPS: usize = 6;
const PARAMS: [&str; 4] = ["w1", "b1", "w2", "b2"];

fn cuda() -> bool {
    std::env::var("RUSTYTORCH_TEST_CUDA").as_deref() == Ok("1")
}

/// One test on the GPUs at a time: NCCL communicators of concurrent tests on the same devices
/// could wait on each other's kernels.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static GPUS: std::sync::Mutex<()> = std::sync::Mutex::new(());
    GPUS.lock().unwrap_or_else(|e| e.into_inner())
}

/// The number of GPUs, or None (with a notice) when fewer than two.
fn two_gpus(test: &str) -> bool {
    let n = rustytorch::runtime::cuda_device_count().expect("RUSTYTORCH_TEST_CUDA=1 needs CUDA");
    if n < 2 {
        println!("notice: {test} needs two GPUs, this machine has {n}: skipped");
    }
    n >= 2
}

fn bits(t: &HostTensor) -> Vec<u64> {
    t.to_f64_vec().iter().map(|v| v.to_bits()).collect()
}

/// Small buckets: several all_reduce steps per training step.
fn small_buckets() -> Option<GradSync> {
    Some(GradSync { bucket_bytes: 256 })
}

#[test]
fn one_gpu_group_trains_bitwise_like_the_plain_session() {
    if !cuda() {
        return;
    }
    let _gpus = serial();
    let graph = mlp_step(8, small_buckets());
    let opts = CompileOptions::default();
    let mut plain = compile_graph(&graph, Device::Cuda(0), &opts).unwrap();
    let mut dp = DataParallel::new(&graph, &[Device::Cuda(0)], &opts).unwrap();
    assert_eq!((dp.world(), dp.local()), (1, 1));
    for step in 0..STEPS {
        let (x, y) = batch(step);
        let a = plain.run(&[("x", x.clone()), ("y", y.clone())]).unwrap();
        let b = dp.run(&[("x", x), ("y", y)]).unwrap();
        assert_eq!(
            bits(a.get("loss").unwrap()),
            bits(b[0].get("loss").unwrap()),
            "step {step}: the losses differ"
        );
    }
    for name in PARAMS {
        assert_eq!(
            bits(&plain.param(name).unwrap()),
            bits(&dp.param(name).unwrap()),
            "{name}: a group of one differs from the plain session"
        );
    }
    // The plain session replays a CUDA graph after its first runs; the group's stays eager.
    assert!(
        plain.graph_replays() > 0,
        "the plain session never replayed"
    );
    assert_eq!(dp.replica(0).unwrap().graph_replays(), 0);
    // Left alone, the replica runs its all_reduce steps as copies: the same next step again.
    let mut alone = dp.into_replica(0).unwrap();
    let (x, y) = batch(STEPS);
    plain.run(&[("x", x.clone()), ("y", y.clone())]).unwrap();
    alone.run(&[("x", x), ("y", y)]).unwrap();
    for name in PARAMS {
        assert_eq!(
            bits(&plain.param(name).unwrap()),
            bits(&alone.param(name).unwrap()),
            "{name}: the replica alone differs"
        );
    }
}

/// After `steps` of 2-GPU training on half batches and 1-GPU training on whole ones: each
/// replica's parameters (bitwise equal across GPUs, checked) and the 1-GPU ones.
#[test]
fn two_gpus_train_like_one_on_the_whole_batch() {
    if !cuda() || !two_gpus("two_gpus_train_like_one_on_the_whole_batch") {
        return;
    }
    let _gpus = serial();
    let opts = CompileOptions::default();
    let mut one = compile_graph(&mlp_step(8, None), Device::Cuda(0), &opts).unwrap();
    let mut two = DataParallel::new(
        &mlp_step(4, Some(GradSync::default())),
        &[Device::Cuda(0), Device::Cuda(1)],
        &opts,
    )
    .unwrap();
    assert_eq!((two.world(), two.local()), (2, 2));
    let init = PARAMS.map(|n| one.param(n).unwrap().to_f64_vec());
    for step in 0..STEPS {
        let (x, y) = batch(step);
        let full = one.run(&[("x", x.clone()), ("y", y.clone())]).unwrap();
        let parts = two.run(&[("x", x), ("y", y)]).unwrap();
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
    for (name, init) in PARAMS.iter().zip(&init) {
        let r0 = two.replica(0).unwrap().param(name).unwrap();
        let r1 = two.replica(1).unwrap().param(name).unwrap();
        assert_eq!(bits(&r0), bits(&r1), "{name}: the GPUs' replicas differ");
        let want = one.param(name).unwrap().to_f64_vec();
        // Tolerance: f32 sums in a different order (two half-batch gradients averaged vs one
        // whole-batch gradient) through six AdamW steps of lr 0.05.
        for (a, b) in r0.to_f64_vec().iter().zip(&want) {
            assert!(
                (a - b).abs() <= 5e-5,
                "{name}: {a} vs {b} after {STEPS} steps"
            );
        }
        assert!(
            r0.to_f64_vec()
                .iter()
                .zip(init)
                .any(|(a, b)| (a - b).abs() > 1e-3),
            "{name}: training did not move it"
        );
    }
}

#[test]
fn a_nan_on_one_gpu_skips_the_step_on_both() {
    if !cuda() || !two_gpus("a_nan_on_one_gpu_skips_the_step_on_both") {
        return;
    }
    let _gpus = serial();
    let opts = CompileOptions {
        nonfinite: NonFinitePolicy::SkipStep,
        ..Default::default()
    };
    let mut dp = DataParallel::new(
        &mlp_step(4, small_buckets()),
        &[Device::Cuda(0), Device::Cuda(1)],
        &opts,
    )
    .unwrap();
    let before = PARAMS.map(|n| bits(&dp.param(n).unwrap()));
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
            assert_eq!(
                &bits(&dp.replica(rank).unwrap().param(n).unwrap()),
                b,
                "{n}"
            );
        }
    }
    // A clean step afterwards trains both, alike.
    let (x, y) = batch(1);
    let outs = dp.run(&[("x", x), ("y", y)]).unwrap();
    assert!(outs.iter().all(|o| o.skipped.is_none()));
    for n in PARAMS {
        let r0 = bits(&dp.replica(0).unwrap().param(n).unwrap());
        assert_eq!(r0, bits(&dp.replica(1).unwrap().param(n).unwrap()), "{n}");
    }
    // Shards of different shapes are refused before either GPU starts.
    let bad = rand_tensor(&TensorType::new(DType::F32, [5, 12]), 9, -1.0, 1.0);
    let e = dp
        .run_shards(vec![
            vec![("x", xs[0].clone()), ("y", ys[0].clone())],
            vec![("x", bad), ("y", ys[1].clone())],
        ])
        .unwrap_err()
        .to_string();
    assert!(e.contains("replica 1") && e.contains("same types"), "{e}");
}

#[test]
fn two_gpus_average_alike_in_small_and_large_buckets() {
    if !cuda() || !two_gpus("two_gpus_average_alike_in_small_and_large_buckets") {
        return;
    }
    let _gpus = serial();
    let run = |sync| {
        let mut dp = DataParallel::new(
            &mlp_step(4, sync),
            &[Device::Cuda(0), Device::Cuda(1)],
            &CompileOptions::default(),
        )
        .unwrap();
        for step in 0..3 {
            let (x, y) = batch(step);
            dp.run(&[("x", x), ("y", y)]).unwrap();
        }
        PARAMS.map(|n| dp.param(n).unwrap().to_f64_vec())
    };
    let (small, large) = (run(small_buckets()), run(Some(GradSync::default())));
    for (a, b) in small.iter().zip(&large) {
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() <= 1e-6, "{x} vs {y}");
        }
    }
}

#[test]
fn state_saved_from_rank_zero_loads_into_both_gpus() {
    if !cuda() || !two_gpus("state_saved_from_rank_zero_loads_into_both_gpus") {
        return;
    }
    let _gpus = serial();
    let mut dp = DataParallel::new(
        &mlp_step(4, Some(GradSync::default())),
        &[Device::Cuda(0), Device::Cuda(1)],
        &CompileOptions::default(),
    )
    .unwrap();
    let (x, y) = batch(0);
    dp.run(&[("x", x), ("y", y)]).unwrap();
    let path = std::env::temp_dir().join(format!("rt-dp-state-{}.safetensors", std::process::id()));
    dp.save_state(&path).unwrap();
    let saved = PARAMS.map(|n| bits(&dp.param(n).unwrap()));
    for step in 1..3 {
        let (x, y) = batch(step);
        dp.run(&[("x", x), ("y", y)]).unwrap();
    }
    assert_ne!(
        bits(&dp.param("w1").unwrap()),
        saved[0],
        "training did not move w1"
    );
    assert!(dp.load_state(&path).unwrap() >= PARAMS.len());
    for rank in 0..2 {
        for (n, b) in PARAMS.iter().zip(&saved) {
            assert_eq!(
                &bits(&dp.replica(rank).unwrap().param(n).unwrap()),
                b,
                "{n}"
            );
        }
    }
    std::fs::remove_file(&path).unwrap();
}

/// Where a child process of [`two_processes_train_like_two_threads`] writes its parameters.
fn child_file(dir: &Path, rank: usize, name: &str) -> PathBuf {
    dir.join(format!("rank{rank}-{name}.npy"))
}

/// The body of one process of a two-process group: runs only when started by
/// [`two_processes_train_like_two_threads`] (`RUSTYTORCH_DP_CHILD_DIR` set).
#[test]
fn multi_process_child() {
    let Ok(dir) = std::env::var("RUSTYTORCH_DP_CHILD_DIR") else {
        return;
    };
    let dir = PathBuf::from(dir);
    let mut dp =
        DataParallel::from_env(&mlp_step(4, Some(GradSync::default())), &Default::default())
            .unwrap();
    assert_eq!(dp.world(), 2);
    for step in 0..STEPS {
        let (x, y) = batch(step);
        dp.run(&[("x", x), ("y", y)]).unwrap();
    }
    for n in PARAMS {
        let path = child_file(&dir, dp.first_rank(), n);
        rustytorch::npy::write_npy(&path, &dp.param(n).unwrap()).unwrap();
    }
}

#[test]
fn two_processes_train_like_two_threads() {
    if !cuda() || !two_gpus("two_processes_train_like_two_threads") {
        return;
    }
    let _gpus = serial();
    let dir = std::env::temp_dir().join(format!("rt-dp-procs-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut children: Vec<_> = (0..2)
        .map(|rank| {
            std::process::Command::new(&exe)
                .args(["--exact", "multi_process_child", "--nocapture"])
                .env("RUSTYTORCH_DP_CHILD_DIR", &dir)
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", "2")
                .env("LOCAL_RANK", rank.to_string())
                .env("RUSTYTORCH_NCCL_ID_FILE", dir.join("nccl.id"))
                .env("RUSTYTORCH_NCCL_ID_TIMEOUT", "120")
                .spawn()
                .unwrap()
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(300);
    for (rank, c) in children.iter_mut().enumerate() {
        loop {
            if let Some(status) = c.try_wait().unwrap() {
                assert!(status.success(), "process {rank} failed: {status}");
                break;
            }
            if Instant::now() > deadline {
                let _ = c.kill();
                panic!("process {rank} did not finish within 300 s");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    // The same training with two threads of this process.
    let mut threads = DataParallel::new(
        &mlp_step(4, Some(GradSync::default())),
        &[Device::Cuda(0), Device::Cuda(1)],
        &CompileOptions::default(),
    )
    .unwrap();
    for step in 0..STEPS {
        let (x, y) = batch(step);
        threads.run(&[("x", x), ("y", y)]).unwrap();
    }
    for n in PARAMS {
        let p0 = rustytorch::npy::read_npy(&child_file(&dir, 0, n)).unwrap();
        let p1 = rustytorch::npy::read_npy(&child_file(&dir, 1, n)).unwrap();
        assert_eq!(bits(&p0), bits(&p1), "{n}: the processes differ");
        // NCCL may pick another transport between processes than between the threads of one,
        // so the sums may round differently: a tolerance, not bits.
        for (a, b) in p0
            .to_f64_vec()
            .iter()
            .zip(threads.param(n).unwrap().to_f64_vec())
        {
            assert!((a - b).abs() <= 1e-6, "{n}: {a} vs {b}");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_device_list_longer_than_the_machine_is_a_clear_error() {
    if !cuda() {
        return;
    }
    let _gpus = serial();
    let n = rustytorch::runtime::cuda_device_count().unwrap();
    let devices: Vec<Device> = (0..=n).map(Device::Cuda).collect();
    let e = DataParallel::new(
        &mlp_step(4, Some(GradSync::default())),
        &devices,
        &CompileOptions::default(),
    )
    .err()
    .expect("refused")
    .to_string();
    assert!(
        e.contains(&format!("cuda:{n} does not exist")) && e.contains("cuda:0, "),
        "{e}"
    );
}

/// A training step of a wide MLP (`layers` square layers of `width`, f32) at `batch` rows.
fn wide_mlp_step(batch: usize, width: usize, layers: usize, sync: Option<GradSync>) -> Graph {
    let g = GraphBuilder::new();
    let x = g.input("x", DType::F32, [batch, width]);
    let y = g.input("y", DType::F32, [batch, width]);
    let mut h = x;
    for l in 0..layers {
        let w = g.param(
            &format!("w{l}"),
            [width, width],
            Init::Uniform {
                low: -0.02,
                high: 0.02,
                seed: l as u64 + 1,
            },
        );
        h = h.matmul(&w).tanh();
    }
    let r = h.sub(&y);
    let loss = r.mul(&r).mean_all();
    g.output("loss", &loss);
    let opts = StepOptions {
        grad_sync: sync,
        ..Default::default()
    };
    g.train_step(&loss, AdamW::new(1e-3), &opts).unwrap();
    g.graph().unwrap()
}

/// Step times of one GPU on the whole batch against two GPUs on half batches each, printed
/// (never asserted): `cargo test --release --test device_data_parallel -- --ignored --nocapture`.
#[test]
#[ignore = "a measurement: run it by name with --ignored --nocapture"]
fn data_parallel_step_times() {
    if !cuda() || !two_gpus("data_parallel_step_times") {
        return;
    }
    let _gpus = serial();
    let (batch, width, layers, steps) = (512, 4096, 4, 20);
    let (x, y) = (
        rand_tensor(&TensorType::new(DType::F32, [batch, width]), 1, -1.0, 1.0),
        rand_tensor(&TensorType::new(DType::F32, [batch, width]), 2, -1.0, 1.0),
    );
    let grad_mb = (layers * width * width * 4) as f64 / (1 << 20) as f64;
    println!(
        "MLP {layers}×{width}² (f32 gradients {grad_mb:.0} MiB), batch {batch}, AdamW, {steps} steps"
    );
    let timed = |f: &mut dyn FnMut()| {
        f(); // compile, warm up
        f();
        let t0 = Instant::now();
        for _ in 0..steps {
            f();
        }
        t0.elapsed().as_secs_f64() * 1e3 / steps as f64
    };
    let ins = [("x", x.clone()), ("y", y.clone())];
    let mut one = compile_graph(
        &wide_mlp_step(batch, width, layers, None),
        Device::Cuda(0),
        &CompileOptions::default(),
    )
    .unwrap();
    let ms_one = timed(&mut || {
        one.run(&ins).unwrap();
    });
    println!("| 1 GPU, batch {batch} | {ms_one:.2} ms/step |");
    for bucket_mb in [1usize, 25, 1024] {
        let mut two = DataParallel::new(
            &wide_mlp_step(
                batch / 2,
                width,
                layers,
                Some(GradSync {
                    bucket_bytes: bucket_mb << 20,
                }),
            ),
            &[Device::Cuda(0), Device::Cuda(1)],
            &CompileOptions::default(),
        )
        .unwrap();
        let ms_two = timed(&mut || {
            two.run(&ins).unwrap();
        });
        println!(
            "| 2 GPUs, {} rows each, {bucket_mb} MiB buckets | {ms_two:.2} ms/step | {:.2}× |",
            batch / 2,
            ms_one / ms_two
        );
    }
}

#[test]
fn an_aborted_group_ends_a_waiting_collective() {
    use rustytorch::runtime::cuda::nccl::NcclRank;
    use rustytorch::runtime::Communicator;
    if !cuda() || !two_gpus("an_aborted_group_ends_a_waiting_collective") {
        return;
    }
    let _gpus = serial();
    let ranks = NcclRank::group(&[0, 1]).unwrap();
    let t = rand_tensor(&TensorType::new(DType::F32, [1000]), 3, -1.0, 1.0);
    // One collective on both ranks first (NCCL connects its ranks on first use).
    let sums: Vec<HostTensor> = std::thread::scope(|s| {
        let hs: Vec<_> = ranks
            .iter()
            .map(|r| s.spawn(|| r.all_reduce(&t, false).unwrap()))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let want: Vec<f64> = t.to_f64_vec().iter().map(|v| 2.0 * v).collect();
    assert_eq!(sums[0].to_f64_vec(), want);
    assert_eq!(bits(&sums[0]), bits(&sums[1]));
    // Rank 0 enters a collective that rank 1 never joins; rank 1 fails and aborts the group.
    let e = std::thread::scope(|s| {
        let waiting = s.spawn(|| ranks[0].all_reduce(&t, true));
        std::thread::sleep(Duration::from_millis(300));
        ranks[1].abort("rank 1 failed");
        waiting.join().unwrap().unwrap_err().to_string()
    });
    assert!(e.contains("rank 1 failed"), "{e}");
    // Later collectives fail at once.
    let e = ranks[0].all_reduce(&t, true).unwrap_err().to_string();
    assert!(e.contains("aborted"), "{e}");
}

#[test]
fn the_runner_splits_a_batch_over_two_gpus() {
    use rustytorch::compiler::format::{self, ParamStorage};
    if !cuda() || !two_gpus("the_runner_splits_a_batch_over_two_gpus") {
        return;
    }
    let _gpus = serial();
    let dir = std::env::temp_dir().join(format!("rt-dp-runner-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let g = GraphBuilder::new();
    let x = g.input_dims("x", DType::F32, &[g.dim("batch", 8), 12.into()]);
    let w = g.param(
        "w",
        [12, 16],
        Init::Uniform {
            low: -0.5,
            high: 0.5,
            seed: 5,
        },
    );
    g.output("y", &x.matmul(&w).tanh());
    let path = dir.join("mlp.rtg");
    format::save(&g.graph().unwrap(), &path, ParamStorage::Embedded).unwrap();
    let xs = rand_tensor(&TensorType::new(DType::F32, [8, 12]), 4, -1.0, 1.0);
    let x_path = dir.join("x.npy");
    rustytorch::npy::write_npy(&x_path, &xs).unwrap();
    let input = format!("x={}", x_path.display());
    let run = |out: &str, extra: &[&str]| {
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_rustytorch"))
            .args(["run", path.to_str().unwrap(), "-i", &input, "--out"])
            .arg(dir.join(out))
            .args(extra)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        rustytorch::npy::read_npy(&dir.join(out).join("y.npy")).unwrap()
    };
    let cpu = run("cpu", &[]);
    let gpus = run("gpus", &["--devices", "cuda:0,cuda:1"]);
    assert_eq!(gpus.shape().dims(), &[8, 16]);
    for (a, b) in gpus.to_f64_vec().iter().zip(cpu.to_f64_vec()) {
        assert!((a - b).abs() <= 1e-5, "{a} vs {b}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
