//! Matmul lowering: `Matmul` and `MatmulEpilogue` become cuBLASLt calls described by plain data
//! ([`MatmulDesc`]); the runtime owns the handles and caches the algorithm per descriptor.
//!
//! Row-major `C[M,N] = A[M,K]·B[K,N]` is computed as the column-major product
//! `Cᵀ[N,M] = Bᵀ·Aᵀ`, so cuBLASLt's "A" is our B and its bias (one value per row of its D) runs
//! along our last dim, as the op's bias does. A batch of row-major A matrices stored back to back
//! against one broadcast B (a linear layer over `[B, S, D]`) is one GEMM over all their rows.
//! Other batches that one strided-batch call can express (equal strides, broadcast as stride 0)
//! are one call; any other batch broadcast is one call per matrix.
//!
//! Epilogues: bias, ReLU and tanh-GELU are cuBLASLt's own (`BIAS`, `RELU_BIAS`, `GELU_BIAS`).
//! cuBLASLt's GELU is the tanh approximation, so the erf GELU is never handed to it: the GEMM
//! applies the bias and a generated kernel applies the exact erf GELU over the output in place.
//! f64 GEMMs take no epilogue (cuBLASLt's f64 kernels do not promise them): bias and activation
//! run in that kernel too.
//!
//! `MatmulActGrad` (`(A·B) ⊙ act'(pre)`): for the tanh GELU in f16, bf16 and f32 with N a
//! multiple of 8 it is one call with cuBLASLt's `DGELU` epilogue, the pre-activation (operand 2)
//! as the epilogue's aux input (`EPILOGUE_AUX_POINTER`, leading dimension N = `ldd`, batch stride
//! that of D; cuBLASLt wants both divisible by 8). Everything else — f64, the erf GELU, ReLU
//! (`DRELU` reads a bit mask, not the pre-activation), N not a multiple of 8 — is the plain GEMM
//! then a generated kernel multiplying the output by the derivative in place, read from `pre`.
//!
//! An accumulating `MatmulEpilogue` (`A·B + bias + C`: a residual add or a gradient summed into,
//! folded by the compiler's accumulate pass) hands C, laid out as D, to cuBLASLt with beta 1, so
//! the sum is added in f32 before the one rounding and no kernel reads the product again.
//!
//! Bias gradients ([`lower_bias_grad`]): the memory plan pairs a GEMM with the `reduce_sum` of a
//! bias gradient over the same rows (`rustytorch_compiler::plan::bias_grad_pair`) and places the
//! sum's slot at the GEMM's step, so one cuBLASLt call can write both. A `matmul_act_grad` with
//! the `DGELU` epilogue becomes `DGELU_BGRAD` (the sum of its own result over the rows); a weight
//! gradient `matmul[trans_a](x, dy)` becomes `BGRADA` (the sum of `dy`, cuBLASLt's A, over the
//! inner dimension). The sum's own step then runs nothing. Its kernels stay in the step: the
//! runtime runs them after the plain GEMM instead when they are faster (it times both once per
//! descriptor) or when cuBLASLt has no algorithm for the epilogue.

use super::ir::*;
use super::{ArgRef, CudaStep, Launch, StepKernels};
use crate::{CodegenError, Result};
use rustytorch_ops::matmul::batch_offsets;
use rustytorch_ops::{Activation, DType, Op, Shape, TensorType};

/// The activation cuBLASLt applies in its epilogue.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LtActivation {
    /// None.
    None,
    /// ReLU.
    Relu,
    /// GELU, tanh approximation (the only GELU cuBLASLt has).
    GeluTanh,
    /// The tanh GELU's derivative at the aux input (the step's operand 2, laid out as D):
    /// `D = (A·B) ⊙ gelu_tanh'(aux)`, cuBLASLt's `DGELU`.
    DGeluTanh,
    /// The tanh GELU of `A·B + bias` as D and the pre-activation `A·B + bias` as the aux output,
    /// laid out as D (cuBLASLt's `GELU_AUX_BIAS`): the GEMM of a GELU pair
    /// ([`lower_gelu_aux`]), whose step output is the pre-activation and whose D is the GELU's
    /// value ([`super::ArgRef::With`]`(0)`).
    GeluTanhAux,
}

/// One cuBLASLt matmul (possibly a strided batch), in column-major terms already swapped:
/// `D[m×n] = op(A)[m×k] · op(B)[k×n]` where A is the step's operand 1 and B its operand 0.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct MatmulDesc {
    /// Element type of A, B and the bias (compute is f32, or f64 for f64).
    pub dtype: DType,
    /// Element type of D (`dtype`, or f32 for f32 results of half-precision operands).
    pub out_dtype: DType,
    /// Rows of D (the op's N).
    pub m: u64,
    /// Columns of D (the op's M).
    pub n: u64,
    /// The inner dimension.
    pub k: u64,
    /// Transpose cuBLASLt's A (= the op's `trans_b`).
    pub trans_a: bool,
    /// Transpose cuBLASLt's B (= the op's `trans_a`).
    pub trans_b: bool,
    /// Leading dimension of A as stored.
    pub lda: u64,
    /// Leading dimension of B as stored.
    pub ldb: u64,
    /// Leading dimension of D.
    pub ldd: u64,
    /// Matrices per call (strided batch).
    pub batch: u64,
    /// Batch strides in elements of A, B and D (0 broadcasts).
    pub stride_a: i64,
    /// See `stride_a`.
    pub stride_b: i64,
    /// See `stride_a`.
    pub stride_d: i64,
    /// Element offsets (A, B, D) of each call; one entry for a single strided-batch call.
    pub calls: Vec<(u64, u64, u64)>,
    /// Whether the step's operand 2 is a bias added by the epilogue.
    pub bias: bool,
    /// The epilogue's activation.
    pub act: LtActivation,
    /// Whether the epilogue also writes a bias gradient into the step's sibling result
    /// ([`lower_bias_grad`]): with `DGeluTanh` the sum of the epilogue's result over D's columns
    /// (`DGELU_BGRAD`), else the sum of A over the inner dimension (`BGRADA`); `m` values.
    pub bgrad: bool,
    /// Whether C, laid out as D, is added before the epilogue (beta 1): the step operand holding
    /// it (the op's last, after the bias, whether the bias runs in cuBLASLt's epilogue or in the
    /// kernel after it).
    pub accumulate: Option<usize>,
}

impl MatmulDesc {
    /// Whether the call reads the step's operand 2 (the bias, or the aux input of `DGeluTanh`).
    pub fn reads_operand2(&self) -> bool {
        self.bias || self.act == LtActivation::DGeluTanh
    }

    /// The step operand holding C, when the call accumulates.
    pub fn c_operand(&self) -> Option<usize> {
        self.accumulate
    }
}

/// How bias-gradient pairs run on CUDA (`RUSTYTORCH_LT_BGRAD`): `0` each member on its own (the
/// default), `1` through cuBLASLt's epilogue or an error when it has no algorithm, `kernel` in
/// the pair's one step but with the sum's own kernels (the fallback, for tests), `auto` the
/// faster of the two (timed by the runtime once per GEMM descriptor; the kernels when cuBLASLt
/// has no algorithm).
///
/// Separate is the default for bias gradients: on their own the column sums merge with the
/// step's other column sums into shared launches (`merge`), which the pair's timing cannot
/// see. On GPT-2 small's bf16 training step on the H200 the `BGRADB` epilogues timed within 1%
/// of their GEMM and sum, and the step ran 0.1–0.25 ms faster with the sums separate in five of
/// six runs (docs/performance.md). GELU pairs (`RUSTYTORCH_LT_GELU_AUX`) default to `auto`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BgradMode {
    /// Separate steps.
    Off,
    /// The epilogue, else the fallback kernels.
    Auto,
    /// The epilogue or an error.
    Epilogue,
    /// The fallback kernels.
    Kernel,
}

thread_local! {
    // A mode for the lowerings of this thread that overrides `RUSTYTORCH_LT_BGRAD` (tests that
    // lower plans while others set the variable); `with_bgrad_mode` scopes it.
    static BGRAD_MODE: std::cell::Cell<Option<BgradMode>> = const { std::cell::Cell::new(None) };
}

/// Runs `f` (lowerings) with bias-gradient pairs in `mode` whatever `RUSTYTORCH_LT_BGRAD`
/// says, then restores the previous setting.
pub fn with_bgrad_mode<R>(mode: BgradMode, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<BgradMode>);
    impl Drop for Restore {
        fn drop(&mut self) {
            BGRAD_MODE.with(|m| m.set(self.0));
        }
    }
    let _restore = Restore(BGRAD_MODE.with(|m| m.replace(Some(mode))));
    f()
}

impl BgradMode {
    /// The mode `RUSTYTORCH_LT_BGRAD` sets.
    pub fn from_env() -> BgradMode {
        BGRAD_MODE
            .with(|m| m.get())
            .unwrap_or_else(|| BgradMode::from_var("RUSTYTORCH_LT_BGRAD", BgradMode::Off))
    }

    /// The mode `RUSTYTORCH_LT_GELU_AUX` sets for GELU pairs ([`lower_gelu_aux`]), with the same
    /// values (unset: `auto`).
    pub fn gelu_aux_from_env() -> BgradMode {
        BgradMode::from_var("RUSTYTORCH_LT_GELU_AUX", BgradMode::Auto)
    }

    fn from_var(var: &str, default: BgradMode) -> BgradMode {
        match std::env::var(var).as_deref() {
            Ok("0") => BgradMode::Off,
            Ok("1") => BgradMode::Epilogue,
            Ok("kernel") => BgradMode::Kernel,
            Ok("auto") => BgradMode::Auto,
            _ => default,
        }
    }
}

/// Whether cuBLASLt's `DGELU` epilogue is used for a result of `dtype` with last dim `n` (its aux
/// leading dimension and batch stride must be multiples of 8).
pub fn lt_dgelu(dtype: DType, n: usize) -> bool {
    matches!(dtype, DType::F16 | DType::BF16 | DType::F32) && n.is_multiple_of(8)
}

fn invalid(op: &Op, msg: String) -> CodegenError {
    CodegenError::Invalid(format!("{}: {msg}", op.name()))
}

/// Lowers `Matmul`/`MatmulEpilogue`/`MatmulActGrad` into a cuBLASLt call and, where needed, a
/// kernel after it.
pub fn lower(op: &Op, inputs: &[&TensorType], out: &TensorType) -> Result<CudaStep> {
    let mut grad = None;
    let accumulate = matches!(
        op,
        Op::MatmulEpilogue {
            accumulate: true,
            ..
        }
    );
    let (ta, tb, has_bias, act) = match op {
        Op::Matmul { trans_a, trans_b } => (*trans_a, *trans_b, false, Activation::None),
        Op::MatmulActGrad {
            trans_a,
            trans_b,
            act,
        } => {
            grad = Some(*act);
            (*trans_a, *trans_b, false, Activation::None)
        }
        Op::MatmulEpilogue {
            trans_a,
            trans_b,
            bias,
            act,
            ..
        } => (*trans_a, *trans_b, *bias, *act),
        _ => return Err(invalid(op, "not a matmul".into())),
    };
    let c_at = 2 + (has_bias || grad.is_some()) as usize;
    if inputs.len() < c_at + accumulate as usize {
        return Err(invalid(op, "missing operands".into()));
    }
    if accumulate && (inputs[c_at].shape != out.shape || inputs[c_at].dtype != out.dtype) {
        return Err(invalid(
            op,
            format!(
                "accumulated operand {} {} must have the result's type {} {}",
                inputs[c_at].dtype, inputs[c_at].shape, out.dtype, out.shape
            ),
        ));
    }
    if accumulate && act != Activation::None {
        return Err(invalid(
            op,
            "an accumulated operand with an activation".into(),
        ));
    }
    if grad.is_some() && (inputs[2].shape != out.shape || inputs[2].dtype != out.dtype) {
        return Err(invalid(
            op,
            format!(
                "pre-activation {} {} must have the result's type {} {}",
                inputs[2].dtype, inputs[2].shape, out.dtype, out.shape
            ),
        ));
    }
    let (a, b) = (inputs[0], inputs[1]);
    let (ad, bd) = (a.shape.dims(), b.shape.dims());
    let (ra, rb) = (ad.len(), bd.len());
    if ra < 2 || rb < 2 {
        return Err(invalid(op, "operands must have rank >= 2".into()));
    }
    let (m, k) = if ta {
        (ad[ra - 1], ad[ra - 2])
    } else {
        (ad[ra - 2], ad[ra - 1])
    };
    let n = if tb { bd[rb - 2] } else { bd[rb - 1] };
    let batch = Shape::new(&out.shape.dims()[..out.shape.rank() - 2]);
    let offs_a = batch_offsets(&ad[..ra - 2], &batch, m * k);
    let offs_b = batch_offsets(&bd[..rb - 2], &batch, k * n);
    let nb = batch.numel();
    let dtype = out.dtype;
    let f64_ = dtype == DType::F64;

    // cuBLASLt's epilogue where it is exact; the rest in a kernel after the GEMM.
    let (lt_bias, lt_act, post_bias, post_act) = match (f64_, act) {
        (true, a) => (false, LtActivation::None, has_bias, a),
        (false, Activation::None) => (has_bias, LtActivation::None, false, Activation::None),
        (false, Activation::Relu) => (has_bias, LtActivation::Relu, false, Activation::None),
        (false, Activation::GeluTanh) => {
            (has_bias, LtActivation::GeluTanh, false, Activation::None)
        }
        (false, Activation::GeluErf) => (has_bias, LtActivation::None, false, Activation::GeluErf),
    };
    // The derivative: cuBLASLt's DGELU where it applies, else a kernel after the plain GEMM.
    let (lt_act, post_grad) = match grad {
        Some(Activation::GeluTanh) if lt_dgelu(dtype, n) => (LtActivation::DGeluTanh, None),
        Some(a) => (lt_act, Some(a)),
        None => (lt_act, None),
    };

    let arith = |offs: &[usize]| -> Option<i64> {
        if offs.len() < 2 {
            return Some(0);
        }
        let s = offs[1] as i64 - offs[0] as i64;
        offs.iter()
            .enumerate()
            .all(|(i, &o)| o as i64 == offs[0] as i64 + s * i as i64)
            .then_some(s)
    };
    let (sa, sb) = (arith(&offs_a), arith(&offs_b));
    // A batch of row-major A matrices stored back to back against one broadcast B (a linear
    // layer over [B, S, D]) is one GEMM over all their rows: cuBLASLt picks its kernels for the
    // whole M, not for a batch of small ones (its DGELU kernels are 3.7× slower batched).
    let fold = nb > 1 && !ta && sb == Some(0) && sa == Some((m * k) as i64);
    let rows = if fold { nb * m } else { m };
    // cuBLASLt's A is our B and vice versa.
    let (calls, batch_n, stride_a, stride_b, stride_d) = match (sa, sb) {
        _ if fold => (vec![(offs_b[0] as u64, offs_a[0] as u64, 0u64)], 1, 0, 0, 0),
        (Some(sa), Some(sb)) if nb > 0 => (
            vec![(offs_b[0] as u64, offs_a[0] as u64, 0u64)],
            nb as u64,
            sb,
            sa,
            (m * n) as i64,
        ),
        _ => (
            (0..nb)
                .map(|i| (offs_b[i] as u64, offs_a[i] as u64, (i * m * n) as u64))
                .collect(),
            1,
            0,
            0,
            (m * n) as i64,
        ),
    };
    let desc = MatmulDesc {
        dtype,
        out_dtype: dtype,
        m: n as u64,
        n: rows as u64,
        k: k as u64,
        trans_a: tb,
        trans_b: ta,
        lda: if tb { k as u64 } else { n as u64 },
        ldb: if ta { m as u64 } else { k as u64 },
        ldd: n as u64,
        batch: batch_n,
        stride_a,
        stride_b,
        stride_d,
        calls,
        bias: lt_bias,
        act: lt_act,
        bgrad: false,
        accumulate: accumulate.then_some(c_at),
    };
    let mut after = StepKernels::default();
    if (post_bias || post_act != Activation::None) && out.shape.numel() > 0 {
        after
            .launches
            .push(epilogue_kernel(out, n, post_bias, post_act)?);
    }
    if let Some(a) = post_grad {
        if out.shape.numel() > 0 {
            after.launches.push(act_grad_kernel(out, a)?);
        }
    }
    Ok(CudaStep::Matmul {
        desc,
        after,
        bgrad: StepKernels::default(),
    })
}

/// Lowers a bias-gradient pair: the GEMM `op` (operands `inputs`, result `out`) together with
/// `sum`, the pair's `reduce_sum` from `sum_in` to `sum_out`, which reads either the GEMM's
/// result (a `matmul_act_grad`) or the bytes of its right operand (a weight gradient). The sum
/// is the step's sibling result ([`ArgRef::With`]`(0)`). `None` when the epilogue cannot write
/// it (f64, a bias or kernels after the GEMM, several calls, other dtypes): the members then
/// run on their own. The sum's kernels, over the step's buffers, are the step's fallback.
pub fn lower_bias_grad(
    op: &Op,
    inputs: &[&TensorType],
    out: &TensorType,
    sum: &Op,
    sum_in: &TensorType,
    sum_out: &TensorType,
) -> Result<Option<CudaStep>> {
    let CudaStep::Matmul {
        mut desc, after, ..
    } = lower(op, inputs, out)?
    else {
        return Ok(None);
    };
    let src = match (op, desc.act) {
        (Op::MatmulActGrad { .. }, LtActivation::DGeluTanh) => ArgRef::Output,
        (
            Op::Matmul {
                trans_a: true,
                trans_b: false,
            },
            LtActivation::None,
        ) => ArgRef::Input(1),
        _ => return Ok(None),
    };
    let plain = after.launches.is_empty()
        && !desc.bias
        && desc.calls.len() == 1
        && desc.batch == 1
        && matches!(desc.dtype, DType::F16 | DType::BF16 | DType::F32)
        && desc.out_dtype == desc.dtype
        && sum_out.dtype == desc.dtype
        && sum_in.dtype == desc.dtype
        && sum_out.shape.numel() as u64 == desc.m
        && sum_in.shape.numel() as u64
            == desc.m
                * if src == ArgRef::Output {
                    desc.n
                } else {
                    desc.k
                };
    if !plain || out.shape.numel() == 0 {
        return Ok(None);
    }
    let Some(fallback) = sibling_kernels(sum, sum_in, sum_out, src)? else {
        return Ok(None);
    };
    desc.bgrad = true;
    Ok(Some(CudaStep::Matmul {
        desc,
        after,
        bgrad: fallback,
    }))
}

/// The kernels of a pair's sibling `op` (one operand of type `ty_in`, result `ty_out`) over the
/// pair's step buffers: its operand read from `src`, its result written to
/// [`ArgRef::With`]`(0)`. `None` when they are not generated kernels of that one operand.
fn sibling_kernels(
    op: &Op,
    ty_in: &TensorType,
    ty_out: &TensorType,
    src: ArgRef,
) -> Result<Option<StepKernels>> {
    let super::CudaStep::Kernels(mut k) = super::lower_step(op, &[ty_in], ty_out)? else {
        return Ok(None);
    };
    for l in &mut k.launches {
        for a in &mut l.args {
            *a = match *a {
                ArgRef::Input(0) => src,
                ArgRef::Output => ArgRef::With(0),
                ArgRef::Input(_) | ArgRef::With(_) | ArgRef::Value(_) => return Ok(None),
                other => other,
            };
        }
    }
    Ok(Some(k))
}

/// The one cuBLASLt call of a GELU pair (`compiler::plan::gelu_aux_pair`): the biased GEMM `op`
/// (result `out`, the pre-activation) and the tanh GELU `act` of its result (`act_out`), as
/// `GELU_AUX_BIAS` writing the GELU into [`ArgRef::With`]`(0)` and the pre-activation into the
/// step's output. The `sibling` kernels are the GELU's own, from the step's output into
/// `With(0)`, which the runtime runs after the plain biased GEMM instead when cuBLASLt has no
/// algorithm for the epilogue (or is slower with it). `None` where the call does not apply: one
/// unbatched f32/f16/bf16 call whose bias is in the epilogue and whose rows are multiples of 8.
pub fn lower_gelu_aux(
    op: &Op,
    inputs: &[&TensorType],
    out: &TensorType,
    act: &Op,
    act_out: &TensorType,
) -> Result<Option<CudaStep>> {
    let CudaStep::Matmul {
        mut desc, after, ..
    } = lower(op, inputs, out)?
    else {
        return Ok(None);
    };
    let plain = after.launches.is_empty()
        && desc.bias
        && desc.act == LtActivation::None
        && desc.accumulate.is_none()
        && desc.calls.len() == 1
        && desc.batch == 1
        && matches!(desc.dtype, DType::F16 | DType::BF16 | DType::F32)
        && desc.out_dtype == desc.dtype
        && act_out == out
        && lt_dgelu(desc.dtype, desc.m as usize)
        && desc.ldd == desc.m;
    if !plain || out.shape.numel() == 0 {
        return Ok(None);
    }
    let Some(sibling) = sibling_kernels(act, out, act_out, ArgRef::Output)? else {
        return Ok(None);
    };
    desc.act = LtActivation::GeluTanhAux;
    Ok(Some(CudaStep::Matmul {
        desc,
        after,
        bgrad: sibling,
    }))
}

/// `out = act(out + bias)` in place over the GEMM's output `[.., n]` (bias along the last dim):
/// the convolutions' bias + activation kernel over the output as `m` rows of `n` channels,
/// channels last.
fn epilogue_kernel(out: &TensorType, n: usize, bias: bool, act: Activation) -> Result<Launch> {
    let numel = out.shape.numel();
    let dims = [numel / n.max(1), n];
    let mut args = vec![ArgRef::Output];
    if bias {
        args.push(ArgRef::Input(2));
    }
    let w = 16 / elem_bytes(CTy::storage(out.dtype));
    Ok(Launch {
        kernel: super::dnn::bias_act_kernel("matmul_epilogue", out.dtype, &dims, true, bias, act)?,
        args,
        grid: super::grid_for(numel.div_ceil(w) as u64, 256),
    })
}

/// `g·act'(x)` for variables of compute type `ct`, as the CPU computes it (ReLU's as a select, so
/// a non-finite `g` where `x <= 0` gives 0, as its gradient rule does); `t` names the variable
/// the tanh GELU's `tanh` is bound to (by [`act_grad_lets`]).
fn act_grad_value(act: Activation, g: Expr, x: Expr, t: &str, ct: CTy) -> Expr {
    match act {
        Activation::Relu => select(bin(BinFn::Gt, x, lit(0.0, ct)), g, lit(0.0, ct)),
        _ => mul(g, act_derivative(act, x, t, ct)),
    }
}

/// `act'(x)` for a variable `x` of compute type `ct`; `t` names the variable the tanh GELU's
/// `tanh` is bound to (by [`act_grad_lets`]).
fn act_derivative(act: Activation, x: Expr, t: &str, ct: CTy) -> Expr {
    let one = || lit(1.0, ct);
    let half = || lit(0.5, ct);
    match act {
        Activation::None => one(),
        Activation::Relu => select(bin(BinFn::Gt, x, lit(0.0, ct)), one(), lit(0.0, ct)),
        // Φ(x) + x·φ(x), Φ(x) = ½·erfc(−x/√2).
        Activation::GeluErf => {
            let cdf = mul(
                half(),
                un(
                    UnFn::Erfc,
                    mul(
                        un(UnFn::Neg, x.clone()),
                        lit(std::f64::consts::FRAC_1_SQRT_2, ct),
                    ),
                ),
            );
            let pdf = mul(
                un(UnFn::Exp, mul(mul(x.clone(), x.clone()), lit(-0.5, ct))),
                lit(1.0 / (2.0 * std::f64::consts::PI).sqrt(), ct),
            );
            add(cdf, mul(x, pdf))
        }
        // ½(1 + t) + ½x(1 − t²)·k(1 + 3c·x²).
        Activation::GeluTanh => {
            let k = (2.0 / std::f64::consts::PI).sqrt();
            let t = var(t);
            let sech2 = sub(one(), mul(t.clone(), t.clone()));
            let p = add(
                one(),
                mul(mul(x.clone(), x.clone()), lit(3.0 * 0.044_715, ct)),
            );
            add(
                mul(half(), add(one(), t)),
                mul(mul(mul(x, sech2), p), lit(0.5 * k, ct)),
            )
        }
    }
}

/// The statements binding `t` (the tanh GELU's `tanh(k(x + c·x³))`) before [`act_derivative`].
fn act_grad_lets(act: Activation, x: Expr, t: &str, ct: CTy) -> Vec<Stmt> {
    if act != Activation::GeluTanh {
        return vec![];
    }
    let k = (2.0 / std::f64::consts::PI).sqrt();
    let u = mul(
        mul(
            x.clone(),
            add(lit(1.0, ct), mul(mul(x.clone(), x), lit(0.044_715, ct))),
        ),
        lit(k, ct),
    );
    vec![let_(t, ct, un(UnFn::Tanh, u))]
}

/// `out = out ⊙ act'(pre)` in place over the GEMM's output, `pre` being the step's operand 2 of
/// the output's type: in 16-byte vectors when the tensor is a whole number of them, else one
/// element a thread.
fn act_grad_kernel(out: &TensorType, act: Activation) -> Result<Launch> {
    let st = CTy::storage(out.dtype);
    let ct = CTy::compute(out.dtype);
    let numel = out.shape.numel();
    let params = vec![
        Param {
            name: "out".into(),
            elem: st,
            writes: true,
            map: None,
        },
        Param {
            name: "pre".into(),
            elem: st,
            writes: false,
            map: None,
        },
    ];
    let args = vec![ArgRef::Output, ArgRef::Input(2)];
    let w = 16 / elem_bytes(st);
    let vector = w > 1 && numel.is_multiple_of(w) && numel / w >= 256;
    let (body, items) = if vector {
        let names = |p: &str| (0..w).map(|k| format!("{p}{k}")).collect::<Vec<_>>();
        let mut b = vec![
            let_("i", CTy::I64, mul(var("j"), i64c(w as i64))),
            load_vec("out", st, var("i"), names("v")),
            load_vec("pre", st, var("i"), names("p")),
        ];
        let mut values = Vec::with_capacity(w);
        for k in 0..w {
            let (x, t) = (format!("x{k}"), format!("t{k}"));
            b.push(let_(&x, ct, var(&format!("p{k}"))));
            b.extend(act_grad_lets(act, var(&x), &t, ct));
            values.push(act_grad_value(act, var(&format!("v{k}")), var(&x), &t, ct));
        }
        b.push(store_vec("out", st, var("i"), values));
        (vec![grid_stride("j", (numel / w) as i64, b)], numel / w)
    } else {
        let mut b = vec![let_("x", ct, load("pre", st, var("i")))];
        b.extend(act_grad_lets(act, var("x"), "t", ct));
        b.push(store(
            "out",
            st,
            var("i"),
            act_grad_value(act, load("out", st, var("i")), var("x"), "t", ct),
        ));
        (vec![grid_stride("i", numel as i64, b)], numel)
    };
    let k = Kernel {
        name: String::new(),
        params,
        block: 256,
        smem: 0,
        body,
    };
    Ok(Launch {
        kernel: super::finish("matmul_act_grad", k)?,
        args,
        grid: super::grid_for(items as u64, 256),
    })
}
