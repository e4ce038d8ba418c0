//! AVX2 + F16C kernels: 8 f32 lanes, hardware f16 conversion.

use std::arch::x86_64::*;

use sumflow_wire::{Dtype, ReduceOp};

use super::driver::{self, Lanes};

pub(super) struct Avx2;

impl Lanes for Avx2 {
    const N: usize = 8;
    const UNROLL4: bool = true;
    type V = __m256;

    #[inline(always)]
    unsafe fn load(p: *const u8) -> __m256 {
        // SAFETY: the caller guarantees AVX and 8 readable f32; loadu takes any
        // alignment.
        unsafe { _mm256_loadu_ps(p.cast()) }
    }

    #[inline(always)]
    unsafe fn store(p: *mut u8, v: __m256) {
        // SAFETY: the caller guarantees AVX and 8 writable f32; any alignment.
        unsafe { _mm256_storeu_ps(p.cast(), v) }
    }

    #[inline(always)]
    unsafe fn load_f16(p: *const u8) -> __m256 {
        // SAFETY: the caller guarantees F16C and 8 readable u16; any alignment.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
    }

    #[inline(always)]
    unsafe fn store_f16(p: *mut u8, v: __m256) {
        // SAFETY: the caller guarantees F16C and 8 writable u16; any alignment.
        unsafe { _mm_storeu_si128(p.cast(), _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v)) }
    }

    #[inline(always)]
    unsafe fn load_bf16(p: *const u8) -> __m256 {
        // SAFETY: the caller guarantees AVX2 and 8 readable u16; any alignment.
        unsafe {
            let wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast()));
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(wide))
        }
    }

    #[inline(always)]
    unsafe fn store_bf16(p: *mut u8, v: __m256) {
        // SAFETY: the caller guarantees AVX2 (which implies SSE4.1 for the
        // 128-bit pack) and 8 writable u16; any alignment.
        unsafe {
            // Same bit arithmetic as portable::f32_to_bf16.
            let bits = _mm256_castps_si256(v);
            let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(bits), _mm256_set1_epi32(1));
            let bias = _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF));
            let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(bits, bias));
            // |bits| fits in 31 bits, so the signed compare is an unsigned one.
            let abs = _mm256_and_si256(bits, _mm256_set1_epi32(0x7FFF_FFFF));
            let nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7F80_0000));
            let quiet = _mm256_or_si256(_mm256_srli_epi32::<16>(bits), _mm256_set1_epi32(0x40));
            let r = _mm256_blendv_epi8(rounded, quiet, nan);
            // Every lane is <= 0xFFFF, so the saturating pack is exact.
            let lo = _mm256_castsi256_si128(r);
            let hi = _mm256_extracti128_si256::<1>(r);
            _mm_storeu_si128(p.cast(), _mm_packus_epi32(lo, hi));
        }
    }

    #[inline(always)]
    unsafe fn add(a: __m256, b: __m256) -> __m256 {
        // SAFETY: the caller guarantees AVX.
        unsafe { _mm256_add_ps(a, b) }
    }

    #[inline(always)]
    unsafe fn mul(a: __m256, b: __m256) -> __m256 {
        // SAFETY: the caller guarantees AVX.
        unsafe { _mm256_mul_ps(a, b) }
    }

    #[inline(always)]
    unsafe fn min(a: __m256, b: __m256) -> __m256 {
        // SAFETY: the caller guarantees AVX.
        unsafe {
            // vminps returns its second operand when the two compare equal
            // (±0) or either is NaN; or-ing both orders gives -0.0 for a
            // signed-zero pair and the minimum otherwise (portable::min_f32).
            let m = _mm256_or_ps(_mm256_min_ps(a, b), _mm256_min_ps(b, a));
            let nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(a, b);
            _mm256_blendv_ps(m, _mm256_set1_ps(f32::NAN), nan)
        }
    }

    #[inline(always)]
    unsafe fn max(a: __m256, b: __m256) -> __m256 {
        // SAFETY: the caller guarantees AVX.
        unsafe {
            // As min, and-ing: +0.0 for a signed-zero pair (portable::max_f32).
            let m = _mm256_and_ps(_mm256_max_ps(a, b), _mm256_max_ps(b, a));
            let nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(a, b);
            _mm256_blendv_ps(m, _mm256_set1_ps(f32::NAN), nan)
        }
    }
}

/// # Safety
/// The CPU supports AVX2 and F16C; Reducer checked the lengths and that srcs is
/// non-empty.
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn accumulate(
    dtype: Dtype,
    op: ReduceOp,
    acc: &mut [u8],
    fresh: bool,
    srcs: &[&[u8]],
) {
    // SAFETY: forwarded from our caller; this function enables Avx2's features.
    unsafe { driver::accumulate::<Avx2>(dtype, op, acc, fresh, srcs) }
}

/// # Safety
/// The CPU supports AVX2 and F16C; Reducer checked the lengths and that acc or
/// srcs is non-empty.
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn reduce_into(
    dtype: Dtype,
    op: ReduceOp,
    acc: Option<&[u8]>,
    srcs: &[&[u8]],
    out: &mut [u8],
) {
    // SAFETY: forwarded from our caller; this function enables Avx2's features.
    unsafe { driver::reduce_into::<Avx2>(dtype, op, acc, srcs, out) }
}
