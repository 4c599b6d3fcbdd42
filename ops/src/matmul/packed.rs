//! The f32 GEMM of the CPU backend: `C = A·B (+ bias)` with B packed once into panels of
//! [`NR`] columns and an AVX-512 register tile of [`MR`]×[`NR`] (24 accumulators, one FMA per
//! accumulator per `k`).
//!
//! B (a weight, usually) is packed into column panels, each `k`-major with its [`NR`] columns
//! contiguous and zero-padded past `n`, 64-byte aligned: the micro-kernel reads one panel row
//! with three aligned loads and broadcasts one element of A per row of the tile (A is read in
//! place with any strides, so a transposed A is no copy). A [`PackedB`] can be kept and reused
//! across calls (the CPU session packs its parameters once). Loops, outer to inner: blocks of
//! [`KC`] along `k` (a panel's block, 72 KiB, stays in L2 while the tile walks down the rows),
//! blocks of [`MC`] rows (A's block stays in L2), panels, tiles of [`MR`] rows. Work is split
//! over the rayon pool by panels (by rows when there are fewer panels than threads). The first
//! `k` block writes C, later ones add to it; the last adds the bias in registers and applies the
//! activation to the tile while it is in L1.
//!
//! Without AVX-512 (or off x86-64) [`gemm_f32`] returns `false` and the caller uses the `gemm`
//! crate.

use crate::vmath::{self, VFn};
use rayon::prelude::*;

/// Rows of the register tile.
pub const MR: usize = 8;
/// Columns of the register tile and of a packed panel (three 16-lane vectors).
pub const NR: usize = 48;
/// Depth of a `k` block (a panel's block is `KC·NR·4` = 72 KiB, read from L2 once per tile).
pub const KC: usize = 384;
/// Rows of an A block kept in L2 while the panels stream past.
pub const MC: usize = 256;
/// Jobs per pool thread when the work is split.
const JOBS_PER_THREAD: usize = 4;

/// B (`k×n`) packed into panels of [`NR`] columns, each `k`-major, zero-padded, 64-byte aligned.
#[derive(Clone, Debug)]
pub struct PackedB {
    k: usize,
    n: usize,
    buf: Vec<f32>,
    /// Offset of the first (aligned) element in `buf`.
    start: usize,
}

impl PackedB {
    /// Packs the `k×n` matrix whose element `(p, j)` is `b[p·rs + j·cs]` (a transposed B is
    /// `rs = 1, cs = k`). Returns `None` when an index would fall outside `b`.
    pub fn new(b: &[f32], k: usize, n: usize, rs: usize, cs: usize) -> Option<Self> {
        if k > 0 && n > 0 && (k - 1) * rs + (n - 1) * cs >= b.len() {
            return None;
        }
        let panels = n.div_ceil(NR);
        let len = panels * k * NR;
        let mut buf = vec![0f32; len + 16];
        let start = buf.as_ptr().align_offset(64).min(16);
        let dst = &mut buf[start..start + len];
        dst.par_chunks_mut((k * NR).max(1))
            .enumerate()
            .for_each(|(p, panel)| {
                let j0 = p * NR;
                let w = NR.min(n - j0);
                for (kk, row) in panel.chunks_exact_mut(NR).enumerate() {
                    for (jj, d) in row[..w].iter_mut().enumerate() {
                        *d = b[kk * rs + (j0 + jj) * cs];
                    }
                }
            });
        Some(PackedB { k, n, buf, start })
    }

    /// Inner dimension.
    pub fn k(&self) -> usize {
        self.k
    }

    /// Columns.
    pub fn n(&self) -> usize {
        self.n
    }

    fn data(&self) -> &[f32] {
        &self.buf[self.start..self.start + self.n.div_ceil(NR) * self.k * NR]
    }
}

/// Whether [`gemm_f32`] runs here (x86-64 with AVX-512F, detected at run time).
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// A's geometry: `m` rows; element `(i, p)` at `a[i·rs + p·cs]`.
#[derive(Clone, Copy, Debug)]
pub struct AView<'a> {
    /// The elements.
    pub a: &'a [f32],
    /// Rows.
    pub m: usize,
    /// Row stride.
    pub rs: usize,
    /// Column (inner) stride.
    pub cs: usize,
}

/// `c = act(A·B + bias)` with `c` row-major `m×n` (every element written). Returns `false`
/// (leaving `c` untouched) when the kernel is not available on this CPU, or when an operand does
/// not hold the matrix its geometry describes. `parallel` splits the work over the rayon pool.
pub fn gemm_f32(
    a: AView<'_>,
    b: &PackedB,
    bias: Option<&[f32]>,
    act: VFn,
    c: &mut [f32],
    parallel: bool,
) -> bool {
    let (m, n, k) = (a.m, b.n, b.k);
    if !available()
        || c.len() != m * n
        || bias.is_some_and(|v| v.len() != n)
        || (m > 0 && k > 0 && (m - 1) * a.rs + (k - 1) * a.cs >= a.a.len())
    {
        return false;
    }
    if m == 0 || n == 0 {
        return true;
    }
    if k == 0 {
        c.iter_mut().for_each(|v| *v = 0.0);
        if bias.is_some() || act != VFn::Identity {
            vmath::bias_act(c, bias, n, act);
        }
        return true;
    }
    let panels = n.div_ceil(NR);
    let threads = if parallel { crate::par::threads() } else { 1 };
    let cp = SendPtr(c.as_mut_ptr());
    let job = |rows: (usize, usize), pans: (usize, usize)| {
        // SAFETY: the jobs cover disjoint (row range × panel range) blocks of C, every index they
        // touch is inside `c` (m×n row-major, checked above), A's indices are inside `a.a`
        // (checked above) and B's inside the packed panels; AVX-512F was detected above.
        unsafe { run_block(a, b, bias, act, cp, rows, pans) }
    };
    // A few jobs per thread, so that a core slowed by other work hands its share to the other.
    let jobs = threads * JOBS_PER_THREAD;
    if threads > 1 && panels >= threads {
        let per = panels.div_ceil(jobs);
        crate::par::for_each(panels.div_ceil(per), |t| {
            job((0, m), (t * per, ((t + 1) * per).min(panels)))
        });
    } else if threads > 1 && m >= 2 * MR {
        let per = m.div_ceil(jobs).div_ceil(MR) * MR;
        crate::par::for_each(m.div_ceil(per), |t| {
            job((t * per, ((t + 1) * per).min(m)), (0, panels))
        });
    } else {
        job((0, m), (0, panels));
    }
    true
}

/// A raw pointer to C shared by the jobs, which write disjoint blocks.
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: the pointer is only dereferenced inside `run_block`, whose callers give each job a
// disjoint block of C.
unsafe impl Send for SendPtr {}
// SAFETY: as above.
unsafe impl Sync for SendPtr {}

/// Computes C's rows `rows.0..rows.1` and panels `pans.0..pans.1`.
///
/// # Safety
/// AVX-512F and FMA are available; `a` holds the `m×k` matrix its strides describe; `c` points to
/// `m×n` row-major elements of which no other thread touches this block.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
unsafe fn run_block(
    a: AView<'_>,
    b: &PackedB,
    bias: Option<&[f32]>,
    act: VFn,
    c: SendPtr,
    rows: (usize, usize),
    pans: (usize, usize),
) {
    let (n, k) = (b.n, b.k);
    let bp = b.data();
    let mut k0 = 0;
    while k0 < k {
        let kc = KC.min(k - k0);
        let last = k0 + kc == k;
        let mut m0 = rows.0;
        while m0 < rows.1 {
            let mc = MC.min(rows.1 - m0);
            for p in pans.0..pans.1 {
                let j0 = p * NR;
                let w = NR.min(n - j0);
                let panel = &bp[p * k * NR + k0 * NR..p * k * NR + (k0 + kc) * NR];
                let mut i = m0;
                while i < m0 + mc {
                    let mr = MR.min(m0 + mc - i);
                    // SAFETY: row `i` and column `j0` are inside C's block and A (the caller's
                    // contract), and column `j0` inside the bias (`n` long); `panel` holds
                    // `kc·NR` floats at a 64-byte boundary (panels start at multiples of 64 bytes
                    // from an aligned start); the tile reaches `mr` rows and `w` columns.
                    unsafe {
                        let t = Tile {
                            a: a.a.as_ptr().add(i * a.rs + k0 * a.cs),
                            a_rs: a.rs,
                            a_cs: a.cs,
                            b: panel.as_ptr(),
                            ldb: NR,
                            kc,
                            c: c.0.add(i * n + j0),
                            ldc: n,
                            w,
                            acc: k0 > 0,
                            bias: if last {
                                bias.map(|v| v.as_ptr().add(j0))
                            } else {
                                None
                            },
                        };
                        tile_rows::<3, true>(mr, &t);
                    }
                    i += mr;
                }
            }
            m0 += mc;
        }
        k0 += kc;
    }
    if act != VFn::Identity {
        // The activation over the block's rows (in L2), one vectorized call per row.
        let (j0, j1) = (pans.0 * NR, (pans.1 * NR).min(n));
        for i in rows.0..rows.1 {
            // SAFETY: row `i`, columns `j0..j1` are this job's block of C (the caller's contract).
            let row = unsafe { std::slice::from_raw_parts_mut(c.0.add(i * n + j0), j1 - j0) };
            vmath::bias_act(row, None, j1 - j0, act);
        }
    }
}

/// Off x86-64 the kernel never runs ([`available`] is false).
#[cfg(not(target_arch = "x86_64"))]
unsafe fn run_block(
    _: AView<'_>,
    _: &PackedB,
    _: Option<&[f32]>,
    _: VFn,
    _: SendPtr,
    _: (usize, usize),
    _: (usize, usize),
) {
}

/// [`tile`] for `r` rows (1..=8).
///
/// # Safety
/// As [`tile`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
#[inline]
unsafe fn tile_rows<const V: usize, const PACKED: bool>(r: usize, t: &Tile) {
    // SAFETY: forwarded contract.
    unsafe {
        match r {
            8 => tile::<8, V, PACKED>(t),
            7 => tile::<7, V, PACKED>(t),
            6 => tile::<6, V, PACKED>(t),
            5 => tile::<5, V, PACKED>(t),
            4 => tile::<4, V, PACKED>(t),
            3 => tile::<3, V, PACKED>(t),
            2 => tile::<2, V, PACKED>(t),
            _ => tile::<1, V, PACKED>(t),
        }
    }
}

/// `c = a·b` for small row-major f32 operands read in place: `a` is `m×k` (row stride `lda`),
/// `b` is `k×n` (row stride `ldb`), `c` is `m×n` (row stride `ldc`), through the register tile
/// with B unpacked (masked loads at its right edge). One thread. Returns `false` (leaving `c`
/// untouched) without AVX-512 or when an operand is too short for its geometry.
pub fn small_gemm(
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
    c: &mut [f32],
    ldc: usize,
    (m, n, k): (usize, usize, usize),
) -> bool {
    let fits = |len: usize, rows: usize, ld: usize, cols: usize| {
        rows == 0 || cols == 0 || (rows - 1) * ld + cols <= len
    };
    if !available()
        || !fits(a.len(), m, lda, k)
        || !fits(b.len(), k, ldb, n)
        || !fits(c.len(), m, ldc, n)
    {
        return false;
    }
    if m == 0 || n == 0 {
        return true;
    }
    if k == 0 {
        for i in 0..m {
            c[i * ldc..i * ldc + n].iter_mut().for_each(|v| *v = 0.0);
        }
        return true;
    }
    // SAFETY: AVX-512F was detected and the three operands hold their geometry (checked above).
    unsafe {
        small_gemm_x86(
            a.as_ptr(),
            lda,
            b.as_ptr(),
            ldb,
            c.as_mut_ptr(),
            ldc,
            (m, n, k),
        )
    };
    true
}

/// The loops of [`small_gemm`]: tiles of 8 rows × 48 columns (fewer at the edges).
///
/// # Safety
/// AVX-512F and FMA are available; the pointers hold the geometry [`small_gemm`] checks, `k > 0`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
unsafe fn small_gemm_x86(
    a: *const f32,
    lda: usize,
    b: *const f32,
    ldb: usize,
    c: *mut f32,
    ldc: usize,
    (m, n, k): (usize, usize, usize),
) {
    let mut i = 0;
    while i < m {
        let mr = MR.min(m - i);
        let mut j = 0;
        while j < n {
            let w = NR.min(n - j);
            // SAFETY: rows `i..i + mr` and columns `j..j + w` are inside A's, B's and C's
            // geometry (the caller's contract); unpacked tiles read B with masked loads.
            unsafe {
                let t = Tile {
                    a: a.add(i * lda),
                    a_rs: lda,
                    a_cs: 1,
                    b: b.add(j),
                    ldb,
                    kc: k,
                    c: c.add(i * ldc + j),
                    ldc,
                    w,
                    acc: false,
                    bias: None,
                };
                match w.div_ceil(16) {
                    3 => tile_rows::<3, false>(mr, &t),
                    2 => tile_rows::<2, false>(mr, &t),
                    _ => tile_rows::<1, false>(mr, &t),
                }
            }
            j += w;
        }
        i += mr;
    }
}

/// Off x86-64 the kernel never runs ([`available`] is false).
#[cfg(not(target_arch = "x86_64"))]
unsafe fn small_gemm_x86(
    _: *const f32,
    _: usize,
    _: *const f32,
    _: usize,
    _: *mut f32,
    _: usize,
    _: (usize, usize, usize),
) {
}

/// One register tile's operands: `kc` steps of A (`MR` rows from `a`) against a packed panel
/// block `b`, into C at `c` (row stride `ldc`, `w <= NR` valid columns).
struct Tile {
    a: *const f32,
    a_rs: usize,
    a_cs: usize,
    b: *const f32,
    /// B's row stride ([`NR`] in a packed panel).
    ldb: usize,
    kc: usize,
    c: *mut f32,
    ldc: usize,
    w: usize,
    /// Add to C instead of overwriting it.
    acc: bool,
    /// Added after the sum (the bias's first of `w` columns).
    bias: Option<*const f32>,
}

/// The micro-kernel: an `R×16V` block of C from `kc` rank-1 updates held in `V·R` zmm registers
/// (B from a packed panel with aligned loads, or in place with masked ones).
///
/// # Safety
/// AVX-512F and FMA are available; `t.a` reaches `R` rows × `kc` columns by its strides, `t.b`
/// holds `kc` rows of `t.ldb` (64-byte aligned when `PACKED`; `t.w` valid columns when not),
/// `t.c` reaches `R` rows × `t.w` columns by `t.ldc`, and
/// `t.bias` (if any) `t.w` floats.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
#[inline]
unsafe fn tile<const R: usize, const V: usize, const PACKED: bool>(t: &Tile) {
    use std::arch::x86_64::*;
    // SAFETY: the caller's contract: every pointer read or written below is inside the operand it
    // describes (masked lanes beyond `t.w` are neither read nor written), a packed `t.b` is
    // aligned for `_mm512_load_ps`, and the CPU has AVX-512F.
    unsafe {
        let mask = |v: usize| -> __mmask16 {
            let lanes = t.w.saturating_sub(16 * v).min(16);
            ((1u32 << lanes) - 1) as __mmask16
        };
        let masks: [__mmask16; V] = std::array::from_fn(mask);
        let mut acc = [[_mm512_setzero_ps(); V]; R];
        let (mut a, mut b) = (t.a, t.b);
        for _ in 0..t.kc {
            let bv: [__m512; V] = std::array::from_fn(|v| {
                if PACKED {
                    _mm512_load_ps(b.wrapping_add(16 * v))
                } else {
                    _mm512_maskz_loadu_ps(masks[v], b.wrapping_add(16 * v))
                }
            });
            for (r, row) in acc.iter_mut().enumerate() {
                let x = _mm512_set1_ps(*a.add(r * t.a_rs));
                for v in 0..V {
                    row[v] = _mm512_fmadd_ps(x, bv[v], row[v]);
                }
            }
            // Wrapping: after the last step these point past the operands and are not read.
            a = a.wrapping_add(t.a_cs);
            b = b.wrapping_add(t.ldb);
        }
        let mut bv = [_mm512_setzero_ps(); V];
        if let Some(bias) = t.bias {
            for (v, x) in bv.iter_mut().enumerate() {
                if masks[v] != 0 {
                    *x = _mm512_maskz_loadu_ps(masks[v], bias.add(16 * v));
                }
            }
        }
        for (r, row) in acc.iter().enumerate() {
            let cr = t.c.add(r * t.ldc);
            for v in 0..V {
                if masks[v] == 0 {
                    continue;
                }
                let p = cr.add(16 * v);
                let mut y = row[v];
                if t.acc {
                    y = _mm512_add_ps(_mm512_maskz_loadu_ps(masks[v], p), y);
                }
                if t.bias.is_some() {
                    y = _mm512_add_ps(y, bv[v]);
                }
                _mm512_mask_storeu_ps(p, masks[v], y);
            }
        }
    }
}
