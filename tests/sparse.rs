//! Sparse matrices in files (one tensor per component): npy and safetensors round trips for CSR
//! and COO of every value and index dtype, and damaged files, which must be errors naming the
//! component.

use rustytorch::npy::save_safetensors;
use rustytorch::sparse::*;
use rustytorch::{DType, HostTensor};

fn dir(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("rustytorch_sparse_{tag}_{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn csr_and_coo_round_trip_through_npy_and_safetensors() {
    let d = dir("rt");
    for (k, dtype) in [DType::F32, DType::F64, DType::F16, DType::BF16]
        .into_iter()
        .enumerate()
    {
        for index in [DType::I32, DType::I64] {
            let a = random_csr(7, 5, 0.3, dtype, index, k as u64).unwrap();
            let coo = a.to_coo();
            let st = d.join("m.safetensors");
            save_sparse_safetensors(&st, "a", &a).unwrap();
            assert_eq!(load_sparse_safetensors::<CsrMatrix>(&st, "a").unwrap(), a);
            save_sparse_safetensors(&st, "a", &coo).unwrap();
            assert_eq!(load_sparse_safetensors::<CooMatrix>(&st, "a").unwrap(), coo);
            save_sparse_npy(&d, "a", &a).unwrap();
            let back: CsrMatrix = load_sparse_npy(&d, "a").unwrap();
            // numpy has no bf16: its values come back as (the same) f32 values.
            let want = if dtype == DType::BF16 {
                a.to_dtype(DType::F32).unwrap()
            } else {
                a.clone()
            };
            assert_eq!(back, want);
            save_sparse_npy(&d, "c", &coo).unwrap();
            let back: CooMatrix = load_sparse_npy(&d, "c").unwrap();
            assert_eq!(back.to_dense().to_f64_vec(), coo.to_dense().to_f64_vec());
        }
    }
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn damaged_files_are_errors_naming_the_component() {
    let d = dir("bad");
    let a = random_csr(4, 4, 0.5, DType::F32, DType::I64, 3).unwrap();
    let st = d.join("bad.safetensors");
    let mut tensors = to_tensors("a", &a);
    // Row pointers that decrease.
    let n = a.rows() + 1;
    let mut rp = vec![0i64; n];
    rp[1] = a.nnz() as i64;
    rp[n - 1] = a.nnz() as i64;
    tensors[0].1 = HostTensor::from_vec(rp, [n]).unwrap();
    save_safetensors(&st, &tensors).unwrap();
    let e = load_sparse_safetensors::<CsrMatrix>(&st, "a")
        .unwrap_err()
        .to_string();
    assert!(e.contains("row_ptr decreases"), "{e}");
    // A missing component, and a bad shape.
    save_safetensors(&st, &to_tensors("a", &a)[1..]).unwrap();
    let e = load_sparse_safetensors::<CsrMatrix>(&st, "a")
        .unwrap_err()
        .to_string();
    assert!(e.contains("no tensor `a.row_ptr`"), "{e}");
    let mut tensors = to_tensors("a", &a);
    tensors[3].1 = HostTensor::from_vec(vec![-4i64, 4], [2]).unwrap();
    let e = from_tensors::<CsrMatrix>("a", &tensors)
        .unwrap_err()
        .to_string();
    assert!(e.contains("negative dim"), "{e}");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn sparse_matmul_compiles_runs_and_trains_its_values() {
    use rustytorch::prelude::*;
    let (m, k, n) = (9, 7, 3);
    let a = random_csr(m, k, 0.3, DType::F32, DType::I64, 5).unwrap();
    let x =
        rustytorch::ops::testing::rand_tensor(&TensorType::new(DType::F32, [k, n]), 6, -1.0, 1.0);
    let g = GraphBuilder::new();
    let pattern = CsrPattern::constant(&g, &a);
    let values = g.param_typed(
        "values",
        TensorType::new(DType::F32, [a.nnz()]),
        Init::zeros(),
        true,
    );
    let xt = g.input("x", DType::F32, [k, n]);
    let y = pattern.matmul(&values, &xt);
    let loss = y.mul(&y).sum_all();
    g.train_step(&loss, Sgd::new(0.1), &StepOptions::default())
        .unwrap();
    let mut exe = compile(&g, &[&y], Device::Cpu).unwrap();
    exe.set_param("values", a.values().clone()).unwrap();
    let got = exe.run(&[("x", x.clone())]).unwrap();
    let want = a.matmul_dense(&x).unwrap();
    assert_eq!(got[0].to_f64_vec(), want.to_f64_vec());
    // One SGD step on sum(y²): dv = 2·sampled(y, x) at the pattern, so the values moved.
    let v1 = exe.param("values").unwrap();
    assert_eq!(v1.dims(), &[a.nnz()]);
    assert_ne!(v1.to_f64_vec(), a.values().to_f64_vec());
}
