//! The summation loops, written once and instantiated per SIMD level.
//!
//! Plain types (f32, f64, i32, i64) are summed block by block: all sources are
//! added into one L1-sized block of the destination before moving on. 16-bit
//! floats are summed chunk by chunk in f32 registers (see `fused`). Either way
//! memory sees each input once and the destination written once per call.
//!
//! Everything here is `#[inline(always)]` so that it is compiled inside each
//! level's `#[target_feature]` entry point and gets that level's instructions,
//! both in the explicit [`Lanes`] code (16-bit floats) and in the plain loops
//! LLVM vectorises by itself (f32, f64, i32, i64).

use std::mem::size_of;
use std::ops::Range;

use sumflow_wire::Dtype;

use super::portable::Scalar;

/// Destination bytes per block of a plain sum. The block of the destination and
/// of every source stays in L1 while all sources are added into it, yet blocks
/// are big enough that loop overhead and switching the hardware prefetcher
/// between streams cost little.
const BLOCK_BYTES: usize = 4096;

/// `N` f32 lanes and their conversions from and to 16-bit floats, as one SIMD
/// level provides them. Pointers are byte pointers of any alignment.
///
/// # Safety
/// Every method may only be called where the CPU supports the implementor's
/// target features, with pointers valid for `N` elements of the type accessed.
pub(super) trait Lanes {
    const N: usize;
    /// Whether the fused loop should take 4 vectors per chunk rather than 1:
    /// independent adds hide latency and amortise fetching each source's
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
}

/// Sum into an accumulator: see [`super::Reducer::accumulate`].
///
/// # Safety
/// The CPU supports `L`; the lengths were checked by the caller, and `srcs` is
/// non-empty.
#[inline(always)]
pub(super) unsafe fn accumulate<L: Lanes>(
    dtype: Dtype,
    acc: &mut [u8],
    fresh: bool,
    srcs: &[&[u8]],
) {
    match dtype {
        Dtype::F32 => plain_accumulate::<f32>(acc, fresh, srcs),
        Dtype::F64 => plain_accumulate::<f64>(acc, fresh, srcs),
        Dtype::I32 => plain_accumulate::<i32>(acc, fresh, srcs),
        Dtype::I64 => plain_accumulate::<i64>(acc, fresh, srcs),
        // SAFETY: forwarded from our caller.
        Dtype::F16 => unsafe { accumulate16::<L, false>(acc, fresh, srcs) },
        // SAFETY: forwarded from our caller.
        Dtype::Bf16 => unsafe { accumulate16::<L, true>(acc, fresh, srcs) },
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
    acc: Option<&[u8]>,
    srcs: &[&[u8]],
    out: &mut [u8],
) {
    match dtype {
        Dtype::F32 => plain_reduce::<f32>(acc, srcs, out),
        Dtype::F64 => plain_reduce::<f64>(acc, srcs, out),
        Dtype::I32 => plain_reduce::<i32>(acc, srcs, out),
        Dtype::I64 => plain_reduce::<i64>(acc, srcs, out),
        // SAFETY: forwarded from our caller.
        Dtype::F16 => unsafe { reduce16::<L, false>(acc, srcs, out) },
        // SAFETY: forwarded from our caller.
        Dtype::Bf16 => unsafe { reduce16::<L, true>(acc, srcs, out) },
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

// ---- plain element types: the accumulator type is the wire type ----

/// An element summed by a plain add: IEEE for floats, wrapping for integers.
trait Plain: Copy {
    fn plus(self, other: Self) -> Self;
}

impl Plain for f32 {
    #[inline(always)]
    fn plus(self, other: f32) -> f32 {
        self + other
    }
}

impl Plain for f64 {
    #[inline(always)]
    fn plus(self, other: f64) -> f64 {
        self + other
    }
}

impl Plain for i32 {
    #[inline(always)]
    fn plus(self, other: i32) -> i32 {
        self.wrapping_add(other)
    }
}

impl Plain for i64 {
    #[inline(always)]
    fn plus(self, other: i64) -> i64 {
        self.wrapping_add(other)
    }
}

/// `dst[i] += src[i]`. In place rather than `dst = a + b` with `a == dst`,
/// because LLVM only vectorises the latter behind an overlap check that an
/// in-place sum fails.
#[inline(always)]
fn add_assign<T: Plain>(dst: &mut [u8], src: &[u8]) {
    let n = dst.len() / size_of::<T>();
    assert!(src.len() >= n * size_of::<T>());
    let (d, s) = (dst.as_mut_ptr().cast::<T>(), src.as_ptr().cast::<T>());
    for i in 0..n {
        // SAFETY: i < n, and both slices hold at least n elements of T; the
        // accesses are unaligned-safe and T is plain data.
        unsafe {
            let sum = d.add(i).read_unaligned().plus(s.add(i).read_unaligned());
            d.add(i).write_unaligned(sum);
        }
    }
}

/// `dst[i] = a[i] + b[i]`.
#[inline(always)]
fn add_to<T: Plain>(dst: &mut [u8], a: &[u8], b: &[u8]) {
    let n = dst.len() / size_of::<T>();
    assert!(a.len() >= n * size_of::<T>() && b.len() >= n * size_of::<T>());
    let (d, a, b) = (
        dst.as_mut_ptr().cast::<T>(),
        a.as_ptr().cast::<T>(),
        b.as_ptr().cast::<T>(),
    );
    for i in 0..n {
        // SAFETY: as in add_assign.
        unsafe {
            let sum = a.add(i).read_unaligned().plus(b.add(i).read_unaligned());
            d.add(i).write_unaligned(sum);
        }
    }
}

/// Sets `dst` to the sum of the first terms, which must be at least one: a copy
/// of a lone term (so `-0.0` survives), else the first two added.
#[inline(always)]
fn start_sum<'a, T: Plain>(dst: &mut [u8], terms: &mut impl Iterator<Item = &'a [u8]>) {
    let first = terms.next().expect("at least one term to sum");
    match terms.next() {
        Some(second) => add_to::<T>(dst, first, second),
        None => dst.copy_from_slice(first),
    }
}

#[inline(always)]
fn plain_accumulate<T: Plain>(acc: &mut [u8], fresh: bool, srcs: &[&[u8]]) {
    let size = size_of::<T>();
    for r in blocks(acc.len() / size, BLOCK_BYTES / size, size) {
        let dst = &mut acc[r.clone()];
        let mut terms = srcs.iter().map(|s| &s[r.clone()]);
        if fresh {
            start_sum::<T>(dst, &mut terms);
        }
        for src in terms {
            add_assign::<T>(dst, src);
        }
    }
}

#[inline(always)]
fn plain_reduce<T: Plain>(acc: Option<&[u8]>, srcs: &[&[u8]], out: &mut [u8]) {
    let size = size_of::<T>();
    for r in blocks(out.len() / size, BLOCK_BYTES / size, size) {
        let dst = &mut out[r.clone()];
        let mut terms = acc
            .map(|a| &a[r.clone()])
            .into_iter()
            .chain(srcs.iter().map(|s| &s[r.clone()]));
        start_sum::<T>(dst, &mut terms);
        for src in terms {
            add_assign::<T>(dst, src);
        }
    }
}

// ---- 16-bit floats: every term of a chunk summed in f32 registers ----
//
// No blocks here: a chunk of up to 4 vectors takes its terms from all sources
// at once and leaves only through the final store, so each source is read once
// and the f32 partial sums of a round never reach memory, not even L1.

/// `dst[i] = first[i] + srcs[0][i] + srcs[1][i] + ...` in f32, stored as f32 or,
/// if `NARROW`, rounded to 16 bits. A null `first` (f32) means the first source
/// is the first term. `first` may be `dst` itself.
///
/// # Safety
/// The CPU supports `L`; dst holds n elements (16-bit if NARROW else f32),
/// first (if non-null) n f32, each source n 16-bit elements; at least one term.
#[inline(always)]
unsafe fn fused<L: Lanes, const BF: bool, const NARROW: bool>(
    dst: *mut u8,
    first: *const u8,
    srcs: &[&[u8]],
    n: usize,
) {
    // Elements 0..wide in chunks of 4 vectors, then single vectors, then scalars.
    let wide = if L::UNROLL4 { n - n % (4 * L::N) } else { 0 };
    let whole = n - n % L::N;
    let (first, rest, wide_first) = if first.is_null() {
        let (head, rest) = srcs.split_first().expect("a term to sum");
        (head.as_ptr(), rest, false)
    } else {
        (first, srcs, true)
    };
    // SAFETY: forwarded; the ranges are whole chunks of their widths.
    unsafe {
        if wide_first {
            fused_range::<L, BF, NARROW, true, 4>(dst, first, rest, 0, wide);
            fused_range::<L, BF, NARROW, true, 1>(dst, first, rest, wide, whole);
            fused_range::<Scalar, BF, NARROW, true, 1>(dst, first, rest, whole, n);
        } else {
            fused_range::<L, BF, NARROW, false, 4>(dst, first, rest, 0, wide);
            fused_range::<L, BF, NARROW, false, 1>(dst, first, rest, wide, whole);
            fused_range::<Scalar, BF, NARROW, false, 1>(dst, first, rest, whole, n);
        }
    }
}

/// # Safety
/// As for [`fused`], for elements `from..to`, a whole number of `U * L::N` chunks;
/// `first` is f32 if `WIDE_FIRST` else 16-bit.
#[inline(always)]
unsafe fn fused_range<
    L: Lanes,
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
                    *v = L::add(*v, load16::<L, BF>(p.add(2 * (i + j * L::N))));
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
unsafe fn accumulate16<L: Lanes, const BF: bool>(acc: &mut [u8], fresh: bool, srcs: &[&[u8]]) {
    let n = acc.len() / 4;
    let dst = acc.as_mut_ptr();
    let first = if fresh {
        std::ptr::null()
    } else {
        dst.cast_const()
    };
    // SAFETY: forwarded; acc holds n f32 and each source n 16-bit elements.
    unsafe { fused::<L, BF, false>(dst, first, srcs, n) }
}

/// # Safety
/// The CPU supports `L`; the lengths were checked by the caller.
#[inline(always)]
unsafe fn reduce16<L: Lanes, const BF: bool>(acc: Option<&[u8]>, srcs: &[&[u8]], out: &mut [u8]) {
    let n = out.len() / 2;
    let first = acc.map_or(std::ptr::null(), <[u8]>::as_ptr);
    // SAFETY: forwarded; out holds n 16-bit elements, acc n f32, each source n
    // 16-bit elements.
    unsafe { fused::<L, BF, true>(out.as_mut_ptr(), first, srcs, n) }
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
