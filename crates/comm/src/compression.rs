//! Compression of a tensor's partitions on the worker (see `sumflow-compress`), and the
//! residuals error feedback keeps between rounds.
//!
//! A tensor is declared with a compressor and a ratio or a level count; each of its keys
//! (partitions, and their pieces per lane) then gets a codec of its own size: top-k and
//! random-k keep `ceil(ratio × elements)` of a key's elements. The push thread compresses
//! a key's partition just before sending it, and the receiver decodes the sum straight
//! into the tensor.

use std::collections::HashMap;
use std::fmt;
use std::sync::Mutex;

use sumflow_plan::partition::Partition;
use sumflow_wire::compression::MAX_DITHER_LEVELS;
use sumflow_wire::{Codec, KeyCodec};

use crate::error::CommError;

/// Which compressor a tensor uses, with its parameter.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum CompressorKind {
    /// Keeps the `ratio` of each key's elements with the largest magnitudes.
    TopK { ratio: f64 },
    /// Keeps a `ratio` of each key's elements, drawn at random, the same on every worker.
    RandomK { ratio: f64 },
    /// One bit per element, with the mean magnitude as scale.
    Sign,
    /// Stochastic quantisation to `levels` levels of the largest magnitude.
    Dither { levels: u32 },
}

/// A declared tensor's compression.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Compression {
    pub compressor: CompressorKind,
    /// Error feedback: the worker keeps what compression dropped from each key and adds it
    /// to the key's next push; servers that re-compress sums do the same with theirs.
    pub feedback: bool,
}

impl Compression {
    /// From the names the Python plugin uses: `topk` and `randomk` take a ratio in (0, 1],
    /// `dithering` a whole number of levels, `sign` no parameter (0).
    pub fn parse(name: &str, param: f64, feedback: bool) -> Result<Compression, CommError> {
        let invalid = |why: String| CommError::Invalid(format!("compressor '{name}': {why}"));
        let ratio = || {
            if param > 0.0 && param <= 1.0 {
                Ok(param)
            } else {
                Err(invalid(format!("the ratio must be in (0, 1], not {param}")))
            }
        };
        let compressor = match name {
            "topk" => CompressorKind::TopK { ratio: ratio()? },
            "randomk" => CompressorKind::RandomK { ratio: ratio()? },
            "sign" if param == 0.0 => CompressorKind::Sign,
            "sign" => return Err(invalid(format!("takes no parameter, not {param}"))),
            "dithering" => {
                let max = f64::from(MAX_DITHER_LEVELS);
                if param.fract() != 0.0 || !(1.0..=max).contains(&param) {
                    return Err(invalid(format!(
                        "levels must be a whole number from 1 to {MAX_DITHER_LEVELS}, not {param}"
                    )));
                }
                CompressorKind::Dither {
                    levels: param as u32,
                }
            }
            other => {
                return Err(CommError::Invalid(format!(
                    "unknown compressor '{other}': the core compresses with topk, randomk, sign \
                     and dithering"
                )))
            }
        };
        Ok(Compression {
            compressor,
            feedback,
        })
    }

    /// The codec of a key of `elements` elements (at least one, at most `u32::MAX`).
    pub fn key_codec(&self, elements: u64) -> KeyCodec {
        let keep = |ratio: f64| ((ratio * elements as f64).ceil() as u64).clamp(1, elements) as u32;
        let (codec, param) = match self.compressor {
            CompressorKind::TopK { ratio } => (Codec::TopK, keep(ratio)),
            CompressorKind::RandomK { ratio } => (Codec::RandomK, keep(ratio)),
            CompressorKind::Sign => (Codec::Sign, 0),
            CompressorKind::Dither { levels } => (Codec::Dither, levels),
        };
        KeyCodec {
            codec,
            param,
            feedback: self.feedback,
        }
    }
}

impl fmt::Display for Compression {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.compressor {
            CompressorKind::TopK { ratio } => write!(f, "topk (ratio {ratio})")?,
            CompressorKind::RandomK { ratio } => write!(f, "randomk (ratio {ratio})")?,
            CompressorKind::Sign => f.write_str("sign")?,
            CompressorKind::Dither { levels } => write!(f, "dithering ({levels} levels)")?,
        }
        if self.feedback {
            f.write_str(" with error feedback")?;
        }
        Ok(())
    }
}

/// The residuals of error feedback, one per key, kept between the key's pushes.
///
/// A tensor has one push_pull in flight at a time, so a key's residual is taken by at most
/// one push thread at once; it is taken out while the thread compresses, and put back.
#[derive(Debug, Default)]
pub struct Residuals {
    by_key: Mutex<HashMap<u64, Vec<f32>>>,
}

impl Residuals {
    /// The residual of `key` (zeros the first time), to be given back with [`Self::put`].
    pub fn take(&self, key: u64, elements: usize) -> Vec<f32> {
        let mut map = self.by_key.lock().expect("residuals lock");
        map.remove(&key).unwrap_or_else(|| vec![0.0; elements])
    }

    pub fn put(&self, key: u64, residual: Vec<f32>) {
        self.by_key
            .lock()
            .expect("residuals lock")
            .insert(key, residual);
    }

    /// Drops the residual of a retired key.
    pub fn forget(&self, key: u64) {
        self.by_key.lock().expect("residuals lock").remove(&key);
    }

    /// Moves a tensor's residuals from the keys of one layout to those of another (a new
    /// partition size), so that what feedback holds survives re-partitioning.
    pub fn relayout(&self, old: &[Partition], new: &[Partition]) {
        let mut map = self.by_key.lock().expect("residuals lock");
        let elements = old.iter().map(|p| p.offset + p.bytes).max().unwrap_or(0) as usize / 4;
        let mut whole: Option<Vec<f32>> = None;
        for p in old {
            if let Some(r) = map.remove(&p.key) {
                let w = whole.get_or_insert_with(|| vec![0.0; elements]);
                let first = p.offset as usize / 4;
                w[first..first + r.len()].copy_from_slice(&r);
            }
        }
        let Some(whole) = whole else {
            return;
        };
        for p in new {
            let (first, last) = (p.offset as usize / 4, (p.offset + p.bytes) as usize / 4);
            map.insert(p.key, whole[first..last].to_vec());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratios_become_each_keys_k() {
        let c = Compression::parse("topk", 0.01, true).unwrap();
        assert_eq!(c.key_codec(1000).param, 10);
        assert_eq!(c.key_codec(1001).param, 11);
        assert_eq!(c.key_codec(5).param, 1, "at least one element");
        assert!(c.key_codec(5).feedback);
        let d = Compression::parse("dithering", 7.0, false).unwrap();
        assert_eq!(
            d.key_codec(5),
            KeyCodec {
                codec: Codec::Dither,
                param: 7,
                feedback: false
            }
        );
        assert_eq!(d.to_string(), "dithering (7 levels)");
    }

    #[test]
    fn bad_parameters_are_named() {
        for (name, param, says) in [
            ("topk", 0.0, "(0, 1]"),
            ("randomk", 1.5, "(0, 1]"),
            ("sign", 2.0, "no parameter"),
            ("dithering", 2.5, "whole number"),
            ("dithering", 128.0, "1 to 127"),
            ("zip", 0.0, "unknown compressor 'zip'"),
        ] {
            let e = Compression::parse(name, param, false)
                .unwrap_err()
                .to_string();
            assert!(e.contains(says), "{name} {param}: {e}");
        }
    }

    #[test]
    fn residuals_follow_a_tensor_into_a_new_layout() {
        let r = Residuals::default();
        // Two partitions of 3 and 2 elements, re-cut into 2, 2 and 1.
        let mut a = r.take(10, 3);
        a.copy_from_slice(&[1.0, 2.0, 3.0]);
        r.put(10, a);
        r.put(11, vec![4.0, 5.0]);
        let spans = |spans: &[(u64, u64, u64)]| -> Vec<Partition> {
            spans
                .iter()
                .map(|&(key, offset, bytes)| Partition {
                    key,
                    offset,
                    bytes,
                    ..Partition::default()
                })
                .collect()
        };
        r.relayout(
            &spans(&[(10, 0, 12), (11, 12, 8)]),
            &spans(&[(20, 0, 8), (21, 8, 8), (22, 16, 4)]),
        );
        assert_eq!(r.take(20, 2), [1.0, 2.0]);
        assert_eq!(r.take(21, 2), [3.0, 4.0]);
        assert_eq!(r.take(22, 1), [5.0]);
        assert_eq!(r.take(10, 3), [0.0; 3], "the old keys are gone");
    }
}
