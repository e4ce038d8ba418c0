//! Which keys exist, what they hold, and which engine owns each.
//!
//! Keys are placed on the engine with the fewest bytes so far (PHub's load-balanced key
//! assignment): engines then share no state on the hot path, and each does about the same
//! memory traffic.

use std::collections::HashMap;
use std::sync::Arc;

use sumflow_compress::Compressor;
use sumflow_wire::{Dtype, KeyCodec};
use thiserror::Error;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyMeta {
    pub dtype: Dtype,
    /// Uncompressed length.
    pub byte_len: u64,
    pub codec: KeyCodec,
    /// The workers whose pushes make up each round, ascending; `None`: every worker.
    /// Shared, not copied, by each lookup of the key.
    pub members: Option<Arc<[u32]>>,
    pub engine: usize,
    /// The worker whose declaration created the key, for mismatch messages.
    pub declared_by: u32,
}

impl KeyMeta {
    pub fn elements(&self) -> u64 {
        self.byte_len / self.dtype.size() as u64
    }

    /// Bytes of every push and every sum of the key.
    pub fn payload_len(&self) -> u64 {
        self.codec.payload_len(self.dtype, self.elements())
    }

    /// The compressor whose payloads the server decodes and re-encodes; `None` where it
    /// sums payloads as they are (raw elements, or random-k's values).
    pub fn decoder(&self) -> Option<Compressor> {
        (!self.codec.codec.summable()).then(|| {
            Compressor::new(self.codec, self.elements() as usize)
                .expect("InitKey's decoding checked the codec")
        })
    }

    /// Bytes of the accumulator: the payload's elements widened to the accumulator's type,
    /// or, for a key whose payloads are decoded, all of its elements in f32.
    pub fn acc_len(&self) -> u64 {
        let acc = self.dtype.accumulator().size() as u64;
        if self.codec.codec.summable() {
            self.payload_len() / self.dtype.size() as u64 * acc
        } else {
            self.elements() * acc
        }
    }

    /// Bytes the server holds for this key: the accumulator, the last round's sum, and the
    /// residual of its re-compression when it keeps one.
    pub fn footprint(&self) -> u64 {
        let residual = if self.decoder().is_some() && self.codec.feedback {
            self.elements() * 4
        } else {
            0
        };
        self.acc_len() + self.payload_len() + residual
    }
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum DeclareError {
    #[error(
        "key {key} declared by worker {worker} as {}, but worker {first_worker} declared it as \
         {}: every worker must declare a key with the same {}",
        form(*.dtype, *.elements, .codec),
        form(*.first_dtype, *.first_elements, .first_codec),
        if .codec.is_raw() && .first_codec.is_raw() {
            "dtype and size"
        } else {
            "dtype, size and compression"
        }
    )]
    Mismatch {
        key: u64,
        worker: u32,
        dtype: Dtype,
        elements: u64,
        codec: KeyCodec,
        first_worker: u32,
        first_dtype: Dtype,
        first_elements: u64,
        first_codec: KeyCodec,
    },
    #[error(
        "key {key} declared by worker {worker} {}, but worker {first_worker} declared it {}: \
         every worker must declare a key with the same members",
        members_text(.members.as_deref()),
        members_text(.first_members.as_deref())
    )]
    MembersMismatch {
        key: u64,
        worker: u32,
        members: Option<Vec<u32>>,
        first_worker: u32,
        first_members: Option<Vec<u32>>,
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

/// A key's declaration, for messages: "f32 x 1024", with its codec unless raw.
fn form(dtype: Dtype, elements: u64, codec: &KeyCodec) -> String {
    if codec.is_raw() {
        format!("{dtype} x {elements}")
    } else {
        format!("{dtype} x {elements} compressed by {codec}")
    }
}

/// A key's members, for messages: "with members [0, 2]", or "for every worker".
fn members_text(members: Option<&[u32]>) -> String {
    match members {
        Some(m) => format!("with members {m:?}"),
        None => "for every worker".into(),
    }
}

/// Why a worker's `Retire` of a key is refused.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum RetireError {
    #[error(
        "worker {worker} retired key {key}, which is not live on this server: never \
         initialised, or already retired by every worker of it"
    )]
    Unknown { key: u64, worker: u32 },
    #[error(
        "worker {worker} retired key {key}, but the key's rounds count only its members, \
         workers {members:?}"
    )]
    NotMember {
        key: u64,
        worker: u32,
        members: Vec<u32>,
    },
    #[error("worker {worker} retired key {key} twice")]
    Twice { key: u64, worker: u32 },
}

/// The outcome of a valid retirement.
#[derive(Debug, PartialEq, Eq)]
pub enum Retired {
    /// Other workers of the key have not retired it yet: it stays.
    Waiting(KeyMeta),
    /// The last worker of the key retired it: it is gone from the directory, and its
    /// engine must free it.
    Freed(KeyMeta),
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
    /// Live keys that some of their workers have retired: those workers, in retiring order.
    retiring: HashMap<u64, Vec<u32>>,
    /// The most keys live at once, and how many were freed after every worker retired them.
    peak: usize,
    freed: u64,
}

impl KeyDirectory {
    pub fn new(engines: usize, memory_limit: Option<u64>) -> Self {
        assert!(engines > 0, "at least one engine");
        KeyDirectory {
            keys: HashMap::new(),
            engine_bytes: vec![0; engines],
            memory_limit,
            retiring: HashMap::new(),
            peak: 0,
            freed: 0,
        }
    }

    /// Keys live now.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether no key is live.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// The most keys that were live at once.
    pub fn peak(&self) -> usize {
        self.peak
    }

    /// Keys freed so far because every worker of theirs retired them.
    pub fn freed(&self) -> u64 {
        self.freed
    }

    /// Whether `worker` has retired `key`, which is still live for others.
    pub fn retired_by(&self, key: u64, worker: u32) -> bool {
        !self.retiring.is_empty()
            && self
                .retiring
                .get(&key)
                .is_some_and(|by| by.contains(&worker))
    }

    /// `worker` will never push or pull `key` again. Once every worker of the key (its
    /// members, or all `workers` of the job) has retired it, the key leaves the directory,
    /// its bytes no longer count against the memory limit, and the caller must have its
    /// engine free it.
    pub fn retire(&mut self, key: u64, worker: u32, workers: u32) -> Result<Retired, RetireError> {
        let Some(meta) = self.keys.get(&key) else {
            return Err(RetireError::Unknown { key, worker });
        };
        if let Some(members) = meta.members.as_deref() {
            if members.binary_search(&worker).is_err() {
                return Err(RetireError::NotMember {
                    key,
                    worker,
                    members: members.to_vec(),
                });
            }
        }
        let quorum = meta
            .members
            .as_deref()
            .map_or(workers as usize, <[u32]>::len);
        let by = self.retiring.entry(key).or_default();
        if by.contains(&worker) {
            return Err(RetireError::Twice { key, worker });
        }
        by.push(worker);
        if by.len() < quorum {
            return Ok(Retired::Waiting(meta.clone()));
        }
        self.retiring.remove(&key);
        let meta = self.keys.remove(&key).expect("checked above");
        self.engine_bytes[meta.engine] -= meta.footprint();
        self.freed += 1;
        Ok(Retired::Freed(meta))
    }

    pub fn get(&self, key: u64) -> Option<KeyMeta> {
        self.keys.get(&key).cloned()
    }

    pub fn engine_bytes(&self) -> &[u64] {
        &self.engine_bytes
    }

    /// Declares `key` for `worker`: creates it, or checks a later declaration against the
    /// first. `members` are ascending ranks of the job (the caller checks them against its
    /// size); `None` counts every worker.
    pub fn declare(
        &mut self,
        key: u64,
        dtype: Dtype,
        byte_len: u64,
        codec: KeyCodec,
        members: Option<&[u32]>,
        worker: u32,
    ) -> Result<Declared, DeclareError> {
        if let Some(first) = self.keys.get(&key) {
            if first.dtype != dtype || first.byte_len != byte_len || first.codec != codec {
                return Err(DeclareError::Mismatch {
                    key,
                    worker,
                    dtype,
                    elements: byte_len / dtype.size() as u64,
                    codec,
                    first_worker: first.declared_by,
                    first_dtype: first.dtype,
                    first_elements: first.elements(),
                    first_codec: first.codec,
                });
            }
            if first.members.as_deref() != members {
                return Err(DeclareError::MembersMismatch {
                    key,
                    worker,
                    members: members.map(<[u32]>::to_vec),
                    first_worker: first.declared_by,
                    first_members: first.members.as_deref().map(<[u32]>::to_vec),
                });
            }
            return Ok(Declared::Existing(first.clone()));
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
            codec,
            members: members.map(Arc::from),
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
        self.keys.insert(key, meta.clone());
        self.peak = self.peak.max(self.keys.len());
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
            d.declare(k as u64, Dtype::F32, s * 4, KeyCodec::RAW, None, 0)
                .unwrap();
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
            d.declare(7, Dtype::F16, 20, KeyCodec::RAW, None, 0),
            Ok(Declared::New(_))
        ));
        assert!(matches!(
            d.declare(7, Dtype::F16, 20, KeyCodec::RAW, None, 1),
            Ok(Declared::Existing(_))
        ));
        let e = d
            .declare(7, Dtype::F32, 20, KeyCodec::RAW, None, 2)
            .unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("worker 2 as f32 x 5,") && msg.contains("same dtype and size"),
            "{msg}"
        );
        assert!(d
            .declare(7, Dtype::F16, 22, KeyCodec::RAW, None, 1)
            .is_err());
    }

    #[test]
    fn memory_limit_is_enforced_and_explained() {
        let mut d = KeyDirectory::new(2, Some(1000));
        d.declare(1, Dtype::I32, 400, KeyCodec::RAW, None, 0)
            .unwrap(); // 800 bytes held
        let e = d
            .declare(2, Dtype::I32, 200, KeyCodec::RAW, None, 0)
            .unwrap_err();
        assert!(e.to_string().contains("--max-key-memory"), "{e}");
        assert_eq!(d.get(2), None);
    }

    #[test]
    fn sixteen_bit_keys_count_their_f32_accumulator() {
        let mut d = KeyDirectory::new(1, None);
        let Declared::New(m) = d
            .declare(1, Dtype::Bf16, 100, KeyCodec::RAW, None, 0)
            .unwrap()
        else {
            panic!()
        };
        assert_eq!(m.footprint(), 50 * 4 + 100);
    }

    #[test]
    fn compressed_keys_must_match_in_codec_and_count_what_they_hold() {
        use sumflow_wire::Codec;
        let topk = |param, feedback| KeyCodec {
            codec: Codec::TopK,
            param,
            feedback,
        };
        let mut d = KeyDirectory::new(1, None);
        let Declared::New(m) = d
            .declare(1, Dtype::F32, 4000, topk(10, true), None, 0)
            .unwrap()
        else {
            panic!()
        };
        // f32 accumulator, a top-10 sum, the server's residual.
        assert_eq!(m.footprint(), 4000 + 80 + 4000);
        let e = d
            .declare(1, Dtype::F32, 4000, topk(20, true), None, 3)
            .unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("topk (k = 20) with error feedback")
                && msg.contains("topk (k = 10) with error feedback"),
            "{msg}"
        );
        let randomk = KeyCodec {
            codec: Codec::RandomK,
            param: 10,
            feedback: false,
        };
        let Declared::New(m) = d.declare(2, Dtype::F32, 4000, randomk, None, 0).unwrap() else {
            panic!()
        };
        // Summed as 10 values: accumulator and sum of 10 f32 each.
        assert_eq!(m.footprint(), 80);
    }

    #[test]
    fn a_key_is_freed_once_every_worker_of_it_retired_it() {
        let mut d = KeyDirectory::new(2, Some(100));
        d.declare(1, Dtype::I32, 40, KeyCodec::RAW, None, 0)
            .unwrap();
        d.declare(2, Dtype::I32, 8, KeyCodec::RAW, Some(&[0, 2]), 0)
            .unwrap();
        assert_eq!((d.len(), d.peak()), (2, 2));
        // A key of every worker: all three must retire it.
        assert!(matches!(d.retire(1, 1, 3), Ok(Retired::Waiting(_))));
        assert!(d.retired_by(1, 1) && !d.retired_by(1, 0));
        assert_eq!(
            d.retire(1, 1, 3),
            Err(RetireError::Twice { key: 1, worker: 1 })
        );
        assert!(matches!(d.retire(1, 0, 3), Ok(Retired::Waiting(_))));
        assert!(matches!(d.retire(1, 2, 3), Ok(Retired::Freed(_))));
        assert_eq!(d.get(1), None);
        assert!(!d.retired_by(1, 1));
        assert_eq!((d.len(), d.peak(), d.freed()), (1, 2, 1));
        // Its bytes no longer count against the limit: 80 of 100 bytes fit again.
        d.declare(3, Dtype::I32, 40, KeyCodec::RAW, None, 0)
            .unwrap();
        let e = d.retire(1, 0, 3).unwrap_err();
        assert!(e.to_string().contains("not live on this server"), "{e}");
        // A key of members: only they retire it, and the two of them free it.
        let e = d.retire(2, 1, 3).unwrap_err();
        assert!(matches!(e, RetireError::NotMember { .. }), "{e}");
        assert!(matches!(d.retire(2, 2, 3), Ok(Retired::Waiting(_))));
        assert!(matches!(d.retire(2, 0, 3), Ok(Retired::Freed(_))));
        assert_eq!(d.engine_bytes().iter().sum::<u64>(), 80);
    }

    #[test]
    fn redeclaration_must_name_the_same_members() {
        let mut d = KeyDirectory::new(1, None);
        let Declared::New(m) = d
            .declare(1, Dtype::F32, 8, KeyCodec::RAW, Some(&[0, 2]), 0)
            .unwrap()
        else {
            panic!()
        };
        assert_eq!(m.members.as_deref(), Some(&[0, 2][..]));
        // Members change nothing of what the key holds.
        assert_eq!(m.footprint(), 16);
        assert!(matches!(
            d.declare(1, Dtype::F32, 8, KeyCodec::RAW, Some(&[0, 2]), 2),
            Ok(Declared::Existing(_))
        ));
        let e = d
            .declare(1, Dtype::F32, 8, KeyCodec::RAW, Some(&[0, 1, 2]), 1)
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "key 1 declared by worker 1 with members [0, 1, 2], but worker 0 declared it with \
             members [0, 2]: every worker must declare a key with the same members"
        );
        let e = d
            .declare(1, Dtype::F32, 8, KeyCodec::RAW, None, 1)
            .unwrap_err();
        assert!(
            e.to_string().contains("worker 1 for every worker, but"),
            "{e}"
        );
        d.declare(2, Dtype::F32, 8, KeyCodec::RAW, None, 0).unwrap();
        let e = d
            .declare(2, Dtype::F32, 8, KeyCodec::RAW, Some(&[1]), 1)
            .unwrap_err();
        assert!(matches!(e, DeclareError::MembersMismatch { .. }), "{e}");
    }
}
