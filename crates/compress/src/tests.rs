use super::*;

fn codec(codec: Codec, param: u32) -> KeyCodec {
    KeyCodec {
        codec,
        param,
        feedback: false,
    }
}

fn compressor(c: Codec, param: u32, n: usize) -> Compressor {
    Compressor::new(codec(c, param), n).unwrap()
}

/// Gradient-like data: mostly small, a few large, both signs.
fn data(n: usize, seed: u64) -> Vec<f32> {
    let mut r = Seed::new(seed, 0, 0).rng();
    (0..n)
        .map(|_| {
            let x = r.unit_f32() * 2.0 - 1.0;
            if r.below_or_equal(9) == 0 {
                x * 50.0
            } else {
                x
            }
        })
        .collect()
}

fn round_trip(c: &Compressor, x: &[f32], seed: Seed) -> Vec<f32> {
    let (mut s, mut payload) = (Scratch::default(), vec![0; c.payload_len()]);
    c.compress(x, seed, &mut s, &mut payload);
    assert_eq!(payload.len(), c.payload_len());
    c.validate(&payload).expect("own payload is valid");
    let mut out = vec![f32::NAN; x.len()];
    c.decompress(&payload, seed, &mut s, &mut out);
    out
}

const ALL: [(Codec, u32); 6] = [
    (Codec::TopK, 37),
    (Codec::RandomK, 37),
    (Codec::Sign, 0),
    (Codec::Dither, 1),
    (Codec::Dither, 5),
    (Codec::Dither, 100),
];

#[test]
fn top_k_keeps_exactly_the_largest_magnitudes() {
    let n = 1000;
    let x = data(n, 1);
    for k in [1, 37, 999, 1000] {
        let out = round_trip(
            &compressor(Codec::TopK, k as u32, n),
            &x,
            Seed::new(1, 1, 0),
        );
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by(|&a, &b| x[b].abs().total_cmp(&x[a].abs()).then(a.cmp(&b)));
        for (rank, &i) in order.iter().enumerate() {
            let want = if rank < k { x[i] } else { 0.0 };
            assert_eq!(out[i], want, "k = {k}, element {i}");
        }
    }
}

/// The k largest magnitudes of `x`, ties to lower indices, by sorting.
fn top_k_by_sorting(x: &[f32], k: usize) -> Vec<f32> {
    let mut order: Vec<usize> = (0..x.len()).collect();
    order.sort_by(|&a, &b| x[b].abs().total_cmp(&x[a].abs()).then(a.cmp(&b)));
    let mut out = vec![0.0; x.len()];
    for &i in &order[..k] {
        out[i] = x[i];
    }
    out
}

#[test]
fn top_k_is_exact_when_the_sampled_threshold_misleads() {
    // The threshold is estimated from every 16th element; here those are the large ones,
    // fewer than k, so the estimate admits too few and every element must be considered.
    let n = 1 << 16;
    let x: Vec<f32> = (0..n)
        .map(|i| if i % 16 == 0 { 1.0 } else { -0.5 })
        .collect();
    for k in [10, 4096, 5000] {
        let c = compressor(Codec::TopK, k as u32, n);
        assert_eq!(
            round_trip(&c, &x, Seed::new(0, 1, 0)),
            top_k_by_sorting(&x, k),
            "k = {k}"
        );
    }
    // Large partitions with gradient-like data take the sampled path.
    let x = data(n, 7);
    for k in [1, 100, 655] {
        let c = compressor(Codec::TopK, k as u32, n);
        assert_eq!(
            round_trip(&c, &x, Seed::new(0, 1, 0)),
            top_k_by_sorting(&x, k),
            "k = {k}"
        );
    }
}

#[test]
fn top_k_breaks_ties_towards_lower_indices_and_sends_nan() {
    let x = [1.0, -3.0, 3.0, 0.5, -3.0, f32::NAN];
    let out = round_trip(&compressor(Codec::TopK, 3, 6), &x, Seed::new(0, 1, 0));
    assert_eq!(&out[..5], &[0.0, -3.0, 3.0, 0.0, 0.0]);
    assert!(out[5].is_nan());
}

#[test]
fn random_k_draws_the_same_indices_on_every_worker_and_new_ones_each_round() {
    let n = 500;
    let c = compressor(Codec::RandomK, 50, n);
    let x: Vec<f32> = (1..=n).map(|i| i as f32).collect();
    let kept = |seed| -> Vec<usize> {
        let out = round_trip(&c, &x, seed);
        for (i, v) in out.iter().enumerate() {
            assert!(*v == 0.0 || *v == x[i]);
        }
        (0..n).filter(|&i| out[i] != 0.0).collect()
    };
    let a = kept(Seed::new(4, 1, 0));
    assert_eq!(a.len(), 50);
    assert_eq!(a, kept(Seed::new(4, 1, 3)), "workers share the indices");
    assert_ne!(a, kept(Seed::new(4, 2, 0)), "rounds draw anew");
    // Over many rounds every element is drawn about equally often.
    let mut hits = vec![0u32; n];
    for round in 0..400 {
        for i in kept(Seed::new(9, round, 0)) {
            hits[i] += 1;
        }
    }
    let (lo, hi) = (hits.iter().min().unwrap(), hits.iter().max().unwrap());
    assert!(*lo >= 18 && *hi <= 66, "expected about 40 each: {lo}..{hi}");
}

#[test]
fn sign_sends_the_signs_at_the_mean_magnitude() {
    let x = [2.0, -4.0, 0.0, 1.0, -1.0, 3.0, -0.0, 5.0, -8.0];
    let out = round_trip(&compressor(Codec::Sign, 0, 9), &x, Seed::new(0, 1, 0));
    let s = 24.0 / 9.0;
    assert_eq!(out, [s, -s, s, s, -s, s, s, s, -s]);
}

#[test]
fn dithering_stays_within_one_level_and_is_unbiased() {
    let n = 64;
    let x = data(n, 2);
    let norm = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    for levels in [1, 5, 100] {
        let c = compressor(Codec::Dither, levels, n);
        let mut mean = vec![0f64; n];
        let rounds = 4000;
        for round in 0..rounds {
            let out = round_trip(&c, &x, Seed::new(3, round, 1));
            for i in 0..n {
                let step = norm / levels as f32;
                assert!((out[i] - x[i]).abs() <= step * 1.0001, "levels {levels}");
                mean[i] += f64::from(out[i]) / rounds as f64;
            }
        }
        let step = f64::from(norm) / f64::from(levels);
        for i in 0..n {
            // The mean of 4000 draws within a level: 5 standard errors at most.
            let tolerance = 5.0 * step * 0.5 / (rounds as f64).sqrt();
            assert!(
                (mean[i] - f64::from(x[i])).abs() <= tolerance,
                "levels {levels}, element {i}: mean {} for {}",
                mean[i],
                x[i]
            );
        }
    }
}

#[test]
fn error_feedback_loses_nothing() {
    let n = 300;
    for (c, param) in ALL {
        let comp = compressor(c, param, n);
        let (mut s, mut payload) = (Scratch::default(), vec![0; comp.payload_len()]);
        let mut residual = vec![0f32; n];
        let mut total_in = vec![0f64; n];
        let mut total_sent = vec![0f64; n];
        for round in 1..=20 {
            let x = data(n, round);
            let before = residual.clone();
            let seed = Seed::new(11, round, 2);
            comp.compress_with_feedback(&x, &mut residual, seed, &mut s, &mut payload);
            let mut sent = vec![0f32; n];
            comp.decompress(&payload, seed, &mut s, &mut sent);
            for i in 0..n {
                // sent + residual = input + previous residual, each step.
                let lhs = sent[i] + residual[i];
                let rhs = x[i] + before[i];
                let exact = matches!(c, Codec::TopK | Codec::RandomK);
                let tol = if exact { 0.0 } else { 1e-5 * (1.0 + rhs.abs()) };
                assert!(
                    (lhs - rhs).abs() <= tol,
                    "{c} round {round} element {i}: {lhs} vs {rhs}"
                );
                total_in[i] += f64::from(x[i]);
                total_sent[i] += f64::from(sent[i]);
            }
        }
        // Over the rounds: what was sent plus what is still held is what came in.
        for i in 0..n {
            let held = total_sent[i] + f64::from(residual[i]);
            assert!(
                (held - total_in[i]).abs() < 1e-3 * (1.0 + total_in[i].abs()),
                "{c}: element {i}"
            );
        }
    }
}

#[test]
fn decompress_add_adds_what_decompress_writes() {
    let n = 257;
    for (c, param) in ALL {
        let comp = compressor(c, param, n);
        let (mut s, mut payload) = (Scratch::default(), vec![0; comp.payload_len()]);
        let seed = Seed::new(5, 6, 7);
        comp.compress(&data(n, 3), seed, &mut s, &mut payload);
        let mut decoded = vec![0f32; n];
        comp.decompress(&payload, seed, &mut s, &mut decoded);
        let mut acc = data(n, 4);
        let start = acc.clone();
        comp.decompress_add(&payload, seed, &mut s, &mut acc);
        for i in 0..n {
            assert_eq!(acc[i], start[i] + decoded[i], "{c}: element {i}");
        }
    }
}

#[test]
fn malformed_payloads_are_refused_with_the_reason() {
    let topk = compressor(Codec::TopK, 3, 10);
    let entries = |idx: [u32; 3]| -> Vec<u8> {
        let mut p: Vec<u8> = idx.iter().flat_map(|i| i.to_le_bytes()).collect();
        p.extend([1f32, 2.0, 3.0].iter().flat_map(|v| v.to_le_bytes()));
        p
    };
    assert_eq!(topk.validate(&entries([0, 4, 9])), Ok(()));
    assert_eq!(
        topk.validate(&entries([0, 4, 10])),
        Err(PayloadError::IndexRange {
            index: 10,
            elements: 10
        })
    );
    assert_eq!(
        topk.validate(&entries([0, 4, 4])),
        Err(PayloadError::IndexOrder { position: 2 })
    );
    assert!(matches!(
        topk.validate(&[0; 23]),
        Err(PayloadError::Length {
            got: 23,
            expected: 24
        })
    ));

    let sign = compressor(Codec::Sign, 0, 10);
    assert_eq!(sign.validate(&[0, 0, 128, 63, 0xff, 0x03]), Ok(()));
    assert_eq!(
        sign.validate(&[0, 0, 128, 63, 0xff, 0x07]),
        Err(PayloadError::Padding)
    );

    // One level (2 bits each): -1, 0 and 1 are levels, -2 (0b10) is not.
    let dither = compressor(Codec::Dither, 1, 3);
    assert_eq!(dither.validate(&[0, 0, 128, 63, 0b00_01_11]), Ok(()));
    assert_eq!(
        dither.validate(&[0, 0, 128, 63, 0b00_10_00]),
        Err(PayloadError::Level {
            position: 1,
            level: -2,
            levels: 1
        })
    );
    assert_eq!(
        dither.validate(&[0, 0, 128, 63, 0b01_00_00_00]),
        Err(PayloadError::Padding)
    );
}

#[test]
fn non_finite_gradients_stay_visible() {
    let mut x = data(40, 5);
    x[7] = f32::NAN;
    for (c, param) in ALL {
        if c == Codec::RandomK {
            continue; // sends what it draws, NaN or not
        }
        let out = round_trip(&compressor(c, param, 40), &x, Seed::new(1, 1, 1));
        assert!(out.iter().any(|v| v.is_nan()), "{c} hid a NaN");
    }
}

#[test]
fn compressors_refuse_keys_they_cannot_encode() {
    let e = Compressor::new(codec(Codec::Raw, 0), 10).unwrap_err();
    assert!(e.to_string().contains("not compressed"), "{e}");
    let e = Compressor::new(codec(Codec::TopK, 0), 10).unwrap_err();
    assert!(e.to_string().contains("k must be 1 to 10"), "{e}");
}
