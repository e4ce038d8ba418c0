//! Top-k: the `k` elements of largest magnitude, as ascending indices and their values.
//!
//! Selection is a quickselect over the magnitudes (linear time, no sort). Elements tied at
//! the threshold go to the lower indices, so the choice is a function of the input alone.
//! NaN compares above every number, so a NaN gradient is always sent, as it would be
//! uncompressed, rather than hidden.

use std::cmp::Ordering;

use crate::{f32_at, u32_at, PayloadError};

pub(crate) fn compress(input: &[f32], k: usize, magnitudes: &mut Vec<f32>, out: &mut [u8]) {
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
    magnitudes.clear();
    magnitudes.extend(input.iter().map(|x| x.abs()));
    let (_, threshold, above) = magnitudes.select_nth_unstable_by(n - k, f32::total_cmp);
    let threshold = *threshold;
    let greater = above
        .iter()
        .filter(|m| m.total_cmp(&threshold) == Ordering::Greater)
        .count();
    let mut ties = k - greater;
    let mut j = 0;
    for (i, &x) in input.iter().enumerate() {
        let take = match x.abs().total_cmp(&threshold) {
            Ordering::Greater => true,
            Ordering::Equal if ties > 0 => {
                ties -= 1;
                true
            }
            _ => false,
        };
        if take {
            put(j, i, x);
            j += 1;
            if j == k {
                break;
            }
        }
    }
    debug_assert_eq!(j, k);
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
