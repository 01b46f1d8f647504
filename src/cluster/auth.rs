//! The run's secret: where a process gets it (`--run-token-file`, else `XTRAIN_RUN_TOKEN`), what
//! is taken as one, and the key the handshake (`handshake`) derives from it.
//!
//! Only a random secret is taken: at least 128 bits, as hex (32 hex digits or more, as
//! `xtrain run-token` or `openssl rand -hex 32` print) or as raw random bytes in a file (16 or
//! more, `head -c 32 /dev/urandom`). A passphrase, words, or a string of few distinct characters
//! is refused, saying how to make one: whoever records one connection's handshake can try
//! guesses against it offline, as fast as they can compute, so a secret that can be guessed is
//! guessed. The secret never goes over the wire, and never into a message: its `Debug` says only
//! whether there is one; the process drops it from its environment at its start
//! ([`take_from_environment`]), so that no program it starts inherits it.

use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::path::Path;
use std::sync::{Arc, OnceLock};

/// The fewest bits of a secret taken.
pub const MIN_BITS: usize = 128;

/// The longest `--run-token-file` read: a secret is tens of bytes.
pub const MAX_FILE: u64 = 4096;

/// How to make a secret, for every refusal.
pub const HOW: &str = "make one with `xtrain run-token` (32 random bytes as hex) and give every \
                       process the same one";

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

    /// A secret of these bytes ([`normalized`]), if they are random enough; `what` names where
    /// they came from, for the refusal (which never quotes them).
    pub fn from_bytes(bytes: &[u8], what: &str) -> anyhow::Result<Secret> {
        let taken = normalized(bytes);
        if let Err(why) = random_enough(&taken) {
            anyhow::bail!(
                "{what} is not a random secret: {why}. Only a random secret of at least \
                 {MIN_BITS} bits is taken, since whoever sees one connection can try guesses \
                 offline: {HOW}"
            );
        }
        Ok(Secret(Some(taken.into())))
    }

    /// The secret in a file (`--run-token-file`): a regular file (a link is followed and said),
    /// of at most [`MAX_FILE`] bytes, opened without waiting (a FIFO or a device is refused,
    /// never read).
    pub fn from_file(path: &Path) -> anyhow::Result<Secret> {
        let what = format!("--run-token-file {}", path.display());
        let bytes = read_token_file(path, &what)?;
        Secret::from_bytes(&bytes, &what)
    }

    /// A fresh random secret of 32 bytes (for `--virtual-hosts`, whose store only this process
    /// reaches).
    pub fn random() -> anyhow::Result<Secret> {
        Ok(Secret(Some(random_token()?.into_bytes().into())))
    }

    pub fn is_set(&self) -> bool {
        self.0.is_some()
    }

    /// The key the handshake's pattern takes (`psk`): HMAC-SHA256 of a label under the secret
    /// (under no key without one: the channel is still sealed, but anyone can open it).
    pub fn key(&self) -> [u8; 32] {
        let key = self.0.as_deref().unwrap_or(&[]);
        let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes keys of any length");
        mac.update(b"xtrain-store/noise-psk/4");
        mac.finalize().into_bytes().into()
    }
}

/// A secret's bytes as they are taken: hex (with whitespace around it or inside it, as `xxd -p`
/// breaks its lines) is its hex digits alone; anything else is taken byte for byte, but for
/// whitespace around printable text. Raw random bytes are never trimmed: a byte that looks like
/// whitespace is as random as any other (`head -c 16 /dev/urandom` keeps its 128 bits).
pub fn normalized(bytes: &[u8]) -> Vec<u8> {
    let trimmed = bytes.trim_ascii();
    let text = |b: &u8| (0x20..0x7f).contains(b) || b.is_ascii_whitespace();
    if trimmed
        .iter()
        .all(|b| b.is_ascii_hexdigit() || b.is_ascii_whitespace())
    {
        trimmed
            .iter()
            .copied()
            .filter(u8::is_ascii_hexdigit)
            .collect()
    } else if bytes.iter().all(text) {
        trimmed.to_vec()
    } else {
        bytes.to_vec()
    }
}

/// 32 random bytes as 64 hex digits: `xtrain run-token`'s secret.
pub fn random_token() -> anyhow::Result<String> {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).map_err(|e| anyhow::anyhow!("cannot draw a random secret: {e}"))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// Whether `s` is a random secret of at least [`MIN_BITS`] bits, and why not. Hex digits count
/// 4 bits each; raw bytes (a file of random bytes: an eighth of them or more outside printable
/// ASCII) 8 bits each. Printable text that is not hex is refused (a passphrase, words, base64:
/// nothing tells a random one from words). A secret is also refused where it shows what random
/// draws of its length show with a chance of at most [`CHANCE`] each: few distinct characters,
/// a repeated block, or (for hex) almost no digits or digits and letters in long runs of their
/// own, as words of a-f do (`deadbeefcafebabe...`). So a random secret (`xtrain run-token`'s,
/// `openssl rand -hex 16`) is in practice never refused, which a rule of thumb (a few standard
/// deviations) did for one random 32-digit secret in about 70,000.
pub fn random_enough(s: &[u8]) -> Result<(), String> {
    if s.is_empty() {
        return Err("it is empty".into());
    }
    if s.len() as u64 > MAX_FILE {
        return Err(format!(
            "it holds {} bytes (a run's secret is tens of bytes, at most {MAX_FILE})",
            s.len()
        ));
    }
    let printable = |b: &u8| (0x20..0x7f).contains(b);
    let outside = s.iter().filter(|b| !printable(b)).count();
    let (bits_each, alphabet) = if s.iter().all(u8::is_ascii_hexdigit) {
        (4, 16)
    } else if outside * 8 >= s.len() {
        (8, 256)
    } else {
        return Err(
            "it is text but not hex (words, a passphrase or base64 look alike, and words are \
             guessed)"
                .into(),
        );
    };
    let bits = bits_each * s.len();
    if bits < MIN_BITS {
        return Err(format!(
            "it holds {bits} bits ({} {})",
            s.len(),
            if bits_each == 4 {
                "hex digits"
            } else {
                "bytes"
            }
        ));
    }
    let folded: Vec<u8> = s.iter().map(u8::to_ascii_lowercase).collect();
    let n = folded.len();
    let mut distinct = folded.clone();
    distinct.sort_unstable();
    distinct.dedup();
    if chance::few_distinct(n, alphabet, distinct.len()) <= CHANCE {
        return Err(format!(
            "it uses only {} distinct characters (a short alphabet)",
            distinct.len()
        ));
    }
    // A random secret repeats a block with a chance of 16^-(n/2) at most (2^-64 for 32 digits).
    if let Some(p) = (1..=n / 2).find(|&p| folded[p..] == folded[..n - p]) {
        return Err(format!("it repeats a block of {p}"));
    }
    if bits_each == 4 {
        let digits = folded.iter().filter(|b| b.is_ascii_digit()).count();
        if chance::few_digits(n, digits) <= CHANCE {
            return Err(format!(
                "it has {digits} decimal digits in {n}, nearly all letters a-f, as hex words are"
            ));
        }
        let changes = folded
            .windows(2)
            .filter(|w| w[0].is_ascii_digit() != w[1].is_ascii_digit())
            .count();
        if chance::few_changes(n, changes) <= CHANCE {
            return Err("its digits and letters come in long runs, as words do".into());
        }
    }
    Ok(())
}

/// The most chance a rule of [`random_enough`] has to refuse a random secret: 2^-40 (one in a
/// million million).
pub const CHANCE: f64 = 1.0 / (1u64 << 40) as f64;

/// The chances, exactly (by counting), that `n` uniform random symbols show as little as a
/// secret does.
mod chance {
    /// Of `alphabet` symbols, at most `d` distinct ones.
    pub fn few_distinct(n: usize, alphabet: usize, d: usize) -> f64 {
        // p[k]: the chance of exactly k distinct after the draws so far.
        let mut p = vec![0.0f64; alphabet + 1];
        p[0] = 1.0;
        let a = alphabet as f64;
        for _ in 0..n {
            for k in (0..=alphabet).rev() {
                let new = if k > 0 {
                    p[k - 1] * (alphabet - k + 1) as f64 / a
                } else {
                    0.0
                };
                p[k] = p[k] * k as f64 / a + new;
            }
        }
        p[..=d.min(alphabet)].iter().sum()
    }

    /// Of hex digits, at most `d` decimal ones (each one with a chance of 10/16).
    pub fn few_digits(n: usize, d: usize) -> f64 {
        // p[k]: the chance of exactly k decimal digits so far.
        let mut p = vec![0.0f64; n + 1];
        p[0] = 1.0;
        for i in 0..n {
            for k in (0..=i + 1).rev() {
                let came = if k > 0 { p[k - 1] * 10.0 / 16.0 } else { 0.0 };
                p[k] = p[k] * 6.0 / 16.0 + came;
            }
        }
        p[..=d.min(n)].iter().sum()
    }

    /// Of hex digits, at most `c` changes between a decimal digit and a letter among
    /// neighbours.
    pub fn few_changes(n: usize, c: usize) -> f64 {
        let (digit, letter) = (10.0 / 16.0, 6.0 / 16.0);
        // [class][k]: the chance that the last symbol is of this class (0 digit, 1 letter)
        // after exactly k changes so far.
        let mut p = [vec![0.0f64; n], vec![0.0f64; n]];
        p[0][0] = digit;
        p[1][0] = letter;
        for i in 1..n {
            for k in (0..=i).rev() {
                let (d, l) = (p[0][k], p[1][k]);
                let (from_l, from_d) = if k > 0 {
                    (p[1][k - 1], p[0][k - 1])
                } else {
                    (0.0, 0.0)
                };
                p[0][k] = (d + from_l) * digit;
                p[1][k] = (l + from_d) * letter;
            }
        }
        (0..=c.min(n - 1)).map(|k| p[0][k] + p[1][k]).sum()
    }
}

/// A token file's bytes, read as [`Secret::from_file`] says.
fn read_token_file(path: &Path, what: &str) -> anyhow::Result<Vec<u8>> {
    use std::io::Read;
    let words = |e: &std::io::Error| crate::cluster::wire::io_words(e);
    let link = std::fs::symlink_metadata(path)
        .map_err(|e| anyhow::anyhow!("{what}: cannot read it ({})", words(&e)))?;
    if link.file_type().is_symlink() {
        let target = std::fs::canonicalize(path)
            .map_err(|e| anyhow::anyhow!("{what}: a link that leads nowhere ({})", words(&e)))?;
        crate::esay!(
            "xtrain: note: {what} is a link; reading {}",
            target.display()
        );
    }
    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    // Opened without waiting: a FIFO nobody writes would block the open itself.
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.custom_flags(libc::O_NONBLOCK);
    }
    let file = options
        .open(path)
        .map_err(|e| anyhow::anyhow!("{what}: cannot read it ({})", words(&e)))?;
    let meta = file
        .metadata()
        .map_err(|e| anyhow::anyhow!("{what}: cannot read it ({})", words(&e)))?;
    if !meta.is_file() {
        anyhow::bail!(
            "{what} is not a regular file ({}): give a file that holds the secret",
            kind_of(&meta)
        );
    }
    if meta.len() > MAX_FILE {
        anyhow::bail!(
            "{what} holds {} bytes: a run's secret is tens of bytes (at most {MAX_FILE} read); {HOW}",
            meta.len()
        );
    }
    // As ssh does for a private key: a secret others on the host can read is no secret.
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        if meta.permissions().mode() & 0o077 != 0 {
            crate::esay!(
                "xtrain: warning: {what} can be read by other users of this host (mode {:o}); \
                 `chmod 600` it",
                meta.permissions().mode() & 0o777
            );
        }
    }
    let mut bytes = Vec::new();
    file.take(MAX_FILE + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| anyhow::anyhow!("{what}: cannot read it ({})", words(&e)))?;
    if bytes.len() as u64 > MAX_FILE {
        anyhow::bail!("{what} grew past {MAX_FILE} bytes while it was read");
    }
    Ok(bytes)
}

fn kind_of(meta: &std::fs::Metadata) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        let t = meta.file_type();
        if t.is_fifo() {
            return "a FIFO";
        }
        if t.is_char_device() || t.is_block_device() {
            return "a device";
        }
        if t.is_socket() {
            return "a socket";
        }
    }
    if meta.is_dir() {
        "a directory"
    } else {
        "not a file"
    }
}

/// The `XTRAIN_RUN_TOKEN` this process was started with, taken out of its environment.
static FROM_ENVIRONMENT: OnceLock<Option<String>> = OnceLock::new();

/// Take `XTRAIN_RUN_TOKEN` out of this process's environment and keep it for
/// [`from_launch`], so that no program this process starts (a plugin's Python, pip) inherits
/// the secret. Call it first thing in `main`, before any thread starts.
pub fn take_from_environment() {
    FROM_ENVIRONMENT.get_or_init(|| {
        let token = std::env::var("XTRAIN_RUN_TOKEN").ok();
        // The value's bytes are overwritten where the process was given them, so that its
        // environment as the system shows it (/proc/PID/environ, `ps e`) no longer holds them.
        #[cfg(unix)]
        // SAFETY: called first thing in `main`, with no other thread reading the environment;
        // getenv's pointer is to the value's NUL-terminated bytes, overwritten within them.
        unsafe {
            let value = libc::getenv(c"XTRAIN_RUN_TOKEN".as_ptr());
            if !value.is_null() {
                std::ptr::write_bytes(value, b'-', libc::strlen(value));
            }
        }
        std::env::remove_var("XTRAIN_RUN_TOKEN");
        token
    });
}

/// `XTRAIN_RUN_TOKEN` as this process was started with it (taken out of its environment by
/// [`take_from_environment`]), else as its environment has it now.
pub fn token_variable() -> Option<String> {
    match FROM_ENVIRONMENT.get() {
        Some(taken) => taken.clone(),
        None => std::env::var("XTRAIN_RUN_TOKEN").ok(),
    }
}

/// The run's secret as this process was given it: `--run-token-file FILE`, else the
/// `XTRAIN_RUN_TOKEN` variable (`env` looks a variable up), else none. Both given and holding
/// different secrets is refused (which one the others hold is not known).
pub fn from_launch(
    file: Option<&Path>,
    env: &dyn Fn(&str) -> Option<String>,
) -> anyhow::Result<Secret> {
    let variable = env("XTRAIN_RUN_TOKEN").filter(|v| !v.trim().is_empty());
    if let Some(path) = file {
        let secret = Secret::from_file(path)?;
        if let Some(v) = variable {
            if Secret(Some(normalized(v.as_bytes()).into())) != secret {
                anyhow::bail!(
                    "--run-token-file {} and XTRAIN_RUN_TOKEN hold different secrets: give one \
                     (every process of the run must hold the same)",
                    path.display()
                );
            }
        }
        return Ok(secret);
    }
    match variable {
        Some(v) => Secret::from_bytes(v.as_bytes(), "XTRAIN_RUN_TOKEN"),
        None => Ok(Secret::none()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn random_secrets_are_taken_and_guessable_ones_refused() {
        let token = random_token().unwrap();
        assert_eq!(token.len(), 64);
        random_enough(token.as_bytes()).unwrap();
        random_enough(token.to_uppercase().as_bytes()).unwrap();
        // 128 bits as 32 hex digits (`openssl rand -hex 16`), and 16 raw random bytes.
        let mut raw = [0u8; 16];
        for _ in 0..200 {
            getrandom::fill(&mut raw).unwrap();
            random_enough(hex(&raw).as_bytes()).unwrap();
        }
        random_enough(&[
            0x8d, 0x02, 0xf1, 0x7e, 0x33, 0xa0, 0x5c, 0xee, 0x91, 0x10, 0x4b, 0xd7, 0x6a, 0x29,
            0xb8, 0x00,
        ])
        .unwrap();
        for (bad, why) in [
            ("capitals-training", "text but not hex"),
            (
                "correct horse battery staple and more words",
                "text but not hex",
            ),
            ("a-secret-for-the-tests", "text but not hex"),
            (
                "dGhpcyBpcyBub3QgcmFuZG9tIGF0IGFsbCBub3Qgb25l",
                "text but not hex",
            ),
            ("0123456789abcdef", "64 bits"),
            (&"0".repeat(64), "distinct"),
            (&"01".repeat(32), "distinct"),
            (&"3f7a9c2e5b1d4086".repeat(4), "repeats a block of 16"),
            ("deadbeefcafebabefeedfacedecafbad", "nearly all letters a-f"),
            (
                "deadbeefcafebabefeedfacedecafbad31415926535897932384626433832795",
                "long runs",
            ),
            (&"0".repeat(5000), "5000 bytes"),
            ("", "empty"),
        ] {
            let e = random_enough(bad.as_bytes()).unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }

    /// Random 32-digit secrets (`openssl rand -hex 16`, drawn from the system's generator) that
    /// the rule of thumb refused (its runs of digits and letters, or its distinct digits, a few
    /// standard deviations out) are taken: every rule now refuses what random draws show with a
    /// chance of 2^-40 at most, counted exactly, and the counts agree with a direct reckoning.
    #[test]
    fn random_secrets_the_rule_of_thumb_refused_are_taken() {
        for drawn in [
            "468bf417500893955908880010746885",
            "27a61880064427749307960562052401",
            "5543137049639c504101583302122704",
            "913837806830041530711848cfec7343",
        ] {
            random_enough(drawn.as_bytes()).unwrap();
        }
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * b;
        // No change in 32: all 32 digits or all 32 letters.
        let none = (10.0f64 / 16.0).powi(32) + (6.0f64 / 16.0).powi(32);
        assert!(close(chance::few_changes(32, 0), none));
        assert!(close(chance::few_changes(32, 31), 1.0));
        assert!(close(chance::few_digits(32, 0), (6.0f64 / 16.0).powi(32)));
        assert!(close(chance::few_digits(32, 32), 1.0));
        // One distinct symbol of 16 in 32 draws: 16 * 16^-32.
        assert!(close(
            chance::few_distinct(32, 16, 1),
            16.0 * 16f64.powi(-32)
        ));
        assert!(close(chance::few_distinct(32, 16, 16), 1.0));
        // What the rules refuse of a 32-digit random secret, at the edges: 5 distinct digits
        // of 16, no decimal digit, and no run rule at all (a change or none).
        assert!(chance::few_distinct(32, 16, 5) <= CHANCE);
        assert!(chance::few_distinct(32, 16, 6) > CHANCE);
        assert!(chance::few_digits(32, 1) > CHANCE);
        assert!(chance::few_changes(32, 0) > CHANCE);
        for _ in 0..20_000 {
            random_enough(&random_token().unwrap().as_bytes()[..32]).unwrap();
        }
    }

    #[test]
    fn a_secret_is_never_shown_and_a_weak_one_is_refused_unquoted() {
        let token = random_token().unwrap();
        let s = Secret::from_bytes(format!("  {token}\n").as_bytes(), "XTRAIN_RUN_TOKEN").unwrap();
        assert_eq!(format!("{s:?}"), "Secret(set)");
        assert_eq!(s, Secret::from_bytes(token.as_bytes(), "t").unwrap());
        assert_ne!(s.key(), Secret::none().key());
        let e = Secret::from_bytes(b"hunter2-hunter2-hunter2", "XTRAIN_RUN_TOKEN")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("XTRAIN_RUN_TOKEN is not a random secret")
                && e.contains("xtrain run-token")
                && !e.contains("hunter2"),
            "{e}"
        );
        let env = |k: &str| (k == "XTRAIN_RUN_TOKEN").then(|| token.clone());
        assert!(from_launch(None, &env).unwrap().is_set());
        assert!(!from_launch(None, &|_| None).unwrap().is_set());
        assert_ne!(Secret::random().unwrap(), Secret::random().unwrap());
    }

    #[test]
    fn a_token_file_is_a_small_regular_file_and_beats_no_other_secret_silently() {
        let dir = std::env::temp_dir().join(format!("xtrain-auth-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let token = random_token().unwrap();
        let file = dir.join("token");
        std::fs::write(&file, format!("{token}\n")).unwrap();
        let none = |_: &str| None;
        assert!(from_launch(Some(&file), &none).unwrap().is_set());
        let same = |_: &str| Some(token.clone());
        assert!(from_launch(Some(&file), &same).unwrap().is_set());
        let other = random_token().unwrap();
        let differs = |_: &str| Some(other.clone());
        let e = from_launch(Some(&file), &differs).unwrap_err().to_string();
        assert!(e.contains("hold different secrets"), "{e}");
        // A link is followed and said; a directory, a device and a FIFO are refused unread.
        let link = dir.join("link");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&file, &link).unwrap();
        assert!(from_launch(Some(&link), &none).unwrap().is_set());
        for (path, kind) in [
            (dir.clone(), "a directory"),
            ("/dev/zero".into(), "a device"),
        ] {
            let e = from_launch(Some(&path), &none).unwrap_err().to_string();
            assert!(
                e.contains(&format!("is not a regular file ({kind})")),
                "{e}"
            );
        }
        let fifo = dir.join("fifo");
        let _ = std::fs::remove_file(&fifo);
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let t0 = std::time::Instant::now();
        let e = from_launch(Some(&fifo), &none).unwrap_err().to_string();
        assert!(e.contains("(a FIFO)"), "{e}");
        assert!(t0.elapsed() < std::time::Duration::from_secs(2));
        let big = dir.join("big");
        std::fs::write(&big, vec![b'a'; 5000]).unwrap();
        let e = from_launch(Some(&big), &none).unwrap_err().to_string();
        assert!(e.contains("holds 5000 bytes"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
