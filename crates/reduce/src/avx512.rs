//! AVX-512F kernels: 16 f32 lanes, hardware f16 conversion. Only AVX-512F is
//! required (no BW/VL), so 16-bit data moves as 256-bit halves and the tails
//! of a call go through the scalar path rather than 16-bit masked loads.
//!
//! AVX-512 intrinsics and `target_feature(enable = "avx512f")` are stable since
//! Rust 1.89, above the workspace's declared rust-version: this module is what
//! needs that bump (see its declaration in `reduce/mod.rs`).

use std::arch::x86_64::*;

use sumflow_wire::{Dtype, ReduceOp};

use super::driver::{self, Lanes};

pub(super) struct Avx512;

impl Lanes for Avx512 {
    const N: usize = 16;
    const UNROLL4: bool = true;
    type V = __m512;

    #[inline(always)]
    unsafe fn load(p: *const u8) -> __m512 {
        // SAFETY: the caller guarantees AVX-512F and 16 readable f32; loadu
        // takes any alignment.
        unsafe { _mm512_loadu_ps(p.cast()) }
    }

    #[inline(always)]
    unsafe fn store(p: *mut u8, v: __m512) {
        // SAFETY: the caller guarantees AVX-512F and 16 writable f32.
        unsafe { _mm512_storeu_ps(p.cast(), v) }
    }

    #[inline(always)]
    unsafe fn load_f16(p: *const u8) -> __m512 {
        // SAFETY: the caller guarantees AVX-512F and 16 readable u16.
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) }
    }

    #[inline(always)]
    unsafe fn store_f16(p: *mut u8, v: __m512) {
        // SAFETY: the caller guarantees AVX-512F and 16 writable u16.
        unsafe {
            let h = _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v);
            _mm256_storeu_si256(p.cast(), h);
        }
    }

    #[inline(always)]
    unsafe fn load_bf16(p: *const u8) -> __m512 {
        // SAFETY: the caller guarantees AVX-512F and 16 readable u16.
        unsafe {
            let wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast()));
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(wide))
        }
    }

    #[inline(always)]
    unsafe fn store_bf16(p: *mut u8, v: __m512) {
        // SAFETY: the caller guarantees AVX-512F and 16 writable u16.
        unsafe {
            // Same bit arithmetic as portable::f32_to_bf16.
            let bits = _mm512_castps_si512(v);
            let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(1));
            let bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF));
            let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(bits, bias));
            let abs = _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFF_FFFF));
            let nan = _mm512_cmpgt_epu32_mask(abs, _mm512_set1_epi32(0x7F80_0000));
            let quiet = _mm512_or_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(0x40));
            let r = _mm512_mask_blend_epi32(nan, rounded, quiet);
            // Every lane is <= 0xFFFF, so the truncating narrow is exact.
            _mm256_storeu_si256(p.cast(), _mm512_cvtepi32_epi16(r));
        }
    }

    #[inline(always)]
    unsafe fn add(a: __m512, b: __m512) -> __m512 {
        // SAFETY: the caller guarantees AVX-512F.
        unsafe { _mm512_add_ps(a, b) }
    }

    #[inline(always)]
    unsafe fn mul(a: __m512, b: __m512) -> __m512 {
        // SAFETY: the caller guarantees AVX-512F.
        unsafe { _mm512_mul_ps(a, b) }
    }

    #[inline(always)]
    unsafe fn min(a: __m512, b: __m512) -> __m512 {
        // SAFETY: the caller guarantees AVX-512F.
        unsafe {
            // vminps returns its second operand when the two compare equal
            // (±0) or either is NaN; or-ing both orders gives -0.0 for a
            // signed-zero pair and the minimum otherwise (portable::min_f32).
            // The float or/and are AVX-512DQ: integer ones do the same.
            let ab = _mm512_castps_si512(_mm512_min_ps(a, b));
            let ba = _mm512_castps_si512(_mm512_min_ps(b, a));
            let m = _mm512_castsi512_ps(_mm512_or_si512(ab, ba));
            let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(a, b);
            _mm512_mask_blend_ps(nan, m, _mm512_set1_ps(f32::NAN))
        }
    }

    #[inline(always)]
    unsafe fn max(a: __m512, b: __m512) -> __m512 {
        // SAFETY: the caller guarantees AVX-512F.
        unsafe {
            // As min, and-ing: +0.0 for a signed-zero pair (portable::max_f32).
            let ab = _mm512_castps_si512(_mm512_max_ps(a, b));
            let ba = _mm512_castps_si512(_mm512_max_ps(b, a));
            let m = _mm512_castsi512_ps(_mm512_and_si512(ab, ba));
            let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(a, b);
            _mm512_mask_blend_ps(nan, m, _mm512_set1_ps(f32::NAN))
        }
    }
}

/// # Safety
/// The CPU supports AVX-512F; Reducer checked the lengths and that srcs is
/// non-empty.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn accumulate(
    dtype: Dtype,
    op: ReduceOp,
    acc: &mut [u8],
    fresh: bool,
    srcs: &[&[u8]],
) {
    // SAFETY: forwarded from our caller; this function enables Avx512's
    // features.
    unsafe { driver::accumulate::<Avx512>(dtype, op, acc, fresh, srcs) }
}

/// # Safety
/// The CPU supports AVX-512F; Reducer checked the lengths and that acc or srcs
/// is non-empty.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn reduce_into(
    dtype: Dtype,
    op: ReduceOp,
    acc: Option<&[u8]>,
    srcs: &[&[u8]],
    out: &mut [u8],
) {
    // SAFETY: forwarded from our caller; this function enables Avx512's
    // features.
    unsafe { driver::reduce_into::<Avx512>(dtype, op, acc, srcs, out) }
}
