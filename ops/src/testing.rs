//! Test support shared by the ops' tests and the workspace tests: seeded random tensors (never
//! zeros), float64 comparisons with per-dtype tolerances, and `gradcheck` of one op's gradient rule
//! against central finite differences, evaluated eagerly with the CPU kernels.

use crate::{
    eval_cpu, rng, vjp, DType, GradBuilder, HostTensor, Op, OpError, Result, Shape, TensorType,
    Value, VjpCtx,
};

/// Uniform random values in [lo, hi), seeded. With `lo < 0 < hi` a value is never exactly zero in
/// practice; use `lo > 0` where zero must be impossible.
pub fn rand_f64(n: usize, seed: u64, lo: f64, hi: f64) -> Vec<f64> {
    (0..n)
        .map(|i| lo + (hi - lo) * rng::uniform01(seed, i as u64))
        .collect()
}

/// A random tensor of `ty` (floats uniform in [lo, hi); ints in [lo, hi) truncated; bool random).
pub fn rand_tensor(ty: &TensorType, seed: u64, lo: f64, hi: f64) -> HostTensor {
    let n = ty.shape.numel();
    let vals: Vec<f64> = match ty.dtype {
        DType::Bool => (0..n)
            .map(|i| (rng::uniform01(seed, i as u64) < 0.5) as u8 as f64)
            .collect(),
        d if d.is_int() => rand_f64(n, seed, lo, hi)
            .into_iter()
            .map(f64::floor)
            .collect(),
        _ => rand_f64(n, seed, lo, hi),
    };
    HostTensor::from_f64_slice(ty, &vals).expect("sizes match")
}

/// Seeded input `k` of an op sample whose inputs have types `tys` (see [`Op::samples`]): floats
/// uniform in [-1, 1), integers in {0, 1}, bools random; the row pointers of a sparse op (its
/// input 0) are a valid CSR row-pointer array over `tys[1]`'s nonzeros, with random row lengths.
pub fn sample_input(op: &Op, tys: &[TensorType], k: usize, seed: u64) -> HostTensor {
    let ty = &tys[k];
    if k == 0 && matches!(op, Op::SparseMatmul { .. } | Op::SampledMatmul) {
        let rows = ty.shape.numel().saturating_sub(1);
        let nnz = tys.get(1).map_or(0, |t| t.shape.numel());
        // Row boundaries at sorted random cut points in 0..=nnz: random lengths, empty rows too.
        let mut cuts: Vec<f64> = rand_f64(rows.saturating_sub(1), seed, 0.0, nnz as f64 + 1.0)
            .into_iter()
            .map(f64::floor)
            .collect();
        cuts.sort_by(f64::total_cmp);
        let mut row_ptr = vec![0.0];
        row_ptr.extend(cuts);
        if rows > 0 {
            row_ptr.push(nnz as f64);
        }
        return HostTensor::from_f64_slice(ty, &row_ptr).expect("sizes match");
    }
    let (lo, hi) = if ty.dtype.is_float() {
        (-1.0, 1.0)
    } else {
        (0.0, 2.0)
    };
    rand_tensor(ty, seed, lo, hi)
}

/// Absolute+relative tolerance used to compare a dtype's results against a float64 reference.
pub fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F64 => 1e-10,
        DType::F32 => 1e-5,
        DType::F16 => 2e-3,
        DType::BF16 => 1.6e-2,
        _ => 0.0,
    }
}

/// Asserts `got` equals `want` elementwise within `tol` (absolute + relative), NaNs matching.
pub fn assert_close(got: &[f64], want: &[f64], tol: f64, what: &str) {
    assert_eq!(
        got.len(),
        want.len(),
        "{what}: length {} vs {}",
        got.len(),
        want.len()
    );
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let ok = (g.is_nan() && w.is_nan()) || g == w || (g - w).abs() <= tol * (1.0 + w.abs());
        assert!(ok, "{what}: element {i}: got {g}, want {w} (tol {tol})");
    }
}

/// A [`GradBuilder`] that evaluates every emitted op at once with the CPU kernels.
pub struct Eager {
    /// Every value so far.
    pub values: Vec<HostTensor>,
}

impl GradBuilder for Eager {
    fn ty(&self, v: Value) -> TensorType {
        self.values[v].ty()
    }
    fn emit(&mut self, op: Op, inputs: &[Value]) -> Result<Value> {
        let ins: Vec<&HostTensor> = inputs.iter().map(|&i| &self.values[i]).collect();
        let out = eval_cpu(&op, &ins)?;
        self.values.push(out);
        Ok(self.values.len() - 1)
    }
}

/// The gradients `op`'s rule gives for the loss `sum(op(inputs) * cotangent)`; `None` for inputs
/// without a gradient.
pub fn vjp_eager(
    op: &Op,
    inputs: &[HostTensor],
    cotangent: &HostTensor,
) -> Result<Vec<Option<HostTensor>>> {
    let mut e = Eager {
        values: inputs.to_vec(),
    };
    let ids: Vec<Value> = (0..inputs.len()).collect();
    let out = e.emit(op.clone(), &ids)?;
    e.values.push(cotangent.clone());
    let grad = e.values.len() - 1;
    let mut cx = VjpCtx {
        b: &mut e,
        op,
        inputs: &ids,
        output: out,
        grad,
    };
    let gs = vjp(&mut cx)?;
    Ok(gs
        .into_iter()
        .map(|g| g.map(|v| e.values[v].clone()))
        .collect())
}

/// Checks `op`'s gradient rule against central finite differences in float64, for every input in
/// `check` (by position). Inputs must be f64 where checked. Panics with the op, input and element on
/// a mismatch; errors when the rule or a kernel fails.
pub fn gradcheck(op: &Op, inputs: &[HostTensor], check: &[usize], seed: u64) -> Result<()> {
    let refs: Vec<&HostTensor> = inputs.iter().collect();
    let out = eval_cpu(op, &refs)?;
    let cot_ty = TensorType::new(DType::F64, out.shape().clone());
    let cot = rand_tensor(&cot_ty, seed ^ 0xC07, -1.0, 1.0);
    let cot_v = cot.to_f64_vec();
    let loss = |ins: &[HostTensor]| -> Result<f64> {
        let r: Vec<&HostTensor> = ins.iter().collect();
        let o = eval_cpu(op, &r)?.to_f64_vec();
        Ok(o.iter().zip(&cot_v).map(|(a, b)| a * b).sum())
    };
    let grads = vjp_eager(op, inputs, &cot)?;
    for &i in check {
        let g = grads
            .get(i)
            .cloned()
            .flatten()
            .ok_or_else(|| OpError::Runtime {
                op: op.name(),
                reason: format!("no gradient for input {i}"),
            })?;
        if g.shape() != inputs[i].shape() {
            panic!(
                "{}: gradient of input {i} has shape {} but the input has {}",
                op.name(),
                g.shape(),
                inputs[i].shape()
            );
        }
        let analytic = g.to_f64_vec();
        let base = inputs[i].to_f64_vec();
        let h = 1e-6;
        for k in 0..base.len() {
            let mut plus = inputs.to_vec();
            let mut minus = inputs.to_vec();
            let mut p = base.clone();
            p[k] += h;
            plus[i] = HostTensor::from_f64_slice(&inputs[i].ty(), &p)?;
            let mut m = base.clone();
            m[k] -= h;
            minus[i] = HostTensor::from_f64_slice(&inputs[i].ty(), &m)?;
            let numeric = (loss(&plus)? - loss(&minus)?) / (2.0 * h);
            let a = analytic[k];
            assert!(
                (a - numeric).abs() <= 1e-5 * (1.0 + numeric.abs()),
                "{}: gradient of input {i} element {k}: rule {a}, finite difference {numeric}",
                op.name()
            );
        }
    }
    Ok(())
}

/// Shorthand for an f64 tensor type.
pub fn f64_ty(dims: &[usize]) -> TensorType {
    TensorType::new(DType::F64, Shape::new(dims))
}

/// `[B, H, S, D]` ↔ `[B, S, H, D]`: the transpose between attention's two layouts (its own
/// inverse).
pub fn swap_heads(t: &HostTensor) -> HostTensor {
    crate::eval_cpu(
        &Op::Permute {
            perm: vec![0, 2, 1, 3],
        },
        &[t],
    )
    .expect("a rank-4 tensor")
}
