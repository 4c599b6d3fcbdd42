//! Sparse ops on the test device against the CPU kernels (themselves checked against dense
//! float64 products in `ops/tests/sparse.rs`): SpMM (`A·x`, `Aᵀ·x`) and SDDMM in graphs with the
//! pattern as an input or a constant, every value and index dtype, unsorted and repeated columns,
//! empty rows and empty matrices, gradients of a training graph, and a bad pattern (a clear error,
//! nothing run); on CUDA also SpGEMM and transposition of device CSR matrices against the CPU's.
//! CUDA where `RUSTYTORCH_TEST_CUDA=1` (the GPU machine); elsewhere the CPU executable, and the
//! device-matrix tests return early.

use rustytorch::compiler::{CsrPattern, Graph};
use rustytorch::ops::testing::{assert_close, rand_tensor};
use rustytorch::ops::{eval_cpu, Op};
use rustytorch::prelude::*;
use rustytorch::sparse::{random_csr, spgemm, CsrMatrix};

fn cuda() -> bool {
    std::env::var("RUSTYTORCH_TEST_CUDA").as_deref() == Ok("1")
}

fn device() -> Device {
    if cuda() {
        Device::Cuda(0)
    } else {
        Device::Cpu
    }
}

/// Device against CPU: f16/bf16 round the sum once either way, but cuSPARSE adds in its own
/// order, so a sum of many products differs by a few units of the last place.
fn tol(d: DType) -> f64 {
    match d {
        DType::F64 => 1e-10,
        DType::F32 => 1e-5,
        DType::F16 => 4e-3,
        _ => 2e-2,
    }
}

fn idx(d: DType, v: &[i64]) -> HostTensor {
    HostTensor::from_vec(v.to_vec(), [v.len()]).unwrap().cast(d)
}

/// A pattern with unsorted and repeated columns and empty rows (5 × 7, 9 entries).
fn messy(index: DType) -> (usize, usize, HostTensor, HostTensor) {
    let rp = [0, 3, 3, 6, 6, 9];
    let ci = [6, 0, 6, 2, 1, 2, 5, 0, 3];
    (5, 7, idx(index, &rp), idx(index, &ci))
}

/// Runs `op` on `inputs` as a graph on the test device, the operands listed in `consts` being
/// graph constants and the others inputs, and compares with the CPU kernel.
fn check(what: &str, op: Op, inputs: Vec<HostTensor>, consts: &[usize]) {
    let refs: Vec<&HostTensor> = inputs.iter().collect();
    let want = eval_cpu(&op, &refs).unwrap_or_else(|e| panic!("{what}: cpu: {e}"));
    let mut g = Graph::new();
    let mut ids = vec![];
    let mut args = vec![];
    for (i, x) in inputs.iter().enumerate() {
        if consts.contains(&i) {
            ids.push(g.add_constant(x.clone()));
        } else {
            let name = format!("x{i}");
            ids.push(g.add_input(&name, x.ty()).unwrap());
            args.push((name, x.clone()));
        }
    }
    let y = g.add(op, &ids).unwrap();
    g.add_output("y", y).unwrap();
    let mut exe = rustytorch::compile_graph(&g, device(), &CompileOptions::default())
        .unwrap_or_else(|e| panic!("{what}: compile: {e}"));
    let args: Vec<(&str, HostTensor)> = args.iter().map(|(n, x)| (n.as_str(), x.clone())).collect();
    // Twice: the second run may replay a captured CUDA graph.
    for run in 0..2 {
        let got = exe
            .run(&args)
            .unwrap_or_else(|e| panic!("{what}: run {run}: {e}"))
            .into_vec()
            .remove(0);
        assert_eq!(got.ty(), want.ty(), "{what}");
        assert_close(
            &got.to_f64_vec(),
            &want.to_f64_vec(),
            tol(want.dtype()),
            &format!("{what} (run {run})"),
        );
    }
}

#[test]
fn spmm_and_sddmm_match_the_cpu() {
    let mut seed = 1;
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        for index in [DType::I32, DType::I64] {
            // Random sorted patterns of several shapes and densities, and the messy one.
            let mut cases = vec![];
            for &(m, k, density) in &[(33, 17, 0.2), (1, 40, 0.5), (40, 1, 0.5), (300, 200, 0.02)] {
                let a = random_csr(m, k, density, dtype, index, seed).unwrap();
                seed += 1;
                cases.push((m, k, a.row_ptr().clone(), a.col_idx().clone()));
            }
            cases.push(messy(index));
            // No entries at all.
            cases.push((4, 3, idx(index, &[0, 0, 0, 0, 0]), idx(index, &[])));
            for (m, k, rp, ci) in cases {
                let nnz = ci.numel();
                let v = rand_tensor(&TensorType::new(dtype, [nnz]), seed, -1.0, 1.0);
                for n in [1, 8, 33] {
                    seed += 1;
                    for trans_a in [false, true] {
                        let inner = if trans_a { m } else { k };
                        let x = rand_tensor(&TensorType::new(dtype, [inner, n]), seed, -1.0, 1.0);
                        let op = Op::SparseMatmul {
                            rows: m,
                            cols: k,
                            trans_a,
                        };
                        let what =
                            format!("spmm {m}x{k} nnz {nnz} n {n} t {trans_a} {dtype}/{index}");
                        let ins = vec![rp.clone(), ci.clone(), v.clone(), x];
                        // Pattern as inputs, then as constants.
                        check(&what, op.clone(), ins.clone(), &[]);
                        check(&format!("{what} (constant pattern)"), op, ins, &[0, 1]);
                    }
                    let a = rand_tensor(&TensorType::new(dtype, [m, n]), seed + 7, -1.0, 1.0);
                    let b = rand_tensor(&TensorType::new(dtype, [k, n]), seed + 8, -1.0, 1.0);
                    let what = format!("sddmm {m}x{k} nnz {nnz} k {n} {dtype}/{index}");
                    check(
                        &what,
                        Op::SampledMatmul,
                        vec![rp.clone(), ci.clone(), a, b],
                        &[],
                    );
                }
            }
        }
    }
}

#[test]
fn a_bad_pattern_is_a_clear_error_and_the_session_stays_usable() {
    let (m, k, rp, _) = messy(DType::I32);
    let good = idx(DType::I32, &[6, 0, 6, 2, 1, 2, 5, 0, 3]);
    let bad = idx(DType::I32, &[6, 0, 6, 2, 1, 2, 5, 0, 7]);
    let v = rand_tensor(&TensorType::new(DType::F32, [9]), 3, -1.0, 1.0);
    let x = rand_tensor(&TensorType::new(DType::F32, [k, 4]), 4, -1.0, 1.0);
    let mut g = Graph::new();
    let ids: Vec<_> = [("rp", &rp), ("ci", &good), ("v", &v), ("x", &x)]
        .iter()
        .map(|(n, t)| g.add_input(n, t.ty()).unwrap())
        .collect();
    let op = Op::SparseMatmul {
        rows: m,
        cols: k,
        trans_a: false,
    };
    let y = g.add(op.clone(), &ids).unwrap();
    g.add_output("y", y).unwrap();
    let mut exe = rustytorch::compile_graph(&g, device(), &CompileOptions::default()).unwrap();
    let run = |exe: &mut rustytorch::Executable, ci: &HostTensor| {
        exe.run(&[
            ("rp", rp.clone()),
            ("ci", ci.clone()),
            ("v", v.clone()),
            ("x", x.clone()),
        ])
    };
    let e = run(&mut exe, &bad)
        .expect_err("column 7 of 7 columns")
        .to_string();
    assert!(
        e.contains("col_idx[8] = 7") && e.contains("sparse_matmul"),
        "{e}"
    );
    let got = run(&mut exe, &good).unwrap().into_vec().remove(0);
    let want = eval_cpu(&op, &[&rp, &good, &v, &x]).unwrap();
    assert_close(
        &got.to_f64_vec(),
        &want.to_f64_vec(),
        1e-5,
        "after the error",
    );
}

/// A two-layer GCN step (Â·relu(Â·X·W1)·W2 with trainable edge weights) trained a few steps on
/// the device gives the CPU's parameters.
#[test]
fn gcn_training_matches_the_cpu() {
    let n = 64;
    let a = random_csr(n, n, 0.08, DType::F32, DType::I32, 11).unwrap();
    let x = rand_tensor(&TensorType::new(DType::F32, [n, 12]), 7, -1.0, 1.0);
    let y = HostTensor::from_vec((0..n as i64).map(|i| i % 3).collect(), [n]).unwrap();
    let mut params = vec![];
    for dev in [Device::Cpu, device()] {
        let g = GraphBuilder::new();
        let pattern = CsrPattern::constant(&g, &a);
        let edge = g.param(
            "edge",
            [a.nnz()],
            Init::Uniform {
                low: 0.5,
                high: 1.5,
                seed: 3,
            },
        );
        let xi = g.input("x", DType::F32, [n, 12]);
        let yi = g.input("y", DType::I64, [n]);
        let w1 = g.param("w1", [12, 16], Init::kaiming_uniform(12, 1));
        let w2 = g.param("w2", [16, 3], Init::kaiming_uniform(16, 2));
        let h = pattern.matmul(&edge, &xi.matmul(&w1)).relu();
        let logits = pattern.matmul_t(&edge, &h.matmul(&w2));
        let loss = logits.cross_entropy(&yi);
        g.train_step(&loss, AdamW::new(1e-2), &StepOptions::default())
            .unwrap();
        let mut exe = compile(&g, &[&loss], dev).unwrap();
        for _ in 0..5 {
            exe.run(&[("x", x.clone()), ("y", y.clone())]).unwrap();
        }
        params.push(exe.params().unwrap());
    }
    for ((name, cpu), (_, dev)) in params[0].iter().zip(&params[1]) {
        assert_close(&dev.to_f64_vec(), &cpu.to_f64_vec(), 1e-4, name);
    }
}

/// CSR matrices on the device: upload and download, SpGEMM and transposition against the CPU.
#[test]
fn device_spgemm_and_transpose_match_the_cpu() {
    if !cuda() {
        return;
    }
    use rustytorch::runtime::cuda::DeviceCsr;
    let mut seed = 100;
    let shapes = [
        (50, 40, 30, 0.1),
        (1, 64, 20, 0.3),
        (64, 1, 20, 1.0),
        (200, 300, 100, 0.02),
        (7, 5, 6, 0.0),
        (0, 5, 6, 0.5),
    ];
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        for index in [DType::I32, DType::I64] {
            for &(m, k, n, density) in &shapes {
                seed += 2;
                let a = random_csr(m, k, density, dtype, index, seed).unwrap();
                let b = random_csr(k, n, density, dtype, index, seed + 1).unwrap();
                let what = format!("{m}x{k}·{k}x{n} density {density} {dtype}/{index}");
                let (da, db) = (
                    DeviceCsr::upload(0, &a).unwrap(),
                    DeviceCsr::upload(0, &b).unwrap(),
                );
                assert_eq!(da.to_host().unwrap(), a, "{what}: round trip");
                let c = da.matmul(&db).unwrap_or_else(|e| panic!("{what}: {e}"));
                assert_eq!((c.index_dtype(), c.dtype()), (index, dtype), "{what}");
                let got = c.to_host().unwrap();
                let want = spgemm(&a, &b).unwrap();
                // The same number of entries and the same values.
                assert_eq!(got.nnz(), want.nnz(), "{what}: entries");
                assert_close(
                    &got.to_dense().to_f64_vec(),
                    &want.to_dense().to_f64_vec(),
                    tol(dtype),
                    &what,
                );
                let t = da.transpose().unwrap().to_host().unwrap();
                assert_eq!(t, a.transpose(), "{what}: transpose");
            }
        }
    }
    // Mismatched shapes are an error naming both.
    let a = DeviceCsr::upload(
        0,
        &random_csr(3, 4, 0.5, DType::F32, DType::I32, 1).unwrap(),
    )
    .unwrap();
    let e = a.matmul(&a).unwrap_err().to_string();
    assert!(e.contains("3×4"), "{e}");
    let _: CsrMatrix = a.to_host().unwrap();
}
