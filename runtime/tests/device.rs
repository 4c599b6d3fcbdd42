//! Devices and sessions: without a GPU the probe is an error, never a crash; with
//! `RUSTYTORCH_TEST_CUDA=1` (the GPU machine) at least one device must be found and every session
//! test runs on it too. A session commits a step's updates only when every guard passed, and its
//! parameters are read and written with their types checked.

use rustytorch_codegen::{lower, Plan};
use rustytorch_compiler::{passes, Graph, GraphBuilder, Init, Sgd, StepOptions};
use rustytorch_ops::{DType, HostTensor};
use rustytorch_runtime::device::test_devices;
use rustytorch_runtime::{cuda_device_count, Device, Session};
use std::sync::Arc;

fn gpu_required() -> bool {
    std::env::var("RUSTYTORCH_TEST_CUDA").as_deref() == Ok("1")
}

#[test]
fn cuda_probe_reports_instead_of_crashing() {
    let r = cuda_device_count();
    if gpu_required() {
        let n = r.expect("a CUDA device is required when RUSTYTORCH_TEST_CUDA=1");
        assert!(n >= 1, "the driver reports no devices");
        println!("CUDA devices: {n}");
    } else if let Err(e) = r {
        assert!(e.to_string().starts_with("device: "), "{e}");
    }
}

#[test]
fn device_names_parse() {
    assert_eq!(Device::parse("cpu"), Some(Device::Cpu));
    assert_eq!(Device::parse("cuda"), Some(Device::Cuda(0)));
    assert_eq!(Device::parse("cuda:3"), Some(Device::Cuda(3)));
    assert_eq!(Device::parse("auto"), Some(Device::Auto));
    assert_eq!(Device::parse("tpu"), None);
    assert_eq!(Device::parse("cuda:x"), None);
    assert_eq!(Device::Cuda(1).to_string(), "cuda:1");
    assert_eq!(Device::Auto.to_string(), "auto");
    for d in [Device::Cpu, Device::Cuda(2), Device::Auto] {
        assert_eq!(Device::parse(&d.to_string()), Some(d));
    }
}

#[test]
fn test_devices_follow_the_environment() {
    let d = test_devices();
    assert_eq!(d[0], Device::Cpu);
    assert_eq!(d.contains(&Device::Cuda(0)), gpu_required());
}

#[test]
fn best_and_backends() {
    let best = Device::best();
    assert_ne!(best, Device::Auto);
    if gpu_required() {
        assert_eq!(best, Device::Cuda(0));
    }
    assert_eq!(Device::Cpu.backend().unwrap().name(), "cpu");
    let e = Device::Auto.backend().err().expect("auto has no backend");
    assert!(e.to_string().contains("auto"), "{e}");
    // Without a driver, opening a CUDA device is an error naming it, never a crash.
    if cuda_device_count().is_err() {
        let e = Device::Cuda(0)
            .backend()
            .err()
            .expect("no driver, no backend");
        let msg = e.to_string();
        assert!(
            msg.starts_with("device: ") && msg.contains("cuda:0"),
            "{msg}"
        );
    }
}

/// A training graph: `loss = sum(x·good) + sum(sqrt(bad))` under SGD(0.1). With `bad` negative
/// its gradient is NaN and the finiteness guard fails; without `bad` every guard passes.
fn train_graph(with_bad: bool) -> Graph {
    let g = GraphBuilder::new();
    let x = g.input("x", DType::F32, [3]);
    let good = g.param("good", [3], Init::Full(0.5));
    let mut loss = x.mul(&good).sum_all();
    if with_bad {
        let bad = g.param("bad", [3], Init::Full(-1.0));
        loss = loss.add(&bad.sqrt().sum_all());
    }
    g.train_step(&loss, Sgd::new(0.1), &StepOptions::default())
        .unwrap();
    g.output("loss", &loss);
    g.graph().unwrap()
}

/// Compiles and lowers `graph`, prepares it on `device`; returns the session, the plan and the
/// graph's parameter names (in plan order) with their initial values.
fn session(
    graph: &Graph,
    device: Device,
) -> (Box<dyn Session>, Arc<Plan>, Vec<(String, HostTensor)>) {
    let compiled = passes::run(graph, &passes::Options::default()).unwrap();
    let memory = compiled.report.memory.as_ref().unwrap();
    let plan = Arc::new(lower(&compiled.graph, memory).unwrap());
    let init: Vec<(String, HostTensor)> = compiled
        .graph
        .params
        .iter()
        .map(|p| (p.name.clone(), p.init.materialize(&p.ty).unwrap()))
        .collect();
    let params = init.iter().map(|(_, t)| Arc::new(t.clone())).collect();
    let s = device
        .backend()
        .unwrap_or_else(|e| panic!("{device}: {e}"))
        .prepare(plan.clone(), params)
        .unwrap_or_else(|e| panic!("{device}: {e}"));
    assert_eq!(s.device(), device);
    (s, plan, init)
}

fn x() -> Arc<HostTensor> {
    Arc::new(HostTensor::from_vec(vec![1.0f32, 2.0, 3.0], [3]).unwrap())
}

#[test]
fn a_failed_guard_commits_nothing() {
    for device in test_devices() {
        let (mut s, _, init) = session(&train_graph(true), device);
        let r = s.run(&[x()]).unwrap();
        assert!(!r.committed, "{device}: committed with a NaN gradient");
        let failed: Vec<&str> = r
            .guards
            .iter()
            .filter(|(_, ok)| !ok)
            .map(|(n, _)| n.as_str())
            .collect();
        assert_eq!(failed, ["grad:bad"], "{device}: {:?}", r.guards);
        assert_eq!(r.outputs.len(), 1);
        for (i, (name, v)) in init.iter().enumerate() {
            let now = s.read_param(i).unwrap();
            assert_eq!(now.ty(), v.ty(), "{device}: {name}");
            assert_eq!(now.to_f64_vec(), v.to_f64_vec(), "{device}: {name} changed");
        }
    }
}

#[test]
fn passing_guards_commit_the_updates() {
    for device in test_devices() {
        let (mut s, _, init) = session(&train_graph(false), device);
        let good = init.iter().position(|(n, _)| n == "good").unwrap();
        let r = s.run(&[x()]).unwrap();
        assert!(r.committed, "{device}: {:?}", r.guards);
        assert!(r.guards.iter().all(|(_, ok)| *ok));
        // d loss / d good = x: good ← 0.5 - 0.1·x.
        let got = s.read_param(good).unwrap().to_vec::<f32>().unwrap();
        for (g, want) in got.iter().zip([0.4f32, 0.3, 0.2]) {
            assert!((g - want).abs() < 1e-6, "{device}: {got:?}");
        }
        assert_eq!(s.transfers() == Default::default(), device == Device::Cpu);
        assert_eq!(s.memory_stats().is_none(), device == Device::Cpu);
    }
}

#[test]
fn params_are_written_with_their_types_checked() {
    for device in test_devices() {
        let (mut s, _, init) = session(&train_graph(false), device);
        let good = init.iter().position(|(n, _)| n == "good").unwrap();
        let v = HostTensor::from_vec(vec![7.0f32, 8.0, 9.0], [3]).unwrap();
        s.write_param(good, &v).unwrap();
        assert_eq!(s.read_param(good).unwrap().to_f64_vec(), [7.0, 8.0, 9.0]);
        // Wrong shape, wrong dtype, no such parameter: errors, and nothing changes.
        let e = s
            .write_param(good, &HostTensor::from_vec(vec![1.0f32; 4], [4]).unwrap())
            .unwrap_err();
        assert!(e.to_string().contains("f32[3]"), "{device}: {e}");
        assert!(s
            .write_param(good, &HostTensor::from_vec(vec![1.0f64; 3], [3]).unwrap())
            .is_err());
        assert!(s.write_param(init.len(), &v).is_err());
        assert!(s.read_param(init.len()).is_err());
        assert_eq!(s.read_param(good).unwrap().to_f64_vec(), [7.0, 8.0, 9.0]);
        // The next step starts from the written value.
        s.run(&[x()]).unwrap();
        let got = s.read_param(good).unwrap().to_vec::<f32>().unwrap();
        for (g, want) in got.iter().zip([6.9f32, 7.8, 8.7]) {
            assert!((g - want).abs() < 1e-5, "{device}: {got:?}");
        }
    }
}

#[test]
fn prepare_checks_the_parameters() {
    let graph = train_graph(false);
    let compiled = passes::run(&graph, &passes::Options::default()).unwrap();
    let plan = Arc::new(lower(&compiled.graph, compiled.report.memory.as_ref().unwrap()).unwrap());
    let backend = Device::Cpu.backend().unwrap();
    assert!(backend.prepare(plan.clone(), vec![]).is_err());
    let wrong: Vec<Arc<HostTensor>> = (0..plan.param_types.len())
        .map(|_| Arc::new(HostTensor::from_vec(vec![0.0f32; 2], [2]).unwrap()))
        .collect();
    assert!(backend.prepare(plan, wrong).is_err());
}
