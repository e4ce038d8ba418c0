//! 1-bit sign with a scale: every element becomes ±scale, the scale being the mean
//! magnitude, which is the scale that minimises the squared error of a sign vector.

use crate::{f32_at, PayloadError};

pub(crate) fn compress(input: &[f32], out: &mut [u8]) {
    // Eight running sums, so the additions do not wait on each other.
    let mut lanes = [0f64; 8];
    let chunks = input.chunks_exact(8);
    let tail: f64 = chunks.remainder().iter().map(|x| f64::from(x.abs())).sum();
    for c in chunks {
        for (lane, x) in lanes.iter_mut().zip(c) {
            *lane += f64::from(x.abs());
        }
    }
    let l1 = lanes.iter().sum::<f64>() + tail;
    let scale = (l1 / input.len() as f64) as f32;
    out[..4].copy_from_slice(&scale.to_le_bytes());
    let bits = &mut out[4..];
    bits.fill(0);
    for (byte, chunk) in bits.iter_mut().zip(input.chunks(8)) {
        for (b, x) in chunk.iter().enumerate() {
            *byte |= u8::from(*x < 0.0) << b;
        }
    }
}

pub(crate) fn for_each(payload: &[u8], n: usize, mut f: impl FnMut(usize, f32)) {
    let scale = f32_at(payload, 0);
    for i in 0..n {
        let negative = payload[4 + i / 8] >> (i % 8) & 1 == 1;
        f(i, if negative { -scale } else { scale });
    }
}

pub(crate) fn validate(payload: &[u8], n: usize) -> Result<(), PayloadError> {
    let used = n % 8;
    if used != 0 && payload[payload.len() - 1] >> used != 0 {
        return Err(PayloadError::Padding);
    }
    Ok(())
}
