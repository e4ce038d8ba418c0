//! Throughput of the reduction kernels (sum, and min, max and product next to
//! it) and a plain memory-bandwidth reference, on buffers far larger than any
//! cache.
//!
//! `cargo bench -p sumflow-reduce --bench reduce [-- --quick]`
//!
//! Environment: `SUMFLOW_BENCH_REPS` (repetitions, best kept; default 5),
//! `SUMFLOW_BENCH_ALL_LEVELS=1` (every level the CPU runs, not just the best),
//! `SUMFLOW_BENCH_QUICK=1` (same as `--quick`: 4 MiB buffers, 2 repetitions).

use std::hint::black_box;
use std::io::Write;
use std::time::{Duration, Instant};

use sumflow_reduce::buffer::AlignedBuf;
use sumflow_reduce::{Reducer, SimdLevel};
use sumflow_wire::{Dtype, ReduceOp};

/// Sources in the `reduce_into` round.
const ROUND: usize = 4;

fn main() {
    let quick = std::env::args().any(|a| a == "--quick") || env_flag("SUMFLOW_BENCH_QUICK");
    let mib = if quick { 4 } else { 64 };
    let reps = std::env::var("SUMFLOW_BENCH_REPS")
        .ok()
        .and_then(|s| s.parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or(if quick { 2 } else { 5 });
    let levels = if env_flag("SUMFLOW_BENCH_ALL_LEVELS") {
        SimdLevel::available()
    } else {
        vec![SimdLevel::detect()]
    };
    let names = |ls: &[SimdLevel]| ls.iter().map(|l| l.name()).collect::<Vec<_>>().join(", ");

    println!(
        "sumflow reduce benchmark: {mib} MiB of wire data per source, best of {reps}; \
         level(s) {} (available: {})",
        names(&levels),
        names(&SimdLevel::available())
    );
    println!(
        "GB/s = 1e9 bytes of wire-dtype source data per second; ratio = that / reference \
         (a plain f32 a += b loop over two {mib} MiB buffers, built for the same level, \
         counted as {mib} MiB per pass); vs sum = that / the same kernel's sum"
    );
    println!(
        "{:<10} {:<5} {:<7} {:>15} {:>17} {:>7} {:>7} {:>17} {:>7} {:>7}",
        "level",
        "dtype",
        "op",
        "reference",
        "accumulate x1",
        "ratio",
        "vs sum",
        "reduce_into x4",
        "ratio",
        "vs sum"
    );
    flush();
    for level in levels {
        let reducer = Reducer::with_level(level).expect("available levels are supported");
        for dtype in Dtype::ALL {
            let row = bench(reducer, dtype, mib << 20, reps);
            for (o, op) in ReduceOp::ALL.into_iter().enumerate() {
                println!(
                    "{:<10} {:<5} {:<7} {:>10.2} GB/s {:>12.2} GB/s {:>6.2}x {:>6.2}x {:>12.2} GB/s \
                     {:>6.2}x {:>6.2}x",
                    level.name(),
                    dtype.name(),
                    op.name(),
                    row.reference,
                    row.accumulate[o],
                    row.accumulate[o] / row.reference,
                    row.accumulate[o] / row.accumulate[0],
                    row.reduce[o],
                    row.reduce[o] / row.reference,
                    row.reduce[o] / row.reduce[0],
                );
            }
            flush();
        }
    }
}

/// Best throughputs in GB/s of wire data; the kernels' by op, in
/// `ReduceOp::ALL` order (sum first).
struct Row {
    reference: f64,
    accumulate: [f64; 4],
    reduce: [f64; 4],
}

fn bench(reducer: Reducer, dtype: Dtype, bytes: usize, reps: usize) -> Row {
    eprint!("[{} {dtype}] filling buffers", reducer.level());
    flush();
    let n = bytes / dtype.size();
    let srcs: Vec<AlignedBuf> = (0..ROUND).map(|k| filled(dtype, n, k as u64 + 1)).collect();
    let srcs: Vec<&[u8]> = srcs.iter().map(|b| &b[..]).collect();
    let mut acc = filled(dtype.accumulator(), n, 99);
    let mut out = AlignedBuf::zeroed(n * dtype.size());
    let mut ref_a = filled(Dtype::F32, bytes / 4, 100);
    let ref_b = filled(Dtype::F32, bytes / 4, 101);

    // The reference and the kernels alternate within each repetition, so drift
    // in clock speed or neighbours' load hits all of them alike. Repetition 0
    // is a warm-up: it takes the page faults of the untouched output. (The
    // accumulator's values drift, repetition after repetition, but stay normal:
    // the sources are multiples of 2^-10 in [-1, 1), so even the product of
    // every repetition's factors stays far above f32's subnormals, or is 0.)
    let mut best = [Duration::MAX; 9];
    for rep in 0..=reps {
        eprint!(" {rep}");
        flush();
        let mut times = [Duration::ZERO; 9];
        times[0] =
            time(|| reference_add(reducer.level(), black_box(&mut ref_a), black_box(&ref_b)));
        for (o, op) in ReduceOp::ALL.into_iter().enumerate() {
            times[1 + o] = time(|| {
                reducer.accumulate(dtype, op, black_box(&mut acc), false, black_box(&srcs[..1]));
            });
            times[5 + o] = time(|| {
                reducer.reduce_into(dtype, op, None, black_box(&srcs), black_box(&mut out));
            });
        }
        if rep > 0 {
            for (b, t) in best.iter_mut().zip(times) {
                *b = (*b).min(t);
            }
        }
    }
    eprintln!();
    black_box((&acc, &out, &ref_a));
    let gbps = |bytes: usize, t: Duration| bytes as f64 / t.as_secs_f64() / 1e9;
    Row {
        reference: gbps(bytes, best[0]),
        accumulate: std::array::from_fn(|o| gbps(bytes, best[1 + o])),
        reduce: std::array::from_fn(|o| gbps(ROUND * bytes, best[5 + o])),
    }
}

/// The memory-bandwidth reference: a plain `a += b` loop over f32, the traffic
/// pattern of a one-source f32 accumulate (read two streams, write one). It is
/// compiled for the instruction set of the level it is compared with, so that
/// a ratio measures the kernel's memory use, not the width of its loads.
fn reference_add(level: SimdLevel, a: &mut [u8], b: &[u8]) {
    let a: &mut [f32] = bytemuck::cast_slice_mut(a);
    let b: &[f32] = bytemuck::cast_slice(b);
    match level {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the level is available, so the CPU has AVX-512F.
        SimdLevel::Avx512 => unsafe { add_avx512(a, b) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the level is available, so the CPU has AVX2.
        SimdLevel::Avx2F16c => unsafe { add_avx2(a, b) },
        _ => add_plain(a, b),
    }
}

#[inline(always)]
fn add_plain(a: &mut [f32], b: &[f32]) {
    for (x, y) in a.iter_mut().zip(b) {
        *x += *y;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn add_avx2(a: &mut [f32], b: &[f32]) {
    add_plain(a, b);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[clippy::msrv = "1.89"]
unsafe fn add_avx512(a: &mut [f32], b: &[f32]) {
    add_plain(a, b);
}

/// `n` elements of `dtype`: multiples of 2^-10 in [-1, 1) for floats, which
/// every float type holds (no subnormals, whose slow paths would skew the
/// timing), and raw bits for integers.
fn filled(dtype: Dtype, n: usize, seed: u64) -> AlignedBuf {
    let mut buf = AlignedBuf::zeroed(n * dtype.size());
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for e in buf.chunks_exact_mut(dtype.size()) {
        // xorshift64
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let v = ((state >> 40) % 2048) as f32 / 1024.0 - 1.0;
        match dtype {
            Dtype::F32 => e.copy_from_slice(&v.to_ne_bytes()),
            Dtype::F64 => e.copy_from_slice(&f64::from(v).to_ne_bytes()),
            Dtype::F16 => e.copy_from_slice(&half::f16::from_f32(v).to_bits().to_ne_bytes()),
            Dtype::Bf16 => e.copy_from_slice(&half::bf16::from_f32(v).to_bits().to_ne_bytes()),
            Dtype::I32 => e.copy_from_slice(&(state as u32).to_ne_bytes()),
            Dtype::I64 => e.copy_from_slice(&state.to_ne_bytes()),
        }
    }
    buf
}

fn time(f: impl FnOnce()) -> Duration {
    let start = Instant::now();
    f();
    start.elapsed()
}

fn env_flag(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| v == "1")
}

fn flush() {
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
}
