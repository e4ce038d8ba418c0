//! How a key's payloads are encoded: raw elements, or one of the compressed codecs.
//!
//! A key's compression is fixed when it is declared (`InitKey`), so every payload of the
//! key, pushed or pulled, has a length known in advance: `KeyCodec::payload_len`. The
//! algorithms themselves live in the `sumflow-compress` crate; this module only names
//! them, carries their one parameter, and checks what a frame can check without them.

use std::fmt;

use thiserror::Error;

use crate::dtype::Dtype;

/// Payload encoding, the `codec` byte of `InitKey`, `Push` and `PullReply`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Codec {
    /// Raw little-endian elements of the key's dtype.
    Raw = 0,
    /// The `k` elements of largest magnitude: `k` ascending `u32` indices, then their `k`
    /// `f32` values. Summed by decoding; the sum is sent as its own top `k`.
    TopK = 1,
    /// `k` elements at indices drawn from a seed every worker and the server derive from
    /// the key and round: `k` `f32` values only. The same indices on every worker make the
    /// values summable as they are.
    RandomK = 2,
    /// One bit per element with one scale: an `f32` scale (the mean magnitude), then one
    /// bit per element, least significant first, set where the element is negative.
    Sign = 3,
    /// Stochastic quantisation to `levels` levels of the largest magnitude: an `f32` norm,
    /// then one signed level per element in 2, 4 or 8 bits (two's complement, least
    /// significant first).
    Dither = 4,
}

impl Codec {
    pub const ALL: [Codec; 5] = [
        Codec::Raw,
        Codec::TopK,
        Codec::RandomK,
        Codec::Sign,
        Codec::Dither,
    ];

    pub fn from_code(code: u8) -> Option<Codec> {
        Codec::ALL.into_iter().find(|c| *c as u8 == code)
    }

    pub const fn name(self) -> &'static str {
        match self {
            Codec::Raw => "raw",
            Codec::TopK => "topk",
            Codec::RandomK => "randomk",
            Codec::Sign => "sign",
            Codec::Dither => "dithering",
        }
    }

    /// Whether the server can sum payloads as they are (elementwise), with no decoding.
    pub const fn summable(self) -> bool {
        matches!(self, Codec::Raw | Codec::RandomK)
    }
}

impl fmt::Display for Codec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The most levels dithering can use: a level and its sign fit in 8 bits.
pub const MAX_DITHER_LEVELS: u32 = 127;

/// Why a codec does not fit the key it is declared for.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum CodecMismatch {
    #[error("raw keys take no codec parameter and no error feedback")]
    RawWithParameter,
    #[error("{codec} compresses f32 keys, not {dtype}")]
    NotF32 { codec: Codec, dtype: Dtype },
    #[error("{codec} indexes elements with 32 bits: a key of {elements} elements is too long")]
    TooLong { codec: Codec, elements: u64 },
    #[error("{codec} keeps k = {k} of {elements} elements: k must be 1 to {elements}")]
    Keep { codec: Codec, k: u32, elements: u64 },
    #[error("{codec} takes no parameter")]
    Parameter { codec: Codec },
    #[error("{codec} with {levels} levels: levels must be 1 to {MAX_DITHER_LEVELS}")]
    Levels { codec: Codec, levels: u32 },
}

/// A key's compression, as declared by `InitKey`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KeyCodec {
    pub codec: Codec,
    /// `k` for top-k and random-k, the number of levels for dithering, 0 otherwise.
    pub param: u32,
    /// Whether the server keeps what its re-compression of a sum dropped and adds it to
    /// the next round's sum (error feedback on the server's side).
    pub feedback: bool,
}

impl KeyCodec {
    pub const RAW: KeyCodec = KeyCodec {
        codec: Codec::Raw,
        param: 0,
        feedback: false,
    };

    pub fn is_raw(&self) -> bool {
        self.codec == Codec::Raw
    }

    /// Checks the codec against the key it is declared for; the reason when it does not fit.
    pub fn check(&self, dtype: Dtype, elements: u64) -> Result<(), CodecMismatch> {
        let codec = self.codec;
        if codec == Codec::Raw {
            return match (self.param, self.feedback) {
                (0, false) => Ok(()),
                _ => Err(CodecMismatch::RawWithParameter),
            };
        }
        if dtype != Dtype::F32 {
            return Err(CodecMismatch::NotF32 { codec, dtype });
        }
        if elements > u64::from(u32::MAX) {
            return Err(CodecMismatch::TooLong { codec, elements });
        }
        match codec {
            Codec::TopK | Codec::RandomK if !(1..=elements).contains(&u64::from(self.param)) => {
                Err(CodecMismatch::Keep {
                    codec,
                    k: self.param,
                    elements,
                })
            }
            Codec::Sign if self.param != 0 => Err(CodecMismatch::Parameter { codec }),
            Codec::Dither if !(1..=MAX_DITHER_LEVELS).contains(&self.param) => {
                Err(CodecMismatch::Levels {
                    codec,
                    levels: self.param,
                })
            }
            _ => Ok(()),
        }
    }

    /// Bits per element of dithering's levels: the fewest of 2, 4 and 8 that hold
    /// `-levels..=levels`.
    pub fn dither_bits(levels: u32) -> u32 {
        match levels {
            0..=1 => 2,
            2..=7 => 4,
            _ => 8,
        }
    }

    /// Bytes of every payload of a key of `elements` elements of `dtype` (a checked codec).
    pub fn payload_len(&self, dtype: Dtype, elements: u64) -> u64 {
        let k = u64::from(self.param);
        match self.codec {
            Codec::Raw => elements * dtype.size() as u64,
            Codec::TopK => k * 8,
            Codec::RandomK => k * 4,
            Codec::Sign => 4 + elements.div_ceil(8),
            Codec::Dither => 4 + (elements * u64::from(Self::dither_bits(self.param))).div_ceil(8),
        }
    }
}

impl fmt::Display for KeyCodec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.codec {
            Codec::Raw | Codec::Sign => write!(f, "{}", self.codec)?,
            Codec::TopK | Codec::RandomK => write!(f, "{} (k = {})", self.codec, self.param)?,
            Codec::Dither => write!(f, "{} ({} levels)", self.codec, self.param)?,
        }
        if self.feedback {
            f.write_str(" with error feedback")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payload_lengths() {
        let k = |codec, param| KeyCodec {
            codec,
            param,
            feedback: false,
        };
        assert_eq!(k(Codec::Raw, 0).payload_len(Dtype::F16, 10), 20);
        assert_eq!(k(Codec::TopK, 3).payload_len(Dtype::F32, 10), 24);
        assert_eq!(k(Codec::RandomK, 3).payload_len(Dtype::F32, 10), 12);
        assert_eq!(k(Codec::Sign, 0).payload_len(Dtype::F32, 17), 4 + 3);
        assert_eq!(k(Codec::Dither, 1).payload_len(Dtype::F32, 5), 4 + 2);
        assert_eq!(k(Codec::Dither, 7).payload_len(Dtype::F32, 5), 4 + 3);
        assert_eq!(k(Codec::Dither, 8).payload_len(Dtype::F32, 5), 4 + 5);
    }

    #[test]
    fn checks_name_what_is_wrong() {
        let c = |codec, param, feedback| KeyCodec {
            codec,
            param,
            feedback,
        };
        assert!(c(Codec::TopK, 10, true).check(Dtype::F32, 10).is_ok());
        let e = c(Codec::TopK, 11, false).check(Dtype::F32, 10).unwrap_err();
        assert!(e.to_string().contains("k must be 1 to 10"), "{e}");
        let e = c(Codec::Sign, 0, false).check(Dtype::F16, 10).unwrap_err();
        assert!(e.to_string().contains("not f16"), "{e}");
        let e = c(Codec::Dither, 128, false)
            .check(Dtype::F32, 10)
            .unwrap_err();
        assert!(e.to_string().contains("1 to 127"), "{e}");
        assert!(c(Codec::Raw, 0, true).check(Dtype::F32, 10).is_err());
        assert!(c(Codec::RandomK, 0, false).check(Dtype::F32, 10).is_err());
    }
}
