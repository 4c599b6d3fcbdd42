//! The CUDA pooling kernels against the CPU kernels through the IR interpreter: max and both
//! averages, forward and backward, 1-D to 3-D, padding, windows that overlap (stride < window) and
//! that skip inputs (stride > window), every float dtype, NaN inputs, and max-pool ties (the
//! gradient goes to the first maximum, as on the CPU).

use rustytorch_codegen::cuda::{self, interp, CudaStep};
use rustytorch_ops::testing::rand_tensor;
use rustytorch_ops::{eval_cpu, infer, ConvGeom, DType, HostTensor, Layout, Op, PoolKind};

mod common;
use common::{check, ty};

const KINDS: [PoolKind; 3] = [
    PoolKind::Max,
    PoolKind::Avg {
        count_include_pad: true,
    },
    PoolKind::Avg {
        count_include_pad: false,
    },
];

fn ops(kind: PoolKind, window: &[usize], stride: usize, pad: usize) -> (Op, Op) {
    ops_in(kind, window, stride, pad, Layout::ChannelsFirst)
}

fn ops_in(kind: PoolKind, window: &[usize], stride: usize, pad: usize, l: Layout) -> (Op, Op) {
    let n = window.len();
    let geom = ConvGeom::new(vec![stride; n], vec![pad; n], vec![1; n]).with_layout(l);
    (
        Op::Pool {
            kind,
            kernel: window.to_vec(),
            geom: geom.clone(),
        },
        Op::PoolGrad {
            kind,
            kernel: window.to_vec(),
            geom,
        },
    )
}

#[test]
fn pooling_matches_the_cpu() {
    // (x, window, stride, padding)
    // The later cases have rows long enough for the row-vectorized forward kernel (a thread per
    // 16 bytes of outputs) in some or all dtypes.
    let cases: [(&[usize], &[usize], usize, usize); 12] = [
        (&[2, 3, 11], &[3], 2, 1),
        (&[1, 2, 9, 7], &[3, 3], 2, 1),
        (&[2, 1, 8, 8], &[2, 2], 2, 0),
        (&[1, 2, 10, 9], &[2, 3], 4, 1),
        (&[1, 2, 5, 6, 7], &[3, 2, 3], 2, 1),
        (&[1, 1, 6, 6], &[3, 3], 1, 1),
        (&[2, 3, 7, 32], &[3, 3], 2, 1),
        (&[1, 2, 4, 16], &[2, 2], 2, 0),
        (&[2, 3, 64], &[3], 2, 1),
        (&[1, 2, 5, 6, 16], &[3, 2, 3], 2, 1),
        (&[1, 2, 5, 16], &[3, 3], 1, 1),
        (&[1, 1, 4, 32], &[2, 2], 4, 0),
    ];
    for (c, &(xd, window, stride, pad)) in cases.iter().enumerate() {
        for kind in KINDS {
            for dt in [DType::F32, DType::F64, DType::F16, DType::BF16] {
                let (fwd, bwd) = ops(kind, window, stride, pad);
                let x = rand_tensor(&ty(dt, xd), 7 * c as u64, -2.0, 2.0);
                let what = format!("{kind:?} {xd:?} window {window:?} {dt:?}");
                check(&fwd, &[&x], &what);
                let y = infer(&fwd, &[&x.ty()]).unwrap();
                let g = rand_tensor(&y, 7 * c as u64 + 1, -1.0, 1.0);
                check(&bwd, &[&x, &g], &format!("{what} grad"));
            }
        }
    }
}

#[test]
fn channels_last_pooling_matches_the_cpu() {
    // ([N, *spatial, C], window, stride, padding): channel counts that fill 16-byte vectors in
    // every dtype (a thread per vector of channels) and odd ones (a thread per element).
    let cases: [(&[usize], &[usize], usize, usize); 5] = [
        (&[2, 9, 7, 16], &[3, 3], 2, 1),
        (&[1, 8, 8, 3], &[2, 2], 2, 0),
        (&[2, 11, 8], &[3], 2, 1),
        (&[1, 5, 6, 7, 8], &[3, 2, 3], 2, 1),
        (&[1, 6, 5, 5], &[3, 3], 1, 1),
    ];
    for (c, &(xd, window, stride, pad)) in cases.iter().enumerate() {
        for kind in KINDS {
            for dt in [DType::F32, DType::F64, DType::F16, DType::BF16] {
                let (fwd, bwd) = ops_in(kind, window, stride, pad, Layout::ChannelsLast);
                let x = rand_tensor(&ty(dt, xd), 11 * c as u64, -2.0, 2.0);
                let what = format!("channels-last {kind:?} {xd:?} window {window:?} {dt:?}");
                check(&fwd, &[&x], &what);
                let y = infer(&fwd, &[&x.ty()]).unwrap();
                let g = rand_tensor(&y, 11 * c as u64 + 1, -1.0, 1.0);
                check(&bwd, &[&x, &g], &format!("{what} grad"));
            }
        }
    }
    let (fwd, _) = ops_in(PoolKind::Max, &[3, 3], 2, 1, Layout::ChannelsLast);
    let xt = ty(DType::F16, &[2, 9, 7, 16]);
    let y = infer(&fwd, &[&xt]).unwrap();
    match cuda::lower_step(&fwd, &[&xt], &y).unwrap() {
        CudaStep::Kernels(k) => assert!(k.launches[0].kernel.name.starts_with("pool_channels")),
        other => panic!("{other:?}"),
    }
}

/// Which forward kernel a pooling op lowers to.
fn forward_kernel(x: &[usize], window: &[usize], stride: usize, pad: usize, dt: DType) -> String {
    let (fwd, _) = ops(PoolKind::Max, window, stride, pad);
    let xt = ty(dt, x);
    let y = infer(&fwd, &[&xt]).unwrap();
    match cuda::lower_step(&fwd, &[&xt], &y).unwrap() {
        CudaStep::Kernels(k) => k.launches[0].kernel.name.clone(),
        other => panic!("{other:?}"),
    }
}

#[test]
fn long_rows_take_the_vectorized_forward() {
    // Rows of 16-byte multiples in and out: a thread per vector of outputs.
    assert!(forward_kernel(&[2, 3, 7, 32], &[3, 3], 2, 1, DType::F16).starts_with("pool_rows"));
    assert!(forward_kernel(&[2, 3, 64], &[3], 2, 1, DType::F32).starts_with("pool_rows"));
    assert!(forward_kernel(&[1, 1, 4, 32], &[2, 2], 4, 0, DType::BF16).starts_with("pool_rows"));
    // An output row of 9 halves (not a multiple of 8), or 7 floats: the generic kernel.
    assert!(!forward_kernel(&[1, 2, 10, 18], &[2, 2], 2, 0, DType::F16).starts_with("pool_rows"));
    assert!(!forward_kernel(&[1, 2, 9, 7], &[3, 3], 2, 1, DType::F32).starts_with("pool_rows"));
}

#[test]
fn max_pool_ties_and_nan_follow_the_cpu() {
    // Many equal values (ties: the first maximum takes the gradient) and a NaN (it wins).
    let mut v: Vec<f32> = (0..2 * 36).map(|i| (i % 3) as f32).collect();
    v[14] = f32::NAN;
    let x = HostTensor::from_vec(v, [1, 2, 6, 6]).unwrap();
    let (fwd, bwd) = ops(PoolKind::Max, &[3, 3], 1, 1);
    let y = infer(&fwd, &[&x.ty()]).unwrap();
    let g = rand_tensor(&y, 3, -1.0, 1.0);
    let tys = [x.ty(), g.ty()];
    let step = match cuda::lower_step(&bwd, &[&tys[0], &tys[1]], &x.ty()).unwrap() {
        CudaStep::Kernels(k) => k,
        other => panic!("{other:?}"),
    };
    let got = interp::run_step(&step, &[&x, &g], &x.ty(), None).unwrap();
    let want = eval_cpu(&bwd, &[&x, &g]).unwrap();
    assert_eq!(got.to_f64_vec(), want.to_f64_vec());
    let fstep = match cuda::lower_step(&fwd, &[&tys[0]], &y).unwrap() {
        CudaStep::Kernels(k) => k,
        other => panic!("{other:?}"),
    };
    let fy = interp::run_step(&fstep, &[&x], &y, None)
        .unwrap()
        .to_f64_vec();
    let fw = eval_cpu(&fwd, &[&x]).unwrap().to_f64_vec();
    for (a, b) in fy.iter().zip(&fw) {
        assert!(a == b || (a.is_nan() && b.is_nan()), "{a} vs {b}");
    }
    assert!(fy.iter().any(|a| a.is_nan()));
}

/// The benchmarked max pool (3×3, stride 2, padding 1, f16, 64×64×112×112): a thread per eight
/// outputs of a row, its window rows read as 16-byte vectors.
#[test]
fn snapshot_max_pool_f16_rows() {
    let (fwd, _) = ops(PoolKind::Max, &[3, 3], 2, 1);
    let xt = ty(DType::F16, &[64, 64, 112, 112]);
    let y = infer(&fwd, &[&xt]).unwrap();
    let step = match cuda::lower_step(&fwd, &[&xt], &y).unwrap() {
        CudaStep::Kernels(k) => k,
        other => panic!("{other:?}"),
    };
    let src = cuda::source(&step.launches[0].kernel).unwrap();
    insta::assert_snapshot!("max_pool_f16_rows", src);
}
