//! Fused row ops ([`Op::FusedRow`]): a normalization, softmax or reduction (the *core*) with an
//! elementwise *prologue* that computes the core's input from the kernel's inputs (evaluated per
//! input element of a row), and an elementwise *epilogue* that maps the core's result to the
//! kernel's result (evaluated per output element). The fusion pass builds them; a device runs one
//! kernel that reads the prologue's inputs once and writes the epilogue's result once.
//!
//! Operands, in order: the prologue's inputs (or the core's input itself when there is no
//! prologue), the core's other operands (a norm's weight and bias), then the epilogue's inputs
//! after its first (the epilogue's input 0 is the core's result).
//!
//! The CPU kernel runs the three parts in turn with the unfused kernels, so its results are the
//! unfused graph's bit for bit: the prologue's result is rounded to its dtype before the core reads
//! it, as the unfused graph stores it. An f32 LayerNorm or RMSNorm with an f32 prologue and no
//! epilogue (a post-LN block's `layer_norm(x + y)`) runs the same two kernels block by block of
//! rows instead, never storing the prologue's whole result; its results are the same.

use crate::util::{arity, attr_err, shape_err};
use crate::{DType, FusedKernel, HostTensor, Op, Result, RowFusion, TensorType, Value, VjpCtx};

impl RowFusion {
    /// Whether `op` may be the core of a fused row op.
    pub fn is_core(op: &Op) -> bool {
        matches!(
            op,
            Op::Softmax { .. }
                | Op::LogSoftmax { .. }
                | Op::LayerNorm { .. }
                | Op::RmsNorm { .. }
                | Op::Reduce { .. }
        )
    }

    /// The core's operand count (its input, then a norm's weight and bias).
    pub fn core_arity(&self) -> usize {
        match &self.core {
            Op::LayerNorm { weight, bias, .. } => 1 + *weight as usize + *bias as usize,
            Op::RmsNorm { weight, .. } => 1 + *weight as usize,
            _ => 1,
        }
    }

    /// Operands the prologue reads (1 without a prologue: the core's input).
    pub fn prologue_inputs(&self) -> usize {
        self.prologue.as_ref().map_or(1, |k| k.n_inputs as usize)
    }

    /// Operands the epilogue reads besides the core's result.
    pub fn epilogue_inputs(&self) -> usize {
        self.epilogue
            .as_ref()
            .map_or(0, |k| (k.n_inputs as usize).saturating_sub(1))
    }

    /// The kernel's operand count.
    pub fn n_inputs(&self) -> usize {
        self.prologue_inputs() + self.core_arity() - 1 + self.epilogue_inputs()
    }

    /// Splits the kernel's operands into the prologue's, the core's others and the epilogue's
    /// others (the caller checked the count).
    pub fn split<'a, T>(&self, inputs: &'a [T]) -> (&'a [T], &'a [T], &'a [T]) {
        let p = self.prologue_inputs();
        let c = self.core_arity() - 1;
        (
            &inputs[..p],
            &inputs[p..p + c],
            &inputs[p + c..p + c + self.epilogue_inputs()],
        )
    }
}

/// The types of a fused row op's parts: the core's input, the core's result and the result.
pub fn part_types(op: &Op, inputs: &[&TensorType]) -> Result<(TensorType, TensorType, TensorType)> {
    let Op::FusedRow(r) = op else {
        return Err(attr_err(op, "not a fused row op"));
    };
    if !RowFusion::is_core(&r.core) {
        return Err(attr_err(
            op,
            format!(
                "`{}` cannot be the core of a fused row op (softmax, log_softmax, layer_norm, \
                 rms_norm or a reduction)",
                r.core.name()
            ),
        ));
    }
    if r.epilogue.as_ref().is_some_and(|k| k.n_inputs == 0) {
        return Err(attr_err(
            op,
            "the epilogue must read the core's result (input 0)",
        ));
    }
    arity(op, inputs, r.n_inputs())?;
    let (pro, core_rest, epi) = r.split(inputs);
    let x = match &r.prologue {
        Some(k) => crate::infer(&Op::Fused(Box::new(k.clone())), pro)?,
        None => pro[0].clone(),
    };
    let mut core_in = vec![&x];
    core_in.extend_from_slice(core_rest);
    let c = crate::infer(&r.core, &core_in)?;
    let y = match &r.epilogue {
        Some(k) => {
            let mut epi_in = vec![&c];
            epi_in.extend_from_slice(epi);
            let y = crate::infer(&Op::Fused(Box::new(k.clone())), &epi_in)?;
            if y.shape != c.shape {
                return Err(shape_err(
                    op,
                    inputs,
                    format!(
                        "the epilogue's shape {} is not the core's result shape {}",
                        y.shape, c.shape
                    ),
                ));
            }
            y
        }
        None => c.clone(),
    };
    Ok((x, c, y))
}

/// Shape and dtype inference.
pub fn infer(op: &Op, inputs: &[&TensorType]) -> Result<TensorType> {
    part_types(op, inputs).map(|(_, _, y)| y)
}

/// The CPU kernel: the prologue, the core and the epilogue in turn (see the module docs).
pub fn cpu(op: &Op, inputs: &[&HostTensor], out: &TensorType) -> Result<HostTensor> {
    let Op::FusedRow(r) = op else {
        return Err(attr_err(op, "not a fused row op"));
    };
    let (pro, core_rest, epi) = r.split(inputs);
    if let Some(y) = norm_of_prologue(op, r, inputs, out)? {
        return Ok(y);
    }
    let run = |k: &FusedKernel, ins: &[&HostTensor]| {
        crate::eval_cpu(&Op::Fused(Box::new(k.clone())), ins)
    };
    let made;
    let x = match &r.prologue {
        Some(k) => {
            made = run(k, pro)?;
            &made
        }
        None => pro[0],
    };
    let mut core_in = vec![x];
    core_in.extend_from_slice(core_rest);
    let c = crate::eval_cpu(&r.core, &core_in)?;
    match &r.epilogue {
        Some(k) => {
            let mut epi_in = vec![&c];
            epi_in.extend_from_slice(epi);
            run(k, &epi_in)
        }
        None => Ok(c),
    }
}

/// An f32 LayerNorm or RMSNorm whose prologue is f32 and which has no epilogue, in blocks of rows:
/// each block's prologue is computed into a scratch block and normalized from there, so the
/// prologue's result is never stored whole. `None` for other fused row ops. Equal to the
/// three-part path bit for bit (the same values, rounded the same way, and the same rows).
fn norm_of_prologue(
    op: &Op,
    r: &RowFusion,
    inputs: &[&HostTensor],
    out: &TensorType,
) -> Result<Option<HostTensor>> {
    let (Some(k), None) = (&r.prologue, &r.epilogue) else {
        return Ok(None);
    };
    if !matches!(r.core, Op::LayerNorm { .. } | Op::RmsNorm { .. }) || out.dtype != DType::F32 {
        return Ok(None);
    }
    let tys: Vec<TensorType> = inputs.iter().map(|t| t.ty()).collect();
    let refs: Vec<&TensorType> = tys.iter().collect();
    let (x, _, _) = part_types(op, &refs)?;
    if x.dtype != DType::F32 || x.shape != out.shape {
        return Ok(None);
    }
    let (pro, core_rest, _) = r.split(inputs);
    let Some(fill) = crate::elementwise::fused_f32_ranges(k, pro, &x) else {
        return Ok(None);
    };
    let d = out.shape.dims().last().copied().unwrap_or(1);
    let y = crate::norm::norm_f32_blocks(&r.core, core_rest, out.shape.numel(), d, fill)?;
    HostTensor::from_vec(y, out.shape.clone()).map(Some)
}

/// Fused row ops are built after differentiation: no gradient.
pub fn vjp(cx: &mut VjpCtx<'_>) -> Result<Vec<Option<Value>>> {
    Err(cx.not_differentiable(
        0,
        "fused row kernels are built after differentiation; differentiate the unfused graph",
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::rand_tensor;

    /// `core(a + b)` as a fused row op, for `[r, d]` rows.
    fn op(core: &str, r: usize, d: usize) -> Op {
        crate::text::parse_op(&format!(
            "fused_row[core={core},prologue=fused[n_inputs=2,out=f32:{r}:{d},instrs=add@0:1@f32]]"
        ))
        .unwrap()
    }

    /// The block path equals the prologue and the core run one after the other, bit for bit:
    /// full operands, a broadcast row, and scalars (a constant prologue), at sizes below and above
    /// the parallel threshold.
    #[test]
    fn norm_blocks_equal_the_parts() {
        for (core, params) in [
            ("layer_norm[eps=1e-5,weight,bias]", 2),
            ("rms_norm[eps=1e-6,weight]", 1),
            ("layer_norm[eps=1e-5]", 0),
        ] {
            for (r, d) in [(3, 7), (65, 768)] {
                let t = |dims: &[usize], seed| {
                    rand_tensor(&TensorType::new(DType::F32, dims.to_vec()), seed, -2.0, 2.0)
                };
                for (a, b) in [
                    (t(&[r, d], 1), t(&[r, d], 2)),
                    (t(&[r, d], 3), t(&[d], 4)),
                    (t(&[1], 5), t(&[1], 6)),
                ] {
                    let fused = op(core, r, d);
                    let Op::FusedRow(fr) = &fused else {
                        unreachable!()
                    };
                    let ps: Vec<HostTensor> = (0..params).map(|i| t(&[d], 10 + i)).collect();
                    let mut ins = vec![&a, &b];
                    ins.extend(ps.iter());
                    let got = crate::eval_cpu(&fused, &ins).unwrap();
                    let k = fr.prologue.clone().unwrap();
                    let x = crate::eval_cpu(&Op::Fused(Box::new(k)), &[&a, &b]).unwrap();
                    let mut core_in = vec![&x];
                    core_in.extend(ps.iter());
                    let want = crate::eval_cpu(&fr.core, &core_in).unwrap();
                    assert_eq!(
                        got.to_vec::<f32>().unwrap(),
                        want.to_vec::<f32>().unwrap(),
                        "{core} {r}x{d} a {:?} b {:?}",
                        a.dims(),
                        b.dims()
                    );
                }
            }
        }
    }
}
