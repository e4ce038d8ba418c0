//! The reduction loops, written once and instantiated per SIMD level and per
//! reduction.
//!
//! Plain types (f32, f64, i32, i64) are reduced block by block: all sources are
//! combined into one L1-sized block of the destination before moving on. 16-bit
//! floats are reduced chunk by chunk in f32 registers (see `fused`). Either way
//! memory sees each input once and the destination written once per call.
//!
//! The reduction is a type parameter ([`Combine`]: [`Sum`], [`Min`], [`Max`],
//! [`Product`]), chosen once per call, so every op gets its own tight loop with
//! no test of the op inside it.
//!
//! Everything here is `#[inline(always)]` so that it is compiled inside each
//! level's `#[target_feature]` entry point and gets that level's instructions,
//! both in the explicit [`Lanes`] code (16-bit floats) and in the plain loops
//! LLVM vectorises by itself (f32, f64, i32, i64).

use std::mem::size_of;
use std::ops::Range;

use sumflow_wire::{Dtype, ReduceOp};

use super::portable::{self, Scalar};

/// Destination bytes per block of a plain reduction. The block of the
/// destination and of every source stays in L1 while all sources are combined
/// into it, yet blocks are big enough that loop overhead and switching the
/// hardware prefetcher between streams cost little.
const BLOCK_BYTES: usize = 4096;

/// `N` f32 lanes, their arithmetic and their conversions from and to 16-bit
/// floats, as one SIMD level provides them. Pointers are byte pointers of any
/// alignment.
///
/// `min` and `max` must give exactly [`portable::min_f32`] and
/// [`portable::max_f32`] in every lane (NaN gives the canonical quiet NaN, and
/// `-0.0 < +0.0`), so that every level agrees bit for bit; `add` and `mul` are
/// IEEE's, rounding to nearest.
///
/// # Safety
/// Every method may only be called where the CPU supports the implementor's
/// target features, with pointers valid for `N` elements of the type accessed.
pub(super) trait Lanes {
    const N: usize;
    /// Whether the fused loop should take 4 vectors per chunk rather than 1:
    /// independent operations hide latency and amortise fetching each source's
    /// pointer, but LLVM's SLP vectoriser mangles unrolled array lanes.
    const UNROLL4: bool;
    type V: Copy;
    unsafe fn load(p: *const u8) -> Self::V;
    unsafe fn store(p: *mut u8, v: Self::V);
    unsafe fn load_f16(p: *const u8) -> Self::V;
    /// Rounds to nearest, ties to even.
    unsafe fn store_f16(p: *mut u8, v: Self::V);
    unsafe fn load_bf16(p: *const u8) -> Self::V;
    /// Rounds to nearest, ties to even; a NaN stays a (quiet) NaN.
    unsafe fn store_bf16(p: *mut u8, v: Self::V);
    unsafe fn add(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn mul(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn min(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn max(a: Self::V, b: Self::V) -> Self::V;
}

/// Combine into an accumulator: see [`super::Reducer::accumulate`].
///
/// # Safety
/// The CPU supports `L`; the lengths were checked by the caller, and `srcs` is
/// non-empty.
#[inline(always)]
pub(super) unsafe fn accumulate<L: Lanes>(
    dtype: Dtype,
    op: ReduceOp,
    acc: &mut [u8],
    fresh: bool,
    srcs: &[&[u8]],
) {
    // SAFETY: forwarded from our caller, in every arm.
    unsafe {
        match op {
            ReduceOp::Sum => accumulate_by::<L, Sum>(dtype, acc, fresh, srcs),
            ReduceOp::Min => accumulate_by::<L, Min>(dtype, acc, fresh, srcs),
            ReduceOp::Max => accumulate_by::<L, Max>(dtype, acc, fresh, srcs),
            ReduceOp::Product => accumulate_by::<L, Product>(dtype, acc, fresh, srcs),
        }
    }
}

/// Finish a round: see [`super::Reducer::reduce_into`].
///
/// # Safety
/// The CPU supports `L`; the lengths were checked by the caller, and `acc` or
/// `srcs` is non-empty.
#[inline(always)]
pub(super) unsafe fn reduce_into<L: Lanes>(
    dtype: Dtype,
    op: ReduceOp,
    acc: Option<&[u8]>,
    srcs: &[&[u8]],
    out: &mut [u8],
) {
    // SAFETY: forwarded from our caller, in every arm.
    unsafe {
        match op {
            ReduceOp::Sum => reduce_by::<L, Sum>(dtype, acc, srcs, out),
            ReduceOp::Min => reduce_by::<L, Min>(dtype, acc, srcs, out),
            ReduceOp::Max => reduce_by::<L, Max>(dtype, acc, srcs, out),
            ReduceOp::Product => reduce_by::<L, Product>(dtype, acc, srcs, out),
        }
    }
}

/// # Safety
/// As for [`accumulate`].
#[inline(always)]
unsafe fn accumulate_by<L: Lanes, O: Combine>(
    dtype: Dtype,
    acc: &mut [u8],
    fresh: bool,
    srcs: &[&[u8]],
) {
    match dtype {
        Dtype::F32 => plain_accumulate::<f32, O>(acc, fresh, srcs),
        Dtype::F64 => plain_accumulate::<f64, O>(acc, fresh, srcs),
        Dtype::I32 => plain_accumulate::<i32, O>(acc, fresh, srcs),
        Dtype::I64 => plain_accumulate::<i64, O>(acc, fresh, srcs),
        // SAFETY: forwarded from our caller.
        Dtype::F16 => unsafe { accumulate16::<L, O, false>(acc, fresh, srcs) },
        // SAFETY: forwarded from our caller.
        Dtype::Bf16 => unsafe { accumulate16::<L, O, true>(acc, fresh, srcs) },
    }
}

/// # Safety
/// As for [`reduce_into`].
#[inline(always)]
unsafe fn reduce_by<L: Lanes, O: Combine>(
    dtype: Dtype,
    acc: Option<&[u8]>,
    srcs: &[&[u8]],
    out: &mut [u8],
) {
    match dtype {
        Dtype::F32 => plain_reduce::<f32, O>(acc, srcs, out),
        Dtype::F64 => plain_reduce::<f64, O>(acc, srcs, out),
        Dtype::I32 => plain_reduce::<i32, O>(acc, srcs, out),
        Dtype::I64 => plain_reduce::<i64, O>(acc, srcs, out),
        // SAFETY: forwarded from our caller.
        Dtype::F16 => unsafe { reduce16::<L, O, false>(acc, srcs, out) },
        // SAFETY: forwarded from our caller.
        Dtype::Bf16 => unsafe { reduce16::<L, O, true>(acc, srcs, out) },
    }
}

/// Byte ranges of successive blocks of at most `block_elems` of the `n`
/// elements of `size` bytes.
#[inline(always)]
fn blocks(n: usize, block_elems: usize, size: usize) -> impl Iterator<Item = Range<usize>> {
    (0..n)
        .step_by(block_elems)
        .map(move |start| start * size..(start + block_elems).min(n) * size)
}

// ---- the reductions: one zero-sized type per ReduceOp ----

/// How two terms combine, for plain elements and for f32 lanes. Terms are
/// combined left to right, `((t0 op t1) op t2) ...`.
trait Combine {
    fn plain<T: Plain>(a: T, b: T) -> T;

    /// # Safety
    /// The CPU supports `L`.
    unsafe fn lanes<L: Lanes>(a: L::V, b: L::V) -> L::V;
}

struct Sum;
struct Min;
struct Max;
struct Product;

impl Combine for Sum {
    #[inline(always)]
    fn plain<T: Plain>(a: T, b: T) -> T {
        a.plus(b)
    }

    #[inline(always)]
    unsafe fn lanes<L: Lanes>(a: L::V, b: L::V) -> L::V {
        // SAFETY: forwarded from our caller.
        unsafe { L::add(a, b) }
    }
}

impl Combine for Min {
    #[inline(always)]
    fn plain<T: Plain>(a: T, b: T) -> T {
        a.lesser(b)
    }

    #[inline(always)]
    unsafe fn lanes<L: Lanes>(a: L::V, b: L::V) -> L::V {
        // SAFETY: forwarded from our caller.
        unsafe { L::min(a, b) }
    }
}

impl Combine for Max {
    #[inline(always)]
    fn plain<T: Plain>(a: T, b: T) -> T {
        a.greater(b)
    }

    #[inline(always)]
    unsafe fn lanes<L: Lanes>(a: L::V, b: L::V) -> L::V {
        // SAFETY: forwarded from our caller.
        unsafe { L::max(a, b) }
    }
}

impl Combine for Product {
    #[inline(always)]
    fn plain<T: Plain>(a: T, b: T) -> T {
        a.times(b)
    }

    #[inline(always)]
    unsafe fn lanes<L: Lanes>(a: L::V, b: L::V) -> L::V {
        // SAFETY: forwarded from our caller.
        unsafe { L::mul(a, b) }
    }
}

// ---- plain element types: the accumulator type is the wire type ----

/// An element reduced as it is: IEEE arithmetic for floats (min and max as
/// [`portable::min_f32`] describes), two's complement wrapping for integers
/// (the sum and the product keep the low bits, as `wrapping_add` and
/// `wrapping_mul` do).
trait Plain: Copy {
    fn plus(self, other: Self) -> Self;
    fn times(self, other: Self) -> Self;
    fn lesser(self, other: Self) -> Self;
    fn greater(self, other: Self) -> Self;
}

macro_rules! plain_float {
    ($t:ty, $min:path, $max:path) => {
        impl Plain for $t {
            #[inline(always)]
            fn plus(self, other: $t) -> $t {
                self + other
            }

            #[inline(always)]
            fn times(self, other: $t) -> $t {
                self * other
            }

            #[inline(always)]
            fn lesser(self, other: $t) -> $t {
                $min(self, other)
            }

            #[inline(always)]
            fn greater(self, other: $t) -> $t {
                $max(self, other)
            }
        }
    };
}

plain_float!(f32, portable::min_f32, portable::max_f32);
plain_float!(f64, portable::min_f64, portable::max_f64);

macro_rules! plain_int {
    ($t:ty) => {
        impl Plain for $t {
            #[inline(always)]
            fn plus(self, other: $t) -> $t {
                self.wrapping_add(other)
            }

            #[inline(always)]
            fn times(self, other: $t) -> $t {
                self.wrapping_mul(other)
            }

            #[inline(always)]
            fn lesser(self, other: $t) -> $t {
                Ord::min(self, other)
            }

            #[inline(always)]
            fn greater(self, other: $t) -> $t {
                Ord::max(self, other)
            }
        }
    };
}

plain_int!(i32);
plain_int!(i64);

/// `dst[i] = dst[i] op src[i]`. In place rather than `dst = a op b` with
/// `a == dst`, because LLVM only vectorises the latter behind an overlap check
/// that an in-place operation fails.
#[inline(always)]
fn combine_assign<T: Plain, O: Combine>(dst: &mut [u8], src: &[u8]) {
    let n = dst.len() / size_of::<T>();
    assert!(src.len() >= n * size_of::<T>());
    let (d, s) = (dst.as_mut_ptr().cast::<T>(), src.as_ptr().cast::<T>());
    for i in 0..n {
        // SAFETY: i < n, and both slices hold at least n elements of T; the
        // accesses are unaligned-safe and T is plain data.
        unsafe {
            let r = O::plain(d.add(i).read_unaligned(), s.add(i).read_unaligned());
            d.add(i).write_unaligned(r);
        }
    }
}

/// `dst[i] = a[i] op b[i]`.
#[inline(always)]
fn combine_to<T: Plain, O: Combine>(dst: &mut [u8], a: &[u8], b: &[u8]) {
    let n = dst.len() / size_of::<T>();
    assert!(a.len() >= n * size_of::<T>() && b.len() >= n * size_of::<T>());
    let (d, a, b) = (
        dst.as_mut_ptr().cast::<T>(),
        a.as_ptr().cast::<T>(),
        b.as_ptr().cast::<T>(),
    );
    for i in 0..n {
        // SAFETY: as in combine_assign.
        unsafe {
            let r = O::plain(a.add(i).read_unaligned(), b.add(i).read_unaligned());
            d.add(i).write_unaligned(r);
        }
    }
}

/// Sets `dst` to the first terms combined, which must be at least one: a copy
/// of a lone term (so `-0.0` survives a sum, and no op meets an identity
/// element), else the first two combined.
#[inline(always)]
fn start<'a, T: Plain, O: Combine>(dst: &mut [u8], terms: &mut impl Iterator<Item = &'a [u8]>) {
    let first = terms.next().expect("at least one term to reduce");
    match terms.next() {
        Some(second) => combine_to::<T, O>(dst, first, second),
        None => dst.copy_from_slice(first),
    }
}

#[inline(always)]
fn plain_accumulate<T: Plain, O: Combine>(acc: &mut [u8], fresh: bool, srcs: &[&[u8]]) {
    let size = size_of::<T>();
    for r in blocks(acc.len() / size, BLOCK_BYTES / size, size) {
        let dst = &mut acc[r.clone()];
        let mut terms = srcs.iter().map(|s| &s[r.clone()]);
        if fresh {
            start::<T, O>(dst, &mut terms);
        }
        for src in terms {
            combine_assign::<T, O>(dst, src);
        }
    }
}

#[inline(always)]
fn plain_reduce<T: Plain, O: Combine>(acc: Option<&[u8]>, srcs: &[&[u8]], out: &mut [u8]) {
    let size = size_of::<T>();
    for r in blocks(out.len() / size, BLOCK_BYTES / size, size) {
        let dst = &mut out[r.clone()];
        let mut terms = acc
            .map(|a| &a[r.clone()])
            .into_iter()
            .chain(srcs.iter().map(|s| &s[r.clone()]));
        start::<T, O>(dst, &mut terms);
        for src in terms {
            combine_assign::<T, O>(dst, src);
        }
    }
}

// ---- 16-bit floats: every term of a chunk combined in f32 registers ----
//
// No blocks here: a chunk of up to 4 vectors takes its terms from all sources
// at once and leaves only through the final store, so each source is read once
// and the f32 partial results of a round never reach memory, not even L1.

/// `dst[i] = first[i] op srcs[0][i] op srcs[1][i] ...` in f32, stored as f32 or,
/// if `NARROW`, rounded to 16 bits. A null `first` (f32) means the first source
/// is the first term. `first` may be `dst` itself.
///
/// # Safety
/// The CPU supports `L`; dst holds n elements (16-bit if NARROW else f32),
/// first (if non-null) n f32, each source n 16-bit elements; at least one term.
#[inline(always)]
unsafe fn fused<L: Lanes, O: Combine, const BF: bool, const NARROW: bool>(
    dst: *mut u8,
    first: *const u8,
    srcs: &[&[u8]],
    n: usize,
) {
    // Elements 0..wide in chunks of 4 vectors, then single vectors, then scalars.
    let wide = if L::UNROLL4 { n - n % (4 * L::N) } else { 0 };
    let whole = n - n % L::N;
    let (first, rest, wide_first) = if first.is_null() {
        let (head, rest) = srcs.split_first().expect("a term to reduce");
        (head.as_ptr(), rest, false)
    } else {
        (first, srcs, true)
    };
    // SAFETY: forwarded; the ranges are whole chunks of their widths.
    unsafe {
        if wide_first {
            fused_range::<L, O, BF, NARROW, true, 4>(dst, first, rest, 0, wide);
            fused_range::<L, O, BF, NARROW, true, 1>(dst, first, rest, wide, whole);
            fused_range::<Scalar, O, BF, NARROW, true, 1>(dst, first, rest, whole, n);
        } else {
            fused_range::<L, O, BF, NARROW, false, 4>(dst, first, rest, 0, wide);
            fused_range::<L, O, BF, NARROW, false, 1>(dst, first, rest, wide, whole);
            fused_range::<Scalar, O, BF, NARROW, false, 1>(dst, first, rest, whole, n);
        }
    }
}

/// # Safety
/// As for [`fused`], for elements `from..to`, a whole number of `U * L::N` chunks;
/// `first` is f32 if `WIDE_FIRST` else 16-bit.
#[inline(always)]
unsafe fn fused_range<
    L: Lanes,
    O: Combine,
    const BF: bool,
    const NARROW: bool,
    const WIDE_FIRST: bool,
    const U: usize,
>(
    dst: *mut u8,
    first: *const u8,
    rest: &[&[u8]],
    from: usize,
    to: usize,
) {
    let mut i = from;
    while i < to {
        // SAFETY: i + U * L::N <= to, so every access is within the n elements
        // the caller vouched for; the CPU supports L.
        unsafe {
            let mut v = [first_term::<L, BF, WIDE_FIRST>(first, i); U];
            for (j, v) in v.iter_mut().enumerate().skip(1) {
                *v = first_term::<L, BF, WIDE_FIRST>(first, i + j * L::N);
            }
            for src in rest {
                let p = src.as_ptr();
                for (j, v) in v.iter_mut().enumerate() {
                    *v = O::lanes::<L>(*v, load16::<L, BF>(p.add(2 * (i + j * L::N))));
                }
            }
            for (j, v) in v.into_iter().enumerate() {
                let e = i + j * L::N;
                if NARROW {
                    store16::<L, BF>(dst.add(2 * e), v);
                } else {
                    L::store(dst.add(4 * e), v);
                }
            }
        }
        i += U * L::N;
    }
}
/// # Safety
/// The CPU supports `L`; `first` is valid for `L::N` elements from element `e`
/// (f32 if `WIDE` else 16-bit).
#[inline(always)]
unsafe fn first_term<L: Lanes, const BF: bool, const WIDE: bool>(
    first: *const u8,
    e: usize,
) -> L::V {
    // SAFETY: forwarded from our caller.
    unsafe {
        if WIDE {
            L::load(first.add(4 * e))
        } else {
            load16::<L, BF>(first.add(2 * e))
        }
    }
}

/// # Safety
/// The CPU supports `L`; the lengths were checked by the caller.
#[inline(always)]
unsafe fn accumulate16<L: Lanes, O: Combine, const BF: bool>(
    acc: &mut [u8],
    fresh: bool,
    srcs: &[&[u8]],
) {
    let n = acc.len() / 4;
    let dst = acc.as_mut_ptr();
    let first = if fresh {
        std::ptr::null()
    } else {
        dst.cast_const()
    };
    // SAFETY: forwarded; acc holds n f32 and each source n 16-bit elements.
    unsafe { fused::<L, O, BF, false>(dst, first, srcs, n) }
}

/// # Safety
/// The CPU supports `L`; the lengths were checked by the caller.
#[inline(always)]
unsafe fn reduce16<L: Lanes, O: Combine, const BF: bool>(
    acc: Option<&[u8]>,
    srcs: &[&[u8]],
    out: &mut [u8],
) {
    let n = out.len() / 2;
    let first = acc.map_or(std::ptr::null(), <[u8]>::as_ptr);
    // SAFETY: forwarded; out holds n 16-bit elements, acc n f32, each source n
    // 16-bit elements.
    unsafe { fused::<L, O, BF, true>(out.as_mut_ptr(), first, srcs, n) }
}

/// # Safety
/// As for [`Lanes::load_f16`].
#[inline(always)]
unsafe fn load16<L: Lanes, const BF: bool>(p: *const u8) -> L::V {
    // SAFETY: forwarded from our caller.
    unsafe {
        if BF {
            L::load_bf16(p)
        } else {
            L::load_f16(p)
        }
    }
}

/// # Safety
/// As for [`Lanes::store_f16`].
#[inline(always)]
unsafe fn store16<L: Lanes, const BF: bool>(p: *mut u8, v: L::V) {
    // SAFETY: forwarded from our caller.
    unsafe {
        if BF {
            L::store_bf16(p, v);
        } else {
            L::store_f16(p, v);
        }
    }
}
