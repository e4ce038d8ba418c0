//! Writing a pulled sum into the caller's tensor, optionally divided by the worker count.

use half::{bf16, f16};
use sumflow_wire::Dtype;

/// Copies `sum` into `dst`, dividing each element by `divisor` when given. Integer sums are
/// never divided (the service refuses to average integers before anything is sent).
pub fn write_result(dtype: Dtype, dst: &mut [u8], sum: &[u8], divisor: Option<u32>) {
    assert_eq!(dst.len(), sum.len(), "result length mismatch");
    let Some(n) = divisor.filter(|n| *n > 1) else {
        dst.copy_from_slice(sum);
        return;
    };
    macro_rules! scale {
        ($t:ty, $size:expr, $from:expr, $to:expr) => {
            for (d, s) in dst.chunks_exact_mut($size).zip(sum.chunks_exact($size)) {
                let v: $t = $from(s.try_into().expect("element"));
                d.copy_from_slice(&$to(v));
            }
        };
    }
    match dtype {
        Dtype::F32 => {
            let inv = n as f32;
            scale!(f32, 4, |b| f32::from_le_bytes(b) / inv, |v: f32| v
                .to_le_bytes());
        }
        Dtype::F64 => {
            let inv = n as f64;
            scale!(f64, 8, |b| f64::from_le_bytes(b) / inv, |v: f64| v
                .to_le_bytes());
        }
        Dtype::F16 => {
            let inv = n as f32;
            scale!(
                f16,
                2,
                |b| f16::from_f32(f16::from_le_bytes(b).to_f32() / inv),
                |v: f16| v.to_le_bytes()
            );
        }
        Dtype::Bf16 => {
            let inv = n as f32;
            scale!(
                bf16,
                2,
                |b| bf16::from_f32(bf16::from_le_bytes(b).to_f32() / inv),
                |v: bf16| v.to_le_bytes()
            );
        }
        Dtype::I32 | Dtype::I64 => dst.copy_from_slice(sum),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn averages_floats_and_copies_otherwise() {
        let sum: Vec<u8> = [3.0f32, -6.0, 1.5]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let mut dst = vec![0u8; sum.len()];
        write_result(Dtype::F32, &mut dst, &sum, Some(3));
        let got: Vec<f32> = dst
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(got, [1.0, -2.0, 0.5]);
        write_result(Dtype::F32, &mut dst, &sum, None);
        assert_eq!(dst, sum);
        let h: Vec<u8> = [f16::from_f32(6.0)]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let mut d = vec![0u8; 2];
        write_result(Dtype::F16, &mut d, &h, Some(4));
        assert_eq!(f16::from_le_bytes([d[0], d[1]]).to_f32(), 1.5);
        let b: Vec<u8> = bf16::from_f32(-8.0).to_le_bytes().to_vec();
        write_result(Dtype::Bf16, &mut d, &b, Some(2));
        assert_eq!(bf16::from_le_bytes([d[0], d[1]]).to_f32(), -4.0);
    }
}
