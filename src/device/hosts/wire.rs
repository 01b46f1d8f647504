//! What the run's store says over TCP: one JSON object per message (a JSON object delimits
//! itself, so `serde_json`'s stream reader needs no length prefix), and the errors its users
//! see. Shared by the server (`server`) and the processes' handle on it (`store`).

use serde::{Deserialize, Serialize};
use std::io::{BufReader, Write};
use std::net::TcpStream;
use std::time::Duration;

/// What went wrong with the store.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// A blocking get (or a barrier) waited its whole timeout.
    #[error("DEADLINE_EXCEEDED: no value for key {key:?} within {}", secs(*timeout))]
    DeadlineExceeded { key: String, timeout: Duration },
    /// A process of the run is gone (killed, crashed, or unreachable).
    #[error("{0}")]
    Lost(String),
    /// The coordinator could not be reached or answered nonsense.
    #[error("{0}")]
    Unavailable(String),
}

/// `30 s`, `1.5 s`: a duration as a person reads it.
pub fn secs(d: Duration) -> String {
    format!("{} s", (d.as_secs_f64() * 1000.0).round() / 1000.0)
}

#[derive(Serialize, Deserialize, Debug)]
#[serde(tag = "op", rename_all = "snake_case")]
pub(crate) enum Request {
    Put {
        key: String,
        value: Vec<u8>,
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
    /// Opens a session: this connection lives as long as the process's part in the run.
    /// `silent_ms` (0: never): a session that sends nothing for that long is a hung process.
    Join {
        process: usize,
        host: String,
        #[serde(default)]
        silent_ms: u64,
    },
    /// A session's sign of life (answered, so that the process hears the store's too).
    Heartbeat,
    /// Closes a session on purpose (the process finished).
    Leave,
}

#[derive(Serialize, Deserialize, Debug)]
#[serde(tag = "reply", rename_all = "snake_case")]
pub(crate) enum Reply {
    Done,
    Value { value: Vec<u8> },
    NotFound,
    Timeout,
    Lost { message: String },
}

pub(crate) fn send<T: Serialize>(stream: &mut TcpStream, msg: &T) -> std::io::Result<()> {
    let mut bytes = serde_json::to_vec(msg)?;
    bytes.push(b'\n');
    stream.write_all(&bytes)?;
    stream.flush()
}

pub(crate) fn receive<T: for<'de> Deserialize<'de>>(
    reader: &mut BufReader<TcpStream>,
) -> std::io::Result<T> {
    let mut messages = serde_json::Deserializer::from_reader(reader).into_iter::<T>();
    match messages.next() {
        Some(Ok(m)) => Ok(m),
        Some(Err(e)) if e.is_io() => Err(e.into()),
        Some(Err(e)) => Err(std::io::Error::new(std::io::ErrorKind::InvalidData, e)),
        None => Err(std::io::ErrorKind::UnexpectedEof.into()),
    }
}

/// This machine's host name, for messages (`?` where it cannot be read).
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "?".into())
}
