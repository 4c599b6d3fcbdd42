//! The SDDMM kernel (`sampled_matmul` on CUDA) in the IR interpreter against the CPU kernel:
//! every value and index dtype, unsorted and repeated columns, empty rows, no entries; and SpMM
//! lowered to its cuSPARSE descriptor.

mod common;

use common::{check, ty};
use rustytorch_codegen::cuda::{lower_step, CudaStep, SpmmDesc};
use rustytorch_ops::testing::rand_tensor;
use rustytorch_ops::{DType, HostTensor, Op};

fn idx(d: DType, v: &[i64]) -> HostTensor {
    HostTensor::from_vec(v.to_vec(), [v.len()]).unwrap().cast(d)
}

#[test]
fn sddmm_matches_the_cpu() {
    let mut seed = 1;
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        for index in [DType::I32, DType::I64] {
            let patterns: [(usize, usize, &[i64], &[i64]); 3] = [
                (5, 7, &[0, 3, 3, 6, 6, 9], &[6, 0, 6, 2, 1, 2, 5, 0, 3]),
                (3, 2, &[0, 0, 0, 0], &[]),
                (1, 4, &[0, 4], &[3, 2, 1, 0]),
            ];
            for (m, n, rp, ci) in patterns {
                for k in [1, 5, 40] {
                    seed += 1;
                    let a = rand_tensor(&ty(dtype, &[m, k]), seed, -1.0, 1.0);
                    let b = rand_tensor(&ty(dtype, &[n, k]), seed + 50, -1.0, 1.0);
                    let (rp, ci) = (idx(index, rp), idx(index, ci));
                    check(
                        &Op::SampledMatmul,
                        &[&rp, &ci, &a, &b],
                        &format!("sddmm {m}x{n} k {k} {dtype}/{index}"),
                    );
                }
            }
        }
    }
}

#[test]
fn spmm_lowers_to_one_cusparse_call() {
    let op = Op::SparseMatmul {
        rows: 6,
        cols: 4,
        trans_a: true,
    };
    let ins = [
        ty(DType::I64, &[7]),
        ty(DType::I64, &[10]),
        ty(DType::BF16, &[10]),
        ty(DType::BF16, &[6, 3]),
    ];
    let refs: Vec<_> = ins.iter().collect();
    let out = ty(DType::BF16, &[4, 3]);
    let CudaStep::Spmm(d) = lower_step(&op, &refs, &out).unwrap() else {
        panic!("not an SpMM step");
    };
    assert_eq!(
        d,
        SpmmDesc {
            rows: 6,
            cols: 4,
            nnz: 10,
            n: 3,
            trans_a: true,
            index: DType::I64,
            dtype: DType::BF16,
        }
    );
    assert_eq!(d.out_rows(), 4);
    assert!(!d.is_empty());
}
