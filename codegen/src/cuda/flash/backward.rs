//! The fused flash backward: the three gradients of one attention in one kernel.
//!
//! A block owns a tile of `16 · warps` keys of one (batch, head); each warp owns 16 of them and
//! keeps their `dK` and `dV` accumulators (f32) in registers for the whole walk over the query
//! tiles that see them. The key and value tiles are loaded once into shared memory; the query
//! and `dO` tiles of 64 rows (with their log-sum-exp and `D = rowsum(dO ∘ O)`) are
//! double-buffered with `cp.async`, the next tile loading while the current one is used. Per
//! query tile and warp, with `mma.sync.m16n8k16` and f32 accumulators:
//!
//! 1. `Sᵀ = K·Qᵀ` and `dPᵀ = V·dOᵀ` (16 × 64), the A fragments read by `ldmatrix` from the key
//!    and value tiles;
//! 2. `Pᵀ = 2^(Sᵀ·scale·log2 e − lse)` (masked pairs 0) and `dSᵀ = Pᵀ ∘ (dPᵀ − D)`;
//! 3. `dV += Pᵀ·dO` and `dK += dSᵀ·Q`, `Pᵀ` and `dSᵀ` rounded to the operands' type and reused
//!    from the accumulators as A fragments;
//! 4. `dSᵀ` into shared memory; after a barrier the warps compute `dQ = dS·K` for the query
//!    tile (each warp 16 rows, split by columns between warp halves when there are eight) and
//!    add it into an f32 buffer with vector reductions (`red.global.add.v2.f32` on sm_90,
//!    `atomicAdd` before).
//!
//! So `S`, `P` and `dP` are computed once per (query tile, key tile), where separate kernels
//! for `dQ` and for `dK`/`dV` compute them twice; the price is the f32 `dQ` buffer: zeroed by a
//! kernel before and rounded into the result (times the scale) by one after. The statistics
//! come from the forward kernel's statistics pass, as for the separate kernels.
//!
//! Eight warps (128 keys) when the head size is a multiple of 32, which halves the `dQ`
//! reductions and the query-tile loads per key; else four.

use super::{
    abt, first_query, grad_defs, head_pointers, mma_pb, store_kv, transposed_probabilities, zeros,
    Part, Spec, PACK,
};

/// Query rows per tile of the walk.
const QT: usize = 64;

/// The fused kernel's source and launch shape.
pub(super) struct Built {
    pub source: String,
    pub threads: u32,
    pub smem: u32,
    /// Keys per block.
    pub keys: usize,
    /// Where the kernel adds `dQ`: None for a `[B·H, Sq, D]` buffer, else the blocked layout of
    /// the Hopper kernel's bulk reductions (see `dq_source`).
    pub dq_blocked: Option<(usize, String)>,
    /// Where the kernel reads q, k, v and dO through tensor maps (`qmap`, `kmap`, `vmap`,
    /// `gmap`, parameters after the others): the rows of the query and the key boxes.
    pub maps: Option<[u32; 2]>,
    /// Whether the kernel also writes `dK` and `dV` through tensor maps (`okmap`, `ovmap`, after
    /// the four above, for the gradients it computes), with the key box's rows.
    pub out_maps: bool,
}

/// Warps per block for `sp`: eight when the `dQ` columns split evenly in two 16-column
/// halves per warp pair, else four.
fn warps(sp: &Spec) -> usize {
    if sp.d.is_multiple_of(32) {
        8
    } else {
        4
    }
}

/// The fused backward of `sp`, computing `dK` (into `out_k`, when `wk`) and `dV` (into `out_v`,
/// when `wv`) and adding `dQ / scale` into the f32 buffer `dq_acc` (`[B·H, Sq, D]`, zeroed).
pub(super) fn build(sp: &Spec, wk: bool, wv: bool) -> Built {
    let (sq, sk, d, dv) = (sp.sq, sp.sk, sp.d, sp.dv);
    let nw = warps(sp);
    let bk = nw * 16;
    let threads = nw * 32;
    let (ks, vs, qs, gs, dss) = (d + 8, dv + 8, d + 8, dv + 8, QT + 8);
    // Shared memory: K and V tiles, two Q and two dO tiles, dSᵀ, two lse/D vectors.
    let k_off = 0;
    let v_off = k_off + bk * ks * 2;
    let q_off = v_off + bk * vs * 2;
    let q_bytes = QT * qs * 2;
    let g_off = q_off + 2 * q_bytes;
    let g_bytes = QT * gs * 2;
    let ds_off = g_off + 2 * g_bytes;
    let l_off = ds_off + bk * dss * 2;
    let smem = l_off + 4 * QT * 4;
    let (qrs, krs, vrs, grs) = (
        sp.stride(Part::Q),
        sp.stride(Part::K),
        sp.stride(Part::V),
        sp.stride(Part::O),
    );
    let (qt, kt) = (sq.div_ceil(QT), sk.div_ceil(bk));
    let tiles = sp.bsz * sp.heads * kt;
    let first = first_query(sp);
    let mut c = grad_defs(sp);
    c += &format!(
        r#"// Fused flash backward: {bk} keys a block ({nw} warps), query tiles of {QT}.
extern __shared__ __align__(16) unsigned char rt_smem[];
const unsigned sm = (unsigned)__cvta_generic_to_shared(rt_smem);
const unsigned ks_base = sm + {k_off}u, vs_base = sm + {v_off}u, ds_base = sm + {ds_off}u;
const float* ls_all = (const float*)(rt_smem + {l_off});
// Rows [r0, r0 + rows) of an [n, width] matrix (rows gstride apart) into shared memory at
// base (rows `stride` elements apart), rows past n zero.
auto load_rows = [&](const unsigned short* src, unsigned base, int r0, int rows, int width, int stride, int n, long long gstride) {{
  const int chunks = width / 8;
  for (int c = tid; c < rows * chunks; c += {threads}) {{
    const int r = c / chunks, c8 = c - r * chunks;
    const int row = r0 + r;
    const unsigned short* from = src + (long long)(row < n ? row : 0) * gstride + c8 * 8;
    const unsigned to = base + (unsigned)((r * stride + c8 * 8) * 2);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(to), "l"(from), "r"(row < n ? 16 : 0));
  }}
}};
{RED2}for (long long tile = blockIdx.x; tile < {tiles}LL; tile += gridDim.x) {{
  const long long bh = tile / {kt}LL;
  const int kb = (int)(tile % {kt}LL) * {bk};
  const int j0 = kb + warp * 16 + g, j1 = j0 + 8;
{ptrs}  const float* lp = lse + bh * {sq}LL;
  const float* dlp = delta + bh * {sq}LL;
  // Query tile `it` (its rows, dO rows, lse and D) into buffer `buf`.
  auto load_queries = [&](int it, int buf) {{
    load_rows(qp, sm + {q_off}u + buf * {q_bytes}u, it * {QT}, {QT}, {d}, {qs}, {sq}, {qrs});
    load_rows(gp, sm + {g_off}u + buf * {g_bytes}u, it * {QT}, {QT}, {dv}, {gs}, {sq}, {grs});
    if (tid < {QT}) {{
      const int i = it * {QT} + tid;
      const int bytes = i < {sq} ? 4 : 0;
      const long long at = i < {sq} ? i : 0;
      const unsigned to = sm + {l_off}u + (unsigned)((buf * {QT} + tid) * 4);
      asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" :: "r"(to), "l"(lp + at), "r"(bytes));
      asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" :: "r"(to + {dl_off}u), "l"(dlp + at), "r"(bytes));
    }}
  }};
  const int it0 = ({first}) / {QT};
  load_rows(kp, ks_base, kb, {bk}, {d}, {ks}, {sk}, {krs});
  load_rows(vp, vs_base, kb, {bk}, {dv}, {vs}, {sk}, {vrs});
  if (it0 < {qt}) load_queries(it0, 0);
  asm volatile("cp.async.commit_group;");
"#,
        ptrs = head_pointers(sp),
        dl_off = 2 * QT * 4,
    );
    if wk {
        c += &zeros("acck", d / 8);
    }
    if wv {
        c += &zeros("accv", dv / 8);
    }
    // The A fragment of this warp's 16 keys (rows of the tile at `base`) for step `kk`.
    let a_rows = |base: &str, stride: usize| {
        format!(
            "    unsigned af[4];\n    RT_LDSM(af[0], af[1], af[2], af[3], {base} + (unsigned)(((warp * 16 + (lane & 15)) * {stride} + kk * 16 + (lane >> 4) * 8) * 2));\n"
        )
    };
    c += &format!(
        r#"  for (int it = it0; it < {qt}; ++it) {{
    const int buf = (it - it0) & 1;
    if (it + 1 < {qt}) load_queries(it + 1, buf ^ 1);
    asm volatile("cp.async.commit_group;");
    asm volatile("cp.async.wait_group 1;");
    __syncthreads();
    const unsigned qs_base = sm + {q_off}u + buf * {q_bytes}u;
    const unsigned gs_base = sm + {g_off}u + buf * {g_bytes}u;
    const float* lsb = ls_all + buf * {QT};
    const float* dlsb = ls_all + {dl_words} + buf * {QT};
"#,
        dl_words = 2 * QT,
    );
    c += &zeros("s", 8);
    c += &abt("s", &a_rows("ks_base", ks), "af", "qs_base", qs, d / 16);
    c += &zeros("dpt", 8);
    c += &abt("dpt", &a_rows("vs_base", vs), "af", "gs_base", gs, dv / 16);
    c += &transposed_probabilities(
        sp,
        "Pᵀ and dSᵀ",
        "lsb",
        "dpt[n][e] = p * (dpt[n][e] - dlsb[local]);\n        s[n][e] = p;",
        QT,
    );
    if wv {
        c += &mma_pb("accv", "s", "gs_base", gs, dv);
    }
    if wk {
        c += &mma_pb("acck", "dpt", "qs_base", qs, d);
    }
    // dQ: warp `w` takes query rows (w % 4)·16 and the `w / 4`-th of the columns.
    let cw = d / (nw / 4);
    let bk16 = bk / 16;
    c += &format!(
        r#"    // dSᵀ into shared memory for dQ = dS·K.
    #pragma unroll
    for (int n = 0; n < 8; ++n) {{
      const unsigned at = ds_base + (unsigned)(((warp * 16 + g) * {dss} + n * 8 + t4 * 2) * 2);
      asm volatile("st.shared.b32 [%0], %1;" :: "r"(at), "r"(pack(dpt[n][0], dpt[n][1])));
      asm volatile("st.shared.b32 [%0], %1;" :: "r"(at + {row8}u), "r"(pack(dpt[n][2], dpt[n][3])));
    }}
    __syncthreads();
    {{
      const int qw0 = (warp & 3) * 16, col0 = (warp >> 2) * {cw};
      unsigned dsa[{bk16}][4];
      #pragma unroll
      for (int kk = 0; kk < {bk16}; ++kk) {{
        const int key = kk * 16 + ((lane >> 4) & 1) * 8 + (lane & 7);
        const int q = qw0 + ((lane >> 3) & 1) * 8;
        RT_LDSM_T(dsa[kk][0], dsa[kk][1], dsa[kk][2], dsa[kk][3], ds_base + (unsigned)((key * {dss} + q) * 2));
      }}
      const int r0 = it * {QT} + qw0 + g;
      float* dq0 = dq_acc + (bh * {sq}LL + r0) * {d}LL + col0 + t4 * 2;
"#,
        row8 = 8 * dss * 2,
    );
    for (c0, w16) in dq_chunks(cw) {
        c += &format!(
            r#"      {{
{acc}        #pragma unroll
        for (int kk = 0; kk < {bk16}; ++kk) {{
          #pragma unroll
          for (int dp = 0; dp < {w16}; ++dp) {{
            const int row = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
            const int col = col0 + {c0} + dp * 16 + (lane >> 4) * 8;
            unsigned b0, b1, b2, b3;
            RT_LDSM_T(b0, b1, b2, b3, ks_base + (unsigned)((row * {ks} + col) * 2));
            RT_MMA(qacc[2 * dp], dsa[kk], b0, b1);
            RT_MMA(qacc[2 * dp + 1], dsa[kk], b2, b3);
          }}
        }}
        #pragma unroll
        for (int n = 0; n < {n8}; ++n) {{
          if (r0 < {sq}) red2(dq0 + {c0} + n * 8, qacc[n][0], qacc[n][1]);
          if (r0 + 8 < {sq}) red2(dq0 + 8LL * {d} + {c0} + n * 8, qacc[n][2], qacc[n][3]);
        }}
      }}
"#,
            acc = zeros("qacc", w16 * 2).replace("\n  ", "\n        "),
            n8 = w16 * 2,
        );
    }
    c += "    }\n    __syncthreads();\n  }\n  asm volatile(\"cp.async.wait_group 0;\");\n";
    c += &store_kv(sp, wk.then_some("out_k"), wv.then_some("out_v"));
    // The next tile's loads overwrite the key and value tiles.
    c += "  __syncthreads();\n}\n";
    Built {
        source: c,
        threads: threads as u32,
        smem: smem as u32,
        keys: bk,
        dq_blocked: None,
        maps: None,
        out_maps: false,
    }
}

/// The chunks a warp computes its `cw` columns of `dQ` in: (first column, 16-column groups),
/// 32 columns at most (16 accumulator registers).
fn dq_chunks(cw: usize) -> Vec<(usize, usize)> {
    (0..cw)
        .step_by(32)
        .map(|c0| (c0, ((cw - c0) / 16).min(2)))
        .collect()
}

/// `red2(p, a, b)`: adds `a` and `b` into the floats at `p` and `p + 1` (one vector reduction
/// on sm_90, two atomics before).
pub(super) const RED2: &str = r#"auto red2 = [](float* p, float a, float b) {
#if __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" :: "l"(p), "f"(a), "f"(b) : "memory");
#else
  atomicAdd(p, a);
  atomicAdd(p + 1, b);
#endif
};
"#;

/// Threads per block of the buffer kernels.
pub(super) const BUFFER_THREADS: u32 = 256;

/// The kernel zeroing the `dQ` buffer (`n` floats, `n` even) before the fused kernel.
pub(super) fn zero_source(n: usize) -> String {
    format!(
        r#"for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < {h}LL; i += (long long)gridDim.x * blockDim.x)
  ((float2*)dq_acc)[i] = make_float2(0.f, 0.f);
"#,
        h = n / 2
    )
}

/// The kernel rounding the `dQ` buffer times the scale into the result `out` (q's layout):
/// the buffer `[B·H, Sq, D]`, or with `blocked` = (query rows per tile, the C index of
/// `dQ[bh][row][c]` over `bh`, `row`, `c` and `rt = row mod rows`) the Hopper kernel's blocks.
pub(super) fn dq_source(sp: &Spec, blocked: Option<(usize, String)>) -> String {
    let (sq, d) = (sp.sq, sp.d);
    let n = sp.bsz * sp.heads * sq * d / 2;
    let defs = PACK.replace("$E", sp.elem());
    let read = match blocked {
        None => "((const float2*)dq_acc)[i]".to_string(),
        Some((br, index)) => format!(
            "*(const float2*)(dq_acc + [&] {{ const int rt = (int)(row % {br}LL); return {index}; }}())"
        ),
    };
    format!(
        r#"{defs}for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < {n}LL; i += (long long)gridDim.x * blockDim.x) {{
  const long long c = (i % {h2}LL) * 2, r = i / {h2}LL;
  const long long bh = r / {sq}LL, row = r % {sq}LL;
  const float2 a = {read};
  unsigned short* op = (unsigned short*)out + {head} + row * {rs}LL + c;
  *(unsigned*)op = pack(a.x * {scale:?}f, a.y * {scale:?}f);
}}
"#,
        h2 = d / 2,
        head = sp.head(Part::Q),
        rs = sp.stride(Part::Q),
        scale = sp.scale as f32,
    )
}

/// The lanes of a warp that read one row of [`delta_source`]: a power of two (a row's lanes are
/// one group of the warp's shuffles), at least `dv / 8` (one 16-byte piece each) up to 32.
pub(super) fn delta_lanes(dv: usize) -> usize {
    (dv / 8).next_power_of_two().clamp(1, 32)
}

/// The kernel deriving the backward's statistics from a saved forward: per query row
/// `D = rowsum(dO ∘ O)` into `delta`, and the saved natural log-sum-exp (`stats_at` bytes past
/// O's start) in the base-2 domain into `lse`; with `zero = Some(n)` it also zeroes the `n`
/// floats of the f32 `dQ` buffer `dq_acc` (one launch instead of two, their bytes the same).
/// A row is read by [`delta_lanes`] lanes in 16-byte pieces — the head sizes are
/// multiples of 16 and the rows 16-byte aligned, as the flash kernels' copies already take
/// them — so that a warp keeps 512 bytes in flight a load, not the 128 of a warp a row reading
/// 4-byte pieces (which this kernel replaced: docs/performance.md).
pub(super) fn delta_source(sp: &Spec, stats_at: usize, zero: Option<usize>) -> String {
    let (sq, dv) = (sp.sq, sp.dv);
    let rows = sp.bsz * sp.heads * sq;
    let lanes = delta_lanes(dv);
    let widen = if sp.elem() == "bf16" {
        "rt_bf2f"
    } else {
        "rt_h2f"
    };
    let zero = zero.map(zero_source).unwrap_or_default();
    format!(
        r#"{zero}const int lane = threadIdx.x & 31, sub = lane & {lm};
const long long warps = ((long long)gridDim.x * blockDim.x) >> 5;
// The 8 products of 16-byte pieces a and b.
auto dot8 = [](uint4 a, uint4 b) {{
  const unsigned x[4] = {{a.x, a.y, a.z, a.w}}, y[4] = {{b.x, b.y, b.z, b.w}};
  float acc = 0.f;
  #pragma unroll
  for (int k = 0; k < 4; ++k)
    acc += {widen}((unsigned short)(x[k] & 0xffffu)) * {widen}((unsigned short)(y[k] & 0xffffu))
         + {widen}((unsigned short)(x[k] >> 16)) * {widen}((unsigned short)(y[k] >> 16));
  return acc;
}};
// A warp takes {rpw} rows at a time (every lane through the shuffles, the loop's bound the
// same for the whole warp).
for (long long w = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5; w * {rpw}LL < {rows}LL; w += warps) {{
  const long long r = w * {rpw}LL + lane / {lanes};
  float acc = 0.f;
  if (r < {rows}LL) {{
    const long long bh = r / {sq}LL, row = r % {sq}LL;
    const unsigned short* gp = (const unsigned short*)dout + {head} + row * {rs}LL;
    const unsigned short* op = (const unsigned short*)o + {head} + row * {rs}LL;
    for (int c = sub * 8; c < {dv}; c += {step})
      acc += dot8(*(const uint4*)(gp + c), *(const uint4*)(op + c));
  }}
  #pragma unroll
  for (int s = {half}; s > 0; s >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, s);
  if (sub == 0 && r < {rows}LL) {{
    delta[r] = acc;
    lse[r] = ((const float*)((const unsigned char*)o + {stats_at}LL))[r] * 1.4426950408889634f;
  }}
}}
"#,
        lm = lanes - 1,
        rpw = 32 / lanes,
        step = lanes * 8,
        half = lanes / 2,
        head = sp.head(Part::O),
        rs = sp.stride(Part::O),
    )
}

#[cfg(test)]
mod tests {
    use super::super::Spec;
    use rustytorch_ops::{AttnLayout, AttnMask, Causal, DType, F64Bits, Op, Shape, TensorType};

    fn spec(d: usize, dv: usize) -> Spec {
        let t = |s: usize, w: usize| TensorType::new(DType::BF16, Shape::new(vec![2, 3, s, w]));
        let ins = [t(100, d), t(90, d), t(90, dv), t(100, dv)];
        let refs: Vec<&TensorType> = ins.iter().collect();
        let op = Op::AttentionGrad {
            causal: Causal::TopLeft,
            mask: AttnMask::None,
            scale: F64Bits::new(0.125),
            wrt: 0,
            layout: AttnLayout::Bhsd,
        };
        let out = rustytorch_ops::infer(&op, &refs).unwrap();
        Spec::new(&op, &refs, &out).unwrap().unwrap()
    }

    /// Every head size the flash kernels take gets a block that fits an SM's shared memory
    /// (227 KiB on Hopper, 163 KiB on the A100; the 8-warp blocks are the larger), with eight
    /// warps exactly when the `dQ` columns split into 16-column halves, and the `dQ` chunks of
    /// the source cover each warp's columns.
    #[test]
    fn blocks_fit_and_cover_the_columns() {
        for d in (16..=128).step_by(16) {
            for dv in (16..=128).step_by(16) {
                let b = super::build(&spec(d, dv), true, true);
                let warps = if d % 32 == 0 { 8 } else { 4 };
                assert_eq!(b.threads as usize, warps * 32, "d {d}");
                assert_eq!(b.keys, warps * 16);
                assert!(
                    b.smem as usize <= 163 * 1024,
                    "d {d} dv {dv}: {} bytes",
                    b.smem
                );
                // The chunks tile the warp's columns, each one or two 16-column groups.
                let cols = d / (warps / 4);
                let mut next = 0;
                for (c0, w16) in super::dq_chunks(cols) {
                    assert_eq!(c0, next, "d {d}");
                    assert!((1..=2).contains(&w16), "d {d}");
                    next += w16 * 16;
                }
                assert_eq!(next, cols, "d {d}");
                assert!(b.source.contains("red2(dq0"));
            }
        }
    }
}
