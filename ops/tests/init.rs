//! Leaf ops: `Full`, `Iota`, seeded `RandUniform` / `RandNormal`, and the runtime-supplied leaves.

use rustytorch_ops::testing::{assert_close, vjp_eager};
use rustytorch_ops::{eval_cpu, infer, rng, DType, F64Bits, HostTensor, Op, Shape, TensorType};

fn ty(d: DType, dims: &[usize]) -> TensorType {
    TensorType::new(d, Shape::new(dims))
}

fn full(v: f64, t: TensorType) -> Op {
    Op::Full {
        value: F64Bits::new(v),
        ty: t,
    }
}

fn uniform(lo: f64, hi: f64, seed: u64, t: TensorType) -> Op {
    Op::RandUniform {
        low: F64Bits::new(lo),
        high: F64Bits::new(hi),
        seed,
        ty: t,
    }
}

fn normal(mean: f64, std: f64, seed: u64, t: TensorType) -> Op {
    Op::RandNormal {
        mean: F64Bits::new(mean),
        std: F64Bits::new(std),
        seed,
        ty: t,
    }
}

#[test]
fn full_converts_with_as_semantics() {
    let cases: [(f64, DType, f64); 9] = [
        (2.5, DType::F32, 2.5),
        (2.7, DType::I32, 2.0),
        (-2.7, DType::I64, -2.0),
        (300.0, DType::U8, 255.0),
        (-5.0, DType::U8, 0.0),
        (0.5, DType::Bool, 1.0),
        (0.0, DType::Bool, 0.0),
        (0.1, DType::F64, 0.1),
        (f64::NAN, DType::I32, 0.0),
    ];
    for (v, d, want) in cases {
        let t = eval_cpu(&full(v, ty(d, &[2, 3])), &[]).unwrap();
        assert_eq!(t.ty(), ty(d, &[2, 3]));
        assert_eq!(t.to_f64_vec(), vec![want; 6], "full({v}) as {d}");
    }
    let h = eval_cpu(&full(0.1, ty(DType::F16, &[])), &[]).unwrap();
    assert_eq!(
        h.to_f64_vec(),
        vec![rustytorch_ops::f16::from_f64(0.1).to_f64()]
    );
    let b = eval_cpu(&full(0.1, ty(DType::BF16, &[4])), &[]).unwrap();
    assert_eq!(
        b.to_f64_vec(),
        vec![rustytorch_ops::bf16::from_f64(0.1).to_f64(); 4]
    );
    // A large fill.
    let big = eval_cpu(&full(-1.5, ty(DType::F32, &[300, 300])), &[]).unwrap();
    assert!(big.to_vec::<f32>().unwrap().iter().all(|&v| v == -1.5));
}

#[test]
fn iota_counts_along_its_axis() {
    let dims = [2usize, 3, 4];
    for d in [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I32,
        DType::I64,
        DType::U8,
    ] {
        for axis in 0..3 {
            let t = eval_cpu(
                &Op::Iota {
                    axis,
                    ty: ty(d, &dims),
                },
                &[],
            )
            .unwrap();
            assert_eq!(t.ty(), ty(d, &dims));
            let mut want = Vec::new();
            for i in 0..2 {
                for j in 0..3 {
                    for k in 0..4 {
                        want.push([i, j, k][axis] as f64);
                    }
                }
            }
            assert_eq!(t.to_f64_vec(), want, "iota axis {axis} {d}");
        }
    }
    // Large, parallel path.
    let t = eval_cpu(
        &Op::Iota {
            axis: 1,
            ty: ty(DType::I64, &[3, 40_000]),
        },
        &[],
    )
    .unwrap();
    let v = t.to_vec::<i64>().unwrap();
    assert!(v.iter().enumerate().all(|(i, &x)| x == (i % 40_000) as i64));
}

#[test]
fn iota_validation() {
    let e = infer(
        &Op::Iota {
            axis: 3,
            ty: ty(DType::I32, &[2, 3, 4]),
        },
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("iota") && e.contains("axis 3"), "{e}");
    let e = infer(
        &Op::Iota {
            axis: 0,
            ty: ty(DType::Bool, &[2]),
        },
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("iota") && e.contains("bool[2]"), "{e}");
    let e = infer(
        &Op::Iota {
            axis: 0,
            ty: ty(DType::I32, &[]),
        },
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("iota"), "{e}");
}

#[test]
fn rand_uniform_range_mean_and_determinism() {
    let n = 100_000;
    for d in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        let op = uniform(-2.0, 3.0, 42, ty(d, &[n]));
        let t = eval_cpu(&op, &[]).unwrap();
        assert_eq!(t.ty(), ty(d, &[n]));
        let v = t.to_f64_vec();
        assert!(
            v.iter().all(|&x| (-2.0..=3.0).contains(&x)),
            "{d}: out of range"
        );
        if d == DType::F32 || d == DType::F64 {
            assert!(v.iter().all(|&x| x < 3.0), "{d}: reached high");
        }
        let mean = v.iter().sum::<f64>() / n as f64;
        assert!((mean - 0.5).abs() < 0.03, "{d}: mean {mean}");
        // Same seed, same values; a different seed, different values.
        assert_eq!(eval_cpu(&op, &[]).unwrap(), t);
        let other = eval_cpu(&uniform(-2.0, 3.0, 43, ty(d, &[n])), &[])
            .unwrap()
            .to_f64_vec();
        let same = v.iter().zip(&other).filter(|(a, b)| a == b).count();
        assert!(same < n / 50, "{d}: {same} equal values across seeds");
    }
    // Element i is low + (high - low)·u(seed, i), rounded once: independent of the shape.
    let t = eval_cpu(&uniform(1.0, 2.0, 7, ty(DType::F32, &[5, 7])), &[]).unwrap();
    let want: Vec<f64> = (0..35)
        .map(|i| (1.0 + rng::uniform01(7, i)) as f32 as f64)
        .collect();
    assert_eq!(t.to_f64_vec(), want);
    let small = eval_cpu(&uniform(1.0, 2.0, 7, ty(DType::F32, &[10])), &[])
        .unwrap()
        .to_f64_vec();
    assert_eq!(&small[..], &want[..10]);
}

#[test]
fn rand_normal_mean_and_std() {
    let n = 200_000;
    for d in [DType::F32, DType::F64, DType::BF16] {
        let op = normal(1.5, 2.0, 9, ty(d, &[n]));
        let v = eval_cpu(&op, &[]).unwrap().to_f64_vec();
        let mean = v.iter().sum::<f64>() / n as f64;
        let var = v.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n as f64;
        assert!((mean - 1.5).abs() < 0.03, "{d}: mean {mean}");
        assert!((var.sqrt() - 2.0).abs() < 0.03, "{d}: std {}", var.sqrt());
        assert_eq!(eval_cpu(&op, &[]).unwrap().to_f64_vec(), v);
        let other = eval_cpu(&normal(1.5, 2.0, 10, ty(d, &[n])), &[])
            .unwrap()
            .to_f64_vec();
        assert_ne!(other, v);
    }
    let t = eval_cpu(&normal(0.0, 1.0, 3, ty(DType::F64, &[4])), &[]).unwrap();
    let want: Vec<f64> = (0..4).map(|i| rng::normal(3, i)).collect();
    assert_close(&t.to_f64_vec(), &want, 0.0, "normal values");
}

#[test]
fn random_tensors_need_float_dtypes() {
    for d in [DType::I32, DType::I64, DType::U8, DType::Bool] {
        let e = infer(&uniform(0.0, 1.0, 1, ty(d, &[3])), &[])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("rand_uniform") && e.contains(&format!("{d}[3]")),
            "{e}"
        );
        let e = infer(&normal(0.0, 1.0, 1, ty(d, &[3])), &[])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("rand_normal") && e.contains(&format!("{d}[3]")),
            "{e}"
        );
    }
}

#[test]
fn runtime_supplied_leaves() {
    let t = ty(DType::F32, &[2, 2]);
    for op in [
        Op::Input {
            index: 0,
            ty: t.clone(),
        },
        Op::Param {
            index: 1,
            ty: t.clone(),
        },
        Op::Constant {
            index: 2,
            ty: t.clone(),
        },
    ] {
        assert_eq!(infer(&op, &[]).unwrap(), t);
        let e = eval_cpu(&op, &[]).unwrap_err().to_string();
        assert!(e.contains(op.name()) && e.contains("runtime"), "{e}");
    }
    // Leaves take no inputs, and have no input gradients.
    let x = HostTensor::from_vec(vec![1.0f32; 4], [2, 2]).unwrap();
    let e = infer(&full(1.0, t.clone()), &[&t]).unwrap_err().to_string();
    assert!(e.contains("full") && e.contains("expected 0"), "{e}");
    assert_eq!(vjp_eager(&full(1.0, t.clone()), &[], &x).unwrap(), vec![]);
}
