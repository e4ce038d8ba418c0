//! The randomness of random-k and dithering: reproducible streams derived from a key, a
//! round and a stream number.
//!
//! Random-k needs every worker and the server to draw the same indices for a key's round
//! without talking, so its stream is a pure function of (key, round). Dithering rounds
//! each worker's elements independently, so each worker draws from its own stream. Being
//! reproducible also makes every compressed push of a test run the same bytes each time.

/// Where a payload's random draws come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Seed {
    pub key: u64,
    pub round: u64,
    /// Which party draws: the worker's rank, or [`Seed::SERVER`]. Random-k ignores it.
    pub stream: u64,
}

impl Seed {
    /// The stream of the summation server's re-compression of a sum.
    pub const SERVER: u64 = u64::MAX;

    pub fn new(key: u64, round: u64, stream: u64) -> Seed {
        Seed { key, round, stream }
    }

    /// The generator of this seed's draws.
    pub fn rng(self) -> Rng {
        let mut r = Rng(self.key);
        let a = r.next_u64() ^ self.round;
        let mut r = Rng(a);
        Rng(r.next_u64() ^ self.stream)
    }

    /// The generator shared by every party for this key and round.
    pub fn shared_rng(self) -> Rng {
        Seed { stream: 0, ..self }.rng()
    }
}

/// SplitMix64: one 64-bit add and a few multiply-xorshift steps per draw, statistically
/// good enough for sampling and stochastic rounding, and trivially seeded.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..=max`, by the multiply-shift map (bias below 2^-32 for any `max`
    /// an index can take).
    pub fn below_or_equal(&mut self, max: u64) -> u64 {
        ((u128::from(self.next_u64()) * (u128::from(max) + 1)) >> 64) as u64
    }

    /// Uniform in `[0, 1)` with 24 random bits, all an `f32` in that range can hold.
    pub fn unit_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_are_reproducible_and_distinct() {
        let draw = |s: Seed| (0..4).map(|_| s.rng().next_u64()).collect::<Vec<_>>();
        let a = Seed::new(7, 3, 0);
        assert_eq!(draw(a), draw(a));
        for other in [Seed::new(8, 3, 0), Seed::new(7, 4, 0), Seed::new(7, 3, 1)] {
            assert_ne!(a.rng().next_u64(), other.rng().next_u64(), "{other:?}");
        }
        assert_eq!(
            Seed::new(7, 3, 5).shared_rng().next_u64(),
            Seed::new(7, 3, 9).shared_rng().next_u64()
        );
    }

    #[test]
    fn draws_cover_their_ranges_evenly() {
        let mut r = Seed::new(1, 1, 1).rng();
        let mut counts = [0u32; 5];
        for _ in 0..50_000 {
            counts[r.below_or_equal(4) as usize] += 1;
        }
        for c in counts {
            assert!((9_000..11_000).contains(&c), "{counts:?}");
        }
        let mean: f64 = (0..50_000).map(|_| f64::from(r.unit_f32())).sum::<f64>() / 50_000.0;
        assert!((mean - 0.5).abs() < 0.01, "{mean}");
    }
}
