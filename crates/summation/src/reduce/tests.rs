//! Every available level against a scalar reference written here, bit for bit.

use half::{bf16, f16};
use sumflow_wire::Dtype;

use super::{Reducer, SimdLevel};
use crate::buffer::AlignedBuf;

/// splitmix64: deterministic, dependency-free.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())]
    }

    /// A value in [-8, 8) with a full 24-bit mantissa's worth of random bits.
    fn moderate(&mut self) -> f64 {
        ((self.next() >> 11) as f64 / (1u64 << 53) as f64 - 0.5) * 16.0
    }
}

fn levels() -> Vec<Reducer> {
    let levels = SimdLevel::available();
    if !levels.contains(&SimdLevel::Avx512) {
        eprintln!("note: this CPU lacks AVX-512F; the avx512 kernels are not exercised");
    }
    levels
        .into_iter()
        .map(|l| Reducer::with_level(l).unwrap())
        .collect()
}

const F32_SPECIALS: [f32; 14] = [
    f32::NAN,
    -f32::NAN,
    f32::INFINITY,
    f32::NEG_INFINITY,
    0.0,
    -0.0,
    1.0e-45,  // smallest subnormal
    -3.0e-39, // subnormal
    1.1e-38,  // just below the smallest normal
    f32::MIN_POSITIVE,
    f32::MAX,
    f32::MIN,
    65504.0,
    1.0,
];

const F16_SPECIALS: [u16; 16] = [
    0x7E00, 0x7C01, 0xFE00, 0x7C00, 0xFC00, 0x0000, 0x8000, 0x0001, 0x03FF, 0x8001, 0x0400, 0x7BFF,
    0xFBFF, 0x7B53, 0xFB53, 0x3C00,
];

const BF16_SPECIALS: [u16; 15] = [
    0x7FC0, 0x7F81, 0xFFC1, 0x7FFF, 0x7F80, 0xFF80, 0x0000, 0x8000, 0x0001, 0x007F, 0x0080, 0x7F7F,
    0xFF7F, 0x3F80, 0x3B80,
];

/// One random element of `dtype`, mostly ordinary values with a share of
/// special ones (NaN, Inf, signed zeros, subnormals, extremes) and raw bits.
fn gen_elem(rng: &mut Rng, dtype: Dtype, out: &mut [u8]) {
    let class = rng.below(16);
    match dtype {
        Dtype::F32 => {
            let v = match class {
                0 => rng.pick(&F32_SPECIALS),
                1 => f32::from_bits(rng.next() as u32),
                _ => rng.moderate() as f32,
            };
            out.copy_from_slice(&v.to_ne_bytes());
        }
        Dtype::F64 => {
            let v = match class {
                0 => f64::from(rng.pick(&F32_SPECIALS)),
                1 => f64::from_bits(rng.next()),
                2 => rng.pick(&[f64::MAX, f64::MIN, 5e-324, -0.0]),
                _ => rng.moderate(),
            };
            out.copy_from_slice(&v.to_ne_bytes());
        }
        Dtype::F16 => {
            let bits = match class {
                0 => rng.pick(&F16_SPECIALS),
                1 => rng.next() as u16,
                // Subnormals and the smallest normals, whose sums must stay exact.
                2 | 3 => (rng.below(0x0800) as u16) | ((rng.next() as u16) & 0x8000),
                // Near the top of the range, where sums overflow to Inf.
                4 => (0x7800 + rng.below(0x3FF) as u16) | ((rng.next() as u16) & 0x8000),
                _ => f16::from_f64(rng.moderate()).to_bits(),
            };
            out.copy_from_slice(&bits.to_ne_bytes());
        }
        Dtype::Bf16 => {
            let bits = match class {
                0 => rng.pick(&BF16_SPECIALS),
                1 => rng.next() as u16,
                2 => rng.below(0x0100) as u16 | ((rng.next() as u16) & 0x8000),
                // Exponents within a factor 4 of each other: the f32 sums have a
                // few more bits than bf16 keeps, so exact ties are common.
                3..=7 => (0x3F00 + rng.below(0x0180) as u16) | ((rng.next() as u16) & 0x8000),
                _ => bf16::from_f64(rng.moderate()).to_bits(),
            };
            out.copy_from_slice(&bits.to_ne_bytes());
        }
        Dtype::I32 => {
            let v = match class {
                0 => rng.pick(&[i32::MAX, i32::MIN, -1, 0]),
                _ => rng.next() as i32,
            };
            out.copy_from_slice(&v.to_ne_bytes());
        }
        Dtype::I64 => {
            let v = match class {
                0 => rng.pick(&[i64::MAX, i64::MIN, -1, 0]),
                _ => rng.next() as i64,
            };
            out.copy_from_slice(&v.to_ne_bytes());
        }
    }
}

/// A byte slice starting `off` bytes into a page-aligned buffer.
struct Placed {
    buf: AlignedBuf,
    off: usize,
    len: usize,
}

impl Placed {
    fn random(rng: &mut Rng, dtype: Dtype, n: usize, off: usize) -> Placed {
        let mut p = Placed::zeroed(n * dtype.size(), off);
        for e in p.bytes_mut().chunks_exact_mut(dtype.size()) {
            gen_elem(rng, dtype, e);
        }
        p
    }

    fn zeroed(len: usize, off: usize) -> Placed {
        Placed {
            buf: AlignedBuf::zeroed(len + off),
            off,
            len,
        }
    }

    fn copy_of(bytes: &[u8], off: usize) -> Placed {
        let mut p = Placed::zeroed(bytes.len(), off);
        p.bytes_mut().copy_from_slice(bytes);
        p
    }

    fn bytes(&self) -> &[u8] {
        &self.buf[self.off..self.off + self.len]
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.buf[self.off..self.off + self.len]
    }
}

fn rd<const N: usize>(bytes: &[u8], i: usize) -> [u8; N] {
    bytes[i * N..(i + 1) * N].try_into().unwrap()
}

/// Element `i` of a float source or accumulator of `dtype`, exactly as f32.
fn src_f32(dtype: Dtype, bytes: &[u8], i: usize) -> f32 {
    match dtype {
        Dtype::F32 => f32::from_ne_bytes(rd(bytes, i)),
        Dtype::F16 => f16::from_bits(u16::from_ne_bytes(rd(bytes, i))).to_f32(),
        Dtype::Bf16 => bf16::from_bits(u16::from_ne_bytes(rd(bytes, i))).to_f32(),
        _ => unreachable!(),
    }
}

/// The terms summed left to right from the first term (no added zero), in the
/// accumulator type, as accumulator bytes.
fn ref_sum(dtype: Dtype, acc: Option<&[u8]>, srcs: &[&[u8]], n: usize) -> Vec<u8> {
    let mut out = Vec::new();
    for i in 0..n {
        match dtype {
            Dtype::F32 | Dtype::F16 | Dtype::Bf16 => {
                let mut terms = acc
                    .map(|a| src_f32(Dtype::F32, a, i))
                    .into_iter()
                    .chain(srcs.iter().map(|s| src_f32(dtype, s, i)));
                let first = terms.next().unwrap();
                out.extend(terms.fold(first, |x, y| x + y).to_ne_bytes());
            }
            Dtype::F64 => {
                let mut terms = acc
                    .into_iter()
                    .chain(srcs.iter().copied())
                    .map(|s| f64::from_ne_bytes(rd(s, i)));
                let first = terms.next().unwrap();
                out.extend(terms.fold(first, |x, y| x + y).to_ne_bytes());
            }
            Dtype::I32 => {
                let mut terms = acc
                    .into_iter()
                    .chain(srcs.iter().copied())
                    .map(|s| i32::from_ne_bytes(rd(s, i)));
                let first = terms.next().unwrap();
                out.extend(terms.fold(first, i32::wrapping_add).to_ne_bytes());
            }
            Dtype::I64 => {
                let mut terms = acc
                    .into_iter()
                    .chain(srcs.iter().copied())
                    .map(|s| i64::from_ne_bytes(rd(s, i)));
                let first = terms.next().unwrap();
                out.extend(terms.fold(first, i64::wrapping_add).to_ne_bytes());
            }
        }
    }
    out
}

/// Accumulator bytes rounded to `dtype` (a no-op unless 16-bit).
fn ref_round(dtype: Dtype, acc: &[u8]) -> Vec<u8> {
    let n = acc.len() / dtype.accumulator().size();
    match dtype {
        Dtype::F16 => (0..n)
            .flat_map(|i| {
                f16::from_f32(src_f32(Dtype::F32, acc, i))
                    .to_bits()
                    .to_ne_bytes()
            })
            .collect(),
        Dtype::Bf16 => (0..n)
            .flat_map(|i| {
                bf16::from_f32(src_f32(Dtype::F32, acc, i))
                    .to_bits()
                    .to_ne_bytes()
            })
            .collect(),
        _ => acc.to_vec(),
    }
}

fn is_nan(dtype: Dtype, bytes: &[u8]) -> bool {
    match dtype {
        Dtype::F32 => f32::from_ne_bytes(rd(bytes, 0)).is_nan(),
        Dtype::F64 => f64::from_ne_bytes(rd(bytes, 0)).is_nan(),
        Dtype::F16 => f16::from_bits(u16::from_ne_bytes(rd(bytes, 0))).is_nan(),
        Dtype::Bf16 => bf16::from_bits(u16::from_ne_bytes(rd(bytes, 0))).is_nan(),
        Dtype::I32 | Dtype::I64 => false,
    }
}

/// Bitwise equality of elements of `dtype`, except that any NaN matches any NaN.
#[track_caller]
fn assert_same(dtype: Dtype, got: &[u8], want: &[u8], ctx: &dyn Fn() -> String) {
    assert_eq!(got.len(), want.len(), "{}: length", ctx());
    let size = dtype.size();
    for (i, (g, w)) in got
        .chunks_exact(size)
        .zip(want.chunks_exact(size))
        .enumerate()
    {
        if g != w && !(is_nan(dtype, g) && is_nan(dtype, w)) {
            panic!(
                "{}: element {i} of {}: got {g:02x?}, want {w:02x?}",
                ctx(),
                got.len() / size
            );
        }
    }
}

/// Runs accumulate (fresh and not) and reduce_into (with and without acc) on
/// random data at the given alignment offsets, against the reference.
fn check_case(r: Reducer, rng: &mut Rng, dtype: Dtype, n: usize, nsrcs: usize, off: usize) {
    let accd = dtype.accumulator();
    let srcs: Vec<Placed> = (0..nsrcs)
        .map(|k| Placed::random(rng, dtype, n, (off + k + 1) % 4))
        .collect();
    let srcs: Vec<&[u8]> = srcs.iter().map(Placed::bytes).collect();
    let acc0 = Placed::random(rng, accd, n, off);
    let ctx = |op: &str| {
        let level = r.level();
        let op = op.to_string();
        move || format!("{level} {dtype} {op} n={n} srcs={nsrcs} off={off}")
    };

    for fresh in [false, true] {
        let mut acc = Placed::copy_of(acc0.bytes(), (off + 2) % 4);
        r.accumulate(dtype, acc.bytes_mut(), fresh, &srcs);
        let want = match (fresh, nsrcs) {
            (true, 0) => vec![0; n * accd.size()],
            (false, 0) => acc0.bytes().to_vec(),
            (true, _) => ref_sum(dtype, None, &srcs, n),
            (false, _) => ref_sum(dtype, Some(acc0.bytes()), &srcs, n),
        };
        assert_same(
            accd,
            acc.bytes(),
            &want,
            &ctx(&format!("accumulate fresh={fresh}")),
        );
    }

    for with_acc in [false, true] {
        if !with_acc && nsrcs == 0 {
            continue;
        }
        let acc = with_acc.then(|| acc0.bytes());
        // Garbage in out proves every element is written.
        let mut out = Placed::random(rng, dtype, n, (off + 3) % 4);
        r.reduce_into(dtype, acc, &srcs, out.bytes_mut());
        let want = ref_round(dtype, &ref_sum(dtype, acc, &srcs, n));
        assert_same(
            dtype,
            out.bytes(),
            &want,
            &ctx(&format!("reduce_into acc={with_acc}")),
        );
    }
}

#[test]
fn small_lengths_all_offsets_and_source_counts() {
    let mut rng = Rng(1);
    for r in levels() {
        for dtype in Dtype::ALL {
            for n in 0..=70 {
                for nsrcs in 0..=5 {
                    for off in 0..4 {
                        check_case(r, &mut rng, dtype, n, nsrcs, off);
                    }
                }
            }
        }
    }
}

#[test]
fn large_lengths_cross_blocks() {
    let mut rng = Rng(2);
    for r in levels() {
        for dtype in Dtype::ALL {
            for (i, n) in [1000, 1023, 1024, 1025, 2063, 4097, 65537]
                .into_iter()
                .enumerate()
            {
                for nsrcs in [1, 2, 5] {
                    check_case(r, &mut rng, dtype, n, nsrcs, (i + nsrcs) % 4);
                }
            }
        }
    }
}

// ---- hand-picked values, repeated to 37 elements so both vectors and the tail
// see them ----

const N: usize = 37;

fn f16s(v: f32) -> Vec<u8> {
    (0..N)
        .flat_map(|_| f16::from_f32(v).to_bits().to_ne_bytes())
        .collect()
}

fn bf16_bits(bits: u16) -> Vec<u8> {
    (0..N).flat_map(|_| bits.to_ne_bytes()).collect()
}

fn f32s(v: f32) -> Vec<u8> {
    (0..N).flat_map(|_| v.to_ne_bytes()).collect()
}

fn u16s(bytes: &[u8]) -> Vec<u16> {
    bytes
        .chunks_exact(2)
        .map(|c| u16::from_ne_bytes([c[0], c[1]]))
        .collect()
}

fn reduce(r: Reducer, dtype: Dtype, acc: Option<&[u8]>, srcs: &[&[u8]]) -> Vec<u8> {
    let mut out = vec![0xAA; N * dtype.size()];
    r.reduce_into(dtype, acc, srcs, &mut out);
    out
}

#[test]
fn f16_sums_in_f32_beat_f16_accumulation() {
    let vals = [1024.0f32, 0.5, 0.5, 0.25];
    // Summing in f16 loses each small term to round-to-even at 1024 (ulp 1).
    let naive = vals[1..].iter().fold(f16::from_f32(vals[0]), |s, &v| {
        f16::from_f32(s.to_f32() + v)
    });
    assert_eq!(naive.to_f32(), 1024.0);
    let srcs: Vec<Vec<u8>> = vals.iter().map(|&v| f16s(v)).collect();
    let srcs: Vec<&[u8]> = srcs.iter().map(Vec::as_slice).collect();
    for r in levels() {
        let out = reduce(r, Dtype::F16, None, &srcs);
        assert!(
            u16s(&out)
                .iter()
                .all(|&b| f16::from_bits(b).to_f32() == 1025.0),
            "{}",
            r.level()
        );

        let mut acc = vec![0u8; N * 4];
        r.accumulate(Dtype::F16, &mut acc, true, &srcs);
        assert_eq!(acc, f32s(1025.25), "{}", r.level());
    }
}

#[test]
fn f16_overflow_rounds_to_inf_but_f32_partials_do_not() {
    let (big, neg) = (f16s(60000.0), f16s(-60000.0));
    for r in levels() {
        let inf = reduce(r, Dtype::F16, None, &[&big, &big]);
        assert_eq!(u16s(&inf), vec![0x7C00; N], "{}", r.level());
        let ninf = reduce(r, Dtype::F16, None, &[&neg, &neg]);
        assert_eq!(u16s(&ninf), vec![0xFC00; N], "{}", r.level());
        // 120000 is out of f16 range but not of the f32 partial sum.
        let back = reduce(r, Dtype::F16, None, &[&big, &big, &neg]);
        assert_eq!(back, big, "{}", r.level());
        let mut acc = vec![0u8; N * 4];
        r.accumulate(Dtype::F16, &mut acc, true, &[&big, &big]);
        assert_eq!(acc, f32s(120000.0), "{}", r.level());
    }
}

#[test]
fn bf16_rounds_ties_to_even() {
    let half_ulp_at_one = bf16_bits(0x3B80); // 2^-8
    let quarter_ulp = bf16_bits(0x3780); // 2^-16
    for r in levels() {
        let sum = |a: u16, extra: &[&[u8]]| {
            let a = bf16_bits(a);
            let mut srcs: Vec<&[u8]> = vec![&a, &half_ulp_at_one];
            srcs.extend_from_slice(extra);
            u16s(&reduce(r, Dtype::Bf16, None, &srcs))[0]
        };
        assert_eq!(
            sum(0x3F80, &[]),
            0x3F80,
            "{}: 1 + half ulp ties down to even",
            r.level()
        );
        assert_eq!(
            sum(0x3F81, &[]),
            0x3F82,
            "{}: odd + half ulp ties up to even",
            r.level()
        );
        assert_eq!(sum(0xBF81, &[]), 0xBF80, "{}: negative tie", r.level());
        assert_eq!(
            sum(0x3F80, &[&quarter_ulp]),
            0x3F81,
            "{}: above the tie",
            r.level()
        );
    }
}

#[test]
fn nan_stays_nan_and_is_never_inf() {
    // f32 NaNs whose rounding carry would reach the exponent or the sign.
    let nans = [
        0x7FFF_FFFFu32,
        0x7F80_0001,
        0xFFFF_FFFF,
        0x7FC0_0000,
        0xFF80_8000,
    ];
    for r in levels() {
        for bits in nans {
            let acc = f32s(f32::from_bits(bits));
            for dtype in [Dtype::Bf16, Dtype::F16] {
                let out = reduce(r, dtype, Some(&acc), &[]);
                let ok = u16s(&out).iter().all(|&b| match dtype {
                    Dtype::Bf16 => bf16::from_bits(b).is_nan(),
                    _ => f16::from_bits(b).is_nan(),
                });
                assert!(
                    ok,
                    "{} {dtype} {bits:#x} -> {:x?}",
                    r.level(),
                    &u16s(&out)[..1]
                );
            }
        }
        // A signalling bf16 NaN passing straight through.
        let out = reduce(r, Dtype::Bf16, None, &[&bf16_bits(0x7F81)]);
        assert!(
            u16s(&out).iter().all(|&b| bf16::from_bits(b).is_nan()),
            "{}",
            r.level()
        );
        // Inf + -Inf.
        let (inf, ninf) = (f32s(f32::INFINITY), f32s(f32::NEG_INFINITY));
        let out = reduce(r, Dtype::F32, None, &[&inf, &ninf]);
        assert!(out
            .chunks(4)
            .all(|c| f32::from_ne_bytes(c.try_into().unwrap()).is_nan()));
    }
}

#[test]
fn negative_zero_survives_a_lone_copy() {
    for r in levels() {
        for dtype in Dtype::ALL {
            let nz: Vec<u8> = match dtype {
                Dtype::F32 => f32s(-0.0),
                Dtype::F64 => (0..N).flat_map(|_| (-0.0f64).to_ne_bytes()).collect(),
                Dtype::F16 => f16s(-0.0),
                Dtype::Bf16 => bf16_bits(0x8000),
                Dtype::I32 | Dtype::I64 => continue,
            };
            let mut acc = vec![0x55; N * dtype.accumulator().size()];
            r.accumulate(dtype, &mut acc, true, &[&nz]);
            let want = ref_sum(dtype, None, &[&nz], N);
            assert_eq!(acc, want, "{} {dtype}", r.level());
            assert!(acc
                .chunks(dtype.accumulator().size())
                .all(|c| c.iter().any(|&b| b != 0)));
            assert_eq!(reduce(r, dtype, None, &[&nz]), nz, "{} {dtype}", r.level());
            assert_eq!(
                reduce(r, dtype, None, &[&nz, &nz]),
                nz,
                "{} {dtype}",
                r.level()
            );
        }
    }
}

#[test]
fn scalar_f16_conversions_match_half() {
    use super::portable::{f16_to_f32, f32_to_f16};
    for h in 0..=u16::MAX {
        let want = f16::from_bits(h).to_f32();
        let got = f16_to_f32(h);
        assert!(
            got.to_bits() == want.to_bits() || got.is_nan() && want.is_nan(),
            "{h:#06x}"
        );
    }
    let check = |v: f32| {
        let (got, want) = (f32_to_f16(v), f16::from_f32(v));
        let ok = got == want.to_bits() || want.is_nan() && f16::from_bits(got).is_nan();
        assert!(
            ok,
            "{v:e} ({:#010x}): got {got:#06x}, want {:#06x}",
            v.to_bits(),
            want.to_bits()
        );
    };
    // Every f16 value, the exact midpoint to the next one (a tie), and the f32
    // values either side of that midpoint.
    for h in 0..=u16::MAX {
        let (a, b) = (
            f16::from_bits(h).to_f32(),
            f16::from_bits(h.wrapping_add(1)).to_f32(),
        );
        check(a);
        if a.is_finite() && b.is_finite() {
            let mid = (a + b) / 2.0;
            for bits in [mid.to_bits() - 1, mid.to_bits(), mid.to_bits() + 1] {
                check(f32::from_bits(bits));
            }
        }
    }
    // A sweep over all f32 bit patterns.
    for bits in (0..=u32::MAX).step_by(997) {
        check(f32::from_bits(bits));
    }
    check(65519.996);
    check(65520.0);
    check(f32::MAX);
}

#[test]
fn scalar_bf16_rounding_matches_half() {
    use super::portable::f32_to_bf16;
    let check = |bits: u32| {
        let v = f32::from_bits(bits);
        let (got, want) = (f32_to_bf16(v), bf16::from_f32(v));
        let ok = got == want.to_bits() || want.is_nan() && bf16::from_bits(got).is_nan();
        assert!(
            ok,
            "{bits:#010x}: got {got:#06x}, want {:#06x}",
            want.to_bits()
        );
    };
    for hi in 0..=u32::from(u16::MAX) {
        for lo in [0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF] {
            check(hi << 16 | lo);
        }
    }
    for bits in (0..=u32::MAX).step_by(997) {
        check(bits);
    }
}

#[test]
fn levels_and_errors() {
    let available = SimdLevel::available();
    assert_eq!(available[0], SimdLevel::detect());
    assert_eq!(available.last(), Some(&SimdLevel::Portable));
    assert_eq!(Reducer::detect().level(), SimdLevel::detect());
    for level in [SimdLevel::Avx512, SimdLevel::Avx2F16c, SimdLevel::Portable] {
        match Reducer::with_level(level) {
            Ok(r) => assert!(level.supported() && r.level() == level),
            Err(e) => {
                assert!(!level.supported());
                assert!(e.to_string().contains(level.name()), "{e}");
            }
        }
    }
    assert_eq!(SimdLevel::Avx2F16c.name(), "avx2+f16c");
}

#[test]
#[should_panic(expected = "srcs[1] is 6 bytes")]
fn mismatched_source_length_panics() {
    let mut acc = vec![0u8; 16];
    Reducer::detect().accumulate(Dtype::F16, &mut acc, false, &[&[0; 8], &[0; 6]]);
}

#[test]
#[should_panic(expected = "not a whole number of 4-byte f32 elements")]
fn ragged_accumulator_panics() {
    let mut acc = vec![0u8; 10];
    Reducer::detect().accumulate(Dtype::Bf16, &mut acc, false, &[]);
}

#[test]
#[should_panic(expected = "acc is 8 bytes (2 elements) but out is 6 bytes (3 elements)")]
fn mismatched_acc_in_reduce_panics() {
    let mut out = vec![0u8; 6];
    Reducer::detect().reduce_into(Dtype::F16, Some(&[0; 8]), &[], &mut out);
}

#[test]
#[should_panic(expected = "nothing to sum")]
fn reduce_of_nothing_panics() {
    let mut out = vec![0u8; 8];
    Reducer::detect().reduce_into(Dtype::F32, None, &[], &mut out);
}
