//! Which keys exist, what they hold, and which engine thread owns each.
//!
//! Keys are placed on the engine with the fewest bytes so far (PHub's load-balanced key
//! assignment): engines then share no state on the hot path, and each does about the same
//! memory traffic.

use std::collections::HashMap;

use sumflow_wire::Dtype;
use thiserror::Error;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeyMeta {
    pub dtype: Dtype,
    pub byte_len: u64,
    pub engine: usize,
    /// The worker whose declaration created the key, for mismatch messages.
    pub declared_by: u32,
}

impl KeyMeta {
    pub fn elements(&self) -> u64 {
        self.byte_len / self.dtype.size() as u64
    }

    /// Bytes the server holds for this key: the accumulator and the last round's sum.
    pub fn footprint(&self) -> u64 {
        self.elements() * self.dtype.accumulator().size() as u64 + self.byte_len
    }
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum DeclareError {
    #[error(
        "key {key} declared by worker {worker} as {dtype} x {elements} elements, but worker \
         {first_worker} declared it as {first_dtype} x {first_elements}: every worker must \
         declare a key with the same dtype and size"
    )]
    Mismatch {
        key: u64,
        worker: u32,
        dtype: Dtype,
        elements: u64,
        first_worker: u32,
        first_dtype: Dtype,
        first_elements: u64,
    },
    #[error(
        "key {key} needs {need} bytes but the server's key memory limit of {limit} bytes has \
         {used} in use; raise --max-key-memory or add servers"
    )]
    MemoryLimit {
        key: u64,
        need: u64,
        used: u64,
        limit: u64,
    },
}

/// The outcome of a valid declaration.
#[derive(Debug, PartialEq, Eq)]
pub enum Declared {
    /// First declaration: the engine must create the key.
    New(KeyMeta),
    /// The key exists with the same dtype and size.
    Existing(KeyMeta),
}

#[derive(Debug)]
pub struct KeyDirectory {
    keys: HashMap<u64, KeyMeta>,
    engine_bytes: Vec<u64>,
    memory_limit: Option<u64>,
}

impl KeyDirectory {
    pub fn new(engines: usize, memory_limit: Option<u64>) -> Self {
        assert!(engines > 0, "at least one engine");
        KeyDirectory {
            keys: HashMap::new(),
            engine_bytes: vec![0; engines],
            memory_limit,
        }
    }

    pub fn get(&self, key: u64) -> Option<KeyMeta> {
        self.keys.get(&key).copied()
    }

    pub fn engine_bytes(&self) -> &[u64] {
        &self.engine_bytes
    }

    pub fn declare(
        &mut self,
        key: u64,
        dtype: Dtype,
        byte_len: u64,
        worker: u32,
    ) -> Result<Declared, DeclareError> {
        if let Some(first) = self.keys.get(&key) {
            if first.dtype != dtype || first.byte_len != byte_len {
                return Err(DeclareError::Mismatch {
                    key,
                    worker,
                    dtype,
                    elements: byte_len / dtype.size() as u64,
                    first_worker: first.declared_by,
                    first_dtype: first.dtype,
                    first_elements: first.elements(),
                });
            }
            return Ok(Declared::Existing(*first));
        }
        let (engine, _) = self
            .engine_bytes
            .iter()
            .enumerate()
            .min_by_key(|(i, bytes)| (**bytes, *i))
            .expect("at least one engine");
        let meta = KeyMeta {
            dtype,
            byte_len,
            engine,
            declared_by: worker,
        };
        let used: u64 = self.engine_bytes.iter().sum();
        if let Some(limit) = self.memory_limit {
            if used + meta.footprint() > limit {
                return Err(DeclareError::MemoryLimit {
                    key,
                    need: meta.footprint(),
                    used,
                    limit,
                });
            }
        }
        self.engine_bytes[engine] += meta.footprint();
        self.keys.insert(key, meta);
        Ok(Declared::New(meta))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_balance_over_engines_by_bytes() {
        let mut d = KeyDirectory::new(3, None);
        let sizes = [4096u64, 64, 64, 1024, 2048, 4096, 16, 512, 2048, 1024];
        for (k, s) in sizes.iter().enumerate() {
            d.declare(k as u64, Dtype::F32, s * 4, 0).unwrap();
        }
        let b = d.engine_bytes();
        let (lo, hi) = (b.iter().min().unwrap(), b.iter().max().unwrap());
        // Greedy placement keeps the spread within the largest key's footprint.
        assert!(hi - lo <= 4096 * 8, "{b:?}");
        assert_eq!(b.iter().sum::<u64>(), sizes.iter().sum::<u64>() * 8);
    }

    #[test]
    fn redeclaration_must_match() {
        let mut d = KeyDirectory::new(1, None);
        assert!(matches!(
            d.declare(7, Dtype::F16, 20, 0),
            Ok(Declared::New(_))
        ));
        assert!(matches!(
            d.declare(7, Dtype::F16, 20, 1),
            Ok(Declared::Existing(_))
        ));
        let e = d.declare(7, Dtype::F32, 20, 2).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("worker 2 as f32 x 5") && msg.contains("worker 0"),
            "{msg}"
        );
        assert!(d.declare(7, Dtype::F16, 22, 1).is_err());
    }

    #[test]
    fn memory_limit_is_enforced_and_explained() {
        let mut d = KeyDirectory::new(2, Some(1000));
        d.declare(1, Dtype::I32, 400, 0).unwrap(); // 800 bytes held
        let e = d.declare(2, Dtype::I32, 200, 0).unwrap_err();
        assert!(e.to_string().contains("--max-key-memory"), "{e}");
        assert_eq!(d.get(2), None);
    }

    #[test]
    fn sixteen_bit_keys_count_their_f32_accumulator() {
        let mut d = KeyDirectory::new(1, None);
        let Declared::New(m) = d.declare(1, Dtype::Bf16, 100, 0).unwrap() else {
            panic!()
        };
        assert_eq!(m.footprint(), 50 * 4 + 100);
    }
}
