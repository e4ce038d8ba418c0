//! Wire accounting: the bytes a worker wrote to and read from its summation servers, per
//! key, counted at the sockets (frames whole: headers, acknowledgements and sums), so
//! benchmarks report what crossed the wire rather than what the tensor sizes suggest.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

pub use sumflow_wire::accounting::WireBytes;

/// One key's bytes, with the tensor it belongs to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyBytes {
    pub tensor: Arc<str>,
    pub key: u64,
    pub bytes: WireBytes,
}

/// Every key's bytes so far, shared by a pipeline's lanes.
#[derive(Debug, Default)]
pub struct Ledger {
    keys: Mutex<HashMap<u64, (Arc<str>, WireBytes)>>,
    /// Bytes no key names: a reply for a key this worker never pushed, the leaving
    /// `Shutdown` frames.
    other: Mutex<WireBytes>,
}

impl Ledger {
    /// Makes `key` of `tensor` known, so that bytes read for it count as its own even
    /// before any written for it are counted.
    pub fn open(&self, key: u64, tensor: &Arc<str>) {
        self.keys
            .lock()
            .expect("ledger lock")
            .entry(key)
            .or_insert_with(|| (Arc::clone(tensor), WireBytes::default()));
    }

    /// `n` bytes written for `key` of `tensor`.
    pub fn sent(&self, key: u64, tensor: &Arc<str>, n: u64) {
        let mut keys = self.keys.lock().expect("ledger lock");
        let entry = keys
            .entry(key)
            .or_insert_with(|| (Arc::clone(tensor), WireBytes::default()));
        entry.1.sent += n;
    }

    /// `n` bytes read for `key` (`None`: a frame naming no key).
    pub fn received(&self, key: Option<u64>, n: u64) {
        if n == 0 {
            return;
        }
        if let Some(key) = key {
            if let Some(entry) = self.keys.lock().expect("ledger lock").get_mut(&key) {
                entry.1.received += n;
                return;
            }
        }
        self.other.lock().expect("ledger lock").received += n;
    }

    /// `n` bytes written for no key.
    pub fn sent_other(&self, n: u64) {
        self.other.lock().expect("ledger lock").sent += n;
    }

    /// Every key's bytes, by key, and the bytes no key names.
    pub fn snapshot(&self) -> (Vec<KeyBytes>, WireBytes) {
        let mut keys: Vec<KeyBytes> = self
            .keys
            .lock()
            .expect("ledger lock")
            .iter()
            .map(|(key, (tensor, bytes))| KeyBytes {
                tensor: Arc::clone(tensor),
                key: *key,
                bytes: *bytes,
            })
            .collect();
        keys.sort_by_key(|k| k.key);
        (keys, *self.other.lock().expect("ledger lock"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_per_key_and_keeps_the_rest_apart() {
        let ledger = Ledger::default();
        let t: Arc<str> = Arc::from("w");
        ledger.sent(7, &t, 100);
        ledger.sent(7, &t, 20);
        ledger.received(Some(7), 64);
        ledger.received(Some(9), 5);
        ledger.received(None, 3);
        ledger.sent_other(11);
        let (keys, other) = ledger.snapshot();
        assert_eq!(
            keys,
            vec![KeyBytes {
                tensor: t,
                key: 7,
                bytes: WireBytes {
                    sent: 120,
                    received: 64
                }
            }]
        );
        assert_eq!(
            other,
            WireBytes {
                sent: 11,
                received: 8
            }
        );
    }
}
