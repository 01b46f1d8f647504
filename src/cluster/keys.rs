//! Whose each key of the run's store is. xtrain's own keys end in the process that writes them
//! (`settings/K`, `barrier/NAME/K`, `gather/ROUND/POSITION/K`), which alone may write them,
//! once: no process can stand in for another, or change what another said. The plugin's keys
//! (`pjrt/PLATFORM/...`) follow the plugin's own protocol, written by whichever process it
//! says. Every key is under `xtrain/RUN/`.

/// Who may put `key`: `Some(k)`: process `k` alone, once; `None`: any process of the run
/// (a plugin's key). An error says why the key is no key of the store's.
pub fn owner(key: &str) -> Result<Option<usize>, String> {
    let rest = key
        .strip_prefix("xtrain/")
        .and_then(|r| r.split_once('/'))
        .map(|(_, rest)| rest)
        .filter(|r| !r.is_empty())
        .ok_or_else(|| format!("{key:?} is not a key of a run (xtrain/RUN/...)"))?;
    if rest.starts_with("pjrt/") {
        return Ok(None);
    }
    match rest.rsplit_once('/').map(|(_, last)| last.parse::<usize>()) {
        Some(Ok(k)) => Ok(Some(k)),
        _ => Err(format!(
            "{key:?} does not end in the process that writes it"
        )),
    }
}

/// Whether `process` may delete `key`: process 0, which reads the shards the others put and
/// forgets each once read, or the key's owner.
pub fn may_delete(key: &str, process: usize) -> Result<(), String> {
    match owner(key)? {
        Some(k) if k == process || process == 0 => Ok(()),
        None => Ok(()),
        Some(k) => Err(format!(
            "process {process} may not delete {key:?}, process {k}'s key"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_belong_to_the_process_they_end_in() {
        assert_eq!(owner("xtrain/run/settings/1"), Ok(Some(1)));
        assert_eq!(owner("xtrain/slurm-7/barrier/checkpoint-4/0"), Ok(Some(0)));
        assert_eq!(owner("xtrain/run/gather/3/5/1"), Ok(Some(1)));
        assert_eq!(owner("xtrain/run/pjrt/cuda/nccl_id"), Ok(None));
        assert!(owner("xtrain/run/settings/x").is_err());
        assert!(owner("other/run/settings/1").is_err());
        assert!(owner("xtrain/run/").is_err());
        may_delete("xtrain/run/gather/0/3/1", 0).unwrap();
        may_delete("xtrain/run/gather/0/3/1", 1).unwrap();
        assert!(may_delete("xtrain/run/gather/0/3/1", 2).is_err());
    }
}
