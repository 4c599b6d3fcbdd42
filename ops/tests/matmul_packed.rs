//! The packed-B f32 GEMM (`matmul::packed`) against a float64 reference on seeded random inputs:
//! sizes on both sides of the register tile (8×48), the `k` block (384) and the row block (256),
//! both transposes, bias and every activation, one thread and the pool; the prepacked entry
//! (`cpu_prepacked`) with batch dims equal to the plain kernel; bad geometry refused.

use rustytorch_ops::matmul::packed::{self, AView, PackedB};
use rustytorch_ops::matmul::{cpu_prepacked, prepack_b};
use rustytorch_ops::testing::rand_f64;
use rustytorch_ops::vmath::VFn;
use rustytorch_ops::{eval_cpu, infer, Activation, HostTensor, Op};

fn rand32(n: usize, seed: u64) -> Vec<f32> {
    rand_f64(n, seed, -1.0, 1.0)
        .into_iter()
        .map(|v| v as f32)
        .collect()
}

fn gelu_erf(x: f64) -> f64 {
    0.5 * x * (1.0 + rustytorch_ops::elementwise::erf(x / 2f64.sqrt()))
}

fn gelu_tanh(x: f64) -> f64 {
    let c = (2.0 / std::f64::consts::PI).sqrt();
    0.5 * x * (1.0 + (c * (x + 0.044715 * x.powi(3))).tanh())
}

fn act64(f: VFn, x: f64) -> f64 {
    match f {
        VFn::Identity => x,
        VFn::Relu => x.max(0.0),
        VFn::GeluErf => gelu_erf(x),
        VFn::GeluTanh => gelu_tanh(x),
        other => panic!("not an epilogue: {other:?}"),
    }
}

/// One product through the kernel against the f64 reference, with the f32 rounding bound
/// `k·2⁻²³·Σ|a·b|` (plus the bias's and the activation's own rounding).
#[allow(clippy::too_many_arguments)]
fn check(m: usize, n: usize, k: usize, ta: bool, tb: bool, bias: bool, f: VFn, par: bool) {
    let seed = (m * 1_000_003 + n * 1009 + k * 7 + ta as usize * 2 + tb as usize) as u64;
    let a = rand32(m * k, seed);
    let b = rand32(k * n, seed + 1);
    let c: Vec<f32> = rand32(n, seed + 2);
    // A stored [m,k] or [k,m]; B stored [k,n] or [n,k].
    let at = |i: usize, p: usize| if ta { a[p * m + i] } else { a[i * k + p] };
    let bt = |p: usize, j: usize| if tb { b[j * k + p] } else { b[p * n + j] };
    let (ars, acs) = if ta { (1, m) } else { (k, 1) };
    let (brs, bcs) = if tb { (1, k) } else { (n, 1) };
    let pb = PackedB::new(&b, k, n, brs, bcs).expect("B fits");
    let mut y = vec![f32::NAN; m * n];
    let view = AView {
        a: &a,
        m,
        rs: ars,
        cs: acs,
    };
    assert!(packed::gemm_f32(
        view,
        &pb,
        bias.then_some(&c[..]),
        f,
        &mut y,
        par
    ));
    for i in 0..m {
        for j in 0..n {
            let (mut s, mut abs) = (0f64, 0f64);
            for p in 0..k {
                let t = at(i, p) as f64 * bt(p, j) as f64;
                s += t;
                abs += t.abs();
            }
            let cb = if bias { c[j] as f64 } else { 0.0 };
            let want = act64(f, s + cb);
            let got = y[i * n + j] as f64;
            let tol =
                1.2 * ((k as f64 + 2.0) * 1.2e-7 * (abs + cb.abs())) + 2e-6 * want.abs() + 1e-7;
            assert!(
                (got - want).abs() <= tol,
                "m={m} n={n} k={k} ta={ta} tb={tb} bias={bias} {f:?} par={par}: \
                 ({i},{j}) {got} vs {want} (tol {tol})"
            );
        }
    }
}

#[test]
fn tile_and_block_edges_against_f64() {
    if !packed::available() {
        return;
    }
    for &(m, n, k) in &[
        (1, 1, 1),
        (8, 48, 384),
        (7, 47, 5),
        (9, 49, 193),
        (17, 96, 384),
        (33, 100, 191),
        (3, 16, 400),
        (259, 50, 20),
        (260, 150, 385),
    ] {
        for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
            check(m, n, k, ta, tb, true, VFn::Identity, true);
        }
        check(m, n, k, false, true, false, VFn::Identity, false);
    }
}

#[test]
fn epilogues_against_f64() {
    if !packed::available() {
        return;
    }
    for f in [VFn::Relu, VFn::GeluErf, VFn::GeluTanh] {
        for par in [false, true] {
            check(37, 101, 200, false, true, true, f, par);
            check(12, 49, 7, true, false, false, f, par);
        }
    }
}

#[test]
fn threads_split_rows_or_panels() {
    if !packed::available() {
        return;
    }
    // Fewer panels than threads (split by rows), many panels (split by panels).
    check(300, 20, 64, false, false, true, VFn::Identity, true);
    check(20, 500, 64, false, true, true, VFn::Identity, true);
}

#[test]
fn empty_inner_dim_gives_bias_and_activation() {
    if !packed::available() {
        return;
    }
    let pb = PackedB::new(&[], 0, 5, 5, 1).unwrap();
    let c = [0.5f32, -1.0, 2.0, -0.25, 1.5];
    let mut y = vec![f32::NAN; 15];
    let view = AView {
        a: &[],
        m: 3,
        rs: 0,
        cs: 1,
    };
    assert!(packed::gemm_f32(
        view,
        &pb,
        Some(&c),
        VFn::Relu,
        &mut y,
        true
    ));
    for (i, v) in y.iter().enumerate() {
        assert_eq!(*v, c[i % 5].max(0.0));
    }
}

#[test]
fn bad_geometry_is_refused() {
    // B too short for its geometry.
    assert!(PackedB::new(&[1.0; 11], 3, 4, 4, 1).is_none());
    let pb = PackedB::new(&[1.0; 12], 3, 4, 4, 1).unwrap();
    let a = [1.0f32; 6];
    let view = |m| AView {
        a: &a,
        m,
        rs: 3,
        cs: 1,
    };
    // Output of the wrong size, A too short, bias of the wrong length.
    assert!(!packed::gemm_f32(
        view(2),
        &pb,
        None,
        VFn::Identity,
        &mut [0.0; 7],
        false
    ));
    assert!(!packed::gemm_f32(
        view(3),
        &pb,
        None,
        VFn::Identity,
        &mut [0.0; 12],
        false
    ));
    assert!(!packed::gemm_f32(
        view(2),
        &pb,
        Some(&[0.0; 3]),
        VFn::Identity,
        &mut [0.0; 8],
        false
    ));
}

/// The prepacked entry gives exactly what the op's kernel gives, batch dims included, and declines
/// what it does not handle.
#[test]
fn prepacked_equals_the_kernel() {
    let t = |dims: &[usize], seed| {
        HostTensor::from_vec(rand32(dims.iter().product(), seed), dims.to_vec()).unwrap()
    };
    let x = t(&[2, 3, 13, 70], 1);
    let w = t(&[50, 70], 2);
    let wt = t(&[70, 50], 3);
    let bias = t(&[50], 4);
    for (op, b, ins_bias) in [
        (
            Op::MatmulEpilogue {
                trans_a: false,
                trans_b: true,
                bias: true,
                act: Activation::GeluErf,
                accumulate: false,
            },
            &w,
            true,
        ),
        (
            Op::Matmul {
                trans_a: false,
                trans_b: false,
            },
            &wt,
            false,
        ),
    ] {
        let mut ins = vec![&x, b];
        if ins_bias {
            ins.push(&bias);
        }
        let tys: Vec<_> = ins.iter().map(|t| t.ty()).collect();
        let refs: Vec<_> = tys.iter().collect();
        let out = infer(&op, &refs).unwrap();
        let want = eval_cpu(&op, &ins).unwrap();
        let pb = prepack_b(&op, b).expect("a 2-D f32 B packs");
        if !packed::available() {
            assert!(cpu_prepacked(&op, &ins, &out, &pb).is_none());
            continue;
        }
        let got = cpu_prepacked(&op, &ins, &out, &pb).unwrap().unwrap();
        assert_eq!(got.dims(), want.dims());
        assert_eq!(got.to_f64_vec(), want.to_f64_vec());
        // A B of another geometry is declined, not misread.
        let other = prepack_b(&op, &t(&[70, 70], 5)).unwrap();
        assert!(cpu_prepacked(&op, &ins, &out, &other).is_none());
    }
    // A batched B, or f64, is not packed.
    let op = Op::Matmul {
        trans_a: false,
        trans_b: false,
    };
    assert!(prepack_b(&op, &t(&[2, 70, 50], 6)).is_none());
    let w64 = HostTensor::from_vec(vec![1.0f64; 6], [2, 3]).unwrap();
    assert!(prepack_b(&op, &w64).is_none());
}

/// The in-place small GEMM (attention's products) against f64 with strides wider than the
/// matrices, at sizes around the tile; bad geometry refused.
#[test]
fn small_gemm_against_f64() {
    if !packed::available() {
        return;
    }
    for &(m, n, k) in &[
        (1, 1, 1),
        (32, 32, 32),
        (7, 17, 3),
        (9, 49, 64),
        (33, 100, 5),
    ] {
        let (lda, ldb, ldc) = (k + 3, n + 5, n + 1);
        let a = rand32(m * lda, (m * n + k) as u64);
        let b = rand32(k * ldb, (m + n * k) as u64);
        let mut c = vec![7f32; m * ldc];
        assert!(packed::small_gemm(&a, lda, &b, ldb, &mut c, ldc, (m, n, k)));
        for i in 0..m {
            for j in 0..ldc {
                let got = c[i * ldc + j] as f64;
                if j >= n {
                    assert_eq!(got, 7.0, "({i},{j}) outside the product was written");
                    continue;
                }
                let (mut s, mut abs) = (0f64, 0f64);
                for p in 0..k {
                    let t = a[i * lda + p] as f64 * b[p * ldb + j] as f64;
                    s += t;
                    abs += t.abs();
                }
                let tol = 1.2 * (k as f64 + 1.0) * 1.2e-7 * abs + 1e-7;
                assert!(
                    (got - s).abs() <= tol,
                    "m={m} n={n} k={k}: ({i},{j}) {got} vs {s}"
                );
            }
        }
    }
    let mut c = [0f32; 4];
    assert!(!packed::small_gemm(
        &[1.0; 3],
        2,
        &[1.0; 4],
        2,
        &mut c,
        2,
        (2, 2, 2)
    ));
}
