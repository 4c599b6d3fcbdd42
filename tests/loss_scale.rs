//! Loss scaling of training steps (`CompileOptions::loss_scale`): a static scale trains exactly
//! like no scale (the unscaling is exact and comes before clipping); dynamic scaling skips a step
//! with an overflowing gradient, backs the scale off and grows it again after its interval, on
//! every device and on every data-parallel replica; under f16 autocast a loss too small for f16
//! gradients learns only with scaling; the option parses from text and the environment.

use rustytorch::compiler::GradSync;
use rustytorch::executable::{LossScale, LossScaleStatus};
use rustytorch::parallel::{shard, DataParallel};
use rustytorch::prelude::*;
use rustytorch::runtime::device::test_devices;
use std::sync::Mutex;

/// Held by every test that compiles with `LossScale::Auto` or sets `RUSTYTORCH_LOSS_SCALE`
/// (tests of one binary share the environment).
static ENV: Mutex<()> = Mutex::new(());

fn env_lock() -> std::sync::MutexGuard<'static, ()> {
    ENV.lock().unwrap_or_else(|e| e.into_inner())
}

const PARAMS: [&str; 3] = ["w1", "b1", "w2"];

/// A two-layer regression network on x [8, 6] → [8, 3] of `dtype`, its training step (AdamW or
/// SGD with momentum, clipping to `clip`), outputting the loss and the gradient norm.
fn regression(
    dtype: DType,
    opt: rustytorch::Optimizer,
    clip: Option<f64>,
    grad_sync: Option<GradSync>,
) -> GraphBuilder {
    regression_rows(8, dtype, opt, clip, grad_sync)
}

/// [`regression`] on batches of `rows`.
fn regression_rows(
    rows: usize,
    dtype: DType,
    opt: rustytorch::Optimizer,
    clip: Option<f64>,
    grad_sync: Option<GradSync>,
) -> GraphBuilder {
    let g = GraphBuilder::new();
    let x = g.input("x", dtype, [rows, 6]);
    let y = g.input("y", dtype, [rows, 3]);
    let ty = |dims: [usize; 2]| TensorType::new(dtype, Shape::new(dims));
    let w1 = g.param_typed("w1", ty([6, 16]), Init::kaiming_uniform(6, 1), true);
    let b1 = g.param_typed(
        "b1",
        TensorType::new(dtype, Shape::new([16usize])),
        Init::Full(0.1),
        true,
    );
    let w2 = g.param_typed("w2", ty([16, 3]), Init::kaiming_uniform(16, 2), true);
    let loss = x.matmul(&w1).add(&b1).tanh().matmul(&w2).mse_loss(&y);
    let step = g
        .train_step(
            &loss,
            opt,
            &StepOptions {
                clip_norm: clip,
                grad_sync,
            },
        )
        .unwrap();
    g.output("loss", &loss);
    g.output("grad_norm", &step.grad_norm);
    g
}

/// Batch `i` of the regression task: random x, y a fixed function of x.
fn batch(i: u64, dtype: DType) -> (HostTensor, HostTensor) {
    let xs = rustytorch::ops::testing::rand_f64(48, 100 + i, -1.0, 1.0);
    let ys: Vec<f64> = xs
        .chunks(6)
        .flat_map(|r| [r[0] * r[1], r[2] - r[3], (r[4] + r[5]).sin()])
        .collect();
    let t = |v: Vec<f64>, dims: [usize; 2]| HostTensor::from_vec(v, dims).unwrap().cast(dtype);
    (t(xs, [8, 6]), t(ys, [8, 3]))
}

fn compile_step(g: &GraphBuilder, device: Device, loss_scale: LossScale) -> Executable {
    let graph = g.graph().unwrap();
    let opts = CompileOptions {
        loss_scale,
        ..CompileOptions::default()
    };
    rustytorch::compile_graph(&graph, device, &opts).unwrap()
}

fn params(exe: &Executable) -> Vec<Vec<f64>> {
    PARAMS
        .iter()
        .map(|n| exe.param(n).unwrap().to_f64_vec())
        .collect()
}

/// Runs `steps` steps on batches 0.. and returns the gradient norms.
fn train(exe: &mut Executable, dtype: DType, steps: u64) -> Vec<f64> {
    (0..steps)
        .map(|i| {
            let (x, y) = batch(i, dtype);
            let out = exe.run(&[("x", x), ("y", y)]).unwrap();
            assert!(out.skipped.is_none(), "step {i} was skipped");
            out.get("grad_norm").unwrap().to_f64_vec()[0]
        })
        .collect()
}

/// A static scale S: the backward runs in units of S and every gradient is multiplied by 1/S
/// before the norm, clipping and the update, so the parameters after a few steps are those of
/// the unscaled run: bit for bit with a power of two (exact in binary), within rounding with
/// S = 1000, for f16 parameters (whose scaled f16 gradients are unscaled in f32), f32 and f64
/// parameters (whose unscaling is in f64). Clipping is active
/// (the gradient norms are above its bound), so unscaling after clipping would show.
#[test]
fn a_static_scale_trains_exactly_like_no_scale() {
    let cases: [(DType, rustytorch::Optimizer, f32, f64); 5] = [
        (DType::F16, Sgd::new(0.05).momentum(0.9).into(), 1024.0, 0.0),
        (DType::F32, Sgd::new(0.05).momentum(0.9).into(), 1024.0, 0.0),
        (DType::F32, AdamW::new(1e-2).into(), 1024.0, 0.0),
        (DType::F32, AdamW::new(1e-2).into(), 1000.0, 1e-5),
        (
            DType::F64,
            Sgd::new(0.05).momentum(0.9).into(),
            1000.0,
            1e-12,
        ),
    ];
    for (dtype, opt, s, tol) in cases {
        let g = regression(dtype, opt.clone(), Some(0.05), None);
        let mut plain = compile_step(&g, Device::Cpu, LossScale::Off);
        let mut scaled = compile_step(&g, Device::Cpu, LossScale::Static(s));
        assert!(plain.loss_scale().is_none());
        assert_eq!(
            scaled.loss_scale(),
            Some(LossScaleStatus {
                scale: s,
                dynamic: false,
                good_steps: 0,
                skipped: 0
            })
        );
        let norms_plain = train(&mut plain, dtype, 6);
        let norms_scaled = train(&mut scaled, dtype, 6);
        let what = format!("{dtype}, {opt:?}, scale {s}");
        assert!(
            norms_plain.iter().all(|&n| n > 0.05),
            "{what}: clipping was not active: {norms_plain:?}"
        );
        rustytorch::ops::testing::assert_close(&norms_scaled, &norms_plain, tol, &what);
        let initial = params(&compile_step(&g, Device::Cpu, LossScale::Off));
        for ((name, a), (b, p0)) in PARAMS
            .iter()
            .zip(params(&scaled))
            .zip(params(&plain).into_iter().zip(initial))
        {
            assert_ne!(b, p0, "{what}: {name} did not train");
            if tol == 0.0 {
                assert_eq!(a, b, "{what}: {name}");
            } else {
                rustytorch::ops::testing::assert_close(&a, &b, tol, &format!("{what}: {name}"));
            }
        }
    }
}

/// `y` with its element `at` set to 1e37: the gradient of the mean squared error there is
/// about 8e35, finite in f32, but 1024 times that is not.
fn overflowing(y: HostTensor, at: usize) -> HostTensor {
    let shape = y.shape().clone();
    let mut v = y.to_vec::<f32>().unwrap();
    v[at] = 1e37;
    HostTensor::from_vec(v, shape).unwrap()
}

/// Batch `i`, with a target that overflows the scaled gradient when `overflow` is set.
fn maybe_overflowing(i: u64, overflow: bool) -> Vec<(&'static str, HostTensor)> {
    let (x, y) = batch(i, DType::F32);
    let y = if overflow { overflowing(y, 7) } else { y };
    vec![("x", x), ("y", y)]
}

const DYNAMIC: LossScale = LossScale::Dynamic {
    init: 1024.0,
    growth: 2.0,
    backoff: 0.5,
    interval: 3,
};

fn status(exe: &Executable) -> (f32, u64, u64) {
    let s = exe.loss_scale().expect("the executable scales its loss");
    assert!(s.dynamic);
    (s.scale, s.good_steps, s.skipped)
}

/// Dynamic scaling with interval 3: two finite steps, then an overflowing gradient skips the step
/// (under the default non-finite policy, which would otherwise fail the run), leaves every
/// parameter and the step counter as they were and halves the scale; three finite steps later
/// the scale has doubled back. The scale and its counters survive a save and a load.
#[test]
fn dynamic_scaling_backs_off_on_overflow_and_grows_after_its_interval() {
    for device in test_devices() {
        let g = regression(DType::F32, AdamW::new(1e-2).into(), None, None);
        let mut exe = compile_step(&g, device, DYNAMIC);
        assert_eq!(status(&exe), (1024.0, 0, 0), "{device}");
        for i in 0..2 {
            let out = exe.run(&maybe_overflowing(i, false)).unwrap();
            assert!(out.skipped.is_none(), "{device}: step {i}");
        }
        assert_eq!(status(&exe), (1024.0, 2, 0), "{device}");
        let before = params(&exe);
        let out = exe.run(&maybe_overflowing(2, true)).unwrap();
        assert!(
            out.skipped.is_some(),
            "{device}: the overflow was not skipped"
        );
        assert_eq!(
            params(&exe),
            before,
            "{device}: a skipped step changed parameters"
        );
        assert_eq!(
            exe.param("optim.step").unwrap().to_vec::<i64>().unwrap(),
            vec![2],
            "{device}"
        );
        assert_eq!(status(&exe), (512.0, 0, 1), "{device}");
        for i in 3..5 {
            assert!(exe
                .run(&maybe_overflowing(i, false))
                .unwrap()
                .skipped
                .is_none());
            assert_eq!(status(&exe), (512.0, i - 2, 1), "{device}: step {i}");
        }
        assert!(exe
            .run(&maybe_overflowing(5, false))
            .unwrap()
            .skipped
            .is_none());
        assert_eq!(status(&exe), (1024.0, 0, 1), "{device}: after the interval");
        assert_ne!(
            params(&exe),
            before,
            "{device}: the finite steps did not train"
        );

        // The state file carries the scale and its counters.
        let dir =
            std::env::temp_dir().join(format!("rustytorch-loss-scale-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(format!(
            "state-{}.safetensors",
            device.to_string().replace(':', "")
        ));
        assert!(exe
            .run(&maybe_overflowing(6, false))
            .unwrap()
            .skipped
            .is_none());
        exe.save_state(&path).unwrap();
        let mut fresh = compile_step(&g, device, DYNAMIC);
        assert_eq!(status(&fresh), (1024.0, 0, 0));
        fresh.load_state(&path).unwrap();
        assert_eq!(status(&fresh), (1024.0, 1, 1), "{device}: after load");
        std::fs::remove_dir_all(&dir).ok();
    }
}

/// Data parallelism on two host replicas: an overflow in one replica's shard reaches both
/// through the averaged gradients, so both skip the step and both halve their scale.
#[test]
fn every_replica_backs_off_together() {
    let g = regression_rows(
        4,
        DType::F32,
        Sgd::new(0.05).into(),
        None,
        Some(GradSync::default()),
    )
    .graph()
    .unwrap();
    let opts = CompileOptions {
        loss_scale: DYNAMIC,
        ..CompileOptions::default()
    };
    let mut dp = DataParallel::new(&g, &[Device::Cpu, Device::Cpu], &opts).unwrap();
    let shards = |i: u64, overflow_on: Option<usize>| {
        let (x, y) = batch(i, DType::F32);
        (0..2)
            .map(|r| {
                let mut ys = shard("y", &y, r, 2).unwrap();
                if overflow_on == Some(r) {
                    ys = overflowing(ys, 4);
                }
                vec![("x", shard("x", &x, r, 2).unwrap()), ("y", ys)]
            })
            .collect::<Vec<_>>()
    };
    let outs = dp.run_shards(shards(0, None)).unwrap();
    assert!(outs.iter().all(|o| o.skipped.is_none()));
    let outs = dp.run_shards(shards(1, Some(1))).unwrap();
    for r in 0..2 {
        assert!(outs[r].skipped.is_some(), "replica {r} applied the step");
        assert_eq!(status(dp.replica(r).unwrap()), (512.0, 0, 1), "replica {r}");
    }
    let outs = dp.run_shards(shards(2, None)).unwrap();
    assert!(outs.iter().all(|o| o.skipped.is_none()));
    for r in 0..2 {
        assert_eq!(status(dp.replica(r).unwrap()), (512.0, 1, 1), "replica {r}");
    }
}

/// A regression network without biases whose loss is multiplied by 1e-8: under f16 autocast the
/// backward's matmuls see output gradients around 1e-9, below f16's smallest subnormal (6e-8),
/// so without scaling every weight gradient is exactly zero and AdamW cannot move; with the
/// default (dynamic scaling from 65536, since autocast is f16) the gradients are those of the
/// f32 run within f16 rounding, and the loss falls.
#[test]
fn f16_autocast_learns_a_tiny_loss_only_with_scaling() {
    let _env = env_lock();
    for device in test_devices() {
        let build = || {
            let g = GraphBuilder::new();
            let x = g.input("x", DType::F32, [8, 6]);
            let y = g.input("y", DType::F32, [8, 3]);
            let w1 = g.param("w1", [6, 16], Init::kaiming_uniform(6, 1));
            let w2 = g.param("w2", [16, 3], Init::kaiming_uniform(16, 2));
            let loss = x.matmul(&w1).tanh().matmul(&w2).mse_loss(&y);
            let step = g
                .train_step(
                    &loss.mul_scalar(1e-8),
                    AdamW {
                        eps: 1e-20,
                        weight_decay: 0.0,
                        ..AdamW::new(1e-2)
                    },
                    &StepOptions::default(),
                )
                .unwrap();
            g.output("loss", &loss);
            for (name, grad) in &step.grads {
                g.output(&format!("grad.{name}"), grad);
            }
            g.graph().unwrap()
        };
        let run = |autocast: Option<DType>, loss_scale: LossScale| {
            let opts = CompileOptions {
                autocast,
                loss_scale,
                ..CompileOptions::default()
            };
            let mut exe = rustytorch::compile_graph(&build(), device, &opts).unwrap();
            let mut losses = vec![];
            let mut first_grads = None;
            for i in 0..30 {
                let (x, y) = batch(0, DType::F32);
                let out = exe.run(&[("x", x), ("y", y)]).unwrap();
                assert!(out.skipped.is_none(), "{device}: step {i} skipped");
                losses.push(out.get("loss").unwrap().to_f64_vec()[0]);
                if i == 0 {
                    first_grads =
                        Some(["grad.w1", "grad.w2"].map(|n| out.get(n).unwrap().to_f64_vec()));
                }
            }
            (exe, losses, first_grads.unwrap())
        };
        let (_, f32_losses, f32_grads) = run(None, LossScale::Auto);
        let (off, off_losses, off_grads) = run(Some(DType::F16), LossScale::Off);
        let (on, on_losses, on_grads) = run(Some(DType::F16), LossScale::Auto);

        assert!(off.loss_scale().is_none());
        for (g, name) in off_grads.iter().zip(["w1", "w2"]) {
            assert!(
                g.iter().all(|&v| v == 0.0),
                "{device}: unscaled f16 gradient of {name} did not underflow"
            );
        }
        assert_eq!(
            off_losses[0], off_losses[29],
            "{device}: without scaling nothing should train"
        );

        let s = on.loss_scale().expect("f16 autocast scales by default");
        assert!(s.dynamic && s.scale == 65536.0 && s.skipped == 0, "{s:?}");
        for ((g, want), name) in on_grads.iter().zip(&f32_grads).zip(["w1", "w2"]) {
            let norm = want.iter().map(|v| v * v).sum::<f64>().sqrt();
            assert!(
                norm > 1e-9,
                "{device}: the f32 gradient of {name} is {norm}"
            );
            let err = g
                .iter()
                .zip(want)
                .map(|(a, b)| (a - b) * (a - b))
                .sum::<f64>()
                .sqrt();
            assert!(
                err < 2e-2 * norm,
                "{device}: scaled f16 gradient of {name} is off by {err} (norm {norm})"
            );
        }
        assert!(
            on_losses[29] < 0.5 * on_losses[0],
            "{device}: with scaling the loss went {} → {}",
            on_losses[0],
            on_losses[29]
        );
        assert!(
            (on_losses[29] - f32_losses[29]).abs() < 0.2 * f32_losses[29],
            "{device}: scaled f16 {} vs f32 {}",
            on_losses[29],
            f32_losses[29]
        );
    }
}

/// `Auto` is dynamic (PyTorch's defaults) under f16 autocast and off under bf16, without
/// autocast, and for an inference executable of the same graph.
#[test]
fn auto_scales_only_f16_training() {
    let _env = env_lock();
    let g = regression(DType::F32, Sgd::new(0.1).into(), None, None)
        .graph()
        .unwrap();
    let status = |autocast: Option<DType>, updates: bool| {
        let opts = CompileOptions {
            autocast,
            updates,
            ..CompileOptions::default()
        };
        rustytorch::compile_graph(&g, Device::Cpu, &opts)
            .unwrap()
            .loss_scale()
    };
    assert_eq!(
        status(Some(DType::F16), true),
        Some(LossScaleStatus {
            scale: 65536.0,
            dynamic: true,
            good_steps: 0,
            skipped: 0
        })
    );
    assert_eq!(status(Some(DType::F16), false), None);
    assert_eq!(status(Some(DType::BF16), true), None);
    assert_eq!(status(None, true), None);
}

#[test]
fn loss_scales_parse_from_text_and_the_environment() {
    let ok = [
        ("auto", LossScale::Auto),
        ("off", LossScale::Off),
        (" None ", LossScale::Off),
        ("128", LossScale::Static(128.0)),
        ("dynamic", LossScale::DYNAMIC),
        (
            "dynamic:init=1024, interval=10",
            LossScale::Dynamic {
                init: 1024.0,
                growth: 2.0,
                backoff: 0.5,
                interval: 10,
            },
        ),
        (
            "dynamic:growth=4,backoff=0.25",
            LossScale::Dynamic {
                init: 65536.0,
                growth: 4.0,
                backoff: 0.25,
                interval: 2000,
            },
        ),
    ];
    for (text, want) in ok {
        assert_eq!(text.parse::<LossScale>().unwrap(), want, "{text}");
    }
    let bad = [
        ("", "not a loss scale"),
        ("fast", "not a loss scale"),
        ("0", "finite and positive"),
        ("-4", "finite and positive"),
        ("inf", "finite and positive"),
        ("dynamic:init", "not key=value"),
        ("dynamic:speed=2", "unknown setting `speed`"),
        ("dynamic:interval=0", "interval must be at least 1"),
        ("dynamic:interval=1.5", "not a count"),
        ("dynamic:backoff=2", "backoff must be in (0, 1]"),
        ("dynamic:growth=0.5", "growth must be finite and at least 1"),
    ];
    for (text, want) in bad {
        let e = text.parse::<LossScale>().unwrap_err().to_string();
        assert!(e.contains(want), "`{text}`: {e}");
    }

    // Options are checked when compiled.
    let g = regression(DType::F32, Sgd::new(0.1).into(), None, None)
        .graph()
        .unwrap();
    let compile_with_scale = |loss_scale: LossScale| {
        let opts = CompileOptions {
            loss_scale,
            ..CompileOptions::default()
        };
        rustytorch::compile_graph(&g, Device::Cpu, &opts)
    };
    let e = compile_with_scale(LossScale::Static(f32::NAN))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("finite and positive"), "{e}");

    // The environment sets what `Auto` means; an explicit option wins over it.
    let _env = env_lock();
    std::env::set_var("RUSTYTORCH_LOSS_SCALE", "dynamic:init=256,interval=7");
    let from_env = compile_with_scale(LossScale::Auto).map(|e| e.loss_scale());
    let explicit = compile_with_scale(LossScale::Off).map(|e| e.loss_scale());
    std::env::set_var("RUSTYTORCH_LOSS_SCALE", "sometimes");
    let invalid = compile_with_scale(LossScale::Auto)
        .err()
        .map(|e| e.to_string());
    std::env::remove_var("RUSTYTORCH_LOSS_SCALE");
    let s = from_env.unwrap().unwrap();
    assert!(s.dynamic && s.scale == 256.0, "{s:?}");
    assert_eq!(explicit.unwrap(), None);
    let invalid = invalid.expect("an invalid RUSTYTORCH_LOSS_SCALE fails the compile");
    assert!(
        invalid.contains("RUSTYTORCH_LOSS_SCALE") && invalid.contains("sometimes"),
        "{invalid}"
    );
}

/// Updates written by hand have no loss to scale: asking for a scale is an error that says so;
/// the default quietly trains without one.
#[test]
fn a_scale_needs_a_training_step() {
    let _env = env_lock();
    let g = GraphBuilder::new();
    let w = g.param("w", [3], Init::Full(1.0));
    let x = g.input("x", DType::F32, [3]);
    g.update(&w, &w.add(&x));
    g.output("w", &w);
    let graph = g.graph().unwrap();
    let opts = |loss_scale, autocast| CompileOptions {
        loss_scale,
        autocast,
        ..CompileOptions::default()
    };
    let e = rustytorch::compile_graph(&graph, Device::Cpu, &opts(DYNAMIC, None))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("train_step"), "{e}");
    let exe = rustytorch::compile_graph(
        &graph,
        Device::Cpu,
        &opts(LossScale::Auto, Some(DType::F16)),
    )
    .unwrap();
    assert!(exe.loss_scale().is_none());
}

/// The CUDA kernels of a dynamically scaled f16-autocast training step (the scale's cast and
/// reciprocal, the unscaled gradients, the i64 counter and the scale's growth) compile with NVRTC
/// for sm_90, on a machine without a GPU. Skipped where NVRTC is absent, unless
/// `RUSTYTORCH_TEST_NVRTC=1`.
#[test]
fn the_scaled_step_compiles_for_cuda() {
    use rustytorch::codegen::cuda::{lower_step, source};
    use rustytorch::runtime::cuda::compile::KernelCompiler;
    let compiler = match KernelCompiler::with_dir((9, 0), None) {
        Ok(c) => c,
        Err(e) if std::env::var("RUSTYTORCH_TEST_NVRTC").as_deref() == Ok("1") => {
            panic!("RUSTYTORCH_TEST_NVRTC=1 but NVRTC is unavailable: {e}")
        }
        Err(e) => {
            eprintln!("skipped: {e}");
            return;
        }
    };
    let g = regression(DType::F32, AdamW::new(1e-3).into(), Some(1.0), None)
        .graph()
        .unwrap();
    let opts = CompileOptions {
        autocast: Some(DType::F16),
        loss_scale: DYNAMIC,
        ..CompileOptions::default()
    };
    let exe = rustytorch::compile_graph(&g, Device::Cpu, &opts).unwrap();
    let plan = exe.plan();
    let mut sources = vec![];
    for step in &plan.steps {
        let ins: Vec<&TensorType> = step.inputs.iter().map(|&v| &plan.types[v]).collect();
        let lowered = lower_step(&step.op, &ins, &plan.types[step.output])
            .unwrap_or_else(|e| panic!("{}: {e}", step.op.name()));
        for l in lowered.launches() {
            sources.push((l.kernel.name.clone(), source(&l.kernel).unwrap()));
        }
    }
    sources.sort();
    sources.dedup();
    assert!(sources.len() > 3, "{} kernels", sources.len());
    compiler.cubins(&sources).unwrap();
}

/// A graph exported from a loss-scaled executable and saved to a graph file keeps its scale and
/// counters, and training it again continues the scaling (whatever the options ask); an
/// inference executable of it has no loss scale.
#[test]
fn an_exported_graph_keeps_its_scaling() {
    use rustytorch::compiler::format::{self, ParamStorage};
    let _env = env_lock();
    let g = regression(DType::F32, AdamW::new(1e-2).into(), None, None);
    let mut exe = compile_step(&g, Device::Cpu, DYNAMIC);
    exe.run(&maybe_overflowing(0, false)).unwrap();
    exe.run(&maybe_overflowing(1, true)).unwrap();
    exe.run(&maybe_overflowing(2, false)).unwrap();
    assert_eq!(status(&exe), (512.0, 1, 1));
    let dir = std::env::temp_dir().join(format!("rustytorch-loss-export-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("scaled.rtg");
    format::save(&exe.export_graph().unwrap(), &path, ParamStorage::Embedded).unwrap();
    let loaded = format::load(&path).unwrap();
    std::fs::remove_dir_all(&dir).ok();

    let mut again =
        rustytorch::compile_graph(&loaded, Device::Cpu, &CompileOptions::default()).unwrap();
    assert_eq!(status(&again), (512.0, 1, 1));
    for i in 3..5 {
        let a = again.run(&maybe_overflowing(i, false)).unwrap();
        let b = exe.run(&maybe_overflowing(i, false)).unwrap();
        assert_eq!(
            a.get("loss").unwrap().to_f64_vec(),
            b.get("loss").unwrap().to_f64_vec()
        );
    }
    assert_eq!(status(&again), (1024.0, 0, 1));
    assert_eq!(params(&again), params(&exe));
    let inference =
        rustytorch::compile_graph(&loaded, Device::Cpu, &CompileOptions::inference()).unwrap();
    assert!(inference.loss_scale().is_none());
}
