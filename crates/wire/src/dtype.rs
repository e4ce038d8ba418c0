//! Element types a key can hold.

use std::fmt;

/// The element type of a key's data, as declared at init and carried by every push.
///
/// 16-bit floats travel as 16 bits but are summed in `f32` accumulators (see
/// [`Dtype::accumulator`]); integers exist for exact end-to-end tests.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Dtype {
    F32 = 1,
    F16 = 2,
    Bf16 = 3,
    F64 = 4,
    I32 = 5,
    I64 = 6,
}

impl Dtype {
    pub const ALL: [Dtype; 6] = [
        Dtype::F32,
        Dtype::F16,
        Dtype::Bf16,
        Dtype::F64,
        Dtype::I32,
        Dtype::I64,
    ];

    /// Bytes of one element on the wire.
    pub const fn size(self) -> usize {
        match self {
            Dtype::F16 | Dtype::Bf16 => 2,
            Dtype::F32 | Dtype::I32 => 4,
            Dtype::F64 | Dtype::I64 => 8,
        }
    }

    /// The type the summation service accumulates this dtype in.
    pub const fn accumulator(self) -> Dtype {
        match self {
            Dtype::F16 | Dtype::Bf16 => Dtype::F32,
            other => other,
        }
    }

    pub const fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::F16 => "f16",
            Dtype::Bf16 => "bf16",
            Dtype::F64 => "f64",
            Dtype::I32 => "i32",
            Dtype::I64 => "i64",
        }
    }

    pub fn from_code(code: u8) -> Option<Dtype> {
        Dtype::ALL.into_iter().find(|d| *d as u8 == code)
    }

    pub fn from_name(name: &str) -> Option<Dtype> {
        Dtype::ALL.into_iter().find(|d| d.name() == name)
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_and_names_round_trip() {
        for d in Dtype::ALL {
            assert_eq!(Dtype::from_code(d as u8), Some(d));
            assert_eq!(Dtype::from_name(d.name()), Some(d));
        }
        assert_eq!(Dtype::from_code(0), None);
        assert_eq!(Dtype::from_code(7), None);
        assert_eq!(Dtype::from_name("float"), None);
    }

    #[test]
    fn sixteen_bit_types_accumulate_in_f32() {
        assert_eq!(Dtype::F16.accumulator(), Dtype::F32);
        assert_eq!(Dtype::Bf16.accumulator(), Dtype::F32);
        assert_eq!(Dtype::I64.accumulator(), Dtype::I64);
    }
}
