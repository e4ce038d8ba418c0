//! Averaging a pulled sum in place, in the caller's tensor, by the worker count.

use half::{bf16, f16};
use sumflow_wire::Dtype;

/// Divides each element of the sum in `data` by `divisor` when given. Integer sums are
/// never divided (the service refuses to average integers before anything is sent).
pub fn scale_in_place(dtype: Dtype, data: &mut [u8], divisor: Option<u32>) {
    let Some(n) = divisor.filter(|n| *n > 1) else {
        return;
    };
    macro_rules! scale {
        ($t:ty, $size:expr, $from:expr, $to:expr) => {
            for e in data.chunks_exact_mut($size) {
                let v: $t = $from(e.as_ref().try_into().expect("element"));
                e.copy_from_slice(&$to(v));
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
        Dtype::I32 | Dtype::I64 => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn averages_floats_and_leaves_the_rest() {
        let sum: Vec<u8> = [3.0f32, -6.0, 1.5]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let mut data = sum.clone();
        scale_in_place(Dtype::F32, &mut data, Some(3));
        let got: Vec<f32> = data
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(got, [1.0, -2.0, 0.5]);
        let mut data = sum.clone();
        scale_in_place(Dtype::F32, &mut data, None);
        assert_eq!(data, sum);
        let mut ints: Vec<u8> = 6i32.to_le_bytes().to_vec();
        scale_in_place(Dtype::I32, &mut ints, Some(2));
        assert_eq!(ints, 6i32.to_le_bytes());
        let mut h = f16::from_f32(6.0).to_le_bytes();
        scale_in_place(Dtype::F16, &mut h, Some(4));
        assert_eq!(f16::from_le_bytes(h).to_f32(), 1.5);
        let mut b = bf16::from_f32(-8.0).to_le_bytes();
        scale_in_place(Dtype::Bf16, &mut b, Some(2));
        assert_eq!(bf16::from_le_bytes(b).to_f32(), -4.0);
    }
}
