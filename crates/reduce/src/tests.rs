//! Every available level against a scalar reference written here, bit for bit,
//! for every op and dtype.

use std::ops::{Add, Mul};

use half::{bf16, f16};
use sumflow_wire::{Dtype, ReduceOp};

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

/// A float type of the reference.
trait Float: Copy + PartialOrd + Add<Output = Self> + Mul<Output = Self> {
    const NAN: Self;
    fn is_nan(self) -> bool;
    fn is_sign_negative(self) -> bool;
}

impl Float for f32 {
    const NAN: f32 = f32::NAN;
    fn is_nan(self) -> bool {
        f32::is_nan(self)
    }
    fn is_sign_negative(self) -> bool {
        f32::is_sign_negative(self)
    }
}

impl Float for f64 {
    const NAN: f64 = f64::NAN;
    fn is_nan(self) -> bool {
        f64::is_nan(self)
    }
    fn is_sign_negative(self) -> bool {
        f64::is_sign_negative(self)
    }
}

/// `a op b` for floats, as the kernels promise it, written the obvious way.
fn ref_float<T: Float>(op: ReduceOp, a: T, b: T) -> T {
    match op {
        ReduceOp::Sum => a + b,
        ReduceOp::Product => a * b,
        ReduceOp::Min | ReduceOp::Max => {
            if a.is_nan() || b.is_nan() {
                return T::NAN; // canonical, whatever NaN came in
            }
            if a == b {
                // Equal values differ at most in the sign of a zero: -0.0 < +0.0.
                let (neg, pos) = if a.is_sign_negative() { (a, b) } else { (b, a) };
                return if op == ReduceOp::Min { neg } else { pos };
            }
            if (a < b) == (op == ReduceOp::Min) {
                a
            } else {
                b
            }
        }
    }
}

/// `a op b` for i32 or i64: products and sums wrap.
macro_rules! ref_int {
    ($op:expr, $a:expr, $b:expr) => {
        match $op {
            ReduceOp::Sum => $a.wrapping_add($b),
            ReduceOp::Product => $a.wrapping_mul($b),
            ReduceOp::Min => $a.min($b),
            ReduceOp::Max => $a.max($b),
        }
    };
}

/// The terms combined by `op` left to right from the first term (no added
/// identity), in the accumulator type, as accumulator bytes.
fn ref_reduce(dtype: Dtype, op: ReduceOp, acc: Option<&[u8]>, srcs: &[&[u8]], n: usize) -> Vec<u8> {
    let mut out = Vec::new();
    for i in 0..n {
        match dtype {
            Dtype::F32 | Dtype::F16 | Dtype::Bf16 => {
                let mut terms = acc
                    .map(|a| src_f32(Dtype::F32, a, i))
                    .into_iter()
                    .chain(srcs.iter().map(|s| src_f32(dtype, s, i)));
                let first = terms.next().unwrap();
                out.extend(terms.fold(first, |x, y| ref_float(op, x, y)).to_ne_bytes());
            }
            Dtype::F64 => {
                let mut terms = acc
                    .into_iter()
                    .chain(srcs.iter().copied())
                    .map(|s| f64::from_ne_bytes(rd(s, i)));
                let first = terms.next().unwrap();
                out.extend(terms.fold(first, |x, y| ref_float(op, x, y)).to_ne_bytes());
            }
            Dtype::I32 => {
                let mut terms = acc
                    .into_iter()
                    .chain(srcs.iter().copied())
                    .map(|s| i32::from_ne_bytes(rd(s, i)));
                let first = terms.next().unwrap();
                out.extend(terms.fold(first, |x, y| ref_int!(op, x, y)).to_ne_bytes());
            }
            Dtype::I64 => {
                let mut terms = acc
                    .into_iter()
                    .chain(srcs.iter().copied())
                    .map(|s| i64::from_ne_bytes(rd(s, i)));
                let first = terms.next().unwrap();
                out.extend(terms.fold(first, |x, y| ref_int!(op, x, y)).to_ne_bytes());
            }
        }
    }
    out
}

/// The sum, as [`ref_reduce`].
fn ref_sum(dtype: Dtype, acc: Option<&[u8]>, srcs: &[&[u8]], n: usize) -> Vec<u8> {
    ref_reduce(dtype, ReduceOp::Sum, acc, srcs, n)
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

/// Bitwise equality of elements of `dtype`, except that any NaN matches any NaN
/// unless `exact_nan`.
#[track_caller]
fn assert_same(dtype: Dtype, got: &[u8], want: &[u8], exact_nan: bool, ctx: &dyn Fn() -> String) {
    assert_eq!(got.len(), want.len(), "{}: length", ctx());
    let size = dtype.size();
    for (i, (g, w)) in got
        .chunks_exact(size)
        .zip(want.chunks_exact(size))
        .enumerate()
    {
        if g != w && (exact_nan || !(is_nan(dtype, g) && is_nan(dtype, w))) {
            panic!(
                "{}: element {i} of {}: got {g:02x?}, want {w:02x?}",
                ctx(),
                got.len() / size
            );
        }
    }
}

/// Whether results of `terms` terms must match NaN for NaN: min and max give
/// the canonical NaN once two terms meet (a lone term is copied as it is, and
/// F16C quiets a signalling NaN that the portable conversion keeps). Sums and
/// products promise no NaN payload.
fn exact_nan(op: ReduceOp, terms: usize) -> bool {
    matches!(op, ReduceOp::Min | ReduceOp::Max) && terms >= 2
}

/// Runs accumulate (fresh and not) and reduce_into (with and without acc) of
/// `srcs` and the accumulator `acc0` against the reference, placing the
/// destinations at alignment offsets derived from `off`.
#[allow(clippy::too_many_arguments)]
fn check_with(
    r: Reducer,
    rng: &mut Rng,
    dtype: Dtype,
    op: ReduceOp,
    srcs: &[&[u8]],
    acc0: &[u8],
    n: usize,
    off: usize,
) {
    let accd = dtype.accumulator();
    let nsrcs = srcs.len();
    let ctx = |what: &str| {
        let level = r.level();
        let what = what.to_string();
        move || format!("{level} {dtype} {op} {what} n={n} srcs={nsrcs} off={off}")
    };

    // The reference results, in the accumulator type, without and with acc0.
    let fresh_ref = (nsrcs > 0).then(|| ref_reduce(dtype, op, None, srcs, n));
    let acc_ref = ref_reduce(dtype, op, Some(acc0), srcs, n);

    for fresh in [false, true] {
        let mut acc = Placed::copy_of(acc0, (off + 2) % 4);
        r.accumulate(dtype, op, acc.bytes_mut(), fresh, srcs);
        let want = match (fresh, &fresh_ref) {
            (true, None) => vec![0; n * accd.size()],
            (true, Some(want)) => want.clone(),
            (false, _) => acc_ref.clone(),
        };
        let terms = nsrcs + usize::from(!fresh);
        assert_same(
            accd,
            acc.bytes(),
            &want,
            exact_nan(op, terms),
            &ctx(&format!("accumulate fresh={fresh}")),
        );
    }

    for with_acc in [false, true] {
        if !with_acc && nsrcs == 0 {
            continue;
        }
        let acc = with_acc.then_some(acc0);
        // Garbage in out proves every element is written.
        let mut out = Placed::random(rng, dtype, n, (off + 3) % 4);
        r.reduce_into(dtype, op, acc, srcs, out.bytes_mut());
        let wide = if with_acc {
            &acc_ref
        } else {
            fresh_ref.as_ref().unwrap()
        };
        let want = ref_round(dtype, wide);
        let terms = nsrcs + usize::from(with_acc);
        assert_same(
            dtype,
            out.bytes(),
            &want,
            exact_nan(op, terms),
            &ctx(&format!("reduce_into acc={with_acc}")),
        );
    }
}

/// [`check_with`] on random data at the given alignment offsets, for `ops`.
fn check_case(
    r: Reducer,
    rng: &mut Rng,
    (dtype, ops): (Dtype, &[ReduceOp]),
    n: usize,
    nsrcs: usize,
    off: usize,
) {
    let srcs: Vec<Placed> = (0..nsrcs)
        .map(|k| Placed::random(rng, dtype, n, (off + k + 1) % 4))
        .collect();
    let srcs: Vec<&[u8]> = srcs.iter().map(Placed::bytes).collect();
    let acc0 = Placed::random(rng, dtype.accumulator(), n, off);
    for &op in ops {
        check_with(r, rng, dtype, op, &srcs, acc0.bytes(), n, off);
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
                        check_case(r, &mut rng, (dtype, &ReduceOp::ALL), n, nsrcs, off);
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
        for (d, dtype) in Dtype::ALL.into_iter().enumerate() {
            // Every op up to 4097 elements (4 to 8 blocks of a plain type); the
            // long case, slow in a debug build, by sum and one op per dtype.
            let long = [ReduceOp::Sum, ReduceOp::ALL[1 + d % 3]];
            for (i, n) in [1000, 1023, 1024, 1025, 2063, 4097, 65537]
                .into_iter()
                .enumerate()
            {
                let ops = if n > 4097 { &long[..] } else { &ReduceOp::ALL };
                for nsrcs in [1, 2, 5] {
                    check_case(r, &mut rng, (dtype, ops), n, nsrcs, (i + nsrcs) % 4);
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
    reduce_by(r, dtype, ReduceOp::Sum, acc, srcs)
}

fn reduce_by(
    r: Reducer,
    dtype: Dtype,
    op: ReduceOp,
    acc: Option<&[u8]>,
    srcs: &[&[u8]],
) -> Vec<u8> {
    let mut out = vec![0xAA; N * dtype.size()];
    r.reduce_into(dtype, op, acc, srcs, &mut out);
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
        r.accumulate(Dtype::F16, ReduceOp::Sum, &mut acc, true, &srcs);
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
        r.accumulate(Dtype::F16, ReduceOp::Sum, &mut acc, true, &[&big, &big]);
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
            for op in ReduceOp::ALL {
                let ctx = || format!("{} {dtype} {op}", r.level());
                let mut acc = vec![0x55; N * dtype.accumulator().size()];
                r.accumulate(dtype, op, &mut acc, true, &[&nz]);
                let want = ref_sum(dtype, None, &[&nz], N);
                assert_eq!(acc, want, "{}", ctx());
                assert!(acc
                    .chunks(dtype.accumulator().size())
                    .all(|c| c.iter().any(|&b| b != 0)));
                assert_eq!(reduce_by(r, dtype, op, None, &[&nz]), nz, "{}", ctx());
                // -0 + -0, min, max and -0 * -0 = +0.
                let two = reduce_by(r, dtype, op, None, &[&nz, &nz]);
                let pz = vec![0; nz.len()];
                let want = if op == ReduceOp::Product { &pz } else { &nz };
                assert_eq!(&two, want, "{}", ctx());
            }
        }
    }
}

/// Every ordered pair (and a third term) of a dtype's special values, at
/// every vector lane and in the tails: NaNs of both signs and several
/// payloads, ±Inf, ±0, subnormals, extremes, ordinary values.
#[test]
fn special_values_pairwise_every_op() {
    let mut rng = Rng(3);
    for r in levels() {
        for dtype in [Dtype::F32, Dtype::F64, Dtype::F16, Dtype::Bf16] {
            let specials: Vec<Vec<u8>> = match dtype {
                Dtype::F32 => F32_SPECIALS
                    .iter()
                    .chain(&[
                        -1.0,
                        2.5,
                        f32::from_bits(0x7F80_0001),
                        f32::from_bits(0xFFC0_1234),
                    ])
                    .map(|v| v.to_ne_bytes().to_vec())
                    .collect(),
                Dtype::F64 => F32_SPECIALS
                    .iter()
                    .map(|&v| f64::from(v))
                    .chain([
                        f64::MAX,
                        f64::MIN,
                        5e-324,
                        -1.0,
                        f64::from_bits(0x7FF0_0000_0000_0001),
                    ])
                    .map(|v| v.to_ne_bytes().to_vec())
                    .collect(),
                Dtype::F16 => F16_SPECIALS
                    .iter()
                    .chain(&[0xBC00, 0x4100])
                    .map(|v| v.to_ne_bytes().to_vec())
                    .collect(),
                _ => BF16_SPECIALS
                    .iter()
                    .chain(&[0xBF80, 0x4020])
                    .map(|v| v.to_ne_bytes().to_vec())
                    .collect(),
            };
            let k = specials.len();
            let n = k * k;
            let col = |f: &dyn Fn(usize) -> usize, off: usize| {
                Placed::copy_of(
                    &(0..n)
                        .flat_map(|i| specials[f(i)].clone())
                        .collect::<Vec<_>>(),
                    off,
                )
            };
            let a = col(&|i| i / k, 1);
            let b = col(&|i| i % k, 3);
            let c = col(&|i| (i * 7 + 3) % k, 2);
            let acc0 = Placed::random(&mut rng, dtype.accumulator(), n, 0);
            for op in ReduceOp::ALL {
                for srcs in [
                    vec![a.bytes(), b.bytes()],
                    vec![a.bytes(), b.bytes(), c.bytes()],
                    vec![c.bytes()],
                ] {
                    check_with(r, &mut rng, dtype, op, &srcs, acc0.bytes(), n, 1);
                }
            }
        }
    }
}

#[test]
fn integer_products_wrap_as_sums_do() {
    let i32s = |v: i32| -> Vec<u8> { (0..N).flat_map(|_| v.to_ne_bytes()).collect() };
    let i64s = |v: i64| -> Vec<u8> { (0..N).flat_map(|_| v.to_ne_bytes()).collect() };
    for r in levels() {
        let level = r.level();
        let p = |dtype, srcs: &[&[u8]]| reduce_by(r, dtype, ReduceOp::Product, None, srcs);
        assert_eq!(
            p(Dtype::I32, &[&i32s(i32::MAX), &i32s(2)]),
            i32s(-2),
            "{level}"
        );
        assert_eq!(
            p(Dtype::I32, &[&i32s(i32::MIN), &i32s(-1)]),
            i32s(i32::MIN),
            "{level}"
        );
        let t16 = i32s(1 << 16);
        assert_eq!(p(Dtype::I32, &[&t16, &t16, &i32s(3)]), i32s(0), "{level}");
        // A wrapped partial product goes on wrapping: the low 32 bits of the exact one.
        let want = i32s((i64::from(1 << 30) * -15) as i32);
        assert_eq!(
            p(Dtype::I32, &[&i32s(1 << 30), &i32s(-3), &i32s(5)]),
            want,
            "{level}"
        );
        assert_eq!(
            p(Dtype::I64, &[&i64s(i64::MAX), &i64s(2)]),
            i64s(-2),
            "{level}"
        );
        assert_eq!(
            p(Dtype::I64, &[&i64s(i64::MIN), &i64s(-1)]),
            i64s(i64::MIN),
            "{level}"
        );
        assert_eq!(
            p(Dtype::I64, &[&i64s(1 << 32), &i64s(1 << 32)]),
            i64s(0),
            "{level}"
        );
        // Min and max compare as signed.
        let m = |op, dtype, srcs: &[&[u8]]| reduce_by(r, dtype, op, None, srcs);
        let (lo, hi) = (i32s(i32::MIN), i32s(i32::MAX));
        assert_eq!(m(ReduceOp::Min, Dtype::I32, &[&hi, &lo]), lo, "{level}");
        assert_eq!(m(ReduceOp::Max, Dtype::I32, &[&lo, &hi]), hi, "{level}");
        let (lo, hi) = (i64s(i64::MIN), i64s(-1));
        assert_eq!(m(ReduceOp::Min, Dtype::I64, &[&hi, &lo]), lo, "{level}");
        assert_eq!(m(ReduceOp::Max, Dtype::I64, &[&lo, &hi]), hi, "{level}");
    }
}

#[test]
fn f16_products_form_in_f32() {
    let (big, small) = (f16s(256.0), f16s(1.0 / 256.0));
    // In f16, 256 * 256 overflows to Inf before the third term could bring it back.
    let naive = f16::from_f32(256.0 * 256.0);
    assert!(naive.is_infinite());
    for r in levels() {
        let level = r.level();
        let out = reduce_by(
            r,
            Dtype::F16,
            ReduceOp::Product,
            None,
            &[&big, &big, &small],
        );
        assert_eq!(out, big, "{level}");
        // Through an f32 accumulator across calls: still no overflow.
        let mut acc = vec![0u8; N * 4];
        r.accumulate(Dtype::F16, ReduceOp::Product, &mut acc, true, &[&big, &big]);
        assert_eq!(acc, f32s(65536.0), "{level}");
        let out = reduce_by(r, Dtype::F16, ReduceOp::Product, Some(&acc), &[&small]);
        assert_eq!(out, big, "{level}");
        // A result out of f16 range rounds to Inf once, at the end.
        let out = reduce_by(r, Dtype::F16, ReduceOp::Product, None, &[&big, &big]);
        assert_eq!(u16s(&out), vec![0x7C00; N], "{level}");
        // bf16 shares f32's range: 2^100 * 2^100 / 2^100 is exact.
        let e100 = bf16_bits(bf16::from_f32(2f32.powi(100)).to_bits());
        let em100 = bf16_bits(bf16::from_f32(2f32.powi(-100)).to_bits());
        let out = reduce_by(
            r,
            Dtype::Bf16,
            ReduceOp::Product,
            None,
            &[&e100, &em100, &e100],
        );
        assert_eq!(out, e100, "{level}");
    }
}

#[test]
fn min_and_max_give_the_canonical_nan_and_order_signed_zeros() {
    for r in levels() {
        let level = r.level();
        for op in [ReduceOp::Min, ReduceOp::Max] {
            // Any NaN, on either side, of any sign or payload: the canonical quiet NaN.
            for (nan, one, canon) in [
                (bf16_bits(0xFF81), bf16_bits(0x3F80), 0x7FC0u16),
                (bf16_bits(0x7FC1), bf16_bits(0xFF80), 0x7FC0),
                (f16s(f32::from_bits(0xFFC0_0000)), f16s(1.0), 0x7E00),
                (f16s(f32::NAN), f16s(f32::NEG_INFINITY), 0x7E00),
            ] {
                let dtype = if canon == 0x7FC0 {
                    Dtype::Bf16
                } else {
                    Dtype::F16
                };
                for srcs in [[&nan[..], &one[..]], [&one[..], &nan[..]]] {
                    let out = reduce_by(r, dtype, op, None, &srcs);
                    assert_eq!(u16s(&out), vec![canon; N], "{level} {op} {dtype}");
                }
            }
            let (nan, one) = (f32s(f32::from_bits(0xFFFF_FFFF)), f32s(1.0));
            let out = reduce_by(r, Dtype::F32, op, None, &[&one, &nan]);
            assert_eq!(out, f32s(f32::NAN), "{level} {op}");
            // A NaN accumulator meets the sources too.
            let mut acc = f32s(f32::from_bits(0x7F80_0001));
            r.accumulate(Dtype::F16, op, &mut acc, false, &[&f16s(2.0)]);
            assert_eq!(acc, f32s(f32::NAN), "{level} {op}");
            // Signed zeros, either order: -0.0 < +0.0.
            let (pz, nz) = (f32s(0.0), f32s(-0.0));
            let want = if op == ReduceOp::Min { &nz } else { &pz };
            assert_eq!(
                &reduce_by(r, Dtype::F32, op, None, &[&pz, &nz]),
                want,
                "{level} {op}"
            );
            assert_eq!(
                &reduce_by(r, Dtype::F32, op, None, &[&nz, &pz]),
                want,
                "{level} {op}"
            );
            let (pz, nz) = (f16s(0.0), f16s(-0.0));
            let want = if op == ReduceOp::Min { &nz } else { &pz };
            assert_eq!(
                &reduce_by(r, Dtype::F16, op, None, &[&nz, &pz]),
                want,
                "{level} {op}"
            );
            assert_eq!(
                &reduce_by(r, Dtype::F16, op, None, &[&pz, &nz]),
                want,
                "{level} {op}"
            );
        }
        // A lone NaN is passed on as it is, not made canonical.
        let nan = f16s(f32::from_bits(0xFFC0_2000));
        let out = reduce_by(r, Dtype::F16, ReduceOp::Max, None, &[&nan]);
        assert_eq!(out, nan, "{level}");
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
    Reducer::detect().accumulate(
        Dtype::F16,
        ReduceOp::Max,
        &mut acc,
        false,
        &[&[0; 8], &[0; 6]],
    );
}

#[test]
#[should_panic(expected = "not a whole number of 4-byte f32 elements")]
fn ragged_accumulator_panics() {
    let mut acc = vec![0u8; 10];
    Reducer::detect().accumulate(Dtype::Bf16, ReduceOp::Sum, &mut acc, false, &[]);
}

#[test]
#[should_panic(expected = "acc is 8 bytes (2 elements) but out is 6 bytes (3 elements)")]
fn mismatched_acc_in_reduce_panics() {
    let mut out = vec![0u8; 6];
    Reducer::detect().reduce_into(Dtype::F16, ReduceOp::Min, Some(&[0; 8]), &[], &mut out);
}

#[test]
#[should_panic(expected = "nothing to reduce")]
fn reduce_of_nothing_panics() {
    let mut out = vec![0u8; 8];
    Reducer::detect().reduce_into(Dtype::F32, ReduceOp::Product, None, &[], &mut out);
}
