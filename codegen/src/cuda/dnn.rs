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
//!
//! A convolution's bias and activation (`Op::Conv { act, .. }`) are applied where they cost no
//! extra pass when possible: a staged step's transpose back adds the bias and applies the
//! activation in the same kernel; an unstaged step leaves a ReLU on its descriptor with the bias
//! (the runtime applies both on every cuDNN: fused into the convolution where a cuDNN graph
//! engine has the pattern, else after it); an unstaged GELU (which cuDNN applies only through
//! graph engines that a given shape may lack) gets one generated kernel after the call that adds
//! the bias and applies the activation in place (16-byte vectors along the channels when they
//! tile), and its descriptor then carries neither.

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
    /// `y = act(conv(x, w) [+ bias])`; operands x, w, [bias].
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
    /// The runtime adds a bias `[K]` (operand 2) to the convolution's output (staged
    /// channels-first steps add it in their transpose back instead, and steps whose activation
    /// runs in a generated kernel add it there: both clear this).
    pub bias: bool,
    /// Activation applied after the bias (convolution forward only; `None` elsewhere). After
    /// [`lower_step`] it is `None` or an activation [`runtime_applies`] (ReLU), set only on
    /// unstaged steps: the runtime applies the bias and then this activation to `y` (fused into
    /// cuDNN's call where it can, else after it). Other activations run in the step's own
    /// launches.
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

/// `out[b][c][r] = act(in[b][r][c] [+ bias[c]])` for `batch` matrices of `rows × cols`, through
/// 32×32 shared-memory tiles so that both the reads and the writes are coalesced.
pub fn transpose_kernel(
    dt: DType,
    batch: usize,
    rows: usize,
    cols: usize,
    bias: bool,
    act: Activation,
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
        let vk = format!("v{k}");
        per_tile.push(if_(
            and(lt(var(&ro), i64c(r)), lt(var(&co), i64c(c))),
            vec![
                let_(&vk, ty, v),
                store(
                    "out",
                    el,
                    add(var("base"), add(mul(var(&co), i64c(r)), var(&ro))),
                    activation(act, var(&vk), ty),
                ),
            ],
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
        map: None,
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
        smem: 0,
        body,
    };
    finish("transpose", k)
}

/// A launch of [`transpose_kernel`] from `src` to `dst`, adding the per-column `bias` if given
/// and applying `act`.
fn transpose(
    dt: DType,
    (batch, rows, cols): (usize, usize, usize),
    src: ArgRef,
    bias: Option<ArgRef>,
    act: Activation,
    dst: ArgRef,
) -> Result<Launch> {
    let tiles = batch as u64 * (rows as u64).div_ceil(32) * (cols as u64).div_ceil(32);
    let mut args = vec![src];
    args.extend(bias);
    args.push(dst);
    Ok(Launch {
        kernel: transpose_kernel(dt, batch, rows, cols, bias.is_some(), act)?,
        args,
        grid: grid_for(tiles, 1).min(MAX_GRID as u32),
    })
}

/// `act(x)` for a variable `x` of compute type `ct`, as the CPU kernel computes it (ReLU keeps
/// NaN; GELU's exact form through `erfc`).
pub(super) fn activation(act: Activation, x: Expr, ct: CTy) -> Expr {
    let half = || lit(0.5, ct);
    match act {
        Activation::None => x,
        Activation::Relu => select(lt(x.clone(), lit(0.0, ct)), lit(0.0, ct), x),
        // 0.5·x·erfc(−x/√2).
        Activation::GeluErf => mul(
            mul(half(), x.clone()),
            un(
                UnFn::Erfc,
                mul(un(UnFn::Neg, x), lit(std::f64::consts::FRAC_1_SQRT_2, ct)),
            ),
        ),
        Activation::GeluTanh => {
            let c = lit(0.044_715, ct);
            let s = lit((2.0 / std::f64::consts::PI).sqrt(), ct);
            let u = mul(
                s,
                add(x.clone(), mul(mul(mul(c, x.clone()), x.clone()), x.clone())),
            );
            mul(mul(half(), x), add(lit(1.0, ct), un(UnFn::Tanh, u)))
        }
    }
}

/// `y = act(y [+ bias[channel]])` in place over a convolution's output `y` of `dims` (cuDNN's
/// `[N, C, spatial...]`), stored channels-last when `nhwc`. In 16-byte vectors when they tile
/// the layout's inner run (the channels channels-last, the spatial extent channels-first: then
/// one vector has one channel), else one element a thread.
pub fn bias_act_kernel(
    prefix: &str,
    dt: DType,
    dims: &[usize],
    nhwc: bool,
    bias: bool,
    act: Activation,
) -> Result<Kernel> {
    let (st, ct) = (CTy::storage(dt), CTy::compute(dt));
    let numel: usize = dims.iter().product();
    let c = dims.get(1).copied().unwrap_or(1) as i64;
    let sp = dims.iter().skip(2).product::<usize>() as i64;
    // The channel of flat element `i`.
    let channel = |i: Expr| {
        if nhwc {
            rem(i, i64c(c))
        } else {
            rem(div(i, i64c(sp)), i64c(c))
        }
    };
    let mut params = vec![Param {
        name: "y".into(),
        elem: st,
        writes: true,
        map: None,
    }];
    if bias {
        params.push(Param {
            name: "bias".into(),
            elem: st,
            writes: false,
            map: None,
        });
    }
    let w = 16 / elem_bytes(st);
    let inner = if nhwc { c } else { sp };
    let body = if w > 1 && inner % w as i64 == 0 {
        let names = |p: &str| (0..w).map(|k| format!("{p}{k}")).collect::<Vec<_>>();
        let mut b = vec![
            let_("i", CTy::I64, mul(var("j"), i64c(w as i64))),
            load_vec("y", st, var("i"), names("v")),
        ];
        if bias && nhwc {
            b.push(load_vec("bias", st, channel(var("i")), names("b")));
        } else if bias {
            b.push(let_("b", ct, load("bias", st, channel(var("i")))));
        }
        let values = (0..w)
            .map(|k| {
                let mut x = var(&format!("v{k}"));
                if bias {
                    x = add(x, var(&if nhwc { format!("b{k}") } else { "b".into() }));
                }
                b.push(let_(&format!("x{k}"), ct, x));
                activation(act, var(&format!("x{k}")), ct)
            })
            .collect();
        b.push(store_vec("y", st, var("i"), values));
        vec![grid_stride("j", (numel / w) as i64, b)]
    } else {
        let mut b = vec![let_("v", ct, load("y", st, var("i")))];
        if bias {
            b.push(assign(
                "v",
                add(var("v"), load("bias", st, channel(var("i")))),
            ));
        }
        b.push(store("y", st, var("i"), activation(act, var("v"), ct)));
        vec![grid_stride("i", numel as i64, b)]
    };
    finish(
        prefix,
        Kernel {
            name: String::new(),
            params,
            block: 256,
            smem: 0,
            body,
        },
    )
}

/// A launch of [`bias_act_kernel`] over the step's output (bias: operand 2).
fn bias_act(d: &DnnDesc, dims: &[usize]) -> Result<Launch> {
    let numel: usize = dims.iter().product();
    let w = 16 / elem_bytes(CTy::storage(d.dtype));
    let mut args = vec![ArgRef::Output];
    if d.bias {
        args.push(ArgRef::Input(2));
    }
    Ok(Launch {
        kernel: bias_act_kernel("conv_bias_act", d.dtype, dims, d.nhwc, d.bias, d.act)?,
        args,
        grid: grid_for(numel.div_ceil(w) as u64, u64::from(TBLOCK)),
    })
}

/// Whether the runtime applies `act` after a convolution forward's bias on every cuDNN (the
/// contract of the runtime's `fused_act_supported`): ReLU, by the fused graph or cuDNN's own
/// activation call. GELU is left to generated kernels.
pub fn runtime_applies(act: Activation) -> bool {
    matches!(act, Activation::None | Activation::Relu)
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
        let mut after = vec![];
        // An activation the runtime does not apply (and the bias before it) is one generated
        // pass over the output.
        if !runtime_applies(d.act) {
            let dims: Vec<usize> = d.y.iter().map(|&v| v as usize).collect();
            if dims.iter().product::<usize>() > 0 {
                after.push(bias_act(&d, &dims)?);
            }
            d.bias = false;
            d.act = Activation::None;
        }
        return Ok(DnnStep {
            desc: d,
            before: vec![],
            after,
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
        let none = Activation::None;
        transpose(
            d.dtype,
            (t[0] as usize, t[1] as usize, sp),
            src,
            None,
            none,
            dst,
        )
    };
    // The forward's bias and activation are applied by the transpose back, not by separate
    // passes over y.
    let fwd = d.kind == DnnKind::ConvForward;
    let bias = (fwd && d.bias).then_some(ArgRef::Input(2));
    let act = if fwd { d.act } else { Activation::None };
    let to_first = |t: &[i32], src: ArgRef, dst: ArgRef| {
        let sp = n(&t[2..]);
        transpose(
            d.dtype,
            (t[0] as usize, sp, t[1] as usize),
            src,
            bias,
            act,
            dst,
        )
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
    d.act = Activation::None;
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
                act: match op {
                    Op::Conv { act, .. } => *act,
                    _ => Activation::None,
                },
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
            act: Activation::None,
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
            act: Activation::None,
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
                launches: vec![transpose(
                    dt,
                    (b, r, c),
                    ArgRef::Input(0),
                    None,
                    Activation::None,
                    ArgRef::Output,
                )
                .unwrap()],
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
                Activation::None,
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
            act: Activation::None,
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
                act: Activation::None,
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
            act: Activation::None,
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

    const ACTS: [Activation; 3] = [Activation::Relu, Activation::GeluErf, Activation::GeluTanh];

    /// `act(v)` in float64 through the CPU's unary kernel.
    fn act_f64(act: Activation, v: Vec<f64>) -> Vec<f64> {
        use rustytorch_ops::{eval_cpu, HostTensor, UnaryOp};
        let u = match act {
            Activation::None => return v,
            Activation::Relu => UnaryOp::Relu,
            Activation::GeluErf => UnaryOp::GeluErf,
            Activation::GeluTanh => UnaryOp::GeluTanh,
        };
        let n = v.len();
        let t = HostTensor::from_vec(v, [n]).unwrap();
        eval_cpu(&Op::Unary(u), &[&t]).unwrap().to_f64_vec()
    }

    #[test]
    fn transpose_back_applies_the_activation() {
        use crate::cuda::{interp, StepKernels};
        use rustytorch_ops::testing::{assert_close, rand_tensor, tolerance};
        let (b, r, c) = (2, 40, 24);
        for dt in [DType::F32, DType::F16, DType::BF16] {
            for act in ACTS {
                let x = rand_tensor(&t(dt, &[b, r, c]), 18, -2.0, 2.0);
                let bias = rand_tensor(&t(dt, &[c]), 19, -1.0, 1.0);
                let step = StepKernels {
                    launches: vec![transpose(
                        dt,
                        (b, r, c),
                        ArgRef::Input(0),
                        Some(ArgRef::Input(1)),
                        act,
                        ArgRef::Output,
                    )
                    .unwrap()],
                    scratch_bytes: 0,
                };
                let out = t(dt, &[b, c, r]);
                let got = interp::run_step(&step, &[&x, &bias], &out, None)
                    .unwrap()
                    .to_f64_vec();
                let (xv, bv) = (x.to_f64_vec(), bias.to_f64_vec());
                let mut pre = vec![0.0; b * r * c];
                for bi in 0..b {
                    for ri in 0..r {
                        for ci in 0..c {
                            pre[(bi * c + ci) * r + ri] = xv[(bi * r + ri) * c + ci] + bv[ci];
                        }
                    }
                }
                let want = act_f64(act, pre);
                assert_close(&got, &want, tolerance(dt), &format!("{dt:?} {act:?}"));
            }
        }
    }

    /// An unstaged step with a GELU (which the runtime does not apply) gets one bias+activation
    /// kernel after the call, over the output in place (channels-first and channels-last, vectors
    /// and single elements); a ReLU stays on the descriptor.
    #[test]
    fn bias_and_activation_run_after_the_call() {
        use crate::cuda::{interp, StepKernels};
        use rustytorch_ops::testing::{assert_close, rand_tensor, tolerance};
        // (dtype, channels, spatial, layout, groups): vector and scalar paths in both layouts.
        let cases = [
            (DType::F32, 16, [8, 8], Layout::ChannelsFirst, 1),
            (DType::F32, 6, [9, 7], Layout::ChannelsFirst, 1),
            (DType::F64, 16, [4, 5], Layout::ChannelsLast, 1),
            (DType::F32, 6, [4, 5], Layout::ChannelsLast, 1),
            (DType::F16, 16, [8, 8], Layout::ChannelsFirst, 2),
            (DType::BF16, 6, [9, 7], Layout::ChannelsFirst, 1),
        ];
        for (k, (dt, ch, sp, layout, groups)) in cases.into_iter().enumerate() {
            for (j, act) in ACTS.into_iter().enumerate() {
                for bias in [true, false] {
                    let op = Op::Conv {
                        geom: geom(2, 1, 1, 1).with_layout(layout),
                        groups,
                        bias,
                        act,
                    };
                    let first = |d: &[usize]| t(dt, &layout.dims_from_first(d));
                    let x = first(&[2, 8, sp[0], sp[1]]);
                    let w = first(&[ch, 8 / groups, 3, 3]);
                    let bt = t(dt, &[ch]);
                    let mut ins = vec![&x, &w];
                    if bias {
                        ins.push(&bt);
                    }
                    let y = rustytorch_ops::infer(&op, &ins).unwrap();
                    let s = lower_step(&op, &ins, &y).unwrap();
                    if act == Activation::Relu {
                        // The runtime applies the bias and the ReLU.
                        assert_eq!((s.desc.bias, s.desc.act), (bias, act));
                        assert!(s.after.is_empty());
                        continue;
                    }
                    assert_eq!(
                        (s.desc.bias, s.desc.act, s.after.len()),
                        (false, Activation::None, 1),
                        "{dt:?} {layout:?}"
                    );
                    let seed = 100 * k as u64 + 10 * j as u64;
                    let pre = rand_tensor(&y, seed, -2.0, 2.0);
                    let bv = rand_tensor(&bt, seed + 1, -1.0, 1.0);
                    let (xs, ws) = (rand_tensor(&x, 1, -1.0, 1.0), rand_tensor(&w, 2, -1.0, 1.0));
                    let mut args = vec![&xs, &ws];
                    if bias {
                        args.push(&bv);
                    }
                    let step = StepKernels {
                        launches: s.after.clone(),
                        scratch_bytes: 0,
                    };
                    let got = interp::run_step(&step, &args, &y, Some(&pre))
                        .unwrap()
                        .to_f64_vec();
                    let (pv, b64) = (pre.to_f64_vec(), bv.to_f64_vec());
                    let rank = y.shape.rank();
                    let c_axis = layout.channel_axis(rank);
                    let dims = y.shape.dims();
                    let inner: usize = dims[c_axis + 1..].iter().product();
                    let with_bias: Vec<f64> = pv
                        .iter()
                        .enumerate()
                        .map(|(i, v)| v + if bias { b64[(i / inner) % ch] } else { 0.0 })
                        .collect();
                    let want = act_f64(act, with_bias);
                    let what = format!("{dt:?} {layout:?} {act:?} bias={bias}");
                    assert_close(&got, &want, tolerance(dt), &what);
                }
            }
        }
    }

    /// Channels-last half precision leaves a ReLU and the bias to the runtime and runs a GELU
    /// itself; a staged step applies both in its transpose back.
    #[test]
    fn half_precision_activation_placement() {
        let (x, w, b) = (
            t(DType::BF16, &[2, 9, 7, 16]),
            t(DType::BF16, &[8, 3, 3, 16]),
            t(DType::BF16, &[8]),
        );
        let op = Op::Conv {
            geom: geom(2, 1, 1, 1).with_layout(Layout::ChannelsLast),
            groups: 1,
            bias: true,
            act: Activation::GeluErf,
        };
        let y = rustytorch_ops::infer(&op, &[&x, &w, &b]).unwrap();
        let s = lower_step(&op, &[&x, &w, &b], &y).unwrap();
        assert!(s.desc.nhwc && s.after.len() == 1);
        assert_eq!((s.desc.bias, s.desc.act), (false, Activation::None));
        let relu = Op::Conv {
            geom: geom(2, 1, 1, 1).with_layout(Layout::ChannelsLast),
            groups: 1,
            bias: true,
            act: Activation::Relu,
        };
        let s = lower_step(&relu, &[&x, &w, &b], &y).unwrap();
        assert!(s.desc.nhwc && s.after.is_empty());
        assert_eq!((s.desc.bias, s.desc.act), (true, Activation::Relu));
        // Staged channels-first.
        let op = Op::Conv {
            geom: geom(2, 1, 1, 1),
            groups: 1,
            bias: true,
            act: Activation::Relu,
        };
        let (x, w) = (t(DType::F16, &[2, 16, 9, 7]), t(DType::F16, &[8, 16, 3, 3]));
        let b = t(DType::F16, &[8]);
        let y = rustytorch_ops::infer(&op, &[&x, &w, &b]).unwrap();
        let s = lower_step(&op, &[&x, &w, &b], &y).unwrap();
        assert!(s.desc.nhwc && s.after.len() == 1);
        assert_eq!((s.desc.bias, s.desc.act), (false, Activation::None));
        let plain = transpose_kernel(DType::F16, 2, 63, 8, true, Activation::None).unwrap();
        assert_ne!(
            s.after[0].kernel.name, plain.name,
            "the transpose back applies the relu"
        );
        // The gradients never carry an activation.
        let gi = Op::ConvGradInput {
            geom: geom(2, 1, 1, 1),
            groups: 1,
            input_shape: x.shape.clone(),
        };
        let d = lower(&gi, &[&y, &w], &x).unwrap();
        assert_eq!(d.act, Activation::None);
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
