//! Collectives through NCCL against host-computed results: all-reduce (sum, mean, max, min),
//! broadcast, reduce-scatter and all-gather over every CUDA device of the machine (two on the
//! two-GPU machine), several sizes, f32/bf16/f64/i32. Where `RUSTYTORCH_TEST_CUDA=1`; elsewhere
//! the checks that need no GPU (bad arguments, the unique id's text form, a clear error without
//! CUDA).

use rustytorch::ops::testing::{assert_close, rand_tensor};
use rustytorch::prelude::*;
use rustytorch::runtime::cuda::{Collective, DeviceTensor, ReduceOp, UniqueId};

fn cuda() -> bool {
    std::env::var("RUSTYTORCH_TEST_CUDA").as_deref() == Ok("1")
}

#[test]
fn bad_arguments_are_clear_errors() {
    let e = Collective::new(&[]).unwrap_err().to_string();
    assert!(e.contains("at least one device"), "{e}");
    let e = Collective::new(&[0, 0]).unwrap_err().to_string();
    assert!(e.contains("must differ"), "{e}");
    if !cuda() {
        // No GPU here: opening a device is an error that says so, never a crash.
        let e = Collective::new(&[0, 1]).unwrap_err().to_string();
        assert!(
            e.to_lowercase().contains("cuda") || e.contains("device"),
            "{e}"
        );
    }
    let hex: String = (0..128).map(|i| format!("{:02x}", (i * 7) % 256)).collect();
    assert_eq!(UniqueId::from_hex(&hex).unwrap().to_hex(), hex);
    for bad in ["", "zz", &hex[..254], &format!("{}xx", &hex[..254])] {
        assert!(UniqueId::from_hex(bad).is_err(), "{bad}");
    }
}

fn devices() -> Vec<usize> {
    let n = rustytorch::runtime::cuda_device_count().unwrap();
    (0..n).collect()
}

/// The host reduction of `xs` (one tensor per rank) with `op`.
fn host_reduce(xs: &[HostTensor], op: ReduceOp) -> Vec<f64> {
    let vs: Vec<Vec<f64>> = xs.iter().map(|t| t.to_f64_vec()).collect();
    (0..vs[0].len())
        .map(|i| {
            let col = vs.iter().map(|v| v[i]);
            match op {
                ReduceOp::Sum => col.sum(),
                ReduceOp::Mean => col.sum::<f64>() / vs.len() as f64,
                ReduceOp::Max => col.fold(f64::NEG_INFINITY, f64::max),
                ReduceOp::Min => col.fold(f64::INFINITY, f64::min),
                ReduceOp::Prod => col.product(),
            }
        })
        .collect()
}

fn tol(d: DType) -> f64 {
    match d {
        DType::BF16 => 2e-2,
        DType::F32 => 1e-6,
        _ => 1e-12,
    }
}

#[test]
fn collectives_match_the_host() {
    if !cuda() {
        return;
    }
    let devs = devices();
    let world = devs.len();
    let coll = Collective::new(&devs).unwrap();
    assert_eq!(coll.world_size(), world);
    let mut seed = 1;
    for dtype in [DType::F32, DType::BF16, DType::F64, DType::I32] {
        for n in [1usize, 1000, (1 << 20) + 3] {
            let (lo, hi) = if dtype == DType::I32 {
                (-100.0, 100.0)
            } else {
                (-1.0, 1.0)
            };
            let xs: Vec<HostTensor> = (0..world)
                .map(|r| rand_tensor(&TensorType::new(dtype, [n]), seed + r as u64, lo, hi))
                .collect();
            seed += 10;
            let up = |xs: &[HostTensor]| -> Vec<DeviceTensor> {
                xs.iter()
                    .zip(&devs)
                    .map(|(x, &d)| DeviceTensor::upload(d, x).unwrap())
                    .collect()
            };
            let ops: &[ReduceOp] = if dtype == DType::I32 {
                &[ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min]
            } else {
                &[ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min]
            };
            for &op in ops {
                let mut bufs = up(&xs);
                coll.all_reduce(&mut bufs, op).unwrap();
                let want = host_reduce(&xs, op);
                for b in &bufs {
                    let what = format!("all_reduce {op:?} {dtype} n {n} on cuda:{}", b.device());
                    assert_close(&b.to_host().unwrap().to_f64_vec(), &want, tol(dtype), &what);
                }
            }
            let root = world - 1;
            let mut bufs = up(&xs);
            coll.broadcast(&mut bufs, root).unwrap();
            for b in &bufs {
                assert_eq!(
                    b.to_host().unwrap().to_f64_vec(),
                    xs[root].to_f64_vec(),
                    "broadcast {dtype} n {n}"
                );
            }
            // Reduce-scatter of world·n elements, then all-gather back.
            let big: Vec<HostTensor> = (0..world)
                .map(|r| {
                    rand_tensor(
                        &TensorType::new(dtype, [world * n]),
                        seed + r as u64,
                        lo,
                        hi,
                    )
                })
                .collect();
            let send = up(&big);
            let mut recv: Vec<DeviceTensor> = devs
                .iter()
                .map(|&d| DeviceTensor::empty(d, TensorType::new(dtype, [n])).unwrap())
                .collect();
            coll.reduce_scatter(&send, &mut recv, ReduceOp::Sum)
                .unwrap();
            let want = host_reduce(&big, ReduceOp::Sum);
            for (r, b) in recv.iter().enumerate() {
                let what = format!("reduce_scatter {dtype} n {n} rank {r}");
                assert_close(
                    &b.to_host().unwrap().to_f64_vec(),
                    &want[r * n..(r + 1) * n],
                    tol(dtype),
                    &what,
                );
            }
            let mut gathered: Vec<DeviceTensor> = devs
                .iter()
                .map(|&d| DeviceTensor::empty(d, TensorType::new(dtype, [world * n])).unwrap())
                .collect();
            coll.all_gather(&up(&xs), &mut gathered).unwrap();
            let want: Vec<f64> = xs.iter().flat_map(|t| t.to_f64_vec()).collect();
            for g in &gathered {
                assert_eq!(
                    g.to_host().unwrap().to_f64_vec(),
                    want,
                    "all_gather {dtype} n {n}"
                );
            }
        }
    }
    // Mismatched types are errors naming both.
    let a =
        DeviceTensor::upload(devs[0], &HostTensor::from_vec(vec![1f32; 4], [4]).unwrap()).unwrap();
    if world > 1 {
        let b = DeviceTensor::upload(devs[1], &HostTensor::from_vec(vec![1f32; 5], [5]).unwrap())
            .unwrap();
        let mut v = vec![a, b];
        let e = coll
            .all_reduce(&mut v, ReduceOp::Sum)
            .unwrap_err()
            .to_string();
        assert!(e.contains("shape"), "{e}");
    }
}

/// The multi-process form, one rank per thread: every rank joins through the same unique id
/// (passed as its hex text, as processes would share it) and all-reduces its own tensor.
#[test]
fn ranks_joined_through_a_unique_id_all_reduce() {
    if !cuda() {
        return;
    }
    let devs = devices();
    let world = devs.len();
    let id = UniqueId::new().unwrap().to_hex();
    let xs: Vec<HostTensor> = (0..world)
        .map(|r| {
            rand_tensor(
                &TensorType::new(DType::F32, [4099]),
                50 + r as u64,
                -1.0,
                1.0,
            )
        })
        .collect();
    let want = host_reduce(&xs, ReduceOp::Mean);
    std::thread::scope(|s| {
        let handles: Vec<_> = devs
            .iter()
            .map(|&d| {
                let (id, x) = (id.clone(), xs[d].clone());
                s.spawn(move || {
                    let id = UniqueId::from_hex(&id).unwrap();
                    let coll = Collective::from_rank(d, d, world, &id).unwrap();
                    let mut buf = vec![DeviceTensor::upload(d, &x).unwrap()];
                    coll.all_reduce(&mut buf, ReduceOp::Mean).unwrap();
                    buf[0].to_host().unwrap().to_f64_vec()
                })
            })
            .collect();
        for h in handles {
            assert_close(&h.join().unwrap(), &want, 1e-6, "rank all_reduce");
        }
    });
}
