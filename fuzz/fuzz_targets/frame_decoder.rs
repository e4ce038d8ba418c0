//! Arbitrary bytes through both frame decoders: no panic, and both agree (on where a lent
//! frame's payload lies too).
#![no_main]

use std::io::Cursor;

use libfuzzer_sys::fuzz_target;
use sumflow_wire::io::FrameReader;
use sumflow_wire::message::decode_frame;

const MAX_BODY: u32 = 1 << 16;

fuzz_target!(|data: &[u8]| {
    let whole = decode_frame(data, MAX_BODY);
    let mut reader = FrameReader::new(Cursor::new(data), MAX_BODY);
    let streamed = reader.read().and_then(|frame| {
        let mut payload = vec![0; frame.payload_len];
        reader.read_payload(&mut payload)?;
        Ok((frame.message, payload, frame.lent))
    });
    match (whole, streamed) {
        (Ok(Some(frame)), Ok((message, payload, lent))) => {
            assert_eq!(frame.message, message);
            assert_eq!(frame.payload, &payload[..]);
            assert_eq!(frame.lent, lent);
            // Decoding is a fixed point of encoding, lent frames included.
            let again = match lent {
                Some(lent) => message.encode_lent(lent),
                None => message.encode_with_payload(&payload),
            };
            let twice = decode_frame(&again, MAX_BODY).unwrap().unwrap();
            assert_eq!((&twice.message, twice.lent), (&message, lent));
            assert_eq!(twice.consumed, again.len());
        }
        (Ok(Some(frame)), Err(e)) => panic!("streaming reader refused {:?}: {e}", frame.message),
        (Ok(None), Ok(_)) => panic!("streaming reader decoded an incomplete frame"),
        (Err(_), Ok((m, _, _))) => panic!("streaming reader accepted {m:?}"),
        _ => {}
    }
});
