//! The opening of every connection to the run's store, both halves: the greetings (which
//! protocol each side speaks), then a Noise handshake keyed by the run's secret (`channel::NOISE`:
//! `NNpsk0`, X25519, AES-256-GCM, SHA-256), then the sealed channel (`channel`). In order:
//!
//! - process: `MAGIC`, `PROTOCOL` (u32), Noise's first message, whose sealed payload is its
//!   process id;
//! - store: `MAGIC`, `PROTOCOL`, a status byte: go on (Noise's second message follows), busy
//!   (no room for another connection now: the process tries again) or refused (a message
//!   follows: the first message did not open under the run's secret);
//! - process: its first sealed record, a fixed word (proof that it made the first message now,
//!   not a recording of another connection's, and holds the keys) and, once its process has
//!   joined the run, the session's [`Ticket`];
//! - store: its first sealed record, the verdict: accepted, busy (this process has as many
//!   connections as it may), or refused with why (an id outside the run, or the id of a process
//!   that joined the run, without its ticket).
//!
//! The ticket binds an id to the process that joined as it: every holder of the secret passes
//! the handshake, but once process `k` joined, only a connection that carries the ticket its
//! session was given acts as process `k`. It travels in a record sealed under the connection's
//! fresh keys, which whoever records the wire (the secret in hand or not) cannot open.
//!
//! The first message is sealed under the secret's key, so a stranger's probe earns one refusal
//! that says nothing about the run (not even its size), and nothing that would let it test
//! guesses of the secret: those need a recorded handshake, and a random secret of 128 bits
//! or more ([`auth`](super::auth)) makes them hopeless. A process of another protocol hears the
//! store's greeting and nothing more, so both name both versions. Every read and write of the
//! handshake is bounded by one deadline, however slowly the peer trickles its bytes. All
//! integers little-endian; a message is a u16 length and its bytes.

use crate::cluster::auth::Secret;
use crate::cluster::channel::{self, Keys, Opener, Sealer, NOISE};
use crate::cluster::wire::Greeting;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Instant;

const GO_ON: u8 = 0;
const BUSY: u8 = 1;
const REFUSED: u8 = 2;
const ACCEPTED: u8 = 3;

/// The process's first sealed record (its ticket follows, where it has one).
const CONFIRM: &[u8] = b"xtrain-store/confirm";

/// What the store gives a process when it joins the run: the connections that carry it act as
/// that process, and no others (see the module's words).
pub type Ticket = [u8; 32];

/// Whether two tickets are the same (compared in constant time).
pub fn same_ticket(a: &Ticket, b: &Ticket) -> bool {
    a.iter().zip(b.iter()).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

/// What the store says when a process's first message opened under the secret (its fresh
/// public key in hand), before it answers: go on, or stop there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum First {
    GoOn,
    /// This first message was seen before: a recording, replayed.
    Replayed,
    /// The connection was closed meanwhile (crowded out by newcomers, told it is busy).
    Closed,
}

/// Noise's messages in this pattern are tens of bytes.
const MAX_MESSAGE: usize = 256;

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
    /// The other side does not hold the run's secret (or another one), or its messages were
    /// changed on the way.
    Proof,
    /// The store refused this process, saying why.
    Refused(String),
    /// The process's first message opened, but it did not prove it holds this connection's
    /// keys (a recorded first message replayed, or bytes changed on the way).
    Unconfirmed,
    /// The connection failed on the way (or its deadline passed).
    Io(std::io::Error),
}

impl From<std::io::Error> for Failed {
    fn from(e: std::io::Error) -> Failed {
        Failed::Io(e)
    }
}

/// What the store decides about a proven process by its id (it may count the connection as the
/// process's where it says yes).
#[derive(Clone, Debug)]
pub enum Verdict {
    Accepted,
    /// No room for another connection of this process now.
    Busy,
    Refused(String),
}

/// A connection whose handshake is done: its sealed halves over the same socket.
pub struct Opened {
    pub sealer: Sealer<TcpStream>,
    pub opener: Opener<TcpStream>,
}

/// Reads and writes on `stream`, each bounded by what is left until `deadline`.
struct Timed<'a> {
    stream: &'a TcpStream,
    deadline: Instant,
}

impl Timed<'_> {
    fn left(&self) -> std::io::Result<std::time::Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        Ok(left)
    }

    fn read_exact(&mut self, buf: &mut [u8]) -> std::io::Result<()> {
        let mut got = 0;
        while got < buf.len() {
            self.stream.set_read_timeout(Some(self.left()?))?;
            match (&mut &*self.stream).read(&mut buf[got..]) {
                Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => got += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    fn write_all(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.stream.set_write_timeout(Some(self.left()?))?;
        (&mut &*self.stream).write_all(bytes)?;
        (&mut &*self.stream).flush()
    }

    /// A u16-length-prefixed message of at most `max` bytes.
    fn read_message(&mut self, max: usize) -> std::io::Result<Vec<u8>> {
        let mut n = [0u8; 2];
        self.read_exact(&mut n)?;
        let n = u16::from_le_bytes(n) as usize;
        if n > max {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("a handshake message of {n} bytes (at most {max})"),
            ));
        }
        let mut m = vec![0u8; n];
        self.read_exact(&mut m)?;
        Ok(m)
    }

    fn greeting(&mut self) -> std::io::Result<Greeting> {
        let mut g = [0u8; 12];
        self.read_exact(&mut g)?;
        crate::cluster::wire::read_greeting(&mut &g[..])
    }
}

fn with_length(bytes: &[u8]) -> Vec<u8> {
    let bytes = &bytes[..bytes.len().min(u16::MAX as usize)];
    let mut out = (bytes.len() as u16).to_le_bytes().to_vec();
    out.extend(bytes);
    out
}

fn noise() -> snow::Builder<'static> {
    snow::Builder::new(NOISE.parse().expect("the pattern's name parses"))
}

fn broken<E: std::fmt::Display>(e: E) -> Failed {
    Failed::Io(std::io::Error::other(format!("the handshake failed ({e})")))
}

/// The sealed halves, once the keys are there; the next record each way is the second.
fn opened(stream: &TcpStream, keys: Keys) -> Result<Opened, Failed> {
    Ok(Opened {
        sealer: Sealer::starting_at(keys.clone(), stream.try_clone()?, 1),
        opener: Opener::starting_at(keys, stream.try_clone()?, 1),
    })
}

/// The process's half: greet the store as `process`, check that the store holds the secret,
/// prove this side's; everything by `deadline`. A process that has not joined the run (no
/// ticket yet).
pub fn open(
    stream: &TcpStream,
    secret: &Secret,
    process: u32,
    deadline: Instant,
) -> Result<Opened, Failed> {
    open_as(stream, secret, process, None, deadline)
}

/// [`open`], carrying the `ticket` of this process's session once it joined the run.
pub fn open_as(
    stream: &TcpStream,
    secret: &Secret,
    process: u32,
    ticket: Option<&Ticket>,
    deadline: Instant,
) -> Result<Opened, Failed> {
    let key = secret.key();
    let greeting = crate::cluster::wire::greeting();
    let mut hs = noise()
        .psk(0, &key)
        .and_then(|b| b.prologue(&greeting))
        .and_then(|b| b.build_initiator())
        .map_err(broken)?;
    let mut t = Timed { stream, deadline };
    let mut first = [0u8; MAX_MESSAGE];
    let n = hs
        .write_message(&process.to_le_bytes(), &mut first)
        .map_err(broken)?;
    let mut hello = greeting.to_vec();
    hello.extend(with_length(&first[..n]));
    t.write_all(&hello)?;
    match t.greeting().map_err(Failed::NoGreeting)? {
        Greeting::Same => {}
        other => return Err(Failed::Protocol(other)),
    }
    let mut status = [0u8; 1];
    t.read_exact(&mut status)?;
    match status[0] {
        GO_ON => {}
        BUSY => return Err(Failed::Busy),
        REFUSED => {
            let why = t.read_message(1024)?;
            return Err(Failed::Refused(String::from_utf8_lossy(&why).into_owned()));
        }
        _ => return Err(Failed::Protocol(Greeting::Stranger)),
    }
    let second = t.read_message(MAX_MESSAGE)?;
    // The store's message opens only under the same secret: a store without it (a fake
    // coordinator) is refused here, having learnt nothing.
    hs.read_message(&second, &mut [0u8; MAX_MESSAGE])
        .map_err(|_| Failed::Proof)?;
    let keys: Keys = Arc::new(hs.into_stateless_transport_mode().map_err(broken)?);
    let mut confirm = CONFIRM.to_vec();
    confirm.extend(ticket.into_iter().flatten());
    t.write_all(&with_length(&channel::seal_one(&keys, 0, &confirm)?))?;
    let sealed = t.read_message(channel::RECORD)?;
    let verdict = channel::open_one(&keys, 0, &sealed)?;
    match verdict.first() {
        Some(&ACCEPTED) => opened(stream, keys),
        Some(&BUSY) => Err(Failed::Busy),
        Some(&REFUSED) => Err(Failed::Refused(
            String::from_utf8_lossy(&verdict[1..]).into_owned(),
        )),
        _ => Err(Failed::Protocol(Greeting::Stranger)),
    }
}

/// The store's half: hear the process's greeting and first message, which must open under the
/// secret; tell `first` its fresh public key (which may stop it there); answer; take its proof
/// of the keys and its ticket, if any; then ask `admit` about its id and ticket. Returns the
/// process's id and the sealed halves; everything by `deadline`.
pub fn accept(
    stream: &TcpStream,
    secret: &Secret,
    deadline: Instant,
    first: &dyn Fn(&[u8; 32]) -> First,
    admit: &dyn Fn(u32, Option<&Ticket>) -> Verdict,
) -> Result<(u32, Opened), Failed> {
    let mut t = Timed { stream, deadline };
    match t.greeting()? {
        Greeting::Same => {}
        Greeting::Version(v) => {
            // Answered with this side's version, so that the peer names both too.
            let _ = t.write_all(&crate::cluster::wire::greeting());
            return Err(Failed::Protocol(Greeting::Version(v)));
        }
        other => return Err(Failed::Protocol(other)),
    }
    let first_message = t.read_message(MAX_MESSAGE)?;
    let key = secret.key();
    let greeting = crate::cluster::wire::greeting();
    let mut hs = noise()
        .psk(0, &key)
        .and_then(|b| b.prologue(&greeting))
        .and_then(|b| b.build_responder())
        .map_err(broken)?;
    let mut payload = [0u8; MAX_MESSAGE];
    let process = match hs.read_message(&first_message, &mut payload) {
        Ok(4) => u32::from_le_bytes(payload[..4].try_into().unwrap()),
        _ => {
            let mut out = greeting.to_vec();
            out.push(REFUSED);
            out.extend(with_length(
                b"this process does not hold the run's secret: every host must be given the \
                  same XTRAIN_RUN_TOKEN or --run-token-file",
            ));
            let _ = t.write_all(&out);
            return Err(Failed::Proof);
        }
    };
    // The first 32 bytes of a first message that opened are its sender's fresh public key.
    let ephemeral: [u8; 32] = first_message[..32].try_into().map_err(broken)?;
    match first(&ephemeral) {
        First::GoOn => {}
        First::Replayed => return Err(Failed::Unconfirmed),
        First::Closed => return Err(Failed::Io(std::io::ErrorKind::ConnectionAborted.into())),
    }
    let mut second = [0u8; MAX_MESSAGE];
    let n = hs.write_message(&[], &mut second).map_err(broken)?;
    let mut out = greeting.to_vec();
    out.push(GO_ON);
    out.extend(with_length(&second[..n]));
    t.write_all(&out)?;
    let keys: Keys = Arc::new(hs.into_stateless_transport_mode().map_err(broken)?);
    // A recorded first message replayed gets this far, but no further: its sender cannot make
    // the keys of this connection's fresh second message.
    let sealed = t.read_message(channel::RECORD)?;
    let ticket: Option<Ticket> = match channel::open_one(&keys, 0, &sealed) {
        Ok(word) if word == CONFIRM => None,
        Ok(word) if word.len() == CONFIRM.len() + 32 && word.starts_with(CONFIRM) => {
            Some(word[CONFIRM.len()..].try_into().expect("32 bytes"))
        }
        _ => return Err(Failed::Unconfirmed),
    };
    let (verdict, result) = match admit(process, ticket.as_ref()) {
        Verdict::Accepted => (vec![ACCEPTED], Ok(())),
        Verdict::Busy => (vec![BUSY], Err(Failed::Busy)),
        Verdict::Refused(why) => {
            let mut v = vec![REFUSED];
            v.extend(why.as_bytes());
            (v, Err(Failed::Refused(why)))
        }
    };
    t.write_all(&with_length(&channel::seal_one(&keys, 0, &verdict)?))?;
    result?;
    Ok((process, opened(stream, keys)?))
}

/// The store's answer to a connection it has no room for: its greeting and "busy".
pub fn busy() -> Vec<u8> {
    let mut g = crate::cluster::wire::greeting().to_vec();
    g.push(BUSY);
    g
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::auth::random_token;
    use std::io::{Read, Write};
    use std::net::TcpListener;
    use std::time::Duration;

    fn soon() -> Instant {
        Instant::now() + Duration::from_secs(10)
    }

    /// Both halves over loopback, the store's with `store`'s secret and the process's with
    /// `process`'s; what each side got.
    fn meet(store: Secret, process: Secret, id: u32) -> (Result<u32, Failed>, Result<(), Failed>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let at = l.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (s, _) = l.accept().unwrap();
            let admit = |p: u32, _: Option<&Ticket>| {
                if p < 2 {
                    Verdict::Accepted
                } else {
                    Verdict::Refused(format!("process {p} is outside this run of 2 processes"))
                }
            };
            let (p, mut o) = accept(&s, &store, soon(), &|_| First::GoOn, &admit)?;
            // One sealed frame each way after the handshake.
            let mut hello = [0u8; 5];
            o.opener.read_exact(&mut hello)?;
            assert_eq!(&hello, b"hello");
            o.sealer.write_all(b"there")?;
            o.sealer.flush()?;
            Ok(p)
        });
        let s = std::net::TcpStream::connect(at).unwrap();
        let client = open(&s, &process, id, soon()).and_then(|mut o| {
            o.sealer.write_all(b"hello")?;
            o.sealer.flush()?;
            let mut there = [0u8; 5];
            o.opener.read_exact(&mut there)?;
            assert_eq!(&there, b"there");
            Ok(())
        });
        // Closed as a process that gave up closes it: the store's side sees the end.
        drop(s);
        (server.join().unwrap(), client)
    }

    fn secret() -> Secret {
        Secret::from_bytes(random_token().unwrap().as_bytes(), "t").unwrap()
    }

    #[test]
    fn both_sides_prove_the_secret_and_a_wrong_or_missing_one_is_refused() {
        let s = secret();
        let (store, process) = meet(s.clone(), s.clone(), 1);
        assert_eq!(store.unwrap(), 1);
        process.unwrap();
        let (store, process) = meet(Secret::none(), Secret::none(), 0);
        assert_eq!(store.unwrap(), 0);
        process.unwrap();
        // A process with another secret (or none) is refused at its first message.
        for other in [secret(), Secret::none()] {
            let (store, process) = meet(s.clone(), other, 1);
            match process {
                Err(Failed::Refused(m)) => assert!(m.contains("does not hold the run's secret")),
                other => panic!("{other:?}"),
            }
            assert!(matches!(store, Err(Failed::Proof)));
        }
        // A store without the secret (a fake coordinator) is refused by the process.
        let (_, process) = meet(secret(), s.clone(), 1);
        assert!(matches!(process, Err(Failed::Refused(_))), "{process:?}");
        // An id outside the run is refused with the store's words, once proven.
        let (store, process) = meet(s.clone(), s, 5);
        assert!(matches!(store, Err(Failed::Refused(_))));
        match process {
            Err(Failed::Refused(m)) => assert!(m.contains("process 5 is outside"), "{m}"),
            other => panic!("{other:?}"),
        }
    }

    /// A peer that trickles its bytes cannot stretch the handshake past its deadline.
    #[test]
    fn a_slow_peer_is_bounded_by_the_deadline() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let at = l.local_addr().unwrap();
        let slow = std::thread::spawn(move || {
            let mut s = std::net::TcpStream::connect(at).unwrap();
            for b in crate::cluster::wire::greeting() {
                if s.write_all(&[b]).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(150));
            }
        });
        let (s, _) = l.accept().unwrap();
        let t0 = Instant::now();
        let got = accept(
            &s,
            &secret(),
            Instant::now() + Duration::from_millis(500),
            &|_| First::GoOn,
            &|_, _| Verdict::Accepted,
        );
        assert!(matches!(got, Err(Failed::Io(_))), "{:?}", got.err());
        assert!(
            t0.elapsed() < Duration::from_millis(900),
            "{:?}",
            t0.elapsed()
        );
        drop(s);
        slow.join().unwrap();
    }
}
