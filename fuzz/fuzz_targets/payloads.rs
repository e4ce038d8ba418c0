//! Compressed payloads from a peer through the server's validator, then its decoder:
//! whatever a payload holds, validation refuses it or the decoder reads exactly the key's
//! elements, without panicking.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sumflow_compress::{Compressor, Scratch, Seed};
use sumflow_wire::{Codec, KeyCodec};

fuzz_target!(|data: &[u8]| {
    let [codec, p0, p1, e0, e1, payload @ ..] = data else {
        return;
    };
    let Some(codec) = Codec::from_code(*codec % 8) else {
        return;
    };
    let key = KeyCodec {
        codec,
        param: u32::from(u16::from_le_bytes([*p0, *p1])),
        feedback: false,
    };
    let elements = usize::from(u16::from_le_bytes([*e0, *e1])) % 4096 + 1;
    let Ok(c) = Compressor::new(key, elements) else {
        return;
    };
    if c.validate(payload).is_err() {
        return;
    }
    let mut scratch = Scratch::default();
    let mut out = vec![0f32; elements];
    c.decompress(payload, Seed::new(7, 1, 0), &mut scratch, &mut out);
    let mut acc = vec![0f32; elements];
    c.decompress_add(payload, Seed::new(7, 1, 0), &mut scratch, &mut acc);
});
