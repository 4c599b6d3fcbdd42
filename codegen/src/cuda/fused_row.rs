//! CUDA lowering of fused row ops ([`Op::FusedRow`]): a norm, softmax or reduction with an
//! elementwise prologue (per input element) and epilogue (per output element).
//!
//! Rows that the one-pass kernels of [`super::rows`] take (a last-axis softmax or norm whose rows
//! fit in registers) run as one kernel: the prologue is evaluated as each row element is loaded
//! into registers, and the epilogue as each result is stored, so the step reads its inputs once
//! and writes its result once. Every other fused row op (odd row lengths, reductions, rows too
//! long for the registers) runs as its parts in turn over the step's scratch: the prologue's
//! fused kernel, the row op's own kernels ([`super::reduce`]) and the epilogue's fused kernel —
//! the unfused graph's kernels, in one step.

use super::ir::CTy;
use super::{elementwise, reduce, rows, ArgRef, Launch, StepKernels};
use crate::{CodegenError, Result};
use rustytorch_ops::{fused_row::part_types, FusedKernel, Op, RowFusion, TensorType};

/// Scratch offsets are multiples of this many bytes.
const ALIGN: usize = 256;

/// Lowers a fused row op with operand types `inputs` and result type `out`.
pub fn lower(op: &Op, inputs: &[&TensorType], out: &TensorType) -> Result<StepKernels> {
    let Op::FusedRow(r) = op else {
        return Err(CodegenError::Invalid(format!(
            "{}: not a fused row op",
            op.name()
        )));
    };
    super::ir::check_dtypes(op, inputs, out)?;
    let (x, c, y) = part_types(op, inputs)?;
    if &y != out {
        return Err(CodegenError::Invalid(format!(
            "fused_row: result type {out} does not match the inferred {y}"
        )));
    }
    if out.shape.numel() == 0 || x.shape.numel() == 0 {
        return composed(r, inputs, &x, &c, out);
    }
    if let Some(step) = rows::lower_fused(r, inputs, &x, out)? {
        return Ok(step);
    }
    if let Some(step) = fused_reduction(r, inputs, &x, &c, out)? {
        return Ok(step);
    }
    composed(r, inputs, &x, &c, out)
}

/// The operand space of `t` broadcast over `space`: (size, stride) per dim, coalesced.
fn space(t: &TensorType, space: &TensorType) -> Vec<reduce::Dim> {
    let st = t.shape.broadcast_strides(&space.shape);
    reduce::coalesce(space.shape.dims().iter().copied().zip(st))
}

/// A fused reduction as the reduction kernels with the prologue in their loads and the epilogue
/// in their stores, or `None` when the core is not a reduction, an operand is not a float
/// tensor, or the reduction has no reduced extent.
fn fused_reduction(
    r: &RowFusion,
    inputs: &[&TensorType],
    x: &TensorType,
    c: &TensorType,
    out: &TensorType,
) -> Result<Option<StepKernels>> {
    let Op::Reduce { kind, axes, .. } = &r.core else {
        return Ok(None);
    };
    let (pro, _, epi) = r.split(inputs);
    // The reduction runs over floats; an epilogue may map its float result to another dtype
    // (a finiteness test of a max gives bool).
    if !x.dtype.is_float()
        || !c.dtype.is_float()
        || (r.epilogue.is_none() && !out.dtype.is_float())
        || !pro.iter().chain(epi).all(|t| t.dtype.is_float())
    {
        return Ok(None);
    }
    let pro_prog = match &r.prologue {
        Some(k) => {
            super::ir::check_dtypes(&Op::Fused(Box::new(k.clone())), pro, x)?;
            Some(reduce::Prog {
                k,
                ops: pro
                    .iter()
                    .enumerate()
                    .map(|(i, t)| Some((format!("p{i}"), CTy::storage(t.dtype), space(t, x))))
                    .collect(),
                dtypes: pro.iter().map(|t| t.dtype).collect(),
                round: CTy::storage(x.dtype),
                first: CTy::storage(x.dtype),
            })
        }
        None => None,
    };
    let epi_prog =
        match &r.epilogue {
            Some(k) => {
                super::ir::check_dtypes(&Op::Fused(Box::new(k.clone())), epi, out)?;
                let mut ops = vec![None];
                ops.extend(epi.iter().enumerate().map(|(i, t)| {
                    Some((format!("q{}", i + 1), CTy::storage(t.dtype), space(t, c)))
                }));
                let mut dtypes = vec![c.dtype];
                dtypes.extend(epi.iter().map(|t| t.dtype));
                Some(reduce::Prog {
                    k,
                    ops,
                    dtypes,
                    round: CTy::storage(out.dtype),
                    first: CTy::storage(c.dtype),
                })
            }
            None => None,
        };
    reduce::fused_reduce(*kind, axes, x, out, pro_prog.as_ref(), epi_prog.as_ref())
}

/// Rebinds a sub-step's arguments into the fused step: its inputs through `input`, its output to
/// `output`, its scratch to the fused step's scratch at `scratch`.
fn rebind(
    step: StepKernels,
    input: &dyn Fn(usize) -> ArgRef,
    output: ArgRef,
    scratch: usize,
    launches: &mut Vec<Launch>,
) {
    for mut l in step.launches {
        for a in &mut l.args {
            *a = match *a {
                ArgRef::Input(i) => input(i),
                ArgRef::Output => output,
                ArgRef::Scratch => ArgRef::ScratchAt(scratch),
                ArgRef::ScratchAt(o) => ArgRef::ScratchAt(scratch + o),
                ArgRef::With(k) => ArgRef::With(k),
                ArgRef::Value(v) => ArgRef::Value(v),
            };
        }
        launches.push(l);
    }
}

/// Bytes of a tensor of type `t`, rounded up to [`ALIGN`].
fn slot(t: &TensorType) -> usize {
    (t.shape.numel() * t.dtype.size_bytes()).div_ceil(ALIGN) * ALIGN
}

/// The parts in turn: the prologue's result and the core's result in scratch (`x`, `c` their
/// types), the sub-steps' own scratch after them.
fn composed(
    r: &RowFusion,
    inputs: &[&TensorType],
    x: &TensorType,
    c: &TensorType,
    out: &TensorType,
) -> Result<StepKernels> {
    let (pro, core_rest, epi) = r.split(inputs);
    let p = pro.len();
    let core_base = p;
    let epi_base = p + core_rest.len();
    let x_at = 0;
    let c_at = if r.prologue.is_some() { slot(x) } else { 0 };
    let own = c_at + if r.epilogue.is_some() { slot(c) } else { 0 };
    let mut launches = Vec::new();
    let mut scratch = own;
    let fused = |k: &FusedKernel| Op::Fused(Box::new(k.clone()));
    let x_ref = match &r.prologue {
        Some(k) => {
            let step = elementwise::lower(&fused(k), pro, x)?;
            scratch = scratch.max(own + step.scratch_bytes);
            rebind(
                step,
                &ArgRef::Input,
                ArgRef::ScratchAt(x_at),
                own,
                &mut launches,
            );
            ArgRef::ScratchAt(x_at)
        }
        None => ArgRef::Input(0),
    };
    let c_ref = if r.epilogue.is_some() {
        ArgRef::ScratchAt(c_at)
    } else {
        ArgRef::Output
    };
    let mut core_in = vec![x];
    core_in.extend_from_slice(core_rest);
    let step = reduce::lower(&r.core, &core_in, c)?;
    scratch = scratch.max(own + step.scratch_bytes);
    rebind(
        step,
        &|i| {
            if i == 0 {
                x_ref
            } else {
                ArgRef::Input(core_base + i - 1)
            }
        },
        c_ref,
        own,
        &mut launches,
    );
    if let Some(k) = &r.epilogue {
        let mut epi_in = vec![c];
        epi_in.extend_from_slice(epi);
        let step = elementwise::lower(&fused(k), &epi_in, out)?;
        scratch = scratch.max(own + step.scratch_bytes);
        rebind(
            step,
            &|i| {
                if i == 0 {
                    c_ref
                } else {
                    ArgRef::Input(epi_base + i - 1)
                }
            },
            ArgRef::Output,
            own,
            &mut launches,
        );
    }
    let scratch_bytes = if launches_use_scratch(&launches) {
        scratch
    } else {
        0
    };
    Ok(StepKernels {
        launches,
        scratch_bytes,
    })
}

/// Whether any launch binds the scratch buffer.
fn launches_use_scratch(launches: &[Launch]) -> bool {
    launches.iter().any(|l| {
        l.args
            .iter()
            .any(|a| matches!(a, ArgRef::Scratch | ArgRef::ScratchAt(_)))
    })
}
