//! Throughput of each compressor next to the summation kernel's reference (a plain f32
//! `a += b` pass) over the same partition: what compressing costs a worker's push thread
//! and a server's engine per byte of gradient, against what summing it costs anyway.
//!
//! `cargo bench -p sumflow-compress --bench codecs [-- --quick]`
//!
//! Environment: `SUMFLOW_BENCH_REPS` (repetitions, best kept; default 5),
//! `SUMFLOW_BENCH_QUICK=1` (same as `--quick`: 2 repetitions).

use std::hint::black_box;
use std::time::{Duration, Instant};

use sumflow_compress::{Compressor, Scratch, Seed};
use sumflow_wire::{Codec, KeyCodec};

/// A 4 MiB partition, the default partition size.
const ELEMENTS: usize = 1 << 20;

fn main() {
    let quick = std::env::args().any(|a| a == "--quick")
        || std::env::var("SUMFLOW_BENCH_QUICK").is_ok_and(|v| v == "1");
    let reps = std::env::var("SUMFLOW_BENCH_REPS")
        .ok()
        .and_then(|s| s.parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or(if quick { 2 } else { 5 });
    let input: Vec<f32> = (0..ELEMENTS)
        .map(|i| ((i.wrapping_mul(2_654_435_761) % 20_011) as f32 - 10_005.0) * 1e-4)
        .collect();
    let mut acc = vec![0f32; ELEMENTS];
    let reference = best(reps, || {
        for (a, b) in acc.iter_mut().zip(&input) {
            *a += b;
        }
        black_box(&acc);
    });
    let gbs = |d: Duration| (ELEMENTS * 4) as f64 / d.as_secs_f64() / 1e9;
    println!(
        "sumflow codec benchmark: a partition of {ELEMENTS} f32 (4 MiB), best of {reps}; \
         GB/s of uncompressed gradient; ratio = the reference's time / the codec's"
    );
    println!("reference (f32 a += b): {:.2} GB/s", gbs(reference));
    println!(
        "{:<22} {:>9} {:>14} {:>7} {:>14} {:>7} {:>14} {:>7}",
        "codec", "payload", "compress", "ratio", "decompress+=", "ratio", "+ feedback", "ratio"
    );
    let codecs = [
        (Codec::TopK, (ELEMENTS / 100) as u32),
        (Codec::RandomK, (ELEMENTS / 100) as u32),
        (Codec::Sign, 0),
        (Codec::Dither, 7),
    ];
    let mut scratch = Scratch::default();
    for (codec, param) in codecs {
        let key = KeyCodec {
            codec,
            param,
            feedback: true,
        };
        let c = Compressor::new(key, ELEMENTS).expect("a valid codec");
        let mut payload = vec![0u8; c.payload_len()];
        let seed = Seed::new(1, 1, 0);
        let compress = best(reps, || {
            c.compress(&input, seed, &mut scratch, &mut payload);
            black_box(&payload);
        });
        let decompress = best(reps, || {
            c.decompress_add(&payload, seed, &mut scratch, &mut acc);
            black_box(&acc);
        });
        let mut residual = vec![0f32; ELEMENTS];
        let feedback = best(reps, || {
            c.compress_with_feedback(&input, &mut residual, seed, &mut scratch, &mut payload);
            black_box(&payload);
        });
        let ratio = |d: Duration| reference.as_secs_f64() / d.as_secs_f64();
        println!(
            "{:<22} {:>8.2}% {:>9.2} GB/s {:>6.2}x {:>9.2} GB/s {:>6.2}x {:>9.2} GB/s {:>6.2}x",
            key.to_string().replace(" with error feedback", ""),
            100.0 * c.payload_len() as f64 / (ELEMENTS * 4) as f64,
            gbs(compress),
            ratio(compress),
            gbs(decompress),
            ratio(decompress),
            gbs(feedback),
            ratio(feedback),
        );
    }
}

fn best(reps: usize, mut f: impl FnMut()) -> Duration {
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .min()
        .expect("at least one repetition")
}
