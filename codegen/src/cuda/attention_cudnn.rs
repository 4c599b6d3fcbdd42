//! Attention forward through cuDNN's fused attention (SDPA) as a second implementation beside the
//! flash kernel: [`AttnDnnDesc`] is the plain-data description of one call (sizes, element type,
//! scale, causal masking and the strides of q, k, v and the output in the op's layout), from
//! which the runtime builds cuDNN's operation graph (`Q·Kᵀ`, the scale, the causal mask, the
//! softmax, `·V`), times its plans against the flash kernel once per shape and keeps the faster.
//!
//! Both layouts are strides of the same `[B, H, S, D]` dims: `[B, S, H, D]` (Bshd) needs no copy.
//! Only shapes the GPU tests cover are eligible ([`AttnDnnDesc::of`]): f16/bf16, head sizes 32,
//! 64, 80 or 128 (equal for q/k and v), no mask operand, any causal mask except a bottom-right
//! one with more queries than keys (it leaves rows fully masked, whose zeros cuDNN does not
//! give). Everything else keeps the flash kernel.
//!
//! The gradient ([`AttnDnnDesc::of_grad`]): the three gradients of one attention (dQ, dK, dV
//! from q, k, v and dO) through cuDNN's fused backward, which needs the forward's output and
//! softmax statistics; the runtime recomputes both with a forward that writes them, then runs the
//! backward graph. Eligible as the forward, for head sizes [`GRAD_HEAD_SIZES`].
//!
//! `RUSTYTORCH_ATTENTION=flash` or `=cudnn` forces one implementation (see [`Choice::from_env`]),
//! for the forward and the gradient alike.

use crate::{CodegenError, Result};
use rustytorch_ops::{AttnLayout, AttnMask, Causal, DType, Op, TensorType, ATTN_WRT_PACKED};

/// Head sizes the cuDNN path takes (those its GPU test covers).
pub const HEAD_SIZES: [usize; 4] = [32, 64, 80, 128];

/// Head sizes cuDNN's fused backward takes for [`Op::AttentionGrad`] (those the runtime's GPU
/// unit test of the gradient covers).
pub const GRAD_HEAD_SIZES: [usize; 2] = [64, 128];

/// Which attention forward runs on CUDA for shapes both implementations cover.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Choice {
    /// Time both once per shape at prepare and keep the faster (the default).
    Auto,
    /// The generated flash kernel only.
    Flash,
    /// cuDNN's fused attention only (a shape it cannot take is an error).
    Cudnn,
}

impl Choice {
    /// From `RUSTYTORCH_ATTENTION` (`flash`, `cudnn`; anything else is [`Choice::Auto`]).
    pub fn from_env() -> Choice {
        Choice::parse(std::env::var("RUSTYTORCH_ATTENTION").ok().as_deref())
    }

    /// The choice a value of `RUSTYTORCH_ATTENTION` names.
    pub fn parse(v: Option<&str>) -> Choice {
        match v {
            Some("flash") => Choice::Flash,
            Some("cudnn") => Choice::Cudnn,
            _ => Choice::Auto,
        }
    }
}

/// One cuDNN attention forward call; every tensor described as `[B, H, S, D]` dims with strides
/// in elements.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct AttnDnnDesc {
    /// f16 or bf16 (q, k, v and the output).
    pub dtype: DType,
    /// Batch.
    pub b: usize,
    /// Heads.
    pub h: usize,
    /// Query rows.
    pub sq: usize,
    /// Keys.
    pub sk: usize,
    /// Head size (q, k and v).
    pub d: usize,
    /// Causal masking (bottom-right only with `sq <= sk`).
    pub causal: Causal,
    /// The score scale as f32 bits (cuDNN takes it by value as an f32).
    pub scale_bits: u32,
    /// The operands' and result's layout.
    pub layout: AttnLayout,
}

impl AttnDnnDesc {
    /// The description of `op` over `inputs` when cuDNN's path covers it (see the module docs),
    /// else `None`.
    pub fn of(op: &Op, inputs: &[&TensorType], out: &TensorType) -> Option<AttnDnnDesc> {
        let Op::Attention {
            causal,
            mask,
            scale,
            layout,
        } = op
        else {
            return None;
        };
        if inputs.len() != 3 || *mask != AttnMask::None {
            return None;
        }
        let d = AttnDnnDesc::common(*causal, scale.get(), *layout, inputs, out, out)?;
        HEAD_SIZES.contains(&d.d).then_some(d)
    }

    /// The description of the gradient op `op` (an [`Op::AttentionGrad`] of any `wrt`) over q,
    /// k, v and dO when cuDNN's fused backward covers it: as [`AttnDnnDesc::of`], with dO of
    /// q's type, the result of the `wrt` operand's type, head sizes [`GRAD_HEAD_SIZES`] and not
    /// Sq = Sk = 1.
    pub fn of_grad(op: &Op, inputs: &[&TensorType], out: &TensorType) -> Option<AttnDnnDesc> {
        let Op::AttentionGrad {
            causal,
            mask,
            scale,
            wrt,
            layout,
        } = op
        else {
            return None;
        };
        // A packed attention's one gradient is dq, dk and dv in q's packed type.
        let wrt_ok = match layout {
            AttnLayout::Packed => *wrt == ATTN_WRT_PACKED && inputs[0] == out,
            _ => *wrt <= 2 && inputs[*wrt as usize] == out,
        };
        if inputs.len() != 4
            || *mask != AttnMask::None
            || !wrt_ok
            || inputs.iter().any(|t| t.shape.numel() == 0)
        {
            return None;
        }
        let d = AttnDnnDesc::common(*causal, scale.get(), *layout, &inputs[..3], inputs[3], out)?;
        // cudnn-frontend refuses the backward of one query over one key.
        (GRAD_HEAD_SIZES.contains(&d.d) && (d.sq, d.sk) != (1, 1)).then_some(d)
    }

    /// The description of q, k, v (`qkv`) and a `[B, H, Sq, D]` tensor `o` when their types and
    /// sizes fit one call (f16/bf16 throughout, k and v of q's head size, `out` of that type, no
    /// empty tensor, a finite scale, no bottom-right causal mask with more queries than keys).
    fn common(
        causal: Causal,
        scale: f64,
        layout: AttnLayout,
        qkv: &[&TensorType],
        o: &TensorType,
        out: &TensorType,
    ) -> Option<AttnDnnDesc> {
        let dt = qkv[0].dtype;
        let qkv_rank = if layout == AttnLayout::Packed { 5 } else { 4 };
        if !matches!(dt, DType::F16 | DType::BF16)
            || qkv
                .iter()
                .any(|t| t.dtype != dt || t.shape.rank() != qkv_rank)
            || o.dtype != dt
            || o.shape.rank() != 4
            || out.dtype != dt
            || out.shape.numel() == 0
        {
            return None;
        }
        let q = layout.to_bhsd(qkv[0].shape.dims());
        let k = layout.to_bhsd(qkv[1].shape.dims());
        let v = layout.to_bhsd(qkv[2].shape.dims());
        let o = layout.to_bhsd(o.shape.dims());
        let (b, h, sq, d, sk) = (q[0], q[1], q[2], q[3], k[2]);
        let ok = k == [b, h, sk, d]
            && v == [b, h, sk, d]
            && o == [b, h, sq, d]
            && (causal != Causal::BottomRight || sq <= sk);
        let scale = scale as f32;
        (ok && scale.is_finite()).then(|| AttnDnnDesc {
            dtype: dt,
            b,
            h,
            sq,
            sk,
            d,
            causal,
            scale_bits: scale.to_bits(),
            layout,
        })
    }

    /// The scale as cuDNN gets it.
    pub fn scale(&self) -> f32 {
        f32::from_bits(self.scale_bits)
    }

    /// The `[B, H, S, D]` dims and strides of the output O or dO (`rows` = `sq`) in the
    /// desc's layout.
    pub fn dims_strides(&self, rows: usize) -> ([i64; 4], [i64; 4]) {
        let (b, h, s, d) = (self.b as i64, self.h as i64, rows as i64, self.d as i64);
        let st = match self.layout {
            AttnLayout::Bhsd => [h * s * d, s * d, d, 1],
            AttnLayout::Bshd | AttnLayout::Packed => [s * h * d, d, h * d, 1],
        };
        ([b, h, s, d], st)
    }

    /// The `[B, H, S, D]` dims and strides of q, k or v, or of its gradient (`rows`: `sq` for
    /// q, `sk` for k and v): O's, except that packed operands' rows are three heads' widths
    /// apart (each addressed at [`AttnDnnDesc::part_offset`]).
    pub fn operand(&self, rows: usize) -> ([i64; 4], [i64; 4]) {
        let (dims, mut st) = self.dims_strides(rows);
        if self.layout == AttnLayout::Packed {
            st[0] *= 3;
            st[2] *= 3;
        }
        (dims, st)
    }

    /// Kᵀ as cuDNN's first product reads it: `[B, H, D, Sk]`, the strides of k's last two dims
    /// swapped (no copy).
    pub fn k_transposed(&self) -> ([i64; 4], [i64; 4]) {
        let (d, s) = self.operand(self.sk);
        ([d[0], d[1], d[3], d[2]], [s[0], s[1], s[3], s[2]])
    }

    /// Bytes of one `[B, H, rows, D]` tensor.
    pub fn bytes(&self, rows: usize) -> usize {
        self.b * self.h * rows * self.d * self.dtype.size_bytes()
    }

    /// Bytes of the tensor that holds q, k or v (`rows` rows): the packed one when packed.
    pub fn operand_bytes(&self, rows: usize) -> usize {
        let n = if self.layout == AttnLayout::Packed {
            3
        } else {
            1
        };
        n * self.bytes(rows)
    }

    /// Where operand `j` (0 = q, 1 = k, 2 = v, or its gradient) starts, in bytes from its
    /// tensor's address: `j` heads' widths into a packed tensor, else 0.
    pub fn part_offset(&self, j: usize) -> u64 {
        match self.layout {
            AttnLayout::Packed => (j * self.h * self.d * self.dtype.size_bytes()) as u64,
            _ => 0,
        }
    }
}

/// The error of a forced cuDNN attention (forward or gradient) over a shape it does not cover.
pub fn not_covered(op: &Op, inputs: &[&TensorType]) -> CodegenError {
    let shapes: Vec<String> = inputs.iter().map(|t| t.to_string()).collect();
    let (what, heads, extra) = match op {
        Op::AttentionGrad { .. } => (
            "fused attention backward",
            &GRAD_HEAD_SIZES[..],
            ", not Sq = Sk = 1",
        ),
        _ => ("fused attention", &HEAD_SIZES[..], ""),
    };
    CodegenError::Unsupported {
        op: op.name(),
        device: "cuda",
        reason: format!(
            "RUSTYTORCH_ATTENTION=cudnn: cuDNN's {what} here takes f16/bf16 q, k, v of \
             equal head sizes {heads:?}, no mask operand and no bottom-right causal mask \
             with more queries than keys{extra}; \
             got {} ({op:?}); unset the variable to use the flash kernel",
            shapes.join(", ")
        ),
    }
}

/// [`not_covered`] as a result, for lowering.
pub fn forced_error<T>(op: &Op, inputs: &[&TensorType]) -> Result<T> {
    Err(not_covered(op, inputs))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustytorch_ops::F64Bits;

    fn op(causal: Causal, mask: AttnMask, layout: AttnLayout) -> Op {
        Op::Attention {
            causal,
            mask,
            scale: F64Bits::new(0.125),
            layout,
        }
    }

    fn tys(
        dt: DType,
        layout: AttnLayout,
        b: usize,
        h: usize,
        sq: usize,
        sk: usize,
        d: usize,
    ) -> (Vec<TensorType>, TensorType) {
        let t = |s: usize| TensorType::new(dt, layout.from_bhsd([b, h, s, d]));
        (vec![t(sq), t(sk), t(sk)], t(sq))
    }

    fn desc(op: &Op, ins: &[TensorType], out: &TensorType) -> Option<AttnDnnDesc> {
        let refs: Vec<&TensorType> = ins.iter().collect();
        AttnDnnDesc::of(op, &refs, out)
    }

    #[test]
    fn strides_of_both_layouts() {
        let (ins, out) = tys(DType::BF16, AttnLayout::Bhsd, 2, 3, 5, 7, 64);
        let d = desc(
            &op(Causal::None, AttnMask::None, AttnLayout::Bhsd),
            &ins,
            &out,
        )
        .unwrap();
        assert_eq!(d.dims_strides(5), ([2, 3, 5, 64], [960, 320, 64, 1]));
        assert_eq!(d.dims_strides(7), ([2, 3, 7, 64], [1344, 448, 64, 1]));
        assert_eq!(d.k_transposed(), ([2, 3, 64, 7], [1344, 448, 1, 64]));
        assert_eq!(d.bytes(7), 2 * 3 * 7 * 64 * 2);
        assert_eq!(d.scale(), 0.125);

        let (ins, out) = tys(DType::F16, AttnLayout::Bshd, 2, 3, 5, 7, 128);
        let d = desc(
            &op(Causal::TopLeft, AttnMask::None, AttnLayout::Bshd),
            &ins,
            &out,
        )
        .unwrap();
        assert_eq!((d.b, d.h, d.sq, d.sk, d.d), (2, 3, 5, 7, 128));
        // [B, S, H, D] memory: a head's rows are H·D apart, heads D apart.
        assert_eq!(d.dims_strides(5), ([2, 3, 5, 128], [1920, 128, 384, 1]));
        assert_eq!(d.k_transposed(), ([2, 3, 128, 7], [2688, 128, 1, 384]));
    }

    #[test]
    fn eligible_shapes() {
        let l = AttnLayout::Bhsd;
        for d in HEAD_SIZES {
            let (ins, out) = tys(DType::F16, l, 1, 2, 1, 9, d);
            assert!(desc(&op(Causal::TopLeft, AttnMask::None, l), &ins, &out).is_some());
        }
        // Other head sizes, f32, masks and bottom-right causal keep the flash kernel.
        for d in [16, 48, 96, 256] {
            let (ins, out) = tys(DType::F16, l, 1, 2, 4, 9, d);
            assert!(desc(&op(Causal::None, AttnMask::None, l), &ins, &out).is_none());
        }
        let (ins, out) = tys(DType::F32, l, 1, 2, 4, 9, 64);
        assert!(desc(&op(Causal::None, AttnMask::None, l), &ins, &out).is_none());
        let (ins, out) = tys(DType::BF16, l, 1, 2, 4, 9, 64);
        assert!(desc(&op(Causal::BottomRight, AttnMask::None, l), &ins, &out).is_some());
        let (more_q, out_q) = tys(DType::BF16, l, 1, 2, 10, 9, 64);
        assert!(desc(&op(Causal::BottomRight, AttnMask::None, l), &more_q, &out_q).is_none());
        let mut with_mask = ins.clone();
        with_mask.push(TensorType::new(DType::BF16, [4, 9]));
        assert!(desc(&op(Causal::None, AttnMask::Additive, l), &with_mask, &out).is_none());
        // Different head sizes for v, and empty results.
        let mut odd = ins.clone();
        odd[2] = TensorType::new(DType::BF16, [1, 2, 9, 128]);
        let o2 = TensorType::new(DType::BF16, [1, 2, 4, 128]);
        assert!(desc(&op(Causal::None, AttnMask::None, l), &odd, &o2).is_none());
        let (ins, out) = tys(DType::BF16, l, 0, 2, 4, 9, 64);
        assert!(desc(&op(Causal::None, AttnMask::None, l), &ins, &out).is_none());
        // Not attention at all.
        assert!(desc(&Op::Where, &ins, &out).is_none());
    }

    #[test]
    fn lowering_carries_both_halves() {
        if std::env::var_os("RUSTYTORCH_ATTENTION").is_some() {
            return;
        }
        let l = AttnLayout::Bshd;
        let (ins, out) = tys(DType::F16, l, 2, 2, 3, 70, 64);
        let refs: Vec<&TensorType> = ins.iter().collect();
        let o = op(Causal::TopLeft, AttnMask::None, l);
        let step = super::super::lower_step(&o, &refs, &out).unwrap();
        let super::super::CudaStep::Attention { cudnn, flash, .. } = &step else {
            panic!("{step:?}");
        };
        assert_eq!(cudnn, &AttnDnnDesc::of(&o, &refs, &out).unwrap());
        assert_eq!(flash, &super::super::flash::lower(&o, &refs, &out).unwrap());
        assert_eq!(step.launches().len(), 1);
        assert!(step.launches()[0]
            .kernel
            .name
            .starts_with("flash_attention"));
        assert_eq!(super::super::interp::host_kernels(&step), Some(flash));
        // A shape cuDNN's path leaves out stays a plain kernel step.
        let o = op(Causal::BottomRight, AttnMask::None, l);
        let (ins, out) = tys(DType::F16, l, 2, 2, 71, 70, 64);
        let refs: Vec<&TensorType> = ins.iter().collect();
        assert!(matches!(
            super::super::lower_step(&o, &refs, &out).unwrap(),
            super::super::CudaStep::Kernels(_)
        ));
    }

    fn grad_op(causal: Causal, wrt: u8, layout: AttnLayout) -> Op {
        Op::AttentionGrad {
            causal,
            mask: AttnMask::None,
            scale: F64Bits::new(0.125),
            wrt,
            layout,
        }
    }

    fn grad_desc(op: &Op, ins: &[TensorType], out: &TensorType) -> Option<AttnDnnDesc> {
        let refs: Vec<&TensorType> = ins.iter().collect();
        AttnDnnDesc::of_grad(op, &refs, out)
    }

    #[test]
    fn eligible_gradients() {
        for l in [AttnLayout::Bhsd, AttnLayout::Bshd] {
            for d in GRAD_HEAD_SIZES {
                // q, k, v and dO; sq != sk.
                let (mut ins, out) = tys(DType::BF16, l, 2, 3, 5, 7, d);
                ins.push(out.clone());
                for wrt in 0..3u8 {
                    let o = grad_op(Causal::TopLeft, wrt, l);
                    let want = ins[wrt as usize].clone();
                    let g = grad_desc(&o, &ins, &want).unwrap();
                    assert_eq!((g.b, g.h, g.sq, g.sk, g.d), (2, 3, 5, 7, d));
                    assert_eq!((g.layout, g.causal, g.scale()), (l, Causal::TopLeft, 0.125));
                    // The result must be the `wrt` operand's type.
                    let wrong = ins[if wrt == 0 { 1 } else { 0 }].clone();
                    assert!(grad_desc(&o, &ins, &wrong).is_none());
                }
                // The same description as the forward's.
                let fwd = desc(&op(Causal::TopLeft, AttnMask::None, l), &ins[..3], &out);
                assert_eq!(
                    grad_desc(&grad_op(Causal::TopLeft, 0, l), &ins, &ins[0]),
                    fwd
                );
            }
        }
        let l = AttnLayout::Bhsd;
        let with_grad = |dt, sq, sk, d| {
            let (mut ins, out) = tys(dt, l, 1, 2, sq, sk, d);
            ins.push(out);
            ins
        };
        // Head sizes the backward's test leaves out, f32, more queries than keys bottom-right.
        for d in [32, 80, 96] {
            let ins = with_grad(DType::F16, 4, 9, d);
            assert!(grad_desc(&grad_op(Causal::None, 1, l), &ins, &ins[1]).is_none());
        }
        let ins = with_grad(DType::F32, 4, 9, 64);
        assert!(grad_desc(&grad_op(Causal::None, 1, l), &ins, &ins[1]).is_none());
        let ins = with_grad(DType::F16, 10, 9, 64);
        assert!(grad_desc(&grad_op(Causal::BottomRight, 2, l), &ins, &ins[2]).is_none());
        assert!(grad_desc(&grad_op(Causal::TopLeft, 2, l), &ins, &ins[2]).is_some());
        // dO of another size, a wrong operand count, a mask, wrt out of range, the forward op.
        let mut odd = with_grad(DType::F16, 4, 9, 64);
        odd[3] = TensorType::new(DType::F16, [1, 2, 5, 64]);
        assert!(grad_desc(&grad_op(Causal::None, 0, l), &odd, &odd[0]).is_none());
        let ins = with_grad(DType::F16, 4, 9, 64);
        assert!(grad_desc(&grad_op(Causal::None, 0, l), &ins[..3], &ins[0]).is_none());
        let masked = Op::AttentionGrad {
            causal: Causal::None,
            mask: AttnMask::Additive,
            scale: F64Bits::new(0.125),
            wrt: 0,
            layout: l,
        };
        assert!(grad_desc(&masked, &ins, &ins[0]).is_none());
        assert!(grad_desc(&grad_op(Causal::None, 3, l), &ins, &ins[0]).is_none());
        let fwd = op(Causal::None, AttnMask::None, l);
        assert!(grad_desc(&fwd, &ins, &ins[0]).is_none());
        // Empty operands; one query over one key.
        let ins = with_grad(DType::F16, 0, 9, 64);
        assert!(grad_desc(&grad_op(Causal::None, 1, l), &ins, &ins[1]).is_none());
        let ins = with_grad(DType::F16, 1, 1, 64);
        assert!(grad_desc(&grad_op(Causal::None, 1, l), &ins, &ins[1]).is_none());
        let ins = with_grad(DType::F16, 1, 2, 64);
        assert!(grad_desc(&grad_op(Causal::None, 1, l), &ins, &ins[1]).is_some());
    }

    #[test]
    fn forced_errors_name_the_covered_head_sizes() {
        let l = AttnLayout::Bhsd;
        let (ins, _) = tys(DType::F16, l, 1, 2, 4, 9, 96);
        let refs: Vec<&TensorType> = ins.iter().collect();
        let fwd = not_covered(&op(Causal::None, AttnMask::None, l), &refs).to_string();
        assert!(fwd.contains("[32, 64, 80, 128]"), "{fwd}");
        let grad = not_covered(&grad_op(Causal::None, 0, l), &refs).to_string();
        assert!(
            grad.contains("backward") && grad.contains("[64, 128]"),
            "{grad}"
        );
    }

    #[test]
    fn choice_from_env_values() {
        assert_eq!(Choice::parse(Some("flash")), Choice::Flash);
        assert_eq!(Choice::parse(Some("cudnn")), Choice::Cudnn);
        assert_eq!(Choice::parse(Some("gemm")), Choice::Auto);
        assert_eq!(Choice::parse(None), Choice::Auto);
    }
}
