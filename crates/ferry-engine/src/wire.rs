//! The engine's own messages: requests and replies of the one-sided protocol, sent as active
//! messages on tags above the users' range ([`crate::AM_USER_TAGS`]).
//!
//! | message | from → to | carries |
//! |---|---|---|
//! | `GetRequest` | origin → target | slot, generation, offset, length, the payload's tag, whether it moves in chunks |
//! | `GetRefused` | target → origin | the payload's tag, the reason (then a 0-byte payload) |
//! | `PutRequest` | origin → target | as a get request, then the notification (tag, bytes) |
//! | `PutDone` | target → origin | the payload's tag, and the reason when refused or failed |
//! | `IpcGrant` | target → origin | the payload's tag, the target memory exported for a peer copy |
//! | `IpcRelease` | origin → target | the payload's tag, and the reason when the copy failed |
//! | `LeaseDone` | origin → target | after a leased copy (`lease.rs`): bit 0 put (1) or get (0), bit 1 a single copy of host memory (`cma.rs`) or a peer copy, the bytes copied, the tag of the `PutDone` the origin waits for (all ones: none), a put's notification |
//!
//! Encoded little-endian, fields in the order above; the reason and the notification's bytes
//! run to the end of the message.

use crate::error::{EngineError, Result};

/// Tag of a get request.
pub(crate) const GET_REQUEST: i32 = crate::AM_USER_TAGS as i32;
/// Tag of a refused get.
pub(crate) const GET_REFUSED: i32 = GET_REQUEST + 1;
/// Tag of a put request.
pub(crate) const PUT_REQUEST: i32 = GET_REQUEST + 2;
/// Tag of a put's end.
pub(crate) const PUT_DONE: i32 = GET_REQUEST + 3;
/// Tag of a target's grant of a peer copy: the payload's tag and the exported memory.
pub(crate) const IPC_GRANT: i32 = GET_REQUEST + 4;
/// Tag of the origin's end of a peer copy: the payload's tag, and the reason when it failed.
pub(crate) const IPC_RELEASE: i32 = GET_REQUEST + 5;

/// Tag of the origin's word that a leased peer copy has completed.
pub(crate) const LEASE_DONE: i32 = GET_REQUEST + 6;

/// `LeaseDone`'s answer tag when the origin waits for no answer.
pub(crate) const NO_ANSWER: u32 = u32::MAX;

/// A `LeaseDone`: whether the copy was a put, whether it was a single copy of host memory,
/// its bytes, the payload tag under which the origin waits for a `PutDone` ([`NO_ANSWER`]:
/// none), and a put's notification.
pub(crate) fn encode_lease_done(
    put: bool,
    single: bool,
    len: u64,
    answer: u32,
    notify: Option<(u16, &[u8])>,
) -> Vec<u8> {
    let mut v = Vec::with_capacity(16 + notify.map_or(0, |(_, b)| b.len()));
    v.push(u8::from(put) | (u8::from(single) << 1));
    v.extend_from_slice(&len.to_le_bytes());
    v.extend_from_slice(&answer.to_le_bytes());
    encode_notify(&mut v, notify);
    v
}

/// A notification: its tag and bytes.
pub(crate) type Notification = (u16, Vec<u8>);

/// A decoded `LeaseDone`.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct LeaseDone {
    pub put: bool,
    pub single: bool,
    pub len: u64,
    pub answer: u32,
    pub notify: Option<Notification>,
}

/// Decodes a `LeaseDone`.
pub(crate) fn decode_lease_done(b: &[u8]) -> Result<LeaseDone> {
    if b.len() < 14 || b[0] > 3 {
        return Err(protocol(format!("malformed lease report of {} bytes", b.len())));
    }
    Ok(LeaseDone {
        put: b[0] & 1 == 1,
        single: b[0] & 2 == 2,
        len: u64::from_le_bytes(b[1..9].try_into().expect("8 bytes")),
        answer: u32::from_le_bytes(b[9..13].try_into().expect("4 bytes")),
        notify: decode_notify(&b[13..])?,
    })
}

/// Where a one-sided operation reads or writes on the target, and the tag of its payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Request {
    pub id: u32,
    pub generation: u32,
    pub offset: u64,
    pub len: u64,
    pub data_tag: u32,
    /// The payload moves in chunks (the staged route; [`crate::staged`]).
    pub chunked: bool,
    /// No payload: the origin copies from or into the target's memory, mapped through IPC
    /// (`ipc.rs`).
    pub ipc: bool,
}

const REQUEST_BYTES: usize = 32;

impl Request {
    pub(crate) fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.id.to_le_bytes());
        out.extend_from_slice(&self.generation.to_le_bytes());
        out.extend_from_slice(&self.offset.to_le_bytes());
        out.extend_from_slice(&self.len.to_le_bytes());
        out.extend_from_slice(&self.data_tag.to_le_bytes());
        out.extend_from_slice(&(u32::from(self.chunked) | u32::from(self.ipc) << 1).to_le_bytes());
    }

    pub(crate) fn decode(b: &[u8]) -> Result<(Request, &[u8])> {
        if b.len() < REQUEST_BYTES {
            return Err(protocol(format!("request of {} bytes", b.len())));
        }
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        Ok((
            Request {
                id: u32_at(0),
                generation: u32_at(4),
                offset: u64_at(8),
                len: u64_at(16),
                data_tag: u32_at(24),
                chunked: u32_at(28) & 1 == 1,
                ipc: u32_at(28) & 2 == 2,
            },
            &b[REQUEST_BYTES..],
        ))
    }
}

/// A put request's notification: `(has one, tag, bytes)` after the request.
pub(crate) fn encode_notify(out: &mut Vec<u8>, notify: Option<(u16, &[u8])>) {
    match notify {
        Some((tag, bytes)) => {
            out.push(1);
            out.extend_from_slice(&tag.to_le_bytes());
            out.extend_from_slice(bytes);
        }
        None => out.push(0),
    }
}

pub(crate) fn decode_notify(b: &[u8]) -> Result<Option<(u16, Vec<u8>)>> {
    match b.first() {
        Some(0) => Ok(None),
        Some(1) if b.len() >= 3 => Ok(Some((u16::from_le_bytes([b[1], b[2]]), b[3..].to_vec()))),
        _ => Err(protocol("malformed notification".into())),
    }
}

/// Bytes of a refusal's reason at most (a longer one is cut).
const REASON_MAX: usize = 1024;

/// A reply: the payload's tag, then `ok` (1) or 0 and the reason as UTF-8 (at most
/// [`REASON_MAX`] bytes).
pub(crate) fn encode_reply(data_tag: u32, outcome: std::result::Result<(), String>) -> Vec<u8> {
    let mut v = data_tag.to_le_bytes().to_vec();
    match outcome {
        Ok(()) => v.push(1),
        Err(reason) => {
            v.push(0);
            // Cut to fit an active message whatever the reason says (at a character boundary).
            let mut end = reason.len().min(REASON_MAX);
            while !reason.is_char_boundary(end) {
                end -= 1;
            }
            v.extend_from_slice(&reason.as_bytes()[..end]);
        }
    }
    v
}

pub(crate) fn decode_reply(b: &[u8]) -> Result<(u32, std::result::Result<(), String>)> {
    if b.len() < 5 {
        return Err(protocol(format!("reply of {} bytes", b.len())));
    }
    let tag = u32::from_le_bytes(b[0..4].try_into().expect("4 bytes"));
    Ok(match b[4] {
        1 => (tag, Ok(())),
        _ => (tag, Err(String::from_utf8_lossy(&b[5..]).into_owned())),
    })
}

fn protocol(msg: String) -> EngineError {
    EngineError::Comm(ferry_base::error::FerryError::InvalidArgument(format!(
        "engine protocol message: {msg}"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips() {
        let r = Request {
            id: 5,
            generation: 9,
            offset: 1 << 40,
            len: 77,
            data_tag: 123_456,
            chunked: true,
            ipc: true,
        };
        let mut v = Vec::new();
        r.encode(&mut v);
        encode_notify(&mut v, Some((42, b"hello")));
        let (back, rest) = Request::decode(&v).unwrap();
        assert_eq!(back, r);
        assert_eq!(decode_notify(rest).unwrap(), Some((42, b"hello".to_vec())));
        assert_eq!(decode_reply(&encode_reply(7, Ok(()))).unwrap(), (7, Ok(())));
        assert_eq!(
            decode_reply(&encode_reply(8, Err("gone".into()))).unwrap(),
            (8, Err("gone".to_string()))
        );
        assert!(Request::decode(&v[..10]).is_err());
        assert!(decode_notify(&[1, 2]).is_err());
        let done = encode_lease_done(true, false, 1 << 40, 77, Some((9, b"note")));
        assert_eq!(
            decode_lease_done(&done).unwrap(),
            LeaseDone {
                put: true,
                single: false,
                len: 1 << 40,
                answer: 77,
                notify: Some((9, b"note".to_vec()))
            }
        );
        let get = decode_lease_done(&encode_lease_done(false, true, 3, NO_ANSWER, None)).unwrap();
        assert_eq!(
            (get.put, get.single, get.len, get.answer, get.notify),
            (false, true, 3, NO_ANSWER, None)
        );
        assert!(decode_lease_done(&done[..13]).is_err());
        assert!(decode_lease_done(&[4; 16]).is_err());
    }
}
