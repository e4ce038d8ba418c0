//! Gradient compressors with error feedback, shared by workers and summation servers.
//!
//! A key declared with a compressed codec ([`sumflow_wire::KeyCodec`]) has every push and
//! every sum encoded by one of four compressors (BytePS §9 lists them; GradientFlow's
//! coarse-grained sparsity lives in the PyTorch plugin instead):
//!
//! | codec | payload | the server |
//! |---|---|---|
//! | top-k | the k largest magnitudes: indices and values | decodes, sums, sends the sum's top k |
//! | random-k | k values at indices drawn from a seed all parties share | sums the values as they are |
//! | sign | a scale and one bit per element | decodes, sums, sends the sum's signs and scale |
//! | dithering | a norm and a stochastic level per element | decodes, sums, quantises the sum again |
//!
//! *Error feedback* keeps what compression dropped (the residual) and adds it to the next
//! input of the same key, so nothing is lost, only delayed:
//! `decoded(sent) + new residual = input + previous residual`
//! ([`Compressor::compress_with_feedback`]). Workers keep one residual per key; a server
//! keeps one for its re-compression of each sum when the key asks for it.
//!
//! Every payload a peer sends is checked before it is decoded ([`Compressor::validate`]),
//! so a malformed one is refused whole instead of summed in part.

mod dither;
mod randomk;
pub mod rng;
mod sign;
mod topk;

use sumflow_wire::{Codec, Dtype, KeyCodec};
use thiserror::Error;

pub use rng::Seed;

/// Why a payload cannot be decoded.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum PayloadError {
    #[error("{got} bytes where the key's codec makes {expected}")]
    Length { got: usize, expected: usize },
    #[error("index {index} is outside the key's {elements} elements")]
    IndexRange { index: u32, elements: usize },
    #[error("indices must ascend strictly, and entry {position} does not")]
    IndexOrder { position: usize },
    #[error("element {position} has level {level}, outside -{levels}..={levels}")]
    Level {
        position: usize,
        level: i8,
        levels: u32,
    },
    #[error("the bits past the last element must be zero")]
    Padding,
}

/// Why a compressor cannot be made for a key.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
#[error("cannot compress a key of {elements} elements with {codec}: {why}")]
pub struct CodecError {
    pub codec: KeyCodec,
    pub elements: usize,
    pub why: String,
}

/// Memory a compressor reuses from call to call; one per thread that compresses.
#[derive(Debug, Default)]
pub struct Scratch {
    magnitudes: Vec<u32>,
    bitmap: Vec<u64>,
    indices: Vec<u32>,
}

/// The compressor of one key: its codec and element count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Compressor {
    codec: KeyCodec,
    elements: usize,
}

impl Compressor {
    /// A compressor for `elements` f32 elements; raw keys need none.
    pub fn new(codec: KeyCodec, elements: usize) -> Result<Compressor, CodecError> {
        let fail = |why: String| CodecError {
            codec,
            elements,
            why,
        };
        if codec.is_raw() {
            return Err(fail("raw keys are not compressed".into()));
        }
        codec
            .check(Dtype::F32, elements as u64)
            .map_err(|e| fail(e.to_string()))?;
        Ok(Compressor { codec, elements })
    }

    pub fn codec(&self) -> KeyCodec {
        self.codec
    }

    pub fn elements(&self) -> usize {
        self.elements
    }

    /// Bytes of every payload.
    pub fn payload_len(&self) -> usize {
        self.codec.payload_len(Dtype::F32, self.elements as u64) as usize
    }

    fn k(&self) -> usize {
        self.codec.param as usize
    }

    /// Encodes `input` into `out`, [`Self::payload_len`] bytes.
    pub fn compress(&self, input: &[f32], seed: Seed, scratch: &mut Scratch, out: &mut [u8]) {
        assert_eq!(input.len(), self.elements, "input length");
        assert_eq!(out.len(), self.payload_len(), "payload length");
        match self.codec.codec {
            Codec::TopK => topk::compress(input, self.k(), scratch, out),
            Codec::RandomK => {
                self.random_indices(seed, scratch);
                for (j, &i) in scratch.indices.iter().enumerate() {
                    out[4 * j..4 * j + 4].copy_from_slice(&input[i as usize].to_le_bytes());
                }
            }
            Codec::Sign => sign::compress(input, out),
            Codec::Dither => dither::compress(input, self.codec.param, &mut seed.rng(), out),
            Codec::Raw => unreachable!("Compressor::new refuses raw keys"),
        }
    }

    /// Encodes `input + residual` into `out` and leaves in `residual` what the encoding
    /// dropped, so that `decoded(out) + residual` equals `input + residual` as it was.
    pub fn compress_with_feedback(
        &self,
        input: &[f32],
        residual: &mut [f32],
        seed: Seed,
        scratch: &mut Scratch,
        out: &mut [u8],
    ) {
        assert_eq!(residual.len(), self.elements, "residual length");
        for (r, x) in residual.iter_mut().zip(input) {
            *r += x;
        }
        self.compress(residual, seed, scratch, out);
        // Sent elements of the sparse codecs are dropped from the residual exactly (not
        // subtracted, which would turn an infinity into NaN).
        match self.codec.codec {
            Codec::TopK => topk::entries(out, self.k()).for_each(|(i, _)| residual[i] = 0.0),
            Codec::RandomK => scratch
                .indices
                .iter()
                .for_each(|&i| residual[i as usize] = 0.0),
            _ => self.for_each_dense(out, |i, v| residual[i] -= v),
        }
    }

    /// Writes the decoded payload into `out`, every element.
    pub fn decompress(&self, payload: &[u8], seed: Seed, scratch: &mut Scratch, out: &mut [f32]) {
        assert_eq!(out.len(), self.elements, "output length");
        match self.codec.codec {
            Codec::TopK | Codec::RandomK => {
                out.fill(0.0);
                self.for_each_sparse(payload, seed, scratch, |i, v| out[i] = v);
            }
            _ => self.for_each_dense(payload, |i, v| out[i] = v),
        }
    }

    /// Adds the decoded payload to `acc`.
    pub fn decompress_add(
        &self,
        payload: &[u8],
        seed: Seed,
        scratch: &mut Scratch,
        acc: &mut [f32],
    ) {
        assert_eq!(acc.len(), self.elements, "accumulator length");
        match self.codec.codec {
            Codec::TopK | Codec::RandomK => {
                self.for_each_sparse(payload, seed, scratch, |i, v| acc[i] += v);
            }
            _ => self.for_each_dense(payload, |i, v| acc[i] += v),
        }
    }

    /// Checks a payload from a peer: its length, and that it decodes to exactly the key's
    /// elements (indices in range and ascending, levels in range, padding bits zero).
    /// Values themselves are not judged: a NaN or an infinity is summed as it would be
    /// uncompressed.
    pub fn validate(&self, payload: &[u8]) -> Result<(), PayloadError> {
        let expected = self.payload_len();
        if payload.len() != expected {
            return Err(PayloadError::Length {
                got: payload.len(),
                expected,
            });
        }
        match self.codec.codec {
            Codec::TopK => topk::validate(payload, self.k(), self.elements),
            Codec::Sign => sign::validate(payload, self.elements),
            Codec::Dither => dither::validate(payload, self.elements, self.codec.param),
            Codec::RandomK | Codec::Raw => Ok(()),
        }
    }

    fn random_indices(&self, seed: Seed, scratch: &mut Scratch) {
        randomk::indices(
            self.elements,
            self.k(),
            seed,
            &mut scratch.bitmap,
            &mut scratch.indices,
        );
    }

    fn for_each_sparse(
        &self,
        payload: &[u8],
        seed: Seed,
        scratch: &mut Scratch,
        mut f: impl FnMut(usize, f32),
    ) {
        if self.codec.codec == Codec::TopK {
            topk::entries(payload, self.k()).for_each(|(i, v)| f(i, v));
        } else {
            self.random_indices(seed, scratch);
            for (j, &i) in scratch.indices.iter().enumerate() {
                f(i as usize, f32_at(payload, j));
            }
        }
    }

    fn for_each_dense(&self, payload: &[u8], f: impl FnMut(usize, f32)) {
        match self.codec.codec {
            Codec::Sign => sign::for_each(payload, self.elements, f),
            _ => dither::for_each(payload, self.elements, self.codec.param, f),
        }
    }
}

/// The `f32` in the `word`-th 4 bytes of `payload`.
fn f32_at(payload: &[u8], word: usize) -> f32 {
    f32::from_le_bytes(payload[4 * word..4 * word + 4].try_into().expect("4 bytes"))
}

/// The `u32` in the `word`-th 4 bytes of `payload`.
fn u32_at(payload: &[u8], word: usize) -> u32 {
    u32::from_le_bytes(payload[4 * word..4 * word + 4].try_into().expect("4 bytes"))
}

#[cfg(test)]
mod tests;
