//! The sealed channel every connection to the run's store carries once its handshake is done
//! (`handshake`): each side's bytes go in records, each sealed with AES-256-GCM under that
//! direction's key from the Noise handshake and a counter as its nonce. A record that was
//! changed, cut, replayed, reordered or written by anyone without the keys does not open, and
//! its connection ends there, saying so. A record is a u16 length (little-endian) and at most
//! 65,535 bytes of sealed text (16 of them the tag), as the Noise protocol bounds a message.
//!
//! [`Sealer`] is a [`Write`]: bytes are gathered into a record and sealed when it is full or
//! flushed, so that the store's frames (`wire`) go over it as over a socket; [`Opener`] is the
//! matching [`Read`].

use snow::StatelessTransportState;
use std::io::{Read, Write};
use std::sync::Arc;

/// The handshake's Noise pattern: both sides' keys are fresh for each connection (forward
/// secrecy), and the pre-shared key (the secret's) goes in first, so that the process's first
/// message already proves it holds the secret.
pub const NOISE: &str = "Noise_NNpsk0_25519_AESGCM_SHA256";

/// The longest sealed record (Noise's bound on a message), and the most plain bytes in one.
pub const RECORD: usize = 65_535;
const TAG: usize = 16;
pub const PLAIN: usize = RECORD - TAG;

/// Both directions' keys of one connection, shared by its two halves.
pub type Keys = Arc<StatelessTransportState>;

/// Why a record did not open: said in the log of the side that read it.
pub const TAMPERED: &str = "a sealed record did not open: the connection's bytes were changed, \
                            cut or replayed on the way, or come from someone without its keys";

/// The sending half: plain bytes in, sealed records out.
pub struct Sealer<W: Write> {
    keys: Keys,
    nonce: u64,
    out: W,
    /// Plain bytes not sealed yet (less than a record's worth).
    plain: Vec<u8>,
    /// A record's room: its length and sealed bytes.
    sealed: Vec<u8>,
}

/// `plain` (at most [`PLAIN`] bytes) sealed as record `nonce` of its direction, without its
/// length: the handshake's own first records.
pub fn seal_one(keys: &Keys, nonce: u64, plain: &[u8]) -> std::io::Result<Vec<u8>> {
    let mut sealed = vec![0u8; plain.len() + TAG];
    let n = keys
        .write_message(nonce, plain, &mut sealed)
        .map_err(|e| std::io::Error::other(format!("cannot seal a record ({e})")))?;
    sealed.truncate(n);
    Ok(sealed)
}

/// Record `nonce` of the other direction opened, or [`TAMPERED`].
pub fn open_one(keys: &Keys, nonce: u64, sealed: &[u8]) -> std::io::Result<Vec<u8>> {
    let mut plain = vec![0u8; sealed.len()];
    let n = keys
        .read_message(nonce, sealed, &mut plain)
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, TAMPERED))?;
    plain.truncate(n);
    Ok(plain)
}

impl<W: Write> Sealer<W> {
    /// Seal onto `out`, the first record with counter `nonce`.
    pub fn starting_at(keys: Keys, out: W, nonce: u64) -> Sealer<W> {
        Sealer {
            keys,
            nonce,
            out,
            plain: Vec::with_capacity(PLAIN),
            sealed: vec![0u8; 2 + RECORD],
        }
    }

    pub fn get_ref(&self) -> &W {
        &self.out
    }

    /// Seal `plain` (at most [`PLAIN`] bytes) as the next record and write it.
    fn seal(&mut self, plain: &[u8]) -> std::io::Result<()> {
        let n = self
            .keys
            .write_message(self.nonce, plain, &mut self.sealed[2..])
            .map_err(|e| std::io::Error::other(format!("cannot seal a record ({e})")))?;
        self.nonce += 1;
        self.sealed[..2].copy_from_slice(&(n as u16).to_le_bytes());
        self.out.write_all(&self.sealed[..2 + n])
    }

    fn seal_pending(&mut self) -> std::io::Result<()> {
        if self.plain.is_empty() {
            return Ok(());
        }
        let plain = std::mem::take(&mut self.plain);
        let sealed = self.seal(&plain);
        self.plain = plain;
        self.plain.clear();
        sealed
    }
}

impl<W: Write> Write for Sealer<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        // A whole record's worth with nothing pending is sealed straight from the caller's
        // bytes (a shard of gigabytes is not copied into the buffer first).
        if self.plain.is_empty() && buf.len() >= PLAIN {
            self.seal(&buf[..PLAIN])?;
            return Ok(PLAIN);
        }
        let n = buf.len().min(PLAIN - self.plain.len());
        self.plain.extend_from_slice(&buf[..n]);
        if self.plain.len() == PLAIN {
            self.seal_pending()?;
        }
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.seal_pending()?;
        self.out.flush()
    }
}

/// The receiving half: sealed records in, plain bytes out.
pub struct Opener<R: Read> {
    keys: Keys,
    nonce: u64,
    input: R,
    sealed: Vec<u8>,
    /// The last record's plain bytes, and how many of them were read.
    plain: Vec<u8>,
    at: usize,
}

impl<R: Read> Opener<R> {
    /// Open what comes from `input`, the first record with counter `nonce`.
    pub fn starting_at(keys: Keys, input: R, nonce: u64) -> Opener<R> {
        Opener {
            keys,
            nonce,
            input,
            sealed: vec![0u8; RECORD],
            plain: Vec::new(),
            at: 0,
        }
    }

    pub fn get_ref(&self) -> &R {
        &self.input
    }

    /// The next record's sealed bytes into `self.sealed`; its length, or None at a clean end
    /// (the peer closed between records).
    fn next_record(&mut self) -> std::io::Result<Option<usize>> {
        let mut len = [0u8; 2];
        let mut got = 0;
        while got < 2 {
            match self.input.read(&mut len[got..]) {
                Ok(0) if got == 0 => return Ok(None),
                Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                Ok(k) => got += k,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        let n = u16::from_le_bytes(len) as usize;
        if n < TAG {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                TAMPERED,
            ));
        }
        self.input.read_exact(&mut self.sealed[..n])?;
        Ok(Some(n))
    }

    /// Open the record in `self.sealed[..n]` into `into`; its plain length.
    fn open(&mut self, n: usize, into: &mut [u8]) -> std::io::Result<usize> {
        let opened = self
            .keys
            .read_message(self.nonce, &self.sealed[..n], into)
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, TAMPERED))?;
        self.nonce += 1;
        Ok(opened)
    }
}

impl<R: Read> Read for Opener<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        while self.at >= self.plain.len() {
            let Some(n) = self.next_record()? else {
                return Ok(0);
            };
            // Straight into the caller's buffer where it has room for the whole record.
            if buf.len() >= n - TAG {
                match self.open(n, buf)? {
                    0 => continue,
                    k => return Ok(k),
                }
            }
            let mut plain = std::mem::take(&mut self.plain);
            plain.resize(PLAIN, 0);
            let opened = self.open(n, &mut plain);
            self.plain = plain;
            self.at = 0;
            match opened {
                Ok(k) => self.plain.truncate(k),
                Err(e) => {
                    self.plain.clear();
                    return Err(e);
                }
            }
        }
        let k = buf.len().min(self.plain.len() - self.at);
        buf[..k].copy_from_slice(&self.plain[self.at..self.at + k]);
        self.at += k;
        Ok(k)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two sides' keys from a handshake of the run's pattern, over memory.
    pub(crate) fn pair() -> (Keys, Keys) {
        let psk = [7u8; 32];
        let build = || {
            snow::Builder::new(super::NOISE.parse().unwrap())
                .psk(0, &psk)
                .unwrap()
        };
        let mut i = build().build_initiator().unwrap();
        let mut r = build().build_responder().unwrap();
        let (mut m, mut p) = (vec![0u8; 200], vec![0u8; 200]);
        let n = i.write_message(&[], &mut m).unwrap();
        r.read_message(&m[..n], &mut p).unwrap();
        let n = r.write_message(&[], &mut m).unwrap();
        i.read_message(&m[..n], &mut p).unwrap();
        (
            Arc::new(i.into_stateless_transport_mode().unwrap()),
            Arc::new(r.into_stateless_transport_mode().unwrap()),
        )
    }

    #[test]
    fn bytes_go_through_sealed_and_a_changed_record_does_not_open() {
        let (a, b) = pair();
        let mut wire = Vec::new();
        let big: Vec<u8> = (0..200_000u32).map(|i| (i * 7 % 251) as u8).collect();
        {
            let mut s = Sealer::starting_at(a.clone(), &mut wire, 0);
            s.write_all(b"hello").unwrap();
            s.flush().unwrap();
            s.write_all(&big).unwrap();
            s.flush().unwrap();
        }
        // Nothing of the plain bytes shows on the wire.
        assert!(!wire.windows(5).any(|w| w == b"hello"));
        let mut o = Opener::starting_at(b.clone(), &wire[..], 0);
        let mut got = Vec::new();
        o.read_to_end(&mut got).unwrap();
        assert_eq!(&got[..5], b"hello");
        assert_eq!(&got[5..], &big[..]);
        // One bit changed anywhere: that record does not open.
        for at in [3usize, 40, wire.len() - 1] {
            let mut bad = wire.clone();
            bad[at] ^= 1;
            let mut o = Opener::starting_at(b.clone(), &bad[..], 0);
            let e = o.read_to_end(&mut Vec::new()).unwrap_err();
            assert_eq!(e.kind(), std::io::ErrorKind::InvalidData, "{at}");
            assert!(e.to_string().contains("did not open"), "{e}");
        }
        // A record replayed (the first one twice) does not open either: its counter moved on.
        let first = 2 + u16::from_le_bytes([wire[0], wire[1]]) as usize;
        let replayed = [&wire[..first], &wire[..first]].concat();
        let mut o = Opener::starting_at(b, &replayed[..], 0);
        let mut five = [0u8; 5];
        o.read_exact(&mut five).unwrap();
        assert!(o.read(&mut five).is_err());
        // The other direction's key opens nothing of this one.
        let mut o = Opener::starting_at(a, &wire[..], 0);
        assert!(o.read(&mut five).is_err());
    }
}
