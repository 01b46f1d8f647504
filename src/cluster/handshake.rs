//! The opening of every connection to the run's store, both halves: the greetings (which
//! protocol each side speaks), then the proofs that both hold the run's secret (`auth`), then
//! the store's verdict. What each says, in order:
//!
//! - process: `MAGIC`, `PROTOCOL` (u32), its process id (u32), its nonce;
//! - store: `MAGIC`, `PROTOCOL`, a status byte: go on (its nonce and its proof follow),
//!   busy (too many connections: the process tries again) or refused (a message follows);
//! - process: its proof;
//! - store: accepted, or refused with a message; then the connection carries frames (`wire`).
//!
//! A process of another protocol hears the store's greeting and nothing more, so both name
//! both versions. All integers little-endian; a message is a u16 length and its UTF-8 bytes.

use crate::cluster::auth::{nonce, Secret, NONCE, PROOF};
use crate::cluster::wire::Greeting;
use std::io::{Read, Write};

const GO_ON: u8 = 0;
const BUSY: u8 = 1;
const REFUSED: u8 = 2;
const ACCEPTED: u8 = 3;

/// Why a connection did not open, as the side that failed sees it.
#[derive(Debug)]
pub enum Failed {
    /// The other side speaks another protocol (as far as known).
    Protocol(Greeting),
    /// The store's side closed or said nothing before its greeting (not a store, or one that
    /// had to close the connection).
    NoGreeting(std::io::Error),
    /// The store has no room now: try again.
    Busy,
    /// The other side does not hold the run's secret (or another one).
    Proof,
    /// The store refused this process, saying why.
    Refused(String),
    /// The connection failed on the way.
    Io(std::io::Error),
}

impl From<std::io::Error> for Failed {
    fn from(e: std::io::Error) -> Failed {
        Failed::Io(e)
    }
}

fn greeting_then(extra: &[u8]) -> Vec<u8> {
    let mut g = crate::cluster::wire::greeting().to_vec();
    g.extend(extra);
    g
}

fn read_message(r: &mut impl Read) -> std::io::Result<String> {
    let mut n = [0u8; 2];
    r.read_exact(&mut n)?;
    let mut text = vec![0u8; u16::from_le_bytes(n) as usize];
    r.read_exact(&mut text)?;
    Ok(String::from_utf8_lossy(&text).into_owned())
}

fn message(text: &str) -> Vec<u8> {
    let bytes = &text.as_bytes()[..text.len().min(u16::MAX as usize)];
    let mut out = (bytes.len() as u16).to_le_bytes().to_vec();
    out.extend(bytes);
    out
}

/// The process's half: greet the store as `process`, check its proof, prove this side's.
pub fn open(
    r: &mut impl Read,
    w: &mut impl Write,
    secret: &Secret,
    process: u32,
) -> Result<(), Failed> {
    let mine = nonce()?;
    let mut hello = greeting_then(&process.to_le_bytes());
    hello.extend(mine);
    w.write_all(&hello)?;
    w.flush()?;
    match crate::cluster::wire::read_greeting(r).map_err(Failed::NoGreeting)? {
        Greeting::Same => {}
        other => return Err(Failed::Protocol(other)),
    }
    let mut status = [0u8; 1];
    r.read_exact(&mut status)?;
    match status[0] {
        GO_ON => {}
        BUSY => return Err(Failed::Busy),
        REFUSED => return Err(Failed::Refused(read_message(r)?)),
        _ => return Err(Failed::Protocol(Greeting::Stranger)),
    }
    let mut theirs = [0u8; NONCE];
    r.read_exact(&mut theirs)?;
    let mut proof = [0u8; PROOF];
    r.read_exact(&mut proof)?;
    if !secret.store_proved(&proof, &mine, &theirs, process) {
        return Err(Failed::Proof);
    }
    w.write_all(&secret.process_proof(&mine, &theirs, process))?;
    w.flush()?;
    r.read_exact(&mut status)?;
    match status[0] {
        ACCEPTED => Ok(()),
        REFUSED => Err(Failed::Refused(read_message(r)?)),
        _ => Err(Failed::Protocol(Greeting::Stranger)),
    }
}

/// What the store decides about a process by its id, before any proof (`Err`: why it is
/// refused, told to it).
pub type Admit<'a> = &'a dyn Fn(u32) -> Result<(), String>;

/// The store's half: hear the process's greeting, refuse it where `admit` says so, prove this
/// side's secret, check the process's proof. Returns the process's id.
pub fn accept(
    r: &mut impl Read,
    w: &mut impl Write,
    secret: &Secret,
    admit: Admit,
) -> Result<u32, Failed> {
    match crate::cluster::wire::read_greeting(r)? {
        Greeting::Same => {}
        Greeting::Version(v) => {
            // Answered with this side's version, so that the peer names both too.
            let _ = w.write_all(&greeting_then(&[]));
            return Err(Failed::Protocol(Greeting::Version(v)));
        }
        other => return Err(Failed::Protocol(other)),
    }
    let mut rest = [0u8; 4 + NONCE];
    r.read_exact(&mut rest)?;
    let process = u32::from_le_bytes(rest[..4].try_into().unwrap());
    let theirs = &rest[4..];
    if let Err(why) = admit(process) {
        let mut out = greeting_then(&[REFUSED]);
        out.extend(message(&why));
        let _ = w.write_all(&out);
        return Err(Failed::Refused(why));
    }
    let mine = nonce()?;
    let mut out = greeting_then(&[GO_ON]);
    out.extend(mine);
    out.extend(secret.store_proof(theirs, &mine, process));
    w.write_all(&out)?;
    w.flush()?;
    let mut proof = [0u8; PROOF];
    r.read_exact(&mut proof)?;
    if !secret.process_proved(&proof, theirs, &mine, process) {
        let mut out = vec![REFUSED];
        out.extend(message(
            "this process does not hold the run's secret: every host must be given the same \
             XTRAIN_RUN_TOKEN or --run-token-file",
        ));
        let _ = w.write_all(&out);
        return Err(Failed::Proof);
    }
    w.write_all(&[ACCEPTED])?;
    w.flush()?;
    Ok(process)
}

/// The store's answer to a connection it has no room for: its greeting and "busy".
pub fn busy() -> Vec<u8> {
    greeting_then(&[BUSY])
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};

    /// Both halves over loopback, the store's with `store`'s secret and the process's with
    /// `process`'s; what each side got.
    fn meet(store: Secret, process: Secret, id: u32) -> (Result<u32, Failed>, Result<(), Failed>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let at = l.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (s, _) = l.accept().unwrap();
            let mut r = s.try_clone().unwrap();
            let mut w = s;
            let admit = |p: u32| {
                if p < 2 {
                    Ok(())
                } else {
                    Err(format!("process {p} is outside this run of 2 processes"))
                }
            };
            accept(&mut r, &mut w, &store, &admit)
        });
        let s = TcpStream::connect(at).unwrap();
        let mut r = s.try_clone().unwrap();
        let mut w = s;
        let client = open(&mut r, &mut w, &process, id);
        // Closed as a process that gave up closes it: the store's side sees the end.
        drop((r, w));
        (server.join().unwrap(), client)
    }

    fn secret(text: &str) -> Secret {
        Secret::from_bytes(text.as_bytes(), "t").unwrap()
    }

    #[test]
    fn both_sides_prove_the_secret_and_a_wrong_or_missing_one_is_refused() {
        let s = || secret("a-run-secret-of-enough-bytes");
        let (store, process) = meet(s(), s(), 1);
        assert_eq!(store.unwrap(), 1);
        process.unwrap();
        let (store, process) = meet(Secret::none(), Secret::none(), 0);
        assert_eq!(store.unwrap(), 0);
        process.unwrap();
        // A process with another secret (or none) fails the store's proof and sends nothing more.
        for other in [secret("another-secret-of-enough-bytes"), Secret::none()] {
            let (store, process) = meet(s(), other, 1);
            assert!(matches!(process, Err(Failed::Proof)), "{process:?}");
            assert!(store.is_err());
        }
        // A store without the secret (a fake coordinator) is refused by the process.
        let (_, process) = meet(Secret::none(), s(), 1);
        assert!(matches!(process, Err(Failed::Proof)), "{process:?}");
        // An id outside the run is refused with the store's words.
        let (store, process) = meet(s(), s(), 5);
        assert!(matches!(store, Err(Failed::Refused(_))));
        match process {
            Err(Failed::Refused(m)) => assert!(m.contains("process 5 is outside"), "{m}"),
            other => panic!("{other:?}"),
        }
    }
}
