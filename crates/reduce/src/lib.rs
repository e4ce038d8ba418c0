//! sumflow's reduction kernels, shared by the summation servers and the workers'
//! shared-memory stage: combine pushed partitions into a key's accumulator, or
//! finish a round of pushes into the dtype-sized result in one pass, by a
//! round's [`ReduceOp`]: sum, min, max or product.
//!
//! The buffers are far larger than any cache, so the kernels are written around
//! memory traffic: with several sources, every source is read once and the
//! destination read and written once per call, whatever the number of sources
//! (plain types are reduced in L1-sized blocks, 16-bit floats in registers).
//! 16-bit floats are reduced in `f32` and rounded to 16 bits once, at the end.
//!
//! Three implementations exist (AVX-512, AVX2+F16C, portable Rust); the best one
//! the CPU supports is chosen at run time, and every one gives bit-identical
//! results (NaN payloads of sums and products aside).
//!
//! What each op does to an element, in the accumulator type (f32 for the
//! 16-bit floats, else the dtype itself), terms taken left to right:
//!
//! - **Sum** and **Product**: IEEE addition and multiplication for floats,
//!   rounding to nearest; for i32 and i64, two's complement wrapping (the low
//!   bits of the exact result, as `wrapping_add` and `wrapping_mul`): an
//!   overflowing product wraps just as an overflowing sum does, it does not
//!   saturate. A 16-bit product is formed in f32 and rounded once, so its
//!   partial products neither overflow nor lose bits to 16-bit rounding.
//! - **Min** and **Max**: as torch.minimum and torch.maximum, and IEEE
//!   754-2019's `minimum` and `maximum`: a NaN among the terms makes the result
//!   NaN, and `-0.0 < +0.0`. Every level gives the canonical quiet NaN
//!   (`f32::NAN`, `f64::NAN`; 0x7E00 as f16, 0x7FC0 as bf16), whatever NaN came
//!   in, so min and max agree bit for bit, NaNs included, and do not depend on
//!   the order of the terms. For 16-bit floats the result is one of the terms,
//!   so rounding it back is exact. Integers compare as signed.
//!
//! A lone term is copied (converted), never combined with an identity element:
//! a lone `-0.0` stays `-0.0`, and a lone NaN is passed on, not made canonical.

// Every unsafe operation, even inside an unsafe fn, gets its own block and
// SAFETY comment.
#![deny(unsafe_op_in_unsafe_fn)]

pub mod buffer;
mod driver;
mod portable;

#[cfg(target_arch = "x86_64")]
mod avx2;
// AVX-512 intrinsics are stable since 1.89; the workspace rust-version must be
// raised to match (it cannot be met below 1.89 either way).
#[cfg(target_arch = "x86_64")]
#[clippy::msrv = "1.89"]
mod avx512;

#[cfg(test)]
mod tests;

use std::fmt;

use sumflow_wire::{Dtype, ReduceOp};

/// An instruction-set level the kernels are compiled for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SimdLevel {
    /// AVX-512F: 16 f32 lanes, hardware f16 conversion.
    Avx512,
    /// AVX2 with F16C: 8 f32 lanes, hardware f16 conversion.
    Avx2F16c,
    /// Plain Rust, whatever the compiler makes of it; runs everywhere.
    Portable,
}

impl SimdLevel {
    /// Every level, best first.
    const ALL: [SimdLevel; 3] = [SimdLevel::Avx512, SimdLevel::Avx2F16c, SimdLevel::Portable];

    /// The best level this CPU supports.
    pub fn detect() -> SimdLevel {
        Self::ALL
            .into_iter()
            .find(|level| level.supported())
            .unwrap_or(SimdLevel::Portable)
    }

    /// Whether this CPU (and OS) can run this level's code.
    pub fn supported(self) -> bool {
        match self {
            SimdLevel::Portable => true,
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx512 => std::arch::is_x86_feature_detected!("avx512f"),
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx2F16c => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("f16c")
            }
            #[cfg(not(target_arch = "x86_64"))]
            SimdLevel::Avx512 | SimdLevel::Avx2F16c => false,
        }
    }

    /// Every level this CPU can run, best first.
    pub fn available() -> Vec<SimdLevel> {
        Self::ALL.into_iter().filter(|l| l.supported()).collect()
    }

    pub fn name(self) -> &'static str {
        match self {
            SimdLevel::Avx512 => "avx512",
            SimdLevel::Avx2F16c => "avx2+f16c",
            SimdLevel::Portable => "portable",
        }
    }
}

impl fmt::Display for SimdLevel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A [`Reducer`] was asked for a level this CPU cannot run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("SIMD level {level} is not supported by this CPU")]
pub struct UnsupportedLevel {
    pub level: SimdLevel,
}

/// Runs the reduction kernels of one [`SimdLevel`].
///
/// Invariant: `level` is supported by the CPU (checked at construction), which
/// is what makes calling its `#[target_feature]` code sound.
#[derive(Clone, Copy, Debug)]
pub struct Reducer {
    level: SimdLevel,
}

impl Reducer {
    /// A reducer using the best level the CPU supports.
    pub fn detect() -> Reducer {
        Reducer {
            level: SimdLevel::detect(),
        }
    }

    pub fn with_level(level: SimdLevel) -> Result<Reducer, UnsupportedLevel> {
        if level.supported() {
            Ok(Reducer { level })
        } else {
            Err(UnsupportedLevel { level })
        }
    }

    pub fn level(&self) -> SimdLevel {
        self.level
    }

    /// `acc[i] = (if fresh {nothing} else {acc[i] op}) conv(srcs[0][i]) op
    /// conv(srcs[1][i]) op ...`, combined left to right by `op` (see the
    /// [module](self) for what each op does).
    ///
    /// `acc` holds elements of `dtype.accumulator()` (native-endian bytes), each
    /// source elements of `dtype`; any alignment is fine. When `fresh`, `acc` is
    /// never read: the first source is copied (converted), not combined with an
    /// identity (zero for a sum, one for a product), so a lone `-0.0` stays
    /// `-0.0`. Fresh with no sources zero-fills `acc`, whatever the op.
    ///
    /// # Panics
    /// If a length is not a whole number of elements or the element counts differ.
    #[track_caller]
    pub fn accumulate(
        &self,
        dtype: Dtype,
        op: ReduceOp,
        acc: &mut [u8],
        fresh: bool,
        srcs: &[&[u8]],
    ) {
        let n = elements("acc", acc.len(), dtype.accumulator());
        check_srcs("accumulate", dtype, srcs, n, "acc");
        if srcs.is_empty() {
            if fresh {
                acc.fill(0);
            }
            return;
        }
        match self.level {
            SimdLevel::Portable => portable::accumulate(dtype, op, acc, fresh, srcs),
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx2F16c => {
                // SAFETY: the level was checked supported when self was built,
                // and the lengths were checked consistent above.
                unsafe { avx2::accumulate(dtype, op, acc, fresh, srcs) }
            }
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx512 => {
                // SAFETY: as for Avx2F16c.
                unsafe { avx512::accumulate(dtype, op, acc, fresh, srcs) }
            }
            #[cfg(not(target_arch = "x86_64"))]
            level => unreachable!("{level} is never supported off x86_64"),
        }
    }

    /// `out[i] = round_to_dtype((acc[i] op if Some) conv(srcs[0][i]) op ...)`,
    /// combined left to right by `op` in `dtype.accumulator()`.
    ///
    /// Completes a round in one pass: for f16/bf16 the result is formed in f32
    /// and rounded once to 16 bits (nearest, ties to even; NaN stays NaN,
    /// overflow gives ±Inf), and no f32 is written to memory. For the other
    /// dtypes `out` is the plain result. A lone term is copied (converted).
    /// `acc` (accumulator-sized) and `out` (dtype-sized) may have any alignment.
    ///
    /// # Panics
    /// If `acc` is `None` and `srcs` is empty, or on inconsistent lengths.
    #[track_caller]
    pub fn reduce_into(
        &self,
        dtype: Dtype,
        op: ReduceOp,
        acc: Option<&[u8]>,
        srcs: &[&[u8]],
        out: &mut [u8],
    ) {
        let n = elements("out", out.len(), dtype);
        if let Some(acc) = acc {
            let acc_n = elements("acc", acc.len(), dtype.accumulator());
            assert_eq!(
                acc_n,
                n,
                "reduce_into({dtype}): acc is {} bytes ({acc_n} elements) but out is {} bytes \
                 ({n} elements)",
                acc.len(),
                out.len()
            );
        } else {
            assert!(
                !srcs.is_empty(),
                "reduce_into({dtype}): nothing to reduce (no acc and no srcs)"
            );
        }
        check_srcs("reduce_into", dtype, srcs, n, "out");
        match self.level {
            SimdLevel::Portable => portable::reduce_into(dtype, op, acc, srcs, out),
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx2F16c => {
                // SAFETY: the level was checked supported when self was built,
                // and the lengths were checked consistent above.
                unsafe { avx2::reduce_into(dtype, op, acc, srcs, out) }
            }
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx512 => {
                // SAFETY: as for Avx2F16c.
                unsafe { avx512::reduce_into(dtype, op, acc, srcs, out) }
            }
            #[cfg(not(target_arch = "x86_64"))]
            level => unreachable!("{level} is never supported off x86_64"),
        }
    }
}

/// Elements of `dtype` in `bytes`, which must be a whole number of them.
#[track_caller]
fn elements(what: &str, bytes: usize, dtype: Dtype) -> usize {
    assert!(
        bytes.is_multiple_of(dtype.size()),
        "{what} is {bytes} bytes, not a whole number of {}-byte {dtype} elements",
        dtype.size()
    );
    bytes / dtype.size()
}

#[track_caller]
fn check_srcs(op: &str, dtype: Dtype, srcs: &[&[u8]], n: usize, against: &str) {
    for (k, src) in srcs.iter().enumerate() {
        assert_eq!(
            src.len(),
            n * dtype.size(),
            "{op}({dtype}): srcs[{k}] is {} bytes but {against} holds {n} elements ({} bytes \
             expected)",
            src.len(),
            n * dtype.size()
        );
    }
}
