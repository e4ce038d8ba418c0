//! Random-k: `k` elements at indices every party draws from the same seed.
//!
//! Only the values travel. Because every worker draws the same indices for a key's round,
//! the servers sum the values as they are, and the sum is exact: nothing is re-compressed.
//! Values are not rescaled by n/k: with error feedback what is not sent this round is sent
//! later, and without it the scaled estimate's variance grows with n/k.

use crate::rng::Seed;

/// The `k` indices of `0..n` that `seed` draws, ascending, written to `out`.
///
/// Floyd's sampling without replacement, over a bitmap so that the indices come out in
/// order with no sort: k draws, then one pass over n/64 words.
pub(crate) fn indices(n: usize, k: usize, seed: Seed, bitmap: &mut Vec<u64>, out: &mut Vec<u32>) {
    out.clear();
    if k == n {
        out.extend(0..n as u32);
        return;
    }
    bitmap.clear();
    bitmap.resize(n.div_ceil(64), 0);
    let mut rng = seed.shared_rng();
    for j in n - k..n {
        let t = rng.below_or_equal(j as u64) as usize;
        let pick = if bitmap[t / 64] >> (t % 64) & 1 == 1 {
            j
        } else {
            t
        };
        bitmap[pick / 64] |= 1 << (pick % 64);
    }
    for (w, &word) in bitmap.iter().enumerate() {
        let mut bits = word;
        while bits != 0 {
            out.push((w * 64) as u32 + bits.trailing_zeros());
            bits &= bits - 1;
        }
    }
}
