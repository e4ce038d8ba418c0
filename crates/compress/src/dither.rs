//! Dithering: stochastic quantisation of every element to one of `levels` levels of the
//! largest magnitude (the norm), rounding up with probability equal to the remainder, so
//! that the decoded value is an unbiased estimate of the element.

use sumflow_wire::KeyCodec;

use crate::rng::Rng;
use crate::{f32_at, PayloadError};

/// The largest magnitude; NaN if any element is NaN, so that a NaN is not hidden.
fn norm(input: &[f32]) -> f32 {
    // Eight running maxima and a NaN flag, so the loop needs no early exit and vectorises.
    let mut lanes = [0f32; 8];
    let mut nan = false;
    let chunks = input.chunks_exact(8);
    for &x in chunks.remainder() {
        nan |= x.is_nan();
        lanes[0] = if x.abs() > lanes[0] {
            x.abs()
        } else {
            lanes[0]
        };
    }
    for c in chunks {
        for (lane, x) in lanes.iter_mut().zip(c) {
            let a = x.abs();
            nan |= a.is_nan();
            *lane = if a > *lane { a } else { *lane };
        }
    }
    if nan {
        return f32::NAN;
    }
    lanes.into_iter().fold(0.0, f32::max)
}

pub(crate) fn compress(input: &[f32], levels: u32, rng: &mut Rng, out: &mut [u8]) {
    let norm = norm(input);
    out[..4].copy_from_slice(&norm.to_le_bytes());
    let packed = &mut out[4..];
    packed.fill(0);
    // A zero or non-finite norm sends level 0 everywhere; a non-finite one still decodes
    // to NaN, which the optimizer's overflow checks see.
    if norm == 0.0 || !norm.is_finite() {
        return;
    }
    let bits = KeyCodec::dither_bits(levels) as usize;
    let mask = ((1u16 << bits) - 1) as u8;
    let per_unit = levels as f32 / norm;
    // One 64-bit draw per output byte, cut into 16 random bits for each element (at most
    // four per byte). floor(q + u), u uniform in [0, 1), is floor(q) + 1 with probability
    // q - floor(q): stochastic rounding without a floor (a library call on baseline
    // x86-64) or an int-to-float conversion (a false dependency that serialises the loop).
    let per_byte = 8 / bits;
    for (byte, chunk) in packed.iter_mut().zip(input.chunks(per_byte)) {
        let mut draw = rng.next_u64();
        let mut b = 0u8;
        for (j, &x) in chunk.iter().enumerate() {
            let u = f32::from_bits(0x3f80_0000 | ((draw as u32 & 0xffff) << 7)) - 1.0;
            draw >>= 16;
            let level = ((x.abs() * per_unit + u) as u32).min(levels) as i8;
            let signed = if x < 0.0 { -level } else { level };
            b |= (signed as u8 & mask) << (j * bits);
        }
        *byte = b;
    }
}

pub(crate) fn for_each(payload: &[u8], n: usize, levels: u32, mut f: impl FnMut(usize, f32)) {
    let step = f32_at(payload, 0) / levels as f32;
    for_each_level(payload, n, levels, |i, level| f(i, f32::from(level) * step));
}

/// Every element's signed level.
fn for_each_level(payload: &[u8], n: usize, levels: u32, mut f: impl FnMut(usize, i8)) {
    let bits = KeyCodec::dither_bits(levels) as usize;
    let packed = &payload[4..];
    for i in 0..n {
        let at = i * bits;
        // Sign-extends the field: its top bit lands in the byte's sign bit.
        let raw = packed[at / 8] >> (at % 8) << (8 - bits);
        f(i, raw as i8 >> (8 - bits));
    }
}

pub(crate) fn validate(payload: &[u8], n: usize, levels: u32) -> Result<(), PayloadError> {
    let limit = levels as i8;
    let mut bad = None;
    for_each_level(payload, n, levels, |i, level| {
        if bad.is_none() && !(-limit..=limit).contains(&level) {
            bad = Some((i, level));
        }
    });
    if let Some((position, level)) = bad {
        return Err(PayloadError::Level {
            position,
            level,
            levels,
        });
    }
    let used = n * KeyCodec::dither_bits(levels) as usize % 8;
    if used != 0 && payload[payload.len() - 1] >> used != 0 {
        return Err(PayloadError::Padding);
    }
    Ok(())
}
