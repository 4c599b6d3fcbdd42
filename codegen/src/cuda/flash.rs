//! Flash attention on the tensor cores: f16/bf16 attention forward in one kernel whose scores
//! never reach memory, for head sizes that are multiples of 16 up to 128.
//!
//! # The kernel
//!
//! A block of four warps owns 64 query rows of one (batch, head); each warp owns 16 of them and
//! keeps their query fragments in registers for the whole walk over the keys (loaded once, as
//! `mma.m16n8k16` A fragments). The keys and values go through shared memory in tiles of 64
//! rows, loaded with `cp.async` (16-byte chunks; rows past the end are zero-filled): the value
//! tile of step `j` loads while the scores of step `j` are computed, and the key tile of `j + 1`
//! while the probabilities of `j` meet the values. Per tile and warp:
//!
//! 1. `S = Q·Kᵀ` (16 × 64, f32 accumulators) with `mma.sync.m16n8k16`, the key fragments read by
//!    `ldmatrix` from rows padded by 16 bytes (no bank conflicts);
//! 2. the scores scaled into the base-2 domain (`scale · log2 e`), the causal limit, the end of
//!    the keys and the mask applied only on tiles that cross them, then the online softmax: the
//!    row maximum over the four lanes that share a row (two shuffles), the running sum rescaled,
//!    the output accumulators rescaled, `P = 2^(S − m)`;
//! 3. `O += P·V` with `P` rounded to the operands' type and reused straight from the score
//!    accumulators as A fragments (the m16n8 accumulator layout is the A layout of two k-halves),
//!    the value fragments read by `ldmatrix.trans`.
//!
//! At the end each row is divided by its sum (reduced over its four lanes). The semantics are
//! those of the CPU kernel (`rustytorch_ops::attention`): statistics in f32; masked keys (causal,
//! a false bool mask, a −∞ additive mask) weigh nothing; a row whose keys are all masked is zero;
//! a NaN score makes its row NaN. Differences are rounding only: `P` is rounded to f16/bf16
//! before `P·V` (as every flash kernel does) and `2^x` is the hardware approximation.
//!
//! For causal attention a block walks only the key tiles its rows can see, and the blocks are
//! scheduled heaviest first. The grid is one block per (batch·head, query tile), strided when it
//! exceeds the launch limit.
//!
//! This is the `mma.sync` kernel every GPU from sm_80 on runs (Hopper included); what it leaves to
//! a Hopper-specific kernel (warpgroup MMA, TMA loads, warp specialization) is noted in
//! docs/performance.md with its measured speed.

use super::ir::{CTy, Kernel, Param, Stmt};
use super::{finish, grid_for, ArgRef, Launch, StepKernels};
use crate::Result;
use rustytorch_ops::{AttnMask, Causal, DType, Op, Shape, TensorType};

/// Query rows per block (four warps of 16).
const BR: usize = 64;
/// Keys per shared-memory tile.
const BC: usize = 64;
/// Threads per block.
const THREADS: u32 = 128;
/// The largest head size (query/key and value) the kernel holds in registers.
pub const MAX_HEAD: usize = 128;

/// Whether the flash kernel runs attention over `inputs`: f16/bf16 operands with head sizes
/// that are multiples of 16 up to [`MAX_HEAD`]. `RUSTYTORCH_ATTENTION=gemm` or `=kernel` selects
/// the other implementations instead.
pub fn supported(inputs: &[&TensorType]) -> bool {
    let (q, v) = (inputs[0], inputs[2]);
    let (d, dv) = (q.shape.dims()[3], v.shape.dims()[3]);
    let env = std::env::var("RUSTYTORCH_ATTENTION");
    matches!(q.dtype, DType::F16 | DType::BF16)
        && [d, dv]
            .iter()
            .all(|&h| h > 0 && h % 16 == 0 && h <= MAX_HEAD)
        && !matches!(env.as_deref(), Ok("gemm") | Ok("kernel"))
}

/// Lowers `Attention` (operands q, k, v and the mask when it has one) to the flash kernel. The
/// caller checks [`supported`] and that the result type is the inferred one.
pub fn lower(op: &Op, inputs: &[&TensorType], out: &TensorType) -> Result<StepKernels> {
    let Op::Attention {
        causal,
        mask,
        scale,
    } = op
    else {
        return Err(crate::CodegenError::Invalid(format!(
            "{} is not attention",
            op.name()
        )));
    };
    let want = rustytorch_ops::infer(op, inputs)?;
    if &want != out {
        return Err(crate::CodegenError::Invalid(format!(
            "attention: result type {out} does not match the inferred {want}"
        )));
    }
    if out.shape.numel() == 0 {
        return Ok(StepKernels::default());
    }
    let (qd, kd, vd) = (
        inputs[0].shape.dims(),
        inputs[1].shape.dims(),
        inputs[2].shape.dims(),
    );
    let (bsz, heads, sq, d, sk, dv) = (qd[0], qd[1], qd[2], qd[3], kd[2], vd[3]);
    let e = CTy::storage(inputs[0].dtype);
    let mut params = vec![
        param("q", e, false),
        param("k", e, false),
        param("v", e, false),
    ];
    let mask_load = match mask {
        AttnMask::None => None,
        AttnMask::Additive | AttnMask::Bool => {
            let m = inputs[3];
            let me = CTy::storage(m.dtype);
            params.push(param("mask", me, false));
            let st = m.shape.broadcast_strides(&Shape::new([bsz, heads, sq, sk]));
            let index = format!(
                "(bh / {heads}LL) * {}LL + (bh % {heads}LL) * {}LL + (long long)row * {}LL + (long long)key * {}LL",
                st[0], st[1], st[2], st[3]
            );
            Some(match (mask, me) {
                (AttnMask::Bool, _) => format!("x = mask[{index}] ? x : RT_NEG_INF;"),
                (_, CTy::F16) => format!("x += rt_h2f(mask[{index}]) * RT_LOG2E;"),
                (_, CTy::BF16) => format!("x += rt_bf2f(mask[{index}]) * RT_LOG2E;"),
                _ => format!("x += (float)mask[{index}] * RT_LOG2E;"),
            })
        }
    };
    params.push(param("out", e, true));
    let tiles = bsz * heads * sq.div_ceil(BR);
    let body = source(&Shape2 {
        sq,
        sk,
        d,
        dv,
        tiles,
        causal: *causal,
        scale_log2: scale.get() * std::f64::consts::LOG2_E,
        elem: if e == CTy::BF16 { "bf16" } else { "f16" },
        mask: mask_load,
    });
    let kernel = finish(
        "flash_attention",
        Kernel {
            name: String::new(),
            params,
            block: THREADS,
            body: vec![Stmt::Verbatim(body)],
        },
    )?;
    Ok(StepKernels {
        launches: vec![Launch {
            kernel,
            args: (0..inputs.len())
                .map(ArgRef::Input)
                .chain([ArgRef::Output])
                .collect(),
            grid: grid_for(tiles as u64, 1),
        }],
        scratch_bytes: 0,
    })
}

fn param(name: &str, elem: CTy, writes: bool) -> Param {
    Param {
        name: name.into(),
        elem,
        writes,
    }
}

/// What the kernel source is specialized on.
struct Shape2 {
    sq: usize,
    sk: usize,
    d: usize,
    dv: usize,
    tiles: usize,
    causal: Causal,
    scale_log2: f64,
    /// `f16` or `bf16` (the PTX type name).
    elem: &'static str,
    /// The statement that applies the mask to score `x` of row `row`, key `key`.
    mask: Option<String>,
}

/// The end of the keys row `i` sees, as C over `long long i`.
fn limit(causal: Causal, sq: usize, sk: usize) -> String {
    match causal {
        Causal::None => format!("{sk}LL"),
        Causal::TopLeft => format!("min(i + 1LL, {sk}LL)"),
        Causal::BottomRight => {
            let off = 1 + sk as i64 - sq as i64;
            format!("max(min(i + ({off}LL), {sk}LL), 0LL)")
        }
    }
}

/// The kernel body (see the module docs).
fn source(s: &Shape2) -> String {
    let Shape2 {
        sq,
        sk,
        d,
        dv,
        tiles,
        causal,
        scale_log2,
        elem,
        ref mask,
    } = *s;
    let qt = sq.div_ceil(BR);
    let (ks, vs) = (d + 8, dv + 8);
    let lim = limit(causal, sq, sk);
    let has_mask = mask.is_some();
    let mask_stmt = mask.clone().unwrap_or_default();
    format!(
        r#"// Flash attention forward: {BR} query rows a block, key tiles of {BC}, mma.sync m16n8k16 ({elem}).
#define RT_NEG_INF __int_as_float(0xff800000)
#define RT_LOG2E 1.4426950408889634f
__shared__ __align__(16) unsigned short ks[{BC} * {ks}];
__shared__ __align__(16) unsigned short vs[{BC} * {vs}];
const unsigned ks_base = (unsigned)__cvta_generic_to_shared(ks);
const unsigned vs_base = (unsigned)__cvta_generic_to_shared(vs);
const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
const int g = lane >> 2, t4 = lane & 3;
auto lim_of = [](long long i) -> int {{ return (int)({lim}); }};
auto pack = [](float lo, float hi) -> unsigned {{
  unsigned r; asm("cvt.rn.{elem}x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo)); return r;
}};
auto ex2 = [](float x) -> float {{ float y; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }};
for (long long tile = blockIdx.x; tile < {tiles}LL; tile += gridDim.x) {{
  const long long bh = tile / {qt}LL;
  const int qt = (int)({qt}LL - 1LL - tile % {qt}LL);
  const int i0 = qt * {BR} + warp * 16 + g, i1 = i0 + 8;
  const unsigned short* qp = (const unsigned short*)q + bh * {sq}LL * {d}LL;
  const unsigned short* kp = (const unsigned short*)k + bh * {sk}LL * {d}LL;
  const unsigned short* vp = (const unsigned short*)v + bh * {sk}LL * {dv}LL;
  // This warp's 16 query rows as A fragments, for the whole walk.
  unsigned qa[{dq16}][4];
  #pragma unroll
  for (int kk = 0; kk < {dq16}; ++kk) {{
    const int c = kk * 16 + t4 * 2;
    qa[kk][0] = i0 < {sq} ? *(const unsigned*)(qp + (long long)i0 * {d} + c) : 0u;
    qa[kk][1] = i1 < {sq} ? *(const unsigned*)(qp + (long long)i1 * {d} + c) : 0u;
    qa[kk][2] = i0 < {sq} ? *(const unsigned*)(qp + (long long)i0 * {d} + c + 8) : 0u;
    qa[kk][3] = i1 < {sq} ? *(const unsigned*)(qp + (long long)i1 * {d} + c + 8) : 0u;
  }}
  const int lim0 = lim_of(i0), lim1 = lim_of(i1);
  const int lim_first = lim_of(qt * {BR});
  const int kend = lim_of(min(qt * {BR} + {BR} - 1, {sq} - 1));
  const int ntiles = (kend + {BC} - 1) / {BC};
  float o[{dv8}][4];
  #pragma unroll
  for (int n = 0; n < {dv8}; ++n) {{ o[n][0] = 0.f; o[n][1] = 0.f; o[n][2] = 0.f; o[n][3] = 0.f; }}
  float m0 = RT_NEG_INF, m1 = RT_NEG_INF, l0 = 0.f, l1 = 0.f;
  // Tile `j` of keys (or values) into shared memory, rows past the end zero-filled.
  auto load_tile = [&](const unsigned short* src, unsigned base, int j, int width, int stride) {{
    const int chunks = width / 8;
    for (int c = tid; c < {BC} * chunks; c += {THREADS}) {{
      const int r = c / chunks, c8 = c - r * chunks;
      const int key = j * {BC} + r;
      const unsigned short* from = src + (long long)(key < {sk} ? key : 0) * width + c8 * 8;
      const unsigned to = base + (unsigned)((r * stride + c8 * 8) * 2);
      const int bytes = key < {sk} ? 16 : 0;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(to), "l"(from), "r"(bytes));
    }}
    asm volatile("cp.async.commit_group;");
  }};
  if (ntiles > 0) load_tile(kp, ks_base, 0, {d}, {ks});
  for (int j = 0; j < ntiles; ++j) {{
    asm volatile("cp.async.wait_group 0;");
    __syncthreads();
    load_tile(vp, vs_base, j, {dv}, {vs});
    // S = Q·Kᵀ for this warp's rows and the tile's 64 keys.
    float s[8][4];
    #pragma unroll
    for (int n = 0; n < 8; ++n) {{ s[n][0] = 0.f; s[n][1] = 0.f; s[n][2] = 0.f; s[n][3] = 0.f; }}
    #pragma unroll
    for (int kk = 0; kk < {dq16}; ++kk) {{
      #pragma unroll
      for (int np = 0; np < 4; ++np) {{
        const int row = np * 16 + (lane & 7) + (lane >> 4) * 8;
        const int col = kk * 16 + ((lane >> 3) & 1) * 8;
        unsigned b0, b1, b2, b3;
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {{%0,%1,%2,%3}}, [%4];"
                     : "=r"(b0), "=r"(b1), "=r"(b2), "=r"(b3) : "r"(ks_base + (unsigned)((row * {ks} + col) * 2)));
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.{elem}.{elem}.f32 {{%0,%1,%2,%3}}, {{%4,%5,%6,%7}}, {{%8,%9}}, {{%0,%1,%2,%3}};"
                     : "+f"(s[2 * np][0]), "+f"(s[2 * np][1]), "+f"(s[2 * np][2]), "+f"(s[2 * np][3])
                     : "r"(qa[kk][0]), "r"(qa[kk][1]), "r"(qa[kk][2]), "r"(qa[kk][3]), "r"(b0), "r"(b1));
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.{elem}.{elem}.f32 {{%0,%1,%2,%3}}, {{%4,%5,%6,%7}}, {{%8,%9}}, {{%0,%1,%2,%3}};"
                     : "+f"(s[2 * np + 1][0]), "+f"(s[2 * np + 1][1]), "+f"(s[2 * np + 1][2]), "+f"(s[2 * np + 1][3])
                     : "r"(qa[kk][0]), "r"(qa[kk][1]), "r"(qa[kk][2]), "r"(qa[kk][3]), "r"(b2), "r"(b3));
      }}
    }}
    __syncthreads();
    if (j + 1 < ntiles) load_tile(kp, ks_base, j + 1, {d}, {ks});
    else asm volatile("cp.async.commit_group;");
    // Scale into base 2; limits and the mask only where the tile crosses them.
    const int kb = j * {BC};
    const bool edge = {has_mask} || kb + {BC} > lim_first;
    #pragma unroll
    for (int n = 0; n < 8; ++n) {{
      #pragma unroll
      for (int e = 0; e < 4; ++e) {{
        float x = s[n][e] * {scale_log2:?}f;
        if (edge) {{
          const int key = kb + n * 8 + t4 * 2 + (e & 1);
          const int row = e < 2 ? i0 : i1;
          if (key >= (e < 2 ? lim0 : lim1) || row >= {sq}) {{
            x = RT_NEG_INF;
          }} else {{
            {mask_stmt}
          }}
        }}
        s[n][e] = x;
      }}
    }}
    // Online softmax: the rows' maxima over the four lanes that share them.
    float mx0 = RT_NEG_INF, mx1 = RT_NEG_INF;
    #pragma unroll
    for (int n = 0; n < 8; ++n) {{
      mx0 = fmaxf(mx0, fmaxf(s[n][0], s[n][1]));
      mx1 = fmaxf(mx1, fmaxf(s[n][2], s[n][3]));
    }}
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
    const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
    // A row with nothing visible yet keeps a finite reference so that 2^(−∞ − ref) is 0.
    const float r0 = mn0 == RT_NEG_INF ? 0.f : mn0, r1 = mn1 == RT_NEG_INF ? 0.f : mn1;
    const float a0 = ex2(m0 - r0), a1 = ex2(m1 - r1);
    m0 = mn0; m1 = mn1;
    l0 *= a0; l1 *= a1;
    #pragma unroll
    for (int n = 0; n < {dv8}; ++n) {{ o[n][0] *= a0; o[n][1] *= a0; o[n][2] *= a1; o[n][3] *= a1; }}
    #pragma unroll
    for (int n = 0; n < 8; ++n) {{
      s[n][0] = ex2(s[n][0] - r0); s[n][1] = ex2(s[n][1] - r0);
      s[n][2] = ex2(s[n][2] - r1); s[n][3] = ex2(s[n][3] - r1);
      l0 += s[n][0] + s[n][1]; l1 += s[n][2] + s[n][3];
    }}
    asm volatile("cp.async.wait_group 1;");
    __syncthreads();
    // O += P·V: the score accumulators of key halves 2kk and 2kk+1 are P's A fragment.
    #pragma unroll
    for (int kk = 0; kk < 4; ++kk) {{
      const unsigned pa0 = pack(s[2 * kk][0], s[2 * kk][1]);
      const unsigned pa1 = pack(s[2 * kk][2], s[2 * kk][3]);
      const unsigned pa2 = pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      const unsigned pa3 = pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
      #pragma unroll
      for (int dp = 0; dp < {dv16}; ++dp) {{
        const int row = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
        const int col = dp * 16 + (lane >> 4) * 8;
        unsigned b0, b1, b2, b3;
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {{%0,%1,%2,%3}}, [%4];"
                     : "=r"(b0), "=r"(b1), "=r"(b2), "=r"(b3) : "r"(vs_base + (unsigned)((row * {vs} + col) * 2)));
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.{elem}.{elem}.f32 {{%0,%1,%2,%3}}, {{%4,%5,%6,%7}}, {{%8,%9}}, {{%0,%1,%2,%3}};"
                     : "+f"(o[2 * dp][0]), "+f"(o[2 * dp][1]), "+f"(o[2 * dp][2]), "+f"(o[2 * dp][3])
                     : "r"(pa0), "r"(pa1), "r"(pa2), "r"(pa3), "r"(b0), "r"(b1));
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.{elem}.{elem}.f32 {{%0,%1,%2,%3}}, {{%4,%5,%6,%7}}, {{%8,%9}}, {{%0,%1,%2,%3}};"
                     : "+f"(o[2 * dp + 1][0]), "+f"(o[2 * dp + 1][1]), "+f"(o[2 * dp + 1][2]), "+f"(o[2 * dp + 1][3])
                     : "r"(pa0), "r"(pa1), "r"(pa2), "r"(pa3), "r"(b2), "r"(b3));
      }}
    }}
  }}
  // Each row's sum over its four lanes; a row that saw nothing is zero, a NaN row stays NaN.
  l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
  l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
  const float inv0 = l0 == 0.f ? 0.f : 1.f / l0, inv1 = l1 == 0.f ? 0.f : 1.f / l1;
  unsigned short* op = (unsigned short*)out + bh * {sq}LL * {dv}LL;
  #pragma unroll
  for (int n = 0; n < {dv8}; ++n) {{
    const int c = n * 8 + t4 * 2;
    if (i0 < {sq}) *(unsigned*)(op + (long long)i0 * {dv} + c) = pack(o[n][0] * inv0, o[n][1] * inv0);
    if (i1 < {sq}) *(unsigned*)(op + (long long)i1 * {dv} + c) = pack(o[n][2] * inv1, o[n][3] * inv1);
  }}
  __syncthreads();
}}"#,
        dq16 = d / 16,
        dv8 = dv / 8,
        dv16 = dv / 16,
        scale_log2 = scale_log2 as f32,
    )
}
