//! Reductions: sum, mean, max, min, prod, any, all over a set of axes, and argmax/argmin along one.
//!
//! Kernel layout: after dropping size-1 dims and merging neighbours, a reduction whose axes are
//! contiguous is `[outer, reduced, inner]` over the input as it is; otherwise the reduced axes are
//! first gathered to the end (movement's strided gather) and the reduction is `[outer, reduced, 1]`.
//!
//! Accuracy: float sums, means and products accumulate in f64 for every float dtype (max and min,
//! which are exact, compare in f32 for f16/bf16/f32), integers in i64 (wrapping, then truncated to
//! the dtype with `as`). Sums and products are pairwise over a contiguous run (blocks of 128
//! elements in 8 lanes, halves combined recursively), and blocked over strided runs (256 rows are
//! summed into a fresh partial row, and the partials are merged pairwise), so the error grows
//! with `log n` instead of `n`; an f32 result is the f64 value rounded once, so it is correctly
//! rounded in all but contrived cases. Mean divides the f64 sum once; mean of nothing is
//! NaN, sum of nothing 0, prod of nothing 1, max/min of nothing an error. NaN propagates through
//! max/min, and argmax/argmin return the first index of the extreme, NaN counting as the extreme
//! (as PyTorch).

use crate::movement::{coalesce, for_each_row, strided_gather};
use crate::util::{arity, attr_err, dtype_err, PAR_THRESHOLD};
use crate::{
    bf16, f16, ArgKind, BinaryOp, DType, Data, HostElement, HostTensor, Op, OpError, ReduceKind,
    Result, Shape, TensorType, Value, VjpCtx,
};
use rayon::prelude::*;

/// Output type of a reduction, or a typed error naming the op, shapes and dtypes.
pub fn infer(op: &Op, inputs: &[&TensorType]) -> Result<TensorType> {
    arity(op, inputs, 1)?;
    let x = inputs[0];
    let r = x.shape.rank();
    match op {
        Op::Reduce {
            kind,
            axes,
            keep_dims,
        } => {
            check_axes(op, axes, r, x)?;
            let ok = match kind {
                ReduceKind::Any | ReduceKind::All => x.dtype == DType::Bool,
                ReduceKind::Mean => x.dtype.is_float(),
                ReduceKind::Sum | ReduceKind::Prod | ReduceKind::Max | ReduceKind::Min => {
                    x.dtype != DType::Bool
                }
            };
            if !ok {
                let want = match kind {
                    ReduceKind::Any | ReduceKind::All => "bool",
                    ReduceKind::Mean => "a float dtype",
                    _ => "a numeric dtype",
                };
                return Err(dtype_err(op, inputs, format!("needs {want}")));
            }
            Ok(TensorType::new(
                x.dtype,
                reduced_dims(x.shape.dims(), axes, *keep_dims),
            ))
        }
        Op::ArgReduce {
            axis, keep_dims, ..
        } => {
            if *axis >= r {
                return Err(attr_err(op, format!("axis {axis} out of range for {x}")));
            }
            if x.dtype == DType::Bool {
                return Err(dtype_err(op, inputs, "needs a numeric dtype"));
            }
            Ok(TensorType::new(
                DType::I64,
                reduced_dims(x.shape.dims(), &[*axis], *keep_dims),
            ))
        }
        _ => Err(OpError::Runtime {
            op: op.name(),
            reason: "not a reduction".into(),
        }),
    }
}

fn check_axes(op: &Op, axes: &[usize], rank: usize, x: &TensorType) -> Result<()> {
    let sorted = axes.windows(2).all(|w| w[0] < w[1]);
    if !sorted || axes.iter().any(|&a| a >= rank) {
        return Err(attr_err(
            op,
            format!("axes {axes:?} must be sorted, unique and below the rank of {x}"),
        ));
    }
    Ok(())
}

fn reduced_dims(dims: &[usize], axes: &[usize], keep: bool) -> Vec<usize> {
    dims.iter()
        .enumerate()
        .filter_map(|(i, &d)| match (axes.contains(&i), keep) {
            (false, _) => Some(d),
            (true, true) => Some(1),
            (true, false) => None,
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Accumulators

/// The arithmetic a reduction accumulates in: f32, f64, i64 or u64 (integers wrap).
trait Acc: Copy + Send + Sync + PartialOrd + 'static {
    const ZERO: Self;
    const ONE: Self;
    const LOWEST: Self;
    const HIGHEST: Self;
    fn add(self, o: Self) -> Self;
    fn mul(self, o: Self) -> Self;
    fn is_nan(self) -> bool;
    fn div_count(self, n: usize) -> Self;
}

macro_rules! acc_float {
    ($t:ty) => {
        impl Acc for $t {
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            const LOWEST: Self = <$t>::NEG_INFINITY;
            const HIGHEST: Self = <$t>::INFINITY;
            #[inline(always)]
            fn add(self, o: Self) -> Self {
                self + o
            }
            #[inline(always)]
            fn mul(self, o: Self) -> Self {
                self * o
            }
            #[inline(always)]
            fn is_nan(self) -> bool {
                <$t>::is_nan(self)
            }
            #[inline(always)]
            fn div_count(self, n: usize) -> Self {
                self / n as $t
            }
        }
    };
}
acc_float!(f32);
acc_float!(f64);

macro_rules! acc_int {
    ($t:ty) => {
        impl Acc for $t {
            const ZERO: Self = 0;
            const ONE: Self = 1;
            const LOWEST: Self = <$t>::MIN;
            const HIGHEST: Self = <$t>::MAX;
            #[inline(always)]
            fn add(self, o: Self) -> Self {
                self.wrapping_add(o)
            }
            #[inline(always)]
            fn mul(self, o: Self) -> Self {
                self.wrapping_mul(o)
            }
            #[inline(always)]
            fn is_nan(self) -> bool {
                false
            }
            #[inline(always)]
            fn div_count(self, n: usize) -> Self {
                if n == 0 {
                    0
                } else {
                    self / n as $t
                }
            }
        }
    };
}
acc_int!(i64);
acc_int!(u64);

/// A numeric element with its accumulator types: `A` for max/min (exact), `S` for sum, mean and
/// prod (f64 for every float dtype).
trait Num: HostElement {
    type A: Acc;
    type S: Acc;
    fn load(self) -> Self::A;
    fn store(a: Self::A) -> Self;
    fn load_s(self) -> Self::S;
    fn store_s(s: Self::S) -> Self;
}

macro_rules! num {
    ($t:ty, $a:ty, |$x:ident| $load:expr, |$y:ident| $store:expr,
     $s:ty, |$xs:ident| $load_s:expr, |$ys:ident| $store_s:expr) => {
        impl Num for $t {
            type A = $a;
            type S = $s;
            #[inline(always)]
            fn load(self) -> $a {
                let $x = self;
                $load
            }
            #[inline(always)]
            fn store($y: $a) -> Self {
                $store
            }
            #[inline(always)]
            fn load_s(self) -> $s {
                let $xs = self;
                $load_s
            }
            #[inline(always)]
            fn store_s($ys: $s) -> Self {
                $store_s
            }
        }
    };
}
num!(f32, f32, |x| x, |a| a, f64, |x| x as f64, |s| s as f32);
num!(f64, f64, |x| x, |a| a, f64, |x| x, |s| s);
num!(
    f16,
    f32,
    |x| x.to_f32(),
    |a| f16::from_f32(a),
    f64,
    |x| x.to_f64(),
    |s| f16::from_f64(s)
);
num!(
    bf16,
    f32,
    |x| x.to_f32(),
    |a| bf16::from_f32(a),
    f64,
    |x| x.to_f64(),
    |s| bf16::from_f64(s)
);
num!(
    i32,
    i64,
    |x| x as i64,
    |a| a as i32,
    i64,
    |x| x as i64,
    |s| s as i32
);
num!(i64, i64, |x| x, |a| a, i64, |x| x, |s| s);
num!(u8, i64, |x| x as i64, |a| a as u8, i64, |x| x as i64, |s| s
    as u8);
num!(i8, i64, |x| x as i64, |a| a as i8, i64, |x| x as i64, |s| s
    as i8);
num!(
    i16,
    i64,
    |x| x as i64,
    |a| a as i16,
    i64,
    |x| x as i64,
    |s| s as i16
);
num!(
    u16,
    i64,
    |x| x as i64,
    |a| a as u16,
    i64,
    |x| x as i64,
    |s| s as u16
);
num!(
    u32,
    i64,
    |x| x as i64,
    |a| a as u32,
    i64,
    |x| x as i64,
    |s| s as u32
);
num!(u64, u64, |x| x, |a| a, u64, |x| x, |s| s);

/// One reduction: its identity and combining step (associative, so partials can be merged).
trait Reducer<A>: Copy + Send + Sync {
    const INIT: A;
    fn step(a: A, x: A) -> A;
}

#[derive(Clone, Copy)]
struct SumR;
#[derive(Clone, Copy)]
struct ProdR;
#[derive(Clone, Copy)]
struct MaxR;
#[derive(Clone, Copy)]
struct MinR;

impl<A: Acc> Reducer<A> for SumR {
    const INIT: A = A::ZERO;
    #[inline(always)]
    fn step(a: A, x: A) -> A {
        a.add(x)
    }
}
impl<A: Acc> Reducer<A> for ProdR {
    const INIT: A = A::ONE;
    #[inline(always)]
    fn step(a: A, x: A) -> A {
        a.mul(x)
    }
}
impl<A: Acc> Reducer<A> for MaxR {
    const INIT: A = A::LOWEST;
    #[inline(always)]
    fn step(a: A, x: A) -> A {
        // A NaN accumulator stays (x > NaN is false); a NaN x wins.
        if x > a || x.is_nan() {
            x
        } else {
            a
        }
    }
}
impl<A: Acc> Reducer<A> for MinR {
    const INIT: A = A::HIGHEST;
    #[inline(always)]
    fn step(a: A, x: A) -> A {
        if x < a || x.is_nan() {
            x
        } else {
            a
        }
    }
}
impl Reducer<bool> for AnyR {
    const INIT: bool = false;
    #[inline(always)]
    fn step(a: bool, x: bool) -> bool {
        a | x
    }
}
impl Reducer<bool> for AllR {
    const INIT: bool = true;
    #[inline(always)]
    fn step(a: bool, x: bool) -> bool {
        a & x
    }
}
#[derive(Clone, Copy)]
struct AnyR;
#[derive(Clone, Copy)]
struct AllR;

/// Base block of the pairwise reduction of a contiguous run.
const PAIRWISE_BLOCK: usize = 128;
/// Rows summed into a fresh partial before joining the total in the strided case.
const ROW_BLOCK: usize = 256;

/// Reduces a contiguous run pairwise: blocks of 128 in 8 independent lanes, halves merged
/// recursively.
fn reduce_run<T: Copy, A: Copy, R: Reducer<A>>(xs: &[T], load: &impl Fn(T) -> A) -> A {
    if xs.len() <= PAIRWISE_BLOCK {
        let mut lanes = [R::INIT; 8];
        let mut chunks = xs.chunks_exact(8);
        for c in &mut chunks {
            for j in 0..8 {
                lanes[j] = R::step(lanes[j], load(c[j]));
            }
        }
        let mut a = R::INIT;
        for &x in chunks.remainder() {
            a = R::step(a, load(x));
        }
        let l4 = [
            R::step(lanes[0], lanes[4]),
            R::step(lanes[1], lanes[5]),
            R::step(lanes[2], lanes[6]),
            R::step(lanes[3], lanes[7]),
        ];
        return R::step(a, R::step(R::step(l4[0], l4[2]), R::step(l4[1], l4[3])));
    }
    let half = (xs.len() / 2).next_multiple_of(8);
    let (l, r) = xs.split_at(half.min(xs.len()));
    R::step(
        reduce_run::<T, A, R>(l, load),
        reduce_run::<T, A, R>(r, load),
    )
}

/// Reduces `src` viewed as `[outer, red, inner]` to `[outer, inner]` accumulators, then maps each
/// through `finish`.
fn reduce_lanes<T, A, O, R>(
    src: &[T],
    outer: usize,
    red: usize,
    inner: usize,
    load: impl Fn(T) -> A + Sync,
    finish: impl Fn(A) -> O + Sync,
) -> Vec<O>
where
    T: Copy + Send + Sync,
    A: Copy + Send + Sync,
    O: Copy + Send + Sync + Default,
    R: Reducer<A>,
{
    let mut out = vec![O::default(); outer * inner];
    if out.is_empty() {
        return out;
    }
    let par = src.len() >= PAR_THRESHOLD;
    if inner == 1 {
        if outer == 1 && par {
            // One long run: reduce chunks in parallel, then the partials.
            let parts: Vec<A> = src
                .par_chunks(PAR_THRESHOLD)
                .map(|c| reduce_run::<T, A, R>(c, &load))
                .collect();
            out[0] = finish(reduce_run::<A, A, R>(&parts, &|a| a));
            return out;
        }
        let one = |(o, y): (usize, &mut O)| {
            *y = finish(reduce_run::<T, A, R>(&src[o * red..(o + 1) * red], &load));
        };
        if par {
            out.par_iter_mut()
                .enumerate()
                .with_min_len((PAR_THRESHOLD / red.max(1)).max(1))
                .for_each(one);
        } else {
            out.iter_mut().enumerate().for_each(one);
        }
        return out;
    }
    // Strided: each task owns a block of columns of one outer row.
    const COLS: usize = 512;
    let block = |o: usize, c0: usize, dst: &mut [O]| {
        let w = dst.len();
        // Partials of 256 rows, merged pairwise like a binary counter: level `l` holds the sum of
        // 2^l partials, so the error grows with log(red / 256).
        let mut levels: Vec<Option<Vec<A>>> = Vec::new();
        for r0 in (0..red).step_by(ROW_BLOCK) {
            let mut part = vec![R::INIT; w];
            for r in r0..(r0 + ROW_BLOCK).min(red) {
                let base = (o * red + r) * inner + c0;
                for (p, &x) in part.iter_mut().zip(&src[base..base + w]) {
                    *p = R::step(*p, load(x));
                }
            }
            let mut l = 0;
            loop {
                if l == levels.len() {
                    levels.push(None);
                }
                match levels[l].take() {
                    None => {
                        levels[l] = Some(part);
                        break;
                    }
                    Some(prev) => {
                        for (p, q) in part.iter_mut().zip(prev) {
                            *p = R::step(q, *p);
                        }
                        l += 1;
                    }
                }
            }
        }
        let mut total = vec![R::INIT; w];
        for lv in levels.into_iter().flatten() {
            for (t, p) in total.iter_mut().zip(lv) {
                *t = R::step(*t, p);
            }
        }
        for (d, &t) in dst.iter_mut().zip(&total) {
            *d = finish(t);
        }
    };
    if par {
        out.par_chunks_mut(inner).enumerate().for_each(|(o, row)| {
            row.par_chunks_mut(COLS)
                .enumerate()
                .for_each(|(cb, dst)| block(o, cb * COLS, dst));
        });
    } else {
        for (o, row) in out.chunks_mut(inner).enumerate() {
            for (cb, dst) in row.chunks_mut(COLS).enumerate() {
                block(o, cb * COLS, dst);
            }
        }
    }
    out
}

/// The input as `[outer, red, inner]`: either a view of it as it is (reduced dims contiguous) or a
/// gathered copy with the reduced dims moved to the end.
enum Layout<'a, T> {
    View(&'a [T]),
    Gathered(Vec<T>),
}

fn layout<'a, T: Copy + Send + Sync + Default>(
    src: &'a [T],
    dims: &[usize],
    axes: &[usize],
) -> (Layout<'a, T>, usize, usize, usize) {
    let red: usize = axes.iter().map(|&a| dims[a]).product();
    let outer_n: usize = (0..dims.len())
        .filter(|a| !axes.contains(a))
        .map(|a| dims[a])
        .product();
    // Group the non-trivial dims into runs of reduced / kept.
    let mut groups: Vec<(bool, usize)> = Vec::new();
    for (i, &d) in dims.iter().enumerate() {
        if d == 1 {
            continue;
        }
        let r = axes.contains(&i);
        match groups.last_mut() {
            Some((gr, gd)) if *gr == r => *gd *= d,
            _ => groups.push((r, d)),
        }
    }
    let reduced_groups = groups.iter().filter(|g| g.0).count();
    if reduced_groups <= 1 {
        let mut outer = 1;
        let mut inner = 1;
        let mut seen = false;
        for &(r, d) in &groups {
            if r {
                seen = true;
            } else if seen {
                inner *= d;
            } else {
                outer *= d;
            }
        }
        return (Layout::View(src), outer, red, inner);
    }
    // Permute the reduced axes to the end.
    let strides = Shape::new(dims).strides();
    let order: Vec<usize> = (0..dims.len())
        .filter(|a| !axes.contains(a))
        .chain(axes.iter().copied())
        .collect();
    let pd: Vec<usize> = order.iter().map(|&a| dims[a]).collect();
    let ps: Vec<usize> = order.iter().map(|&a| strides[a]).collect();
    let (cd, cs) = coalesce(&pd, &ps);
    (
        Layout::Gathered(strided_gather(src, 0, &cd, &cs)),
        outer_n,
        red,
        1,
    )
}

fn reduce_num<T: Num>(src: &[T], dims: &[usize], axes: &[usize], kind: ReduceKind) -> Data {
    let (lay, outer, red, inner) = layout(src, dims, axes);
    let s: &[T] = match &lay {
        Layout::View(v) => v,
        Layout::Gathered(v) => v,
    };
    let load = |x: T| x.load();
    let store = |a: T::A| T::store(a);
    let load_s = |x: T| x.load_s();
    let store_s = |a: T::S| T::store_s(a);
    let out = match kind {
        ReduceKind::Sum => reduce_lanes::<_, _, _, SumR>(s, outer, red, inner, load_s, store_s),
        ReduceKind::Mean => {
            reduce_lanes::<_, _, _, SumR>(s, outer, red, inner, load_s, |a: T::S| {
                if red == 0 {
                    T::from_f64(f64::NAN)
                } else {
                    T::store_s(a.div_count(red))
                }
            })
        }
        ReduceKind::Prod => reduce_lanes::<_, _, _, ProdR>(s, outer, red, inner, load_s, store_s),
        ReduceKind::Max => reduce_lanes::<_, _, _, MaxR>(s, outer, red, inner, load, store),
        ReduceKind::Min => reduce_lanes::<_, _, _, MinR>(s, outer, red, inner, load, store),
        ReduceKind::Any | ReduceKind::All => unreachable!("bool reductions dispatch elsewhere"),
    };
    T::wrap(out)
}

fn reduce_bool(src: &[bool], dims: &[usize], axes: &[usize], kind: ReduceKind) -> Data {
    let (lay, outer, red, inner) = layout(src, dims, axes);
    let s: &[bool] = match &lay {
        Layout::View(v) => v,
        Layout::Gathered(v) => v,
    };
    let id = |x: bool| x;
    let out = match kind {
        ReduceKind::All => reduce_lanes::<_, _, _, AllR>(s, outer, red, inner, id, id),
        _ => reduce_lanes::<_, _, _, AnyR>(s, outer, red, inner, id, id),
    };
    Data::Bool(out.into())
}

/// First index of the max (or min) along the middle axis of `[outer, red, inner]`; NaN wins.
fn arg_num<T: Num>(src: &[T], outer: usize, red: usize, inner: usize, max: bool) -> Vec<i64> {
    let better = move |x: T::A, best: T::A| -> bool {
        if best.is_nan() {
            false
        } else if x.is_nan() {
            true
        } else if max {
            x > best
        } else {
            x < best
        }
    };
    let mut out = vec![0i64; outer * inner];
    if inner == 1 {
        // One contiguous run per output.
        for_each_row(&mut out, &[outer], 1, red, |idx, y| {
            let run = &src[idx[0] * red..(idx[0] + 1) * red];
            let mut best = run[0].load();
            for (r, &x) in run.iter().enumerate().skip(1) {
                let x = x.load();
                if better(x, best) {
                    best = x;
                    y[0] = r as i64;
                }
            }
        });
        return out;
    }
    for_each_row(&mut out, &[outer], inner, red * inner, |idx, row| {
        let o = idx[0];
        let base = o * red * inner;
        let mut best: Vec<T::A> = src[base..base + inner].iter().map(|x| x.load()).collect();
        row.fill(0);
        for r in 1..red {
            let line = &src[base + r * inner..base + (r + 1) * inner];
            for ((b, i), &x) in best.iter_mut().zip(row.iter_mut()).zip(line) {
                let x = x.load();
                if better(x, *b) {
                    *b = x;
                    *i = r as i64;
                }
            }
        }
    });
    out
}

/// Runs a reduction on the CPU; `out` is the inferred output type.
pub fn cpu(op: &Op, inputs: &[&HostTensor], out: &TensorType) -> Result<HostTensor> {
    let x = inputs[0];
    let dims = x.dims();
    let empty_err = |what: &str| OpError::Runtime {
        op: op.name(),
        reason: format!("{what} of an empty axis of {} is undefined", x.ty()),
    };
    let data = match op {
        Op::Reduce { kind, axes, .. } => {
            if axes.is_empty() {
                x.data().clone()
            } else {
                let empty = axes.iter().any(|&a| dims[a] == 0);
                if empty && matches!(kind, ReduceKind::Max | ReduceKind::Min) {
                    // The identity of max is −∞ (the dtype's least value for integers), of min
                    // +∞: ONNX's definition of the max or min of nothing.
                    let max = *kind == ReduceKind::Max;
                    // (`full` saturates, so ±∞ gives an integer dtype's extremes.)
                    let v = if max {
                        f64::NEG_INFINITY
                    } else {
                        f64::INFINITY
                    };
                    return Ok(HostTensor::full(out, v));
                }
                match x.data() {
                    Data::F32(v) => reduce_num(v, dims, axes, *kind),
                    Data::F64(v) => reduce_num(v, dims, axes, *kind),
                    Data::F16(v) => reduce_num(v, dims, axes, *kind),
                    Data::BF16(v) => reduce_num(v, dims, axes, *kind),
                    Data::I32(v) => reduce_num(v, dims, axes, *kind),
                    Data::I64(v) => reduce_num(v, dims, axes, *kind),
                    Data::I8(v) => reduce_num(v, dims, axes, *kind),
                    Data::I16(v) => reduce_num(v, dims, axes, *kind),
                    Data::U16(v) => reduce_num(v, dims, axes, *kind),
                    Data::U32(v) => reduce_num(v, dims, axes, *kind),
                    Data::U64(v) => reduce_num(v, dims, axes, *kind),
                    Data::U8(v) => reduce_num(v, dims, axes, *kind),
                    Data::Bool(v) => reduce_bool(v, dims, axes, *kind),
                }
            }
        }
        Op::ArgReduce { kind, axis, .. } => {
            let red = dims[*axis];
            if red == 0 && out.shape.numel() > 0 {
                return Err(empty_err("argmax/argmin"));
            }
            let outer: usize = dims[..*axis].iter().product();
            let inner: usize = dims[*axis + 1..].iter().product();
            let max = *kind == ArgKind::ArgMax;
            let v = match x.data() {
                Data::F32(v) => arg_num(v, outer, red, inner, max),
                Data::F64(v) => arg_num(v, outer, red, inner, max),
                Data::F16(v) => arg_num(v, outer, red, inner, max),
                Data::BF16(v) => arg_num(v, outer, red, inner, max),
                Data::I32(v) => arg_num(v, outer, red, inner, max),
                Data::I64(v) => arg_num(v, outer, red, inner, max),
                Data::I8(v) => arg_num(v, outer, red, inner, max),
                Data::I16(v) => arg_num(v, outer, red, inner, max),
                Data::U16(v) => arg_num(v, outer, red, inner, max),
                Data::U32(v) => arg_num(v, outer, red, inner, max),
                Data::U64(v) => arg_num(v, outer, red, inner, max),
                Data::U8(v) => arg_num(v, outer, red, inner, max),
                Data::Bool(_) => {
                    return Err(dtype_err(op, &[&x.ty()], "needs a numeric dtype"));
                }
            };
            Data::I64(v.into())
        }
        _ => {
            return Err(OpError::Runtime {
                op: op.name(),
                reason: "not a reduction".into(),
            })
        }
    };
    HostTensor::from_data(data, out.shape.clone())
}

/// Gradient rules.
///
/// - sum: `g` reshaped to the kept-dims shape and expanded to the input's.
/// - mean: the same divided by the number of reduced elements.
/// - max/min: `g` goes to the positions equal to the result, split evenly among ties
///   (`g · mask / count(mask)`), which is a valid subgradient and matches PyTorch's `amax`.
/// - prod: exact also with zeros. With `x̃ = where(x == 0, 1, x)`, `p = prod(x̃)` and `z` the
///   number of zeros in the group: a nonzero position gets `g·p/x̃` when `z == 0` and 0 otherwise;
///   a zero position gets `g·p` when `z == 1` (the product of the others) and 0 otherwise.
/// - argmax/argmin/any/all: no gradient.
pub fn vjp(cx: &mut VjpCtx<'_>) -> Result<Vec<Option<Value>>> {
    let (kind, axes) = match cx.op {
        Op::Reduce { kind, axes, .. } => (*kind, axes.clone()),
        _ => return Ok(vec![None]),
    };
    if matches!(kind, ReduceKind::Any | ReduceKind::All) {
        return Ok(vec![None]);
    }
    let x = cx.inputs[0];
    let xt = cx.ty(x);
    if !xt.dtype.is_float() {
        return Ok(vec![None]);
    }
    let g = cx.grad;
    if axes.is_empty() {
        return Ok(vec![Some(g)]);
    }
    let dt = xt.dtype;
    let xs = xt.shape.clone();
    // With or without kept dims, the gradient is first given the kept-dims shape.
    let kept = Shape::new(reduced_dims(xs.dims(), &axes, true));
    let gk = cx.reshape(g, kept.clone())?;
    let count: usize = axes.iter().map(|&a| xs.dims()[a]).product();
    let grad = match kind {
        ReduceKind::Sum => cx.expand(gk, xs)?,
        ReduceKind::Mean => {
            let e = cx.expand(gk, xs)?;
            cx.mul_scalar(e, 1.0 / count as f64)?
        }
        ReduceKind::Max | ReduceKind::Min => {
            let yk = cx.reshape(cx.output, kept)?;
            let eq = cx.binary(BinaryOp::Eq, x, yk)?;
            let mask = cx.cast(eq, dt)?;
            let n = cx.sum(mask, axes, true)?;
            let share = cx.div(gk, n)?;
            cx.mul(mask, share)?
        }
        ReduceKind::Prod => {
            let zero = cx.scalar(0.0, dt)?;
            let one = cx.scalar(1.0, dt)?;
            let is0 = cx.binary(BinaryOp::Eq, x, zero)?;
            let xsafe = cx.emit(Op::Where, &[is0, one, x])?;
            let z = cx.cast(is0, dt)?;
            let nz = cx.sum(z, axes.clone(), true)?;
            let p = cx.emit(
                Op::Reduce {
                    kind: ReduceKind::Prod,
                    axes,
                    keep_dims: true,
                },
                &[xsafe],
            )?;
            let gp = cx.mul(gk, p)?;
            let no_zero = cx.binary(BinaryOp::Eq, nz, zero)?;
            let no_zero = cx.cast(no_zero, dt)?;
            let one_zero = cx.binary(BinaryOp::Eq, nz, one)?;
            let one_zero = cx.cast(one_zero, dt)?;
            let at_nonzero = cx.div(gp, xsafe)?;
            let at_nonzero = cx.mul(at_nonzero, no_zero)?;
            let at_zero = cx.mul(gp, one_zero)?;
            let at_zero = cx.expand(at_zero, xs)?;
            cx.emit(Op::Where, &[is0, at_zero, at_nonzero])?
        }
        ReduceKind::Any | ReduceKind::All => return Ok(vec![None]),
    };
    Ok(vec![Some(grad)])
}
