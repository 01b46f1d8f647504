//! The run's store under attack, on loopback: a stranger (a raw TCP client written here, or the
//! store's own client holding the wrong secret or id) is refused on its own connection, and the
//! run's processes still meet and keep what they wrote. Each test replays one attack of issue 46.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};
use xtrain::cluster::auth::Secret;
use xtrain::cluster::handshake::{self, Failed};
use xtrain::cluster::server::{Config, StoreServer};
use xtrain::cluster::store::{Credentials, Store};
use xtrain::cluster::wire::{StoreError, MAGIC, PROTOCOL};

fn secret(text: &str) -> Secret {
    Secret::from_bytes(text.as_bytes(), "test").unwrap()
}

fn the_secret() -> Secret {
    secret("the-run-secret-of-this-test-0123")
}

/// A store for a run of 2 processes holding `s`, on `at` (port 0: any).
fn serve_on(at: &str, s: Secret) -> (StoreServer, String) {
    let listener = TcpListener::bind(at).unwrap();
    let server = StoreServer::serve(listener, Config::new(2, s)).unwrap();
    let address = server.address().to_string();
    (server, address)
}

fn serve() -> (StoreServer, String) {
    serve_on("127.0.0.1:0", the_secret())
}

fn connect(address: &str, process: usize, s: Secret) -> Result<Store, StoreError> {
    let me = Credentials { process, secret: s };
    Store::connect(address, "attack", me, Duration::from_secs(5))
}

/// The run's two processes, as the store's own client reaches it.
fn processes(address: &str) -> (Store, Store) {
    (
        connect(address, 0, the_secret()).unwrap(),
        connect(address, 1, the_secret()).unwrap(),
    )
}

/// The real processes still meet: a barrier both reach, and a value one puts that the other
/// reads.
fn still_meet(address: &str, name: &str) {
    let (zero, one) = processes(address);
    let theirs = name.to_string();
    let other = std::thread::spawn(move || {
        one.put(&format!("said/{theirs}/1"), b"hello").unwrap();
        one.barrier(&theirs, 1, 2, Duration::from_secs(20))
    });
    zero.barrier(name, 0, 2, Duration::from_secs(20)).unwrap();
    other.join().unwrap().unwrap();
    let heard = zero.get(&format!("said/{name}/1"), Duration::from_secs(5));
    assert_eq!(heard.unwrap(), b"hello");
}

/// One frame of the store's protocol, written by hand: header length, JSON header, value
/// length (as declared: it may lie), value bytes.
fn frame(header: &str, declared: u64, value: &[u8]) -> Vec<u8> {
    let mut out = (header.len() as u32).to_le_bytes().to_vec();
    out.extend(header.as_bytes());
    out.extend(declared.to_le_bytes());
    out.extend(value);
    out
}

/// A raw connection that passed the handshake as `process` with `s`.
fn authenticated(address: &str, process: u32, s: &Secret) -> TcpStream {
    let stream = TcpStream::connect(address).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    handshake::open(&mut &stream, &mut &stream, s, process).unwrap();
    stream
}

/// What the store answered on `stream` (its reply header's text), or why nothing came.
fn reply(stream: &mut TcpStream) -> String {
    let mut n = [0u8; 4];
    if let Err(e) = stream.read_exact(&mut n) {
        return format!("closed: {e}");
    }
    let mut header = vec![0u8; u32::from_le_bytes(n) as usize];
    stream.read_exact(&mut header).unwrap();
    String::from_utf8(header).unwrap()
}

/// Another build's greeting, protocol 1's JSON and plain garbage: each is refused on its
/// connection (told this side's version where it speaks xtrain) and the run goes on.
#[test]
fn another_version_or_a_strangers_bytes_end_nothing() {
    let (_server, address) = serve();
    let (zero, _one) = processes(&address);
    zero.put("kept/0", b"v").unwrap();
    for hello in [
        [&MAGIC[..], &(PROTOCOL + 1).to_le_bytes()].concat(),
        br#"{"op":"put","key":"xtrain/run/settings/1","value":[1]}"#.to_vec(),
        b"GET / HTTP/1.1\r\n\r\n".to_vec(),
    ] {
        let mut s = TcpStream::connect(&address).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(&hello).unwrap();
        let mut heard = Vec::new();
        let _ = s.read_to_end(&mut heard);
        assert!(
            heard.len() < 200,
            "{} bytes told to a stranger",
            heard.len()
        );
    }
    still_meet(&address, "after-greetings");
    assert_eq!(zero.try_get("kept/0").unwrap(), Some(b"v".to_vec()));
}

/// Without the secret, or with another, a process can neither join, read nor write; a fake
/// coordinator without it is refused by the real process.
#[test]
fn no_secret_or_a_wrong_one_is_refused_both_ways() {
    let (_server, address) = serve();
    let (zero, _one) = processes(&address);
    zero.put("settings/0", b"{\"data\": \"/secret/path\"}")
        .unwrap();
    for wrong in [Secret::none(), secret("another-secret-entirely-0123456")] {
        let e = match connect(&address, 1, wrong) {
            Err(e) => e.to_string(),
            Ok(_) => panic!("a process without the run's secret got in"),
        };
        assert!(e.contains("does not prove the run's secret"), "{e}");
    }
    // A fake coordinator (no secret, or another) learns nothing and is refused.
    let (_fake, fake_address) = serve_on("127.0.0.1:0", secret("the-fake-coordinators-secret-99"));
    let e = match connect(&fake_address, 1, the_secret()) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("a fake coordinator was taken"),
    };
    assert!(e.contains("does not prove the run's secret"), "{e}");
    still_meet(&address, "after-secrets");
}

/// A process's proof seen on one connection is worth nothing on another: the store's nonce is
/// fresh, so a handshake replayed byte for byte fails.
#[test]
fn a_replayed_handshake_is_refused() {
    let (_server, address) = serve();
    // The bytes a real process sends on its connection, recorded through a relay.
    let relay = TcpListener::bind("127.0.0.1:0").unwrap();
    let relay_at = relay.local_addr().unwrap().to_string();
    let upstream = address.clone();
    let recorder = std::thread::spawn(move || {
        let (client, _) = relay.accept().unwrap();
        let server = TcpStream::connect(upstream).unwrap();
        let (mut c2, mut s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
        std::thread::spawn(move || std::io::copy(&mut s2, &mut c2));
        let mut sent = Vec::new();
        let mut buf = [0u8; 4096];
        let mut client = client;
        let mut server = server;
        // The process's half of the handshake: greeting, id, nonce, then its proof.
        while sent.len() < 12 + 4 + 32 + 32 {
            let n = client.read(&mut buf).unwrap();
            assert!(n > 0);
            sent.extend(&buf[..n]);
            server.write_all(&buf[..n]).unwrap();
        }
        sent
    });
    let me = Credentials {
        process: 1,
        secret: the_secret(),
    };
    let real = Store::connect(&relay_at, "attack", me, Duration::from_secs(5)).unwrap();
    let recorded = recorder.join().unwrap();
    drop(real);
    let mut replay = TcpStream::connect(&address).unwrap();
    replay
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    replay.write_all(&recorded[..12 + 4 + 32]).unwrap();
    let mut heard = vec![0u8; 12 + 1 + 32 + 32];
    replay.read_exact(&mut heard).unwrap();
    replay.write_all(&recorded[12 + 4 + 32..]).unwrap();
    let mut verdict = [0u8; 1];
    replay.read_exact(&mut verdict).unwrap();
    assert_eq!(verdict[0], 2, "a replayed proof was not refused");
    // It is told why, and the connection ends there.
    let mut rest = Vec::new();
    let _ = replay.read_to_end(&mut rest);
    let told = String::from_utf8_lossy(&rest);
    assert!(told.contains("does not hold the run's secret"), "{told}");
    still_meet(&address, "after-replay");
}

/// The peak resident memory of this test process (VmHWM), in bytes.
fn peak_memory() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
    let kb: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kb * 1024
}

/// A put declaring a 4 GiB value (a few bytes sent) is refused before anything is allocated,
/// even from a process that holds the secret; so is one that would take the store over its
/// total; the connection closes and the run goes on.
#[test]
fn a_declared_4_gib_value_allocates_nothing() {
    let (_server, address) = serve();
    let before = peak_memory();
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut s = authenticated(&address, 1, &the_secret());
        let put = r#"{"op":"put","key":"xtrain/attack/gather/0/1/1"}"#;
        s.write_all(&frame(put, 4 << 30, &[0u8; 1])).unwrap();
        let said = reply(&mut s);
        assert!(
            said.contains("refused") && said.contains("4294967296"),
            "{said}"
        );
        held.push(s);
    }
    std::thread::sleep(Duration::from_millis(300));
    let grew = peak_memory().saturating_sub(before);
    eprintln!("two declared 4 GiB puts: peak memory grew by {grew} bytes");
    assert!(grew < 256 << 20, "the store's process grew by {grew} bytes");
    still_meet(&address, "after-4-gib");
}

/// Thousands of idle connections (a stranger's, that never finish a handshake) neither stop
/// the real processes from joining nor make the store spin.
#[test]
fn idle_connections_do_not_keep_the_run_out() {
    let (_server, address) = serve();
    let mut idle = Vec::new();
    for _ in 0..2000 {
        match TcpStream::connect(&address) {
            Ok(s) => idle.push(s),
            Err(_) => break,
        }
    }
    assert!(idle.len() >= 500, "only {} connections opened", idle.len());
    let t0 = Instant::now();
    still_meet(&address, "among-idle");
    assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", t0.elapsed());
}

/// A joined session that never reads its replies does not wedge the store for the others.
#[test]
fn a_slow_reader_wedges_nothing() {
    let (_server, address) = serve();
    let mut slow = authenticated(&address, 1, &the_secret());
    let join = r#"{"op":"join","process":1,"host":"slow","silent_ms":0}"#;
    slow.write_all(&frame(join, 0, &[])).unwrap();
    // Heartbeats whose answers it never reads, many MB of them.
    let beat = frame(r#"{"op":"heartbeat"}"#, 0, &[]);
    slow.set_write_timeout(Some(Duration::from_secs(2)))
        .unwrap();
    for _ in 0..20_000 {
        if slow.write_all(&beat).is_err() {
            break;
        }
    }
    let zero = connect(&address, 0, the_secret()).unwrap();
    let t0 = Instant::now();
    zero.put("still/0", b"up").unwrap();
    assert_eq!(zero.try_get("still/0").unwrap(), Some(b"up".to_vec()));
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
}

/// A second join as process 1 is refused naming both addresses; an id outside the run is
/// refused; the real process 1's session stays.
#[test]
fn a_duplicate_join_and_an_id_outside_the_run_are_refused() {
    let (_server, address) = serve();
    let (zero, one) = processes(&address);
    let _first = one.watch(1, None, |_| {}).unwrap();
    let again = connect(&address, 1, the_secret()).unwrap();
    let e = match again.watch(1, None, |_| {}) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("a second join as process 1 was taken"),
    };
    assert!(
        e.contains("process 1 joined the run twice: from 127.0.0.1:"),
        "{e}"
    );
    assert!(e.matches("127.0.0.1:").count() >= 2, "{e}");
    for id in [2, 5] {
        let e = match connect(&address, id, the_secret()) {
            Err(e) => e.to_string(),
            Ok(_) => panic!("process {id} of 2 was taken"),
        };
        assert!(
            e.contains(&format!("process {id} is outside this run of 2")),
            "{e}"
        );
    }
    zero.put("still/0", b"up").unwrap();
}

/// A process writes only its own keys, once: it cannot stand in for another (settings, barrier
/// arrivals, another's gather shards) or change what it said.
#[test]
fn a_process_writes_only_its_own_keys_once() {
    let (_server, address) = serve();
    let (zero, one) = processes(&address);
    zero.put("settings/0", b"{}").unwrap();
    for key in ["settings/0", "barrier/start/0", "gather/3/0/0", "settings"] {
        let e = one.put(key, b"forged").unwrap_err();
        assert!(matches!(e, StoreError::Refused(_)), "{key}: {e}");
    }
    one.put("gather/3/1/1", b"mine").unwrap();
    // The same bytes again change nothing (a barrier passed twice by name).
    one.put("gather/3/1/1", b"mine").unwrap();
    let e = one.put("gather/3/1/1", b"changed").unwrap_err();
    assert!(e.to_string().contains("is written once"), "{e}");
    assert_eq!(zero.try_get("settings/0").unwrap(), Some(b"{}".to_vec()));
    assert_eq!(one.try_get("gather/3/1/1").unwrap(), Some(b"mine".to_vec()));
    // Only process 0 (the gather's reader) or the owner forgets a key.
    assert!(one.delete("settings/0").is_err());
}

/// A forged shard, of the right shape or of a wrong one, cannot reach process 0's gather:
/// the shard's key is its holder's alone (above), and one that does not fit its box is refused
/// naming its position rather than written out of bounds.
#[test]
fn a_shard_of_a_wrong_shape_is_refused_not_a_panic() {
    use xtrain::cluster::gather::{decode, encode};
    let good = pjrt::HostTensor::from_f32(&[1.0, 2.0, 3.0, 4.0], &[2, 2]);
    let wrong = pjrt::HostTensor::from_f32(&[0.0; 6], &[2, 3]);
    let back = decode(encode(&wrong)).unwrap();
    let mut full = pjrt::HostTensor::from_f32(&[0.0; 8], &[2, 4]);
    let e = xtrain::device::shards::place(&mut full, &back, &[0, 2]).unwrap_err();
    assert!(e.to_string().contains("does not fit at [0, 2]"), "{e}");
    xtrain::device::shards::place(&mut full, &good, &[0, 2]).unwrap();
}

/// A coordinator on an IPv6 address: the store binds it and its processes meet there.
#[test]
fn an_ipv6_coordinator_is_served_and_reached() {
    let (_server, address) = serve_on("[::1]:0", the_secret());
    assert!(address.starts_with("[::1]:"), "{address}");
    still_meet(&address, "v6");
}

/// A refused connection fails its own handshake only, and says so to the process.
#[test]
fn a_process_hears_why_it_was_refused() {
    let (_server, address) = serve();
    let s = TcpStream::connect(&address).unwrap();
    let got = handshake::open(&mut &s, &mut &s, &the_secret(), 7);
    match got {
        Err(Failed::Refused(why)) => assert!(why.contains("outside this run of 2"), "{why}"),
        other => panic!("{other:?}"),
    }
}

/// Dropping the store stops serving and frees its port at once (a run that ends leaves nothing
/// listening; the next run can take the same port).
#[test]
fn dropping_the_store_frees_its_port() {
    let (server, address) = serve();
    let (zero, _one) = processes(&address);
    drop(server);
    let again = TcpListener::bind(&address);
    assert!(again.is_ok(), "{address} still held: {again:?}");
    assert!(zero.try_get("anything/0").is_err());
}

/// The store listens on the address it is given and nowhere else (it once served every
/// interface, whatever `--coordinator` said): another address of this host finds nothing.
#[test]
fn the_store_listens_only_on_its_address() {
    let at: std::net::SocketAddr = "127.0.0.1:0".parse().unwrap();
    let server = StoreServer::bind(at, Config::new(2, the_secret())).unwrap();
    let port = server.address().port();
    assert!(TcpStream::connect(("127.0.0.1", port)).is_ok());
    let elsewhere = TcpStream::connect(("127.0.0.2", port));
    assert!(elsewhere.is_err(), "the store answered on 127.0.0.2:{port}");
}
