//! Who may talk to the run's store: the run's secret, and the handshake that proves holding it
//! both ways without sending it.
//!
//! Every connection opens with a mutual challenge-response over fresh nonces: the process sends
//! a nonce of its own; the store answers with its nonce and an HMAC-SHA256 (keyed by the secret)
//! over both nonces and the process's id; the process checks it (the store holds the secret: a
//! fake coordinator learns nothing and is refused) and answers with its own HMAC over the same,
//! in the other order and under another label (a proof seen on one connection is worth nothing
//! on another, or in the other direction). Proofs are compared in constant time (`hmac`'s
//! `verify_slice`). The secret itself never goes over the wire, and never into a message: its
//! `Debug` says only whether there is one.
//!
//! Without a secret the same handshake runs keyed by nothing, which anyone can compute: that is
//! a run on loopback, or one the user declared a trusted network (`--trusted-network`).

use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::path::Path;
use std::sync::Arc;

/// Bytes of a nonce and of a proof.
pub const NONCE: usize = 32;
pub const PROOF: usize = 32;

/// The shortest secret taken: shorter ones are guessable.
pub const MIN_SECRET: usize = 16;

/// The run's secret (none: anyone who reaches the store may join).
#[derive(Clone, Default)]
pub struct Secret(Option<Arc<[u8]>>);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.is_set() {
            "Secret(set)"
        } else {
            "Secret(none)"
        })
    }
}

/// Two secrets are equal when both are absent or both hold the same bytes (compared in
/// constant time).
impl PartialEq for Secret {
    fn eq(&self, other: &Secret) -> bool {
        match (&self.0, &other.0) {
            (None, None) => true,
            (Some(a), Some(b)) => {
                a.len() == b.len() && a.iter().zip(b.iter()).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
            }
            _ => false,
        }
    }
}

impl Eq for Secret {}

impl Secret {
    pub fn none() -> Secret {
        Secret(None)
    }

    /// A secret of these bytes; `what` names where they came from, for the refusal of a short
    /// one (which never quotes them).
    pub fn from_bytes(bytes: &[u8], what: &str) -> anyhow::Result<Secret> {
        let trimmed = bytes.trim_ascii();
        if trimmed.len() < MIN_SECRET {
            anyhow::bail!(
                "{what} holds {} bytes: a run's secret needs at least {MIN_SECRET} (make one with \
                 `openssl rand -hex 32`)",
                trimmed.len()
            );
        }
        Ok(Secret(Some(trimmed.into())))
    }

    /// The secret in a file (`--run-token-file`), surrounding whitespace dropped.
    pub fn from_file(path: &Path) -> anyhow::Result<Secret> {
        let what = format!("--run-token-file {}", path.display());
        let bytes = std::fs::read(path).map_err(|e| {
            anyhow::anyhow!(
                "{what}: cannot read it ({})",
                crate::cluster::wire::io_words(&e)
            )
        })?;
        // As ssh does for a private key: a secret others on the host can read is no secret.
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            if let Ok(m) = std::fs::metadata(path) {
                if m.permissions().mode() & 0o077 != 0 {
                    crate::esay!(
                        "xtrain: warning: {what} can be read by other users of this host (mode \
                         {:o}); `chmod 600` it",
                        m.permissions().mode() & 0o777
                    );
                }
            }
        }
        Secret::from_bytes(&bytes, &what)
    }

    /// A fresh random secret (for `--virtual-hosts`, whose store only this process reaches).
    pub fn random() -> anyhow::Result<Secret> {
        let mut bytes = [0u8; 32];
        getrandom::fill(&mut bytes)
            .map_err(|e| anyhow::anyhow!("cannot draw a random secret: {e}"))?;
        Ok(Secret(Some(bytes.to_vec().into())))
    }

    pub fn is_set(&self) -> bool {
        self.0.is_some()
    }

    fn mac(&self, label: &[u8], first: &[u8], second: &[u8], process: u32) -> Hmac<Sha256> {
        let key = self.0.as_deref().unwrap_or(&[]);
        let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes keys of any length");
        mac.update(label);
        mac.update(first);
        mac.update(second);
        mac.update(&process.to_le_bytes());
        mac
    }

    /// The store's proof on the connection of `process` with these nonces.
    pub fn store_proof(&self, client: &[u8], server: &[u8], process: u32) -> [u8; PROOF] {
        self.mac(b"xtrain-store/store", client, server, process)
            .finalize()
            .into_bytes()
            .into()
    }

    /// A process's proof on its connection with these nonces.
    pub fn process_proof(&self, client: &[u8], server: &[u8], process: u32) -> [u8; PROOF] {
        self.mac(b"xtrain-store/process", server, client, process)
            .finalize()
            .into_bytes()
            .into()
    }

    /// Whether `proof` is the store's proof for these nonces (constant time).
    pub fn store_proved(&self, proof: &[u8], client: &[u8], server: &[u8], process: u32) -> bool {
        self.mac(b"xtrain-store/store", client, server, process)
            .verify_slice(proof)
            .is_ok()
    }

    /// Whether `proof` is the process's proof for these nonces (constant time).
    pub fn process_proved(&self, proof: &[u8], client: &[u8], server: &[u8], process: u32) -> bool {
        self.mac(b"xtrain-store/process", server, client, process)
            .verify_slice(proof)
            .is_ok()
    }
}

/// A fresh nonce.
pub fn nonce() -> std::io::Result<[u8; NONCE]> {
    let mut n = [0u8; NONCE];
    getrandom::fill(&mut n).map_err(|e| std::io::Error::other(e.to_string()))?;
    Ok(n)
}

/// The run's secret as this process was given it: `--run-token-file FILE`, else the
/// `XTRAIN_RUN_TOKEN` variable (`env` looks a variable up), else none.
pub fn from_launch(
    file: Option<&Path>,
    env: &dyn Fn(&str) -> Option<String>,
) -> anyhow::Result<Secret> {
    if let Some(path) = file {
        return Secret::from_file(path);
    }
    match env("XTRAIN_RUN_TOKEN") {
        Some(v) => Secret::from_bytes(v.as_bytes(), "XTRAIN_RUN_TOKEN"),
        None => Ok(Secret::none()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_hold_only_for_their_secret_nonces_process_and_direction() {
        let s = Secret::from_bytes(b"0123456789abcdef0123", "t").unwrap();
        let other = Secret::from_bytes(b"0123456789abcdef0124", "t").unwrap();
        let (c, v) = ([1u8; NONCE], [2u8; NONCE]);
        let store = s.store_proof(&c, &v, 1);
        assert!(s.store_proved(&store, &c, &v, 1));
        assert!(!other.store_proved(&store, &c, &v, 1));
        assert!(!s.store_proved(&store, &c, &[3u8; NONCE], 1));
        assert!(!s.store_proved(&store, &c, &v, 2));
        // The store's proof is not the process's (nor the other way round).
        assert!(!s.process_proved(&store, &c, &v, 1));
        let process = s.process_proof(&c, &v, 1);
        assert!(s.process_proved(&process, &c, &v, 1));
        assert!(!Secret::none().process_proved(&process, &c, &v, 1));
        assert_ne!(nonce().unwrap(), nonce().unwrap());
    }

    #[test]
    fn a_secret_is_never_shown_and_a_short_one_is_refused_unquoted() {
        let s = Secret::from_bytes(b"  super-secret-token-1234\n", "XTRAIN_RUN_TOKEN").unwrap();
        assert_eq!(format!("{s:?}"), "Secret(set)");
        assert_eq!(
            s,
            Secret::from_bytes(b"super-secret-token-1234", "t").unwrap()
        );
        let e = Secret::from_bytes(b"hunter2", "XTRAIN_RUN_TOKEN")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("XTRAIN_RUN_TOKEN holds 7 bytes") && !e.contains("hunter2"),
            "{e}"
        );
        let env = |k: &str| (k == "XTRAIN_RUN_TOKEN").then(|| "z".repeat(40));
        assert!(from_launch(None, &env).unwrap().is_set());
        assert!(!from_launch(None, &|_| None).unwrap().is_set());
        assert_ne!(Secret::random().unwrap(), Secret::random().unwrap());
    }
}
