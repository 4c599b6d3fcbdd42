//! Convolution and pooling steps as cuDNN call descriptors.
//!
//! The plan's tensors are contiguous NC + spatial (NCW, NCHW, NCDHW). cuDNN's legacy API wants 4-D
//! or 5-D tensors, so a 1-D op is described as 2-D with a leading spatial extent of 1 (`[N,C,1,L]`,
//! filter `[K,C/g,1,S]`, padding `[0,p]`, stride `[1,s]`, dilation `[1,d]`), which is how cuDNN
//! itself runs 1-D convolutions. The descriptor is plain data: the runtime turns it into cuDNN
//! descriptors, picks the algorithm once per descriptor by measurement and caches both.

use crate::{CodegenError, Result};
use rustytorch_ops::{ConvGeom, DType, Op, PoolKind, TensorType};

/// What a [`DnnDesc`] computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DnnKind {
    /// `y = conv(x, w) [+ bias]`; operands x, w, [bias].
    ConvForward,
    /// `dx = conv_grad_input(dy, w)`; operands dy, w.
    ConvBackwardData,
    /// `dw = conv_grad_weight(x, dy)`; operands x, dy.
    ConvBackwardFilter,
    /// `y = pool(x)`; operand x.
    PoolForward,
    /// `dx = pool_grad(x, dy)`; operands x, dy. cuDNN's pooling backward also reads the forward
    /// result, which the runtime recomputes into the step's scratch before the call.
    PoolBackward,
}

/// cuDNN's pooling modes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DnnPoolMode {
    /// Max (padding never wins).
    Max,
    /// Average, padded positions counted in the divisor.
    AvgIncludePadding,
    /// Average over the positions inside the input only.
    AvgExcludePadding,
}

/// One cuDNN call, shapes as cuDNN sees them (4-D or 5-D).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct DnnDesc {
    /// The call.
    pub kind: DnnKind,
    /// Element type of every tensor.
    pub dtype: DType,
    /// The (forward) input `x`: `[N, C, spatial...]`.
    pub x: Vec<i32>,
    /// The filter `[K, C/groups, window...]` (convolutions; empty for pooling).
    pub w: Vec<i32>,
    /// The (forward) output `y`: `[N, K, spatial...]`.
    pub y: Vec<i32>,
    /// Zero padding per spatial dim (symmetric).
    pub pad: Vec<i32>,
    /// Stride per spatial dim.
    pub stride: Vec<i32>,
    /// Dilation per spatial dim (1 for pooling).
    pub dilation: Vec<i32>,
    /// Convolution groups (1 for pooling).
    pub groups: i32,
    /// A bias `[K]` is added to the convolution's output.
    pub bias: bool,
    /// Pooling mode and window (pooling only).
    pub pool: Option<(DnnPoolMode, Vec<i32>)>,
}

impl DnnDesc {
    /// Bytes of the forward output `y` (the scratch a pooling backward needs).
    pub fn y_bytes(&self) -> usize {
        self.y.iter().map(|&d| d as usize).product::<usize>() * self.dtype.size_bytes()
    }

    /// Number of spatial dims as cuDNN sees them (2 or 3).
    pub fn spatial(&self) -> usize {
        self.x.len() - 2
    }
}

fn dims_i32(op: &Op, dims: &[usize]) -> Result<Vec<i32>> {
    dims.iter()
        .map(|&d| {
            i32::try_from(d).map_err(|_| CodegenError::Unsupported {
                op: op.name(),
                device: "cuda",
                reason: format!("dimension {d} exceeds cuDNN's 32-bit sizes"),
            })
        })
        .collect()
}

/// `[N, C, L]` → `[N, C, 1, L]`; 4-D and 5-D unchanged.
fn lift(op: &Op, dims: &[usize]) -> Result<Vec<i32>> {
    let mut v = dims_i32(op, dims)?;
    if v.len() == 3 {
        v.insert(2, 1);
    }
    if !(4..=5).contains(&v.len()) {
        return Err(CodegenError::Unsupported {
            op: op.name(),
            device: "cuda",
            reason: format!(
                "{}-D convolution or pooling (cuDNN runs 1-D, 2-D and 3-D)",
                dims.len().saturating_sub(2)
            ),
        });
    }
    Ok(v)
}

/// Spatial parameters lifted like [`lift`]: a 1-D list gets `fill` in front.
fn lift_spatial(op: &Op, v: &[usize], fill: i32) -> Result<Vec<i32>> {
    let mut v = dims_i32(op, v)?;
    if v.len() == 1 {
        v.insert(0, fill);
    }
    Ok(v)
}

fn float(op: &Op, d: DType) -> Result<DType> {
    match d {
        DType::F32 | DType::F64 | DType::F16 | DType::BF16 => Ok(d),
        d => Err(CodegenError::Unsupported {
            op: op.name(),
            device: "cuda",
            reason: format!("cuDNN has no {d:?} kernel"),
        }),
    }
}

fn geometry(op: &Op, g: &ConvGeom) -> Result<(Vec<i32>, Vec<i32>, Vec<i32>)> {
    Ok((
        lift_spatial(op, &g.padding, 0)?,
        lift_spatial(op, &g.stride, 1)?,
        lift_spatial(op, &g.dilation, 1)?,
    ))
}

/// The cuDNN call of a convolution or pooling step with operand types `inputs` and result `out`.
pub fn lower(op: &Op, inputs: &[&TensorType], out: &TensorType) -> Result<DnnDesc> {
    let dtype = float(op, out.dtype)?;
    let dims = |t: &TensorType| t.shape.dims().to_vec();
    match op {
        Op::Conv { geom, groups, bias } => {
            let (pad, stride, dilation) = geometry(op, geom)?;
            Ok(DnnDesc {
                kind: DnnKind::ConvForward,
                dtype,
                x: lift(op, &dims(inputs[0]))?,
                w: lift(op, &dims(inputs[1]))?,
                y: lift(op, &dims(out))?,
                pad,
                stride,
                dilation,
                groups: *groups as i32,
                bias: *bias,
                pool: None,
            })
        }
        Op::ConvGradInput { geom, groups, .. } => {
            let (pad, stride, dilation) = geometry(op, geom)?;
            Ok(DnnDesc {
                kind: DnnKind::ConvBackwardData,
                dtype,
                x: lift(op, &dims(out))?,
                w: lift(op, &dims(inputs[1]))?,
                y: lift(op, &dims(inputs[0]))?,
                pad,
                stride,
                dilation,
                groups: *groups as i32,
                bias: false,
                pool: None,
            })
        }
        Op::ConvGradWeight { geom, groups, .. } => {
            let (pad, stride, dilation) = geometry(op, geom)?;
            Ok(DnnDesc {
                kind: DnnKind::ConvBackwardFilter,
                dtype,
                x: lift(op, &dims(inputs[0]))?,
                w: lift(op, &dims(out))?,
                y: lift(op, &dims(inputs[1]))?,
                pad,
                stride,
                dilation,
                groups: *groups as i32,
                bias: false,
                pool: None,
            })
        }
        Op::Pool { kind, kernel, geom } | Op::PoolGrad { kind, kernel, geom } => {
            let mode = match kind {
                PoolKind::Max => DnnPoolMode::Max,
                PoolKind::Avg {
                    count_include_pad: true,
                } => DnnPoolMode::AvgIncludePadding,
                PoolKind::Avg {
                    count_include_pad: false,
                } => DnnPoolMode::AvgExcludePadding,
            };
            let (pad, stride, dilation) = geometry(op, geom)?;
            if dilation.iter().any(|&d| d != 1) {
                return Err(CodegenError::Unsupported {
                    op: op.name(),
                    device: "cuda",
                    reason: "dilated pooling (cuDNN pools without dilation)".into(),
                });
            }
            let grad = matches!(op, Op::PoolGrad { .. });
            let y = if grad { inputs[1] } else { out };
            Ok(DnnDesc {
                kind: if grad {
                    DnnKind::PoolBackward
                } else {
                    DnnKind::PoolForward
                },
                dtype,
                x: lift(op, &dims(inputs[0]))?,
                w: vec![],
                y: lift(op, &dims(y))?,
                pad,
                stride,
                dilation,
                groups: 1,
                bias: false,
                pool: Some((mode, lift_spatial(op, kernel, 1)?)),
            })
        }
        _ => Err(CodegenError::Invalid(format!(
            "`{}` is not a convolution or pooling op",
            op.name()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustytorch_ops::Shape;

    fn t(d: DType, dims: &[usize]) -> TensorType {
        TensorType::new(d, Shape::new(dims.to_vec()))
    }

    fn geom(n: usize, s: usize, p: usize, d: usize) -> ConvGeom {
        ConvGeom {
            stride: vec![s; n],
            padding: vec![p; n],
            dilation: vec![d; n],
        }
    }

    #[test]
    fn conv1d_is_lifted_to_2d() {
        let op = Op::Conv {
            geom: geom(1, 2, 1, 3),
            groups: 2,
            bias: true,
        };
        let (x, w) = (t(DType::F16, &[4, 6, 50]), t(DType::F16, &[8, 3, 3]));
        let b = t(DType::F16, &[8]);
        let out = rustytorch_ops::infer(&op, &[&x, &w, &b]).unwrap();
        let d = lower(&op, &[&x, &w, &b], &out).unwrap();
        assert_eq!(d.kind, DnnKind::ConvForward);
        assert_eq!(d.x, vec![4, 6, 1, 50]);
        assert_eq!(d.w, vec![8, 3, 1, 3]);
        assert_eq!(d.y, vec![4, 8, 1, out.shape.dims()[2] as i32]);
        assert_eq!(
            (d.pad, d.stride, d.dilation),
            (vec![0, 1], vec![1, 2], vec![1, 3])
        );
        assert_eq!((d.groups, d.bias), (2, true));
    }

    #[test]
    fn gradients_describe_the_forward_shapes() {
        let g = geom(3, 1, 1, 1);
        let (x, w) = (
            t(DType::F32, &[2, 4, 5, 6, 7]),
            t(DType::F32, &[3, 4, 3, 3, 3]),
        );
        let fwd = Op::Conv {
            geom: g.clone(),
            groups: 1,
            bias: false,
        };
        let y = rustytorch_ops::infer(&fwd, &[&x, &w]).unwrap();
        let gi = Op::ConvGradInput {
            geom: g.clone(),
            groups: 1,
            input_shape: x.shape.clone(),
        };
        let gw = Op::ConvGradWeight {
            geom: g,
            groups: 1,
            weight_shape: w.shape.clone(),
        };
        let f = lower(&fwd, &[&x, &w], &y).unwrap();
        let bi = lower(&gi, &[&y, &w], &x).unwrap();
        let bw = lower(&gw, &[&x, &y], &w).unwrap();
        for d in [&bi, &bw] {
            assert_eq!((&d.x, &d.w, &d.y), (&f.x, &f.w, &f.y));
        }
        assert_eq!(bi.kind, DnnKind::ConvBackwardData);
        assert_eq!(bw.kind, DnnKind::ConvBackwardFilter);
    }

    #[test]
    fn pooling_modes_and_backward() {
        let g = geom(1, 2, 1, 1);
        let x = t(DType::BF16, &[2, 3, 9]);
        for (kind, mode) in [
            (PoolKind::Max, DnnPoolMode::Max),
            (
                PoolKind::Avg {
                    count_include_pad: true,
                },
                DnnPoolMode::AvgIncludePadding,
            ),
            (
                PoolKind::Avg {
                    count_include_pad: false,
                },
                DnnPoolMode::AvgExcludePadding,
            ),
        ] {
            let op = Op::Pool {
                kind,
                kernel: vec![3],
                geom: g.clone(),
            };
            let y = rustytorch_ops::infer(&op, &[&x]).unwrap();
            let f = lower(&op, &[&x], &y).unwrap();
            assert_eq!(f.pool, Some((mode, vec![1, 3])));
            assert_eq!(f.x, vec![2, 3, 1, 9]);
            let grad = Op::PoolGrad {
                kind,
                kernel: vec![3],
                geom: g.clone(),
            };
            let b = lower(&grad, &[&x, &y], &x).unwrap();
            assert_eq!(b.kind, DnnKind::PoolBackward);
            assert_eq!(b.y, f.y);
            assert_eq!(b.y_bytes(), 2 * 3 * 5 * 2);
        }
    }

    #[test]
    fn integer_tensors_are_refused() {
        let op = Op::Pool {
            kind: PoolKind::Max,
            kernel: vec![2, 2],
            geom: geom(2, 2, 0, 1),
        };
        let x = t(DType::F32, &[1, 1, 4, 4]);
        let y = t(DType::I32, &[1, 1, 2, 2]);
        let e = lower(&op, &[&x], &y).unwrap_err().to_string();
        assert!(e.contains("I32"), "{e}");
    }
}
