//! The CPU session multiplies against weights packed once: results equal a float64 reference,
//! and a weight replaced between runs (`set_param`) is packed again, not read stale.

use rustytorch::prelude::*;

fn rand(n: usize, seed: u64) -> Vec<f32> {
    rustytorch::ops::testing::rand_f64(n, seed, -1.0, 1.0)
        .into_iter()
        .map(|v| v as f32)
        .collect()
}

/// `x·w + b` in f64 from the f32 operands.
fn reference(x: &[f32], w: &[f32], b: &[f32], (m, k, n): (usize, usize, usize)) -> Vec<f64> {
    let mut y = vec![0f64; m * n];
    for i in 0..m {
        for j in 0..n {
            let s: f64 = (0..k)
                .map(|p| x[i * k + p] as f64 * w[p * n + j] as f64)
                .sum();
            y[i * n + j] = s + b[j] as f64;
        }
    }
    y
}

fn check(got: &HostTensor, want: &[f64], k: usize) {
    let got = got.to_f64_vec();
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let tol = 2.0 * k as f64 * 1.2e-7 * (1.0 + w.abs()) + 1e-6;
        assert!((g - w).abs() <= tol, "element {i}: {g} vs {w}");
    }
}

#[test]
fn packed_weights_follow_set_param() {
    let (m, k, n) = (37, 70, 100);
    let g = GraphBuilder::new();
    let x = g.input("x", DType::F32, [m, k]);
    let w = g.param("w", [k, n], Init::kaiming_uniform(k, 1));
    let b = g.param("b", [n], Init::zeros());
    let y = x.matmul(&w).add(&b);
    let mut exe = compile(&g, &[&y], Device::Cpu).unwrap();
    let xv = rand(m * k, 2);
    let xt = HostTensor::from_vec(xv.clone(), [m, k]).unwrap();
    let bv = rand(n, 3);
    exe.set_param("b", HostTensor::from_vec(bv.clone(), [n]).unwrap())
        .unwrap();
    for seed in [4u64, 5, 6] {
        let wv = rand(k * n, seed);
        exe.set_param("w", HostTensor::from_vec(wv.clone(), [k, n]).unwrap())
            .unwrap();
        // Twice per weight: the second run reuses the packed copy.
        for _ in 0..2 {
            let out = exe.run(&[("x", xt.clone())]).unwrap();
            check(&out.into_vec()[0], &reference(&xv, &wv, &bv, (m, k, n)), k);
        }
    }
}
