//! Reading and writing frames on a byte stream, and the authentication handshake.
//!
//! The reader never buffers ahead: a data frame's payload is read by the caller straight
//! into its own (page-aligned) buffer with [`FrameReader::read_payload`].

use std::io::{self as stdio, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use crate::auth::{random_bytes, Handshake, JobToken};
use crate::cluster::Role;
use crate::error::WireError;
use crate::frame::{Header, Lent, HEADER_LEN, LENT_LEN};
use crate::message::{self, ErrorReply, Message, Service, DATA_META_LEN};

/// Payloads up to this size are copied behind the header so a small frame is one write.
const COALESCE_LIMIT: usize = 64 << 10;

/// The largest frame body read before a connection is authenticated (a Hello, a
/// Challenge, a Welcome, a refusal): an unauthenticated peer must not make us allocate
/// the data plane's limit.
pub const HANDSHAKE_MAX_BODY: u32 = 4 << 10;

/// A stream whose reads can be given a timeout: what the handshake needs to hold a peer
/// to one deadline for the whole exchange, not a fresh timeout per read.
pub trait Timed {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> stdio::Result<()>;
}

impl Timed for TcpStream {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> stdio::Result<()> {
        TcpStream::set_read_timeout(self, timeout)
    }
}

impl<T: Timed + ?Sized> Timed for &T {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> stdio::Result<()> {
        (**self).set_read_timeout(timeout)
    }
}

/// Reads from `inner` until `until`, whatever pace the peer sends at: each read waits at
/// most what is left, and none starts after it.
struct ByDeadline<'a, S> {
    inner: &'a mut S,
    until: Instant,
}

impl<S: Read + Timed> Read for ByDeadline<'_, S> {
    fn read(&mut self, buf: &mut [u8]) -> stdio::Result<usize> {
        let left = self.until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(stdio::ErrorKind::TimedOut.into());
        }
        self.inner.set_read_timeout(Some(left))?;
        self.inner.read(buf)
    }
}

/// A frame whose body has been read up to its payload.
#[derive(Debug, PartialEq, Eq)]
pub struct Frame {
    pub message: Message,
    /// Payload bytes still to be read with `read_payload` or `skip_payload` (0 for a lent
    /// frame, whose payload is not on the stream).
    pub payload_len: usize,
    /// Where a lent frame's payload lies, in the connection's mailbox.
    pub lent: Option<Lent>,
}

/// A stream frame payloads are read from, whose reads of a payload may wait for more of
/// the buffer than a plain read does: the peer is sending all of it.
pub trait PayloadRead: Read {
    /// Reads into `buf` as `Read::read` does, or sleeps until all of it has arrived (or
    /// the stream's read timeout passed, or it ended) and returns what came.
    fn read_payload(&mut self, buf: &mut [u8]) -> stdio::Result<usize> {
        self.read(buf)
    }
}

impl<S: PayloadRead> PayloadRead for crate::accounting::Counted<S> {
    fn read_payload(&mut self, buf: &mut [u8]) -> stdio::Result<usize> {
        let n = self.get_mut().read_payload(buf)?;
        self.add(n as u64);
        Ok(n)
    }
}

#[derive(Debug)]
pub struct FrameReader<R> {
    inner: R,
    max_body: u32,
    pending_payload: usize,
}

impl<R: Read> FrameReader<R> {
    pub fn new(inner: R, max_body: u32) -> Self {
        FrameReader {
            inner,
            max_body,
            pending_payload: 0,
        }
    }

    pub fn get_ref(&self) -> &R {
        &self.inner
    }

    pub fn get_mut(&mut self) -> &mut R {
        &mut self.inner
    }

    /// Reads and validates the next frame up to its payload. A clean end of stream at a
    /// frame boundary is `WireError::Closed`.
    pub fn read(&mut self) -> Result<Frame, WireError> {
        assert_eq!(
            self.pending_payload, 0,
            "the previous frame's payload must be consumed first"
        );
        let mut head = [0u8; HEADER_LEN];
        self.inner.read_exact(&mut head)?;
        let header = Header::decode(&head, self.max_body)?;
        if header.lent {
            // The header checked the body's length: meta block and locator exactly.
            let mut body = [0u8; DATA_META_LEN + LENT_LEN];
            self.inner.read_exact(&mut body)?;
            let (meta, locator) = body.split_at(DATA_META_LEN);
            let lent = Lent::decode(header.op, locator.try_into().expect("locator length"))?;
            let message = Message::decode(header.op, meta, lent.len as usize)?;
            return Ok(Frame {
                message,
                payload_len: 0,
                lent: Some(lent),
            });
        }
        let body_len = header.body_len as usize;
        let meta_len = if header.op.has_payload() {
            if body_len < DATA_META_LEN {
                return Err(WireError::Truncated {
                    op: header.op,
                    field: "meta",
                    need: DATA_META_LEN - body_len,
                });
            }
            DATA_META_LEN
        } else {
            body_len
        };
        let mut meta = vec![0u8; meta_len];
        self.inner.read_exact(&mut meta)?;
        let mut payload_len = body_len - meta_len;
        // An InitKey's member list is decoded with its meta block (see `inline_len`).
        let inline = message::inline_len(header.op, &meta, payload_len)?;
        if inline > 0 {
            meta.resize(meta_len + inline, 0);
            self.inner.read_exact(&mut meta[meta_len..])?;
            payload_len -= inline;
        }
        let message = Message::decode(header.op, &meta, payload_len)?;
        self.pending_payload = payload_len;
        Ok(Frame {
            message,
            payload_len,
            lent: None,
        })
    }

    /// Payload bytes of the current frame not yet read or skipped.
    pub fn pending_payload(&self) -> usize {
        self.pending_payload
    }

    /// Reads the current frame's payload into `buf`, whose length must equal it.
    pub fn read_payload(&mut self, buf: &mut [u8]) -> Result<(), WireError> {
        self.fill_payload(buf, |r, b| r.read(b))
    }

    /// [`Self::read_payload`] through [`PayloadRead`], which may sleep until all of `buf`
    /// has arrived rather than wake for every part of it.
    pub fn read_payload_whole(&mut self, buf: &mut [u8]) -> Result<(), WireError>
    where
        R: PayloadRead,
    {
        self.fill_payload(buf, |r, b| r.read_payload(b))
    }

    fn fill_payload(
        &mut self,
        buf: &mut [u8],
        mut read: impl FnMut(&mut R, &mut [u8]) -> stdio::Result<usize>,
    ) -> Result<(), WireError> {
        assert_eq!(buf.len(), self.pending_payload, "payload length mismatch");
        let mut filled = 0;
        while filled < buf.len() {
            match read(&mut self.inner, &mut buf[filled..]) {
                Ok(0) => return Err(stdio::Error::from(stdio::ErrorKind::UnexpectedEof).into()),
                Ok(n) => filled += n,
                Err(e) if e.kind() == stdio::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.into()),
            }
        }
        self.pending_payload = 0;
        Ok(())
    }

    /// Discards the current frame's payload.
    pub fn skip_payload(&mut self) -> Result<(), WireError> {
        let n = std::mem::take(&mut self.pending_payload) as u64;
        let copied = std::io::copy(&mut (&mut self.inner).take(n), &mut std::io::sink())?;
        if copied != n {
            return Err(WireError::Closed);
        }
        Ok(())
    }

    /// Reads a whole frame, payload included (control path and tests).
    pub fn read_owned(&mut self) -> Result<(Message, Vec<u8>), WireError> {
        let frame = self.read()?;
        let mut payload = vec![0u8; frame.payload_len];
        self.read_payload(&mut payload)?;
        Ok((frame.message, payload))
    }
}

/// Writes a frame without payload.
pub fn write_message<W: Write>(w: &mut W, msg: &Message) -> Result<(), WireError> {
    write_data(w, msg, &[])
}

/// Writes a frame and its payload; large payloads are written from the caller's buffer
/// without copying, in the same system call as the header (so that, with Nagle's delay
/// off, the header does not leave as a packet of its own).
pub fn write_data<W: Write>(w: &mut W, msg: &Message, payload: &[u8]) -> Result<(), WireError> {
    write_data_then(w, msg, payload, &[])
}

/// [`write_data`], and the payload-less frames `then` behind it in the same system call:
/// one packet rather than two for a push and the pull after it.
pub fn write_data_then<W: Write>(
    w: &mut W,
    msg: &Message,
    payload: &[u8],
    then: &[&Message],
) -> Result<(), WireError> {
    let mut head = msg.encode(payload.len());
    let tail: Vec<u8> = then.iter().flat_map(|m| m.encode(0)).collect();
    if payload.len() <= COALESCE_LIMIT {
        head.extend_from_slice(payload);
        head.extend_from_slice(&tail);
        w.write_all(&head)?;
    } else {
        let mut slices = [
            stdio::IoSlice::new(&head),
            stdio::IoSlice::new(payload),
            stdio::IoSlice::new(&tail),
        ];
        write_all_vectored(w, &mut slices)?;
    }
    Ok(())
}

/// `write_all` for several buffers at once, through `write_vectored`.
fn write_all_vectored<W: Write>(
    w: &mut W,
    mut slices: &mut [stdio::IoSlice<'_>],
) -> stdio::Result<()> {
    while !slices.is_empty() {
        match w.write_vectored(slices) {
            Ok(0) => return Err(stdio::ErrorKind::WriteZero.into()),
            Ok(n) => stdio::IoSlice::advance_slices(&mut slices, n),
            Err(e) if e.kind() == stdio::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Writes a lent frame: its payload lies in the connection's mailbox, where `lent` says.
pub fn write_lent<W: Write>(w: &mut W, msg: &Message, lent: Lent) -> Result<(), WireError> {
    w.write_all(&msg.encode_lent(lent))?;
    Ok(())
}

/// The authenticated identity of the client on the other end of a connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Peer {
    pub role: Role,
    pub rank: Option<u32>,
    pub name: String,
}

/// Server side of the handshake: challenge, verify the client's proof, let `admit` accept
/// or refuse the authenticated identity, then prove ourselves. A bad proof or a refusal is
/// sent to the client as an `Error` frame before the error is returned, so the client's
/// `connect` fails with the reason. The client has `deadline` for the whole exchange, and
/// its Hello at most [`HANDSHAKE_MAX_BODY`] bytes. The stream's read timeout is left set;
/// the caller sets the one it wants next.
pub fn accept<S: Read + Write + Timed, T>(
    stream: &mut S,
    token: &JobToken,
    service: Service,
    deadline: Duration,
    admit: impl FnOnce(&Peer) -> Result<T, ErrorReply>,
) -> Result<(Peer, T), WireError> {
    let started = Instant::now();
    let server_nonce = random_bytes().map_err(|e| WireError::AuthFailed(e.to_string()))?;
    write_message(
        stream,
        &Message::Challenge {
            service,
            nonce: server_nonce,
        },
    )?;
    let mut timed = ByDeadline {
        inner: &mut *stream,
        until: started + deadline,
    };
    let (msg, _) = FrameReader::new(&mut timed, HANDSHAKE_MAX_BODY)
        .read_owned()
        .map_err(|e| match e {
            WireError::Timeout { .. } => WireError::Timeout {
                what: "the client's Hello (the handshake)".into(),
                secs: started.elapsed().as_secs_f64(),
            },
            other => other,
        })?;
    let Message::Hello {
        role,
        rank,
        nonce,
        proof,
        name,
    } = msg
    else {
        return Err(WireError::Unexpected {
            expected: "Hello",
            got: msg.op(),
        });
    };
    let hs = Handshake {
        server_nonce,
        client_nonce: nonce,
        role,
        rank,
    };
    if !token.verify_client(&hs, &proof) {
        let why = format!("{role} {name:?} does not hold this job's token");
        let _ = write_message(
            stream,
            &Message::error(crate::ErrorCode::AuthFailed, None, why.clone()),
        );
        return Err(WireError::AuthFailed(why));
    }
    let peer = Peer { role, rank, name };
    let admitted = match admit(&peer) {
        Ok(v) => v,
        Err(refusal) => {
            let _ = write_message(stream, &Message::Error(refusal.clone()));
            return Err(WireError::Rejected(refusal));
        }
    };
    write_message(
        stream,
        &Message::Welcome {
            service,
            proof: token.server_proof(&hs),
        },
    )?;
    Ok((peer, admitted))
}

/// Client side of the handshake. Fails if the peer is not the expected service, refuses
/// us, or cannot prove it holds the job token. Nothing it reads before the peer has proved
/// itself is larger than [`HANDSHAKE_MAX_BODY`].
pub fn connect<S: Read + Write>(
    stream: &mut S,
    token: &JobToken,
    expected: Service,
    me: &Peer,
) -> Result<(), WireError> {
    let mut reader = FrameReader::new(&mut *stream, HANDSHAKE_MAX_BODY);
    let (server_nonce, service) = match reader.read_owned()?.0 {
        Message::Challenge { service, nonce } => (nonce, service),
        Message::Error(e) => return Err(WireError::Rejected(e)),
        other => {
            return Err(WireError::Unexpected {
                expected: "Challenge",
                got: other.op(),
            })
        }
    };
    if service != expected {
        return Err(WireError::AuthFailed(format!(
            "expected a {} but this address is a {}",
            expected.name(),
            service.name()
        )));
    }
    let hs = Handshake {
        server_nonce,
        client_nonce: random_bytes().map_err(|e| WireError::AuthFailed(e.to_string()))?,
        role: me.role,
        rank: me.rank,
    };
    write_message(
        stream,
        &Message::Hello {
            role: me.role,
            rank: me.rank,
            nonce: hs.client_nonce,
            proof: token.client_proof(&hs),
            name: me.name.clone(),
        },
    )?;
    match FrameReader::new(&mut *stream, HANDSHAKE_MAX_BODY)
        .read_owned()?
        .0
    {
        Message::Welcome { proof, .. } if token.verify_server(&hs, &proof) => Ok(()),
        Message::Welcome { .. } => Err(WireError::AuthFailed(format!(
            "the {} could not prove it holds this job's token",
            expected.name()
        ))),
        Message::Error(e) => Err(WireError::Rejected(e)),
        other => Err(WireError::Unexpected {
            expected: "Welcome",
            got: other.op(),
        }),
    }
}
