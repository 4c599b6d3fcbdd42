//! The f32 GEMM of the CPU backend: `C = A·B (+ bias)` with B packed once into panels of
//! [`NR`] columns and an AVX-512 register tile of [`MR`]×[`NR`] (24 accumulators, one FMA per
//! accumulator per `k`).
//!
//! B (a weight, usually) is packed into column panels, each `k`-major with its [`NR`] columns
//! contiguous and zero-padded past `n`, 64-byte aligned: the micro-kernel reads one panel row
//! with three aligned loads and broadcasts one element of A per row of the tile (A is read in
//! place with any strides, so a transposed A is no copy). A [`PackedB`] can be kept and reused
//! across calls (the CPU session packs its parameters once). Loops, outer to inner: blocks of
//! [`KC`] along `k` (a panel's block, 36 KiB, stays in L1 while the tile walks down the rows),
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
/// Depth of a `k` block (a panel's block is `KC·NR·4` = 36 KiB).
pub const KC: usize = 192;
/// Rows of an A block kept in L2 while the panels stream past.
pub const MC: usize = 256;

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
    let threads = if parallel {
        rayon::current_num_threads().max(1)
    } else {
        1
    };
    let cp = SendPtr(c.as_mut_ptr());
    let job = |rows: (usize, usize), pans: (usize, usize)| {
        // SAFETY: the jobs cover disjoint (row range × panel range) blocks of C, every index they
        // touch is inside `c` (m×n row-major, checked above), A's indices are inside `a.a`
        // (checked above) and B's inside the packed panels; AVX-512F was detected above.
        unsafe { run_block(a, b, bias, act, cp, rows, pans) }
    };
    if threads > 1 && panels >= threads {
        let per = panels.div_ceil(threads);
        (0..panels.div_ceil(per))
            .into_par_iter()
            .for_each(|t| job((0, m), (t * per, ((t + 1) * per).min(panels))));
    } else if threads > 1 && m >= 2 * MR {
        let per = m.div_ceil(threads).div_ceil(MR) * MR;
        (0..m.div_ceil(per))
            .into_par_iter()
            .for_each(|t| job((t * per, ((t + 1) * per).min(m)), (0, panels)));
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
                        match mr {
                            8 => tile::<8>(&t),
                            7 => tile::<7>(&t),
                            6 => tile::<6>(&t),
                            5 => tile::<5>(&t),
                            4 => tile::<4>(&t),
                            3 => tile::<3>(&t),
                            2 => tile::<2>(&t),
                            _ => tile::<1>(&t),
                        }
                        if last && act != VFn::Identity {
                            for r in 0..mr {
                                let row =
                                    std::slice::from_raw_parts_mut(c.0.add((i + r) * n + j0), w);
                                vmath::bias_act(row, None, w, act);
                            }
                        }
                    }
                    i += mr;
                }
            }
            m0 += mc;
        }
        k0 += kc;
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

/// One register tile's operands: `kc` steps of A (`MR` rows from `a`) against a packed panel
/// block `b`, into C at `c` (row stride `ldc`, `w <= NR` valid columns).
struct Tile {
    a: *const f32,
    a_rs: usize,
    a_cs: usize,
    b: *const f32,
    kc: usize,
    c: *mut f32,
    ldc: usize,
    w: usize,
    /// Add to C instead of overwriting it.
    acc: bool,
    /// Added after the sum (the bias's first of `w` columns).
    bias: Option<*const f32>,
}

/// The micro-kernel: an `R×48` block of C from `kc` rank-1 updates held in 3·R zmm registers.
///
/// # Safety
/// AVX-512F and FMA are available; `t.a` reaches `R` rows × `kc` columns by its strides, `t.b`
/// holds `kc·NR` floats 64-byte aligned, `t.c` reaches `R` rows × `t.w` columns by `t.ldc`, and
/// `t.bias` (if any) `t.w` floats.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
#[inline]
unsafe fn tile<const R: usize>(t: &Tile) {
    use std::arch::x86_64::*;
    // SAFETY: the caller's contract: every pointer read or written below is inside the operand it
    // describes (masked lanes beyond `t.w` are neither read nor written), `t.b` is aligned for
    // `_mm512_load_ps`, and the CPU has AVX-512F.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); 3]; R];
        let (mut a, mut b) = (t.a, t.b);
        for _ in 0..t.kc {
            let b0 = _mm512_load_ps(b);
            let b1 = _mm512_load_ps(b.add(16));
            let b2 = _mm512_load_ps(b.add(32));
            for (r, row) in acc.iter_mut().enumerate() {
                let x = _mm512_set1_ps(*a.add(r * t.a_rs));
                row[0] = _mm512_fmadd_ps(x, b0, row[0]);
                row[1] = _mm512_fmadd_ps(x, b1, row[1]);
                row[2] = _mm512_fmadd_ps(x, b2, row[2]);
            }
            // Wrapping: after the last step these point past the operands and are not read.
            a = a.wrapping_add(t.a_cs);
            b = b.wrapping_add(NR);
        }
        let mask = |v: usize| -> __mmask16 {
            let lanes = t.w.saturating_sub(16 * v).min(16);
            ((1u32 << lanes) - 1) as __mmask16
        };
        let masks = [mask(0), mask(1), mask(2)];
        let mut bv = [_mm512_setzero_ps(); 3];
        if let Some(bias) = t.bias {
            for (v, x) in bv.iter_mut().enumerate() {
                if masks[v] != 0 {
                    *x = _mm512_maskz_loadu_ps(masks[v], bias.add(16 * v));
                }
            }
        }
        for (r, row) in acc.iter().enumerate() {
            let cr = t.c.add(r * t.ldc);
            for v in 0..3 {
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
