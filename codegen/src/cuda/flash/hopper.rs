//! The flash attention forward for Hopper (compute capability 9.0, built for `sm_90a`): the
//! products on warpgroup MMA (`wgmma.mma_async`), the operands in 128-byte-swizzled shared
//! memory.
//!
//! # The kernel
//!
//! A block of two warpgroups ([`Tile`]) owns 128 query rows of one (batch, head), each
//! warpgroup 64 of them. The block copies its query tile once and walks the keys in tiles of
//! 128; the copies (`cp.async`, 16 bytes a thread, rows past the end zero-filled) of tile
//! `j + 1` run while tile `j` is computed. Per tile and warpgroup:
//!
//! 1. `S = Q·Kᵀ` (64 × 128, f32) by `wgmma.m64n128k16` with both operands read from shared
//!    memory through matrix descriptors (K-major, 128-byte swizzle: rows of 64 elements, the
//!    16-byte chunks of row `r` stored at chunk `c ^ (r mod 8)`, so that the tensor cores read
//!    without bank conflicts);
//! 2. the online softmax in registers with the portable kernel's semantics ([`super`]):
//!    base-2 scores, the causal limit, the end of the keys and the mask applied only on tiles
//!    that cross them (elsewhere the scale is folded into the exponent's multiply-add), the rows'
//!    maxima over the four lanes that share a row, the output rescaled only when a maximum
//!    moved;
//! 3. `O += P·V` by `wgmma.m64nDk16` with `P` taken from registers (the accumulator layout of
//!    `S`, rounded to the operands' type, is the A-fragment layout) and `V` read N-major from
//!    shared memory (the descriptor's transpose bit; its 64-column blocks `LBO` apart).
//!
//! The two warpgroups are skewed by half a step: the even one runs tile `j` as S, softmax,
//! P·V; the odd one runs the softmax and P·V of tile `j - 1`, then S of tile `j`. One barrier a
//! step orders the copies, and between two barriers one warpgroup's exponentials overlap the
//! other's matrix products (in lockstep both would exponentiate while the tensor cores idle).
//! So key tiles take two buffers and value tiles three (tile `j` is read in steps `j` and
//! `j + 1`).
//!
//! The accumulator layout of `wgmma.m64nN` is, per warp of the warpgroup, that of
//! `mma.m16n8` repeated over the columns, so the end of the kernel (the normalized rows or the
//! backward's statistics) is the portable kernel's code.
//!
//! Causal blocks walk only the key tiles their rows see, and the tiles run in the order of
//! [`ORDER`] (heads in L2-sized sections, the heaviest query tiles of a section first).
//!
//! This kernel is kept behind `RUSTYTORCH_HOPPER_KERNEL=skew`: the warp-specialized kernel
//! ([`super::hopper_ws`]), built from the same pieces (the products, the softmax, the tile
//! order and the end are shared from here), ran faster on every measured shape. Its producer
//! can also copy with the tensor memory accelerator through tensor maps that the runtime
//! encodes over the operands' addresses (`RUSTYTORCH_HOPPER_TMA=1`, not yet the default:
//! docs/performance.md has the measurement that points there and what has run).

use super::{limit, row_maxima, tail, Shape2, Spec};

/// A block's shape: warpgroups (64 query rows each) and keys per tile.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Tile {
    /// Warpgroups per block.
    wg: usize,
    /// Keys per tile.
    bc: usize,
}

impl Tile {
    /// Query rows per block.
    fn br(self) -> usize {
        64 * self.wg
    }

    /// Threads per block.
    fn threads(self) -> u32 {
        128 * self.wg as u32
    }
}

/// The block shape: two warpgroups, and key tiles of 64 at head size 64 or 128 at head size 128.
/// On the H200 the smaller tile ran head size 64 at 1.12–1.19× the speed of `2x128` (128
/// registers a thread instead of 179, so two blocks share an SM) and head size 128 at 0.82×
/// (docs/performance.md); both passed the float64 device test and compute-sanitizer.
/// `RUSTYTORCH_HOPPER_TILE=WxB` (such as `2x64`) picks another, for measurements.
fn tile(sp: &Spec) -> Tile {
    if let Ok(v) = std::env::var("RUSTYTORCH_HOPPER_TILE") {
        if let Some((w, b)) = v.split_once('x') {
            if let (Ok(wg), Ok(bc)) = (w.parse::<usize>(), b.parse::<usize>()) {
                if (1..=3).contains(&wg) && matches!(bc, 64 | 128) {
                    return Tile { wg, bc };
                }
            }
        }
    }
    let bc = if sp.d.max(sp.dv) <= 64 { 64 } else { 128 };
    Tile { wg: 2, bc }
}

/// The fewest query rows for which the kernel runs (below it most of each 64-row warpgroup
/// MMA would be wasted, and the portable kernel's 16-row warps do better).
pub const MIN_ROWS: usize = 65;

/// Whether the Hopper kernel runs this attention: head sizes 64 or 128 (query/key and value),
/// enough query rows to fill a warpgroup's tile.
pub(super) fn supported(sp: &Spec) -> bool {
    [sp.d, sp.dv].iter().all(|&h| h == 64 || h == 128) && sp.sq >= MIN_ROWS
}

/// Bytes of dynamic shared memory: the query tile, two key and three value tiles, and 1 KiB
/// to align the base to the swizzle's 1024-byte pattern.
fn smem_bytes(sp: &Spec, t: Tile) -> u32 {
    (1024 + t.br() * sp.d * 2 + 2 * t.bc * sp.d * 2 + 3 * t.bc * sp.dv * 2) as u32
}

/// Blocks: one per (query tile, batch·head).
fn tiles(sp: &Spec, t: Tile) -> usize {
    sp.bsz * sp.heads * sp.sq.div_ceil(t.br())
}

/// The Hopper forward of `sp` specialized on `s`, as launched: the block shape is read once
/// and sizes the threads, the shared memory, the grid and the source alike.
pub(super) struct Built {
    /// Threads per block.
    pub threads: u32,
    /// Bytes of dynamic shared memory.
    pub smem: u32,
    /// Blocks: one a tile, in the order the tiles are walked.
    pub blocks: usize,
    /// Blocks an SM holds at once.
    pub per_sm: u32,
    /// Whether the kernel launches as a persistent grid by default ([`launch`]).
    pub persistent: bool,
    /// The kernel body.
    pub source: String,
    /// Where the body reads q, k and v through tensor maps (`qmap`, `kmap`, `vmap`, parameters
    /// after the others): the rows of each map's box.
    pub maps: Option<[u32; 3]>,
    /// Where the body writes the output through a tensor map (`omap`, a parameter after the
    /// three above, over the output): the rows of its box.
    pub out_map: Option<u32>,
}

/// [`Built`] for `sp` and `s`: the warp-specialized kernel ([`super::hopper_ws`]), faster on
/// every measured shape (docs/performance.md), unless `RUSTYTORCH_HOPPER_KERNEL=skew` asks for
/// this module's.
pub(super) fn build(s: &Shape2, sp: &Spec) -> Built {
    if std::env::var("RUSTYTORCH_HOPPER_KERNEL").as_deref() != Ok("skew") {
        return super::hopper_ws::build(s, sp);
    }
    let t = tile(sp);
    Built {
        threads: t.threads(),
        smem: smem_bytes(sp, t),
        blocks: tiles(sp, t),
        per_sm: if t.bc == 64 { 2 } else { 1 },
        persistent: false,
        source: source(s, sp, t),
        maps: None,
        out_map: None,
    }
}

/// The grid and source of a Hopper kernel whose `src` walks `tiles` tiles in loops
/// (`for (long long tile = blockIdx.x; tile < N; tile += gridDim.x)`), of which an SM holds
/// `per_sm` blocks at once. `persistent` kernels launch only as many blocks as the device
/// holds at once, each walking several tiles (its producer copying the next tile's operands
/// while the consumers finish the current one, and no block set up twice on an SM); the
/// others one block a tile, which the hardware hands to SMs as they free up.
/// `RUSTYTORCH_HOPPER_GRID` overrides: `sms` persistent, `tiles` one block a tile, `N` at most
/// N blocks (tests: several tiles a block on small shapes). Where blocks walk several tiles,
/// each loop walks by rounds of `gridDim.x` tiles, every other round backwards, so that under
/// a causal mask (the tiles ordered heaviest first, [`ORDER`]) the block that took a round's
/// heaviest tile takes the next round's lightest; the producer and consumers of a block walk
/// alike.
pub(super) fn launch(src: String, tiles: usize, per_sm: u32, persistent: bool) -> (String, u32) {
    let var = std::env::var("RUSTYTORCH_HOPPER_GRID").ok();
    let var = var
        .as_deref()
        .unwrap_or(if persistent { "sms" } else { "tiles" });
    // The H100 SXM and H200 have 132 SMs, where a lowering does not know its device.
    let sms = super::super::sm_count().unwrap_or(132);
    let grid = grid_of(var, tiles, per_sm, sms);
    if grid as usize >= tiles {
        // A block a tile: each loop runs once.
        return (src, grid);
    }
    (snake(&src), grid)
}

/// [`launch`]'s rewriting of every tile loop in `src`.
fn snake(src: &str) -> String {
    const HEAD: &str = "for (long long tile = blockIdx.x; tile < ";
    const STEP: &str = "; tile += gridDim.x) {";
    let mut out = String::with_capacity(src.len() + 256);
    let mut rest = src;
    while let Some(at) = rest.find(HEAD) {
        let after = &rest[at + HEAD.len()..];
        let Some(end) = after.find(STEP) else { break };
        let n = &after[..end];
        out += &rest[..at];
        out += &format!(
            "for (long long round_ = 0; round_ * (long long)gridDim.x < {n}; ++round_) {{ const long long tile = round_ * (long long)gridDim.x + ((round_ & 1) ? (long long)(gridDim.x - 1 - blockIdx.x) : (long long)blockIdx.x); if (tile >= {n}) continue;"
        );
        rest = &after[end + STEP.len()..];
    }
    out + rest
}

/// [`launch`]'s grid as `var` asks (`sms`, `tiles` or a number; anything else one block a
/// tile), on a device of `sms` SMs.
fn grid_of(var: &str, tiles: usize, per_sm: u32, sms: u32) -> u32 {
    let cap = match var {
        "sms" => (sms.max(1) * per_sm.max(1)) as usize,
        n => n.parse::<usize>().ok().filter(|&n| n > 0).unwrap_or(tiles),
    };
    super::grid_for(tiles.min(cap) as u64, 1)
}

/// Where a `wgmma`'s A operand comes from, and how its operands lie in shared memory.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum OperandA {
    /// Shared memory through a descriptor `da`; both operands K-major.
    KMajor,
    /// Shared memory through a descriptor `da`; both operands MN-major (the transpose bits).
    MnMajor,
    /// Four registers `a0..a3` (the A-fragment layout); B read MN-major.
    Registers,
}

/// A C macro `name(A..., db)` issuing one `wgmma.m64n{n}k16` into the f32 accumulators
/// `acc[n / 8][4]` (`constraint` `=f` when it overwrites them, `+f` when it accumulates;
/// `scale_d` 0 or 1), A as `a` says.
pub(super) fn wgmma_macro(
    name: &str,
    elem: &str,
    n: usize,
    acc: &str,
    constraint: &str,
    scale_d: u32,
    a: OperandA,
) -> String {
    let a_regs = a == OperandA::Registers;
    let m = n / 2;
    let regs: Vec<String> = (0..m).map(|i| format!("%{i}")).collect();
    let outs: Vec<String> = (0..m)
        .map(|i| format!("\"{constraint}\"({acc}[{}][{}])", i / 4, i % 4))
        .collect();
    let (params, a, ins, tail) = if a_regs {
        (
            "a0, a1, a2, a3, db",
            format!("{{%{}, %{}, %{}, %{}}}", m, m + 1, m + 2, m + 3),
            "\"r\"(a0), \"r\"(a1), \"r\"(a2), \"r\"(a3), \"l\"(db)",
            "1, 1, 1",
        )
    } else {
        (
            "da, db",
            format!("%{m}"),
            "\"l\"(da), \"l\"(db)",
            if a == OperandA::MnMajor {
                "1, 1, 1, 1"
            } else {
                "1, 1, 0, 0"
            },
        )
    };
    let b = if a_regs { m + 4 } else { m + 1 };
    format!(
        "#define {name}({params}) asm volatile(\"{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{sc}, 0;\\n\
         wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{elem}.{elem} {{{regs}}}, {a}, %{b}, p, {tail};\\n}}\\n\" \
         : {outs} : {ins}, \"r\"({scale_d}))\n",
        regs = regs.join(", "),
        outs = outs.join(", "),
        sc = b + 1,
    )
}

/// The `wgmma`s of the kernel: `RT_WGMMA_S0(da, db)` for the first step of `S = Q·Kᵀ` over the
/// head dim, which overwrites `s` (its outputs write-only, so the previous tile's scores are
/// dead once the softmax has read them), `RT_WGMMA_S(da, db)` for the others, and
/// `RT_WGMMA_O(a0, a1, a2, a3, db)` for `O += P·V` with `P` from registers.
pub(super) fn wgmma_macros(elem: &str, bc: usize, dv: usize) -> String {
    [
        wgmma_macro("RT_WGMMA_S0", elem, bc, "s", "=f", 0, OperandA::KMajor),
        wgmma_macro("RT_WGMMA_S", elem, bc, "s", "+f", 1, OperandA::KMajor),
        wgmma_macro("RT_WGMMA_O", elem, dv, "o", "+f", 1, OperandA::Registers),
    ]
    .concat()
}

/// `asm volatile("" : "+c"(x))` over every element of `arr[rows][4]` (`c` the constraint):
/// keeps the compiler from moving reads or writes of MMA operands across the MMA's fence and
/// wait.
pub(super) fn pin(arr: &str, rows: usize, c: char) -> String {
    format!(
        "        #pragma unroll\n        for (int n = 0; n < {rows}; ++n) {{ asm volatile(\"\" : \"+{c}\"({arr}[n][0]), \"+{c}\"({arr}[n][1]), \"+{c}\"({arr}[n][2]), \"+{c}\"({arr}[n][3]) :: \"memory\"); }}\n"
    )
}

/// The first part of the online softmax of score tile `t` in `s` (raw products): the scores
/// masked, the running maxima moved, the sums rescaled, and `c`, `r0`, `r1` (the exponent's
/// scale and references) and `a0`, `a1` (the rows' rescaling factors) defined. Off the edges (no
/// mask, every key visible to every row of the block) the scale is folded into the exponent's
/// multiply-add; on them the scores are scaled and masked first (everywhere where a mask adds
/// to them or the scale is not positive, `$SCALED`: the raw scores' maximum times the scale is
/// the scaled scores' maximum only for a positive scale).
pub(super) const SOFTMAX_SCORES: &str = r#"        const int kb = t * $BC;
        float c = $SCALEf;
        if ($SCALED || kb + $BC > lim_first) {
          c = 1.f;
          #pragma unroll
          for (int n = 0; n < $BC8; ++n) {
            #pragma unroll
            for (int e = 0; e < 4; ++e) {
              float x = s[n][e] * $SCALEf;
              const int key = kb + n * 8 + t4 * 2 + (e & 1);
              const int row = e < 2 ? i0 : i1;
              if (key >= (e < 2 ? lim0 : lim1) || row >= $SQ) {
                x = RT_NEG_INF;
              } else {
                $MASK
              }
              s[n][e] = x;
            }
          }
        }
        // The rows' maxima over the four lanes that share them (c > 0 keeps the order).
$ROW_MAXIMA        const float mn0 = fmaxf(m0, mx0 * c), mn1 = fmaxf(m1, mx1 * c);
        // A row with nothing visible yet keeps a finite reference so that 2^(−∞ − ref) is 0.
        const float r0 = mn0 == RT_NEG_INF ? 0.f : mn0, r1 = mn1 == RT_NEG_INF ? 0.f : mn1;
        const float a0 = ex2(m0 - r0), a1 = ex2(m1 - r1);
        m0 = mn0; m1 = mn1;
        l0 *= a0; l1 *= a1;
"#;

/// [`SOFTMAX_SCORES`]'s edge without a mask and with a positive scale, as
/// `RUSTYTORCH_HOPPER_EDGE=lean` builds it ([`softmax_scores`]): the masked scores set to −∞
/// and the others left raw (the scale, positive, stays in the exponent's multiply-add and
/// takes −∞ to −∞), each row's limit taken relative to the lane's first key once (a row past
/// the end sees no key), so that each score costs a compare with a constant and a select
/// where the full edge multiplies, adds the key's index and compares it (about 3.5
/// instructions a score, 224 a 64 × 128 tile, in the assembler's listing).
const LEAN_EDGE: &str = r#"        const int kb = t * $BC;
        const float c = $SCALEf;
        if (kb + $BC > lim_first) {
$EDGE_LIMITS          #pragma unroll
          for (int n = 0; n < $BC8; ++n) {
            #pragma unroll
            for (int e = 0; e < 4; ++e) {
$EDGE_COMPARE            }
          }
        }
"#;

/// The edge's limits relative to a lane's first key in the tile (`d0`, `d1`: a row past the
/// end sees none), as [`LEAN_EDGE`] and the warp-specialized kernel's chunked edge take them.
pub(super) const EDGE_LIMITS: &str = r#"          const int d0 = (i0 < $SQ ? lim0 : 0) - kb - t4 * 2;
          const int d1 = (i1 < $SQ ? lim1 : 0) - kb - t4 * 2;
"#;

/// The edge's one compare and select of score `s[n][e]` against its row's limit, at `indent`
/// spaces.
pub(super) fn edge_compare(indent: usize) -> String {
    format!(
        "{:indent$}if (n * 8 + (e & 1) >= (e < 2 ? d0 : d1)) s[n][e] = RT_NEG_INF;\n",
        ""
    )
}

/// [`SOFTMAX_SCORES`], with `lean` its edge [`LEAN_EDGE`] (which only a kernel without a mask
/// and with a positive scale may take).
pub(super) fn softmax_scores(lean: bool) -> String {
    if !lean {
        return SOFTMAX_SCORES.to_string();
    }
    let rest = SOFTMAX_SCORES
        .find("        // The rows' maxima")
        .expect("the maxima follow the edge");
    let lean = LEAN_EDGE
        .replace("$EDGE_LIMITS", EDGE_LIMITS)
        .replace("$EDGE_COMPARE", &edge_compare(14));
    [lean.as_str(), &SOFTMAX_SCORES[rest..]].concat()
}

/// The edge tiles' form of the forward's softmax ([`edge`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Edge {
    /// Every score scaled, its key's index computed and compared ([`SOFTMAX_SCORES`]).
    Scaled,
    /// Raw scores, each compared with a constant ([`LEAN_EDGE`]).
    Lean,
    /// [`Edge::Lean`] in 32-key chunks, those no row of a warp sees skipped (the
    /// warp-specialized kernel's [`super::hopper_ws`] `CHUNKED_EDGE`).
    Chunks,
}

/// The forward's edge tiles for `nc` consumer warpgroups: where there is no mask and the scale
/// is positive, in chunks with two consumers, scaled with three. Measured on the H100 with the
/// turns carried on across tiles: the chunked edge made the short causal head-size-64 row
/// (two consumers) 1.02–1.03× as fast, but the three-consumer kernels (head size 64, no mask
/// or long causal) 0.97–0.98× as fast, whose listing it lengthens for edges they meet rarely;
/// at head size 128 (two consumers) the chunked edge and the carried turns together ran
/// 1.02–1.04× as fast as neither (docs/performance.md).
/// `RUSTYTORCH_HOPPER_EDGE=scaled|lean|chunks` forces one form where it may be taken.
pub(super) fn edge(s: &Shape2, nc: usize) -> Edge {
    if scaled_first(s) {
        return Edge::Scaled;
    }
    match std::env::var("RUSTYTORCH_HOPPER_EDGE").as_deref() {
        Ok("scaled") => Edge::Scaled,
        Ok("lean") => Edge::Lean,
        Ok("chunks") => Edge::Chunks,
        _ if nc == 2 => Edge::Chunks,
        _ => Edge::Scaled,
    }
}

/// Whether every tile's scores are scaled before their maxima (`$SCALED`): where a mask adds
/// to them, or the scale is not positive (NaN included), for which the raw scores' maximum
/// times the scale is not the scaled scores' maximum.
fn scaled_first(s: &Shape2) -> bool {
    s.mask.is_some() || s.scale_log2.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater)
}

/// The output rows rescaled by `a0`, `a1` when a maximum moved.
pub(super) const RESCALE: &str = r#"        if (__any_sync(0xffffffffu, a0 != 1.f || a1 != 1.f)) {
          #pragma unroll
          for (int n = 0; n < $DV8; ++n) { o[n][0] *= a0; o[n][1] *= a0; o[n][2] *= a1; o[n][3] *= a1; }
        }
"#;

/// P = 2^(c·s − ref) into the A fragments `pa`, summed into the rows' sums.
const EXP_PACK: &str = r#"        // P = 2^(c·s − ref), summed per row and rounded into A fragments (8-key groups 2kk and
        // 2kk + 1 are the fragment of keys 16kk..16kk + 15).
        #pragma unroll
        for (int kk = 0; kk < $BC16; ++kk) {
          float p[8];
          #pragma unroll
          for (int h = 0; h < 2; ++h) {
            p[4 * h + 0] = ex2(fmaf(s[2 * kk + h][0], c, -r0));
            p[4 * h + 1] = ex2(fmaf(s[2 * kk + h][1], c, -r0));
            p[4 * h + 2] = ex2(fmaf(s[2 * kk + h][2], c, -r1));
            p[4 * h + 3] = ex2(fmaf(s[2 * kk + h][3], c, -r1));
          }
          l0 += (p[0] + p[1]) + (p[4] + p[5]);
          l1 += (p[2] + p[3]) + (p[6] + p[7]);
          pa[kk][0] = pack(p[0], p[1]);
          pa[kk][1] = pack(p[2], p[3]);
          pa[kk][2] = pack(p[4], p[5]);
          pa[kk][3] = pack(p[6], p[7]);
        }
"#;

/// The online softmax of score tile `t` in `s`: P into `pa`, the running maxima, sums and
/// output rescaled.
fn softmax() -> String {
    [SOFTMAX_SCORES, RESCALE, EXP_PACK].concat()
}

/// The C storing a warpgroup's 32-bit fragments, for `n` below `n8`, into the `rows`-row tile
/// at shared address `tile` as the tensor cores and bulk copies read it: 64-column blocks of
/// 128-byte rows, the 16-byte chunks of row r at chunk c ^ (r mod 8); a warp's rows r, r + 8
/// (which take `vals[0]` and `vals[1]`) have r mod 8 = g.
pub(super) fn swizzled_rows(tile: &str, rows: usize, n8: usize, vals: [&str; 2]) -> String {
    format!(
        r#"    #pragma unroll
    for (int n = 0; n < {n8}; ++n) {{
      const unsigned at = {tile} + (unsigned)((n >> 3) * {blk} + (warp * 16 + g) * 128 + (((n & 7) ^ g) << 4) + t4 * 4);
      asm volatile("st.shared.b32 [%0], %1;" :: "r"(at), "r"({lo}) : "memory");
      asm volatile("st.shared.b32 [%0], %1;" :: "r"(at + 1024u), "r"({hi}) : "memory");
    }}
"#,
        blk = rows * 128,
        lo = vals[0],
        hi = vals[1],
    )
}

/// The kernel's helpers after the flash kernels' own ([`super::helpers`]), after the thread
/// indices: the shared-memory matrix descriptor `rt_desc` ([`DESCRIPTOR`]) and `load` ([`LOAD`]).
pub(super) fn prelude() -> String {
    [descriptor(), LOAD].concat()
}

/// `rt_desc(addr, lbo)`, a shared-memory matrix descriptor.
pub(super) const DESCRIPTOR: &str = r#"// A shared-memory matrix descriptor: start address, leading byte offset, 1024 bytes between
// 8-row groups, 128-byte swizzle.
auto rt_desc = [](unsigned addr, unsigned lbo) -> unsigned long long {
  return (unsigned long long)((addr & 0x3FFFFu) >> 4) | ((unsigned long long)(lbo >> 4) << 16)
       | ((unsigned long long)(1024u >> 4) << 32) | (1ull << 62);
};
"#;

/// `rt_desc(addr, lbo, off)`, the shared-memory matrix descriptor of the tile at `addr + off`
/// ([`uniform_descriptors`]).
///
/// The start address field is `(addr >> 4) + (off >> 4)`, summed with the leading byte offset's
/// field in 32 bits rather than masked and or-ed in 64: shared addresses are below 2^18 and
/// tiles 16-byte aligned, so the fields never carry into each other, and the descriptors of a
/// tile's steps (the same `addr`, constant `off`) share their base and each cost one integer
/// add, where masking each sum cost the consumers five or six instructions a `wgmma` (at head
/// size 64 a sixth of their instructions per key tile, in the assembler's listing).
pub(super) const DESCRIPTOR_UNIFORM: &str = r#"// A shared-memory matrix descriptor of the tile at addr + off: start address, leading byte
// offset, 1024 bytes between 8-row groups, 128-byte swizzle.
auto rt_desc = [](unsigned addr, unsigned lbo, unsigned off) -> unsigned long long {
  const unsigned lo = (addr >> 4) + ((lbo >> 4) << 16) + (off >> 4);
  return (unsigned long long)lo | ((unsigned long long)(1024u >> 4) << 32) | (1ull << 62);
};
"#;

/// Whether the Hopper kernels build their matrix descriptors as a base plus a constant per
/// step ([`DESCRIPTOR_UNIFORM`]) from values broadcast from lane 0 (`__shfl_sync`, which tells
/// the compiler they are warp-uniform, so that it computes the descriptors in uniform
/// registers): the default. It takes the head-size-64 forward's key-tile loop from 654 to 588
/// instructions in the assembler's listing and the backward's 4–6% shorter; measured on the
/// H200 the head-size-64 forward ran 1.03× as fast at S = 1024 without a mask and at S = 4096
/// causal, forward+backward gained at both head sizes, and on the H100 the head-size-128
/// forward ran 1.00–1.015× as fast (docs/performance.md). `RUSTYTORCH_HOPPER_DESC=full`
/// computes each `wgmma`'s descriptors in full ([`DESCRIPTOR`]).
pub(super) fn uniform_descriptors() -> bool {
    std::env::var("RUSTYTORCH_HOPPER_DESC").as_deref() != Ok("full")
}

/// The descriptor helper the products call ([`uniform_descriptors`]).
pub(super) fn descriptor() -> &'static str {
    if uniform_descriptors() {
        DESCRIPTOR_UNIFORM
    } else {
        DESCRIPTOR
    }
}

/// The C of the warp-uniform value `expr`: with [`uniform_descriptors`] broadcast from lane 0
/// (`__shfl_sync`, which tells the compiler it is warp-uniform, so that the descriptors derived
/// from it are computed in uniform registers), else `expr` itself.
pub(super) fn warp_uniform(expr: &str) -> String {
    if uniform_descriptors() {
        format!("__shfl_sync(0xffffffffu, {expr}, 0)")
    } else {
        expr.to_string()
    }
}

/// The C of the descriptor of the tile at `addr + off` with leading byte offset `lbo`, in the
/// form [`descriptor`] defines.
pub(super) fn desc_call(addr: &str, lbo: usize, off: usize) -> String {
    if uniform_descriptors() {
        format!("rt_desc({addr}, {lbo}u, {off}u)")
    } else {
        format!("rt_desc({addr} + {off}u, {lbo}u)")
    }
}

/// `load`: a swizzled tile by `cp.async`, `$THREADS` threads from `tid`.
pub(super) const LOAD: &str = r#"// Rows [first, first + rows) of a tensor of `limit` rows (`gstride` elements apart, `width`
// wide) into the swizzled tile at `dst`; rows at or past `limit` are zero-filled.
auto load = [&](const unsigned short* src, long long first, long long limit, int rows, int width, long long gstride, unsigned dst) {
  const int chunks = width / 8;
  for (int c = tid; c < rows * chunks; c += $THREADS) {
    const int r = c / chunks, c8 = c - r * chunks;
    const long long row = first + r;
    const bool in = row < limit;
    const unsigned short* from = src + (in ? row : 0LL) * gstride + c8 * 8;
    const unsigned to = dst + (unsigned)((c8 >> 3) * rows * 128 + r * 128 + (((c8 & 7) ^ (r & 7)) << 4));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(to), "l"(from), "r"(in ? 16 : 0) : "memory");
  }
};
"#;

/// `S = Q·Kᵀ` of the key tile at shared address `ks` (C, defined before) into `s`, issued and
/// committed, not waited for ([`kmajor_products`]). `rows` is the C expression of the
/// warpgroup's 64-row block in the query tile.
pub(super) fn s_issue(d: usize, br: usize, bc: usize, rows: &str) -> String {
    let mut out =
        String::from("        asm volatile(\"wgmma.fence.sync.aligned;\" ::: \"memory\");\n");
    out.push_str(&kmajor_products(
        ["RT_WGMMA_S0", "RT_WGMMA_S"],
        ("q_s", br, rows),
        ("ks", bc),
        d,
    ));
    out.push_str("        asm volatile(\"wgmma.commit_group.sync.aligned;\" ::: \"memory\");\n");
    out
}

/// The `wgmma`s of a product `A·Bᵀ` of two K-major swizzled tiles over `k` (the head dim), in
/// steps of 16 (`macs[0]` for the first, which overwrites, `macs[1]` for the others): step `kk`
/// lies in 64-column block kk / 4, at byte 32·(kk mod 4) of each 128-byte row (the hardware
/// applies the swizzle to the address, so advancing the start address inside the pattern walks
/// the K dim). `a` is the A tile's shared address (C), its rows per 64-column block and the C
/// expression of the warpgroup's 64-row block in it; `b` the B tile's address and rows.
pub(super) fn kmajor_products(
    macs: [&str; 2],
    (a, a_rows, rows): (&str, usize, &str),
    (b, b_rows): (&str, usize),
    k: usize,
) -> String {
    let mut out = String::new();
    for kk in 0..k / 16 {
        let (blk, off) = (kk / 4, (kk % 4) * 32);
        let qa = blk * a_rows * 128 + off;
        out.push_str(&format!(
            "        {mac}({}, {});\n",
            // The full form spells the A tile's offset before its warpgroup's rows, as the
            // kernels checked on the device do.
            if uniform_descriptors() {
                desc_call(&format!("{a} + (unsigned)({rows}) * 8192u"), 16, qa)
            } else {
                format!("rt_desc({a} + {qa}u + (unsigned)({rows}) * 8192u, 16u)")
            },
            desc_call(b, 16, blk * b_rows * 128 + off),
            mac = macs[usize::from(kk > 0)],
        ));
    }
    out
}

/// `O += P·V` of the value tile at shared address `vs` (C, defined before), `P` from the
/// registers `pa`, issued and committed, not waited for ([`register_products`]).
pub(super) fn pv_issue(bc: usize, dv: usize) -> String {
    pv_issue_with(bc, dv, false)
}

/// [`pv_issue`], with `sums` also the rows' sums of `P` into `lacc` on the tensor cores
/// (`RT_WGMMA_L`, one `m64n8k16` a 16-key step against a tile of ones at descriptor `ones_d`).
pub(super) fn pv_issue_with(bc: usize, dv: usize, sums: bool) -> String {
    let mut out = pin("pa", bc / 16, 'r');
    out.push_str(&pin("o", dv / 8, 'f'));
    if sums {
        out.push_str(&pin("lacc", 1, 'f'));
    }
    out.push_str("        asm volatile(\"wgmma.fence.sync.aligned;\" ::: \"memory\");\n");
    out.push_str(&register_products("RT_WGMMA_O", "pa", "vs", bc));
    if sums {
        for kk in 0..bc / 16 {
            out.push_str(&format!(
                "        RT_WGMMA_L(pa[{kk}][0], pa[{kk}][1], pa[{kk}][2], pa[{kk}][3], ones_d);\n"
            ));
        }
    }
    out.push_str("        asm volatile(\"wgmma.commit_group.sync.aligned;\" ::: \"memory\");\n");
    out
}

/// The `wgmma`s (macro `mac`) of a product `A·B`, A from the registers `pa[k / 16][4]` and B
/// the MN-major swizzled tile at shared address `b` (C) of `k` rows: over the rows in steps of
/// 16 (two 8-row groups, 2048 bytes), its 64-column blocks `k · 128` bytes apart.
pub(super) fn register_products(mac: &str, pa: &str, b: &str, k: usize) -> String {
    let mut out = String::new();
    for kk in 0..k / 16 {
        out.push_str(&format!(
            "        {mac}({pa}[{kk}][0], {pa}[{kk}][1], {pa}[{kk}][2], {pa}[{kk}][3], {});\n",
            desc_call(b, k * 128, kk * 16 * 128),
        ));
    }
    out
}

/// `wgmma.wait_group n`, then `arr[rows][4]` pinned after it.
pub(super) fn wait(n: u32, arr: &str, rows: usize) -> String {
    format!(
        "        asm volatile(\"wgmma.wait_group.sync.aligned {n};\" ::: \"memory\");\n{}",
        pin(arr, rows, if arr == "pa" { 'r' } else { 'f' })
    )
}

/// The bytes of keys and values that the blocks running at once should share through L2: a
/// third of the H200's 50 MiB, so that the heads of a section stay cached while they are read.
const L2_SHARE: usize = 16 << 20;

/// Heads per section of the tile order ([`ORDER`]): as many as `L2_SHARE` holds the keys and
/// values of, at least one (`RUSTYTORCH_HOPPER_SECTION_HEADS=N` sets it, for tests and
/// measurements).
fn section_heads(sp: &Spec) -> usize {
    let bh = sp.bsz * sp.heads;
    if let Some(n) = std::env::var("RUSTYTORCH_HOPPER_SECTION_HEADS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
    {
        return n.clamp(1, bh);
    }
    (L2_SHARE / (sp.sk * (sp.d + sp.dv) * 2).max(1)).clamp(1, bh)
}

/// The batch·head `bh` and the query tile `qt` of `tile` (C, at the loop's indent). Blocks are
/// launched in tile order, so the blocks running at once hold neighbouring tiles: the heads
/// are taken in sections of `$HS` whose keys and values fit in L2 together, and within a
/// section the heaviest query tiles (causal) of every head come first. Ordered by head
/// fastest over all heads instead, the blocks running at once read as many heads' keys and
/// values as there are SMs, L2 could not hold them, and every query tile read its keys and
/// values from memory again (68% of the H200's DRAM bandwidth at 412 TFLOP/s; this order took
/// it to 5.5%, docs/performance.md).
pub(super) const ORDER: &str = r#"    const long long sec = tile / ($HSLL * $QTLL);
    const long long r = tile - sec * ($HSLL * $QTLL);
    const long long hs = min($HSLL, $BHLL - sec * $HSLL);
    const long long bh = sec * $HSLL + r % hs;
    const int qt = (int)($QTLL - 1LL - r / hs);
"#;

/// The end of the key walk: each row's sum over its four lanes and its inverse (`inv0`,
/// `inv1`), before [`super::tail`]; a row that saw nothing is zero, a NaN row stays NaN.
pub(super) const ROW_SUMS: &str = r#"    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const float inv0 = l0 == 0.f ? 0.f : 1.f / l0, inv1 = l1 == 0.f ? 0.f : 1.f / l1;
"#;

/// The names both Hopper kernels share, replaced in this order (longer names first, so that
/// no name is a prefix of one replaced before it; the blocks before the names they hold).
pub(super) fn common_subs(
    s: &Shape2,
    sp: &Spec,
    br: usize,
    bc: usize,
    loaders: u32,
    blocks: usize,
) -> Vec<(&'static str, String)> {
    let (sq, sk, d, dv) = (s.sq, s.sk, s.d, s.dv);
    vec![
        ("$ORDER", ORDER.to_string()),
        ("$ROW_SUMS", ROW_SUMS.to_string()),
        ("$PRELUDE", super::helpers() + &prelude()),
        ("$HS", section_heads(sp).to_string()),
        ("$WGMMA", wgmma_macros(s.elem, bc, dv)),
        ("$QBYTES", (br * d * 2).to_string()),
        ("$KBYTES", (bc * d * 2).to_string()),
        ("$VBYTES", (bc * dv * 2).to_string()),
        ("$THREADS", loaders.to_string()),
        ("$TILES", blocks.to_string()),
        ("$SCALED", scaled_first(s).to_string()),
        ("$SCALE", format!("{:?}", s.scale_log2 as f32)),
        ("$MASK", s.mask.clone().unwrap_or_default()),
        ("$TAIL", tail(s)),
        ("$LIM", limit(s.causal, sq, sk)),
        ("$QRS", s.strides[0].to_string()),
        ("$KRS", s.strides[1].to_string()),
        ("$VRS", s.strides[2].to_string()),
        ("$DV8", (dv / 8).to_string()),
        ("$BC16", (bc / 16).to_string()),
        ("$BC8", (bc / 8).to_string()),
        ("$QH", s.heads[0].clone()),
        ("$KH", s.heads[1].clone()),
        ("$VH", s.heads[2].clone()),
        ("$BH", (sp.bsz * sp.heads).to_string()),
        ("$QT", sq.div_ceil(br).to_string()),
        ("$SQ", sq.to_string()),
        ("$SK", sk.to_string()),
        ("$DV", dv.to_string()),
        ("$BR", br.to_string()),
        ("$BC", bc.to_string()),
        ("$D", d.to_string()),
        ("$E", s.elem.to_string()),
    ]
}

/// `body` with `first`, then `common`, replaced in order.
pub(super) fn substitute(
    body: &str,
    first: Vec<(&'static str, String)>,
    common: Vec<(&'static str, String)>,
) -> String {
    let mut out = body.to_string();
    for (k, v) in first.into_iter().chain(common) {
        out = out.replace(k, &v);
    }
    out
}

/// The kernel body (see the module docs); `stats` writes the backward's statistics (with `dO`
/// as the fourth tensor of `s.heads`) instead of the output.
fn source(s: &Shape2, sp: &Spec, t: Tile) -> String {
    let (br, bc) = (t.br(), t.bc);
    let mut s_gemm =
        String::from("        const unsigned ks = k_s0 + (unsigned)(t & 1) * $KBYTESu;\n");
    s_gemm.push_str(&s_issue(s.d, br, bc, "wg"));
    s_gemm.push_str(&wait(0, "s", bc / 8));
    let mut pv = String::from("        const unsigned vs = v_s0 + (unsigned)(t % 3) * $VBYTESu;\n");
    pv.push_str(&pv_issue(bc, s.dv));
    pv.push_str(&wait(0, "o", s.dv / 8));
    let body = r#"// Flash attention forward for sm_90a: $NWG warpgroups of 64 query rows, key tiles of $BC, wgmma ($E).
#define RT_NEG_INF __int_as_float(0xff800000)
#define RT_LOG2E 1.4426950408889634f
$WGMMAextern __shared__ __align__(1024) unsigned char rt_smem[];
// The tiles, each a set of 64-column blocks of 128-byte rows, 128-byte swizzled: the query
// tile, then two key tiles, then three value tiles.
const unsigned q_s = ((unsigned)__cvta_generic_to_shared(rt_smem) + 1023u) & ~1023u;
const unsigned k_s0 = q_s + $QBYTESu;
const unsigned v_s0 = k_s0 + 2u * $KBYTESu;
const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
const int g = lane >> 2, t4 = lane & 3;
$PRELUDEfor (long long tile = blockIdx.x; tile < $TILESLL; tile += gridDim.x) {
$ORDER  const int i0 = qt * $BR + wg * 64 + warp * 16 + g, i1 = i0 + 8;
  const unsigned short* qp = (const unsigned short*)q + $QH;
  const unsigned short* kp = (const unsigned short*)k + $KH;
  const unsigned short* vp = (const unsigned short*)v + $VH;
  const int lim0 = lim_of(i0), lim1 = lim_of(i1);
  const int lim_first = lim_of(qt * $BR);
  const int kend = lim_of(min(qt * $BR + $BR - 1, $SQ - 1));
  const int ntiles = (kend + $BC - 1) / $BC;
  load(qp, (long long)qt * $BR, $SQLL, $BR, $D, $QRSLL, q_s);
  if (ntiles > 0) {
    load(kp, 0LL, $SKLL, $BC, $D, $KRSLL, k_s0);
    load(vp, 0LL, $SKLL, $BC, $DV, $VRSLL, v_s0);
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
  float o[$DV8][4];
  #pragma unroll
  for (int n = 0; n < $DV8; ++n) { o[n][0] = 0.f; o[n][1] = 0.f; o[n][2] = 0.f; o[n][3] = 0.f; }
  float m0 = RT_NEG_INF, m1 = RT_NEG_INF, l0 = 0.f, l1 = 0.f;
  // The scores (each tile's first MMA writes them) and P as A fragments.
  float s[$BC8][4];
  unsigned pa[$BC16][4];
  // Even warpgroups run tile j as S, softmax, P·V; odd ones run the softmax and P·V of tile
  // j - 1, then S of tile j: while one warpgroup exponentiates, the other keeps the tensor
  // cores busy. Key tiles take two buffers (tile j is read in step j only), value tiles three
  // (tile j is read in steps j and j + 1).
  for (int j = 0; j <= ntiles; ++j) {
    // Tiles j have landed (each thread's copies, then made visible to the tensor cores); after
    // the barrier no warpgroup reads the buffers that tiles j + 1 take.
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    if (j + 1 < ntiles) {
      load(kp, (long long)(j + 1) * $BC, $SKLL, $BC, $D, $KRSLL, k_s0 + (unsigned)((j + 1) & 1) * $KBYTESu);
      load(vp, (long long)(j + 1) * $BC, $SKLL, $BC, $DV, $VRSLL, v_s0 + (unsigned)((j + 1) % 3) * $VBYTESu);
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
    if ((wg & 1) == 0) {
      if (j < ntiles) {
        const int t = j;
$S_GEMM$SOFTMAX$PV      }
    } else {
      if (j > 0) {
        const int t = j - 1;
$SOFTMAX$PV      }
      if (j < ntiles) {
        const int t = j;
$S_GEMM      }
    }
  }
$ROW_SUMS$TAIL
  // No copy may still be writing the tiles when the next query tile starts.
  asm volatile("cp.async.wait_group 0;" ::: "memory");
  __syncthreads();
}"#;
    let first = vec![
        ("$S_GEMM", s_gemm),
        (
            "$SOFTMAX",
            softmax().replace("$ROW_MAXIMA", &row_maxima("$BC8", "        ")),
        ),
        ("$PV", pv),
        ("$NWG", t.wg.to_string()),
    ];
    substitute(
        body,
        first,
        common_subs(s, sp, br, bc, t.threads(), tiles(sp, t)),
    )
}

#[cfg(test)]
mod tests {
    /// The two descriptor helpers' arithmetic in Rust (as their C spells it): the uniform one
    /// gives the full one's descriptor for every 16-byte-aligned tile and step offset whose sum
    /// stays below the 2^18 bytes of the shared window, at every leading byte offset the
    /// products use; and both helpers' C still spells that arithmetic.
    #[test]
    fn uniform_descriptors_match_the_full_ones() {
        let full = |addr: u32, lbo: u32| -> u64 {
            (((addr & 0x3FFFF) >> 4) as u64)
                | (((lbo >> 4) as u64) << 16)
                | ((1024u64 >> 4) << 32)
                | (1u64 << 62)
        };
        let uniform = |addr: u32, lbo: u32, off: u32| -> u64 {
            let lo = (addr >> 4)
                .wrapping_add((lbo >> 4) << 16)
                .wrapping_add(off >> 4);
            lo as u64 | ((1024u64 >> 4) << 32) | (1u64 << 62)
        };
        for lbo in [16u32, 8192, 16384, 32768] {
            for off in [0u32, 32, 96, 2048, 16384, 16480, 30720] {
                for addr in (0..(1u32 << 18)).step_by(16) {
                    if addr + off < 1 << 18 {
                        assert_eq!(uniform(addr, lbo, off), full(addr + off, lbo));
                    }
                }
            }
        }
        assert!(super::DESCRIPTOR.contains("((addr & 0x3FFFFu) >> 4)"));
        assert!(super::DESCRIPTOR_UNIFORM
            .contains("const unsigned lo = (addr >> 4) + ((lbo >> 4) << 16) + (off >> 4);"));
    }

    /// [`super::ORDER`] in Rust: the (batch·head, query tile) of `tile`.
    fn order(tile: i64, hs: i64, qt: i64, bh: i64) -> (i64, i64) {
        let sec = tile / (hs * qt);
        let r = tile - sec * (hs * qt);
        let n = hs.min(bh - sec * hs);
        (sec * hs + r % n, qt - 1 - r / n)
    }

    /// Every (head, query tile) is visited once, whether or not the last section is full, and
    /// within a section the query tiles run from the last (the heaviest under a causal mask).
    #[test]
    fn tile_order_covers_every_tile_once() {
        assert!(super::ORDER.contains("const long long hs = min($HSLL, $BHLL - sec * $HSLL);"));
        for bh in [1i64, 5, 6, 96, 128] {
            for hs in [1i64, 4, 8, 64, 200] {
                let hs = hs.min(bh);
                for qt in [1i64, 3, 8] {
                    let mut seen = vec![false; (bh * qt) as usize];
                    let mut last = (-1i64, i64::MAX);
                    for tile in 0..bh * qt {
                        let (h, q) = order(tile, hs, qt, bh);
                        assert!((0..bh).contains(&h) && (0..qt).contains(&q));
                        let i = (h * qt + q) as usize;
                        assert!(!seen[i], "bh {bh} hs {hs} qt {qt}: tile {tile} repeats");
                        seen[i] = true;
                        let sec = h / hs;
                        if sec == last.0 {
                            assert!(q <= last.1, "heaviest first within a section");
                        }
                        last = (sec, q);
                    }
                    assert!(seen.iter().all(|&s| s));
                }
            }
        }
    }

    /// The rewritten loop visits every tile once over the blocks of any grid, each block's
    /// rounds alternating direction, and leaves the rest of the source alone.
    #[test]
    fn snake_walk_visits_every_tile_once() {
        let src = "a\n  for (long long tile = blockIdx.x; tile < $TILESLL; tile += gridDim.x) {\nbody\n}\nfor (long long tile = blockIdx.x; tile < 12LL; tile += gridDim.x) {x}";
        let out = super::snake(src);
        assert_eq!(
            out.matches("round_ * (long long)gridDim.x < $TILESLL")
                .count(),
            1
        );
        assert_eq!(out.matches("if (tile >= 12LL) continue;").count(), 1);
        assert!(out.starts_with("a\n  for (long long round_") && out.contains("\nbody\n}\n"));
        assert!(!out.contains("tile += gridDim.x"));
        // The loop in Rust.
        for tiles in [1u64, 5, 131, 132, 133, 2048] {
            for g in [1u64, 3, 132] {
                let mut seen = vec![0u32; tiles as usize];
                for b in 0..g {
                    let mut r = 0;
                    while r * g < tiles {
                        let t = r * g + if r & 1 == 1 { g - 1 - b } else { b };
                        if t < tiles {
                            seen[t as usize] += 1;
                        }
                        r += 1;
                    }
                }
                assert!(seen.iter().all(|&c| c == 1), "tiles {tiles} grid {g}");
            }
        }
    }

    /// `tiles` one block a tile; `sms` caps the grid at the blocks the device holds at once,
    /// `N` at N; the grid never exceeds the tiles, and a bad value falls back to one block a
    /// tile.
    #[test]
    fn grids_cap_as_asked() {
        use super::grid_of;
        assert_eq!(grid_of("tiles", 2048, 1, 132), 2048);
        assert_eq!(grid_of("sms", 2048, 1, 132), 132);
        assert_eq!(grid_of("sms", 2048, 2, 114), 228);
        assert_eq!(grid_of("sms", 40, 1, 132), 40);
        assert_eq!(grid_of("3", 40, 1, 132), 3);
        assert_eq!(grid_of("0", 40, 1, 132), 40);
        assert_eq!(grid_of("many", 40, 1, 132), 40);
    }
}
