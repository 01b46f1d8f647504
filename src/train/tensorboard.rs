//! TensorBoard's event files: `OUT/tensorboard/events.out.tfevents.{time}.{host}.{pid}.0`, scalars
//! by step (`train/loss`, `eval/accuracy`, ...), so `tensorboard --logdir OUT` draws a run's
//! curves. A file is TFRecord framing (u64 length, masked CRC-32C of the length, the bytes, masked
//! CRC-32C of the bytes) around `Event` protos (written with `prost`): first one with
//! `file_version = "brain.Event:2"`, then one per step with a `Summary` of `simple_value`s. Like
//! `metrics.jsonl` it is appended to (and flushed) as the run goes, not written atomically. A
//! file then says where the run starts (`SessionLog` START at its first step), so that after a
//! resume TensorBoard drops what the earlier files logged from there on.

use anyhow::{Context, Result};
use std::io::Write;
use std::path::{Path, PathBuf};

/// tensorflow/core/util/event.proto's `Event`, the fields scalars use.
#[derive(Clone, PartialEq, prost::Message)]
struct Event {
    #[prost(double, tag = "1")]
    wall_time: f64,
    #[prost(int64, tag = "2")]
    step: i64,
    #[prost(string, optional, tag = "3")]
    file_version: Option<String>,
    #[prost(message, optional, tag = "5")]
    summary: Option<Summary>,
    #[prost(message, optional, tag = "7")]
    session_log: Option<SessionLog>,
}

/// tensorflow/core/util/event.proto's `SessionLog`: a `START` at step N tells TensorBoard's
/// readers that the run restarted there, and they drop what earlier files logged at step N or
/// later (`EventAccumulator`'s orphaned-data purge).
#[derive(Clone, PartialEq, prost::Message)]
struct SessionLog {
    /// `SessionStatus`: 1 = START.
    #[prost(int32, tag = "1")]
    status: i32,
}

/// tensorflow/core/framework/summary.proto's `Summary`.
#[derive(Clone, PartialEq, prost::Message)]
struct Summary {
    #[prost(message, repeated, tag = "1")]
    value: Vec<SummaryValue>,
}

/// `Summary.Value` with a `simple_value` (a scalar).
#[derive(Clone, PartialEq, prost::Message)]
struct SummaryValue {
    #[prost(string, tag = "1")]
    tag: String,
    #[prost(float, optional, tag = "2")]
    simple_value: Option<f32>,
}

/// CRC-32C (Castagnoli), as TFRecord frames use it.
fn crc32c(data: &[u8]) -> u32 {
    const TABLE: [u32; 256] = {
        let mut t = [0u32; 256];
        let mut i = 0;
        while i < 256 {
            let mut c = i as u32;
            let mut k = 0;
            while k < 8 {
                c = if c & 1 != 0 {
                    (c >> 1) ^ 0x82F6_3B78
                } else {
                    c >> 1
                };
                k += 1;
            }
            t[i] = c;
            i += 1;
        }
        t
    };
    let mut crc = !0u32;
    for &b in data {
        crc = TABLE[((crc ^ b as u32) & 0xff) as usize] ^ (crc >> 8);
    }
    !crc
}

/// TFRecord's masked CRC.
fn masked_crc(data: &[u8]) -> u32 {
    let c = crc32c(data);
    (c.rotate_right(15)).wrapping_add(0xa282_ead8)
}

/// One TFRecord: length, its CRC, the bytes, their CRC.
fn record(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc(data).to_le_bytes());
    out
}

/// An open event file.
pub struct EventWriter {
    file: std::fs::File,
    pub path: PathBuf,
}

fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The time in a new event file's name: now, or one second past the newest file already in
/// `dir` where that is not earlier. TensorBoard reads a directory's files in name order, and a
/// resumed run's `SessionLog` START drops only what the files read before it logged: the new
/// file must sort last, also when it is made in the same second as the last one (the host and
/// pid that follow the time would then decide, and pids do not sort as strings).
fn file_time(dir: &Path, now: u64) -> u64 {
    let newest = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let time = name
                .strip_prefix("events.out.tfevents.")?
                .split('.')
                .next()?;
            time.parse::<u64>().ok()
        })
        .max();
    match newest {
        Some(t) if t >= now => t + 1,
        _ => now,
    }
}

impl EventWriter {
    /// A new event file in `dir` (created), starting with the file version event.
    pub fn create(dir: &Path) -> Result<EventWriter> {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        let wall = now();
        let path = dir.join(format!(
            "events.out.tfevents.{:010}.{}.{}.0",
            file_time(dir, wall as u64),
            crate::words::hostname().unwrap_or_else(|| "localhost".into()),
            std::process::id()
        ));
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .with_context(|| format!("cannot write {}", path.display()))?;
        let mut w = EventWriter { file, path };
        w.write(&Event {
            wall_time: wall,
            step: 0,
            file_version: Some("brain.Event:2".into()),
            summary: None,
            session_log: None,
        })?;
        Ok(w)
    }

    /// Say that the run (re)starts at `step`, the first step this file logs. TensorBoard's
    /// readers then drop every scalar earlier files logged at `step` or later, which a resumed
    /// run logs anew (or never reaches), so that its curves show each step once, as
    /// `metrics.jsonl` does. Every file starts with one: the reader the TensorBoard app uses
    /// (`plugin_event_accumulator`) takes a run's first START for its start, not a restart.
    pub fn session_start(&mut self, step: u64) -> Result<()> {
        self.write(&Event {
            wall_time: now(),
            step: step as i64,
            file_version: None,
            summary: None,
            session_log: Some(SessionLog { status: 1 }),
        })
    }

    fn write(&mut self, e: &Event) -> Result<()> {
        use prost::Message;
        self.file
            .write_all(&record(&e.encode_to_vec()))
            .and_then(|_| self.file.flush())
            .with_context(|| format!("cannot write {}", self.path.display()))
    }

    /// Scalars (tag, value) at `step`, as one event; non-finite values are left out.
    pub fn scalars(&mut self, step: u64, values: &[(&str, f64)]) -> Result<()> {
        let value: Vec<SummaryValue> = values
            .iter()
            .filter(|(_, v)| v.is_finite())
            .map(|(tag, v)| SummaryValue {
                tag: tag.to_string(),
                simple_value: Some(*v as f32),
            })
            .collect();
        if value.is_empty() {
            return Ok(());
        }
        self.write(&Event {
            wall_time: now(),
            step: step as i64,
            file_version: None,
            summary: Some(Summary { value }),
            session_log: None,
        })
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn crc32c_matches_the_standard_check_value() {
        // The CRC-32C of "123456789" (RFC 3720, and every CRC catalogue).
        assert_eq!(super::crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(super::crc32c(b""), 0);
    }

    /// A file made in the same second as the newest one (or with a clock behind it) is named one
    /// second later, so that it sorts after it whatever the pids.
    #[test]
    fn a_new_event_file_sorts_after_the_ones_already_there() {
        let dir = std::env::temp_dir().join(format!("xtrain-tb-order-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert_eq!(super::file_time(&dir, 1000), 1000, "an empty dir: now");
        std::fs::write(dir.join("events.out.tfevents.0000001000.host.99999.0"), b"").unwrap();
        std::fs::write(dir.join("unrelated.txt"), b"").unwrap();
        assert_eq!(super::file_time(&dir, 1000), 1001);
        assert_eq!(super::file_time(&dir, 999), 1001);
        assert_eq!(super::file_time(&dir, 1005), 1005);
        let w = super::EventWriter::create(&dir).unwrap();
        let mut names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.starts_with("events."))
            .collect();
        names.sort();
        assert_eq!(
            names.last().unwrap(),
            w.path.file_name().unwrap().to_str().unwrap()
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
