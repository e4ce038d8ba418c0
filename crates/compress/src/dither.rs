//! Dithering: stochastic quantisation of every element to one of `levels` levels of the
//! largest magnitude (the norm), rounding up with probability equal to the remainder, so
//! that the decoded value is an unbiased estimate of the element.

use sumflow_wire::KeyCodec;

use crate::rng::Rng;
use crate::{f32_at, PayloadError};

/// The largest magnitude; NaN if any element is NaN, so that a NaN is not hidden.
fn norm(input: &[f32]) -> f32 {
    let mut max = 0f32;
    for &x in input {
        if x.is_nan() {
            return f32::NAN;
        }
        max = max.max(x.abs());
    }
    max
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
    let mask = (1u16 << bits) as u8 - 1;
    let per_unit = levels as f32 / norm;
    for (i, &x) in input.iter().enumerate() {
        let q = x.abs() * per_unit;
        let floor = q.floor();
        let up = rng.unit_f32() < q - floor;
        let level = (floor as u32 + u32::from(up)).min(levels) as i8;
        let signed = if x < 0.0 { -level } else { level };
        let at = i * bits;
        packed[at / 8] |= (signed as u8 & mask) << (at % 8);
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
