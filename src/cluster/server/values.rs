//! The store's values under its rules: who may write a key ([`keys`](crate::cluster::keys)),
//! once; what each process may hold ([`Limits::share`](super::Limits::share)) and the store in
//! all, counting keys' bytes and puts under way; blocking gets; barriers.

use super::shared::{Barrier, Entry, Shared, State, ENTRY};
use crate::cluster::keys::{may_delete, owner, Owner};
use crate::cluster::locks::wait;
use crate::cluster::wire::{Reply, MAX_KEY};
use sha2::{Digest, Sha256};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What a key of `len` value bytes costs against the caps.
fn cost(key: &str, len: u64) -> u64 {
    key.len() as u64 + len + ENTRY
}

fn tombstone(key: &str) -> [u8; 16] {
    Sha256::digest(key.as_bytes())[..16].try_into().unwrap()
}

/// Whether `process` may write `key` now (with a value of `len` bytes), not counting the caps.
fn may_write(st: &State, process: usize, key: &str, len: u64) -> Result<(), String> {
    if key.len() > MAX_KEY {
        return Err(format!("a key of {} bytes (at most {MAX_KEY})", key.len()));
    }
    let held = st.values.get(key);
    match owner(key)? {
        Owner::Process(k) if k != process => {
            return Err(format!(
                "process {process} may not write {key:?}, process {k}'s key"
            ))
        }
        Owner::FirstWriter => match held {
            Some(e) if e.owner != process => {
                return Err(format!(
                    "process {process} may not write {key:?}: process {} wrote it first",
                    e.owner
                ))
            }
            _ => return Ok(()),
        },
        Owner::Process(_) => {}
    }
    if st.deleted.contains(&tombstone(key)) {
        return Err(format!("{key:?} is written once, and was (then read)"));
    }
    // The same value again (a retried put) changes nothing; another is refused before its
    // bytes are read where its length already differs.
    if held.is_some_and(|e| e.value.len() as u64 != len) {
        return Err(format!("{key:?} is written once, and was"));
    }
    Ok(())
}

/// Reserve room for `process`'s put of `len` bytes to `key`, before any of its bytes are read;
/// an error says why it is refused.
pub(super) fn reserve(shared: &Shared, process: usize, key: &str, len: u64) -> Result<(), String> {
    let limits = &shared.config.limits;
    let mut st = shared.state();
    may_write(&st, process, key, len)?;
    let c = cost(key, len);
    let held = st.held.get(&process).copied().unwrap_or(0);
    if held.saturating_add(c) > limits.share {
        drop(st);
        shared.say_once(
            "share",
            &format!(
                "refused a put of process {process}: its keys would hold more than its share of \
                 the store ({} bytes)",
                limits.share
            ),
        );
        return Err(format!(
            "a value of {len} bytes would take process {process}'s keys over its share of the \
             store ({} bytes, {held} held)",
            limits.share
        ));
    }
    if st.total.saturating_add(c) > limits.total {
        drop(st);
        shared.say_once(
            "total",
            &format!(
                "refused a put: the store would hold more than {} bytes",
                limits.total
            ),
        );
        return Err(format!(
            "a value of {len} bytes would take the store over its {} bytes",
            limits.total
        ));
    }
    st.count(process, c as i64);
    Ok(())
}

/// The put reserved by [`reserve`], its bytes read (`Err`: they were not, and the room is
/// given back).
pub(super) fn commit(
    shared: &Shared,
    process: usize,
    key: String,
    len: u64,
    value: std::io::Result<Vec<u8>>,
) -> Result<(), String> {
    let mut st = shared.state();
    let c = cost(&key, len) as i64;
    let value = match value {
        Ok(v) => v,
        Err(e) => {
            st.count(process, -c);
            return Err(match e.kind() {
                std::io::ErrorKind::InvalidData => e.to_string(),
                _ => "the value was cut short".into(),
            });
        }
    };
    // Checked again: another connection of the same process may have written it meanwhile.
    if let Err(why) = may_write(&st, process, &key, len) {
        st.count(process, -c);
        return Err(why);
    }
    let first_writer = matches!(owner(&key), Ok(Owner::FirstWriter));
    if let Some(same) = st.values.get(&key).map(|was| *was.value == value) {
        if !first_writer {
            st.count(process, -c);
            return match same {
                true => Ok(()),
                false => Err(format!("{key:?} is written once, and was")),
            };
        }
    }
    let old = st.values.insert(
        key,
        Entry {
            value: Arc::new(value),
            owner: process,
        },
    );
    if let Some(old) = old {
        st.count(process, -(old.value.len() as i64 + c - len as i64));
    }
    shared.changed.notify_all();
    Ok(())
}

/// Process `process` deletes `key` (once read); it stays written. A key never written is left
/// as it is (no tombstone: deletes of keys that never were hold nothing).
pub(super) fn delete(shared: &Shared, process: usize, key: &str) -> Result<(), String> {
    may_delete(key, process)?;
    let mut st = shared.state();
    if let Some(e) = st.values.remove(key) {
        let owner = e.owner;
        st.count(owner, -(cost(key, e.value.len() as u64) as i64));
        st.deleted.insert(tombstone(key));
    }
    Ok(())
}

/// `key`'s value once some process put it, or the reply that says why not (a timeout, a loss,
/// the store stopping).
pub(super) fn wait_for(shared: &Shared, key: &str, timeout_ms: u64) -> Result<Arc<Vec<u8>>, Reply> {
    let deadline = Instant::now() + Duration::from_millis(timeout_ms.min(86_400_000));
    let mut st = shared.state();
    loop {
        if let Some(e) = st.values.get(key) {
            return Ok(e.value.clone());
        }
        if let Some(reply) = ended(shared, &st) {
            return Err(reply);
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(Reply::Timeout);
        }
        st = wait(&shared.changed, st, deadline - now);
    }
}

/// Why nothing more will come: a process was lost, or the store stops.
fn ended(shared: &Shared, st: &State) -> Option<Reply> {
    if let Some(why) = &st.lost {
        return Some(Reply::Lost {
            message: why.clone(),
        });
    }
    shared.stopped.load(Ordering::SeqCst).then(|| Reply::Lost {
        message: "process 0's store stopped".into(),
    })
}

/// `process` reached the barrier `name`: answered once every process has (each arrival costs
/// O(1), the last wakes only this barrier's waiters), or after `timeout_ms` with who has not.
pub(super) fn barrier(shared: &Shared, process: usize, name: &str, timeout_ms: u64) -> Reply {
    let n = shared.config.processes;
    if !name.starts_with("xtrain/") || name.len() > MAX_KEY {
        return Reply::Refused {
            message: format!("{name:?} is not a barrier of a run"),
        };
    }
    let deadline = Instant::now() + Duration::from_millis(timeout_ms.min(86_400_000));
    let mut st = shared.state();
    if st.passed.contains(name) {
        return Reply::Done;
    }
    if !st.barriers.contains_key(name) {
        // A barrier's room is counted as a key's is, to the process that opens it: a process
        // cannot make the store hold barriers without bound.
        let c = name.len() as u64 + n as u64 + ENTRY;
        let limits = &shared.config.limits;
        let held = st.held.get(&process).copied().unwrap_or(0);
        if held.saturating_add(c) > limits.share || st.total.saturating_add(c) > limits.total {
            return Reply::Refused {
                message: format!(
                    "a barrier would take process {process}'s keys over its share of the store \
                     ({} bytes)",
                    limits.share
                ),
            };
        }
        st.count(process, c as i64);
    }
    let b = st
        .barriers
        .entry(name.to_string())
        .or_insert_with(|| Barrier {
            arrived: vec![false; n],
            count: 0,
            done: Arc::default(),
        });
    if !std::mem::replace(&mut b.arrived[process], true) {
        b.count += 1;
    }
    if b.count == n {
        b.done.notify_all();
        st.barriers.remove(name);
        st.passed.insert(name.to_string());
        return Reply::Done;
    }
    let done = b.done.clone();
    loop {
        if st.passed.contains(name) {
            return Reply::Done;
        }
        if let Some(reply) = ended(shared, &st) {
            return reply;
        }
        let now = Instant::now();
        if now >= deadline {
            let missing: Vec<usize> = st.barriers[name]
                .arrived
                .iter()
                .enumerate()
                .filter(|(_, a)| !**a)
                .map(|(p, _)| p)
                .collect();
            return Reply::Missing {
                count: missing.len(),
                ids: crate::words::ranges(&missing),
            };
        }
        st = wait(&done, st, deadline - now);
    }
}
