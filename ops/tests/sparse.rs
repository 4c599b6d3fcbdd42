//! Sparse matrices: CSR/COO validation and conversions, transpose, SpGEMM and the graph ops
//! `sparse_matmul` / `sampled_matmul` against dense float64 products on seeded random matrices
//! (empty rows, empty matrices, repeated COO entries, 1×N and N×1, rectangular, dense-ish rows),
//! for every value and index dtype; gradchecks of both ops' rules.

use rustytorch_ops::sparse::random_csr;
use rustytorch_ops::testing::{assert_close, gradcheck, rand_tensor, tolerance};
use rustytorch_ops::{
    eval_cpu, infer, spgemm, CooMatrix, CsrMatrix, DType, HostTensor, Op, OpError, TensorType,
};

const FLOATS: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];
const INDEX: [DType; 2] = [DType::I32, DType::I64];

fn ty(dtype: DType, dims: &[usize]) -> TensorType {
    TensorType::new(dtype, dims.to_vec())
}

fn idx(dtype: DType, v: &[i64]) -> HostTensor {
    HostTensor::from_f64_slice(
        &ty(dtype, &[v.len()]),
        &v.iter().map(|&x| x as f64).collect::<Vec<_>>(),
    )
    .unwrap()
}

fn vals(dtype: DType, v: &[f64]) -> HostTensor {
    HostTensor::from_f64_slice(&ty(dtype, &[v.len()]), v).unwrap()
}

/// Dense row-major f64 product of [m,k]·[k,n].
fn dense_mm(a: &[f64], b: &[f64], m: usize, k: usize, n: usize) -> Vec<f64> {
    let mut c = vec![0.0; m * n];
    for i in 0..m {
        for p in 0..k {
            for j in 0..n {
                c[i * n + j] += a[i * k + p] * b[p * n + j];
            }
        }
    }
    c
}

fn transpose(a: &[f64], m: usize, n: usize) -> Vec<f64> {
    (0..n * m).map(|p| a[(p % m) * n + p / m]).collect()
}

/// The shapes every product test covers: (m, k, n, density of A, density of B). The last two
/// are wide: rows with many products for their width (the branch-free path) and rows with a few
/// products spread over many columns (sorted).
const SHAPES: [(usize, usize, usize, f64, f64); 12] = [
    (0, 0, 0, 0.5, 0.5),
    (0, 5, 3, 0.5, 0.5),
    (4, 0, 3, 0.5, 0.5),
    (4, 6, 0, 0.5, 0.5),
    (1, 17, 1, 0.4, 0.4),
    (17, 1, 17, 0.5, 0.5),
    (23, 31, 19, 0.08, 0.1),
    (40, 12, 9, 0.02, 0.6),
    (9, 40, 64, 0.9, 0.7),
    (64, 64, 64, 0.05, 0.05),
    (30, 200, 3000, 0.02, 0.01),
    (30, 200, 3000, 0.01, 0.002),
];

#[test]
fn spgemm_matches_the_dense_product() {
    for (case, &(m, k, n, da, db)) in SHAPES.iter().enumerate() {
        for (t, &dtype) in FLOATS.iter().enumerate() {
            for &index in &INDEX {
                let seed = (case * 10 + t) as u64;
                let a = random_csr(m, k, da, dtype, index, seed).unwrap();
                let b = random_csr(k, n, db, dtype, index, seed + 500).unwrap();
                let c = spgemm(&a, &b).unwrap();
                let what = format!("spgemm {m}x{k}·{k}x{n} {dtype} {index}");
                assert_eq!(c.shape(), (m, n), "{what}");
                assert_eq!((c.dtype(), c.index_dtype()), (dtype, index), "{what}");
                // The result satisfies every CSR invariant (sorted, unique, in range).
                let (rp, ci, v) = c.clone().into_parts();
                CsrMatrix::new(m, n, rp, ci, v).unwrap_or_else(|e| panic!("{what}: {e}"));
                let want = dense_mm(
                    &a.to_dense().to_f64_vec(),
                    &b.to_dense().to_f64_vec(),
                    m,
                    k,
                    n,
                );
                // Low-precision values are rounded once from an f32 sum of exact products.
                let tol = tolerance(dtype).max(if dtype == DType::F64 { 0.0 } else { 1e-5 }) * 4.0;
                assert_close(&c.to_dense().to_f64_vec(), &want, tol, &what);
            }
        }
    }
}

/// The blocks' buffers are kept between products: products of other sizes and types in between
/// (on several threads at once) leave a repeated product's result unchanged, and each result
/// still matches the dense product.
#[test]
fn spgemm_results_do_not_depend_on_earlier_products() {
    let big = |dtype, index, seed| {
        let a = random_csr(300, 200, 0.05, dtype, index, seed).unwrap();
        let b = random_csr(200, 400, 0.05, dtype, index, seed + 1).unwrap();
        (a, b)
    };
    let (a, b) = big(DType::F32, DType::I32, 1);
    let first = spgemm(&a, &b).unwrap();
    let want = dense_mm(
        &a.to_dense().to_f64_vec(),
        &b.to_dense().to_f64_vec(),
        300,
        200,
        400,
    );
    assert_close(&first.to_dense().to_f64_vec(), &want, 1e-5, "first product");
    for round in 0..3u64 {
        std::thread::scope(|s| {
            for (t, (dtype, index)) in [
                (DType::F64, DType::I64),
                (DType::F32, DType::I32),
                (DType::BF16, DType::I32),
                (DType::F16, DType::I64),
            ]
            .into_iter()
            .enumerate()
            {
                s.spawn(move || {
                    let (x, y) = big(dtype, index, 10 + round * 4 + t as u64);
                    let c = spgemm(&x, &y).unwrap();
                    let (rp, ci, v) = c.into_parts();
                    CsrMatrix::new(300, 400, rp, ci, v).unwrap();
                });
            }
        });
        // Smaller and larger products of the first one's types.
        let small = random_csr(20, 200, 0.1, DType::F32, DType::I32, 7 + round).unwrap();
        spgemm(&small, &b).unwrap();
        let again = spgemm(&a, &b).unwrap();
        assert_eq!(again, first, "round {round}");
    }
}

#[test]
fn spgemm_keeps_rows_with_one_nonzero_and_empty_rows() {
    // A: row 0 has one entry, row 1 none, row 2 two entries hitting one column of B twice.
    let a = CsrMatrix::new(
        3,
        3,
        idx(DType::I32, &[0, 1, 1, 3]),
        idx(DType::I32, &[2, 0, 1]),
        vals(DType::F64, &[2.0, 1.0, -1.0]),
    )
    .unwrap();
    let b = CsrMatrix::new(
        3,
        4,
        idx(DType::I32, &[0, 2, 3, 4]),
        idx(DType::I32, &[1, 3, 3, 0]),
        vals(DType::F64, &[1.0, 2.0, 2.0, 5.0]),
    )
    .unwrap();
    let c = spgemm(&a, &b).unwrap();
    // Row 2: 1·B[0] − 1·B[1] = [0, 1, 0, 2−2]: the cancelled entry stays in the pattern.
    assert_eq!(c.row_ptr().to_f64_vec(), [0.0, 1.0, 1.0, 3.0]);
    assert_eq!(c.col_idx().to_f64_vec(), [0.0, 1.0, 3.0]);
    assert_eq!(c.values().to_f64_vec(), [10.0, 1.0, 0.0]);
}

#[test]
fn spgemm_errors_name_the_shapes_and_dtypes() {
    let a = random_csr(3, 4, 0.5, DType::F32, DType::I32, 1).unwrap();
    let b = random_csr(5, 2, 0.5, DType::F32, DType::I32, 2).unwrap();
    let e = spgemm(&a, &b).unwrap_err().to_string();
    assert!(
        e.contains("spgemm") && e.contains("f32[3,4]") && e.contains("f32[5,2]"),
        "{e}"
    );
    let b = random_csr(4, 2, 0.5, DType::F64, DType::I32, 2).unwrap();
    let e = spgemm(&a, &b).unwrap_err().to_string();
    assert!(e.contains("one value dtype"), "{e}");
    let b = random_csr(4, 2, 0.5, DType::F32, DType::I64, 2).unwrap();
    let e = spgemm(&a, &b).unwrap_err().to_string();
    assert!(e.contains("i32") && e.contains("i64"), "{e}");
}

#[test]
fn coo_duplicates_add_up_in_csr_and_dense() {
    for &dtype in &FLOATS {
        for &index in &INDEX {
            // (1,2) three times, (0,0) twice, unsorted.
            let coo = CooMatrix::new(
                3,
                4,
                idx(index, &[1, 0, 1, 2, 1, 0]),
                idx(index, &[2, 0, 2, 3, 2, 0]),
                vals(dtype, &[0.5, 1.0, 0.25, -2.0, 0.25, 2.0]),
            )
            .unwrap();
            let mut want = vec![0.0; 12];
            want[0] = 3.0;
            want[4 + 2] = 1.0;
            want[8 + 3] = -2.0;
            assert_eq!(coo.to_dense().to_f64_vec(), want);
            let csr = coo.to_csr().unwrap();
            assert_eq!(csr.nnz(), 3);
            assert_eq!(csr.row_ptr().to_f64_vec(), [0.0, 1.0, 2.0, 3.0]);
            assert_eq!(csr.col_idx().to_f64_vec(), [0.0, 2.0, 3.0]);
            assert_eq!(csr.to_dense().to_f64_vec(), want);
            assert_eq!((csr.dtype(), csr.index_dtype()), (dtype, index));
            // CSR -> COO -> CSR is the identity; the transposes agree with the dense one.
            assert_eq!(csr.to_coo().to_csr().unwrap(), csr);
            let t = transpose(&want, 3, 4);
            assert_eq!(csr.transpose().to_dense().to_f64_vec(), t);
            assert_eq!(coo.transpose().to_dense().to_f64_vec(), t);
            assert_eq!(csr.transpose().transpose(), csr);
        }
    }
}

#[test]
fn dense_round_trips_and_random_transposes() {
    for (case, &(m, k, _, d, _)) in SHAPES.iter().enumerate() {
        let a = random_csr(m, k, d, DType::F64, DType::I64, case as u64).unwrap();
        let dense = a.to_dense();
        assert_eq!(CsrMatrix::from_dense(&dense, DType::I64).unwrap(), a);
        assert_eq!(
            CooMatrix::from_dense(&dense, DType::I32)
                .unwrap()
                .to_dense(),
            dense
        );
        let t = a.transpose();
        assert_eq!(t.shape(), (k, m));
        assert_eq!(
            t.to_dense().to_f64_vec(),
            transpose(&dense.to_f64_vec(), m, k)
        );
    }
}

fn csr_err(rows: usize, cols: usize, rp: &[i64], ci: &[i64]) -> String {
    CsrMatrix::new(
        rows,
        cols,
        idx(DType::I64, rp),
        idx(DType::I64, ci),
        vals(DType::F32, &vec![1.0; ci.len()]),
    )
    .unwrap_err()
    .to_string()
}

#[test]
fn untrusted_index_data_gives_clear_errors() {
    let cases: [(&[i64], &[i64], &str); 8] = [
        (
            &[0, 1, 2],
            &[0, 1],
            "row_ptr has 3 entries but 3 rows need 4",
        ),
        (&[1, 1, 2, 2], &[0, 1], "row_ptr[0] is 1 but must be 0"),
        (&[0, 2, 1, 2], &[0, 1], "row_ptr decreases at row 1"),
        (
            &[0, 1, 1, 3],
            &[0, 1],
            "row_ptr[3] is 3 but there are 2 column indices",
        ),
        (
            &[0, 1, 1, 2],
            &[0, 4],
            "col_idx[1] = 4 (row 2) is out of range for 4 columns",
        ),
        (
            &[0, 1, 1, 2],
            &[-1, 0],
            "col_idx[0] = -1 (row 0) is out of range",
        ),
        (
            &[0, 2, 2, 2],
            &[3, 1],
            "not strictly increasing: col_idx[1] = 1 after 3",
        ),
        (
            &[0, 2, 2, 2],
            &[1, 1],
            "not strictly increasing: col_idx[1] = 1 after 1",
        ),
    ];
    for (rp, ci, want) in cases {
        let e = csr_err(3, 4, rp, ci);
        assert!(
            e.starts_with("csr: ") && e.contains(want),
            "{rp:?} {ci:?}: {e}"
        );
    }
    let e = CsrMatrix::new(
        1,
        2,
        idx(DType::I32, &[0, 1]),
        idx(DType::I64, &[0]),
        vals(DType::F32, &[1.0]),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("one index dtype"), "{e}");
    let e = CsrMatrix::new(
        1,
        2,
        idx(DType::I64, &[0, 1]),
        idx(DType::I64, &[0]),
        vals(DType::F32, &[1.0, 2.0]),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("col_idx has 1 entries but values has 2"), "{e}");
    let e = CsrMatrix::new(
        1,
        2,
        idx(DType::I64, &[0, 1]),
        idx(DType::I64, &[0]),
        idx(DType::I64, &[1]),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("values must be f32, f64, f16 or bf16"), "{e}");
    let e = CsrMatrix::new(
        (i32::MAX as usize) + 1,
        2,
        idx(DType::I32, &[0]),
        idx(DType::I32, &[]),
        vals(DType::F32, &[]),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("use i64 indices"), "{e}");
    let e = CooMatrix::new(
        2,
        3,
        idx(DType::I32, &[0, 2]),
        idx(DType::I32, &[0, 1]),
        vals(DType::F32, &[1.0, 1.0]),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("coo: row_idx[1] = 2 is out of range for 2"),
        "{e}"
    );
}

/// A random CSR pattern as graph-op inputs (f64 values), possibly with unsorted and repeated
/// column indices within rows.
fn op_inputs(
    rows: usize,
    cols: usize,
    density: f64,
    index: DType,
    dtype: DType,
    seed: u64,
) -> (CsrMatrix, [HostTensor; 3]) {
    let a = random_csr(rows, cols, density, dtype, index, seed).unwrap();
    let (rp, ci, v) = a.clone().into_parts();
    (a, [rp, ci, v])
}

#[test]
fn sparse_matmul_matches_the_dense_product() {
    for (case, &(m, k, n, d, _)) in SHAPES.iter().enumerate() {
        for (t, &dtype) in FLOATS.iter().enumerate() {
            for &index in &INDEX {
                let seed = (case * 10 + t) as u64;
                let (a, [rp, ci, v]) = op_inputs(m, k, d, index, dtype, seed);
                let ad = a.to_dense().to_f64_vec();
                let tol = tolerance(dtype) * 4.0;
                for trans_a in [false, true] {
                    let (inner, outer) = if trans_a { (m, k) } else { (k, m) };
                    let x = rand_tensor(&ty(dtype, &[inner, n]), seed + 7, -1.0, 1.0);
                    let op = Op::SparseMatmul {
                        rows: m,
                        cols: k,
                        trans_a,
                    };
                    let y = eval_cpu(&op, &[&rp, &ci, &v, &x]).unwrap();
                    assert_eq!(y.ty(), ty(dtype, &[outer, n]));
                    let at = if trans_a {
                        transpose(&ad, m, k)
                    } else {
                        ad.clone()
                    };
                    let want = dense_mm(&at, &x.to_f64_vec(), outer, inner, n);
                    let what = format!("{op} {m}x{k} n={n} {dtype} {index}");
                    assert_close(&y.to_f64_vec(), &want, tol, &what);
                    if !trans_a {
                        assert_eq!(a.matmul_dense(&x).unwrap(), y);
                    }
                }
            }
        }
    }
}

#[test]
fn sampled_matmul_matches_the_dense_product_at_the_pattern() {
    for (case, &(m, n, k, d, _)) in SHAPES.iter().enumerate() {
        for (t, &dtype) in FLOATS.iter().enumerate() {
            let seed = (case * 10 + t) as u64;
            let (pat, [rp, ci, _]) = op_inputs(m, n, d, DType::I32, dtype, seed);
            let a = rand_tensor(&ty(dtype, &[m, k]), seed + 1, -1.0, 1.0);
            let b = rand_tensor(&ty(dtype, &[n, k]), seed + 2, -1.0, 1.0);
            let s = eval_cpu(&Op::SampledMatmul, &[&rp, &ci, &a, &b]).unwrap();
            assert_eq!(s.ty(), ty(dtype, &[pat.nnz()]));
            let full = dense_mm(&a.to_f64_vec(), &transpose(&b.to_f64_vec(), n, k), m, k, n);
            let coo = pat.to_coo();
            let want: Vec<f64> = coo
                .row_idx()
                .to_f64_vec()
                .iter()
                .zip(coo.col_idx().to_f64_vec())
                .map(|(&r, c)| full[r as usize * n + c as usize])
                .collect();
            assert_close(
                &s.to_f64_vec(),
                &want,
                tolerance(dtype) * 4.0,
                "sampled_matmul",
            );
        }
    }
}

#[test]
fn sparse_matmul_takes_unsorted_and_repeated_columns() {
    // Row 0: columns 2, 0, 2 (repeated: adds up); row 1 empty; row 2: column 1.
    let rp = idx(DType::I64, &[0, 3, 3, 4]);
    let ci = idx(DType::I64, &[2, 0, 2, 1]);
    let v = vals(DType::F64, &[1.0, 2.0, 3.0, -1.0]);
    let x = HostTensor::from_vec(vec![1.0f64, 2.0, 3.0, 4.0, 5.0, 6.0], [3, 2]).unwrap();
    let op = Op::SparseMatmul {
        rows: 3,
        cols: 3,
        trans_a: false,
    };
    let y = eval_cpu(&op, &[&rp, &ci, &v, &x]).unwrap();
    assert_eq!(
        y.to_f64_vec(),
        [2.0 + 20.0, 4.0 + 24.0, 0.0, 0.0, -3.0, -4.0]
    );
}

#[test]
fn sparse_op_errors_name_op_shapes_and_dtypes() {
    let i = |n: usize| ty(DType::I64, &[n]);
    let f = |d: &[usize]| ty(DType::F32, d);
    let op = Op::SparseMatmul {
        rows: 3,
        cols: 4,
        trans_a: false,
    };
    let cases: [(&Op, Vec<TensorType>, &str); 7] = [
        (
            &op,
            vec![i(4), i(5), f(&[5]), f(&[3, 2])],
            "A·x needs x with 4 rows (A is 3×4), got 3",
        ),
        (
            &op,
            vec![i(3), i(5), f(&[5]), f(&[4, 2])],
            "row_ptr must have rows + 1 = 4 entries",
        ),
        (
            &op,
            vec![i(4), i(5), f(&[6]), f(&[4, 2])],
            "values must be 1-D with one entry per column index (5)",
        ),
        (
            &op,
            vec![i(4), ty(DType::I32, &[5]), f(&[5]), f(&[4, 2])],
            "both be i32 or both be i64",
        ),
        (
            &op,
            vec![i(4), i(5), f(&[5]), ty(DType::F64, &[4, 2])],
            "one float dtype",
        ),
        (
            &Op::SampledMatmul,
            vec![i(4), i(5), f(&[3, 2]), f(&[4, 3])],
            "one column count",
        ),
        (
            &Op::SampledMatmul,
            vec![i(3), i(5), f(&[3, 2]), f(&[4, 2])],
            "row_ptr must have a's rows + 1 = 4",
        ),
    ];
    for (op, tys, want) in cases {
        let refs: Vec<&TensorType> = tys.iter().collect();
        let e = infer(op, &refs).unwrap_err().to_string();
        assert!(e.starts_with(op.name()) && e.contains(want), "{e}");
        assert!(e.contains(&tys[3].to_string()), "{e}");
    }
    let t = Op::SparseMatmul {
        rows: 3,
        cols: 4,
        trans_a: true,
    };
    let e = infer(&t, &[&i(4), &i(5), &f(&[5]), &f(&[4, 2])])
        .unwrap_err()
        .to_string();
    assert!(e.contains("Aᵀ·x needs x with 3 rows"), "{e}");
    // A bad pattern is a runtime error naming the op.
    let x = HostTensor::from_vec(vec![1.0f32; 8], [4, 2]).unwrap();
    let v = vals(DType::F32, &[1.0; 2]);
    let bad = [
        (
            idx(DType::I64, &[0, 2, 1, 2]),
            idx(DType::I64, &[0, 1]),
            "row_ptr decreases at row 1",
        ),
        (
            idx(DType::I64, &[0, 1, 1, 2]),
            idx(DType::I64, &[0, 4]),
            "out of range for 4 columns",
        ),
        (
            idx(DType::I64, &[0, 1, 1, 1]),
            idx(DType::I64, &[0, 1]),
            "row_ptr[3] is 1 but there are 2",
        ),
    ];
    for (rp, ci, want) in bad {
        let e = eval_cpu(&op, &[&rp, &ci, &v, &x]).unwrap_err();
        assert!(
            matches!(
                e,
                OpError::Runtime {
                    op: "sparse_matmul",
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains(want), "{e}");
    }
}

#[test]
fn gradients_match_finite_differences() {
    for (m, k, n) in [(5, 4, 3), (1, 6, 2), (6, 1, 4)] {
        for trans_a in [false, true] {
            let (_, [rp, ci, v]) = op_inputs(m, k, 0.5, DType::I64, DType::F64, (m * k) as u64);
            let inner = if trans_a { m } else { k };
            let x = rand_tensor(&ty(DType::F64, &[inner, n]), 3, -1.0, 1.0);
            let op = Op::SparseMatmul {
                rows: m,
                cols: k,
                trans_a,
            };
            gradcheck(&op, &[rp, ci, v, x], &[2, 3], 11).unwrap();
        }
        let (_, [rp, ci, _]) = op_inputs(m, k, 0.5, DType::I32, DType::F64, 9);
        let a = rand_tensor(&ty(DType::F64, &[m, n]), 4, -1.0, 1.0);
        let b = rand_tensor(&ty(DType::F64, &[k, n]), 5, -1.0, 1.0);
        gradcheck(&Op::SampledMatmul, &[rp, ci, a, b], &[2, 3], 12).unwrap();
    }
}

#[test]
fn the_values_gradient_lives_only_at_the_nonzeros() {
    // A dense weight would get a gradient everywhere; the sparse one has one entry per nonzero
    // and equals the dense gradient G·Xᵀ read at the pattern.
    let (m, k, n) = (6, 5, 3);
    let (a, [rp, ci, v]) = op_inputs(m, k, 0.3, DType::I64, DType::F64, 21);
    let x = rand_tensor(&ty(DType::F64, &[k, n]), 22, -1.0, 1.0);
    let g = rand_tensor(&ty(DType::F64, &[m, n]), 23, -1.0, 1.0);
    let op = Op::SparseMatmul {
        rows: m,
        cols: k,
        trans_a: false,
    };
    let grads = rustytorch_ops::testing::vjp_eager(&op, &[rp, ci, v, x.clone()], &g).unwrap();
    assert!(grads[0].is_none() && grads[1].is_none());
    let dv = grads[2].clone().unwrap();
    assert_eq!(dv.dims(), &[a.nnz()]);
    let full = dense_mm(&g.to_f64_vec(), &transpose(&x.to_f64_vec(), k, n), m, n, k);
    let coo = a.to_coo();
    let want: Vec<f64> = coo
        .row_idx()
        .to_f64_vec()
        .iter()
        .zip(coo.col_idx().to_f64_vec())
        .map(|(&r, c)| full[r as usize * k + c as usize])
        .collect();
    assert_close(&dv.to_f64_vec(), &want, 1e-12, "dv");
}
