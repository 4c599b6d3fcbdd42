//! Convolution and pooling steps as cuDNN call descriptors.
//!
//! The plan's tensors are contiguous NC + spatial (NCW, NCHW, NCDHW). cuDNN's legacy API wants 4-D
//! or 5-D tensors, so a 1-D op is described as 2-D with a leading spatial extent of 1 (`[N,C,1,L]`,
//! filter `[K,C/g,1,S]`, padding `[0,p]`, stride `[1,s]`, dilation `[1,d]`), which is how cuDNN
//! itself runs 1-D convolutions. The descriptor is plain data: the runtime turns it into cuDNN
//! descriptors, picks the algorithm once per descriptor by measurement and caches both.
//!
//! Half-precision 2-D and 3-D convolutions run channels-last, where cuDNN's tensor-core kernels
//! are fastest (measured on the H200: 339 against 156 TFLOP/s for a 3×3 64-channel layer in
//! PyTorch). An op whose tensors are already channels-last (`ConvGeom::layout`, chosen for whole
//! stacks by the compiler's layout pass when [`channels_last`] says so) is described on NHWC
//! (NDHWC) descriptors over its operands directly, with no copies. A channels-first one is
//! staged: the step transposes its operands into NHWC buffers in its scratch with tiled
//! shared-memory transposes, calls cuDNN on those, and transposes the result back.

use super::ir::*;
use super::{finish, grid_for, ArgRef, Launch, MAX_GRID};
use crate::{CodegenError, Result};
use rustytorch_compiler::layout::ChannelsLast;
use rustytorch_ops::{Activation, ConvGeom, DType, Layout, Op, PoolKind, TensorType};

/// When the compiler should make convolution stacks channels-last for CUDA: f16/bf16 with
/// channel counts that tensor-core kernels take (multiples of 8), 2-D and 3-D (1-D convolutions
/// are as fast channels-first). Pooling joins the stack: the generated pooling kernels
/// (`pool.rs`) take channels-last tensors (a 16-byte vector of channels per thread); with
/// `RUSTYTORCH_CUDNN_POOLING=1` a channels-last pool runs through cuDNN's NHWC pooling.
pub fn channels_last() -> ChannelsLast {
    ChannelsLast {
        dtypes: vec![DType::F16, DType::BF16],
        channel_multiple: 8,
        min_spatial: 2,
        pool: true,
    }
}

/// Whether `op` is a convolution or pooling op with channels-last tensors.
pub fn is_channels_last(op: &Op) -> bool {
    matches!(op, Op::Conv { geom, .. } | Op::ConvGradInput { geom, .. }
        | Op::ConvGradWeight { geom, .. } | Op::Pool { geom, .. } | Op::PoolGrad { geom, .. }
        if geom.layout == Layout::ChannelsLast)
}

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
    /// cuDNN adds a bias `[K]` (operand 2) to the convolution's output (channels-last steps add
    /// it in their transpose back instead, and clear this).
    pub bias: bool,
    /// Activation applied after the bias (convolution forward only; `None` elsewhere).
    pub act: Activation,
    /// Pooling mode and window (pooling only).
    pub pool: Option<(DnnPoolMode, Vec<i32>)>,
    /// Channels-last: x, w and y are NHWC (NDHWC; filters KRSC): the op's own operands when its
    /// layout is channels-last, else copies in the scratch at [`DnnDesc::x_at`],
    /// [`DnnDesc::w_at`] and [`DnnDesc::y_at`], made and read back by the step's transposes.
    pub nhwc: bool,
    /// Where a convolution finds x: an operand, the output, or a scratch offset in bytes
    /// (pooling reads its operands and writes its output directly).
    pub x_at: ArgRef,
    /// Where a convolution finds the filter.
    pub w_at: ArgRef,
    /// Where a convolution finds y.
    pub y_at: ArgRef,
    /// Bytes of scratch the staging copies take; cuDNN's workspace follows them.
    pub staging_bytes: usize,
}

/// A cuDNN step: transposes into the staging buffers, the call, transposes back.
#[derive(Clone, Debug, PartialEq)]
pub struct DnnStep {
    /// The call.
    pub desc: DnnDesc,
    /// Launches before the call (operands into channels-last staging).
    pub before: Vec<Launch>,
    /// Launches after the call (the staged result back to the output).
    pub after: Vec<Launch>,
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

    /// Byte offset of cuDNN's workspace in the step's scratch.
    pub fn workspace_offset(&self) -> usize {
        self.staging_bytes.next_multiple_of(256)
    }
}

/// Threads per block of the transpose kernel (a 32-wide tile, 8 rows of threads).
const TILE: i64 = 32;
const TBLOCK: u32 = 256;

/// `out[b][c][r] = in[b][r][c]` (`+ bias[c]` with `bias`) for `batch` matrices of `rows × cols`,
/// through 32×32 shared-memory tiles so that both the reads and the writes are coalesced.
pub fn transpose_kernel(
    dt: DType,
    batch: usize,
    rows: usize,
    cols: usize,
    bias: bool,
) -> Result<Kernel> {
    let (el, ty) = (CTy::storage(dt), CTy::compute(dt));
    let (r, c) = (rows as i64, cols as i64);
    let (tr, tc) = ((r + TILE - 1) / TILE, (c + TILE - 1) / TILE);
    let tiles = batch as i64 * tr * tc;
    let tid = || special(Special::ThreadIdx);
    let mut body = vec![
        Stmt::Shared {
            name: "tile".into(),
            elem: ty,
            len: (TILE * (TILE + 1)) as u32,
        },
        let_("tx", CTy::I64, rem(tid(), i64c(TILE))),
        let_("ty", CTy::I64, div(tid(), i64c(TILE))),
    ];
    let mut per_tile = vec![
        let_("b", CTy::I64, div(var("t"), i64c(tr * tc))),
        let_("tr", CTy::I64, div(rem(var("t"), i64c(tr * tc)), i64c(tc))),
        let_("tcol", CTy::I64, rem(var("t"), i64c(tc))),
        let_("base", CTy::I64, mul(var("b"), i64c(r * c))),
    ];
    let rows_per_pass = (TBLOCK as i64) / TILE;
    let and = |a: Expr, b: Expr| bin(BinFn::And, a, b);
    for k in 0..TILE / rows_per_pass {
        let (ri, ci) = (format!("ri{k}"), format!("ci{k}"));
        let row = add(var("ty"), i64c(k * rows_per_pass));
        per_tile.push(let_(
            &ri,
            CTy::I64,
            add(mul(var("tr"), i64c(TILE)), row.clone()),
        ));
        per_tile.push(let_(
            &ci,
            CTy::I64,
            add(mul(var("tcol"), i64c(TILE)), var("tx")),
        ));
        per_tile.push(if_(
            and(lt(var(&ri), i64c(r)), lt(var(&ci), i64c(c))),
            vec![store(
                "tile",
                ty,
                add(mul(row, i64c(TILE + 1)), var("tx")),
                load(
                    "x",
                    el,
                    add(var("base"), add(mul(var(&ri), i64c(c)), var(&ci))),
                ),
            )],
        ));
    }
    per_tile.push(Stmt::SyncThreads);
    for k in 0..TILE / rows_per_pass {
        let (ro, co) = (format!("ro{k}"), format!("co{k}"));
        let col = add(var("ty"), i64c(k * rows_per_pass));
        per_tile.push(let_(
            &co,
            CTy::I64,
            add(mul(var("tcol"), i64c(TILE)), col.clone()),
        ));
        per_tile.push(let_(
            &ro,
            CTy::I64,
            add(mul(var("tr"), i64c(TILE)), var("tx")),
        ));
        let mut v = load("tile", ty, add(mul(var("tx"), i64c(TILE + 1)), col));
        if bias {
            v = add(v, load("bias", el, var(&co)));
        }
        per_tile.push(if_(
            and(lt(var(&ro), i64c(r)), lt(var(&co), i64c(c))),
            vec![store(
                "out",
                el,
                add(var("base"), add(mul(var(&co), i64c(r)), var(&ro))),
                v,
            )],
        ));
    }
    per_tile.push(Stmt::SyncThreads);
    body.push(for_(
        "t",
        special(Special::BlockIdx),
        i64c(tiles),
        special(Special::GridDim),
        per_tile,
    ));
    let param = |name: &str, writes: bool| Param {
        name: name.into(),
        elem: el,
        writes,
    };
    let mut params = vec![param("x", false)];
    if bias {
        params.push(param("bias", false));
    }
    params.push(param("out", true));
    let k = Kernel {
        name: String::new(),
        params,
        block: TBLOCK,
        body,
    };
    finish("transpose", k)
}

/// A launch of [`transpose_kernel`] from `src` to `dst`, adding the per-column `bias` if given.
fn transpose(
    dt: DType,
    (batch, rows, cols): (usize, usize, usize),
    src: ArgRef,
    bias: Option<ArgRef>,
    dst: ArgRef,
) -> Result<Launch> {
    let tiles = batch as u64 * (rows as u64).div_ceil(32) * (cols as u64).div_ceil(32);
    let mut args = vec![src];
    args.extend(bias);
    args.push(dst);
    Ok(Launch {
        kernel: transpose_kernel(dt, batch, rows, cols, bias.is_some())?,
        args,
        grid: grid_for(tiles, 1).min(MAX_GRID as u32),
    })
}

/// Whether a convolution runs channels-last: half precision, 2-D or 3-D (1-D convolutions are as
/// fast in NCW), one group, and channel counts that tensor-core kernels take (multiples of 8).
fn wants_nhwc(d: &DnnDesc, spatial_in: usize) -> bool {
    matches!(d.dtype, DType::F16 | DType::BF16)
        && spatial_in >= 2
        && d.groups == 1
        && d.pool.is_none()
        && d.x[1] % 8 == 0
        && d.w[0] % 8 == 0
}

/// The step of a convolution or pooling op: its call and, channels-last, its transposes.
pub fn lower_step(op: &Op, inputs: &[&TensorType], out: &TensorType) -> Result<DnnStep> {
    let mut d = lower(op, inputs, out)?;
    let spatial_in = inputs[0].shape.rank().saturating_sub(2);
    // Channels-last ops are described on their own operands: nothing to stage.
    if d.nhwc || !wants_nhwc(&d, spatial_in) {
        return Ok(DnnStep {
            desc: d,
            before: vec![],
            after: vec![],
        });
    }
    let n = |v: &[i32]| v.iter().map(|&x| x as usize).product::<usize>();
    let es = d.dtype.size_bytes();
    let (xb, wb, yb) = (n(&d.x) * es, n(&d.w) * es, n(&d.y) * es);
    let (xo, wo) = (0usize, xb.next_multiple_of(256));
    let yo = (wo + wb).next_multiple_of(256);
    d.nhwc = true;
    d.staging_bytes = yo + yb;
    let (sx, sw, sy) = (
        ArgRef::ScratchAt(xo),
        ArgRef::ScratchAt(wo),
        ArgRef::ScratchAt(yo),
    );
    // NC·S → N·S·C: batch N, rows C, cols S (the spatial extent); back is the reverse.
    let to_last = |t: &[i32], src: ArgRef, dst: ArgRef| {
        let sp = n(&t[2..]);
        transpose(d.dtype, (t[0] as usize, t[1] as usize, sp), src, None, dst)
    };
    // The forward's bias is added by the transpose back, not by a separate pass over y.
    let bias = (d.kind == DnnKind::ConvForward && d.bias).then_some(ArgRef::Input(2));
    let to_first = |t: &[i32], src: ArgRef, dst: ArgRef| {
        let sp = n(&t[2..]);
        transpose(d.dtype, (t[0] as usize, sp, t[1] as usize), src, bias, dst)
    };
    let (before, after) = match d.kind {
        DnnKind::ConvForward => (
            vec![
                to_last(&d.x, ArgRef::Input(0), sx)?,
                to_last(&d.w, ArgRef::Input(1), sw)?,
            ],
            vec![to_first(&d.y, sy, ArgRef::Output)?],
        ),
        DnnKind::ConvBackwardData => (
            vec![
                to_last(&d.y, ArgRef::Input(0), sy)?,
                to_last(&d.w, ArgRef::Input(1), sw)?,
            ],
            vec![to_first(&d.x, sx, ArgRef::Output)?],
        ),
        DnnKind::ConvBackwardFilter => (
            vec![
                to_last(&d.x, ArgRef::Input(0), sx)?,
                to_last(&d.y, ArgRef::Input(1), sy)?,
            ],
            vec![to_first(&d.w, sw, ArgRef::Output)?],
        ),
        DnnKind::PoolForward | DnnKind::PoolBackward => unreachable!("pooling stays NCHW"),
    };
    d.x_at = sx;
    d.w_at = sw;
    d.y_at = sy;
    d.bias = false;
    Ok(DnnStep {
        desc: d,
        before,
        after,
    })
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
        Op::Conv { geom, groups, .. }
        | Op::ConvGradInput { geom, groups, .. }
        | Op::ConvGradWeight { geom, groups, .. } => {
            let (pad, stride, dilation) = geometry(op, geom)?;
            // Which tensor is which operand (or the output) for each of the three calls.
            use ArgRef::{Input, Output};
            let (kind, x_at, w_at, y_at) = match op {
                Op::Conv { .. } => (DnnKind::ConvForward, Input(0), Input(1), Output),
                Op::ConvGradInput { .. } => (DnnKind::ConvBackwardData, Output, Input(1), Input(0)),
                _ => (DnnKind::ConvBackwardFilter, Input(0), Output, Input(1)),
            };
            // cuDNN's dims are N, C, spatial whatever the memory order (the strides say it).
            let shape = |a: ArgRef| match a {
                Input(k) => lift(op, &geom.layout.dims_to_first(&dims(inputs[k]))),
                _ => lift(op, &geom.layout.dims_to_first(&dims(out))),
            };
            Ok(DnnDesc {
                kind,
                dtype,
                x: shape(x_at)?,
                w: shape(w_at)?,
                y: shape(y_at)?,
                pad,
                stride,
                dilation,
                groups: *groups as i32,
                bias: matches!(op, Op::Conv { bias: true, .. }),
                act: Activation::None,
                pool: None,
                nhwc: geom.layout == Layout::ChannelsLast,
                x_at,
                w_at,
                y_at,
                staging_bytes: 0,
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
            let first = |t: &TensorType| geom.layout.dims_to_first(&dims(t));
            Ok(DnnDesc {
                kind: if grad {
                    DnnKind::PoolBackward
                } else {
                    DnnKind::PoolForward
                },
                dtype,
                x: lift(op, &first(inputs[0]))?,
                w: vec![],
                y: lift(op, &first(y))?,
                pad,
                stride,
                dilation,
                groups: 1,
                bias: false,
                act: Activation::None,
                pool: Some((mode, lift_spatial(op, kernel, 1)?)),
                // Pooling reads its operands and writes its output directly (NHWC descriptors
                // when its layout is channels-last).
                nhwc: geom.layout == Layout::ChannelsLast,
                x_at: ArgRef::Input(0),
                w_at: ArgRef::Input(1),
                y_at: ArgRef::Output,
                staging_bytes: 0,
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
        ConvGeom::new(vec![s; n], vec![p; n], vec![d; n])
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
    fn transposes_through_tiles() {
        use crate::cuda::{interp, StepKernels};
        use rustytorch_ops::testing::rand_tensor;
        // Sizes that are not multiples of the tile, and one that is.
        for (dt, b, r, c) in [
            (DType::F16, 2, 37, 45),
            (DType::F32, 1, 64, 32),
            (DType::BF16, 3, 5, 70),
        ] {
            let x = rand_tensor(&t(dt, &[b, r, c]), 5, -2.0, 2.0);
            let out = t(dt, &[b, c, r]);
            let step = StepKernels {
                launches: vec![
                    transpose(dt, (b, r, c), ArgRef::Input(0), None, ArgRef::Output).unwrap(),
                ],
                scratch_bytes: 0,
            };
            let got = interp::run_step(&step, &[&x], &out, None)
                .unwrap()
                .to_f64_vec();
            let xv = x.to_f64_vec();
            for bi in 0..b {
                for ri in 0..r {
                    for ci in 0..c {
                        assert_eq!(
                            got[(bi * c + ci) * r + ri],
                            xv[(bi * r + ri) * c + ci],
                            "{dt:?} {b}x{r}x{c} at {bi},{ri},{ci}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn transpose_back_adds_the_bias() {
        use crate::cuda::{interp, StepKernels};
        use rustytorch_ops::testing::rand_tensor;
        let (b, r, c) = (2, 40, 24);
        let x = rand_tensor(&t(DType::F32, &[b, r, c]), 8, -2.0, 2.0);
        let bias = rand_tensor(&t(DType::F32, &[c]), 9, -1.0, 1.0);
        let step = StepKernels {
            launches: vec![transpose(
                DType::F32,
                (b, r, c),
                ArgRef::Input(0),
                Some(ArgRef::Input(1)),
                ArgRef::Output,
            )
            .unwrap()],
            scratch_bytes: 0,
        };
        let out = t(DType::F32, &[b, c, r]);
        let got = interp::run_step(&step, &[&x, &bias], &out, None)
            .unwrap()
            .to_f64_vec();
        let (xv, bv) = (x.to_f64_vec(), bias.to_f64_vec());
        for bi in 0..b {
            for ri in 0..r {
                for ci in 0..c {
                    let want = (xv[(bi * r + ri) * c + ci] as f32 + bv[ci] as f32) as f64;
                    assert_eq!(got[(bi * c + ci) * r + ri], want);
                }
            }
        }
    }

    #[test]
    fn half_precision_convolutions_run_channels_last() {
        let g = geom(2, 1, 1, 1);
        let fwd = Op::Conv {
            geom: g.clone(),
            groups: 1,
            bias: true,
        };
        let (x, w, b) = (
            t(DType::F16, &[2, 16, 9, 7]),
            t(DType::F16, &[8, 16, 3, 3]),
            t(DType::F16, &[8]),
        );
        let y = rustytorch_ops::infer(&fwd, &[&x, &w, &b]).unwrap();
        let s = lower_step(&fwd, &[&x, &w, &b], &y).unwrap();
        assert!(s.desc.nhwc);
        assert_eq!((s.before.len(), s.after.len()), (2, 1));
        // The bias is added by the transpose back, not by cuDNN.
        assert_eq!(
            s.after[0].args,
            vec![s.desc.y_at, ArgRef::Input(2), ArgRef::Output]
        );
        assert!(!s.desc.bias);
        assert_eq!(s.before[0].args, vec![ArgRef::Input(0), s.desc.x_at]);
        // Staging buffers do not overlap, and the workspace follows them.
        let offs = [s.desc.x_at, s.desc.w_at, s.desc.y_at].map(|a| match a {
            ArgRef::ScratchAt(o) => o,
            other => panic!("{other:?}"),
        });
        assert!(offs[0] + 2 * 16 * 63 * 2 <= offs[1] && offs[1] + 8 * 16 * 9 * 2 <= offs[2]);
        assert!(offs[2] + 2 * 8 * 63 * 2 <= s.desc.workspace_offset());
        // f32, odd channel counts and groups stay NCHW with no transposes.
        for (dt, c, groups) in [(DType::F32, 16, 1), (DType::F16, 6, 1), (DType::F16, 16, 2)] {
            let op = Op::Conv {
                geom: g.clone(),
                groups,
                bias: false,
            };
            let x = t(dt, &[2, c, 9, 7]);
            let w = t(dt, &[8, c / groups, 3, 3]);
            let y = rustytorch_ops::infer(&op, &[&x, &w]).unwrap();
            let s = lower_step(&op, &[&x, &w], &y).unwrap();
            assert!(!s.desc.nhwc && s.before.is_empty() && s.after.is_empty());
            assert_eq!(
                (s.desc.x_at, s.desc.y_at),
                (ArgRef::Input(0), ArgRef::Output)
            );
        }
    }

    #[test]
    fn channels_last_ops_use_their_operands_directly() {
        let g = geom(2, 1, 1, 1).with_layout(Layout::ChannelsLast);
        let fwd = Op::Conv {
            geom: g.clone(),
            groups: 1,
            bias: true,
        };
        // NHWC x [2, 9, 7, 16], KRSC w [8, 3, 3, 16].
        let (x, w, b) = (
            t(DType::F16, &[2, 9, 7, 16]),
            t(DType::F16, &[8, 3, 3, 16]),
            t(DType::F16, &[8]),
        );
        let y = rustytorch_ops::infer(&fwd, &[&x, &w, &b]).unwrap();
        assert_eq!(y.shape.dims(), &[2, 9, 7, 8]);
        let s = lower_step(&fwd, &[&x, &w, &b], &y).unwrap();
        assert!(s.desc.nhwc && s.before.is_empty() && s.after.is_empty());
        assert_eq!(s.desc.staging_bytes, 0);
        // cuDNN's dims stay N, C, spatial; the strides make them NHWC.
        assert_eq!(
            (&s.desc.x, &s.desc.w, &s.desc.y),
            (&vec![2, 16, 9, 7], &vec![8, 16, 3, 3], &vec![2, 8, 9, 7])
        );
        assert_eq!(
            (s.desc.x_at, s.desc.w_at, s.desc.y_at),
            (ArgRef::Input(0), ArgRef::Input(1), ArgRef::Output)
        );
        assert!(s.desc.bias, "cuDNN adds the bias itself");
        // f32 too (channels-last is the graph's choice, not the step's).
        let gi = Op::ConvGradWeight {
            geom: g.clone(),
            groups: 1,
            weight_shape: w.shape.clone(),
        };
        let (x32, y32) = (t(DType::F32, &[2, 9, 7, 16]), t(DType::F32, &[2, 9, 7, 8]));
        let w32 = t(DType::F32, &[8, 3, 3, 16]);
        let s = lower_step(&gi, &[&x32, &y32], &w32).unwrap();
        assert!(s.desc.nhwc && s.before.is_empty());
        assert_eq!(s.desc.kind, DnnKind::ConvBackwardFilter);
        assert_eq!(s.desc.w, vec![8, 16, 3, 3]);
        // Pooling: NHWC descriptors on its operands.
        let pool = Op::Pool {
            kind: PoolKind::Max,
            kernel: vec![2, 2],
            geom: geom(2, 2, 0, 1).with_layout(Layout::ChannelsLast),
        };
        let py = rustytorch_ops::infer(&pool, &[&x]).unwrap();
        let p = lower_step(&pool, &[&x], &py).unwrap();
        assert!(p.desc.nhwc);
        assert_eq!(
            (&p.desc.x, &p.desc.y),
            (&vec![2, 16, 9, 7], &vec![2, 16, 4, 3])
        );
        assert!(is_channels_last(&pool) && !is_channels_last(&Op::Where));
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
