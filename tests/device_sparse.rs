//! Sparse ops on the test device against the CPU kernels (themselves checked against dense
//! float64 products in `ops/tests/sparse.rs`): SpMM (`A·x`, `Aᵀ·x`) and SDDMM in graphs with the
//! pattern as an input or a constant, every value and index dtype, unsorted and repeated columns,
//! empty rows and empty matrices, gradients of a training graph, and a bad pattern (a clear error,
//! nothing run); on CUDA also SpGEMM and transposition of device CSR matrices against the CPU's,
//! and device COO matrices (round trips, COO → CSR with unsorted and repeated entries, CSR → COO,
//! dense) against the host conversions.
//! CUDA where `RUSTYTORCH_TEST_CUDA=1` (the GPU machine); elsewhere the CPU executable, and the
//! device-matrix tests return early.

use rustytorch::compiler::{CsrPattern, Graph};
use rustytorch::ops::testing::{assert_close, rand_tensor};
use rustytorch::ops::{eval_cpu, Op};
use rustytorch::prelude::*;
use rustytorch::sparse::{random_csr, spgemm, CooMatrix, CsrMatrix, DeviceCoo, DeviceCsr};

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

/// A COO matrix from i64 triples, in the given order.
fn coo(rows: usize, cols: usize, e: &[(i64, i64, f64)], index: DType, dtype: DType) -> CooMatrix {
    let r: Vec<i64> = e.iter().map(|x| x.0).collect();
    let c: Vec<i64> = e.iter().map(|x| x.1).collect();
    let v: Vec<f64> = e.iter().map(|x| x.2).collect();
    let vals = HostTensor::from_f64_slice(&TensorType::new(dtype, [v.len()]), &v).unwrap();
    CooMatrix::new(rows, cols, idx(index, &r), idx(index, &c), vals).unwrap()
}

/// COO matrices to test conversions on: unsorted entries with repeats (also runs of a repeat
/// longer than two) and empty rows, random matrices shuffled with a tenth of their entries
/// repeated, no entries, 1×N, N×1, and one large enough for several blocks of the merge kernels.
fn coo_cases(index: DType, dtype: DType) -> Vec<(String, CooMatrix)> {
    let mut out = vec![];
    let messy = [
        (3, 6, 0.5),
        (0, 2, -1.25),
        (3, 1, 2.0),
        (0, 2, 0.75),
        (4, 0, 1.5),
        (3, 6, -0.25),
        (0, 0, 3.0),
        (3, 6, 1.0),
        (4, 6, -2.0),
    ];
    out.push(("messy 5x7".to_string(), coo(5, 7, &messy, index, dtype)));
    out.push(("no entries 4x3".to_string(), coo(4, 3, &[], index, dtype)));
    out.push(("0x5".to_string(), coo(0, 5, &[], index, dtype)));
    let mut seed = 500;
    for &(m, n, density) in &[
        (1, 300, 0.2),
        (300, 1, 0.2),
        (60, 50, 0.1),
        (2000, 1500, 0.03),
    ] {
        seed += 1;
        let a = random_csr(m, n, density, DType::F64, DType::I64, seed)
            .unwrap()
            .to_coo();
        let r = a.row_idx().to_f64_vec();
        let c = a.col_idx().to_f64_vec();
        let v = a.values().to_f64_vec();
        let mut e: Vec<(i64, i64, f64)> = (0..v.len())
            .map(|k| (r[k] as i64, c[k] as i64, v[k]))
            .collect();
        // Repeat every tenth entry with another value, then shuffle (a fixed permutation).
        let extra: Vec<_> = e
            .iter()
            .step_by(10)
            .map(|x| (x.0, x.1, x.2 * 0.5 - 0.125))
            .collect();
        e.extend(extra);
        let len = e.len();
        for k in 0..len {
            let j = (k * 7919 + 13) % len;
            e.swap(k, j);
        }
        out.push((
            format!("random {m}x{n} shuffled"),
            coo(m, n, &e, index, dtype),
        ));
    }
    out
}

/// The COO cases are valid and the host's conversions agree with each other on them (the
/// reference of the device test below, checked on every machine).
#[test]
fn coo_cases_convert_consistently_on_the_host() {
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        for index in [DType::I32, DType::I64] {
            for (name, a) in coo_cases(index, dtype) {
                let csr = a.to_csr().unwrap();
                assert_close(
                    &csr.to_dense().to_f64_vec(),
                    &a.to_dense().to_f64_vec(),
                    tol(dtype),
                    &format!("{name} {dtype}/{index}"),
                );
                assert_eq!(csr.to_coo().to_csr().unwrap(), csr, "{name}");
            }
        }
    }
}

/// COO matrices on the device against the host: round trips, COO → CSR (sorted, repeats summed),
/// CSR → COO, transposition and dense forms, for every index and value type.
#[test]
fn device_coo_matches_the_host() {
    if !cuda() {
        return;
    }
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        for index in [DType::I32, DType::I64] {
            for (name, a) in coo_cases(index, dtype) {
                let what = format!("{name} {dtype}/{index}");
                let d = DeviceCoo::upload(0, &a).unwrap_or_else(|e| panic!("{what}: {e}"));
                assert_eq!(d.nnz(), a.nnz(), "{what}");
                assert_eq!(d.to_host().unwrap(), a, "{what}: round trip");
                // COO → CSR: the same pattern as the host's, the sums within rounding.
                let want = a.to_csr().unwrap();
                let got = d
                    .to_csr()
                    .unwrap_or_else(|e| panic!("{what}: to_csr: {e}"))
                    .to_host()
                    .unwrap();
                assert_eq!((got.index_dtype(), got.dtype()), (index, dtype), "{what}");
                assert_eq!(got.row_ptr(), want.row_ptr(), "{what}: row offsets");
                assert_eq!(got.col_idx(), want.col_idx(), "{what}: columns");
                assert_close(
                    &got.values().to_f64_vec(),
                    &want.values().to_f64_vec(),
                    tol(dtype),
                    &format!("{what}: values"),
                );
                // CSR → COO: exactly the host's expansion.
                let dc = DeviceCsr::upload(0, &want).unwrap();
                let back = dc.to_coo().unwrap().to_host().unwrap();
                assert_eq!(back, want.to_coo(), "{what}: CSR → COO");
                // Transposition and dense forms.
                assert_eq!(
                    d.transpose().unwrap().to_host().unwrap(),
                    a.transpose(),
                    "{what}: transpose"
                );
                let dense = d
                    .to_dense()
                    .unwrap_or_else(|e| panic!("{what}: dense: {e}"));
                assert_eq!(dense.ty(), a.to_dense().ty(), "{what}: dense type");
                assert_close(
                    &dense.to_f64_vec(),
                    &a.to_dense().to_f64_vec(),
                    tol(dtype),
                    &format!("{what}: dense"),
                );
                assert_eq!(dc.to_dense().unwrap(), want.to_dense(), "{what}: CSR dense");
            }
        }
    }
    // Sizes beyond cuSPARSE's 32-bit conversions are a clear error, not a crash.
    let huge = 3_000_000_000usize;
    let a = coo(
        huge,
        huge,
        &[(5, 7, 1.0), (2_999_999_999, 0, 2.0)],
        DType::I64,
        DType::F32,
    );
    let d = DeviceCoo::upload(0, &a).unwrap();
    let e = d.to_csr().unwrap_err().to_string();
    assert!(e.contains("32-bit"), "{e}");
    assert_eq!(d.to_host().unwrap(), a);
}
