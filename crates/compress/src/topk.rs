//! Top-k: the `k` elements of largest magnitude, as ascending indices and their values.
//!
//! Selection in linear time, without sorting the partition: a threshold estimated from a
//! sample admits about twice k candidates in one pass, and a quickselect over those finds
//! the exact k-th magnitude (if the estimate admitted too few, every element is a
//! candidate, so the result never depends on the sample). Elements tied at the threshold
//! go to the lower indices, so the choice is a function of the input alone. Magnitudes
//! are compared as the bits of |x|, which order like the values, with NaN above infinity:
//! a NaN gradient is always sent, as it would be uncompressed, rather than hidden.

use crate::{f32_at, u32_at, PayloadError, Scratch};

/// |x| as an integer that orders like it.
fn magnitude(x: f32) -> u32 {
    x.to_bits() & 0x7fff_ffff
}

/// Elements the threshold is estimated from.
const SAMPLE: usize = 4096;

pub(crate) fn compress(input: &[f32], k: usize, scratch: &mut Scratch, out: &mut [u8]) {
    let n = input.len();
    let (idx, vals) = out.split_at_mut(4 * k);
    let mut put = |j: usize, i: usize, x: f32| {
        idx[4 * j..4 * j + 4].copy_from_slice(&(i as u32).to_le_bytes());
        vals[4 * j..4 * j + 4].copy_from_slice(&x.to_le_bytes());
    };
    if k == n {
        for (i, &x) in input.iter().enumerate() {
            put(i, i, x);
        }
        return;
    }
    let Scratch {
        magnitudes,
        indices: candidates,
        ..
    } = scratch;
    collect(input, estimate(input, k), candidates);
    if candidates.len() < k {
        collect(input, 0, candidates);
    }
    magnitudes.clear();
    magnitudes.extend(candidates.iter().map(|&i| magnitude(input[i as usize])));
    let cut = magnitudes.len() - k;
    let (_, threshold, above) = magnitudes.select_nth_unstable(cut);
    let threshold = *threshold;
    let mut ties = k - above.iter().filter(|&&m| m > threshold).count();
    let mut j = 0;
    for &i in candidates.iter() {
        let x = input[i as usize];
        let m = magnitude(x);
        let take = m > threshold || (m == threshold && ties > 0);
        if take {
            if m == threshold {
                ties -= 1;
            }
            put(j, i as usize, x);
            j += 1;
            if j == k {
                break;
            }
        }
    }
    debug_assert_eq!(j, k);
}

/// A magnitude that about 2k + 64 elements reach, from an evenly spaced sample; 0 (every
/// element) where that would be most of them anyway.
fn estimate(input: &[f32], k: usize) -> u32 {
    let n = input.len();
    let admit = (2 * k + 64) as f64 / n as f64;
    if n < 4 * SAMPLE || admit >= 0.5 {
        return 0;
    }
    let step = n / SAMPLE;
    let mut sample: Vec<u32> = (0..SAMPLE).map(|s| magnitude(input[s * step])).collect();
    let rank = ((1.0 - admit) * SAMPLE as f64) as usize;
    *sample.select_nth_unstable(rank.min(SAMPLE - 1)).1
}

/// The indices of the elements of at least magnitude `low`, ascending.
fn collect(input: &[f32], low: u32, out: &mut Vec<u32>) {
    out.clear();
    for (i, &x) in input.iter().enumerate() {
        if magnitude(x) >= low {
            out.push(i as u32);
        }
    }
}

/// The `(index, value)` pairs of a checked payload.
pub(crate) fn entries(payload: &[u8], k: usize) -> impl Iterator<Item = (usize, f32)> + '_ {
    (0..k).map(move |j| (u32_at(payload, j) as usize, f32_at(payload, k + j)))
}

pub(crate) fn validate(payload: &[u8], k: usize, n: usize) -> Result<(), PayloadError> {
    let mut previous: Option<u32> = None;
    for j in 0..k {
        let i = u32_at(payload, j);
        if i as usize >= n {
            return Err(PayloadError::IndexRange {
                index: i,
                elements: n,
            });
        }
        if previous.is_some_and(|p| p >= i) {
            return Err(PayloadError::IndexOrder { position: j });
        }
        previous = Some(i);
    }
    Ok(())
}
