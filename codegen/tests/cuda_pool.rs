//! The CUDA pooling kernels against the CPU kernels through the IR interpreter: max and both
//! averages, forward and backward, 1-D to 3-D, padding, windows that overlap (stride < window) and
//! that skip inputs (stride > window), every float dtype, NaN inputs, and max-pool ties (the
//! gradient goes to the first maximum, as on the CPU).

use rustytorch_codegen::cuda::{self, interp, CudaStep};
use rustytorch_ops::testing::rand_tensor;
use rustytorch_ops::{eval_cpu, infer, ConvGeom, DType, HostTensor, Op, PoolKind};

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
    let n = window.len();
    let geom = ConvGeom {
        stride: vec![stride; n],
        padding: vec![pad; n],
        dilation: vec![1; n],
    };
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
    let cases: [(&[usize], &[usize], usize, usize); 6] = [
        (&[2, 3, 11], &[3], 2, 1),
        (&[1, 2, 9, 7], &[3, 3], 2, 1),
        (&[2, 1, 8, 8], &[2, 2], 2, 0),
        (&[1, 2, 10, 9], &[2, 3], 4, 1),
        (&[1, 2, 5, 6, 7], &[3, 2, 3], 2, 1),
        (&[1, 1, 6, 6], &[3, 3], 1, 1),
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
