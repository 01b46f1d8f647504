//! What the run's store says over TCP, and the errors its users see. Shared by the server
//! (`server`) and the processes' handle on it (`store`).
//!
//! A connection opens with a greeting both ways: [`MAGIC`] and the protocol's version
//! ([`PROTOCOL`], u32 little-endian); the server answers with its own, so that a process of
//! another xtrain build is refused at once, naming both versions, rather than misread. The
//! handshake that proves both sides hold the run's secret and makes the connection's keys
//! follows (`handshake`); from then on every byte goes sealed (`channel`). Each message is one
//! frame: the header's length (u32), the header (a JSON object: the operation and its small
//! fields, such as the key), the value's length (u64) and the value's raw bytes (empty for
//! every message but a put and a get's answer); lengths little-endian. A value goes as it is:
//! the LoRA state a checkpoint gathers through the store is gigabytes at 70B.

use serde::{Deserialize, Serialize};
use std::io::{Read, Write};
use std::time::Duration;

/// The store protocol's version: 5 binds each process id to the process that joined as it (a
/// ticket, `handshake`); 4 sealed every frame after a Noise handshake keyed by the run's secret
/// (3 authenticated the connection only). Raise it with any change to what goes over the wire.
pub const PROTOCOL: u32 = 5;

/// The first bytes of every connection to the store, both ways.
pub const MAGIC: &[u8; 8] = b"xtrainKV";

/// A header longer than this is not the store's (keys are short: [`MAX_KEY`]).
const MAX_HEADER: usize = 16 << 10;

/// The longest key the store takes.
pub const MAX_KEY: usize = 1024;

/// What went wrong with the store.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// A blocking get or a barrier waited its whole timeout; `waited` says for what (`no value
    /// for key ...`, `at barrier ...: process 3 of 4 did not arrive`).
    #[error("DEADLINE_EXCEEDED: {waited} within {}", crate::words::secs(*timeout))]
    DeadlineExceeded { waited: String, timeout: Duration },
    /// A process of the run is gone (killed, crashed, or unreachable).
    #[error("{0}")]
    Lost(String),
    /// The coordinator could not be reached or answered nonsense.
    #[error("{0}")]
    Unavailable(String),
    /// The store refused what this process asked (a key it does not own, a value over the cap,
    /// a second join of its id); the run goes on.
    #[error("{0}")]
    Refused(String),
}

/// A request's header; its value (a put's) travels after it in the same frame.
#[derive(Serialize, Deserialize, Debug)]
#[serde(tag = "op", rename_all = "snake_case")]
pub(crate) enum Request {
    /// Set `key` to the frame's value.
    Put {
        key: String,
    },
    Get {
        key: String,
        timeout_ms: u64,
    },
    TryGet {
        key: String,
    },
    /// Forget a key (a value read by everyone it was for, such as a gathered shard).
    Delete {
        key: String,
    },
    /// This process reached the barrier `name`; answered once every process of the run has
    /// (or with who has not, after `timeout_ms`).
    Barrier {
        name: String,
        timeout_ms: u64,
    },
    /// Opens the connection's process's session: this connection lives as long as the
    /// process's part in the run. `silent_ms` (0: never): a session that sends nothing for that
    /// long is a hung process.
    Join {
        host: String,
        silent_ms: u64,
    },
    /// A session's sign of life (answered, so that the process hears the store's too).
    Heartbeat,
    /// Closes a session on purpose (the process finished).
    Leave,
}

/// A reply's header; a found value travels after it in the same frame.
#[derive(Serialize, Deserialize, Debug)]
#[serde(tag = "reply", rename_all = "snake_case")]
pub(crate) enum Reply {
    Done,
    /// A join's answer: the session is open, and the frame's value is its ticket (32 bytes),
    /// which every other connection of the process then carries (`handshake`).
    Joined,
    /// The key's value is the frame's value.
    Value,
    NotFound,
    Timeout,
    /// A barrier's timeout passed: `count` processes did not arrive, `ids` as ranges.
    Missing {
        count: usize,
        ids: String,
    },
    Lost {
        message: String,
    },
    /// The request was refused (the run goes on); the connection closes after it.
    Refused {
        message: String,
    },
}

/// Send one frame: `msg`'s header, then `value` as it is.
pub(crate) fn send<T: Serialize>(w: &mut impl Write, msg: &T, value: &[u8]) -> std::io::Result<()> {
    send_parts(w, msg, &[value])
}

/// [`send`] with a value in parts, sent one after another as one value (a shard's small header
/// and its bytes, never copied into one buffer).
pub(crate) fn send_parts<T: Serialize>(
    w: &mut impl Write,
    msg: &T,
    parts: &[&[u8]],
) -> std::io::Result<()> {
    let header = serde_json::to_vec(msg)?;
    let len: usize = parts.iter().map(|p| p.len()).sum();
    let mut head = Vec::with_capacity(12 + header.len());
    head.extend((header.len() as u32).to_le_bytes());
    head.extend(&header);
    head.extend((len as u64).to_le_bytes());
    w.write_all(&head)?;
    // Buffered into records by the channel: a large part is not copied.
    for part in parts {
        w.write_all(part)?;
    }
    w.flush()
}

/// Read one frame: its header and its value, at most `max_value` bytes of it (a longer one is
/// refused before any of it is read). The value is read as its bytes arrive: nothing is
/// allocated for a length a peer only declared.
pub(crate) fn receive<T: for<'de> Deserialize<'de>>(
    r: &mut impl Read,
    max_value: u64,
) -> std::io::Result<(T, Vec<u8>)> {
    let (msg, len) = receive_header(r, max_value)?;
    Ok((msg, receive_value(r, len)?))
}

/// A frame's header and its value's length (at most `max_value`); the value's bytes follow.
pub(crate) fn receive_header<T: for<'de> Deserialize<'de>>(
    r: &mut impl Read,
    max_value: u64,
) -> std::io::Result<(T, u64)> {
    let mut word = [0u8; 4];
    r.read_exact(&mut word)?;
    let n = u32::from_le_bytes(word) as usize;
    if n > MAX_HEADER {
        return Err(invalid(format!(
            "a store message's header of {n} bytes (at most {MAX_HEADER}): not the store's protocol"
        )));
    }
    let mut header = vec![0u8; n];
    r.read_exact(&mut header)?;
    let msg = serde_json::from_slice(&header).map_err(|e| {
        invalid(format!(
            "a store message's header is not the protocol's ({e})"
        ))
    })?;
    let mut long = [0u8; 8];
    r.read_exact(&mut long)?;
    let len = u64::from_le_bytes(long);
    if len > max_value {
        return Err(std::io::Error::new(
            std::io::ErrorKind::OutOfMemory,
            format!("a value of {len} bytes, over the store's cap of {max_value} bytes for one"),
        ));
    }
    Ok((msg, len))
}

/// A value of `len` bytes, read as they arrive: room is made 64 MiB at a time, as they come.
pub(crate) fn receive_value(r: &mut impl Read, len: u64) -> std::io::Result<Vec<u8>> {
    const STEP: u64 = 64 << 20;
    let mut value = Vec::new();
    let mut left = len;
    while left > 0 {
        let step = left.min(STEP);
        value.reserve_exact(step as usize);
        let got = (&mut *r).take(step).read_to_end(&mut value)? as u64;
        if got < step {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!("a value cut short at {} of {len} bytes", value.len()),
            ));
        }
        left -= step;
    }
    Ok(value)
}

fn invalid(m: String) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, m)
}

/// An I/O error in words a user reads (not the OS's text for a closed connection).
pub fn io_words(e: &std::io::Error) -> String {
    use std::io::ErrorKind::*;
    match e.kind() {
        UnexpectedEof => "the connection closed".into(),
        ConnectionReset | ConnectionAborted | BrokenPipe => "the connection was cut".into(),
        ConnectionRefused => "nothing listens there".into(),
        WouldBlock | TimedOut => "no answer in time".into(),
        NotFound => "no such file".into(),
        PermissionDenied => "permission denied".into(),
        AddrInUse => "the address is in use".into(),
        AddrNotAvailable => "the address is not one of this host's".into(),
        InvalidData | OutOfMemory | Other => e.to_string(),
        _ => e.to_string(),
    }
}

/// This build's greeting: [`MAGIC`] and [`PROTOCOL`].
pub(crate) fn greeting() -> [u8; 12] {
    let mut g = [0u8; 12];
    g[..8].copy_from_slice(MAGIC);
    g[8..].copy_from_slice(&PROTOCOL.to_le_bytes());
    g
}

/// What a peer's greeting says.
#[derive(Debug, PartialEq, Eq)]
pub enum Greeting {
    /// The same protocol as this build's.
    Same,
    /// An xtrain of another protocol version.
    Version(u32),
    /// Not xtrain's store at all.
    Stranger,
}

pub(crate) fn read_greeting(r: &mut impl Read) -> std::io::Result<Greeting> {
    let mut g = [0u8; 12];
    r.read_exact(&mut g)?;
    Ok(if g[..8] != MAGIC[..] {
        Greeting::Stranger
    } else {
        match u32::from_le_bytes(g[8..].try_into().unwrap()) {
            PROTOCOL => Greeting::Same,
            v => Greeting::Version(v),
        }
    })
}

/// Why a peer of another protocol cannot take part (`other`: its version, as far as known).
pub(crate) fn other_protocol(who: &str, other: &str) -> String {
    format!(
        "{who} speaks store protocol {other}, this xtrain protocol {PROTOCOL}: every host of a run \
         must run the same xtrain build"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A put of `n` bytes as it goes on the wire.
    fn put_frame(value: &[u8]) -> Vec<u8> {
        let mut wire = Vec::new();
        let put = Request::Put {
            key: "xtrain/run/gather/gather/0/3".into(),
        };
        send(&mut wire, &put, value).unwrap();
        wire
    }

    /// A value goes as its own bytes and a header of tens of bytes; protocol 1 sent the same
    /// value as a JSON array of numbers, about 3.5 times its size on varied bytes.
    #[test]
    fn a_large_value_costs_its_bytes_and_a_small_constant() {
        for mb in [1usize, 16] {
            let n = mb << 20;
            // Varied bytes, as f32 moments are (xorshift).
            let mut x = 0x9E37_79B9_7F4A_7C15u64;
            let value: Vec<u8> = (0..n)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect();
            let wire = put_frame(&value).len();
            let before = serde_json::to_vec(&serde_json::json!({
                "op": "put", "key": "xtrain/run/gather/gather/0/3", "value": value
            }))
            .unwrap()
            .len();
            crate::esay!(
                "a put of {mb} MiB: {wire} bytes on the wire (protocol 1: {before}, {:.2}x)",
                before as f64 / n as f64
            );
            assert!(wire <= n + n / 100 + 128, "{wire} bytes for {n}");
            assert!(wire - n < 128, "{} bytes of framing", wire - n);
            assert!(before > 3 * n, "protocol 1 was {before} bytes for {n}");
        }
    }

    #[test]
    fn frames_read_back_with_their_values_and_one_after_another() {
        let mut wire = put_frame(&[0, 1, 255]);
        send(&mut wire, &Reply::Done, &[]).unwrap();
        let big = vec![7u8; 100 << 10];
        send(&mut wire, &Reply::Value, &big).unwrap();
        let mut r = &wire[..];
        let (put, value) = receive::<Request>(&mut r, u64::MAX).unwrap();
        assert!(matches!(put, Request::Put { key } if key.ends_with("0/3")));
        assert_eq!(value, [0, 1, 255]);
        assert!(matches!(receive::<Reply>(&mut r, 0).unwrap(), (Reply::Done, v) if v.is_empty()));
        assert!(
            matches!(receive::<Reply>(&mut r, 1 << 20).unwrap(), (Reply::Value, v) if v == big)
        );
        assert!(r.is_empty());
        // A frame cut short is an unexpected end, not a shorter value.
        let cut = &wire[..wire.len() - 10];
        let mut r = cut;
        receive::<Request>(&mut r, 16).unwrap();
        receive::<Reply>(&mut r, 16).unwrap();
        let e = receive::<Reply>(&mut r, 1 << 20).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof);
    }

    /// A frame declaring a value over the cap is refused before any of it is read, and one
    /// under the cap is read as its bytes come: a declared length allocates nothing.
    #[test]
    fn a_declared_length_is_capped_and_never_allocated() {
        let mut wire = Vec::new();
        send(&mut wire, &Reply::Value, &[]).unwrap();
        let at = wire.len() - 8;
        wire[at..].copy_from_slice(&(4u64 << 30).to_le_bytes());
        let e = receive::<Reply>(&mut &wire[..], 1 << 30).unwrap_err();
        assert!(
            e.to_string()
                .contains("a value of 4294967296 bytes, over the store's cap"),
            "{e}"
        );
        // Under the cap but with 3 bytes behind it: cut short, with 3 bytes held.
        wire.extend([1, 2, 3]);
        let e = receive::<Reply>(&mut &wire[..], u64::MAX).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof);
        assert!(
            e.to_string().contains("cut short at 3 of 4294967296"),
            "{e}"
        );
    }

    #[test]
    fn greetings_tell_this_protocol_from_another_and_from_strangers() {
        assert_eq!(read_greeting(&mut &greeting()[..]).unwrap(), Greeting::Same);
        let mut other = greeting();
        other[8..].copy_from_slice(&7u32.to_le_bytes());
        assert_eq!(
            read_greeting(&mut &other[..]).unwrap(),
            Greeting::Version(7)
        );
        let json = br#"{"op":"join","process":1}"#;
        assert_eq!(read_greeting(&mut &json[..]).unwrap(), Greeting::Stranger);
        assert_eq!(
            read_greeting(&mut &b"GET / HTTP/1.1\r\n"[..]).unwrap(),
            Greeting::Stranger
        );
    }
}
