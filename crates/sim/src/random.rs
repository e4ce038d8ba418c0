//! Seeded draws for what the simulator lets vary (a machine's pace, a connection's share
//! of its NIC): splitmix64, one independent stream per thing that varies, so a simulation
//! is reproducible from its seed and adding one stream leaves the others' draws alone.

/// Streams of connections start here, after any machine's.
pub const CONNECTION_STREAMS: u64 = 1 << 32;

#[derive(Clone, Debug)]
pub struct Stream {
    state: u64,
}

impl Stream {
    /// Stream `stream` of the simulation seeded with `seed`.
    pub fn new(seed: u64, stream: u64) -> Stream {
        Stream {
            state: seed ^ stream.wrapping_add(1).wrapping_mul(0xD1B5_4A32_D192_ED03),
        }
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        // 1 - u: in (0, 1], so the logarithm is finite.
        let u1 = 1.0 - self.uniform();
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniforms_cover_the_unit_interval_evenly() {
        let mut s = Stream::new(3, 0);
        let mut bins = [0u32; 10];
        for _ in 0..100_000 {
            let u = s.uniform();
            assert!((0.0..1.0).contains(&u));
            bins[(u * 10.0) as usize] += 1;
        }
        assert!(
            bins.iter().all(|&b| (9_500..10_500).contains(&b)),
            "{bins:?}"
        );
    }

    #[test]
    fn streams_and_seeds_draw_differently_and_repeat() {
        let draw = |seed, stream| {
            let mut s = Stream::new(seed, stream);
            (0..4).map(|_| s.uniform()).collect::<Vec<_>>()
        };
        assert_eq!(draw(5, 0), draw(5, 0));
        assert_ne!(draw(5, 0), draw(5, 1));
        assert_ne!(draw(5, 0), draw(6, 0));
        assert_ne!(draw(5, 0), draw(5, CONNECTION_STREAMS));
    }
}
