//! Wire accounting of a summation server: the bytes it read from and wrote to workers,
//! per key, counted at the sockets after the handshake (frames whole: headers,
//! acknowledgements, payloads and sums). Frames that name no key (heartbeats, shutdown
//! notices, refusals of a frame that named none) count as `other`.
//!
//! Each byte a server reads is one a worker wrote on the same TCP stream, so a key's
//! bytes here equal the sum, over workers, of that key's bytes in their own accounting:
//! the test `server_and_workers_count_the_same_bytes` holds the two to each other.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::Mutex;

use sumflow_wire::accounting::WireBytes;

/// Every key's bytes so far, shared by the server's connections.
#[derive(Debug, Default)]
pub struct Traffic {
    inner: Mutex<WireTraffic>,
}

impl Traffic {
    /// `n` bytes read for `key` (`None`: a frame naming no key).
    pub fn received(&self, key: Option<u64>, n: u64) {
        if n > 0 {
            self.inner.lock().expect("traffic lock").entry(key).received += n;
        }
    }

    /// `n` bytes written for `key` (`None`: a frame naming no key).
    pub fn sent(&self, key: Option<u64>, n: u64) {
        if n > 0 {
            self.inner.lock().expect("traffic lock").entry(key).sent += n;
        }
    }

    pub fn snapshot(&self) -> WireTraffic {
        self.inner.lock().expect("traffic lock").clone()
    }
}

/// A server's bytes per key and the bytes no key names.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WireTraffic {
    pub keys: HashMap<u64, WireBytes>,
    pub other: WireBytes,
}

impl WireTraffic {
    fn entry(&mut self, key: Option<u64>) -> &mut WireBytes {
        match key {
            Some(key) => self.keys.entry(key).or_default(),
            None => &mut self.other,
        }
    }

    /// Every key's bytes and the others', added up.
    pub fn total(&self) -> WireBytes {
        self.keys
            .values()
            .chain(std::iter::once(&self.other))
            .fold(WireBytes::default(), |a, b| WireBytes {
                sent: a.sent + b.sent,
                received: a.received + b.received,
            })
    }

    /// As JSON: `{"keys": [{"key", "sent", "received"}...] (by key), "other": {...},
    /// "total": {...}}`, what `--wire-stats-dir` writes.
    pub fn to_json(&self) -> String {
        let bytes =
            |b: &WireBytes| format!("{{\"sent\": {}, \"received\": {}}}", b.sent, b.received);
        let mut keys: Vec<_> = self.keys.iter().collect();
        keys.sort_by_key(|(k, _)| **k);
        let mut out = String::from("{\"keys\": [");
        for (i, (key, b)) in keys.iter().enumerate() {
            let sep = if i == 0 { "" } else { ", " };
            let _ = write!(
                out,
                "{sep}{{\"key\": {key}, \"sent\": {}, \"received\": {}}}",
                b.sent, b.received
            );
        }
        let _ = writeln!(
            out,
            "], \"other\": {}, \"total\": {}}}",
            bytes(&self.other),
            bytes(&self.total())
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_and_other_add_up_and_serialise() {
        let t = Traffic::default();
        t.received(Some(7), 100);
        t.sent(Some(7), 40);
        t.received(Some(3), 5);
        t.received(None, 9);
        t.sent(None, 0);
        let s = t.snapshot();
        assert_eq!(
            s.keys[&7],
            WireBytes {
                sent: 40,
                received: 100
            }
        );
        assert_eq!(
            s.total(),
            WireBytes {
                sent: 40,
                received: 114
            }
        );
        assert_eq!(
            s.to_json(),
            "{\"keys\": [{\"key\": 3, \"sent\": 0, \"received\": 5}, \
             {\"key\": 7, \"sent\": 40, \"received\": 100}], \
             \"other\": {\"sent\": 0, \"received\": 9}, \
             \"total\": {\"sent\": 40, \"received\": 114}}\n"
        );
    }
}
