//! SpGEMM on the CPU: `C = A·B` for CSR A and B with a CSR result, by Gustavson's row-by-row
//! method over rayon: each row of C is accumulated in a per-thread dense accumulator with a
//! bitmap of the touched columns (and, for rows with few products, a bitmap of its non-zero
//! words); the columns come out sorted by reading the bitmaps in order. Each block of rows
//! writes into its own buffers, which are then copied into C's arrays at their offsets (one pass
//! over the products; a symbolic pass counting each row first would make two). The blocks'
//! buffers are kept for later products and large fresh buffers ask for transparent huge pages,
//! since first touches of 4 KiB pages (page faults) cost as much as a good part of the products.
//!
//! Rows are split into contiguous blocks of about equal work (multiply-adds plus one per row), a
//! few per thread, so skewed rows do not idle threads. The number of nonzeros of C depends on the
//! data, which is why SpGEMM is an eager operation and not a node of the static graph.

use super::{err, with_index, CsrMatrix, SpIndex};
use crate::{DType, HostElement, HostTensor, OpError, Result, TensorType};
use rayon::prelude::*;
use std::borrow::Cow;
use std::ops::{Add, Mul};

/// The accumulation type (f32 for f32/f16/bf16 values, f64 for f64).
trait Acc: HostElement + Add<Output = Self> + Mul<Output = Self> {}
impl Acc for f32 {}
impl Acc for f64 {}

/// `a · b` for CSR matrices (SpGEMM): the result is CSR with sorted column indices, the index
/// dtype and value dtype of the operands (which must agree). Entries that cancel to zero are kept
/// (the pattern is the symbolic product's). f16/bf16 products accumulate in f32 and round once.
pub fn spgemm(a: &CsrMatrix, b: &CsrMatrix) -> Result<CsrMatrix> {
    const W: &str = "spgemm";
    let ty = |m: &CsrMatrix| TensorType::new(m.dtype(), [m.rows(), m.cols()]);
    if a.cols() != b.rows() {
        return Err(OpError::Shape {
            op: W,
            inputs: vec![ty(a), ty(b)],
            reason: format!("A has {} columns but B has {} rows", a.cols(), b.rows()),
        });
    }
    if a.dtype() != b.dtype() {
        return Err(OpError::DType {
            op: W,
            inputs: vec![ty(a), ty(b)],
            reason: "A and B must have one value dtype".into(),
        });
    }
    if a.index_dtype() != b.index_dtype() {
        return Err(err(
            W,
            format!(
                "A has {} indices and B has {}; they must agree",
                a.index_dtype(),
                b.index_dtype()
            ),
        ));
    }
    let dtype = a.dtype();
    let (rp, ci, v) = with_index!(a.index_dtype(), I => match dtype {
        DType::F64 => typed::<I, f64>(a, b)?,
        _ => typed::<I, f32>(a, b)?,
    });
    let values = if dtype == v.dtype() { v } else { v.cast(dtype) };
    Ok(CsrMatrix::from_valid(a.rows(), b.cols(), rp, ci, values))
}

/// The values of a matrix in the accumulation type.
fn acc_values<V: Acc>(t: &HostTensor) -> Cow<'_, [V]> {
    match t.as_slice::<V>() {
        Ok(s) => Cow::Borrowed(s),
        Err(_) => Cow::Owned(
            crate::with_data!(t.data(), v => v.iter().map(|x| V::from_f64(crate::Element::to_f64(*x))).collect()),
        ),
    }
}

/// Runs the two phases for index type `I` and accumulation type `V`.
fn typed<I: SpIndex, V: Acc>(
    a: &CsrMatrix,
    b: &CsrMatrix,
) -> Result<(HostTensor, HostTensor, HostTensor)> {
    let (m, n) = (a.rows(), b.cols());
    let arp = a.row_ptr().as_slice::<I>()?;
    let aci = a.col_idx().as_slice::<I>()?;
    let brp = b.row_ptr().as_slice::<I>()?;
    let bci = b.col_idx().as_slice::<I>()?;
    let av = acc_values::<V>(a.values());
    let bv = acc_values::<V>(b.values());
    let (av, bv) = (&av[..], &bv[..]);

    // Work per row: multiply-adds, plus one for the row itself.
    let work: Vec<usize> = (0..m)
        .into_par_iter()
        .map(|i| {
            let (s, e) = (arp[i].to_usize(), arp[i + 1].to_usize());
            1 + aci[s..e]
                .iter()
                .map(|&k| brp[k.to_usize() + 1].to_usize() - brp[k.to_usize()].to_usize())
                .sum::<usize>()
        })
        .collect();
    let blocks = split_rows(&work, rayon::current_num_threads() * 4);

    // One pass per block: each block accumulates its rows into its own buffers (sized from its
    // work, an upper bound of its nonzeros), then the blocks are copied into C's arrays at their
    // offsets. A separate symbolic pass (counting each row's columns first) would traverse every
    // product twice; the copy costs one pass over C instead.
    type Block<I, V> = (Vec<usize>, Vec<I>, Vec<V>);
    let parts: Vec<Block<I, V>> = blocks
        .par_iter()
        .map(|rows| {
            let bound: usize = work[rows.clone()].iter().sum();
            let mut counts = Vec::with_capacity(rows.len());
            let (mut ci_out, mut v_out) =
                spare::take::<I, V>(bound.min(rows.len().saturating_mul(n)));
            // Which columns the current row has touched, one bit each (small enough for L1).
            let mut bits = vec![0u64; n.div_ceil(64)];
            let mut acc = vec![V::default(); n];
            // The branch-free path's accumulator, kept all zeros between rows.
            let mut zacc = vec![V::default(); n];
            let words = n.div_ceil(64);
            // Which words of `bits` are non-zero, one bit each.
            let mut summary = vec![0u64; words.div_ceil(64)];
            for i in rows.clone() {
                let (s, e) = (arp[i].to_usize(), arp[i + 1].to_usize());
                let before = ci_out.len();
                if e - s == 1 {
                    // One nonzero in A's row: C's row is a scaled copy of B's (already sorted).
                    let (k, x) = (aci[s].to_usize(), av[s]);
                    let (bs, be) = (brp[k].to_usize(), brp[k + 1].to_usize());
                    ci_out.extend_from_slice(&bci[bs..be]);
                    v_out.extend(bv[bs..be].iter().map(|&y| x * y));
                    counts.push(be - bs);
                    continue;
                }
                let products = work[i] - 1;
                if products >= words {
                    // Many products for the width: accumulate without branches (every product
                    // adds into a zeroed accumulator and sets its column's bit), then read the
                    // whole bitmap in order, which lists the columns sorted and clears both.
                    for p in s..e {
                        let (k, x) = (aci[p].to_usize(), av[p]);
                        let (bs, be) = (brp[k].to_usize(), brp[k + 1].to_usize());
                        for (&j, &y) in bci[bs..be].iter().zip(&bv[bs..be]) {
                            let j = j.to_usize();
                            bits[j >> 6] |= 1u64 << (j & 63);
                            zacc[j] = zacc[j] + x * y;
                        }
                    }
                    for (w, word) in bits.iter_mut().enumerate() {
                        let mut b = std::mem::take(word);
                        while b != 0 {
                            let j = w * 64 + b.trailing_zeros() as usize;
                            ci_out.push(I::from_usize(j));
                            v_out.push(std::mem::take(&mut zacc[j]));
                            b &= b - 1;
                        }
                    }
                    counts.push(ci_out.len() - before);
                    continue;
                }
                // Few products for the width: a second bitmap level marks the words of `bits`
                // in use, so reading the columns back in order touches only those words (plus
                // the summary's span), never the whole row width, and nothing needs sorting.
                let (mut slo, mut shi, mut len) = (usize::MAX, 0, 0);
                for p in s..e {
                    let (k, x) = (aci[p].to_usize(), av[p]);
                    let (bs, be) = (brp[k].to_usize(), brp[k + 1].to_usize());
                    for (&j, &y) in bci[bs..be].iter().zip(&bv[bs..be]) {
                        let j = j.to_usize();
                        let (w, bit) = (j >> 6, 1u64 << (j & 63));
                        if bits[w] & bit == 0 {
                            if bits[w] == 0 {
                                summary[w >> 6] |= 1u64 << (w & 63);
                                slo = slo.min(w >> 6);
                                shi = shi.max(w >> 6);
                            }
                            bits[w] |= bit;
                            acc[j] = x * y;
                            len += 1;
                        } else {
                            acc[j] = acc[j] + x * y;
                        }
                    }
                }
                if slo <= shi && (shi + 1 - slo) * 64 <= 4 * len {
                    // The columns fill their span densely: read its words straight through.
                    summary[slo..=shi].fill(0);
                    let end = ((shi + 1) * 64).min(words);
                    for (w, word) in bits.iter_mut().enumerate().take(end).skip(slo * 64) {
                        let mut b = std::mem::take(word);
                        while b != 0 {
                            let j = w * 64 + b.trailing_zeros() as usize;
                            ci_out.push(I::from_usize(j));
                            v_out.push(acc[j]);
                            b &= b - 1;
                        }
                    }
                } else if slo <= shi {
                    for sw in slo..=shi {
                        let mut sb = std::mem::take(&mut summary[sw]);
                        while sb != 0 {
                            let w = sw * 64 + sb.trailing_zeros() as usize;
                            let mut b = std::mem::take(&mut bits[w]);
                            while b != 0 {
                                let j = w * 64 + b.trailing_zeros() as usize;
                                ci_out.push(I::from_usize(j));
                                v_out.push(acc[j]);
                                b &= b - 1;
                            }
                            sb &= sb - 1;
                        }
                    }
                }
                counts.push(ci_out.len() - before);
            }
            (counts, ci_out, v_out)
        })
        .collect();

    // Row pointers of C.
    let mut crp = Vec::with_capacity(m + 1);
    crp.push(0usize);
    let mut total = 0usize;
    for (counts, _, _) in &parts {
        for &c in counts {
            total += c;
            crp.push(total);
        }
    }
    if total > I::LIMIT {
        return Err(err(
            "spgemm",
            format!(
                "the product has {total} nonzeros, more than {} indices can address; use i64 \
                 indices",
                I::DTYPE
            ),
        ));
    }
    // The blocks' buffers into C's arrays, each block into its own slice.
    let spans: Vec<std::ops::Range<usize>> =
        blocks.iter().map(|r| crp[r.start]..crp[r.end]).collect();
    let mut cci: Vec<I> = fresh(total);
    let mut cv: Vec<V> = fresh(total);
    {
        let ci_dst = split_uninit(cci.spare_capacity_mut(), &spans);
        let v_dst = split_uninit(cv.spare_capacity_mut(), &spans);
        parts
            .par_iter()
            .zip(ci_dst)
            .zip(v_dst)
            .for_each(|(((_, ci, v), cd), vd)| {
                for (d, s) in cd.iter_mut().zip(ci) {
                    d.write(*s);
                }
                for (d, s) in vd.iter_mut().zip(v) {
                    d.write(*s);
                }
            });
    }
    for (_, ci, v) in parts {
        spare::give_back((ci, v));
    }
    // SAFETY: the spans partition 0..total (block b's rows start at crp[start] and end at
    // crp[end], consecutive blocks sharing their boundary), and block b wrote exactly
    // crp[end] − crp[start] elements (its own row counts) into its span, so every element of
    // both arrays is initialized.
    unsafe {
        cci.set_len(total);
        cv.set_len(total);
    }
    let rp = HostTensor::from_data(
        I::wrap(crp.into_iter().map(I::from_usize).collect()),
        [m + 1],
    )?;
    Ok((
        rp,
        HostTensor::from_data(I::wrap(cci), [total])?,
        HostTensor::from_data(V::wrap(cv), [total])?,
    ))
}

/// The blocks' buffers, kept between products. A product's blocks write about as many bytes as
/// its result (each block up to its work), and fresh buffers cost a minor page fault per 4 KiB
/// page on first touch, however they are allocated (the allocator returns large blocks to the
/// system when they are freed): kept buffers are already mapped, so a repeated product of a
/// similar size faults only on its result. Kept: at most [`spare::KEEP_BYTES`] in all.
mod spare {
    use std::any::Any;
    use std::sync::Mutex;

    /// The most bytes kept between products.
    pub(super) const KEEP_BYTES: usize = 256 << 20;

    /// Kept (column indices, values) pairs of any element types, and their bytes in all.
    static SPARE: Mutex<(Vec<Box<dyn Any + Send>>, usize)> = Mutex::new((Vec::new(), 0));

    fn bytes<I, V>(p: &(Vec<I>, Vec<V>)) -> usize {
        p.0.capacity() * std::mem::size_of::<I>() + p.1.capacity() * std::mem::size_of::<V>()
    }

    /// Empty buffers with room for `cap` elements each: a kept pair that fits, or new ones with a
    /// quarter to spare (untouched room costs no memory) so that they fit the next product's
    /// blocks of a similar size.
    pub(super) fn take<I: Send + 'static, V: Send + 'static>(cap: usize) -> (Vec<I>, Vec<V>) {
        {
            let mut g = SPARE.lock().unwrap_or_else(|e| e.into_inner());
            let fits = |b: &Box<dyn Any + Send>| {
                b.downcast_ref::<(Vec<I>, Vec<V>)>()
                    .is_some_and(|(c, v)| c.capacity() >= cap && v.capacity() >= cap)
            };
            if let Some(k) = g.0.iter().position(fits) {
                let b = g.0.swap_remove(k);
                let p = *b.downcast::<(Vec<I>, Vec<V>)>().expect("checked above");
                g.1 -= bytes(&p);
                return p;
            }
        }
        let cap = cap + cap / 4;
        (super::fresh(cap), super::fresh(cap))
    }

    /// Keeps a block's buffers for later products, if they fit in [`KEEP_BYTES`].
    pub(super) fn give_back<I: Send + 'static, V: Send + 'static>(mut p: (Vec<I>, Vec<V>)) {
        p.0.clear();
        p.1.clear();
        let b = bytes(&p);
        let mut g = SPARE.lock().unwrap_or_else(|e| e.into_inner());
        if g.1 + b <= KEEP_BYTES {
            g.1 += b;
            g.0.push(Box::new(p));
        }
    }
}

/// An empty vector with room for `cap` elements, its large allocations backed by transparent
/// huge pages where the kernel offers them on request.
fn fresh<T>(cap: usize) -> Vec<T> {
    let v = Vec::with_capacity(cap);
    huge_pages(v.as_ptr() as usize, cap * std::mem::size_of::<T>());
    v
}

/// Asks for transparent huge pages (`madvise(MADV_HUGEPAGE)`) on the 2 MiB-aligned interior of
/// the `bytes` bytes at `addr`, not yet touched. A product's buffers are written once, front to
/// back, right after their allocation: with 4 KiB pages each first touch is a minor page fault
/// (about 17 K per product at n 16384, density 1e-3, a sizeable part of its time), with 2 MiB
/// pages one in 512. Where THP is `madvise`-only (the common default), nothing else turns it on.
/// Linux only; elsewhere, and on any error, the pages stay as they are.
fn huge_pages(addr: usize, bytes: usize) {
    const HUGE: usize = 2 << 20;
    #[cfg(target_os = "linux")]
    {
        let (start, end) = (addr.next_multiple_of(HUGE), (addr + bytes) / HUGE * HUGE);
        if end > start {
            // SAFETY: the range lies inside one live allocation of this process; the advice
            // changes how its pages are backed, never their contents.
            unsafe {
                libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (addr, bytes, HUGE);
}

/// Splits rows `0..work.len()` into at most `parts` contiguous ranges of about equal total work.
fn split_rows(work: &[usize], parts: usize) -> Vec<std::ops::Range<usize>> {
    let total: usize = work.iter().sum();
    let parts = parts.clamp(1, work.len().max(1));
    let target = total.div_ceil(parts).max(1);
    let mut out = Vec::with_capacity(parts);
    let (mut start, mut acc) = (0, 0);
    for (i, &w) in work.iter().enumerate() {
        acc += w;
        if acc >= target {
            out.push(start..i + 1);
            start = i + 1;
            acc = 0;
        }
    }
    if start < work.len() || out.is_empty() {
        out.push(start..work.len());
    }
    out
}

/// Splits `v` into the disjoint mutable slices covering `ranges` (contiguous, in order, from 0).
fn split_uninit<'a, T>(
    mut v: &'a mut [std::mem::MaybeUninit<T>],
    ranges: &[std::ops::Range<usize>],
) -> Vec<&'a mut [std::mem::MaybeUninit<T>]> {
    let mut out = Vec::with_capacity(ranges.len());
    for r in ranges {
        let (head, tail) = std::mem::take(&mut v).split_at_mut(r.end - r.start);
        out.push(head);
        v = tail;
    }
    out
}
