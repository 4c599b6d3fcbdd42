//! Split-key decoding: attention of one query row (`Sq = 1`, a decoding step) over a long key
//! sequence, at the speed of reading the keys and values once.
//!
//! The tiled kernels give a block 64 query rows of one head, so a decoding step runs one block
//! per (batch, head) with 63 of its rows idle, and its key walk is serial. Here the keys of each
//! head are split into chunks (64 to 1024 keys, [`chunk_keys`]) and every (head, chunk) is a
//! block of 128 threads:
//!
//! 1. **Scores.** The query row is held in registers, scaled into the base-2 domain. Each key
//!    row is read by `d / 8` lanes as 16-byte vectors, [`BATCH`] rows a lane in flight before
//!    any is used; the lanes' partial dot products meet by shuffles, and the causal limit and the
//!    mask apply before the score goes to shared memory.
//! 2. **Softmax of the chunk.** The chunk's maximum `m` and `l = Σ 2^(s − m)` by block
//!    reductions; the scores become the weights `p = 2^(s − m)` in place (masked keys weigh 0).
//! 3. **`o = Σ p·v`.** Each value row is read by `dv / 8` lanes as 16-byte vectors, again a batch
//!    in flight; the lane groups' partial sums meet in shared memory. The chunk's unnormalized
//!    `o`, `m` and `l` (f32) go to the step's scratch.
//!
//! A second kernel combines a head's chunks: `M = max m`, `L = Σ l·2^(m − M)`,
//! `out = Σ o·2^(m − M) / L`, rounded once to the output type. A row whose keys are all masked
//! has `L = 0` and is zero, and a NaN score makes the row NaN, as in the tiled kernels. The
//! weights stay in f32 (the tiled kernels round `P` to f16/bf16 before `P·V`).

use super::{param, Part, Spec};
use crate::cuda::ir::{CTy, Kernel, Stmt};
use crate::cuda::{finish, grid_for, ArgRef, Launch, StepKernels};
use crate::Result;
use rustytorch_ops::Causal;

/// Blocks the split aims for: about eight per SM of an H100/H200 (132 SMs), enough to keep the
/// memory system busy.
const TARGET_BLOCKS: usize = 1024;

/// Keys per block: the largest power of two from 64 to 1024 that still gives `heads` heads of
/// `sk` keys [`TARGET_BLOCKS`] blocks (64 when none does). Longer chunks mean fewer partial
/// results to combine: on the H200, B8 H32 Sk8192 D128 ran in 245.5 µs with chunks of 256,
/// 241.7 µs with 512 and 239.5 µs with 1024 (docs/performance.md).
/// `RUSTYTORCH_DECODE_CHUNK` (a power of two from 64 to 2048) overrides it, for measurements.
fn chunk_keys(heads: usize, sk: usize) -> usize {
    if let Some(c) = std::env::var("RUSTYTORCH_DECODE_CHUNK")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|c| c.is_power_of_two() && (64..=2048).contains(c))
    {
        return c;
    }
    [1024, 512, 256, 128]
        .into_iter()
        .find(|&c| heads * sk.div_ceil(c) >= TARGET_BLOCKS)
        .unwrap_or(64)
}

/// Threads per block (both kernels).
const THREADS: usize = 128;
/// Key or value rows a lane loads before it uses any.
const BATCH: usize = 8;

/// Whether the decoding kernels run this attention: one query row, and head sizes whose rows a
/// power-of-two group of lanes reads in 16-byte vectors (32, 64 or 128). `RUSTYTORCH_FLASH_DECODE=0`
/// keeps the tiled kernel (for measurements).
pub(super) fn supported(sp: &Spec) -> bool {
    sp.sq == 1
        && [sp.d, sp.dv].iter().all(|&h| matches!(h, 32 | 64 | 128))
        && std::env::var("RUSTYTORCH_FLASH_DECODE").as_deref() != Ok("0")
}

/// The two launches (chunks, then their combination) and the scratch they share: per
/// (head, chunk) `dv` f32 of `o`, then one f32 of `m` and one of `l`.
pub(super) fn lower(sp: &Spec, n_inputs: usize) -> Result<StepKernels> {
    let chunk = chunk_keys(sp.bsz * sp.heads, sp.sk).min(sp.sk.max(1));
    let splits = sp.sk.max(1).div_ceil(chunk);
    let heads = sp.bsz * sp.heads;
    let blocks = heads * splits;
    let align = |b: usize| b.div_ceil(256) * 256;
    let m_at = align(blocks * sp.dv * 4);
    let l_at = m_at + align(blocks * 4);
    let scratch_bytes = l_at + align(blocks * 4);
    let parts = [
        ArgRef::ScratchAt(0),
        ArgRef::ScratchAt(m_at),
        ArgRef::ScratchAt(l_at),
    ];
    let mut params = sp.params.clone();
    params.extend([
        param("po", CTy::F32, true),
        param("pm", CTy::F32, true),
        param("pl", CTy::F32, true),
    ]);
    let split = finish(
        "flash_decode_split",
        Kernel {
            name: String::new(),
            params,
            block: THREADS as u32,
            smem: 0,
            body: vec![Stmt::Verbatim(split_source(sp, chunk, splits))],
        },
    )?;
    let combine = finish(
        "flash_decode_combine",
        Kernel {
            name: String::new(),
            params: vec![
                param("po", CTy::F32, false),
                param("pm", CTy::F32, false),
                param("pl", CTy::F32, false),
                param("out", sp.e, true),
            ],
            block: THREADS as u32,
            smem: 0,
            body: vec![Stmt::Verbatim(combine_source(sp, splits))],
        },
    )?;
    Ok(StepKernels {
        launches: vec![
            Launch {
                kernel: split,
                args: (0..n_inputs).map(ArgRef::Input).chain(parts).collect(),
                grid: grid_for(blocks as u64, 1),
            },
            Launch {
                kernel: combine,
                args: parts.into_iter().chain([ArgRef::Output]).collect(),
                grid: grid_for(heads as u64, 1),
            },
        ],
        scratch_bytes,
    })
}

/// The widening of one 16-bit element (`rt_bf2f` or `rt_h2f`).
fn widen(sp: &Spec) -> &'static str {
    if sp.e == CTy::BF16 {
        "rt_bf2f"
    } else {
        "rt_h2f"
    }
}

/// The chunk kernel (see the module docs).
fn split_source(sp: &Spec, chunk: usize, splits: usize) -> String {
    let (sk, d, dv) = (sp.sk, sp.d, sp.dv);
    let (lk, lv) = (d / 8, dv / 8);
    // Keys a warp scores at once, lane groups of the value pass.
    let (kw, groups) = (32 / lk, THREADS / lv);
    let per_pass = THREADS / lk;
    let iters = chunk.div_ceil(per_pass);
    // The one row sees keys [0, lim): all of them, or the first alone for top-left causality.
    let lim = match sp.causal {
        Causal::TopLeft => sk.min(1),
        Causal::None | Causal::BottomRight => sk,
    };
    let mask = sp.mask.clone().unwrap_or_default();
    let scale = sp.scale * std::f64::consts::LOG2_E;
    let (qh, kh, vh) = (sp.head(Part::Q), sp.head(Part::K), sp.head(Part::V));
    let (k_rs, v_rs) = (sp.stride(Part::K), sp.stride(Part::V));
    let w = widen(sp);
    let blocks = sp.bsz * sp.heads * splits;
    format!(
        r#"// Split-key decoding: one query row, {chunk} keys a block, {lk} lanes a key row.
#define RT_NEG_INF __int_as_float(0xff800000)
#define RT_LOG2E 1.4426950408889634f
__shared__ float sc[{chunk}];
__shared__ float red[{groups} * {dv}];
__shared__ float wred[{nw2}];
const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
auto ex2 = [](float x) -> float {{ float y; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }};
auto unpack = [](uint4 u, float* f) {{
  const unsigned w[4] = {{u.x, u.y, u.z, u.w}};
  #pragma unroll
  for (int i = 0; i < 4; ++i) {{
    f[2 * i] = {w}((unsigned short)(w[i] & 0xffffu));
    f[2 * i + 1] = {w}((unsigned short)(w[i] >> 16));
  }}
}};
const int lim = (int)({lim});
for (long long tile = blockIdx.x; tile < {blocks}LL; tile += gridDim.x) {{
  const long long bh = tile / {splits}LL;
  const int k0 = (int)(tile % {splits}LL) * {chunk};
  const int kn = min({chunk}, {sk} - k0);
  const unsigned short* qp = (const unsigned short*)q + {qh};
  const unsigned short* kp = (const unsigned short*)k + {kh};
  const unsigned short* vp = (const unsigned short*)v + {vh};
  // Scores: {kw} keys a warp, {per_pass} a pass, {BATCH} passes' rows in flight.
  const int c8 = (lane % {lk}) * 8;
  float qf[8];
  unpack(*(const uint4*)(qp + c8), qf);
  #pragma unroll
  for (int i = 0; i < 8; ++i) qf[i] *= {scale:?}f;
  for (int it0 = 0; it0 < {iters}; it0 += {BATCH}) {{
    uint4 u[{BATCH}];
    #pragma unroll
    for (int j = 0; j < {BATCH}; ++j) {{
      const int r = (it0 + j) * {per_pass} + warp * {kw} + lane / {lk};
      u[j] = r < kn ? *(const uint4*)(kp + (long long)(k0 + r) * {k_rs} + c8) : make_uint4(0u, 0u, 0u, 0u);
    }}
    #pragma unroll
    for (int j = 0; j < {BATCH}; ++j) {{
      const int r = (it0 + j) * {per_pass} + warp * {kw} + lane / {lk};
      float f[8];
      unpack(u[j], f);
      float x = 0.f;
      #pragma unroll
      for (int i = 0; i < 8; ++i) x = fmaf(qf[i], f[i], x);
      #pragma unroll
      for (int off = {lk} / 2; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
      if (lane % {lk} == 0 && r < kn) {{
        const int row = 0, key = k0 + r;
        (void)row;
        if (key >= lim) x = RT_NEG_INF;
        {mask}
        sc[r] = x;
      }}
    }}
  }}
  __syncthreads();
  // The chunk's maximum, then its weights and their sum.
  float mx = RT_NEG_INF;
  for (int r = tid; r < kn; r += {THREADS}) mx = fmaxf(mx, sc[r]);
  #pragma unroll
  for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  if (lane == 0) wred[warp] = mx;
  __syncthreads();
  mx = RT_NEG_INF;
  #pragma unroll
  for (int i = 0; i < {nw}; ++i) mx = fmaxf(mx, wred[i]);
  float ls = 0.f;
  for (int r = tid; r < kn; r += {THREADS}) {{
    const float s = sc[r];
    const float p = s == RT_NEG_INF ? 0.f : ex2(s - mx);
    sc[r] = p;
    ls += p;
  }}
  #pragma unroll
  for (int off = 16; off > 0; off >>= 1) ls += __shfl_xor_sync(0xffffffffu, ls, off);
  if (lane == 0) wred[{nw} + warp] = ls;
  __syncthreads();
  ls = 0.f;
  #pragma unroll
  for (int i = 0; i < {nw}; ++i) ls += wred[{nw} + i];
  // o = Σ p·v: {lv} lanes a value row, {groups} groups, {BATCH} rows a lane in flight.
  const int cv = (tid % {lv}) * 8, gi = tid / {lv};
  float o[8];
  #pragma unroll
  for (int i = 0; i < 8; ++i) o[i] = 0.f;
  for (int r0 = gi; r0 < kn; r0 += {groups} * {BATCH}) {{
    uint4 u[{BATCH}];
    #pragma unroll
    for (int j = 0; j < {BATCH}; ++j) {{
      const int r = r0 + j * {groups};
      u[j] = r < kn ? *(const uint4*)(vp + (long long)(k0 + r) * {v_rs} + cv) : make_uint4(0u, 0u, 0u, 0u);
    }}
    #pragma unroll
    for (int j = 0; j < {BATCH}; ++j) {{
      const int r = r0 + j * {groups};
      if (r < kn) {{
        const float p = sc[r];
        float f[8];
        unpack(u[j], f);
        #pragma unroll
        for (int i = 0; i < 8; ++i) o[i] = fmaf(p, f[i], o[i]);
      }}
    }}
  }}
  #pragma unroll
  for (int i = 0; i < 8; ++i) red[gi * {dv} + cv + i] = o[i];
  __syncthreads();
  for (int c = tid; c < {dv}; c += {THREADS}) {{
    float acc = 0.f;
    #pragma unroll
    for (int g = 0; g < {groups}; ++g) acc += red[g * {dv} + c];
    po[tile * {dv}LL + c] = acc;
  }}
  if (tid == 0) {{
    pm[tile] = mx;
    pl[tile] = ls;
  }}
  __syncthreads();
}}
"#,
        nw = THREADS / 32,
        nw2 = 2 * (THREADS / 32),
    )
}

/// The combining kernel (see the module docs).
fn combine_source(sp: &Spec, splits: usize) -> String {
    let dv = sp.dv;
    let heads = sp.bsz * sp.heads;
    let oh = sp.head(Part::O);
    let narrow = if sp.e == CTy::BF16 {
        "rt_f2bf"
    } else {
        "rt_f2h"
    };
    format!(
        r#"// Split-key decoding: {splits} chunks of a head combined.
#define RT_NEG_INF __int_as_float(0xff800000)
auto ex2 = [](float x) -> float {{ float y; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }};
for (long long bh = blockIdx.x; bh < {heads}LL; bh += gridDim.x) {{
  const float* hm = pm + bh * {splits}LL;
  const float* hl = pl + bh * {splits}LL;
  const float* ho = po + bh * {splits}LL * {dv}LL;
  float mx = RT_NEG_INF;
  for (int s = 0; s < {splits}; ++s) mx = fmaxf(mx, hm[s]);
  // A chunk that sees nothing weighs 0 (its o and l are 0, or NaN from a NaN score, which
  // then spreads as it should).
  float l = 0.f;
  for (int s = 0; s < {splits}; ++s) l += hl[s] * (hm[s] == RT_NEG_INF ? 0.f : ex2(hm[s] - mx));
  unsigned short* op = (unsigned short*)out + {oh};
  for (int c = threadIdx.x; c < {dv}; c += {THREADS}) {{
    float acc = 0.f;
    for (int s = 0; s < {splits}; ++s) acc += ho[s * {dv} + c] * (hm[s] == RT_NEG_INF ? 0.f : ex2(hm[s] - mx));
    op[c] = {narrow}(l == 0.f ? 0.f : acc / l);
  }}
}}
"#
    )
}
