//! Compute jitter: a worker machine's pace in each iteration, a log-normal factor with mean
//! 1 and a given coefficient of variation that stretches or shrinks all its layers' times.
//!
//! Why per iteration and per machine: a machine that is slower in an iteration (another
//! process on its CPUs, a throttled GPU) is slower for the whole of it, and its pushes reach
//! the servers after the others', so every round waits for it. Noise drawn per layer would
//! average out over a model's hundreds of layers and leave the machines in step.

use crate::random::Stream;

#[derive(Clone, Debug)]
pub struct Pace {
    draws: Stream,
    /// The log-normal's sigma (0: no jitter).
    sigma: f64,
}

impl Pace {
    /// The pace of machine `machine` for a simulation seeded with `seed`, varying by `cv`.
    pub fn new(cv: f64, seed: u64, machine: u32) -> Pace {
        Pace {
            draws: Stream::new(seed, u64::from(machine)),
            sigma: (1.0 + cv * cv).ln().sqrt(),
        }
    }

    /// The factor for the next iteration.
    pub fn next_factor(&mut self) -> f64 {
        if self.sigma == 0.0 {
            return 1.0;
        }
        let z = self.draws.normal();
        (self.sigma * z - self.sigma * self.sigma / 2.0).exp()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_jitter_keeps_the_profiles_times() {
        let mut p = Pace::new(0.0, 7, 3);
        assert!((0..100).all(|_| p.next_factor() == 1.0));
    }

    #[test]
    fn factors_have_mean_one_and_the_asked_variation() {
        let mut p = Pace::new(0.2, 1, 0);
        let xs: Vec<f64> = (0..200_000).map(|_| p.next_factor()).collect();
        let mean = xs.iter().sum::<f64>() / xs.len() as f64;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / xs.len() as f64;
        assert!((mean - 1.0).abs() < 0.005, "mean {mean}");
        assert!(
            (var.sqrt() / mean - 0.2).abs() < 0.005,
            "cv {}",
            var.sqrt() / mean
        );
        assert!(xs.iter().all(|&x| x > 0.0));
    }

    #[test]
    fn machines_draw_differently_and_a_seed_repeats() {
        let draw = |seed, m| {
            let mut p = Pace::new(0.1, seed, m);
            (0..5).map(|_| p.next_factor()).collect::<Vec<_>>()
        };
        assert_eq!(draw(5, 0), draw(5, 0));
        assert_ne!(draw(5, 0), draw(5, 1));
        assert_ne!(draw(5, 0), draw(6, 0));
    }
}
