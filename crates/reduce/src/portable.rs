//! Plain-Rust kernels: the fallback off x86_64 or without AVX2+F16C, and the
//! scalar tails of the SIMD levels.
//!
//! The 16-bit conversions are written branch-free (selects only) so that LLVM
//! can vectorise the 8-lane [`Array8`] with whatever the baseline target has,
//! and they round exactly like F16C and the bf16 bit arithmetic of the SIMD
//! levels, so a tail agrees with its vectors.

use sumflow_wire::{Dtype, ReduceOp};

use super::driver::{self, Lanes};

macro_rules! float_min_max {
    ($t:ty, $min:ident, $max:ident) => {
        /// The lesser of `a` and `b`, as torch.minimum and IEEE 754-2019's
        /// `minimum`: NaN if either is NaN (always the canonical quiet NaN, with
        /// a positive sign and no payload, whatever NaN came in), and
        /// `-0.0 < +0.0`, so the result never depends on the order of the
        /// operands.
        ///
        /// Written as x86's `min(a, b) = if a < b { a } else { b }` both ways
        /// round and or-ed, selects that LLVM turns into `minps` (the SIMD
        /// levels spell out the same): for ordered operands both give the
        /// lesser, except that equal ones (which differ at most in the sign of
        /// a zero) give `a | b`, `-0.0` if either is.
        #[inline(always)]
        pub(super) fn $min(a: $t, b: $t) -> $t {
            let ab = if a < b { a } else { b };
            let ba = if b < a { b } else { a };
            let m = <$t>::from_bits(ab.to_bits() | ba.to_bits());
            if a.is_nan() || b.is_nan() {
                <$t>::NAN
            } else {
                m
            }
        }

        /// The greater of `a` and `b`: as the minimum, with `+0.0 > -0.0`
        /// (x86's `max` both ways round, and-ed: `+0.0` unless both are
        /// `-0.0`).
        #[inline(always)]
        pub(super) fn $max(a: $t, b: $t) -> $t {
            let ab = if a > b { a } else { b };
            let ba = if b > a { b } else { a };
            let m = <$t>::from_bits(ab.to_bits() & ba.to_bits());
            if a.is_nan() || b.is_nan() {
                <$t>::NAN
            } else {
                m
            }
        }
    };
}

float_min_max!(f32, min_f32, max_f32);
float_min_max!(f64, min_f64, max_f64);

/// f16 -> f32, exact.
#[inline(always)]
pub(super) fn f16_to_f32(h: u16) -> f32 {
    let h = u32::from(h);
    let sign = (h & 0x8000) << 16;
    let em = h & 0x7FFF;
    // Normal: rebias the exponent (by 127 - 15). Subnormal: the mantissa counts
    // steps of 2^-24, converted exactly without any f32 subnormal arithmetic
    // (which DAZ, if some library set it, would flush).
    let normal = (em << 13) + 0x3800_0000;
    let subnormal = ((em as i32) as f32 * f32::from_bits(0x3380_0000)).to_bits();
    // Comparisons on i32 (the values are small) map onto SSE2's signed compares.
    let finite = if (em as i32) < 0x0400 {
        subnormal
    } else {
        normal
    };
    // Inf and NaN keep their payload under the all-ones f32 exponent.
    let special = (em << 13) | 0x7F80_0000;
    f32::from_bits(if em as i32 >= 0x7C00 { special } else { finite } | sign)
}

/// f32 -> f16, rounding to nearest, ties to even; overflow gives ±Inf and a
/// NaN stays a (quiet) NaN.
#[inline(always)]
pub(super) fn f32_to_f16(v: f32) -> u16 {
    let bits = v.to_bits();
    let sign = (bits >> 16) & 0x8000;
    let abs = bits & 0x7FFF_FFFF;
    // Normal results: rebias the exponent, add just under half an ulp plus the
    // kept lsb (so exact ties go to even) and truncate; a carry rounds into the
    // next binade, or to Inf from the top one.
    let lsb = (abs >> 13) & 1;
    let normal = abs.wrapping_sub(0x3800_0000).wrapping_add(0xFFF + lsb) >> 13;
    // Subnormal results: adding 0.5, whose ulp is the f16 subnormal step 2^-24,
    // makes the FPU round to a whole number of steps (ties to even); a result
    // of 0x400 is the smallest normal, as it should be.
    let subnormal = (f32::from_bits(abs) + 0.5).to_bits() - 0x3F00_0000;
    let nan = 0x7E00 | ((abs >> 13) & 0x3FF);
    let a = abs as i32; // signed compares vectorise on SSE2; abs < 2^31
    let mag = if a > 0x7F80_0000 {
        nan
    } else if a >= 0x4780_0000 {
        0x7C00
    } else if a < 0x3880_0000 {
        subnormal
    } else {
        normal
    };
    (mag | sign) as u16
}

/// bf16 -> f32, exact.
#[inline(always)]
pub(super) fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits(u32::from(h) << 16)
}

/// f32 -> bf16, rounding to nearest, ties to even, by adding just under half
/// an ulp (plus the kept lsb, which turns exact ties towards even) and
/// truncating. The SIMD levels do the same bit arithmetic.
#[inline(always)]
pub(super) fn f32_to_bf16(v: f32) -> u16 {
    let bits = v.to_bits();
    // No overflow: the largest non-NaN pattern, -Inf, is 0xFF80_0000.
    let rounded = bits.wrapping_add(0x7FFF + ((bits >> 16) & 1)) >> 16;
    // The rounding carry would turn a NaN into Inf (or wrap to -0.0): keep its
    // top payload bits instead, quieted.
    let nan = (bits >> 16) | 0x0040;
    (if bits & 0x7FFF_FFFF > 0x7F80_0000 {
        nan
    } else {
        rounded
    }) as u16
}

/// One f32 "lane": the tails of every level.
pub(super) struct Scalar;

impl Lanes for Scalar {
    const N: usize = 1;
    const UNROLL4: bool = false;
    type V = f32;

    #[inline(always)]
    unsafe fn load(p: *const u8) -> f32 {
        // SAFETY: the caller guarantees p is valid for one f32; unaligned read.
        unsafe { p.cast::<f32>().read_unaligned() }
    }

    #[inline(always)]
    unsafe fn store(p: *mut u8, v: f32) {
        // SAFETY: the caller guarantees p is valid for one f32; unaligned write.
        unsafe { p.cast::<f32>().write_unaligned(v) }
    }

    #[inline(always)]
    unsafe fn load_f16(p: *const u8) -> f32 {
        // SAFETY: the caller guarantees p is valid for one u16; unaligned read.
        f16_to_f32(unsafe { p.cast::<u16>().read_unaligned() })
    }

    #[inline(always)]
    unsafe fn store_f16(p: *mut u8, v: f32) {
        // SAFETY: the caller guarantees p is valid for one u16; unaligned write.
        unsafe { p.cast::<u16>().write_unaligned(f32_to_f16(v)) }
    }

    #[inline(always)]
    unsafe fn load_bf16(p: *const u8) -> f32 {
        // SAFETY: the caller guarantees p is valid for one u16; unaligned read.
        bf16_to_f32(unsafe { p.cast::<u16>().read_unaligned() })
    }

    #[inline(always)]
    unsafe fn store_bf16(p: *mut u8, v: f32) {
        // SAFETY: the caller guarantees p is valid for one u16; unaligned write.
        unsafe { p.cast::<u16>().write_unaligned(f32_to_bf16(v)) }
    }

    #[inline(always)]
    unsafe fn add(a: f32, b: f32) -> f32 {
        a + b
    }

    #[inline(always)]
    unsafe fn mul(a: f32, b: f32) -> f32 {
        a * b
    }

    #[inline(always)]
    unsafe fn min(a: f32, b: f32) -> f32 {
        min_f32(a, b)
    }

    #[inline(always)]
    unsafe fn max(a: f32, b: f32) -> f32 {
        max_f32(a, b)
    }
}

/// Eight f32 lanes as a plain array: element-wise loops that LLVM turns into
/// the baseline target's vectors (SSE2 on x86_64, NEON on aarch64).
pub(super) struct Array8;

const W: usize = 8;

/// Reads `W` elements of `T` from `p`.
///
/// # Safety
/// p is valid for `W` reads of `T` (any alignment).
#[inline(always)]
unsafe fn read8<T: Copy + Default>(p: *const u8) -> [T; W] {
    let mut v = [T::default(); W];
    for (j, x) in v.iter_mut().enumerate() {
        // SAFETY: j < W, within the caller's guarantee; unaligned read.
        *x = unsafe { p.cast::<T>().add(j).read_unaligned() };
    }
    v
}

/// Writes `W` elements of `T` to `p`.
///
/// # Safety
/// p is valid for `W` writes of `T` (any alignment).
#[inline(always)]
unsafe fn write8<T: Copy>(p: *mut u8, v: [T; W]) {
    for (j, x) in v.into_iter().enumerate() {
        // SAFETY: j < W, within the caller's guarantee; unaligned write.
        unsafe { p.cast::<T>().add(j).write_unaligned(x) };
    }
}

/// Element-wise conversion; a plain loop rather than `array::map`, which LLVM
/// leaves as an out-of-line call instead of vectorising.
#[inline(always)]
fn convert8<A: Copy, B: Copy + Default>(a: [A; W], f: impl Fn(A) -> B) -> [B; W] {
    let mut b = [B::default(); W];
    for (y, x) in b.iter_mut().zip(a) {
        *y = f(x);
    }
    b
}

impl Lanes for Array8 {
    const N: usize = W;
    const UNROLL4: bool = false;
    type V = [f32; W];

    #[inline(always)]
    unsafe fn load(p: *const u8) -> [f32; W] {
        // SAFETY: the caller guarantees p is valid for N f32.
        unsafe { read8(p) }
    }

    #[inline(always)]
    unsafe fn store(p: *mut u8, v: [f32; W]) {
        // SAFETY: the caller guarantees p is valid for N f32.
        unsafe { write8(p, v) }
    }

    #[inline(always)]
    unsafe fn load_f16(p: *const u8) -> [f32; W] {
        // SAFETY: the caller guarantees p is valid for N u16.
        convert8(unsafe { read8::<u16>(p) }, f16_to_f32)
    }

    #[inline(always)]
    unsafe fn store_f16(p: *mut u8, v: [f32; W]) {
        // SAFETY: the caller guarantees p is valid for N u16.
        unsafe { write8(p, convert8(v, f32_to_f16)) }
    }

    #[inline(always)]
    unsafe fn load_bf16(p: *const u8) -> [f32; W] {
        // SAFETY: the caller guarantees p is valid for N u16.
        convert8(unsafe { read8::<u16>(p) }, bf16_to_f32)
    }

    #[inline(always)]
    unsafe fn store_bf16(p: *mut u8, v: [f32; W]) {
        // SAFETY: the caller guarantees p is valid for N u16.
        unsafe { write8(p, convert8(v, f32_to_bf16)) }
    }

    #[inline(always)]
    unsafe fn add(a: [f32; W], b: [f32; W]) -> [f32; W] {
        zip8(a, b, |x, y| x + y)
    }

    #[inline(always)]
    unsafe fn mul(a: [f32; W], b: [f32; W]) -> [f32; W] {
        zip8(a, b, |x, y| x * y)
    }

    #[inline(always)]
    unsafe fn min(a: [f32; W], b: [f32; W]) -> [f32; W] {
        zip8(a, b, min_f32)
    }

    #[inline(always)]
    unsafe fn max(a: [f32; W], b: [f32; W]) -> [f32; W] {
        zip8(a, b, max_f32)
    }
}

/// Element-wise `f(a[j], b[j])`, in place in `a`: a plain loop, as `convert8`.
#[inline(always)]
fn zip8(mut a: [f32; W], b: [f32; W], f: impl Fn(f32, f32) -> f32) -> [f32; W] {
    for (x, y) in a.iter_mut().zip(b) {
        *x = f(*x, y);
    }
    a
}

pub(super) fn accumulate(dtype: Dtype, op: ReduceOp, acc: &mut [u8], fresh: bool, srcs: &[&[u8]]) {
    // SAFETY: Array8 needs no target feature; Reducer checked the lengths and
    // that srcs is non-empty.
    unsafe { driver::accumulate::<Array8>(dtype, op, acc, fresh, srcs) }
}

pub(super) fn reduce_into(
    dtype: Dtype,
    op: ReduceOp,
    acc: Option<&[u8]>,
    srcs: &[&[u8]],
    out: &mut [u8],
) {
    // SAFETY: Array8 needs no target feature; Reducer checked the lengths and
    // that acc or srcs is non-empty.
    unsafe { driver::reduce_into::<Array8>(dtype, op, acc, srcs, out) }
}
