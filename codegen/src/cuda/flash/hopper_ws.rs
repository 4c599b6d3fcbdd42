//! The warp-specialized flash attention forward for Hopper: one producer warpgroup copies the
//! tiles, two consumer warpgroups of 64 query rows compute on them (three at head size 64 but
//! on short causal rows), the two sides handing buffers over through shared-memory barriers
//! (`mbarrier`) instead of block-wide barriers.
//!
//! # The kernel
//!
//! - **Roles and registers.** Warpgroup 0 is the producer; it gives registers back
//!   (`setmaxnreg.dec`) and the consumers take them (`setmaxnreg.inc`), so the consumers hold
//!   the scores, `P` and the output of a 64 × 128 tile in registers without spilling.
//! - **The producer** walks the same query tiles as the consumers and copies, in the order the
//!   consumers read them, the query tile, key tile 0, then key tile `j` and value tile `j − 1`
//!   for each `j`, then the last value tile, into two key and two value buffers and one query
//!   buffer (two with three consumers and tiles taken at run time, [`query_stages`]; `cp.async`,
//!   rows past the end zero-filled). Before it writes a buffer it waits on that buffer's *empty*
//!   barrier; `cp.async.mbarrier.arrive.noinc` makes the buffer's *full* barrier complete when
//!   the copies have landed. With one query buffer the next query tile's copies start as soon
//!   as the consumers' last `Q·Kᵀ` of the current one is done; with two, as soon as the
//!   producer has handed out the current tile's last copies.
//! - **Bulk tensor copies** (the default; `RUSTYTORCH_HOPPER_TMA=0` turns them off): instead of
//!   its 128 threads' 16-byte `cp.async`s, one producer thread moves each tile with the tensor
//!   memory accelerator (`cp.async.bulk.tensor.4d`, one copy per 64-column block, swizzled by
//!   the copy itself), reading q, k and v through tensor maps that the runtime encodes at
//!   launch over the operands' addresses (`[B, H, S, D]` views of each layout, so rows past a
//!   head's end arrive as zeros); the full barriers then count one arrival, which announces the
//!   tile's bytes. The producer's 128 threads issuing address arithmetic and 16-byte copies
//!   were what held the consumers back: the bulk copies make the forward 1.1–1.5× faster.
//! - **A consumer** waits on a buffer's full barrier (then a proxy fence makes the copied bytes
//!   visible to the tensor cores), and once the matrix product that read it is complete, one
//!   lane a warp arrives on its empty barrier. Within a consumer, `S_j = Q·K_jᵀ` and
//!   `O += P_{j−1}·V_{j−1}` are issued together; the softmax of `S_j` runs while `P·V` is on the
//!   tensor cores (its exponentials kept in the score registers until `P·V` has read the previous
//!   `P`), then the output is rescaled and `P_j` packed.
//! - **Ping-pong.** The consumers take turns issuing their matrix products (named barriers
//!   `1 + c`, each consumer releasing the next), so that one warpgroup's softmax overlaps the
//!   other's products. Per query tile each consumer issues `n + 1` times for `n` key tiles; the
//!   last consumer opens the first turn and does not pass on its last, so every named barrier
//!   ends each tile with its arrivals matched. `RUSTYTORCH_HOPPER_PINGPONG=0` turns the turns
//!   off, for measurements.
//! - **Tiles taken at run time** (head size 64): a block's producer takes its next tile
//!   from a counter in global memory and publishes it to the consumers in shared memory with
//!   the query tile's full barrier, so the SMs share tiles of unequal cost as they free up
//!   ([`QUEUE_LOOP`]); at head size 128 each block walks a fixed share of them.
//! - **Skipped tiles.** Wherever that saves any products with tiles taken at run time, else
//!   where it saves a fifth of them or more ([`skipped_share`]),
//!   a consumer computes only the key tiles its own 64 rows see (`mine`):
//!   past them — the causal diagonal's last tile for the block's first consumers, everything
//!   for consumers whose rows lie past the query length — it still waits on the full
//!   barriers, takes and passes its turns and frees the buffers, so the producer's walk and
//!   the barriers' phases are the same for every consumer, but it issues no product. Its
//!   `lim_first` (below which no tile needs the mask) is its own first row's too.
//!
//! - **Running on from tile to tile** (a variable, [`fused_tiles`]): a consumer issues a tile's
//!   last `P·V` in the same turn as the next tile's first `Q·Kᵀ` and writes the tile's output
//!   after the next tile's first softmax ([`WALK_FUSED`]).
//!
//! The products (descriptors, swizzle, `wgmma` shapes), the softmax (masks, causal limits,
//! maxima, rescaling) and the end of the kernel (the output or the backward's statistics) are
//! the two-warpgroup kernel's ([`super::hopper`]), shared with it.

use super::hopper::{
    common_subs, edge, pin, pv_issue_with, s_issue, softmax_scores, substitute, swizzled_rows,
    wait, warp_uniform, wgmma_macro, Built, Edge, OperandA, RESCALE,
};
use super::{row_maxima, Shape2, Spec};
use rustytorch_ops::Causal;

/// The C helpers of shared-memory barriers: `mb_init(bar, count)`, `mb_arrive(bar)` and
/// `mb_wait(bar, parity)`.
pub(super) const MBARRIERS: &str = r#"auto mb_init = [](unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
};
auto mb_arrive = [](unsigned bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
};
// Waits until the phase of parity `parity` of the barrier has completed.
auto mb_wait = [](unsigned bar, unsigned parity) {
  unsigned done;
  do {
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  } while (!done);
};
"#;

/// The C helpers of bulk tensor copies: `mb_expect(bar, bytes)` (an arrival that also expects
/// `bytes` to land) and `tma_tile(map, dst, bar, row, blocks, rows, h, b)`, which copies rows
/// `row..row + rows` of head `h` of batch `b` through the tensor map into the swizzled tile at
/// `dst`, one copy per 64-column block (`blocks` of them, `rows · 128` bytes apart), each
/// completing its bytes on `bar`.
pub(super) const BULK_COPIES: &str = r#"auto mb_expect = [](unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
};
auto tma_tile = [](const RtTensorMap* map, unsigned dst, unsigned bar, int row, int blocks, int rows, int h, int b) {
  for (int c = 0; c < blocks; ++c) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];"
                 :: "r"(dst + (unsigned)(c * rows * 128)), "l"((unsigned long long)map), "r"(c * 64), "r"(row), "r"(h), "r"(b), "r"(bar)
                 : "memory");
  }
};
"#;

/// The C helper of bulk tensor stores, [`BULK_COPIES`]'s reverse: `tma_store_tile(map, src,
/// row, blocks, rows, h, b)` copies the swizzled tile at `src` into rows `row..row + rows` of
/// head `h` of batch `b` through the tensor map (which drops rows past the tensor's end), one
/// bulk-group copy per 64-column block; the caller commits and waits for the group.
pub(super) const BULK_STORE: &str = r#"auto tma_store_tile = [](const RtTensorMap* map, unsigned src, int row, int blocks, int rows, int h, int b) {
  for (int c = 0; c < blocks; ++c) {
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%1, %2, %3, %4}], [%5];"
                 :: "l"((unsigned long long)map), "r"(c * 64), "r"(row), "r"(h), "r"(b), "r"(src + (unsigned)(c * rows * 128))
                 : "memory");
  }
};
"#;

/// Whether the producer copies the tiles with the tensor memory accelerator (one thread's bulk
/// tensor copies through tensor maps) instead of its 128 threads' `cp.async`s: by default with
/// two buffers (the kernels measured and checked on the device: 1.1–1.5× the `cp.async`
/// producer's speed), `RUSTYTORCH_HOPPER_TMA=0` never, `=1` also with the measurement knob's
/// three buffers.
fn bulk_copies(st: usize) -> bool {
    match std::env::var("RUSTYTORCH_HOPPER_TMA").as_deref() {
        Ok("0") => false,
        Ok("1") => true,
        _ => st == 2,
    }
}

/// Whether a block of `threads` (one block an SM, `__launch_bounds__(threads)`) can move
/// registers as `setmaxnreg` asks: `producer` threads down to `regs.0` a thread, the others up
/// to `regs.1`. The block holds `65536 / threads` registers a thread rounded down to 8 from
/// launch; `setmaxnreg.inc` waits until the pool has what it takes, so asking for more than
/// the decrease freed waits forever.
pub(super) fn registers_balance(threads: u32, producer: u32, regs: (u32, u32)) -> bool {
    let launch = (65536 / threads) / 8 * 8;
    let (p, c) = regs;
    p % 8 == 0
        && c % 8 == 0
        && p <= launch
        && c >= launch
        && c <= 256
        && producer * (launch - p) >= (threads - producer) * (c - launch)
}

/// Threads of the producer warpgroup, which also copies the tiles.
const PRODUCER: u32 = 128;

/// Consumer warpgroups (64 query rows each) per block: three at head size 64 (160 registers a
/// consumer thread; 1.0–1.15× the speed of two, measured with bulk tensor copies and
/// persistent grids, docs/performance.md), two at 128 (224 registers). Causal attention at
/// head size 64 over at most [`SHORT_CAUSAL`] query rows takes two as well: there the 192-row
/// tiles' diagonal is a large share of the work, and two consumers taking their tiles at run
/// time ran 1.03–1.04× as fast as three (S = 1024), where at S = 4096 three were 1.09× as
/// fast. `RUSTYTORCH_HOPPER_WS=2|3` asks for two or three at head size 64, for measurements.
fn consumers(sp: &Spec) -> usize {
    let small = sp.d.max(sp.dv) <= 64;
    match std::env::var("RUSTYTORCH_HOPPER_WS").as_deref() {
        Ok("2") => 2,
        Ok("3") if small => 3,
        _ if small && !(sp.causal != Causal::None && sp.sq <= SHORT_CAUSAL) => 3,
        _ => 2,
    }
}

/// The longest query at which causal attention at head size 64 takes two consumers (the
/// shortest measured where three were faster: 4096; between the two, unmeasured, three).
const SHORT_CAUSAL: usize = 1024;

/// The registers a thread of the producer and of a consumer holds after `setmaxnreg`: the
/// block's 64 Ki registers shared as the launch bound left them (168 a thread for 384 threads,
/// 128 for 512), the producer giving up what the consumers take.
fn registers(nc: usize) -> (u32, u32) {
    if nc == 2 {
        (56, 224)
    } else {
        (32, 160)
    }
}

/// Keys per tile: 128, or at head size 64 where `RUSTYTORCH_HOPPER_KEYS=176|192` asks
/// (fewer key tiles a query tile, so fewer barrier waits and softmax rounds a key; for
/// measurements). A consumer thread holds the tile's scores and its previous tile's P at
/// once, `3 · keys / 4` registers: 192 keys fit the 224 registers of two consumers, 176 the
/// 160 of three (which compile without spills, yet ran at 0.45–0.67× the speed of 128 on the
/// H100; 192 with two consumers at 0.93–1.03×).
fn keys(sp: &Spec, nc: usize) -> usize {
    let small = sp.d.max(sp.dv) <= 64;
    match std::env::var("RUSTYTORCH_HOPPER_KEYS").as_deref() {
        Ok("176") if small => 176,
        Ok("192") if small && nc == 2 => 192,
        _ => 128,
    }
}

/// Independent partial maxima and sums a row's reduction over a score tile keeps (1: one
/// chain of `bc / 4` dependent instructions a row, as measured; `RUSTYTORCH_HOPPER_CHAINS=2`
/// or `4` splits them, so that a consumer's softmax waits less on its own results, for
/// measurements).
fn chains() -> usize {
    match std::env::var("RUSTYTORCH_HOPPER_CHAINS").as_deref() {
        Ok("2") => 2,
        Ok("4") => 4,
        _ => 1,
    }
}

/// The declarations of the two rows' `k` partials `{name}{r}_{p}` (each `init`), and the
/// opening of the loop over the score fragments `s[n8][4]` by steps of `k`.
fn partials(name: &str, init: &str, n8: usize, k: usize) -> String {
    let mut c = String::new();
    for r in 0..2 {
        let parts: Vec<String> = (0..k).map(|p| format!("{name}{r}_{p} = {init}")).collect();
        c += &format!("        float {};\n", parts.join(", "));
    }
    c + &format!("        #pragma unroll\n        for (int n = 0; n < {n8}; n += {k}) {{\n")
}

/// The rows' maxima `mx0`, `mx1` over the score fragments `s[n8][4]` in `k` independent
/// chains (`n8` a multiple of `k`), then over the four lanes that share a row.
fn split_maxima(n8: usize, k: usize) -> String {
    let mut c = partials("mx", "RT_NEG_INF", n8, k);
    for p in 0..k {
        for (r, e) in [(0, 0), (1, 2)] {
            c += &format!(
                "          mx{r}_{p} = fmaxf(mx{r}_{p}, fmaxf(s[n + {p}][{e}], s[n + {p}][{}]));\n",
                e + 1
            );
        }
    }
    c += "        }\n";
    for r in 0..2 {
        c += &format!("        float mx{r} = {};\n", tree(r, "mx", k, "fmaxf"));
    }
    for r in 0..2 {
        for x in [1, 2] {
            c += &format!(
                "        mx{r} = fmaxf(mx{r}, __shfl_xor_sync(0xffffffffu, mx{r}, {x}));\n"
            );
        }
    }
    c
}

/// The exponentials in place, summed per row into `l0`, `l1` through `k` partial sums.
fn split_exps(n8: usize, k: usize) -> String {
    let mut c = partials("ls", "0.f", n8, k);
    for p in 0..k {
        for (e, r) in [(0, 0), (1, 0), (2, 1), (3, 1)] {
            c += &format!("          s[n + {p}][{e}] = ex2(fmaf(s[n + {p}][{e}], c, -r{r}));\n");
        }
        for (r, e) in [(0, 0), (1, 2)] {
            c += &format!(
                "          ls{r}_{p} += s[n + {p}][{e}] + s[n + {p}][{}];\n",
                e + 1
            );
        }
    }
    c += "        }\n";
    for r in 0..2 {
        c += &format!("        l{r} += {};\n", tree(r, "ls", k, "add"));
    }
    c
}

/// One exponential in `q` computed by a polynomial on the FMA pipes instead of the special
/// function unit (`RUSTYTORCH_HOPPER_EXP_POLY=2|3|4|8`; 0, the default, computes all of them
/// there). At head size 64 a 64 × 128 score tile's 8192 `ex2`s take the four SFU quadrants
/// (4 lanes a clock each) as long as its two products take the tensor cores, so the two can
/// only just overlap; moving a share to the FMA pipes (128 lanes a clock, about six FP32 and
/// three integer instructions an exponential, [`EX2_POLY`]) leaves the SFU slack. Measured on
/// the H100 it lost: the kernel's consumers are bound by issuing instructions (about 450 a
/// key tile each, three consumers a quadrant against the tensor cores' 1536 cycles), which the
/// polynomial adds to — one in 8 made the head-size-64 forwards 0.97–1.04× as fast, one in
/// 2 0.85–0.95× (docs/performance.md).
fn exp_poly() -> usize {
    match std::env::var("RUSTYTORCH_HOPPER_EXP_POLY").as_deref() {
        Ok("2") => 2,
        Ok("3") => 3,
        Ok("4") => 4,
        Ok("8") => 8,
        _ => 0,
    }
}

/// Whether the rows' sums of `P` come from the tensor cores instead of the FP32 pipes
/// (`RUSTYTORCH_HOPPER_ROWSUM=mma`): each 16-key step of `P·V` gets a `wgmma.m64n8k16` of the
/// same `P` fragments against a tile of ones, which accumulates the sums beside the output
/// (`lacc`, rescaled with it), so the consumers issue eight `wgmma`s a 128-key tile instead of
/// 64 adds and the final shuffles. The sums are then those of `P` as rounded for `P·V`, the
/// normalizer of exactly the weights the output summed. At head size 64 the consumers are
/// bound by issuing instructions ([`exp_poly`]), which this was to relieve: the compiler
/// drops all 64 adds, but measured on the H200 the forward ran 0.97–0.98× as fast (0.99× with
/// the uniform descriptors, 0.98× at head size 128), the narrow products costing the tensor
/// cores more than the adds cost the issue slots (docs/performance.md). Off by default.
fn mma_rowsums() -> bool {
    std::env::var("RUSTYTORCH_HOPPER_ROWSUM").as_deref() == Ok("mma")
}

/// Bytes of the tile of ones that [`mma_rowsums`]' products read (any layout reads ones), and
/// of the alignment before it.
const ONES_BYTES: usize = 512 + 128;

/// `ex2p(x)`, 2^x for `x <= 0` on the FMA pipes: `x` clamped to −127, split into `j = ⌊x⌋`
/// (the low bits of `x + 1.5·2^23` rounded down) and `f = x − j` in [0, 1), 2^f by a cubic
/// (minimax relative error 8.6e-5, below half a unit in the last place of f16 and bf16, the
/// types `P` is rounded to; p(0) = 1 exactly), and `j` added to its exponent field. −∞ (masked
/// scores) gives +0 exactly: f = 0, p = 1.0 = 127 << 23 and j = −127. `ex2s(poly, x)` picks
/// it or `ex2` (`poly` constant once the loops are unrolled).
const EX2_POLY: &str = r#"auto ex2p = [](float x) -> float {
  x = fmaxf(x, -127.f);
  float t; asm("add.rm.f32 %0, %1, 12582912.0;" : "=f"(t) : "f"(x));
  const float f = x - (t - 12582912.f);
  float p = fmaf(fmaf(fmaf(0.0770660192f, f, 0.227646112f), f, 0.69511652f), f, 1.f);
  return __int_as_float(__float_as_int(p) + (__float_as_int(t) << 23));
};
auto ex2s = [&](bool poly, float x) -> float { return poly ? ex2p(x) : ex2(x); };
"#;

/// `exps` (the exponentials' C over `chains` chains, each `s[IDX][e] = ex2(` with IDX `n`, or
/// `n + p` for chain `p` of several) with one in `q` of them through [`EX2_POLY`], chosen by
/// `IDX · 4 + e`.
fn poly_exps(exps: &str, q: usize, chains: usize) -> String {
    let idx: Vec<String> = if chains == 1 {
        vec!["n".into()]
    } else {
        (0..chains).map(|p| format!("n + {p}")).collect()
    };
    let mut c = exps.to_string();
    for i in &idx {
        for e in 0..4 {
            c = c.replace(
                &format!("s[{i}][{e}] = ex2("),
                &format!("s[{i}][{e}] = ex2s((({i}) * 4 + {e}) % {q} == {}, ", q - 1),
            );
        }
    }
    c
}

/// The C combining partials `{name}{r}_0..k` pairwise (`op` `fmaxf` or `add`).
fn tree(r: usize, name: &str, k: usize, op: &str) -> String {
    let mut terms: Vec<String> = (0..k).map(|p| format!("{name}{r}_{p}")).collect();
    while terms.len() > 1 {
        terms = terms
            .chunks(2)
            .map(|t| match (t, op) {
                ([a, b], "fmaxf") => format!("fmaxf({a}, {b})"),
                ([a, b], _) => format!("({a} + {b})"),
                ([a], _) => a.clone(),
                _ => unreachable!("chunks of two"),
            })
            .collect();
    }
    terms.remove(0)
}

/// Key and value buffers (each): two, or three where `RUSTYTORCH_HOPPER_WS_STAGES=3` asks
/// (for measurements).
fn stages() -> usize {
    match std::env::var("RUSTYTORCH_HOPPER_WS_STAGES").as_deref() {
        Ok("3") => 3,
        _ => 2,
    }
}

/// Query-tile buffers: two where the blocks take their tiles at run time ([`queued`]) with three
/// consumers, so that the producer copies a block's next query tile while the consumers still
/// multiply by the current one; one otherwise. With one buffer the next tile's query and first
/// key copies wait until every consumer's last `Q·Kᵀ` of the current tile is done. Measured on
/// the H100 (docs/performance.md): two buffers made the three-consumer full row (S = 1024, head
/// size 64) 1.04–1.05× as fast and left the long causal one level, but made the two-consumer
/// short causal row 0.97–0.98× as fast, whose consumers start a tile's products no sooner for
/// it. `RUSTYTORCH_HOPPER_QSTAGES=1|2` asks for one or two (two only with tiles taken at run
/// time).
fn query_stages(queued: bool, nc: usize) -> usize {
    match std::env::var("RUSTYTORCH_HOPPER_QSTAGES").as_deref() {
        Ok("1") => 1,
        Ok("2") if queued => 2,
        _ if queued && nc == 3 => 2,
        _ => 1,
    }
}

/// Whether a consumer runs on from one query tile into the next ([`WALK_FUSED`]): its last
/// `P·V` of a tile is issued in the same turn as the next tile's first `Q·Kᵀ`, the next tile's
/// first softmax runs while that `P·V` is on the tensor cores, and the tile's output is
/// written after it. Split, a tile's first turn issues `Q·Kᵀ` alone and its last `P·V` alone,
/// and a consumer's softmax of the first key tile and its output overlap nothing of its own;
/// on short causal rows (one to eight key tiles a query tile) those two turns are a large share
/// of a tile. It takes tiles handed out at run time with two query-tile buffers, carried turns,
/// bulk output stores and no statistics, and skips no tiles; `RUSTYTORCH_HOPPER_FUSE=1` asks
/// for it (for measurements).
fn fused_tiles() -> bool {
    std::env::var("RUSTYTORCH_HOPPER_FUSE").as_deref() == Ok("1")
}

/// The consumer's walk over a query tile's key tiles where it runs on from tile to tile
/// ([`fused_tiles`]): a tile whose predecessor is still pending (its last `P·V` not yet issued)
/// starts with `$FUSED`, which issues that `P·V` beside its own first `Q·Kᵀ` and writes the
/// predecessor's output; its own last `P·V` and output wait for the next tile (or, before a
/// tile without keys and at the end, for the pending tile finished on its own).
const WALK_FUSED: &str = r#"      if (pending) {
$FUSED      } else {
$ZERO_O$FIRST      }
      for (int j = 1; j < ntiles; ++j) {
$STEP      }
$INVERSES      bh_p = bh;
      qt_p = qt;
      pending = true;
"#;

/// The state a consumer carries from tile to tile where it runs on ([`WALK_FUSED`]): the
/// output and `P` of the pending tile, its rows' inverse sums, its head and query tile.
const FUSED_STATE: &str = r#"  float o[$DV8][4];
  unsigned pa[$BC16][4];
  float inv0 = 0.f, inv1 = 0.f;
  long long bh_p = 0;
  int qt_p = 0;
  bool pending = false;
"#;

/// Whether the blocks take their tiles from a counter at run time, each the next free one as
/// its last is done (the producer fetching and publishing them, [`QUEUE_LOOP`]), instead of
/// walking a fixed share of them: by default at head size 64 with bulk tensor copies, where
/// the tiles differ in cost (the causal diagonal, consumers skipping rows past the end) and
/// now even out over the SMs as they would one block a tile, while the producer still copies
/// a block's next tile during its current one. With the skipping walk it made the
/// head-size-64 forwards 1.04–1.06× as fast on the H100 (two consumers on short causal rows
/// 1.2× as fast as their fixed walk); at head size 128, whose tiles cost alike, it lost
/// 0.5–2%, and 4% against one block a tile on causal rows (docs/performance.md).
/// `RUSTYTORCH_HOPPER_QUEUE=0|1`: never, always (with bulk tensor copies).
fn queued(sp: &Spec) -> bool {
    match std::env::var("RUSTYTORCH_HOPPER_QUEUE").as_deref() {
        Ok("0") => false,
        Ok("1") => true,
        _ => sp.d.max(sp.dv) <= 64,
    }
}

/// Whether a consumer skips the key tiles its own rows do not see ([`skipped_share`]):
/// wherever there are any when the blocks take their tiles at run time ([`queued`]), else
/// where they are at least a fifth of the block's products. The skipping walk costs its
/// branches and turns, and a block walking a fixed share of the tiles ends no sooner for
/// holding a cheaper one: there, on the H100, it ran 1.05–1.09× as fast where it saved a
/// quarter (causal, S = 1024, head size 64), 0.98–1.0× where it saved a ninth (full,
/// S = 1024) and 0.95–0.97× where a twelfth (causal, S = 4096); with the tiles taken at run
/// time it saved 4% and 6% of those last two (docs/performance.md).
/// `RUSTYTORCH_HOPPER_SKIP=0` never skips, `=1` wherever any tile can be skipped.
fn skips(sp: &Spec, br: usize, bc: usize, queued: bool) -> bool {
    let share = skipped_share(sp, br, bc);
    match std::env::var("RUSTYTORCH_HOPPER_SKIP").as_deref() {
        Ok("0") => false,
        Ok("1") => share > 0.0,
        _ if queued => share > 0.0,
        _ => share >= 0.2,
    }
}

/// The keys query row `i` sees under `causal` with `sq` queries and `sk` keys (the kernel's
/// `lim_of`).
fn keys_seen(causal: Causal, sq: usize, sk: usize, i: usize) -> usize {
    match causal {
        Causal::None => sk,
        Causal::TopLeft => (i + 1).min(sk),
        Causal::BottomRight => (i as i64 + 1 + sk as i64 - sq as i64).clamp(0, sk as i64) as usize,
    }
}

/// The share of a block's consumer products (64 query rows of its `br` against a key tile of
/// `bc`) on key tiles that the consumer's own rows do not see: with three consumers and key
/// tiles of 128, the causal diagonal's tiles of the block's first consumers (a quarter at
/// S = 1024, a twelfth at 4096), and consumers whose rows all lie past a query length not a
/// multiple of `br` (a ninth of the full products at S = 1024).
pub(super) fn skipped_share(sp: &Spec, br: usize, bc: usize) -> f64 {
    // The keys row `i` sees (the kernel's `lim_of`).
    let lim = |i: usize| keys_seen(sp.causal, sp.sq, sp.sk, i);
    let (mut all, mut skipped) = (0usize, 0usize);
    for qt in 0..sp.sq.div_ceil(br) {
        let ntiles = lim((qt * br + br - 1).min(sp.sq - 1)).div_ceil(bc);
        for cw in 0..br / 64 {
            let row = qt * br + cw * 64;
            let mine = if row >= sp.sq {
                0
            } else {
                lim((row + 63).min(sp.sq - 1)).div_ceil(bc)
            };
            all += ntiles;
            skipped += ntiles - mine;
        }
    }
    if all == 0 {
        0.0
    } else {
        skipped as f64 / all as f64
    }
}

/// A consumer's softmax of a score tile (the scores, maxima, references, rescaling factors and
/// exponentials of [`super::hopper::SOFTMAX_SCORES`] and the walk's exponentials) whose edge
/// tiles, where there is no mask and the scale is positive, work in chunks of 32 keys
/// (`$NCH` a tile): a warp computes only the chunks its last row sees (none for rows past
/// the end), compares its keys there with each row's limit (relative to the lane's first key,
/// as the lean edge does) and leaves the others' probabilities zero. On the causal diagonal
/// at head size 64 with two consumers of 64 rows and key tiles of 128 the warps need 4 to 16
/// of the tile's 16 eight-key groups (in chunks of four), 10 on average, so the diagonal's
/// softmax costs about five eighths of its instructions; off the edges the tile's softmax is
/// the plain one, branch-free.
pub(super) const CHUNKED_EDGE: &str = r#"        const int kb = t * $BC;
        const float c = $SCALEf;
        const bool edge = kb + $BC > lim_first;
        int nch = $NCH;
        float mx0 = RT_NEG_INF, mx1 = RT_NEG_INF;
        if (edge) {
          // The chunks the warp's last row sees (its rows' limits grow with the row).
          const int wrow = i0 - g;
          const int wlim = wrow >= $SQ ? 0 : lim_of(min(wrow + 15, $SQ - 1));
          nch = __shfl_sync(0xffffffffu, min(max(wlim - kb + 31, 0) / 32, $NCH), 0);
$EDGE_LIMITS          #pragma unroll
          for (int ch = 0; ch < $NCH; ++ch) {
            if (ch < nch) {
              #pragma unroll
              for (int n = 4 * ch; n < 4 * ch + 4; ++n) {
                #pragma unroll
                for (int e = 0; e < 4; ++e) {
$EDGE_COMPARE                }
                mx0 = fmaxf(mx0, fmaxf(s[n][0], s[n][1]));
                mx1 = fmaxf(mx1, fmaxf(s[n][2], s[n][3]));
              }
            }
          }
        } else {
          #pragma unroll
          for (int n = 0; n < $BC8; ++n) {
            mx0 = fmaxf(mx0, fmaxf(s[n][0], s[n][1]));
            mx1 = fmaxf(mx1, fmaxf(s[n][2], s[n][3]));
          }
        }
$REFERENCES        if (edge) {
          #pragma unroll
          for (int ch = 0; ch < $NCH; ++ch) {
            if (ch < nch) {
              #pragma unroll
              for (int n = 4 * ch; n < 4 * ch + 4; ++n) {
$EXP_ROWS              }
            } else {
              #pragma unroll
              for (int n = 4 * ch; n < 4 * ch + 4; ++n) {
                s[n][0] = 0.f; s[n][1] = 0.f; s[n][2] = 0.f; s[n][3] = 0.f;
              }
            }
          }
        } else {
$EXPS        }
"#;

/// [`CHUNKED_EDGE`] for key tiles of `bc`, the plain walk's exponentials `exps` off the edges:
/// the rows' maxima reduced over their lanes ([`row_maxima`]'s shuffles) and the references,
/// rescaling factors and sums after them ([`super::hopper::SOFTMAX_SCORES`]'s) as every edge
/// form takes them.
fn chunked_edge(bc: usize, exps: &str) -> String {
    let maxima = row_maxima("$BC8", "        ");
    let shuffles = &maxima[maxima
        .find("        mx0 = fmaxf(mx0, __shfl")
        .expect("shuffles")..];
    let refs = super::hopper::SOFTMAX_SCORES;
    let refs = &refs[refs.find("        const float mn0").expect("references")..];
    CHUNKED_EDGE
        .replace("$REFERENCES", &[shuffles, refs].concat())
        .replace("$EDGE_LIMITS", super::hopper::EDGE_LIMITS)
        .replace("$EDGE_COMPARE", &super::hopper::edge_compare(18))
        .replace("$NCH", &(bc / 32).to_string())
        .replace("$EXP_ROWS", &exp_rows(16))
        .replace("$EXPS", exps)
}

/// The C of the exponentials of the scores of 8-key group `n` in place, summed into the rows'
/// sums, at `indent` spaces.
fn exp_rows(indent: usize) -> String {
    [
        "s[n][0] = ex2(fmaf(s[n][0], c, -r0));",
        "s[n][1] = ex2(fmaf(s[n][1], c, -r0));",
        "s[n][2] = ex2(fmaf(s[n][2], c, -r1));",
        "s[n][3] = ex2(fmaf(s[n][3], c, -r1));",
        "l0 += s[n][0] + s[n][1];",
        "l1 += s[n][2] + s[n][3];",
    ]
    .iter()
    .map(|l| format!("{:indent$}{l}\n", ""))
    .collect()
}

/// The C of a consumer's `lim_first` (the keys its first row sees: tiles below it need no
/// mask) and `mine` (the key tiles its rows see, none where they are past the end).
const MINE: &str = r#"    const int row_c = qt * $BR + cw * 64;
    const int lim_first = lim_of(row_c);
    const int mine = row_c >= $SQ ? 0 : (lim_of(min(row_c + 63, $SQ - 1)) + $BC - 1) / $BC;
"#;

/// The consumer's walk over a query tile's key tiles, with every consumer computing every
/// tile.
const WALK: &str = r#"      {
$FIRST      }
      for (int j = 1; j < ntiles; ++j) {
$STEP      }
      {
$LAST      }
"#;

/// The consumer's walk computing only its own key tiles (`mine`), then taking its turns and
/// freeing the buffers through the rest; its main loop is [`WALK`]'s.
const WALK_MINE: &str = r#"      if (mine > 0) {
$FIRST      } else {
$SKIP_FIRST      }
      int j = 1;
      for (; j < mine; ++j) {
$STEP      }
      if (mine == ntiles) {
$LAST      } else {
        if (mine > 0) {
$ENDING          ++j;
        }
        for (; j < ntiles; ++j) {
$SKIP_STEP        }
$SKIP_LAST      }
"#;

/// Whether the consumers write the output by bulk tensor copies out of a staging tile in
/// shared memory instead of each thread's 4-byte stores from the accumulator layout (8 rows ×
/// 16 bytes a warp instruction), as the backward's `dK` and `dV` are (with bulk tensor copies;
/// not the statistics kernel, which writes no output). The default: timed on the device, the
/// forward ran 1.03–1.07× as fast with it at every bench shape but decoding, which has its own
/// kernel (docs/performance.md); `RUSTYTORCH_HOPPER_STORE=thread` gives the threads' stores.
fn store_bulk(s: &Shape2) -> bool {
    s.tail != super::Tail::Stats
        && std::env::var("RUSTYTORCH_HOPPER_STORE").as_deref() != Ok("thread")
}

/// The C of a consumer's output with [`store_bulk`]: once its previous tile's copy has read its
/// staging tile (64 rows, laid out by [`swizzled_rows`]), the normalized rows into it; then its
/// first thread copies the tile out through the tensor map `omap`, which drops the rows past
/// the queries' end.
fn bulk_store_out(sp: &Spec, dv: usize, br: usize) -> String {
    format!(
        r#"  {{
    const unsigned os = o_s + (unsigned)cw * {obytes}u;
    if ((tid & 127) == 0) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
    asm volatile("bar.sync %0, 128;" :: "r"(4 + cw) : "memory");
{stage}    // Written, and visible to the bulk copy.
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    asm volatile("bar.sync %0, 128;" :: "r"(4 + cw) : "memory");
    if ((tid & 127) == 0) {{
      const int hh = (int)(bh % {heads}LL), bb = (int)(bh / {heads}LL);
      tma_store_tile(&omap, os, qt * {br} + cw * 64, {dblk}, 64, hh, bb);
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    }}
  }}"#,
        obytes = 64 * dv * 2,
        stage = swizzled_rows(
            "os",
            64,
            dv / 8,
            [
                "pack(o[n][0] * inv0, o[n][1] * inv0)",
                "pack(o[n][2] * inv1, o[n][3] * inv1)"
            ]
        ),
        dblk = dv / 64,
        heads = sp.heads,
    )
}

/// [`Built`] for `sp` and `s`.
pub(super) fn build(s: &Shape2, sp: &Spec) -> Built {
    build_with(s, sp, store_bulk(s))
}

/// [`build`], writing the output by bulk copies where `bulk_out` asks and bulk tensor copies
/// feed the kernel.
fn build_with(s: &Shape2, sp: &Spec, bulk_out: bool) -> Built {
    build_sums(s, sp, bulk_out, mma_rowsums())
}

/// [`build_with`], the rows' sums on the tensor cores where `sums` asks ([`mma_rowsums`]).
fn build_sums(s: &Shape2, sp: &Spec, bulk_out: bool, sums: bool) -> Built {
    build_fused(s, sp, (bulk_out, sums), fused_tiles())
}

/// [`build_sums`], the consumers running on from tile to tile where `fuse` asks and the kernel
/// allows ([`fused_tiles`]).
fn build_fused(s: &Shape2, sp: &Spec, (bulk_out, sums): (bool, bool), fuse: bool) -> Built {
    let nc = consumers(sp);
    let br = 64 * nc;
    let bc = keys(sp, nc);
    let st = stages();
    let blocks = sp.bsz * sp.heads * sp.sq.div_ceil(br);
    let pingpong = std::env::var("RUSTYTORCH_HOPPER_PINGPONG").as_deref() != Ok("0");
    let tma = bulk_copies(st);
    let queued = tma && queued(sp);
    // Running on from tile to tile wants the next query tile copied during the current one,
    // and every consumer computing every key tile (rows past the end masked, their output
    // dropped by the store's tensor map).
    let fusable = fuse
        && queued
        && !sums
        && pingpong
        && carried_turns()
        && bulk_out
        && s.tail == super::Tail::Out;
    let skip = !fusable && skips(sp, br, bc, queued);
    let qst = if fusable { 2 } else { query_stages(queued, nc) };
    // The tiles, then full and empty barriers for each query and key or value buffer, and the
    // next tiles' slots (and the tile of ones of the sums on the tensor cores).
    let smem = 1024
        + qst * br * sp.d * 2
        + st * bc * (sp.d + sp.dv) * 2
        + (3 * qst + 4 * st) * 8
        + if sums { ONES_BYTES } else { 0 };
    // The staging tiles where they fit beside the others (they do at the head sizes this
    // kernel takes: 199 KiB at most, head size 128 with two consumers).
    let staged = 1024 + nc * 64 * sp.dv * 2;
    let obulk = tma && bulk_out && smem + staged <= 227 * 1024;
    debug_assert!(registers_balance(
        PRODUCER + 128 * nc as u32,
        PRODUCER,
        registers(nc)
    ));
    Built {
        threads: PRODUCER + 128 * nc as u32,
        // With bulk output stores, each consumer's 64-row staging tile past the barriers, at
        // the next 1024-byte boundary.
        smem: (smem + if obulk { staged } else { 0 }) as u32,
        blocks,
        per_sm: 1,
        // Persistent but for causal attention walking fixed shares of the tiles with two
        // consumers (head size 128), whose query tiles differ most in cost: there a fixed
        // walk ran at 0.63–0.70× the speed of one block a tile, which the hardware hands to
        // SMs as they free up; with three consumers (head size 64) at 0.99–1.08×, and without
        // a causal mask at 1.0–1.14× (docs/performance.md).
        persistent: queued || !(nc == 2 && sp.causal != Causal::None),
        source: source(
            s,
            sp,
            (nc, bc),
            (st, qst),
            (pingpong, skip, carried_turns(), fusable && obulk),
            blocks,
            (tma, queued, obulk, sums),
        ),
        maps: tma.then_some([br as u32, bc as u32, bc as u32]),
        out_map: obulk.then_some(64),
    }
}

/// Whether the consumers' turns run on across query tiles ([`turns`]): the last consumer passes
/// its last turn of a tile on, which opens the first consumer's first turn of its next tile,
/// and the first turn of all is opened once before the walk. Opened afresh at every tile
/// instead (`RUSTYTORCH_HOPPER_TURNS=tile`), the first consumer's first product of a tile
/// waits until the last consumer has finished the previous tile (its last `P·V`, its output
/// and its statistics) while the tensor cores idle. Carried on, the forward ran 1.01–1.05×
/// as fast on every row measured on the H100 (most on the short causal rows, four or five key
/// tiles a query tile; docs/performance.md).
pub(super) fn carried_turns() -> bool {
    std::env::var("RUSTYTORCH_HOPPER_TURNS").as_deref() != Ok("tile")
}

/// The C of a consumer's turn: waiting for it, passing it on, and passing its last of a query
/// tile on (which the last consumer keeps unless the turns are [`carried_turns`]).
fn turns(nc: usize, pingpong: bool, carried: bool) -> (String, String, String) {
    if !pingpong {
        return (String::new(), String::new(), String::new());
    }
    let threads = 256;
    let sync = format!(
        "        asm volatile(\"bar.sync %0, {threads};\" :: \"r\"(1 + cw) : \"memory\");\n"
    );
    let pass = format!(
        "        asm volatile(\"bar.arrive %0, {threads};\" :: \"r\"(1 + (cw + 1) % {nc}) : \"memory\");\n"
    );
    if carried {
        return (sync, pass.clone(), pass);
    }
    let pass_unless_last = format!(
        "        if (cw != {last}) {{\n  {pass}        }}\n",
        last = nc - 1,
        pass = pass.trim_start()
    );
    (sync, pass, pass_unless_last)
}

/// The producer's walk with `cp.async`: its 128 threads copy each tile, and
/// `cp.async.mbarrier.arrive.noinc` completes the buffer's full barrier (one arrival a thread)
/// once their copies have landed.
const COPY_LOOP: &str = r#"  // Buffers used so far (their parities and slots follow from the counts).
  unsigned qc = 0, kc = 0, vc = 0;
  for (long long tile = blockIdx.x; tile < $TILESLL; tile += gridDim.x) {
$ORDER    const int kend = lim_of(min(qt * $BR + $BR - 1, $SQ - 1));
    const int ntiles = (kend + $BC - 1) / $BC;
    if (ntiles == 0) continue;
    const unsigned short* qp = (const unsigned short*)q + $QH;
    const unsigned short* kp = (const unsigned short*)k + $KH;
    const unsigned short* vp = (const unsigned short*)v + $VH;
    const unsigned qslot = qc % $QSTu;
    mb_wait(qempty + 8u * qslot, ((qc / $QSTu) & 1u) ^ 1u);
    load(qp, (long long)qt * $BR, $SQLL, $BR, $D, $QRSLL, q_s0 + qslot * $QBYTESu);
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" :: "r"(qfull + 8u * qslot) : "memory");
    ++qc;
    for (int j = 0; j <= ntiles; ++j) {
      if (j < ntiles) {
        const unsigned slot = kc % $STu;
        mb_wait(kempty + 8u * slot, ((kc / $STu) & 1u) ^ 1u);
        load(kp, (long long)j * $BC, $SKLL, $BC, $D, $KRSLL, k_s0 + slot * $KBYTESu);
        asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" :: "r"(kfull + 8u * slot) : "memory");
        ++kc;
      }
      if (j > 0) {
        const unsigned slot = vc % $STu;
        mb_wait(vempty + 8u * slot, ((vc / $STu) & 1u) ^ 1u);
        load(vp, (long long)(j - 1) * $BC, $SKLL, $BC, $DV, $VRSLL, v_s0 + slot * $VBYTESu);
        asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" :: "r"(vfull + 8u * slot) : "memory");
        ++vc;
      }
    }
  }
  // Every copy has landed before the producer leaves.
  asm volatile("cp.async.wait_all;" ::: "memory");"#;

/// The start of the producer's walk with bulk tensor copies: its one thread prefetches the
/// tensor maps and counts the buffers it fills.
const BULK_START: &str = r#"  if (tid == 0) {
    asm volatile("prefetch.tensormap [%0];" :: "l"((unsigned long long)&qmap) : "memory");
    asm volatile("prefetch.tensormap [%0];" :: "l"((unsigned long long)&kmap) : "memory");
    asm volatile("prefetch.tensormap [%0];" :: "l"((unsigned long long)&vmap) : "memory");
    unsigned qc = 0, kc = 0, vc = 0;
"#;

/// One query tile's bulk tensor copies (the producer's one thread, the query tile's buffer
/// free): the query tile, then key tile `j` and value tile `j − 1` for each `j`, each after
/// its buffer's empty barrier, announcing its bytes on the buffer's full barrier.
const BULK_TILE: &str = r#"      const int hh = (int)(bh % $HEADSLL), bb = (int)(bh / $HEADSLL);
      mb_expect(qfull + 8u * qslot, $QBYTESu);
      tma_tile(&qmap, q_s0 + qslot * $QBYTESu, qfull + 8u * qslot, qt * $BR, $D / 64, $BR, hh, bb);
      for (int j = 0; j <= ntiles; ++j) {
        if (j < ntiles) {
          const unsigned slot = kc % $STu, bar = kfull + 8u * slot;
          mb_wait(kempty + 8u * slot, ((kc / $STu) & 1u) ^ 1u);
          mb_expect(bar, $KBYTESu);
          tma_tile(&kmap, k_s0 + slot * $KBYTESu, bar, j * $BC, $D / 64, $BC, hh, bb);
          ++kc;
        }
        if (j > 0) {
          const unsigned slot = vc % $STu, bar = vfull + 8u * slot;
          mb_wait(vempty + 8u * slot, ((vc / $STu) & 1u) ^ 1u);
          mb_expect(bar, $VBYTESu);
          tma_tile(&vmap, v_s0 + slot * $VBYTESu, bar, (j - 1) * $BC, $DV / 64, $BC, hh, bb);
          ++vc;
        }
      }
"#;

/// The producer's walk with bulk tensor copies: one thread issues every tile's copies (one
/// per 64-column block) after announcing the tile's bytes on the buffer's full barrier, which
/// completes when they have landed; rows past a head's end are outside the tensor map's view
/// and arrive as zeros. The other producer threads have nothing to do.
const BULK_LOOP: &str = r#"$BULK_START    for (long long tile = blockIdx.x; tile < $TILESLL; tile += gridDim.x) {
$ORDER      const int kend = lim_of(min(qt * $BR + $BR - 1, $SQ - 1));
      const int ntiles = (kend + $BC - 1) / $BC;
      if (ntiles == 0) continue;
      const unsigned qslot = qc % $QSTu;
      mb_wait(qempty + 8u * qslot, ((qc / $QSTu) & 1u) ^ 1u);
      ++qc;
$BULK_TILE    }
  }"#;

/// The producer's walk with bulk tensor copies over tiles handed out at run time ([`queued`]):
/// each block starts at its own index, then takes the next free tile from a counter in global
/// memory (fetched while the current tile's copies run), and publishes every tile in a
/// shared-memory slot before the query tile's full barrier completes (a tile with no keys, and
/// the end past the last tile, complete it without bytes). The last block to leave resets the
/// counter for the next launch: every block has taken its last index by then, and launches of
/// a kernel are ordered on the device's one stream.
const QUEUE_LOOP: &str = r#"$BULK_START    long long tile = blockIdx.x;
    for (;;) {
      const unsigned qslot = qc % $QSTu;
      mb_wait(qempty + 8u * qslot, ((qc / $QSTu) & 1u) ^ 1u);
      asm volatile("st.shared.b64 [%0], %1;" :: "r"(tile_s + 8u * qslot), "l"(tile) : "memory");
      if (tile >= $TILESLL) {
        mb_arrive(qfull + 8u * qslot);
        break;
      }
      ++qc;
      const long long next = (long long)gridDim.x + (long long)atomicAdd(&rt_queue[0], 1ull);
$ORDER      const int kend = lim_of(min(qt * $BR + $BR - 1, $SQ - 1));
      const int ntiles = (kend + $BC - 1) / $BC;
      if (ntiles == 0) {
        mb_arrive(qfull + 8u * qslot);
        tile = next;
        continue;
      }
$BULK_TILE      tile = next;
    }
    if (atomicAdd(&rt_queue[1], 1ull) == (unsigned long long)gridDim.x - 1ull) {
      atomicExch(&rt_queue[0], 0ull);
      atomicExch(&rt_queue[1], 0ull);
    }
  }"#;

/// A consumer's loop over the tiles its block takes, as the kernel walks them: a fixed walk
/// (`for` over the block's tiles; [`super::hopper::launch`] may rewrite it), or the tiles the
/// producer publishes ([`queued`]; the query tile's full barrier waited on before the tile is
/// known, and a tile with no keys releasing the query buffer at once).
fn consumer_loop(queued: bool) -> [&'static str; 3] {
    if queued {
        [
            r#"  for (;;) {
    const unsigned qslot = qc % $QSTu;
    mb_wait(qfull + 8u * qslot, (qc / $QSTu) & 1u);
    ++qc;
    long long tile;
    asm volatile("ld.shared.b64 %0, [%1];" : "=l"(tile) : "r"(tile_s + 8u * qslot) : "memory");
    if (tile >= $TILESLL) break;
$Q_SLOT"#,
            "",
            r#"    } else {
      __syncwarp();
      if (lane == 0) mb_arrive(qempty + 8u * qslot);
"#,
        ]
    } else {
        [
            "  for (long long tile = blockIdx.x; tile < $TILESLL; tile += gridDim.x) {\n",
            "      const unsigned qslot = qc % $QSTu;\n      mb_wait(qfull + 8u * qslot, (qc / $QSTu) & 1u);\n      ++qc;\n$Q_SLOT",
            "",
        ]
    }
}

/// The kernel body (see the module docs) for `nc` consumers and key tiles of `bc`.
fn source(
    s: &Shape2,
    sp: &Spec,
    (nc, bc): (usize, usize),
    (st, qst): (usize, usize),
    (pingpong, skip, carried, fused): (bool, bool, bool, bool),
    blocks: usize,
    (tma, queued, obulk, sums): (bool, bool, bool, bool),
) -> String {
    let br = 64 * nc;
    let (bc8, bc16, dv8) = (bc / 8, bc / 16, s.dv / 8);
    let (reg_p, reg_c) = registers(nc);
    let (turn, pass, pass_last) = turns(nc, pingpong, carried);
    // The buffers' addresses, warp-uniform (the loop over tiles taken at run time hides it
    // from the compiler otherwise).
    let k_slot = format!(
        "        const unsigned ks = {};\n",
        warp_uniform("k_s0 + (kc % $STu) * $KBYTESu")
    );
    let v_slot = format!(
        "        const unsigned vs = {};\n",
        warp_uniform("v_s0 + (vc % $STu) * $VBYTESu")
    );
    let (k_slot, v_slot) = (k_slot.as_str(), v_slot.as_str());
    // The exponentials in place, summed per row.
    let exps = format!(
        "        #pragma unroll\n        for (int n = 0; n < $BC8; ++n) {{\n{}        }}\n",
        exp_rows(10)
    );
    // P rounded into A fragments (8-key groups 2kk and 2kk + 1 are the fragment of keys
    // 16kk..16kk + 15).
    let pack = r#"        #pragma unroll
        for (int kk = 0; kk < $BC16; ++kk) {
          pa[kk][0] = pack(s[2 * kk][0], s[2 * kk][1]);
          pa[kk][1] = pack(s[2 * kk][2], s[2 * kk][3]);
          pa[kk][2] = pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
          pa[kk][3] = pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
        }
"#;
    // As many chains as asked that divide the tile's 8-key groups.
    let mut chains = chains();
    while bc8 % chains != 0 {
        chains /= 2;
    }
    let edge = edge(s, nc);
    let poly = exp_poly();
    // The scores' code: the chunked edge (which holds the plain exponentials for the tiles off
    // the edges), or the scaled or lean edge with the maxima and exponentials after it, in
    // one chain a row or split, by the SFU or partly by the polynomial.
    let (scores, exps) = if chains == 1 && poly == 0 && bc % 32 == 0 && edge == Edge::Chunks {
        (chunked_edge(bc, &exps), String::new())
    } else {
        let scores = softmax_scores(edge == Edge::Lean);
        let (scores, exps) = if chains == 1 {
            (
                scores.replace("$ROW_MAXIMA", &row_maxima("$BC8", "        ")),
                exps.to_string(),
            )
        } else {
            (
                scores.replace("$ROW_MAXIMA", &split_maxima(bc / 8, chains)),
                split_exps(bc / 8, chains),
            )
        };
        let exps = if poly == 0 {
            exps
        } else {
            poly_exps(&exps, poly, chains)
        };
        (scores, exps)
    };
    let exps = exps.as_str();
    let full_k = "        mb_wait(kfull + 8u * (kc % $STu), (kc / $STu) & 1u);\n";
    let full_v = "        mb_wait(vfull + 8u * (vc % $STu), (vc / $STu) & 1u);\n";
    // Bytes copied by `cp.async` (the generic proxy) are made visible to the tensor cores (the
    // async proxy); bulk tensor copies write through the async proxy already.
    let fence = if tma {
        ""
    } else {
        "        asm volatile(\"fence.proxy.async.shared::cta;\" ::: \"memory\");\n"
    };
    let free_k = "        if (lane == 0) mb_arrive(kempty + 8u * (kc % $STu));\n        ++kc;\n";
    let free_v = "        if (lane == 0) mb_arrive(vempty + 8u * (vc % $STu));\n        ++vc;\n";
    let free_q = "        if (lane == 0) mb_arrive(qempty + 8u * qslot);\n";

    let release_q = |cond: &str| {
        format!(
            "        if ({cond}) {{\n  {}        }}\n",
            free_q.trim_start()
        )
    };
    let (s_gemm, pv_gemm) = (s_issue(s.d, br, bc, "cw"), pv_issue_with(bc, s.dv, sums));
    let (mut wait_o, pin_pa) = (wait(0, "o", dv8), pin("pa", bc16, 'r'));
    let mut rescale = RESCALE.to_string();
    if sums {
        wait_o += &pin("lacc", 1, 'f');
        rescale = rescale.replace(
            "o[n][3] *= a1; }\n",
            "o[n][3] *= a1; }\n          lacc[0][0] *= a0; lacc[0][1] *= a0; lacc[0][2] *= a1; lacc[0][3] *= a1;\n",
        );
    }

    // The first key tile: S_0, its softmax (the output is still zero: no rescale) and P_0.
    let first = [
        full_k,
        fence,
        &turn,
        k_slot,
        &s_gemm,
        &pass,
        &wait(0, "s", bc8),
        free_k,
        &release_q("ntiles == 1"),
        "        {\n        const int t = 0;\n",
        &scores,
        exps,
        "        }\n",
        pack,
    ]
    .concat();

    // S and the previous tile's P·V issued together in one turn, S waited for and its key
    // tile freed (the previous P·V still running).
    let issue_both = [
        full_k,
        full_v,
        fence,
        &turn,
        k_slot,
        &s_gemm,
        v_slot,
        &pv_gemm,
        &pass,
        &wait(1, "s", bc8),
        free_k,
    ]
    .concat();

    // Key tile j: S_j and P_{j-1}·V_{j-1} issued together, the softmax of S_j while P·V runs.
    let step = [
        &issue_both,
        &release_q("j == ntiles - 1"),
        "        const int t = j;\n",
        &scores,
        exps,
        &wait_o,
        &pin_pa,
        free_v,
        &rescale,
        pack,
    ]
    .concat();

    // The last value tile.
    let last = [
        full_v, fence, &turn, v_slot, &pv_gemm, &pass_last, &wait_o, &pin_pa, free_v,
    ]
    .concat();

    // The end of a query tile: the normalized output (or the statistics).
    let tail = if obulk {
        super::tail_with(s, Some(bulk_store_out(sp, s.dv, br)))
    } else {
        super::tail(s)
    };
    let zero_o = "        #pragma unroll\n        for (int n = 0; n < $DV8; ++n) { o[n][0] = 0.f; o[n][1] = 0.f; o[n][2] = 0.f; o[n][3] = 0.f; }\n";
    // Running on from tile to tile: the pending tile's output (its row and head in the names
    // the end of a tile reads), written once its last P·V is complete.
    let pending_out = format!(
        "        {{\n        const long long bh = bh_p;\n        const int qt = qt_p;\n{tail}\n        }}\n"
    );
    // The pending tile's last P·V issued beside this tile's S_0, this tile's first softmax
    // while it runs, then the pending output, and P_0.
    let fused_turn = [
        &issue_both,
        &release_q("ntiles == 1"),
        "        {\n        const int t = 0;\n",
        &scores,
        exps,
        "        }\n",
        &wait_o,
        &pin_pa,
        free_v,
        &pending_out,
        zero_o,
        pack,
    ]
    .concat();
    // The pending tile finished on its own: before a tile without keys, and at the end.
    let flush = [last.as_str(), &pending_out].concat();

    // Key tiles past the last this consumer's rows see (causal attention's diagonal, or rows
    // past the end): the consumer takes its turns and frees the buffers without computing.
    // Key tile `mine`, the first of them: only the last P·V of the consumer's own.
    let step_last = [
        full_k,
        full_v,
        fence,
        &turn,
        v_slot,
        &pv_gemm,
        &pass,
        free_k,
        &release_q("j == ntiles - 1"),
        &wait_o,
        &pin_pa,
        free_v,
    ]
    .concat();
    let skip_first = [full_k, &turn, &pass, free_k, &release_q("ntiles == 1")].concat();
    let skip_step = [
        full_k,
        full_v,
        &turn,
        &pass,
        free_k,
        &release_q("j == ntiles - 1"),
        free_v,
    ]
    .concat();
    let skip_last = [full_v, &turn, &pass_last, free_v].concat();

    // The first consumer's first turn: opened by the last consumer at every query tile, or
    // once before the walk where the turns run on across tiles.
    let open_turn = if pingpong {
        format!(
            "    if (cw == {}) asm volatile(\"bar.arrive 1, 256;\" ::: \"memory\");\n",
            nc - 1
        )
    } else {
        String::new()
    };
    let (open, initial_turn) = if carried {
        (String::new(), open_turn.replacen("    ", "  ", 1))
    } else {
        (open_turn, String::new())
    };

    let body = r#"// Flash attention forward for sm_90a, warp-specialized: a producer warpgroup and $NC consumer warpgroups of 64 query rows, key tiles of $BC, wgmma ($E).
#define RT_NEG_INF __int_as_float(0xff800000)
#define RT_LOG2E 1.4426950408889634f
$WGMMAextern __shared__ __align__(1024) unsigned char rt_smem[];
// The query tile buffers, the key and value buffers (each a set of 64-column blocks of
// 128-byte rows, 128-byte swizzled), then the barriers.
const unsigned q_s0 = ((unsigned)__cvta_generic_to_shared(rt_smem) + 1023u) & ~1023u;
const unsigned k_s0 = q_s0 + $QSTu * $QBYTESu;
const unsigned v_s0 = k_s0 + $STu * $KBYTESu;
const unsigned qfull = v_s0 + $STu * $VBYTESu, qempty = qfull + 8u * $QSTu;
const unsigned kfull = qempty + 8u * $QSTu, kempty = kfull + 8u * $STu, vfull = kempty + 8u * $STu, vempty = vfull + 8u * $STu;
// The tiles the block takes next (one a query buffer), where the producer hands tiles out at
// run time.
const unsigned tile_s = vempty + 8u * $STu;
$ONES_AT$O_STAGE$QUEUEconst int tid = threadIdx.x, lane = tid & 31;
$MBARRIERS$ONES_FILLif (tid == 0) {
  // Full: the producer's threads (their copies landed) or its one thread's announcement of
  // the bytes to come; empty: the consumers' warps.
  for (unsigned b = 0; b < $QSTu; ++b) {
    mb_init(qfull + 8u * b, $FULLu);
    mb_init(qempty + 8u * b, $CWARPSu);
  }
  for (unsigned b = 0; b < $STu; ++b) {
    mb_init(kfull + 8u * b, $FULLu);
    mb_init(vfull + 8u * b, $FULLu);
    mb_init(kempty + 8u * b, $CWARPSu);
    mb_init(vempty + 8u * b, $CWARPSu);
  }
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__syncthreads();
$PRELUDEif (tid < $PRODUCER) {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 $REG_P;" ::: "memory");
$PRODUCER_LOOP
} else {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 $REG_C;" ::: "memory");
$CONSUMER_INDEX
  const int g = lane >> 2, t4 = lane & 3;
  unsigned qc = 0, kc = 0, vc = 0;
$INITIAL_TURN$CONSUMER_LOOP$ORDER    const int i0 = qt * $BR + cw * 64 + warp * 16 + g, i1 = i0 + 8;
    const int lim0 = lim_of(i0), lim1 = lim_of(i1);
    const int kend = lim_of(min(qt * $BR + $BR - 1, $SQ - 1));
    const int ntiles = (kend + $BC - 1) / $BC;
$LIM_FIRST$O_DECL    float m0 = RT_NEG_INF, m1 = RT_NEG_INF, l0 = 0.f, l1 = 0.f;
$LACC    if (ntiles > 0) {
      float s[$BC8][4];
$PA_DECL$OPEN$WAIT_Q$WALK$NO_KEYS    }
$ROW_SUMS$TAIL
  }
$END_FLUSH$O_DRAIN}"#;
    let (walk, lim_first) = if skip {
        (WALK_MINE, MINE)
    } else {
        (WALK, "    const int lim_first = lim_of(qt * $BR);\n")
    };
    let [head, wait_q, no_keys] = consumer_loop(queued);
    let one = if s.elem == "f16" {
        "0x3C003C00u"
    } else {
        "0x3F803F80u"
    };
    let first_subs = vec![
        (
            "$WGMMA",
            if sums {
                // Before the common names' `$WGMMA`, which it holds.
                format!(
                    "$WGMMA{}",
                    wgmma_macro("RT_WGMMA_L", s.elem, 8, "lacc", "+f", 1, OperandA::Registers)
                )
            } else {
                "$WGMMA".into()
            },
        ),
        (
            "$ONES_AT",
            if sums {
                "// The tile of ones whose products with P are the rows' sums.\nconst unsigned ones_s = (tile_s + 8u * $QSTu + 127u) & ~127u;\n"
            } else {
                ""
            }
            .to_string(),
        ),
        (
            "$ONES_FILL",
            if sums {
                format!(
                    "if (tid < 128) asm volatile(\"st.shared.b32 [%0], %1;\" :: \"r\"(ones_s + 4u * (unsigned)tid), \"r\"({one}) : \"memory\");\nasm volatile(\"fence.proxy.async.shared::cta;\" ::: \"memory\");\n"
                )
            } else {
                String::new()
            },
        ),
        (
            "$LACC",
            if sums {
                "    // The rows' sums as the tensor cores accumulate them (columns alike), and the\n    // descriptor of the ones (no swizzle; 128 bytes between core matrices either way).\n    float lacc[1][4] = {{0.f, 0.f, 0.f, 0.f}};\n    const unsigned long long ones_d = (unsigned long long)(ones_s >> 4) | (8ull << 16) | (8ull << 32);\n"
            } else {
                ""
            }
            .to_string(),
        ),
        (
            "$ROW_SUMS",
            if fused {
                ""
            } else if sums {
                "    l0 = lacc[0][0]; l1 = lacc[0][2];\n    const float inv0 = l0 == 0.f ? 0.f : 1.f / l0, inv1 = l1 == 0.f ? 0.f : 1.f / l1;\n"
            } else {
                "$ROW_SUMS"
            }
            .to_string(),
        ),
        // Before the names its text holds.
        ("$TAIL", if fused { String::new() } else { tail.clone() }),
        (
            "$O_DECL",
            if fused {
                String::new()
            } else {
                ["    float o[$DV8][4];\n", &zero_o[4..].replace("\n        ", "\n    ")].concat()
            },
        ),
        (
            "$PA_DECL",
            if fused { "" } else { "      unsigned pa[$BC16][4];\n" }.to_string(),
        ),
        (
            "$END_FLUSH",
            if fused {
                format!("  if (pending) {{\n{flush}  }}\n")
            } else {
                String::new()
            },
        ),
        (
            "$O_STAGE",
            if obulk {
                if sums {
                    "const unsigned o_s = (ones_s + 512u + 1023u) & ~1023u;\n"
                } else {
                    "const unsigned o_s = (tile_s + 8u * $QSTu + 1023u) & ~1023u;\n"
                }
            } else {
                ""
            }
            .to_string(),
        ),
        (
            "$O_DRAIN",
            if obulk {
                "  // The output's bulk copies complete before the block's shared memory goes.\n  if ((tid & 127) == 0) asm volatile(\"cp.async.bulk.wait_group 0;\" ::: \"memory\");\n"
            } else {
                ""
            }
            .to_string(),
        ),
        (
            "$CONSUMER_LOOP",
            if fused {
                [FUSED_STATE, head].concat()
            } else {
                head.to_string()
            },
        ),
        ("$WAIT_Q", wait_q.to_string()),
        (
            "$NO_KEYS",
            if fused {
                format!(
                    "{no_keys}      if (pending) {{\n{flush}        pending = false;\n      }}\n{zero_o}      inv0 = 0.f;\n      inv1 = 0.f;\n{tail}\n"
                )
            } else {
                no_keys.to_string()
            },
        ),
        (
            "$QUEUE",
            if queued {
                "static unsigned long long rt_queue[2];\n"
            } else {
                ""
            }
            .to_string(),
        ),
        ("$WALK", if fused { WALK_FUSED } else { walk }.to_string()),
        ("$FUSED", fused_turn),
        ("$ZERO_O", zero_o.to_string()),
        (
            "$INVERSES",
            super::hopper::ROW_SUMS
                .replace("const float inv0 = ", "inv0 = ")
                .replace(", inv1 = ", ";\n    inv1 = "),
        ),
        ("$FIRST", first),
        ("$STEP", step),
        ("$LAST", last),
        ("$OPEN", open),
        ("$INITIAL_TURN", initial_turn),
        (
            "$PRODUCER_LOOP",
            (if queued {
                QUEUE_LOOP
            } else if tma {
                BULK_LOOP
            } else {
                COPY_LOOP
            })
            .replace("$BULK_START", BULK_START)
            .replace("$BULK_TILE", BULK_TILE),
        ),
        (
            "$MBARRIERS",
            if obulk {
                [MBARRIERS, BULK_COPIES, BULK_STORE].concat()
            } else if tma {
                [MBARRIERS, BULK_COPIES].concat()
            } else {
                MBARRIERS.to_string()
            },
        ),
        ("$FULL", if tma { "1" } else { "$PRODUCER" }.to_string()),
        // Bulk tensor copies leave the producer no tile to copy itself.
        (
            "$PRELUDE",
            if tma {
                super::helpers() + super::hopper::descriptor()
            } else {
                super::helpers() + &super::hopper::prelude()
            } + if poly == 0 { "" } else { EX2_POLY },
        ),
        ("$SKIP_FIRST", skip_first),
        ("$ENDING", step_last),
        ("$SKIP_STEP", skip_step),
        ("$SKIP_LAST", skip_last),
        ("$LIM_FIRST", lim_first.to_string()),
        (
            "$CONSUMER_INDEX",
            format!(
                "  const int cw = {}, warp = (tid >> 5) & 3;",
                warp_uniform("(tid >> 7) - 1")
            ),
        ),
        ("$HEADS", sp.heads.to_string()),
        ("$NC", nc.to_string()),
        // After the loops whose text holds them.
        (
            "$Q_SLOT",
            if qst == 1 {
                "    const unsigned q_s = q_s0;\n".to_string()
            } else {
                format!(
                    "    const unsigned q_s = {};\n",
                    warp_uniform("q_s0 + qslot * $QBYTESu")
                )
            },
        ),
        ("$QST", qst.to_string()),
        ("$ST", st.to_string()),
        ("$CWARPS", (4 * nc).to_string()),
        ("$PRODUCER", PRODUCER.to_string()),
        ("$REG_P", reg_p.to_string()),
        ("$REG_C", reg_c.to_string()),
    ];
    substitute(
        body,
        first_subs,
        common_subs(s, sp, br, bc, PRODUCER, blocks),
    )
}

#[cfg(test)]
mod tests {
    use super::super::Spec;
    use rustytorch_ops::{AttnLayout, AttnMask, Causal, DType, F64Bits, Op, TensorType};

    /// [`super::EX2_POLY`]'s steps in f32 as the GPU takes them (the rounded-down add
    /// emulated), with the coefficients read from its C: within 9e-5 of 2^x relatively over
    /// the scores' range, +0 at −∞ and far below, tiny and positive near the clamp.
    #[test]
    fn polynomial_exponential_is_accurate() {
        let line = super::EX2_POLY
            .lines()
            .find(|l| l.contains("float p ="))
            .unwrap();
        let c: Vec<f32> = line
            .split("fmaf(")
            .flat_map(|p| p.split([',', ')']))
            .filter_map(|w| w.trim().strip_suffix('f')?.parse::<f32>().ok())
            .collect();
        assert_eq!(c, [0.077_066_02, 0.227_646_11, 0.695_116_5, 1.0]);
        let ex2p = |x: f32| -> f32 {
            let x = x.max(-127.0);
            let sum = x as f64 + 12582912.0;
            let mut t = sum as f32;
            if t as f64 > sum {
                t = f32::from_bits(t.to_bits() - 1);
            }
            let f = x - (t - 12582912.0);
            let p = c[0].mul_add(f, c[1]).mul_add(f, c[2]).mul_add(f, c[3]);
            f32::from_bits(p.to_bits().wrapping_add(t.to_bits() << 23))
        };
        let mut worst = 0f64;
        for i in 0..=2_000_000 {
            let x = -(i as f32) * 6e-5;
            let want = (x as f64).exp2();
            worst = worst.max((ex2p(x) as f64 / want - 1.0).abs());
        }
        assert!(worst < 9e-5, "relative error {worst}");
        for x in [-0.3f32, -1.0, -7.25, -20.5, -100.0, -126.0] {
            let r = ex2p(x) as f64 / (x as f64).exp2() - 1.0;
            assert!(r.abs() < 9e-5, "{x}: {r}");
        }
        assert_eq!(ex2p(0.0), 1.0);
        assert_eq!(ex2p(f32::NEG_INFINITY).to_bits(), 0);
        assert_eq!(ex2p(-500.0).to_bits(), 0);
        let tiny = ex2p(-126.5);
        assert!(tiny > 0.0 && tiny < 1e-37);
        // Scores a rounding above the row's maximum stay near 1.
        assert!((ex2p(1e-6) - 1.0).abs() < 1e-5);
    }

    fn spec(d: usize, sq: usize, sk: usize, causal: Causal) -> Spec {
        spec_scaled(d, sq, sk, causal, 0.125)
    }

    fn spec_scaled(d: usize, sq: usize, sk: usize, causal: Causal, scale: f64) -> Spec {
        let t =
            |s: usize| TensorType::new(DType::BF16, rustytorch_ops::Shape::new(vec![2, 3, s, d]));
        let ins = [t(sq), t(sk), t(sk)];
        let refs: Vec<&TensorType> = ins.iter().collect();
        let op = Op::Attention {
            causal,
            mask: AttnMask::None,
            scale: F64Bits::new(scale),
            layout: AttnLayout::Bhsd,
        };
        let out = rustytorch_ops::infer(&op, &refs).unwrap();
        Spec::new(&op, &refs, &out).unwrap().unwrap()
    }

    /// The share of products consumers can skip: three consumers on the causal diagonal, rows
    /// past the end, bottom-right rows with no keys; none where every consumer sees every tile.
    #[test]
    fn skipped_shares() {
        let (full, tl, br) = (Causal::None, Causal::TopLeft, Causal::BottomRight);
        for (d, sq, sk, causal, nc, want) in [
            (64, 1024, 1024, tl, 3, 0.25),
            (64, 1024, 1024, full, 3, 1.0 / 9.0),
            (64, 3840, 3840, full, 3, 0.0),
            (64, 4096, 4096, tl, 3, 0.083),
            (64, 7, 7, full, 3, 2.0 / 3.0),
            (64, 1024, 1024, tl, 2, 0.0),
            (128, 4096, 4096, tl, 2, 0.0),
            (128, 4096, 4096, br, 2, 0.0),
            (128, 4096, 4096, full, 2, 0.0),
            (128, 1000, 1000, full, 2, 0.0),
            (128, 960, 960, full, 2, 1.0 / 16.0),
            (128, 512, 8192, br, 2, 0.0),
            (128, 300, 77, br, 2, 0.5),
        ] {
            let sp = spec(d, sq, sk, causal);
            let got = super::skipped_share(&sp, 64 * nc, 128);
            assert!(
                (got - want).abs() < 1e-3,
                "d {d} sq {sq} sk {sk} {causal:?} {nc} consumers: {got}"
            );
        }
    }

    /// The forward's register split balances for two and three consumers, and the check
    /// refuses a split that takes more than the producer gives back.
    #[test]
    fn register_splits_balance() {
        for nc in [2u32, 3] {
            let threads = super::PRODUCER + 128 * nc;
            let regs = super::registers(nc as usize);
            assert!(
                super::registers_balance(threads, super::PRODUCER, regs),
                "{nc}: {regs:?}"
            );
        }
        assert!(!super::registers_balance(384, 128, (64, 224)));
        assert!(super::registers_balance(384, 128, (64, 216)));
    }

    /// The scores are scaled before their maxima on every tile where the scale is not
    /// positive (the raw maximum times a negative scale is the scaled minimum); with a
    /// positive one, three consumers scale them on the edges only and two take the chunked
    /// edge; the lean edge leaves them raw and compares each key with a constant.
    #[test]
    fn edges_scale_first_unless_the_scale_is_positive() {
        for causal in [Causal::None, Causal::TopLeft] {
            for scale in [0.125, -0.125, 0.0] {
                let sp = spec_scaled(64, 300, 300, causal, scale);
                let b = super::super::hopper::build(&sp.shape2(super::super::Tail::Out), &sp);
                let want = match (scale > 0.0, causal) {
                    (false, _) => "if (true || kb + 128 > lim_first)",
                    (true, Causal::None) => "if (false || kb + 128 > lim_first)",
                    (true, _) => "const bool edge = kb + 128 > lim_first;",
                };
                assert!(b.source.contains(want), "{causal:?} scale {scale}");
            }
        }
        let lean = super::super::hopper::softmax_scores(true);
        assert!(lean.contains("const int d0 = (i0 < $SQ ? lim0 : 0) - kb - t4 * 2;"));
        assert!(lean.contains("if (n * 8 + (e & 1) >= (e < 2 ? d0 : d1)) s[n][e] = RT_NEG_INF;"));
        assert!(!lean.contains("float x = s[n][e] * $SCALEf;"));
        assert!(lean.contains("$ROW_MAXIMA"));
        assert_eq!(
            super::super::hopper::softmax_scores(false),
            super::super::hopper::SOFTMAX_SCORES
        );
    }

    /// The forward's descriptors: a base plus a constant per step at every head size.
    #[test]
    fn forward_descriptors_are_uniform() {
        for d in [64, 128, 80, 32] {
            let sp = spec(d, 300, 300, Causal::None);
            let b = super::super::hopper::build(&sp.shape2(super::super::Tail::Out), &sp);
            assert!(
                b.source
                    .contains("unsigned addr, unsigned lbo, unsigned off"),
                "d {d}"
            );
        }
    }

    /// With the rows' sums on the tensor cores: the tile of ones (1.0 in the element type) in
    /// 640 more bytes of shared memory, before the output's staging tiles; its descriptor
    /// unswizzled; one `m64n8k16` a 16-key step of each `P·V`, its sums rescaled with the
    /// output; no adds' shuffles at the end.
    #[test]
    fn sums_on_the_tensor_cores() {
        for (d, causal, nc) in [(64, Causal::None, 3), (128, Causal::TopLeft, 2)] {
            let sp = spec(d, 1000, 1000, causal);
            let s = sp.shape2(super::super::Tail::Out);
            let plain = super::build_sums(&s, &sp, true, false);
            let b = super::build_sums(&s, &sp, true, true);
            assert_eq!(b.smem, plain.smem + super::ONES_BYTES as u32);
            assert!(b.smem as usize <= 227 * 1024, "d {d}: {}", b.smem);
            let src = &b.source;
            assert!(src.contains("m64n8k16.f32.bf16.bf16"));
            assert!(src.contains("\"r\"(0x3F803F80u)"));
            assert!(src.contains("const unsigned o_s = (ones_s + 512u + 1023u) & ~1023u;"));
            // 128 threads fill 512 bytes; the descriptor's layout bits (62–63) are clear.
            assert!(src.contains("if (tid < 128) asm volatile(\"st.shared.b32"));
            assert!(src.contains("(ones_s >> 4) | (8ull << 16) | (8ull << 32);"));
            // Two `P·V` sites a query tile (in the walk, and the last value tile) or more.
            let sums = src.matches("RT_WGMMA_L(pa[7][0]").count();
            assert!(sums >= 2, "{sums}");
            assert_eq!(src.matches("RT_WGMMA_L(pa[8][0]").count(), 0);
            assert!(src.contains("lacc[0][0] *= a0; lacc[0][1] *= a0; lacc[0][2] *= a1;"));
            assert!(src.contains("l0 = lacc[0][0]; l1 = lacc[0][2];"));
            assert!(!src.contains("__shfl_xor_sync(0xffffffffu, l0, 1)"));
            assert!(plain.source.contains("__shfl_xor_sync(0xffffffffu, l0, 1)"));
            assert!(!plain.source.contains("RT_WGMMA_L"));
            assert_eq!(b.threads as usize, 128 + 128 * nc, "d {d}");
        }
        // f16 tiles hold f16 ones.
        let sp = spec(64, 300, 300, Causal::None);
        let mut s = sp.shape2(super::super::Tail::Out);
        s.elem = "f16";
        let b = super::build_sums(&s, &sp, true, true);
        assert!(b.source.contains("\"r\"(0x3C003C00u)"));
    }

    /// The chunked edge's chunks, as its C counts them (`nch` from the warp's last row), hold
    /// every key each row of the warp sees on every edge tile, in every causal kind, with two
    /// and three consumers and query lengths that leave rows past the end; on the causal
    /// diagonal of two consumers at S = 1024 the warps compute 10 of a tile's 16 eight-key
    /// groups on average.
    #[test]
    fn chunked_edges_hold_every_visible_key() {
        let src = super::CHUNKED_EDGE;
        assert!(src.contains("const int wlim = wrow >= $SQ ? 0 : lim_of(min(wrow + 15, $SQ - 1));"));
        assert!(src.contains(
            "nch = __shfl_sync(0xffffffffu, min(max(wlim - kb + 31, 0) / 32, $NCH), 0);"
        ));
        assert!(src.contains("const bool edge = kb + $BC > lim_first;"));
        let bc = 128usize;
        for causal in [Causal::None, Causal::TopLeft, Causal::BottomRight] {
            for (sq, sk) in [
                (1024usize, 1024usize),
                (1000, 1000),
                (300, 777),
                (777, 300),
                (65, 7),
            ] {
                let lim = |i: usize| super::keys_seen(causal, sq, sk, i);
                for nc in [2usize, 3] {
                    let br = 64 * nc;
                    let (mut groups, mut tiles) = (0usize, 0usize);
                    for qt in 0..sq.div_ceil(br) {
                        let ntiles = lim((qt * br + br - 1).min(sq - 1)).div_ceil(bc);
                        for cw in 0..nc {
                            let lim_first = lim(qt * br + cw * 64);
                            for t in 0..ntiles {
                                let kb = t * bc;
                                if kb + bc <= lim_first {
                                    continue;
                                }
                                for warp in 0..4 {
                                    let wrow = qt * br + cw * 64 + warp * 16;
                                    let wlim = if wrow >= sq {
                                        0
                                    } else {
                                        lim((wrow + 15).min(sq - 1))
                                    };
                                    let nch = ((wlim as i64 - kb as i64 + 31).max(0) / 32)
                                        .min(bc as i64 / 32)
                                        as usize;
                                    groups += 4 * nch;
                                    tiles += 1;
                                    for row in wrow..(wrow + 16).min(sq) {
                                        let seen = lim(row).saturating_sub(kb).min(bc);
                                        assert!(
                                            seen <= 32 * nch,
                                            "{causal:?} {sq}x{sk} nc {nc} qt {qt} cw {cw} t {t} row {row}"
                                        );
                                    }
                                }
                            }
                        }
                    }
                    if (causal, sq, sk, nc) == (Causal::TopLeft, 1024, 1024, 2) {
                        assert_eq!((groups, tiles), (10 * 64, 64));
                    }
                }
            }
        }
    }

    /// Turns opened at every query tile by the last consumer, which keeps its last; or, carried
    /// on across tiles, opened once before the walk and every last turn passed on.
    #[test]
    fn turns_per_tile_or_carried() {
        let (sync, pass, last) = super::turns(3, true, false);
        assert!(sync.contains("bar.sync %0, 256;\" :: \"r\"(1 + cw)"));
        assert!(pass.contains("bar.arrive %0, 256;\" :: \"r\"(1 + (cw + 1) % 3)"));
        assert!(last.starts_with("        if (cw != 2) {"));
        assert!(last.contains(pass.trim()));
        let (_, carried_pass, carried_last) = super::turns(2, true, true);
        assert_eq!(carried_pass, carried_last);
        assert!(carried_last.contains("(1 + (cw + 1) % 2)"));
        assert_eq!(super::turns(2, false, true), Default::default());
        let sp = spec(64, 1000, 1000, Causal::TopLeft);
        let b = super::build(&sp.shape2(super::super::Tail::Out), &sp);
        let open = "if (cw == 1) asm volatile(\"bar.arrive 1, 256;\" ::: \"memory\");";
        let at = b.source.find(open).expect("the first turn opened");
        let tile = b
            .source
            .find("mb_wait(qfull + 8u * qslot, (qc / 1u) & 1u);")
            .expect("the tile loop");
        assert!(at < tile, "opened once before the walk by default");
        assert!(!b.source.contains("if (cw != 1) {"));
    }

    /// Consumers running on from tile to tile: two query buffers, no skipped tiles, a tile's
    /// first turn either the pending tile's last `P·V` beside its own first `Q·Kᵀ` or the
    /// plain first one, the pending tile finished alone before a tile without keys and at the
    /// end (so five turns in the listing, and four output stores with the keyless tile's
    /// own), with two and three
    /// consumers; without the statistics, and never where not asked.
    #[test]
    fn fused_tiles_carry_the_pending_tile() {
        for (causal, nc) in [(Causal::TopLeft, 2), (Causal::None, 3)] {
            let sp = spec(64, 1000, 1000, causal);
            let s = sp.shape2(super::super::Tail::Out);
            let b = super::build_fused(&s, &sp, (true, false), true);
            assert_eq!(b.threads as usize, 128 + 128 * nc);
            let src = &b.source;
            assert!(src.contains("mb_wait(qfull + 8u * qslot, (qc / 2u) & 1u);"));
            assert!(src.contains("if (pending) {"));
            assert!(src.contains("bh_p = bh;") && src.contains("pending = true;"));
            assert!(!src.contains("mine"), "no skipped tiles");
            assert_eq!(src.matches("asm volatile(\"bar.sync %0, 256;\"").count(), 5);
            assert_eq!(src.matches("tma_store_tile(&omap").count(), 4);
            assert_eq!(src.matches("const long long bh = bh_p;").count(), 3);
            // The pending tile's P·V follows the next tile's S_0 in the same turn, and its
            // output is written after the next tile's first softmax.
            let fused = &src[src.find("if (pending) {").unwrap()..];
            let (s0, pv) = (
                fused.find("RT_WGMMA_S0(").unwrap(),
                fused.find("RT_WGMMA_O(").unwrap(),
            );
            let (maxima, out) = (
                fused.find("float mx0 = RT_NEG_INF").unwrap(),
                fused.find("const long long bh = bh_p;").unwrap(),
            );
            assert!(s0 < pv && pv < maxima && maxima < out);
            // The plain kernel where not asked, or where the statistics are saved.
            for b in [
                super::build_fused(&s, &sp, (true, false), false),
                super::build_fused(
                    &sp.shape2(super::super::Tail::Save(4096)),
                    &sp,
                    (true, false),
                    true,
                ),
            ] {
                assert!(!b.source.contains("pending"));
            }
        }
    }

    /// With bulk output stores each consumer stages its 64 rows past the barriers at a
    /// 1024-byte boundary within Hopper's 227 KiB, waits on its own named barrier (clear of
    /// the turns' 1..=3), copies its tile out once and drains the copies before leaving; the
    /// statistics kernel and the default write no staging tile.
    #[test]
    fn bulk_output_stores_stage_per_consumer() {
        for (d, causal) in [
            (64, Causal::None),
            (64, Causal::TopLeft),
            (128, Causal::None),
        ] {
            let sp = spec(d, 1000, 1000, causal);
            for tail in [super::super::Tail::Out, super::super::Tail::Save(4096)] {
                let s = sp.shape2(tail);
                let plain = super::build_with(&s, &sp, false);
                let b = super::build_with(&s, &sp, true);
                let nc = (b.threads as usize - 128) / 128;
                if plain.maps.is_none() {
                    // No bulk tensor copies (a measurement knob): no bulk stores either.
                    assert_eq!(b.out_map, None);
                    continue;
                }
                assert_eq!(b.out_map, Some(64));
                assert_eq!(plain.out_map, None);
                assert_eq!(
                    b.smem as usize,
                    plain.smem as usize + 1024 + nc * 64 * d * 2
                );
                assert!(b.smem as usize <= 227 * 1024, "d {d}: {}", b.smem);
                // Past the next tiles' slots: two with three consumers (two query buffers).
                let slots = if nc == 3 { "2u" } else { "1u" };
                assert!(b.source.contains(&format!(
                    "const unsigned o_s = (tile_s + 8u * {slots} + 1023u) & ~1023u;"
                )));
                assert_eq!(b.source.matches("tma_store_tile(&omap").count(), 1);
                assert!(b.source.contains("\"r\"(4 + cw)"));
                assert!(b.source.contains("cp.async.bulk.wait_group 0;"));
                assert!(!plain.source.contains("tma_store_tile"));
                // The statistics saved beside the output stay each thread's.
                assert_eq!(
                    b.source.contains("0.6931471805599453f"),
                    matches!(tail, super::super::Tail::Save(_))
                );
            }
            let stats = sp.shape2(super::super::Tail::Stats);
            assert_eq!(super::build(&stats, &sp).out_map, None);
        }
    }

    /// Split reductions: every fragment in exactly one chain, the chains combined pairwise.
    #[test]
    fn split_reductions_cover_every_fragment() {
        let m = super::split_maxima(16, 4);
        assert!(m.contains("for (int n = 0; n < 16; n += 4) {"));
        assert!(m.contains("mx1_3 = fmaxf(mx1_3, fmaxf(s[n + 3][2], s[n + 3][3]));"));
        assert!(m.contains("float mx0 = fmaxf(fmaxf(mx0_0, mx0_1), fmaxf(mx0_2, mx0_3));"));
        assert_eq!(m.matches("__shfl_xor_sync").count(), 4);
        let e = super::split_exps(16, 2);
        assert!(e.contains("float ls0_0 = 0.f, ls0_1 = 0.f;"));
        assert!(e.contains("ls1_1 += s[n + 1][2] + s[n + 1][3];"));
        assert!(e.contains("l0 += (ls0_0 + ls0_1);"));
        assert_eq!(e.matches("= ex2(").count(), 8);
    }
}
