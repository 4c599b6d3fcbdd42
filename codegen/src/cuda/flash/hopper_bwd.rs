//! The fused flash backward for Hopper (`sm_90a`): the three gradients of one attention in one
//! kernel, its products on warpgroup MMA (`wgmma.mma_async`) with the operands in 128-byte
//! swizzled shared memory.
//!
//! # The kernel
//!
//! A block of two warpgroups owns 128 keys of one (batch, head), each warpgroup 64 of them,
//! whose `dK` and `dV` (f32) stay in registers for the whole walk over the query tiles that see
//! them. The key and value tiles are copied once; the query and `dO` tiles (64 rows at head
//! size 128, 128 at head size 64), with their log-sum-exp and `D = rowsum(dO ∘ O)`, are
//! double-buffered with `cp.async`, the next tile copying while the current one is used. Per
//! query tile and warpgroup:
//!
//! 1. `Sᵀ = K·Qᵀ` and `dPᵀ = V·dOᵀ` (64 keys × the tile's queries) as two commit groups of
//!    `wgmma`s, both operands K-major ([`super::hopper::kmajor_products`]); `Pᵀ =
//!    2^(Sᵀ·scale·log2 e − lse)` is computed while `dPᵀ` is still on the tensor cores, then
//!    `dSᵀ = Pᵀ ∘ (dPᵀ − D)`. Tiles that no causal limit, mask or end crosses skip the checks;
//! 2. `dV += Pᵀ·dO` and `dK += dSᵀ·Q` with `Pᵀ` and `dSᵀ` from registers (the accumulator
//!    layout of `Sᵀ`, rounded to the operands' type, is the A-fragment layout) and `dO`, `Q`
//!    read MN-major ([`super::hopper::register_products`]);
//! 3. `dSᵀ` into shared memory (swizzled as the tensor cores read it); after a barrier
//!    `dQ = dS·K` for the whole block's 128 keys, both operands read MN-major (`dSᵀ` and the key
//!    tile as stored, through the transpose bits): at head size 128 each warpgroup takes 64 of
//!    the columns, at head size 64 (128-row query tiles) 64 of the rows; the result is added
//!    into an f32 buffer with vector reductions, as in the portable fused kernel
//!    ([`super::backward`], whose buffer kernels, statistics and scaling this kernel shares).
//!
//! The kernel takes equal query and value head sizes of 64 or 128; the portable fused kernel
//! runs the others (and every shape where `RUSTYTORCH_HOPPER_BWD=0` asks, for measurements).

use super::backward::{Built, RED2};
use super::hopper::{
    kmajor_products, pin, register_products, swizzled_rows, wait, wgmma_macro, OperandA,
};
use super::{
    first_query, grad_defs, head_pointers, store_kv, transposed_probabilities, zeros, Part, Spec,
};

/// Keys per block (two warpgroups of 64).
const BK: usize = 128;

/// Floats of one warpgroup's part of a query tile's `dQ` (64 × 64).
const DQ_PART: usize = 64 * 64;

/// How the kernel orders, feeds and adds its products. The default (`bulk`, `overlap` at head
/// size 128 only, `ws`, `tma`, `ds2`, `store_bulk`, no `fence`) was the fastest measured
/// (docs/performance.md); the environment variables select the others, for measurements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Variant {
    /// `dQ` added by bulk reductions from shared memory into a buffer blocked by query tile
    /// and warpgroup ([`dq_index`]), instead of by each thread's vector reductions into a
    /// `[B·H, Sq, D]` buffer (`RUSTYTORCH_HOPPER_BWD_DQ=vector`).
    pub bulk: bool,
    /// `dK += dSᵀ·Q` issued after `dQ = dS·K` and left running over the `dQ` reduction and the
    /// next query tile's first products; the query tiles then take three buffers, since a
    /// tile's buffer is still read while the tile after the next one is copied. Without it
    /// `dK` is issued once `dSᵀ` is written and waited for with `dQ`. At head size 64 (128-row
    /// query tiles) the `dSᵀ` fragments it keeps alive over the next tile's `Sᵀ` and `dPᵀ`
    /// leave too few registers: ptxas (NVRTC 12.8 and 13.0) then serializes every `wgmma` of
    /// the kernel (its note C7512), which it does not without; timed on the device, the
    /// head-size-64 backward without it ran 1.08–1.11× as fast (forward + backward), while at
    /// head size 128 it is worth about 1%. `None` (the default) keeps it at head size 128 only;
    /// `RUSTYTORCH_HOPPER_BWD_OVERLAP=0` or `=1` turn it off or on at both.
    pub overlap: Option<bool>,
    /// A producer warpgroup copies the tiles and the two computing warpgroups wait on
    /// shared-memory barriers (`mbarrier`) for them, instead of copying them themselves
    /// between block-wide barriers (three query buffers, with or without `overlap`). On with
    /// `tma` (the default), or with `cp.async` copies where
    /// `RUSTYTORCH_HOPPER_BWD_TMA=0 RUSTYTORCH_HOPPER_BWD_WS=1` ask.
    pub ws: bool,
    /// With `ws`: the producer's one thread copies the key, value, query and `dO` tiles with
    /// the tensor memory accelerator (bulk tensor copies through tensor maps the runtime
    /// encodes), its threads only the rows' statistics. The default (1.1–1.3× the
    /// two-warpgroup kernel's speed, forward and backward together);
    /// `RUSTYTORCH_HOPPER_BWD_TMA=0` or `RUSTYTORCH_HOPPER_BWD_WS=0` turn it off.
    pub tma: bool,
    /// With `ws` and `bulk`: `dSᵀ` in two buffers taken by alternate query tiles, so that a
    /// warpgroup writes the next tile's `dSᵀ` without waiting for the other's `dQ` product on
    /// the current one (one named barrier a tile instead of two). At head size 64, where each
    /// warpgroup's `dQ` reads only its own 64 queries' half of `dSᵀ`, the warpgroup stages its
    /// `dQ` for the bulk reduction in that half once its product is complete, so the second
    /// buffer costs no shared memory. The default (with the statistics kernel that zeroes `dQ`,
    /// forward and backward together 1.02–1.04× as fast at head size 64);
    /// `RUSTYTORCH_HOPPER_BWD_DS2=0` turns it off.
    pub ds2: bool,
    /// With `tma`: the value tile goes back to the producer once the block's last `dPᵀ`
    /// product has read it and the key tile once its last `dQ` product has (an empty and a
    /// full barrier each instead of one pair), and the producer copies the next key tile's
    /// values, then its first query tile, then its keys while the block finishes the current
    /// one (its last products, the `dQ` reduction, the `dK`/`dV` stores). Passed the float64
    /// device test but measured within run-to-run spread (−0.6% to +1.8%), so off;
    /// `RUSTYTORCH_HOPPER_BWD_EARLY=1` turns it on.
    pub early: bool,
    /// With `ws`: each key tile walks its query tiles starting at a different one (the key
    /// tile's index modulo their count, wrapping around), so that the blocks of one head add
    /// into different query tiles' `dQ` at a time instead of all into the same one
    /// (`RUSTYTORCH_HOPPER_BWD_ROTATE=1`; measured within the spread, so off).
    pub rotate: bool,
    /// With `tma` (and not `early`): `dK` and `dV` rounded into the key and value tiles' shared
    /// memory (free once the block's last products have read them) and written by bulk tensor
    /// copies, instead of by each thread's 4-byte stores; the producer reloads the tiles once
    /// the copies have read them. Timed on the device: forward + backward 1.14× as fast at
    /// Sq 512 × Sk 8192, 1.01–1.05× at head size 64. The default;
    /// `RUSTYTORCH_HOPPER_BWD_STORE=thread` gives the threads' stores.
    pub store_bulk: bool,
    /// With `tma`: a proxy fence (`fence.proxy.async`, which ptxas compiles to a
    /// `MEMBAR.ALL.CTA`) after each query tile's full barrier, as with `cp.async` copies,
    /// although bulk tensor copies write through the async proxy that the tensor cores read
    /// (the forward has none there). Without it the backward timed 1.01× as fast, so off by
    /// default; `RUSTYTORCH_HOPPER_BWD_FENCE=1` puts it back.
    pub fence: bool,
    /// With `ws`: nanoseconds over which the producers' first copies are spread, block `b` of
    /// `n` starting `b / n` of them late, so that the blocks of a persistent grid, whose key
    /// tiles take equal time at full attention, do not all copy their next key and value tiles
    /// (and store their `dK` and `dV`) at the same moment (`RUSTYTORCH_HOPPER_BWD_STAGGER=ns`;
    /// 0, the default, starts them together). Measured 1.01–1.02× at Sq 512 × Sk 8192, about
    /// the device's run-to-run spread.
    pub stagger_ns: u32,
}

impl Variant {
    /// The variant the environment asks for (see the fields).
    pub(super) fn from_env() -> Self {
        let var = |k: &str| std::env::var(k).ok();
        let ws = var("RUSTYTORCH_HOPPER_BWD_WS");
        let tma =
            var("RUSTYTORCH_HOPPER_BWD_TMA").as_deref() != Some("0") && ws.as_deref() != Some("0");
        Variant {
            bulk: var("RUSTYTORCH_HOPPER_BWD_DQ").as_deref() != Some("vector"),
            overlap: var("RUSTYTORCH_HOPPER_BWD_OVERLAP").map(|v| v != "0"),
            ws: tma || ws.as_deref() == Some("1"),
            tma,
            ds2: var("RUSTYTORCH_HOPPER_BWD_DS2").as_deref() != Some("0"),
            early: var("RUSTYTORCH_HOPPER_BWD_EARLY").as_deref() == Some("1"),
            rotate: var("RUSTYTORCH_HOPPER_BWD_ROTATE").as_deref() == Some("1"),
            store_bulk: var("RUSTYTORCH_HOPPER_BWD_STORE").as_deref() != Some("thread"),
            fence: var("RUSTYTORCH_HOPPER_BWD_FENCE").as_deref() == Some("1"),
            stagger_ns: var("RUSTYTORCH_HOPPER_BWD_STAGGER")
                .and_then(|v| v.parse().ok())
                .unwrap_or(0),
        }
    }
}

/// With [`Variant::bulk`]: the query rows per tile of the blocked buffer, and the C expression of
/// the float index of `dQ[bh][row][c]` (`c` even; `c + 1` follows) in it.
pub(super) fn dq_index(sp: &Spec) -> (usize, String) {
    let br = query_rows(sp);
    let qt = sp.sq.div_ceil(br);
    // At head size 128 the warpgroups split the columns, at 64 the rows.
    let (wg, rr, cc) = if br == 64 {
        ("(c >> 6)", "rt", "(c & 63)")
    } else {
        ("(rt >> 6)", "(rt & 63)", "c")
    };
    (
        br,
        format!(
            "((bh * {qt}LL + row / {br}) * 2 + {wg}) * {DQ_PART}LL + ((({cc} >> 3) * 2 + (({rr} >> 3) & 1)) * 128 + ({rr} >> 4) * 32 + ({rr} & 7) * 4 + (({cc} & 7) >> 1)) * 2",
        ),
    )
}

/// Threads of the warpgroups that compute.
const THREADS: usize = 256;

/// Threads of the producer warpgroup ([`Variant::ws`]).
const PRODUCER: usize = 128;

/// The registers a producer and a computing thread hold after `setmaxnreg` ([`Variant::ws`])
/// when the producer copies with `cp.async`: the block's 168 a thread from launch (384
/// threads), the producer's 112 given up buying the computing threads' 56
/// ([`super::hopper_ws::registers_balance`]: asking for more, as an earlier (64, 224) did,
/// leaves `setmaxnreg.inc` waiting forever). NVRTC 12.8's ptxas spills nothing at this split
/// but notes for 7 of the test kernels that their `wgmma`s are serialized for lack of
/// registers.
const REGISTERS: (u32, u32) = (56, 224);

/// The split with bulk tensor copies ([`Variant::tma`]), whose producer threads only load the
/// rows' statistics: (24, 240). ptxas then serializes the `wgmma`s of one test kernel and
/// spills 36–88 bytes, yet on the device it is 1.05–1.15× faster than (56, 224), and (40, 232)
/// lies between them.
const TMA_REGISTERS: (u32, u32) = (24, 240);

/// [`REGISTERS`] or [`TMA_REGISTERS`], or the balanced split `RUSTYTORCH_HOPPER_BWD_REGS=P,C`
/// asks for (for measurements).
fn registers(tma: bool) -> (u32, u32) {
    let threads = (THREADS + PRODUCER) as u32;
    std::env::var("RUSTYTORCH_HOPPER_BWD_REGS")
        .ok()
        .and_then(|v| {
            let (p, c) = v.split_once(',')?;
            Some((p.trim().parse().ok()?, c.trim().parse().ok()?))
        })
        .filter(|&r| super::hopper_ws::registers_balance(threads, PRODUCER as u32, r))
        .unwrap_or(if tma { TMA_REGISTERS } else { REGISTERS })
}

/// Whether the kernel takes `sp`: query and value head sizes equal, 64 or 128, and
/// `RUSTYTORCH_HOPPER_BWD=0` does not ask for the portable fused kernel.
pub(super) fn supported(sp: &Spec) -> bool {
    sp.d == sp.dv
        && matches!(sp.d, 64 | 128)
        && std::env::var("RUSTYTORCH_HOPPER_BWD").as_deref() != Ok("0")
}

/// Query rows per tile: 64 at head size 128 (the `dK`/`dV` accumulators take 128 registers a
/// thread), 128 at head size 64 (so that the products' N dim stays 128).
fn query_rows(sp: &Spec) -> usize {
    if sp.d > 64 {
        64
    } else {
        128
    }
}

/// The kernel for `sp`, computing `dK` (into `out_k`, when `wk`) and `dV` (into `out_v`, when
/// `wv`) and adding `dQ / scale` into the f32 buffer `dq_acc` (`[B·H, Sq, D]`, zeroed).
pub(super) fn build(sp: &Spec, wk: bool, wv: bool, variant: Variant) -> Built {
    let (sq, sk, d) = (sp.sq, sp.sk, sp.d);
    let br = query_rows(sp);
    let (br8, br16) = (br / 8, br / 16);
    let kbytes = BK * d * 2;
    let qbytes = br * d * 2;
    let dsbytes = BK * br * 2;
    // Key and value tiles, two query and two dO tiles, dSᵀ, two (lse, D) vectors; 1 KiB to
    // align the base to the swizzle's 1024-byte pattern.
    let bulk = variant.bulk;
    let ws = variant.ws || variant.tma;
    let tma = variant.tma;
    let overlap = wk && variant.overlap.unwrap_or(d > 64);
    let nbuf = if overlap || ws { 3 } else { 2 };
    // Two dSᵀ buffers need the producer's barriers (the computing warpgroups' one named barrier
    // a tile orders them) and the bulk reductions (whose reads of the staged dQ are waited for
    // before that barrier).
    let ds2 = variant.ds2 && ws && bulk;
    let nds = if ds2 { 2 } else { 1 };
    // At head size 64 a warpgroup's staged dQ takes its own consumed half of the dSᵀ buffer.
    let staged_in_ds = ds2 && br == 128;
    debug_assert!(super::hopper_ws::registers_balance(
        (THREADS + PRODUCER) as u32,
        PRODUCER as u32,
        registers(tma)
    ));
    // With bulk reductions, each warpgroup's 64 × 64 part of dQ is staged in shared memory.
    let stage = if bulk && !staged_in_ds {
        2 * DQ_PART * 4
    } else {
        0
    };
    let lbytes = nbuf * 2 * br * 4;
    // The key and value tiles released apart (bulk tensor copies only).
    let early = variant.early && tma;
    let walk = walk(sp, br, variant.rotate && ws);
    let store_bulk = variant.store_bulk && tma && !early;
    // With a producer: full and empty barriers for each query buffer and for the key and value
    // tiles (for each of them where they are released apart).
    let bars = if ws {
        8 * (2 * nbuf + if early { 4 } else { 2 })
    } else {
        0
    };
    let smem = 1024 + 2 * kbytes + 2 * nbuf * qbytes + nds * dsbytes + lbytes + stage + bars;
    let (krs, vrs) = (sp.stride(Part::K), sp.stride(Part::V));
    let (qt, kt) = (sq.div_ceil(br), sk.div_ceil(BK));
    let tiles = sp.bsz * sp.heads * kt;
    let elem = sp.elem();
    let mut macros = vec![
        wgmma_macro("RT_WGMMA_S0", elem, br, "s", "=f", 0, OperandA::KMajor),
        wgmma_macro("RT_WGMMA_S", elem, br, "s", "+f", 1, OperandA::KMajor),
        wgmma_macro("RT_WGMMA_P0", elem, br, "dpt", "=f", 0, OperandA::KMajor),
        wgmma_macro("RT_WGMMA_P", elem, br, "dpt", "+f", 1, OperandA::KMajor),
        wgmma_macro("RT_WGMMA_Q0", elem, 64, "dq", "=f", 0, OperandA::MnMajor),
        wgmma_macro("RT_WGMMA_Q", elem, 64, "dq", "+f", 1, OperandA::MnMajor),
    ];
    if wv {
        macros.push(wgmma_macro(
            "RT_WGMMA_V",
            elem,
            d,
            "accv",
            "+f",
            1,
            OperandA::Registers,
        ));
    }
    if wk {
        macros.push(wgmma_macro(
            "RT_WGMMA_K",
            elem,
            d,
            "acck",
            "+f",
            1,
            OperandA::Registers,
        ));
    }
    let first = first_query(sp);
    let mut c = grad_defs(sp);
    c += &macros.concat();
    c += &format!(
        r#"// Fused flash backward for sm_90a: {BK} keys a block (two warpgroups of 64), query tiles of {br}, wgmma ({elem}).
extern __shared__ __align__(1024) unsigned char rt_smem[];
const unsigned sm0 = (unsigned)__cvta_generic_to_shared(rt_smem);
const unsigned k_s = (sm0 + 1023u) & ~1023u;
const unsigned v_s = k_s + {kbytes}u;
const unsigned q_s0 = v_s + {kbytes}u;
const unsigned g_s0 = q_s0 + {nbuf}u * {qbytes}u;
const unsigned ds_s = g_s0 + {nbuf}u * {qbytes}u;
const unsigned l_s = ds_s + {nds}u * {dsbytes}u;
const float* ls_all = (const float*)(rt_smem + (l_s - sm0));
{roles}for (long long tile = blockIdx.x; tile < {tiles}LL; tile += gridDim.x) {{
  const long long bh = tile / {kt}LL;
  const int kb = (int)(tile % {kt}LL) * {BK};
  const int j0 = kb + warp * 16 + g, j1 = j0 + 8;
{ptrs}  const int it0 = ({first}) / {br};
{tile_start}"#,
        roles = roles(
            sp,
            br,
            nbuf,
            bulk,
            ws,
            tma,
            early,
            store_bulk,
            lbytes + stage,
            &walk,
            variant.stagger_ns
        ),
        ptrs = head_pointers(sp),
        tile_start = if ws {
            format!(
                "  // The key and value tiles copied.\n  if (it0 < {qt}) {{ mb_wait(kvfull, kc & 1u);{v} ++kc; }}\n",
                v = if early { " mb_wait(vfull, kc & 1u);" } else { "" }
            )
        } else {
            format!(
                "{loader}  load(kp, (long long)kb, {sk}LL, {BK}, {d}, {krs}LL, k_s);\n  load(vp, (long long)kb, {sk}LL, {BK}, {d}, {vrs}LL, v_s);\n  if (it0 < {qt}) load_queries(it0, 0);\n  asm volatile(\"cp.async.commit_group;\" ::: \"memory\");\n",
                loader = load_queries(sp, br, false)
            )
        },
    );
    if wk {
        c += &zeros("acck", d / 8);
    }
    if wv {
        c += &zeros("accv", d / 8);
    }
    // Whether no causal limit, mask or end crosses the tile (the causal limits grow with the
    // row, so the tile's first row has the smallest).
    let full = if sp.mask.is_some() {
        "false".to_string()
    } else {
        format!("it * {br} + {br} <= {sq} && kb + {BK} <= lim_of(it * {br})")
    };
    let sl2 = (sp.scale * std::f64::consts::LOG2_E) as f32;
    // With `early`: the arrival on `bar` once the block's last query tile has read its tile.
    let last_tile_frees = |bar: &str| {
        if early {
            format!("    if (step == {qt} - 1 && lane == 0) mb_arrive({bar});\n")
        } else {
            String::new()
        }
    };
    c += &format!(
        r#"  float s[{br8}][4], dpt[{br8}][4], dq[8][4];
  unsigned pa[{br16}][4], dsa[{br16}][4] = {{}};
  for (int step = it0; step < {qt}; ++step) {{
    const int it = {walk};
{it_start}{ds_buf}    const unsigned qs = q_s0 + (unsigned)buf * {qbytes}u, gs = g_s0 + (unsigned)buf * {qbytes}u;
    const float* lsb = ls_all + buf * {br2};
    const float* dlsb = lsb + {br};
    // Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ for this warpgroup's keys, one commit group each.
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
{s_products}    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
{p_products}    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
{wait_s}{release_prev}    if ({full}) {{
      // Pᵀ, nothing masked.
      #pragma unroll
      for (int n = 0; n < {br8}; ++n) {{
        #pragma unroll
        for (int e = 0; e < 4; ++e) s[n][e] = ex2(fmaf(s[n][e], {sl2:?}f, -lsb[n * 8 + t4 * 2 + (e & 1)]));
      }}
    }} else {{
{probabilities}    }}
    // Pᵀ rounded into A fragments (8-query groups 2kk and 2kk + 1 are the fragment of queries
    // 16kk..16kk + 15).
    #pragma unroll
    for (int kk = 0; kk < {br16}; ++kk) {{
      pa[kk][0] = pack(s[2 * kk][0], s[2 * kk][1]);
      pa[kk][1] = pack(s[2 * kk][2], s[2 * kk][3]);
      pa[kk][2] = pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      pa[kk][3] = pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
    }}
{v_product}{wait_p}{v_free}    // dSᵀ = Pᵀ ∘ (dPᵀ − D) while dV is on the tensor cores; rounded into A fragments, and into
    // shared memory for dQ.
    #pragma unroll
    for (int n = 0; n < {br8}; ++n) {{
      #pragma unroll
      for (int e = 0; e < 4; ++e) dpt[n][e] = s[n][e] * (dpt[n][e] - dlsb[n * 8 + t4 * 2 + (e & 1)]);
    }}
    #pragma unroll
    for (int kk = 0; kk < {br16}; ++kk) {{
      dsa[kk][0] = pack(dpt[2 * kk][0], dpt[2 * kk][1]);
      dsa[kk][1] = pack(dpt[2 * kk][2], dpt[2 * kk][3]);
      dsa[kk][2] = pack(dpt[2 * kk + 1][0], dpt[2 * kk + 1][1]);
      dsa[kk][3] = pack(dpt[2 * kk + 1][2], dpt[2 * kk + 1][3]);
    }}
{ds_free}    // dSᵀ as [keys][queries] in 64-query blocks of 128-byte rows, the 16-byte chunks of row r
    // at chunk c ^ (r mod 8); a warp's rows r, r + 8 have r mod 8 = g.
{ds_store}{k_before}    // Both warpgroups' dSᵀ written and visible to the tensor cores.
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
{stage_free}{sync}
    {{
      // dQ = dS·K over the block's keys: at head size 128 this warpgroup's 64 columns, at 64
      // its 64 query rows.
      const unsigned da = dsb + (unsigned)wg * {a_step}u, db = k_s + (unsigned)wg * {b_step}u;
      asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
{q_products}      asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    }}
{k_after}{reduce}{k_free}{it_end}  }}
{k_last}"#,
        br2 = 2 * br,
        ds_store = swizzled_rows(
            "dsb",
            BK,
            br8,
            ["dsa[n >> 1][(n & 1) * 2]", "dsa[n >> 1][(n & 1) * 2 + 1]"]
        ),
        s_products = kmajor_products(
            ["RT_WGMMA_S0", "RT_WGMMA_S"],
            ("k_s", BK, "wg"),
            ("qs", br),
            d
        ),
        p_products = kmajor_products(
            ["RT_WGMMA_P0", "RT_WGMMA_P"],
            ("v_s", BK, "wg"),
            ("gs", br),
            d
        ),
        // With `dK` left running, the wait for `Sᵀ` also completes the previous tile's `dK`,
        // whose operand registers stay pinned till then.
        wait_s = if overlap {
            wait(1, "s", br8) + &pin("acck", d / 8, 'f') + &pin("dsa", br16, 'r')
        } else {
            wait(1, "s", br8)
        },
        probabilities = transposed_probabilities(sp, "Pᵀ", "lsb", "s[n][e] = p;", br),
        v_product = if wv {
            register_product("dV += Pᵀ·dO", "RT_WGMMA_V", "pa", "accv", "gs", br, d)
        } else {
            String::new()
        },
        // dV (when computed) may stay in flight.
        wait_p = wait(u32::from(wv), "dpt", br8),
        k_before = if wk && !overlap {
            register_product("dK += dSᵀ·Q", "RT_WGMMA_K", "dsa", "acck", "qs", br, d)
        } else {
            String::new()
        },
        k_after = if overlap {
            register_product("dK += dSᵀ·Q", "RT_WGMMA_K", "dsa", "acck", "qs", br, d)
        } else {
            String::new()
        },
        k_last = {
            let mut out = if ws {
                String::new()
            } else {
                "  asm volatile(\"cp.async.wait_group 0;\" ::: \"memory\");\n".to_string()
            };
            if overlap {
                out += &wait(0, "acck", d / 8);
            }
            if ws {
                // Every product of the block's keys is complete: the last query buffer and the
                // key and value tiles go back to the producer.
                let kv = if early || store_bulk {
                    ""
                } else {
                    " mb_arrive(kvempty);"
                };
                out += &format!("  if (it0 < {qt} && lane == 0) {{ mb_arrive(qempty + 8u * ((qc + {nbuf}u - 1u) % {nbuf}u));{kv} }}\n");
            }
            out
        },
        // Bytes copied by `cp.async` (the generic proxy) are made visible to the tensor cores
        // (the async proxy); bulk tensor copies write through the async proxy already
        // ([`Variant::fence`]).
        it_start = if ws {
            let fence = if tma && !variant.fence {
                ""
            } else {
                "    asm volatile(\"fence.proxy.async.shared::cta;\" ::: \"memory\");\n"
            };
            format!(
                r#"    // Tile `it` has landed in buffer `buf`.
    const unsigned buf = qc % {nbuf}u;
    mb_wait(qfull + 8u * buf, (qc / {nbuf}u) & 1u);
{fence}"#
            )
        } else {
            format!(
                r#"    const int buf = (it - it0) % {nbuf};
    // Tile `it` has landed (each thread's copies, then made visible to the tensor cores); after
    // the barrier nothing reads the buffer the next tile takes.
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    if (it + 1 < {qt}) load_queries(it + 1, (it + 1 - it0) % {nbuf});
    asm volatile("cp.async.commit_group;" ::: "memory");
"#
            )
        },
        // The previous tile's products are complete: its buffer goes back to the producer.
        release_prev = if ws {
            format!("    if (step > it0 && lane == 0) mb_arrive(qempty + 8u * ((qc + {nbuf}u - 1u) % {nbuf}u));\n")
        } else {
            String::new()
        },
        ds_buf = if ds2 {
            format!("    // This tile's dSᵀ buffer (its last reader, tile it − 2's dQ, ordered by tile it − 1's\n    // barrier).\n    const unsigned dsb = ds_s + (qc & 1u) * {dsbytes}u;\n")
        } else {
            "    const unsigned dsb = ds_s;\n".to_string()
        },
        // Both warpgroups' previous dQ products, which read dSᵀ, are complete.
        ds_free = if ws && !ds2 {
            "    asm volatile(\"bar.sync 3, 256;\" ::: \"memory\");\n"
        } else {
            ""
        },
        sync = if ws {
            "    asm volatile(\"bar.sync 3, 256;\" ::: \"memory\");\n"
        } else {
            "    __syncthreads();\n"
        },
        it_end = if ws { "    ++qc;\n" } else { "" },
        // The block's last products of the value tile (dPᵀ, complete with the wait above) and of
        // the key tile (dQ, complete in the reduction) read them: they go back to the producer.
        v_free = last_tile_frees("vempty"),
        k_free = last_tile_frees("kvempty"),
        a_step = if br == 128 { BK * 128 } else { 0 },
        b_step = if br == 64 { BK * 128 } else { 0 },
        q_products = q_products(),
        // Where each warpgroup stages its dQ for the bulk reduction: past the statistics, or
        // at head size 64 with two dSᵀ buffers the half of this tile's dSᵀ that only its own
        // (complete) dQ product read.
        reduce = reduce_dq(
            sp,
            wk,
            wv,
            bulk.then(|| if staged_in_ds {
                format!("dsb + (unsigned)wg * {}u", BK * 128)
            } else {
                format!("l_s + {lbytes}u + (unsigned)wg * {}u", DQ_PART * 4)
            }),
            overlap
        ),
        stage_free = if bulk {
            "    // The previous tile's bulk reduction has read the staged dQ.\n    if ((tid & 127) == 0) asm volatile(\"cp.async.bulk.wait_group.read 0;\" ::: \"memory\");\n"
        } else {
            ""
        },
    );
    if store_bulk {
        c += &bulk_store_kv(sp, wk, wv);
    } else {
        c += &store_kv(sp, wk.then_some("out_k"), wv.then_some("out_v"));
    }
    if !ws {
        // The next tile's copies overwrite the key and value tiles.
        c += "  __syncthreads();\n";
    }
    c += "}\n";
    if bulk {
        // The bulk reductions complete before the block's shared memory goes.
        c +=
            "if ((tid & 127) == 0) asm volatile(\"cp.async.bulk.wait_group 0;\" ::: \"memory\");\n";
    }
    if ws {
        // The computing warpgroups' branch.
        c += "}\n";
    }
    Built {
        source: c,
        threads: (THREADS + if ws { PRODUCER } else { 0 }) as u32,
        smem: smem as u32,
        keys: BK,
        dq_blocked: bulk.then(|| dq_index(sp)),
        maps: tma.then_some([br as u32, BK as u32]),
        out_maps: store_bulk,
    }
}

/// With [`Variant::store_bulk`]: `dK` (scaled) and `dV` rounded into the key and value tiles'
/// shared memory, laid out as the bulk tensor copies loaded them (64-column blocks of 128-byte
/// rows, the 16-byte chunks of row r at chunk c ^ (r mod 8)), once both warpgroups' products
/// have read the tiles; then one thread copies them out through the tensor maps (which drop
/// the rows past the keys' end) and gives the tiles back to the producer once the copies have
/// read them. A key tile that no query sees (the producer copied nothing into the tiles,
/// which may hold the next key tile already) writes its zeros directly.
fn bulk_store_kv(sp: &Spec, wk: bool, wv: bool) -> String {
    let (sq, d) = (sp.sq, sp.d);
    let qt = sq.div_ceil(query_rows(sp));
    let mut stage = String::new();
    let mut copy = String::new();
    for (on, acc, tile, map, scale) in [
        (wk, "acck", "k_s", "okmap", sp.scale as f32),
        (wv, "accv", "v_s", "ovmap", 1.0f32),
    ] {
        if !on {
            continue;
        }
        stage += &swizzled_rows(
            tile,
            BK,
            d / 8,
            [
                &format!("pack({acc}[n][0] * {scale:?}f, {acc}[n][1] * {scale:?}f)"),
                &format!("pack({acc}[n][2] * {scale:?}f, {acc}[n][3] * {scale:?}f)"),
            ],
        );
        copy += &format!(
            "      tma_store_tile(&{map}, {tile}, kb, {dblk}, {BK}, hh, bb);\n",
            dblk = d / 64,
        );
    }
    format!(
        r#"  if (it0 < {qt}) {{
    // Both warpgroups' products, which read the key and value tiles, are complete.
    asm volatile("bar.sync 3, 256;" ::: "memory");
{stage}    // Staged, and visible to the bulk copies.
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    asm volatile("bar.sync 3, 256;" ::: "memory");
    if (tid == 0) {{
      const int hh = (int)(bh % {heads}LL), bb = (int)(bh / {heads}LL);
{copy}      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
      asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
      mb_arrive(kvempty);
    }}
  }} else {{
{direct}  }}
"#,
        heads = sp.heads,
        direct = store_kv(sp, wk.then_some("out_k"), wv.then_some("out_v")),
    )
}

/// The C defining `lp` and `dlp` (the head's log-sum-exp and `D`) and `load_queries(it, buf)`,
/// which copies query tile `it` (its rows, `dO` rows, log-sum-exp and `D`) into buffer `buf`
/// with `cp.async` (uncommitted); with `stats_only` (the rows and `dO` rows left to bulk
/// tensor copies) only the log-sum-exp and `D`.
fn load_queries(sp: &Spec, br: usize, stats_only: bool) -> String {
    let (sq, d) = (sp.sq, sp.d);
    let qbytes = br * d * 2;
    let (qrs, grs) = (sp.stride(Part::Q), sp.stride(Part::O));
    let rows = if stats_only {
        String::new()
    } else {
        format!(
            r#"    load(qp, (long long)it * {br}, {sq}LL, {br}, {d}, {qrs}LL, q_s0 + (unsigned)buf * {qbytes}u);
    load(gp, (long long)it * {br}, {sq}LL, {br}, {d}, {grs}LL, g_s0 + (unsigned)buf * {qbytes}u);
"#
        )
    };
    format!(
        r#"  const float* lp = lse + bh * {sq}LL;
  const float* dlp = delta + bh * {sq}LL;
  auto load_queries = [&](int it, int buf) {{
{rows}    if (tid < {br}) {{
      const int i = it * {br} + tid;
      const int bytes = i < {sq} ? 4 : 0;
      const long long at = i < {sq} ? i : 0;
      const unsigned to = l_s + (unsigned)((buf * {br2} + tid) * 4);
      asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" :: "r"(to), "l"(lp + at), "r"(bytes) : "memory");
      asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" :: "r"(to + {br4}u), "l"(dlp + at), "r"(bytes) : "memory");
    }}
  }};
"#,
        br2 = 2 * br,
        br4 = br * 4,
    )
}

/// The C expression of the query tile taken at walk step `step` (from `it0`, the first that
/// sees the key tile, to the last): the step itself, or with `rotate` the steps rotated by the
/// key tile's index within its head.
fn walk(sp: &Spec, br: usize, rotate: bool) -> String {
    if rotate {
        let (qt, kt) = (sp.sq.div_ceil(br), sp.sk.div_ceil(BK));
        format!("it0 + (step - it0 + (int)(tile % {kt}LL)) % ({qt} - it0)")
    } else {
        "step".to_string()
    }
}

/// The C before the walk over the key tiles: the copy helper and, without a producer, the
/// warpgroup index and the reduction helper. With one ([`Variant::ws`]): the barriers (at
/// `off` bytes past the statistics' buffers), the producer's branch (which walks the same key
/// tiles and copies, for each, the key and value tiles and then the query tiles that see them
/// into the buffers in turn, each once the computing warpgroups have given it back), and the
/// opening of the computing warpgroups' branch, whose threads are renumbered from 0.
#[allow(clippy::too_many_arguments)]
fn roles(
    sp: &Spec,
    br: usize,
    nbuf: usize,
    bulk: bool,
    ws: bool,
    tma: bool,
    early: bool,
    store_bulk: bool,
    off: usize,
    walk: &str,
    stagger_ns: u32,
) -> String {
    let red2 = if bulk { "" } else { RED2 };
    if !ws {
        let prelude = super::hopper::prelude().replace("$THREADS", &THREADS.to_string());
        return format!("const int wg = tid >> 7;\n{prelude}{red2}");
    }
    let (sq, sk, d) = (sp.sq, sp.sk, sp.d);
    let (qt, kt) = (sq.div_ceil(br), sk.div_ceil(BK));
    let tiles = sp.bsz * sp.heads * kt;
    let (krs, vrs) = (sp.stride(Part::K), sp.stride(Part::V));
    let (reg_p, reg_c) = registers(tma);
    // Bulk tensor copies leave the producer no tile to copy itself.
    let prelude = if tma {
        super::hopper::descriptor().to_string()
    } else {
        super::hopper::prelude().replace("$THREADS", &PRODUCER.to_string())
    };
    let cwarps = THREADS / 32;
    let (kbytes, qbytes) = (BK * d * 2, br * d * 2);
    // The key and value tiles, and each query tile's rows and dO rows: the producer threads'
    // `cp.async`s (each thread's arrival once its copies land), or one thread's bulk tensor
    // copies (its announcement of their bytes; the threads still copy the statistics).
    let (kv_count, q_count, kv_copy, q_copy) = if tma {
        (
            "1".to_string(),
            format!("{}", PRODUCER + 1),
            format!(
                r#"    if (tid == 0) {{
      mb_expect(kvfull, {kv2}u);
      tma_tile(&kmap, k_s, kvfull, kb, {dblk}, {BK}, hh, bb);
      tma_tile(&vmap, v_s, kvfull, kb, {dblk}, {BK}, hh, bb);
    }}
"#,
                kv2 = 2 * kbytes,
                dblk = d / 64,
            ),
            format!(
                r#"      if (tid == 0) {{
        const unsigned bar = qfull + 8u * buf;
        mb_expect(bar, {q2}u);
        tma_tile(&qmap, q_s0 + buf * {qbytes}u, bar, it * {br}, {dblk}, {br}, hh, bb);
        tma_tile(&gmap, g_s0 + buf * {qbytes}u, bar, it * {br}, {dblk}, {br}, hh, bb);
      }}
"#,
                q2 = 2 * qbytes,
                dblk = d / 64,
            ),
        )
    } else {
        (
            PRODUCER.to_string(),
            PRODUCER.to_string(),
            format!(
                r#"    load(kp, (long long)kb, {sk}LL, {BK}, {d}, {krs}LL, k_s);
    load(vp, (long long)kb, {sk}LL, {BK}, {d}, {vrs}LL, v_s);
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" :: "r"(kvfull) : "memory");
"#
            ),
            String::new(),
        )
    };
    // With `early`: the values first, the first query tile, then the keys (the order in which
    // the computing warpgroups give their buffers back), else both tiles at once.
    let (kv_start, k_in_loop, k_after_loop) = if early {
        (
            format!(
                r#"    auto copy_keys = [&]() {{
      mb_wait(kvempty, (kc & 1u) ^ 1u);
      if (tid == 0) {{
        mb_expect(kvfull, {kbytes}u);
        tma_tile(&kmap, k_s, kvfull, kb, {dblk}, {BK}, hh, bb);
      }}
    }};
    mb_wait(vempty, (kc & 1u) ^ 1u);
    if (tid == 0) {{
      mb_expect(vfull, {kbytes}u);
      tma_tile(&vmap, v_s, vfull, kb, {dblk}, {BK}, hh, bb);
    }}
"#,
                dblk = d / 64,
            ),
            "      if (step == it0 + 1) copy_keys();\n",
            format!("    if (it0 + 1 == {qt}) copy_keys();\n"),
        )
    } else {
        (
            format!("    mb_wait(kvempty, (kc & 1u) ^ 1u);\n{kv_copy}"),
            "",
            String::new(),
        )
    };
    let heads = sp.heads;
    let helpers = if tma && store_bulk {
        [
            super::hopper_ws::MBARRIERS,
            super::hopper_ws::BULK_COPIES,
            super::hopper_ws::BULK_STORE,
        ]
        .concat()
    } else if tma {
        [super::hopper_ws::MBARRIERS, super::hopper_ws::BULK_COPIES].concat()
    } else {
        super::hopper_ws::MBARRIERS.to_string()
    };
    format!(
        r#"{prelude}const unsigned qfull = l_s + {off}u, qempty = qfull + {b8}u, kvfull = qempty + {b8}u, kvempty = kvfull + 8u;
{v_bars}{mbarriers}if (tid == 0) {{
  // Full: the producer's threads (their copies landed) and the bulk copies' announcement where
  // they copy; empty: the computing warps.
  for (unsigned b = 0; b < {nbuf}u; ++b) {{
    mb_init(qfull + 8u * b, {q_count}u);
    mb_init(qempty + 8u * b, {cwarps}u);
  }}
  mb_init(kvfull, {kv_count}u);
  mb_init(kvempty, {kv_free}u);
{v_init}
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}}
__syncthreads();
if (tid < {PRODUCER}) {{
  asm volatile("setmaxnreg.dec.sync.aligned.u32 {reg_p};" ::: "memory");
{stagger}  // Query buffers and key tiles filled so far (their parities and slots follow).
  unsigned qc = 0, kc = 0;
  for (long long tile = blockIdx.x; tile < {tiles}LL; tile += gridDim.x) {{
    const long long bh = tile / {kt}LL;
    const int kb = (int)(tile % {kt}LL) * {BK};
    const int it0 = ({first}) / {br};
    if (it0 >= {qt}) continue;
{ptrs}{loader}    const int hh = (int)(bh % {heads}LL), bb = (int)(bh / {heads}LL);
{kv_start}    for (int step = it0; step < {qt}; ++step) {{
      const int it = {walk};
{k_in_loop}      const unsigned buf = qc % {nbuf}u;
      mb_wait(qempty + 8u * buf, ((qc / {nbuf}u) & 1u) ^ 1u);
{q_copy}      load_queries(it, (int)buf);
      asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" :: "r"(qfull + 8u * buf) : "memory");
      ++qc;
    }}
{k_after_loop}    ++kc;
  }}
  // Every copy has landed before the producer leaves.
  asm volatile("cp.async.wait_all;" ::: "memory");
}} else {{
asm volatile("setmaxnreg.inc.sync.aligned.u32 {reg_c};" ::: "memory");
const int tid = threadIdx.x - {PRODUCER}, warp = tid >> 5, wg = tid >> 7;
{red2}unsigned qc = 0, kc = 0;
"#,
        b8 = 8 * nbuf,
        mbarriers = helpers,
        // With bulk stores one thread gives the key and value tiles back, once its copies of
        // dK and dV out of them have read them.
        kv_free = if store_bulk { 1 } else { cwarps },
        // With `early` kvfull and kvempty stand for the key tile alone.
        v_bars = if early {
            "const unsigned vfull = kvempty + 8u, vempty = vfull + 8u;\n"
        } else {
            ""
        },
        v_init = if early {
            format!("  mb_init(vfull, 1u);\n  mb_init(vempty, {cwarps}u);\n")
        } else {
            String::new()
        },
        first = first_query(sp),
        ptrs = head_pointers(sp),
        loader = load_queries(sp, br, tma),
        stagger = if stagger_ns > 0 {
            format!(
                r#"  {{
    // This block's start, spread over {stagger_ns} ns across the grid.
    unsigned long long t0, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    const unsigned long long until = t0 + (unsigned long long)blockIdx.x * {stagger_ns}ull / gridDim.x;
    do {{ __nanosleep(256); asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now)); }} while (now < until);
  }}
"#
            )
        } else {
            String::new()
        },
    )
}

/// Waits for the `dQ` product (and with it every product of the tile), then adds `dQ` into
/// the f32 buffer: at head size 128 this warpgroup's 64 columns of the tile's 64 rows, at 64
/// its 64 rows.
/// With bulk reductions (`stage`, the C address where this warpgroup stages its part), `dQ`
/// goes through shared memory.
fn reduce_dq(sp: &Spec, wk: bool, wv: bool, stage: Option<String>, dk_running: bool) -> String {
    let (sq, d) = (sp.sq, sp.d);
    let br = query_rows(sp);
    let (row_step, col_step) = if br == 128 { (64, 0) } else { (0, 64) };
    // dV and dK (when computed, and unless dK is left running) completed with it.
    let mut out = wait(u32::from(dk_running), "dq", 8);
    for (acc, on) in [("acck", wk && !dk_running), ("accv", wv)] {
        if on {
            out += &pin(acc, d / 8, 'f');
        }
    }
    if let Some(stage) = stage {
        let qt = sq.div_ceil(br);
        return out
            + &format!(
                r#"    {{
      // This warpgroup's part in the accumulators' order (pair p of thread t at p·128 + t), staged
      // in shared memory and added into its block of the buffer by one bulk reduction.
      const int tw = tid & 127;
      const unsigned st = {stage};
      #pragma unroll
      for (int n = 0; n < 8; ++n) {{
        asm volatile("st.shared.v2.f32 [%0], {{%1, %2}};" :: "r"(st + (unsigned)(((2 * n) * 128 + tw) * 8)), "f"(dq[n][0]), "f"(dq[n][1]) : "memory");
        asm volatile("st.shared.v2.f32 [%0], {{%1, %2}};" :: "r"(st + (unsigned)(((2 * n + 1) * 128 + tw) * 8)), "f"(dq[n][2]), "f"(dq[n][3]) : "memory");
      }}
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      asm volatile("bar.sync %0, 128;" :: "r"(1 + wg) : "memory");
      if (tw == 0) {{
        float* dst = dq_acc + ((bh * {qt}LL + it) * 2 + wg) * {DQ_PART}LL;
        asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], {part_bytes};" :: "l"(dst), "r"(st) : "memory");
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
      }}
    }}
"#,
                part_bytes = DQ_PART * 4,
            );
    }
    out + &format!(
        r#"    {{
      const int r0 = it * {br} + wg * {row_step} + (warp & 3) * 16 + g;
      float* dq0 = dq_acc + (bh * {sq}LL + r0) * {d}LL + wg * {col_step} + t4 * 2;
      #pragma unroll
      for (int n = 0; n < 8; ++n) {{
        if (r0 < {sq}) red2(dq0 + n * 8, dq[n][0], dq[n][1]);
        if (r0 + 8 < {sq}) red2(dq0 + 8LL * {d} + n * 8, dq[n][2], dq[n][3]);
      }}
    }}
"#
    )
}

/// `what` (a comment) as one commit group: `acc[d / 8][4] += A·B` by the macro `mac`, A from
/// the registers `a` (a query tile of `br` rows), B the MN-major tile at shared address `b`.
fn register_product(
    what: &str,
    mac: &str,
    a: &str,
    acc: &str,
    b: &str,
    br: usize,
    d: usize,
) -> String {
    let mut out = format!("    // {what}.\n");
    out += &pin(a, br / 16, 'r');
    out += &pin(acc, d / 8, 'f');
    out += "        asm volatile(\"wgmma.fence.sync.aligned;\" ::: \"memory\");\n";
    out += &register_products(mac, a, b, br);
    out += "        asm volatile(\"wgmma.commit_group.sync.aligned;\" ::: \"memory\");\n";
    out
}

/// `dQ = dS·K` over the block's keys in steps of 16 (2048 bytes of both MN-major tiles), from
/// the shared addresses `da` (`dSᵀ`) and `db` (the key tile).
fn q_products() -> String {
    (0..BK / 16)
        .map(|kk| {
            format!(
                "      {mac}({}, {});\n",
                super::hopper::desc_call("da", BK * 128, kk * 2048),
                super::hopper::desc_call("db", BK * 128, kk * 2048),
                mac = if kk == 0 { "RT_WGMMA_Q0" } else { "RT_WGMMA_Q" },
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::Spec;
    use rustytorch_ops::{AttnLayout, AttnMask, Causal, DType, F64Bits, Op, TensorType};

    fn spec(d: usize, sq: usize, sk: usize) -> Spec {
        let t =
            |s: usize| TensorType::new(DType::BF16, rustytorch_ops::Shape::new(vec![2, 3, s, d]));
        let ins = [t(sq), t(sk), t(sk), t(sq)];
        let refs: Vec<&TensorType> = ins.iter().collect();
        let op = Op::AttentionGrad {
            causal: Causal::BottomRight,
            mask: AttnMask::None,
            scale: F64Bits::new(0.125),
            wrt: 0,
            layout: AttnLayout::Bhsd,
        };
        let out = rustytorch_ops::infer(&op, &refs).unwrap();
        Spec::new(&op, &refs, &out).unwrap().unwrap()
    }

    /// Both head sizes fit Hopper's 227 KiB of shared memory per block in every variant, with
    /// the tiles at the 1024-byte multiples the swizzle needs, and the `dQ` products cover the
    /// block's keys.
    #[test]
    fn blocks_fit_hopper() {
        let variants = (0..128 * 6).map(|j| {
            let i = j / 6;
            super::Variant {
                bulk: i & 1 != 0,
                overlap: [None, Some(false), Some(true)][j % 3],
                ws: i & 2 != 0,
                tma: i & 4 != 0,
                ds2: i & 8 != 0,
                early: i & 16 != 0,
                rotate: i & 32 != 0,
                store_bulk: i & 64 != 0,
                fence: (j / 3) % 2 == 0,
                stagger_ns: if j % 5 == 0 { 20_000 } else { 0 },
            }
        });
        for variant in variants {
            // Bulk tensor copies imply a producer.
            let ws = variant.ws || variant.tma;
            for d in [64, 128] {
                let sp = spec(d, 1000, 777);
                assert!(super::supported(&sp));
                let b = super::build(&sp, true, true, variant);
                assert!(
                    b.smem as usize <= 227 * 1024,
                    "d {d} {variant:?}: {} bytes",
                    b.smem
                );
                let br = super::query_rows(&sp);
                assert_eq!((super::BK * d * 2) % 1024, 0);
                assert_eq!((br * d * 2) % 1024, 0);
                assert_eq!((super::BK * br * 2) % 1024, 0);
                assert_eq!(b.keys, super::BK);
                assert_eq!(
                    super::q_products().matches("RT_WGMMA_Q").count(),
                    super::BK / 16
                );
                assert!(b.source.contains("RT_WGMMA_V(") && b.source.contains("RT_WGMMA_K("));
                // Three query buffers when dK is left running or a producer copies them.
                let three = variant.overlap.unwrap_or(d > 64) || ws;
                assert_eq!(b.source.contains("% 3"), three, "{variant:?}");
                assert_eq!(b.threads, if ws { 384 } else { 256 });
                assert_eq!(b.source.contains("setmaxnreg"), ws);
                // Bulk stores of dK and dV with bulk tensor copies, apart from the early release.
                let bulk_out = variant.store_bulk && variant.tma && !variant.early;
                assert_eq!(b.out_maps, bulk_out);
                // One store helper, called for dK and for dV.
                assert_eq!(
                    b.source
                        .matches("cp.async.bulk.tensor.4d.global.shared::cta")
                        .count(),
                    usize::from(bulk_out)
                );
                assert_eq!(
                    b.source.matches("tma_store_tile(").count(),
                    if bulk_out { 2 } else { 0 }
                );
                // Proxy fences: after each query tile's copies (unless bulk copies go without),
                // after dSᵀ is written, after dQ is staged (bulk reductions) and after dK and dV
                // are (bulk stores).
                let fences = usize::from(!variant.tma || variant.fence)
                    + 1
                    + usize::from(variant.bulk)
                    + usize::from(bulk_out);
                assert_eq!(
                    b.source.matches("fence.proxy.async.shared::cta").count(),
                    fences,
                    "{variant:?}"
                );
                // The rotated walk needs the producer, which walks the same steps.
                let rotated = b.source.matches("(step - it0 + (int)(tile % ").count();
                assert_eq!(rotated, if variant.rotate && ws { 2 } else { 0 });
                assert_eq!(b.source.contains("cp.async.bulk.tensor"), variant.tma);
                assert_eq!(b.maps.is_some(), variant.tma);
                for regs in [super::REGISTERS, super::TMA_REGISTERS] {
                    assert!(super::super::hopper_ws::registers_balance(
                        (super::THREADS + super::PRODUCER) as u32,
                        super::PRODUCER as u32,
                        regs
                    ));
                }
                assert_eq!(b.dq_blocked.is_some(), variant.bulk);
                // Two dSᵀ buffers leave one named barrier of both warpgroups a tile.
                let ds2 = variant.ds2 && ws && variant.bulk;
                // Bulk stores add two after the walk.
                let barriers = b.source.matches("bar.sync 3, 256").count();
                assert_eq!(
                    barriers,
                    if !ws {
                        0
                    } else if ds2 {
                        1
                    } else {
                        2
                    } + if bulk_out { 2 } else { 0 },
                    "{variant:?}"
                );
                assert_eq!(b.source.contains("(qc & 1u)"), ds2, "{variant:?}");
                // Keys and values released apart: each barrier initialized, waited for and
                // arrived on.
                let early = variant.early && variant.tma;
                for bar in [
                    "mb_init(vfull",
                    "mb_wait(vfull",
                    "mb_wait(vempty",
                    "mb_arrive(vempty",
                ] {
                    assert_eq!(b.source.contains(bar), early, "{bar} {variant:?}");
                }
                assert_eq!(
                    b.source.matches("copy_keys()").count(),
                    if early { 2 } else { 0 }
                );
                let only_v = super::build(&sp, false, true, variant);
                assert!(!only_v.source.contains("RT_WGMMA_K(") && !only_v.source.contains("acck"));
                assert_eq!(only_v.source.contains("% 3"), ws);
            }
        }
        assert!(!super::supported(&spec(48, 100, 100)));
    }
}
