//! Device discovery: without a GPU the probe is an error, never a crash; with
//! `RUSTYTORCH_TEST_CUDA=1` (the GPU machine) at least one device must be found.

use rustytorch_runtime::{cuda_device_count, Device};

#[test]
fn cuda_probe_reports_instead_of_crashing() {
    let r = cuda_device_count();
    if std::env::var("RUSTYTORCH_TEST_CUDA").as_deref() == Ok("1") {
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
    assert_eq!(Device::parse("tpu"), None);
    assert_eq!(Device::Cuda(1).to_string(), "cuda:1");
}
