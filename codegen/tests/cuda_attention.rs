//! The CUDA attention kernel against the CPU kernel through the IR interpreter: every float dtype,
//! causal kinds, additive and bool masks (with fully masked rows), head sizes that do not fill a
//! warp, more keys than lanes, and NaN scores.

use rustytorch_codegen::cuda::{self, interp, CudaStep};
use rustytorch_ops::testing::{assert_close, rand_tensor, tolerance};
use rustytorch_ops::{
    eval_cpu, infer, AttnMask, Causal, DType, F64Bits, HostTensor, Op, TensorType,
};

fn ty(dt: DType, dims: &[usize]) -> TensorType {
    TensorType::new(dt, dims.to_vec())
}

fn check(op: &Op, inputs: &[&HostTensor], what: &str) {
    let tys: Vec<TensorType> = inputs.iter().map(|t| t.ty()).collect();
    let refs: Vec<&TensorType> = tys.iter().collect();
    let out = infer(op, &refs).unwrap_or_else(|e| panic!("{what}: {e}"));
    let step = match cuda::lower_step(op, &refs, &out) {
        Ok(CudaStep::Kernels(k)) => k,
        other => panic!("{what}: {other:?}"),
    };
    for l in &step.launches {
        cuda::source(&l.kernel).unwrap_or_else(|e| panic!("{what}: {e}"));
    }
    let got = interp::run_step(&step, inputs, &out, None).unwrap_or_else(|e| panic!("{what}: {e}"));
    let want = eval_cpu(op, inputs).unwrap_or_else(|e| panic!("{what}: CPU: {e}"));
    assert_close(
        &got.to_f64_vec(),
        &want.to_f64_vec(),
        tolerance(out.dtype),
        what,
    );
}

fn op(causal: Causal, mask: AttnMask, scale: f64) -> Op {
    Op::Attention {
        causal,
        mask,
        scale: F64Bits::new(scale),
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
            let scale = 1.0 / (d as f64).sqrt();
            for causal in [Causal::None, Causal::TopLeft, Causal::BottomRight] {
                let what = format!("{dt} {causal:?} [{b},{h},{sq},{sk},{d},{dv}]");
                check(&op(causal, AttnMask::None, scale), &[&q, &kk, &v], &what);
                // An additive mask over [Sq, Sk] with −∞ entries and a fully masked first row.
                let mut m =
                    rand_tensor(&ty(DType::F64, &[sq, sk]), seed + 3, -2.0, 1.0).to_f64_vec();
                for (x, mv) in m.iter_mut().enumerate() {
                    if x < sk || x % 3 == 0 {
                        *mv = f64::NEG_INFINITY;
                    }
                }
                let add = HostTensor::from_f64_slice(&ty(dt, &[sq, sk]), &m).unwrap();
                check(
                    &op(causal, AttnMask::Additive, scale),
                    &[&q, &kk, &v, &add],
                    &format!("{what} additive"),
                );
                // A bool mask per batch and head, broadcast over queries, and one per query.
                let keep = rand_tensor(&ty(DType::Bool, &[b, h, 1, sk]), seed + 4, 0.0, 1.0);
                check(
                    &op(causal, AttnMask::Bool, scale),
                    &[&q, &kk, &v, &keep],
                    &format!("{what} bool"),
                );
                let mut kv =
                    rand_tensor(&ty(DType::F64, &[sq, sk]), seed + 5, 0.0, 1.0).to_f64_vec();
                kv[..sk].iter_mut().for_each(|x| *x = 0.0);
                let keep = HostTensor::from_f64_slice(&ty(DType::Bool, &[sq, sk]), &kv).unwrap();
                check(
                    &op(causal, AttnMask::Bool, scale),
                    &[&q, &kk, &v, &keep],
                    &format!("{what} bool rows"),
                );
            }
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
    let step = match cuda::lower_step(&op, &refs, &t).unwrap() {
        CudaStep::Kernels(k) => k,
        other => panic!("{other:?}"),
    };
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
            let scale = 1.0 / (d as f64).sqrt();
            for causal in [Causal::None, Causal::TopLeft, Causal::BottomRight] {
                let what = format!("tiled {dt} {causal:?} [{b},{h},{sq},{sk},{d},{dv}]");
                check(&op(causal, AttnMask::None, scale), &[&q, &kk, &v], &what);
                let mut m =
                    rand_tensor(&ty(DType::F64, &[sq, sk]), seed + 3, -2.0, 1.0).to_f64_vec();
                for (x, mv) in m.iter_mut().enumerate() {
                    if x < sk || x % 3 == 0 {
                        *mv = f64::NEG_INFINITY;
                    }
                }
                let add = HostTensor::from_f64_slice(&ty(dt, &[sq, sk]), &m).unwrap();
                check(
                    &op(causal, AttnMask::Additive, scale),
                    &[&q, &kk, &v, &add],
                    &format!("{what} additive"),
                );
                let keep = rand_tensor(&ty(DType::Bool, &[b, h, 1, sk]), seed + 4, 0.0, 1.0);
                check(
                    &op(causal, AttnMask::Bool, scale),
                    &[&q, &kk, &v, &keep],
                    &format!("{what} bool"),
                );
            }
        }
    }
}
