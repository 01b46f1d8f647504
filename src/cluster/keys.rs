//! Whose each key of the run's store is. xtrain's own keys end in the process that writes them
//! (`settings/K`, `gather/ROUND/POSITION/K`), which alone may write them, once: no process can
//! stand in for another, or change what another said. The plugin's keys (`pjrt/PLATFORM/...`)
//! follow the plugin's own protocol, written by whichever process it says: each belongs to the
//! process that first wrote it. Only process 0 deletes (the shards it gathered, once read), and
//! a deleted key stays written: no one writes it again. Every key is under `xtrain/RUN/`.

/// Who may put a key.
#[derive(Debug, PartialEq, Eq, Clone, Copy)]
pub enum Owner {
    /// Process `k` alone, once.
    Process(usize),
    /// Whichever process writes it first (a plugin's key), and then that process alone.
    FirstWriter,
}

/// Who may put `key`; an error says why the key is no key of the store's.
pub fn owner(key: &str) -> Result<Owner, String> {
    let rest = key
        .strip_prefix("xtrain/")
        .and_then(|r| r.split_once('/'))
        .map(|(_, rest)| rest)
        .filter(|r| !r.is_empty())
        .ok_or_else(|| format!("{key:?} is not a key of a run (xtrain/RUN/...)"))?;
    if rest.starts_with("pjrt/") {
        return Ok(Owner::FirstWriter);
    }
    match rest.rsplit_once('/').map(|(_, last)| last.parse::<usize>()) {
        Some(Ok(k)) => Ok(Owner::Process(k)),
        _ => Err(format!(
            "{key:?} does not end in the process that writes it"
        )),
    }
}

/// Whether `process` may delete `key`: process 0 alone, which reads the shards the others put
/// and forgets each once read; a plugin's keys are never deleted.
pub fn may_delete(key: &str, process: usize) -> Result<(), String> {
    match owner(key)? {
        Owner::Process(_) if process == 0 => Ok(()),
        Owner::Process(_) => Err(format!(
            "process {process} may not delete {key:?}: only process 0 deletes (the shards it \
             gathered)"
        )),
        Owner::FirstWriter => Err(format!("{key:?} is a plugin's key: never deleted")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_belong_to_the_process_they_end_in() {
        assert_eq!(owner("xtrain/run/settings/1"), Ok(Owner::Process(1)));
        assert_eq!(owner("xtrain/run/gather/3/5/1"), Ok(Owner::Process(1)));
        assert_eq!(
            owner("xtrain/run/pjrt/cuda/nccl_id"),
            Ok(Owner::FirstWriter)
        );
        assert!(owner("xtrain/run/settings/x").is_err());
        assert!(owner("other/run/settings/1").is_err());
        assert!(owner("xtrain/run/").is_err());
        may_delete("xtrain/run/gather/0/3/1", 0).unwrap();
        assert!(may_delete("xtrain/run/gather/0/3/1", 1).is_err());
        assert!(may_delete("xtrain/run/gather/0/3/2", 2).is_err());
        assert!(may_delete("xtrain/run/pjrt/cuda/id", 0).is_err());
    }
}
