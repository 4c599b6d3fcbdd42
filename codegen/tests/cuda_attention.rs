//! The CUDA attention kernels against the CPU kernel through the IR interpreter: every float
//! dtype, causal kinds, additive and bool masks (with fully masked rows), head sizes that do not
//! fill a warp, more keys than lanes, and NaN scores; for the forward both the single kernel and
//! the GEMM path (its softmax kernel interpreted between host products standing in for the two
//! cuBLASLt GEMMs: scores in f32, probabilities in the operands' type).

use rustytorch_codegen::cuda::{self, attention, interp, Launch, StepKernels};
use rustytorch_ops::testing::{assert_close, rand_tensor, tolerance};
use rustytorch_ops::{
    eval_cpu, AttnLayout, AttnMask, Causal, DType, F64Bits, HostTensor, Op, TensorType,
};

mod common;
use common::ty;

/// The forward through both CUDA paths, anything else through the common check.
fn check(op: &Op, inputs: &[&HostTensor], what: &str) {
    if let Op::AttentionGrad { .. } = op {
        check_kernel(op, inputs, what, attention::lower_grad);
        return check_grad_gemm(op, inputs, what);
    }
    let Op::Attention {
        causal,
        mask,
        scale,
        ..
    } = op
    else {
        return common::check(op, inputs, what);
    };
    check_kernel(op, inputs, what, attention::lower);
    let tys: Vec<TensorType> = inputs.iter().map(|t| t.ty()).collect();
    let refs: Vec<&TensorType> = tys.iter().collect();
    let out = rustytorch_ops::infer(op, &refs).unwrap();
    let want = eval_cpu(op, inputs).unwrap_or_else(|e| panic!("{what}: CPU: {e}"));
    let tol = tolerance(out.dtype);
    if inputs[0].dtype() == DType::F64 || out.shape.numel() == 0 {
        return;
    }
    // The GEMM path.
    let f32 = |t: &HostTensor| t.cast(DType::F32);
    let nt = Op::Matmul {
        trans_a: false,
        trans_b: true,
    };
    let s = eval_cpu(&nt, &[&f32(inputs[0]), &f32(inputs[1])]).unwrap();
    let kernel = attention::gemm_softmax_kernel(*causal, *mask, scale.get(), &refs)
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    cuda::source(&kernel).unwrap_or_else(|e| panic!("{what}: {e}"));
    let mut ins = vec![&s];
    if *mask != AttnMask::None {
        ins.push(inputs[3]);
    }
    let step = StepKernels {
        launches: vec![Launch::simple(kernel, ins.len(), 4)],
        scratch_bytes: 0,
    };
    let p_ty = TensorType::new(out.dtype, s.ty().shape.clone());
    let p = interp::run_step(&step, &ins, &p_ty, None)
        .unwrap_or_else(|e| panic!("{what} (gemm softmax): {e}"));
    let nn = Op::Matmul {
        trans_a: false,
        trans_b: false,
    };
    let o = eval_cpu(&nn, &[&f32(&p), &f32(inputs[2])])
        .unwrap()
        .cast(out.dtype);
    // The probabilities are rounded to the operands' type before the second product.
    assert_close(
        &o.to_f64_vec(),
        &want.to_f64_vec(),
        2.0 * tol,
        &format!("{what} (gemm path)"),
    );
}

/// Checks attention over q, k, v with every causal kind, unmasked, with an additive mask over
/// [Sq, Sk] (−∞ entries and a fully masked first row) and with a bool mask per batch and head;
/// with `per_query_bool`, also a bool mask per query with a fully masked first row.
/// The single-kernel lowering `lower` of `op` through the interpreter against the CPU kernel.
fn check_kernel(
    op: &Op,
    inputs: &[&HostTensor],
    what: &str,
    lower: fn(&Op, &[&TensorType], &TensorType) -> rustytorch_codegen::Result<StepKernels>,
) {
    let tys: Vec<TensorType> = inputs.iter().map(|t| t.ty()).collect();
    let refs: Vec<&TensorType> = tys.iter().collect();
    let out = rustytorch_ops::infer(op, &refs).unwrap();
    let want = eval_cpu(op, inputs).unwrap_or_else(|e| panic!("{what}: CPU: {e}"));
    let step = lower(op, &refs, &out).unwrap_or_else(|e| panic!("{what}: {e}"));
    for l in &step.launches {
        cuda::source(&l.kernel).unwrap_or_else(|e| panic!("{what}: {e}"));
    }
    let got = interp::run_step(&step, inputs, &out, None).unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_close(
        &got.to_f64_vec(),
        &want.to_f64_vec(),
        tolerance(out.dtype),
        what,
    );
}

/// `a·b` on the host in f32 (standing in for a cuBLASLt GEMM with f32 accumulation).
fn host_mm(a: &HostTensor, b: &HostTensor, trans_a: bool, trans_b: bool) -> HostTensor {
    let op = Op::Matmul { trans_a, trans_b };
    eval_cpu(&op, &[&a.cast(DType::F32), &b.cast(DType::F32)]).unwrap()
}

/// The GEMM form of `AttentionGrad`: host products for the GEMMs, the interpreter for the
/// softmax and its backward, against the CPU kernel.
fn check_grad_gemm(op: &Op, inputs: &[&HostTensor], what: &str) {
    let Op::AttentionGrad {
        causal,
        mask,
        scale,
        wrt,
        ..
    } = op
    else {
        unreachable!()
    };
    let dt = inputs[0].dtype();
    if dt == DType::F64 {
        return;
    }
    let tys: Vec<TensorType> = inputs.iter().map(|t| t.ty()).collect();
    let refs: Vec<&TensorType> = tys.iter().collect();
    let want = eval_cpu(op, inputs).unwrap_or_else(|e| panic!("{what}: CPU: {e}"));
    let (q, k, v, g) = (inputs[0], inputs[1], inputs[2], inputs[inputs.len() - 1]);
    let s = host_mm(q, k, false, true);
    let soft = attention::gemm_softmax_kernel(*causal, *mask, scale.get(), &refs).unwrap();
    let mut ins = vec![&s];
    if *mask != AttnMask::None {
        ins.push(inputs[3]);
    }
    let run = |kernel, ins: &[&HostTensor], init: Option<&HostTensor>| {
        let step = StepKernels {
            launches: vec![Launch::simple(kernel, ins.len(), 4)],
            scratch_bytes: 0,
        };
        let ty = TensorType::new(dt, s.ty().shape.clone());
        interp::run_step(&step, ins, &ty, init).unwrap_or_else(|e| panic!("{what}: {e}"))
    };
    let p = run(soft, &ins, None);
    let got = if *wrt == 2 {
        host_mm(&p, g, true, false)
    } else {
        let dp = host_mm(g, v, false, true);
        let kernel = attention::grad_softmax_kernel(scale.get(), &refs).unwrap();
        let ds = run(kernel, &[&dp], Some(&p));
        if *wrt == 0 {
            host_mm(&ds, k, false, false)
        } else {
            host_mm(&ds, q, true, false)
        }
    }
    .cast(dt);
    // P and dS are rounded to the operands' type between the products.
    let tol = 4.0 * tolerance(dt);
    assert_close(
        &got.to_f64_vec(),
        &want.to_f64_vec(),
        tol,
        &format!("{what} (gemm path)"),
    );
}

fn check_masks(q: &HostTensor, k: &HostTensor, v: &HostTensor, seed: u64, per_query_bool: bool) {
    let (qd, kd) = (q.ty().shape.dims().to_vec(), k.ty().shape.dims().to_vec());
    let (b, h, sq, d, sk) = (qd[0], qd[1], qd[2], qd[3], kd[2]);
    let dt = q.dtype();
    let scale = 1.0 / (d as f64).sqrt();
    for causal in [Causal::None, Causal::TopLeft, Causal::BottomRight] {
        let what = format!("{dt} {causal:?} [{b},{h},{sq},{sk},{d}]");
        check(&op(causal, AttnMask::None, scale), &[q, k, v], &what);
        let mut m = rand_tensor(&ty(DType::F64, &[sq, sk]), seed + 3, -2.0, 1.0).to_f64_vec();
        for (x, mv) in m.iter_mut().enumerate() {
            if x < sk || x % 3 == 0 {
                *mv = f64::NEG_INFINITY;
            }
        }
        let add = HostTensor::from_f64_slice(&ty(dt, &[sq, sk]), &m).unwrap();
        check(
            &op(causal, AttnMask::Additive, scale),
            &[q, k, v, &add],
            &format!("{what} additive"),
        );
        let keep = rand_tensor(&ty(DType::Bool, &[b, h, 1, sk]), seed + 4, 0.0, 1.0);
        check(
            &op(causal, AttnMask::Bool, scale),
            &[q, k, v, &keep],
            &format!("{what} bool"),
        );
        if per_query_bool {
            let mut kv = rand_tensor(&ty(DType::F64, &[sq, sk]), seed + 5, 0.0, 1.0).to_f64_vec();
            kv[..sk].iter_mut().for_each(|x| *x = 0.0);
            let keep = HostTensor::from_f64_slice(&ty(DType::Bool, &[sq, sk]), &kv).unwrap();
            check(
                &op(causal, AttnMask::Bool, scale),
                &[q, k, v, &keep],
                &format!("{what} bool rows"),
            );
        }
    }
}

fn op(causal: Causal, mask: AttnMask, scale: f64) -> Op {
    Op::Attention {
        causal,
        mask,
        scale: F64Bits::new(scale),
        layout: AttnLayout::Bhsd,
    }
}

#[test]
fn attention_matches_the_cpu() {
    for dt in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        // (B, H, Sq, Sk, D, Dv): short rows, more keys than lanes, Sq > Sk.
        for (k, &(b, h, sq, sk, d, dv)) in [
            (1, 2, 5, 7, 8, 6),
            (2, 1, 3, 70, 16, 33),
            (1, 1, 9, 4, 5, 3),
        ]
        .iter()
        .enumerate()
        {
            let seed = 10 * k as u64;
            let q = rand_tensor(&ty(dt, &[b, h, sq, d]), seed, -1.0, 1.0);
            let kk = rand_tensor(&ty(dt, &[b, h, sk, d]), seed + 1, -1.0, 1.0);
            let v = rand_tensor(&ty(dt, &[b, h, sk, dv]), seed + 2, -1.0, 1.0);
            check_masks(&q, &kk, &v, seed, true);
        }
    }
}

#[test]
fn nan_scores_make_their_row_nan() {
    let (b, h, sq, sk, d) = (1, 1, 3, 40, 4);
    let q = rand_tensor(&ty(DType::F32, &[b, h, sq, d]), 1, -1.0, 1.0);
    let mut kv = rand_tensor(&ty(DType::F32, &[b, h, sk, d]), 2, -1.0, 1.0).to_f64_vec();
    kv[37 * d] = f64::NAN;
    let k = HostTensor::from_f64_slice(&ty(DType::F32, &[b, h, sk, d]), &kv).unwrap();
    let v = rand_tensor(&ty(DType::F32, &[b, h, sk, d]), 3, -1.0, 1.0);
    check(&op(Causal::None, AttnMask::None, 0.5), &[&q, &k, &v], "nan");
}

/// The benchmarked kernel: causal bf16 attention with GPT-2-small heads.
#[test]
fn snapshot_causal_bf16_gpt2_heads() {
    let t = ty(DType::BF16, &[8, 12, 1024, 64]);
    let op = op(Causal::TopLeft, AttnMask::None, 0.125);
    let refs = [&t, &t, &t];
    let step = attention::lower(&op, &refs, &t).unwrap();
    assert_eq!(step.launches.len(), 1);
    let src = cuda::source(&step.launches[0].kernel).unwrap();
    insta::assert_snapshot!("attention_causal_bf16_gpt2", src);
}

/// The tiled kernel (a thread per query row, keys staged in shared memory): query counts that do
/// not fill a block, several key tiles with a partial last one, every causal kind with Sq ≠ Sk,
/// both mask kinds with fully masked rows, every float dtype.
#[test]
fn tiled_attention_matches_the_cpu() {
    for dt in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        for (k, &(b, h, sq, sk, d, dv)) in [(1, 2, 37, 70, 8, 6), (1, 1, 130, 150, 16, 16)]
            .iter()
            .enumerate()
        {
            let seed = 50 + 10 * k as u64;
            let q = rand_tensor(&ty(dt, &[b, h, sq, d]), seed, -1.0, 1.0);
            let kk = rand_tensor(&ty(dt, &[b, h, sk, d]), seed + 1, -1.0, 1.0);
            let v = rand_tensor(&ty(dt, &[b, h, sk, dv]), seed + 2, -1.0, 1.0);
            check_masks(&q, &kk, &v, seed, false);
        }
    }
}

/// The attention gradient (with respect to q, k and v) through the interpreter against the CPU
/// kernel: every float dtype, every causal kind with Sq ≠ Sk, additive and bool masks with a fully
/// masked query row (whose gradient is zero).
#[test]
fn attention_grad_matches_the_cpu() {
    for dt in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        let (b, h, sq, sk, d, dv) = (1, 2, 6, 9, 5, 3);
        let q = rand_tensor(&ty(dt, &[b, h, sq, d]), 1, -1.0, 1.0);
        let k = rand_tensor(&ty(dt, &[b, h, sk, d]), 2, -1.0, 1.0);
        let v = rand_tensor(&ty(dt, &[b, h, sk, dv]), 3, -1.0, 1.0);
        let g = rand_tensor(&ty(dt, &[b, h, sq, dv]), 4, -1.0, 1.0);
        let mut m = rand_tensor(&ty(DType::F64, &[sq, sk]), 5, -2.0, 1.0).to_f64_vec();
        for (x, mv) in m.iter_mut().enumerate() {
            if x < sk || x % 4 == 0 {
                *mv = f64::NEG_INFINITY;
            }
        }
        let add = HostTensor::from_f64_slice(&ty(dt, &[sq, sk]), &m).unwrap();
        let keep = rand_tensor(&ty(DType::Bool, &[b, h, 1, sk]), 6, 0.0, 1.0);
        for causal in [Causal::None, Causal::TopLeft, Causal::BottomRight] {
            for wrt in 0..3u8 {
                let grad = |mask| Op::AttentionGrad {
                    causal,
                    mask,
                    scale: F64Bits::new(0.4),
                    wrt,
                    layout: AttnLayout::Bhsd,
                };
                let what = format!("{dt} {causal:?} wrt {wrt}");
                check(&grad(AttnMask::None), &[&q, &k, &v, &g], &what);
                check(
                    &grad(AttnMask::Additive),
                    &[&q, &k, &v, &add, &g],
                    &format!("{what} additive"),
                );
                check(
                    &grad(AttnMask::Bool),
                    &[&q, &k, &v, &keep, &g],
                    &format!("{what} bool"),
                );
            }
        }
    }
}

/// Attention in the `[B, S, H, D]` layout on the paths that read `[B, H, S, D]` only (f64 here:
/// the general kernel): the operands transposed into scratch, the op, the result transposed
/// back, through the interpreter against the CPU kernel; forward and the three gradients.
#[test]
fn bshd_layout_through_scratch_transposes() {
    let dt = DType::F64;
    let (b, h, sq, sk, d, dv) = (2, 3, 5, 7, 4, 6);
    let q = rand_tensor(&ty(dt, &[b, sq, h, d]), 11, -1.0, 1.0);
    let k = rand_tensor(&ty(dt, &[b, sk, h, d]), 12, -1.0, 1.0);
    let v = rand_tensor(&ty(dt, &[b, sk, h, dv]), 13, -1.0, 1.0);
    let g = rand_tensor(&ty(dt, &[b, sq, h, dv]), 14, -1.0, 1.0);
    let add = rand_tensor(&ty(dt, &[sq, sk]), 15, -1.0, 1.0);
    for causal in [Causal::None, Causal::TopLeft, Causal::BottomRight] {
        for (mask, extra) in [(AttnMask::None, None), (AttnMask::Additive, Some(&add))] {
            let mut ins = vec![&q, &k, &v];
            ins.extend(extra);
            let fwd = Op::Attention {
                causal,
                mask,
                scale: F64Bits::new(0.4),
                layout: AttnLayout::Bshd,
            };
            let mut cases = vec![(fwd, ins.clone())];
            ins.push(&g);
            for wrt in 0..3u8 {
                let op = Op::AttentionGrad {
                    causal,
                    mask,
                    scale: F64Bits::new(0.4),
                    wrt,
                    layout: AttnLayout::Bshd,
                };
                cases.push((op, ins.clone()));
            }
            for (op, ins) in cases {
                let what = format!("{} {causal:?} {mask:?}", op.name());
                let tys: Vec<TensorType> = ins.iter().map(|t| t.ty()).collect();
                let refs: Vec<&TensorType> = tys.iter().collect();
                let out = rustytorch_ops::infer(&op, &refs).unwrap();
                let cuda::CudaStep::Composite(c) = cuda::lower_step(&op, &refs, &out).unwrap()
                else {
                    panic!("{what}: expected transposes around the op");
                };
                let launches: Vec<Launch> = c
                    .parts
                    .into_iter()
                    .map(|p| match p {
                        cuda::Part::Launch(l) => l,
                        other => panic!("{what}: unexpected {other:?}"),
                    })
                    .collect();
                // Transposes in, the op's kernels, one transpose out.
                assert!(launches.len() >= 4, "{what}: {} launches", launches.len());
                let step = StepKernels {
                    launches,
                    scratch_bytes: c.scratch_bytes,
                };
                let got = interp::run_step(&step, &ins, &out, None)
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                let want = eval_cpu(&op, &ins).unwrap();
                assert_close(&got.to_f64_vec(), &want.to_f64_vec(), 1e-12, &what);
            }
        }
    }
}
