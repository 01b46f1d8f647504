//! The run's store under attack, on loopback only (127.0.0.0/8): a stranger (a raw TCP client
//! written here, a relay between a process and the store, or the store's own client holding
//! the wrong secret or id), and an insider that holds the secret, are each refused or bounded
//! on their own connections, and the run's processes still meet and keep what they wrote. Each
//! test replays one attack of issues 46 and 57. Every loop here is bounded in count and time.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use xtrain::cluster::auth::{random_token, Secret};
use xtrain::cluster::handshake::{self, Failed, Opened};
use xtrain::cluster::server::{Config, StoreServer};
use xtrain::cluster::store::{Credentials, Store};
use xtrain::cluster::wire::{StoreError, MAGIC, PROTOCOL};

/// The run's secret in these tests (a random one, `xtrain run-token`'s form).
const TOKEN: &str = "5b1e0c9a7f24d38e61a0b9c4f7d2e85a3c6019bf4e7d28a5c1f0b36e9d4a7c20";

fn secret(text: &str) -> Secret {
    Secret::from_bytes(text.as_bytes(), "test").unwrap()
}

fn the_secret() -> Secret {
    secret(TOKEN)
}

fn another_secret() -> Secret {
    secret(&random_token().unwrap())
}

/// A store for a run of 2 processes holding `s`, on `at` (port 0: any), with `config`'s
/// limits changed by `limits`.
fn serve_with(at: &str, s: Secret, limits: impl FnOnce(&mut Config)) -> (StoreServer, String) {
    let listener = TcpListener::bind(at).unwrap();
    let mut config = Config::new(2, s);
    limits(&mut config);
    let server = StoreServer::serve(listener, config).unwrap();
    let address = server.address().to_string();
    (server, address)
}

fn serve_on(at: &str, s: Secret) -> (StoreServer, String) {
    serve_with(at, s, |_| {})
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
        one.barrier(&theirs, Duration::from_secs(20))
    });
    zero.barrier(name, Duration::from_secs(20)).unwrap();
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

/// A raw connection that passed the handshake as `process` with `s`: its sealed halves.
fn authenticated(address: &str, process: u32, s: &Secret) -> Opened {
    let stream = TcpStream::connect(address).unwrap();
    let soon = Instant::now() + Duration::from_secs(10);
    let opened = handshake::open(&stream, s, process, soon).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    opened
}

/// Send `bytes` sealed.
fn send(o: &mut Opened, bytes: &[u8]) -> std::io::Result<()> {
    o.sealer.write_all(bytes)?;
    o.sealer.flush()
}

/// What the store answered (its reply header's text), or why nothing came.
fn reply(o: &mut Opened) -> String {
    let mut n = [0u8; 4];
    if let Err(e) = o.opener.read_exact(&mut n) {
        return format!("closed: {e}");
    }
    let mut header = vec![0u8; u32::from_le_bytes(n) as usize];
    o.opener.read_exact(&mut header).unwrap();
    String::from_utf8(header).unwrap()
}

/// A TCP connection to `to` from the loopback address `from` (127.0.0.2: another host, as the
/// store sees it).
fn connect_from(from: Ipv4Addr, to: SocketAddr) -> std::io::Result<TcpStream> {
    use std::os::fd::FromRawFd;
    let SocketAddr::V4(to) = to else {
        panic!("{to} is not IPv4")
    };
    let addr = |ip: Ipv4Addr, port: u16| libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(ip).to_be(),
        },
        sin_zero: [0; 8],
    };
    let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: plain socket calls on a descriptor this function owns; each address is a valid
    // sockaddr_in of `len` bytes; the descriptor is handed to a TcpStream once connected, or
    // closed.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let src = addr(from, 0);
        let dst = addr(*to.ip(), to.port());
        if libc::bind(fd, (&src as *const libc::sockaddr_in).cast(), len) != 0
            || libc::connect(fd, (&dst as *const libc::sockaddr_in).cast(), len) != 0
        {
            let e = std::io::Error::last_os_error();
            libc::close(fd);
            return Err(e);
        }
        Ok(TcpStream::from_raw_fd(fd))
    }
}

/// Another build's greeting, JSON and plain garbage, and a stranger's first message under
/// another secret: each is refused on its connection with a few fixed bytes that say nothing
/// of the run (not its size), and the run goes on.
#[test]
fn a_stranger_learns_nothing_and_ends_nothing() {
    let (_server, address) = serve();
    let (zero, _one) = processes(&address);
    zero.put("kept/0", b"v").unwrap();
    for hello in [
        [&MAGIC[..], &(PROTOCOL + 1).to_le_bytes()].concat(),
        br#"{"op":"put","key":"xtrain/run/settings/1","value":[1]}"#.to_vec(),
        b"GET / HTTP/1.1\r\n\r\n".to_vec(),
        [&MAGIC[..], &PROTOCOL.to_le_bytes(), &[48, 0], &[7u8; 48]].concat(),
    ] {
        let mut s = TcpStream::connect(&address).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(&hello).unwrap();
        let mut heard = Vec::new();
        let _ = s.read_to_end(&mut heard);
        let text = String::from_utf8_lossy(&heard);
        assert!(
            heard.len() < 200,
            "{} bytes told to a stranger",
            heard.len()
        );
        assert!(!text.contains('2') && !text.contains("processes"), "{text}");
    }
    still_meet(&address, "after-greetings");
    assert_eq!(zero.try_get("kept/0").unwrap(), Some(b"v".to_vec()));
}

/// Without the secret, or with another, a process can neither join, read nor write; a fake
/// coordinator without it is refused by the real process, whether it refuses or pretends.
#[test]
fn no_secret_or_a_wrong_one_is_refused_both_ways() {
    let (_server, address) = serve();
    let (zero, _one) = processes(&address);
    zero.put("settings/0", b"{\"data\": \"/secret/path\"}")
        .unwrap();
    for wrong in [Secret::none(), another_secret()] {
        let e = match connect(&address, 1, wrong) {
            Err(e) => e.to_string(),
            Ok(_) => panic!("a process without the run's secret got in"),
        };
        assert!(e.contains("does not hold the run's secret"), "{e}");
    }
    // A fake coordinator with another secret refuses the process's first message.
    let (_fake, fake_address) = serve_on("127.0.0.1:0", another_secret());
    let e = match connect(&fake_address, 1, the_secret()) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("a fake coordinator was taken"),
    };
    assert!(e.contains("does not hold the run's secret"), "{e}");
    // One that pretends (says go on, then sends bytes of its own) fails its proof.
    let liar = TcpListener::bind("127.0.0.1:0").unwrap();
    let liar_at = liar.local_addr().unwrap().to_string();
    let lying = std::thread::spawn(move || {
        let (mut s, _) = liar.accept().unwrap();
        let mut hello = [0u8; 12 + 2 + 52];
        s.read_exact(&mut hello).unwrap();
        let mut out = [&MAGIC[..], &PROTOCOL.to_le_bytes(), &[0u8], &[48, 0]].concat();
        out.extend([9u8; 48]);
        s.write_all(&out).unwrap();
        std::thread::sleep(Duration::from_millis(500));
    });
    let e = match connect(&liar_at, 1, the_secret()) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("a lying coordinator was taken"),
    };
    assert!(e.contains("does not prove the run's secret"), "{e}");
    lying.join().unwrap();
    still_meet(&address, "after-secrets");
}

/// A relay between process 1 and the store: what it records of a whole session (both ways)
/// shows no settings, paths or key names; its bytes injected or changed after the handshake
/// end that connection (said in the store's log), and nothing it sent is taken.
#[test]
fn a_relay_reads_nothing_and_cannot_inject_or_rewrite() {
    #[derive(Clone, Copy, PartialEq)]
    enum Mode {
        Pass,
        Inject,
        Flip,
    }
    let (server, address) = serve();
    let zero = connect(&address, 0, the_secret()).unwrap();
    for (k, mode) in [Mode::Pass, Mode::Inject, Mode::Flip]
        .into_iter()
        .enumerate()
    {
        let relay = TcpListener::bind("127.0.0.1:0").unwrap();
        let relay_at = relay.local_addr().unwrap().to_string();
        let upstream = address.clone();
        let recorded = Arc::new(Mutex::new(Vec::new()));
        let record = recorded.clone();
        let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let finished = done.clone();
        let relaying = std::thread::spawn(move || {
            let mut conns = Vec::new();
            relay.set_nonblocking(true).unwrap();
            let until = Instant::now() + Duration::from_secs(10);
            // Each connection the process opens goes through, relayed both ways.
            while Instant::now() < until && !done.load(std::sync::atomic::Ordering::SeqCst) {
                let Ok((client, _)) = relay.accept() else {
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                };
                client.set_nonblocking(false).unwrap();
                let server = TcpStream::connect(&upstream).unwrap();
                let (mut c2, mut s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
                let back = record.clone();
                conns.push(std::thread::spawn(move || {
                    let mut buf = [0u8; 65536];
                    while let Ok(n) = s2.read(&mut buf) {
                        if n == 0 || c2.write_all(&buf[..n]).is_err() {
                            break;
                        }
                        back.lock().unwrap().extend(&buf[..n]);
                    }
                    // The store closed: so does the relay, toward the process.
                    let _ = c2.shutdown(std::net::Shutdown::Both);
                }));
                let (mut client, mut server) = (client, server);
                let forth = record.clone();
                conns.push(std::thread::spawn(move || {
                    let mut buf = [0u8; 65536];
                    let mut sent = 0usize;
                    // Past the greeting and first message (66 bytes) and the proof record, a
                    // few bytes into the first request's sealed record.
                    let after = 12 + 2 + 52 + 2 + 36 + 2 + 5;
                    let mut meddled = false;
                    while let Ok(n) = client.read(&mut buf) {
                        if n == 0 {
                            break;
                        }
                        let chunk = &mut buf[..n];
                        if !meddled && sent + n > after && mode != Mode::Pass {
                            meddled = true;
                            if mode == Mode::Flip {
                                chunk[after.saturating_sub(sent).min(n - 1)] ^= 0x20;
                            } else {
                                let put = frame(
                                    r#"{"op":"put","key":"xtrain/attack/settings/1"}"#,
                                    6,
                                    b"forged",
                                );
                                let mut forged = (put.len() as u16 + 16).to_le_bytes().to_vec();
                                forged.extend(&put);
                                forged.extend([0u8; 16]);
                                if server.write_all(&forged).is_err() {
                                    break;
                                }
                            }
                        }
                        forth.lock().unwrap().extend(&chunk[..]);
                        sent += n;
                        if server.write_all(chunk).is_err() {
                            break;
                        }
                    }
                    let _ = server.shutdown(std::net::Shutdown::Both);
                }));
            }
            for c in conns {
                let _ = c.join();
            }
        });
        let me = Credentials {
            process: 1,
            secret: the_secret(),
        };
        let settings =
            br#"{"host": "node-1", "settings": {"data": "/data/secret/path.jsonl", "lr": 0.0002}}"#;
        let through = Store::connect(&relay_at, "attack", me, Duration::from_secs(5)).unwrap();
        let key = format!("gather/{k}/0/1");
        let put = through.put(&key, settings);
        match mode {
            Mode::Pass => {
                put.unwrap();
                let back = through.get(&key, Duration::from_secs(5)).unwrap();
                assert_eq!(back, settings);
            }
            _ => {
                // The connection ends; nothing forged or changed is in the store.
                assert!(matches!(put, Err(StoreError::Lost(_))), "{put:?}");
                assert_eq!(zero.try_get(&key).unwrap(), None);
                assert_eq!(zero.try_get("settings/1").unwrap(), None);
            }
        }
        drop(through);
        finished.store(true, std::sync::atomic::Ordering::SeqCst);
        relaying.join().unwrap();
        let wire = recorded.lock().unwrap().clone();
        let seen = String::from_utf8_lossy(&wire);
        assert!(
            wire.len() > settings.len(),
            "the relay saw {} bytes",
            wire.len()
        );
        for word in [
            "settings",
            "/data/secret",
            "xtrain/attack",
            "gather",
            "node-1",
            "\"op\"",
        ] {
            assert!(!seen.contains(word), "the relay read {word:?}");
        }
    }
    let frames = server.refusals().get("frame").map_or(0, |r| r.count);
    assert!(frames >= 2, "the store said nothing of the changed frames");
}

/// A first message recorded through a relay and replayed earns its sender nothing: the store
/// remembers the fresh key of every first message that opened, and closes a replay unanswered
/// (it would hold a handshake slot that newcomers do not crowd out).
#[test]
fn a_replayed_handshake_is_refused() {
    let (server, address) = serve();
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
        let (mut client, mut server) = (client, server);
        // The greeting, the first message and the proof record.
        while sent.len() < 12 + 2 + 52 + 2 + 36 {
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
    // The whole recording at once, the proof record too.
    replay.write_all(&recorded).unwrap();
    let mut heard = Vec::new();
    let _ = replay.read_to_end(&mut heard);
    assert!(heard.is_empty(), "{} bytes told to a replayer", heard.len());
    std::thread::sleep(Duration::from_millis(200));
    assert!(server.refusals().contains_key("replayed"));
    still_meet(&address, "after-replay");
}

/// A flood of connections from 127.0.0.2 (another host, to the store) keeps no process out:
/// process 1 joins from 127.0.0.1 as fast as without it, again and again while the flood
/// goes on.
#[test]
fn a_flood_from_one_address_keeps_no_process_out() {
    let (_server, address) = serve();
    let at: SocketAddr = address.parse().unwrap();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let opened = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let flooders: Vec<_> = (0..3)
        .map(|_| {
            let (stop, opened) = (stop.clone(), opened.clone());
            std::thread::spawn(move || {
                let until = Instant::now() + Duration::from_secs(30);
                let mut held = std::collections::VecDeque::new();
                for _ in 0..200_000 {
                    if stop.load(std::sync::atomic::Ordering::SeqCst) || Instant::now() > until {
                        break;
                    }
                    if let Ok(mut s) = connect_from(Ipv4Addr::new(127, 0, 0, 2), at) {
                        let _ = s.write_all(&MAGIC[..4]);
                        held.push_back(s);
                        opened.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    }
                    if held.len() > 200 {
                        held.pop_front();
                    }
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    let mut took = Vec::new();
    for _ in 0..5 {
        let t0 = Instant::now();
        let one = connect(&address, 1, the_secret()).unwrap();
        one.put("alive/1", b"1").unwrap();
        took.push(t0.elapsed());
        drop(one);
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    for f in flooders {
        f.join().unwrap();
    }
    let flood = opened.load(std::sync::atomic::Ordering::SeqCst);
    eprintln!("process 1 joined in {took:?} during a flood of {flood} connections from 127.0.0.2");
    assert!(flood > 300, "the flood opened only {flood} connections");
    for t in &took {
        assert!(
            *t < Duration::from_secs(3),
            "a join took {t:?} under the flood"
        );
    }
}

/// A store's handshake is bounded by the process's --init-timeout, however slowly a (fake)
/// store trickles its answer.
#[test]
fn init_timeout_bounds_a_slow_handshake() {
    let slow = TcpListener::bind("127.0.0.1:0").unwrap();
    let at = slow.local_addr().unwrap().to_string();
    let trickle = std::thread::spawn(move || {
        let (mut s, _) = slow.accept().unwrap();
        let mut answer = [&MAGIC[..], &PROTOCOL.to_le_bytes(), &[0u8], &[48, 0]].concat();
        answer.extend([1u8; 48]);
        for b in answer {
            if s.write_all(&[b]).is_err() {
                break;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    });
    let t0 = Instant::now();
    let me = Credentials {
        process: 1,
        secret: the_secret(),
    };
    let got = Store::connect(&at, "attack", me, Duration::from_secs(1));
    assert!(got.is_err());
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    trickle.join().unwrap();
}

/// The peak resident memory of this test process (VmHWM), in bytes.
fn peak_memory() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
    let kb: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kb * 1024
}

/// A put declaring a 4 GiB value (a few bytes sent) is refused before anything is allocated,
/// even from a process that holds the secret; the connection closes and the run goes on.
#[test]
fn a_declared_4_gib_value_allocates_nothing() {
    let (_server, address) = serve();
    let before = peak_memory();
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut s = authenticated(&address, 1, &the_secret());
        let put = r#"{"op":"put","key":"xtrain/attack/gather/0/1/1"}"#;
        send(&mut s, &frame(put, 4 << 30, &[0u8; 1])).unwrap();
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

/// A process that holds the secret is bounded too: its keys' bytes (not only values') count
/// toward its share; puts it declared but never sends take only its share; its connections are
/// capped apart from the others'; a key it wrote stays written (it cannot delete it, and after
/// process 0 deleted it no one writes it again); a plugin's key belongs to its first writer.
#[test]
fn an_insider_is_bounded() {
    let small = |c: &mut Config| {
        c.limits.share = 256 << 10;
        c.limits.total = 1 << 20;
        c.limits.value = 128 << 10;
        c.limits.connections = 4;
    };
    // Empty values under 1000-byte keys: refused once the keys fill its share.
    let (_server, address) = serve_with("127.0.0.1:0", the_secret(), small);
    let (zero, _) = processes(&address);
    let long = "k".repeat(990);
    let mut taken = 0;
    let one = connect(&address, 1, the_secret()).unwrap();
    let refused = (0..1000).find_map(|i| match one.put(&format!("{long}{i}/1"), b"") {
        Ok(()) => {
            taken += 1;
            None
        }
        Err(e) => Some(e),
    });
    let e = refused.expect("keys without values were never refused");
    assert!(e.to_string().contains("share of the store"), "{e}");
    assert!(
        taken < 300,
        "{taken} keys of 1000 bytes taken in a share of 256 KiB"
    );
    // Barriers under names of its own count toward its share as keys do.
    let one = connect(&address, 1, the_secret()).unwrap();
    let e = (0..100)
        .find_map(
            |i| match one.barrier(&format!("b{i}"), Duration::from_millis(1)) {
                Err(StoreError::DeadlineExceeded { .. }) | Ok(()) => None,
                Err(e) => Some(e),
            },
        )
        .unwrap();
    assert!(e.to_string().contains("share of the store"), "{e}");
    zero.put("settings/0", b"{}").unwrap();

    // Declared and never sent: two hold its share, the third is refused; process 0 is not.
    let (_server, address) = serve_with("127.0.0.1:0", the_secret(), small);
    let mut declared = Vec::new();
    let refused = (0..4).find(|i| {
        let mut s = authenticated(&address, 1, &the_secret());
        let put = format!(r#"{{"op":"put","key":"xtrain/attack/gather/{i}/1/1"}}"#);
        send(&mut s, &frame(&put, 100 << 10, &[])).unwrap();
        s.sealer
            .get_ref()
            .set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        let mut one_byte = [0u8; 1];
        let answered = s.opener.read(&mut one_byte).is_ok();
        declared.push(s);
        answered
    });
    assert_eq!(refused, Some(2), "puts declared and never sent");
    let zero = connect(&address, 0, the_secret()).unwrap();
    zero.put("settings/0", &[7u8; 100 << 10]).unwrap();

    // Its connections: at most 4 open at once; process 0 still connects.
    let (_server, address) = serve_with("127.0.0.1:0", the_secret(), small);
    let extra: Vec<_> = (0..6)
        .map(|_| {
            let stream = TcpStream::connect(&address).unwrap();
            let soon = Instant::now() + Duration::from_secs(5);
            handshake::open(&stream, &the_secret(), 1, soon).map(|o| (stream, o))
        })
        .collect();
    let busy = extra
        .iter()
        .filter(|r| matches!(r, Err(Failed::Busy)))
        .count();
    assert_eq!(busy, 2, "extra connections of process 1 told busy");
    connect(&address, 0, the_secret()).unwrap();

    // A key it wrote stays written; a plugin's key is its first writer's.
    let (_server, address) = serve();
    let (zero, one) = processes(&address);
    one.put("gather/9/1/1", b"mine").unwrap();
    assert!(one.delete("gather/9/1/1").is_err());
    let one = connect(&address, 1, the_secret()).unwrap();
    zero.delete("gather/9/1/1").unwrap();
    let e = one.put("gather/9/1/1", b"other").unwrap_err();
    assert!(e.to_string().contains("written once"), "{e}");
    let one = connect(&address, 1, the_secret()).unwrap();
    one.scope("pjrt/cuda").put("nccl_id", b"one's").unwrap();
    let e = zero
        .scope("pjrt/cuda")
        .put("nccl_id", b"zero's")
        .unwrap_err();
    assert!(e.to_string().contains("process 1 wrote it first"), "{e}");
    let zero = connect(&address, 0, the_secret()).unwrap();
    assert!(zero.scope("pjrt/cuda").delete("nccl_id").is_err());
    let zero = connect(&address, 0, the_secret()).unwrap();
    assert_eq!(
        zero.scope("pjrt/cuda").try_get("nccl_id").unwrap(),
        Some(b"one's".to_vec())
    );
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
    let join = r#"{"op":"join","host":"slow","silent_ms":0}"#;
    send(&mut slow, &frame(join, 0, &[])).unwrap();
    // Heartbeats whose answers it never reads, many MB of them.
    let beat = frame(r#"{"op":"heartbeat"}"#, 0, &[]);
    slow.sealer
        .get_ref()
        .set_write_timeout(Some(Duration::from_secs(2)))
        .unwrap();
    for _ in 0..20_000 {
        if send(&mut slow, &beat).is_err() {
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
/// refused (once proven); the real process 1's session stays.
#[test]
fn a_duplicate_join_and_an_id_outside_the_run_are_refused() {
    let (_server, address) = serve();
    let (zero, one) = processes(&address);
    // A second process 1 that connected before the first joined: its join is refused.
    let early = connect(&address, 1, the_secret()).unwrap();
    let _first = one.watch(None, |_| {}).unwrap();
    let e = match early.watch(None, |_| {}) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("a second join as process 1 was taken"),
    };
    assert!(
        e.contains("process 1 joined the run from 127.0.0.1:"),
        "{e}"
    );
    assert!(e.matches("127.0.0.1:").count() >= 2, "{e}");
    // One that comes after is refused at its handshake, naming both addresses too.
    let e = match connect(&address, 1, the_secret()) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("a second process 1 got in after the first joined"),
    };
    assert!(
        e.contains("process 1 joined the run from 127.0.0.1:")
            && e.contains("does not carry its session's ticket"),
        "{e}"
    );
    assert!(e.matches("127.0.0.1:").count() >= 3, "{e}");
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
    for key in ["settings/0", "gather/3/0/0", "settings"] {
        let e = one.put(key, b"forged").unwrap_err();
        assert!(matches!(e, StoreError::Refused(_)), "{key}: {e}");
    }
    let one = connect(&address, 1, the_secret()).unwrap();
    one.put("gather/3/1/1", b"mine").unwrap();
    // The same bytes again change nothing (a retried put).
    one.put("gather/3/1/1", b"mine").unwrap();
    let e = one.put("gather/3/1/1", b"changed").unwrap_err();
    assert!(e.to_string().contains("is written once"), "{e}");
    assert_eq!(zero.try_get("settings/0").unwrap(), Some(b"{}".to_vec()));
    let one = connect(&address, 1, the_secret()).unwrap();
    assert_eq!(one.try_get("gather/3/1/1").unwrap(), Some(b"mine".to_vec()));
    // Only process 0 (the gather's reader) forgets a key.
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
    let soon = Instant::now() + Duration::from_secs(10);
    match handshake::open(&s, &the_secret(), 7, soon) {
        Err(Failed::Refused(why)) => assert!(why.contains("outside this run of 2"), "{why}"),
        Err(other) => panic!("{other:?}"),
        Ok(_) => panic!("process 7 of 2 was taken"),
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
    let at: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let server = StoreServer::bind(at, Config::new(2, the_secret())).unwrap();
    let port = server.address().port();
    assert!(TcpStream::connect(("127.0.0.1", port)).is_ok());
    let elsewhere = TcpStream::connect(("127.0.0.2", port));
    assert!(elsewhere.is_err(), "the store answered on 127.0.0.2:{port}");
}

/// A passphrase is refused as the run's secret, saying how to make one; `xtrain run-token`'s
/// secret is taken; the binary refuses a run started with a passphrase before it serves
/// anything.
#[test]
fn a_passphrase_is_refused_and_a_random_secret_taken() {
    for phrase in ["capitals-training", "correct horse battery staple 2026"] {
        let e = Secret::from_bytes(phrase.as_bytes(), "XTRAIN_RUN_TOKEN")
            .unwrap_err()
            .to_string();
        assert!(e.contains("xtrain run-token") && !e.contains(phrase), "{e}");
    }
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_xtrain"))
        .arg("run-token")
        .output()
        .unwrap();
    assert!(out.status.success());
    let token = String::from_utf8(out.stdout).unwrap();
    assert_eq!(token.trim().len(), 64, "{token}");
    Secret::from_bytes(token.as_bytes(), "xtrain run-token").unwrap();
    let flags = xtrain::cluster::launch::LaunchFlags {
        num_processes: Some(2),
        process_id: Some(1),
        coordinator: Some("127.0.0.1:9".into()),
        ..Default::default()
    };
    let env = |k: &str| (k == "XTRAIN_RUN_TOKEN").then(|| "capitals-training".to_string());
    let e = xtrain::cluster::launch::detect(&flags, &env)
        .unwrap_err()
        .to_string();
    assert!(e.contains("not a random secret"), "{e}");
}

/// `--coordinator-bind 0.0.0.0` without a secret is refused (the store would serve every
/// interface), though `--coordinator` is on loopback; so is a bind that resolves to a network
/// address.
#[test]
fn the_wildcard_bind_without_a_secret_is_refused() {
    let flags = |bind: &str| xtrain::cluster::launch::LaunchFlags {
        num_processes: Some(2),
        process_id: Some(0),
        coordinator: Some("127.0.0.1:18476".into()),
        coordinator_bind: Some(bind.into()),
        ..Default::default()
    };
    let none = |_: &str| None;
    for bind in ["0.0.0.0", "0.0.0.0:18477", "[::]"] {
        let e = xtrain::cluster::launch::detect(&flags(bind), &none)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("(--coordinator-bind) with no secret"),
            "{bind}: {e}"
        );
    }
    // With the secret, the same bind is taken.
    let token = |k: &str| (k == "XTRAIN_RUN_TOKEN").then(|| TOKEN.to_string());
    xtrain::cluster::launch::detect(&flags("0.0.0.0"), &token).unwrap();
}

/// A process started with XTRAIN_RUN_TOKEN starts programs without it: the plugin survey's
/// Python (a script here that writes its environment down) never sees the secret.
#[test]
fn a_childs_environment_holds_no_secret() {
    let dir = std::env::temp_dir().join(format!("xtrain-child-env-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let seen = dir.join("environment");
    let python = dir.join("python3");
    std::fs::write(&python, format!("#!/bin/sh\nenv >> '{}'\n", seen.display())).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&python, std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_xtrain"))
        .arg("plugins")
        .env("XTRAIN_RUN_TOKEN", TOKEN)
        .env("XTRAIN_PYTHON", &python)
        .env("XTRAIN_TEST_MARK", "child-of-xtrain")
        .output()
        .unwrap();
    let env = std::fs::read_to_string(&seen).unwrap_or_default();
    assert!(
        env.contains("XTRAIN_TEST_MARK=child-of-xtrain"),
        "the child never ran: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !env.contains(TOKEN) && !env.contains("XTRAIN_RUN_TOKEN"),
        "{env}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Once process 1 joined the run, its id is its own: another holder of the secret that claims
/// it (a connection made before the join, or a new one) is refused, as is one that claims
/// process 0 to delete what others wrote; the real processes go on through connections that
/// carry their session's ticket. (An insider could otherwise write a joined process's keys,
/// shards of a gather still to come among them, and, as process 0, delete any key.)
#[test]
fn a_joined_process_id_is_its_ticket_holders_alone() {
    let (_server, address) = serve();
    let (zero, one) = processes(&address);
    // Another holder of the secret, connected as process 1 before process 1 joins.
    let early = connect(&address, 1, the_secret()).unwrap();
    let _zero_session = zero.watch(None, |_| {}).unwrap();
    let _one_session = one.watch(None, |_| {}).unwrap();
    one.put("gather/0/0/1", b"real").unwrap();
    zero.put("settings/0", b"{}").unwrap();
    let e = early.put("gather/1/0/1", b"forged").unwrap_err();
    assert!(
        matches!(&e, StoreError::Refused(m) if m.contains("does not carry its session's ticket")),
        "{e}"
    );
    for id in [0, 1] {
        let e = match connect(&address, id, the_secret()) {
            Err(e) => e.to_string(),
            Ok(_) => panic!("a second process {id} got in after the first joined"),
        };
        assert!(
            e.contains(&format!("process {id} joined the run from 127.0.0.1:")),
            "{e}"
        );
    }
    assert_eq!(zero.try_get("gather/1/0/1").unwrap(), None);
    assert_eq!(
        one.get("gather/0/0/1", Duration::from_secs(5)).unwrap(),
        b"real"
    );
    assert_eq!(one.try_get("settings/0").unwrap(), Some(b"{}".to_vec()));
    // Process 0 deletes what was read; a delete of a key never written leaves nothing behind
    // (deletes of keys that never were cost the store nothing).
    zero.delete("gather/0/0/1").unwrap();
    let e = one.put("gather/0/0/1", b"again").unwrap_err();
    assert!(e.to_string().contains("written once"), "{e}");
    zero.delete("gather/5/0/1").unwrap();
    one.put("gather/5/0/1", b"later").unwrap();
}

/// The greeting and first message a process sends on connecting as `process` with `s`, made by
/// hand, and the handshake's state to go on with.
fn first_message(s: &Secret, process: u32) -> (snow::HandshakeState, Vec<u8>) {
    let greeting = [&MAGIC[..], &PROTOCOL.to_le_bytes()].concat();
    let mut hs = snow::Builder::new(xtrain::cluster::channel::NOISE.parse().unwrap())
        .psk(0, &s.key())
        .unwrap()
        .prologue(&greeting)
        .unwrap()
        .build_initiator()
        .unwrap();
    let mut m = [0u8; 256];
    let n = hs.write_message(&process.to_le_bytes(), &mut m).unwrap();
    let mut hello = greeting;
    hello.extend((n as u16).to_le_bytes());
    hello.extend(&m[..n]);
    (hs, hello)
}

/// `threads` threads open connections from `sources` loopback addresses (127.x.y.7, each a host
/// to the store) as fast as they can, each sending a few bytes, until `stop` (or 30 s at most),
/// counting them in `opened`.
fn flood(
    at: SocketAddr,
    sources: usize,
    threads: usize,
    stop: Arc<std::sync::atomic::AtomicBool>,
    opened: Arc<std::sync::atomic::AtomicUsize>,
) -> Vec<std::thread::JoinHandle<()>> {
    use std::sync::atomic::Ordering::SeqCst;
    (0..threads)
        .map(|t| {
            let (stop, opened) = (stop.clone(), opened.clone());
            std::thread::spawn(move || {
                let until = Instant::now() + Duration::from_secs(30);
                let mut held = std::collections::VecDeque::new();
                for i in 0..200_000usize {
                    if stop.load(SeqCst) || Instant::now() > until {
                        break;
                    }
                    let k = (i * threads + t) % sources;
                    let from = Ipv4Addr::new(127, 1 + (k / 250) as u8, (k % 250) as u8, 7);
                    if let Ok(mut s) = connect_from(from, at) {
                        let _ = s.write_all(&MAGIC[..4]);
                        held.push_back(s);
                        opened.fetch_add(1, SeqCst);
                    }
                    if held.len() > 300 {
                        held.pop_front();
                    }
                }
            })
        })
        .collect()
}

/// A flood from hundreds of addresses (a stranger with a whole IPv6 prefix, or any local user
/// on loopback) crowds out no process: a handshake whose first message opened under the secret
/// is never closed for a newcomer while a stranger's is there to close, one closed before that
/// is told "busy" (its process tries again), and process 1 joins as fast as without it. Each
/// address holds few handshakes, so fairness per address alone made it first come, first
/// closed: a real handshake lasted only until 64 newer connections came.
#[test]
fn a_flood_from_many_addresses_crowds_out_no_process() {
    let (_server, address) = serve();
    let at: SocketAddr = address.parse().unwrap();
    // A process's handshake, its first message sent, its proof not yet.
    let mut proven = TcpStream::connect(at).unwrap();
    proven
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let (mut hs, hello) = first_message(&the_secret(), 1);
    proven.write_all(&hello).unwrap();
    let mut head = [0u8; 12 + 1 + 2];
    proven.read_exact(&mut head).unwrap();
    assert_eq!(head[12], 0, "the store did not say go on");
    let mut second = vec![0u8; u16::from_le_bytes([head[13], head[14]]) as usize];
    proven.read_exact(&mut second).unwrap();
    // A stranger's connection that sent nothing yet, from the same address.
    let mut idle = TcpStream::connect(at).unwrap();
    idle.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    std::thread::sleep(Duration::from_millis(100));
    // A flood from 200 addresses; once it opened 600 connections (the old rule closed any
    // handshake 64 newer ones came after), process 1 again and again while it goes on.
    use std::sync::atomic::Ordering::SeqCst;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let opened = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let flooders = flood(at, 200, 2, stop.clone(), opened.clone());
    let t0 = Instant::now();
    while opened.load(SeqCst) < 600 && t0.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut took = Vec::new();
    for _ in 0..5 {
        let t0 = Instant::now();
        let one = connect(&address, 1, the_secret()).unwrap();
        one.put("alive/1", b"1").unwrap();
        took.push(t0.elapsed());
    }
    stop.store(true, SeqCst);
    for f in flooders {
        f.join().unwrap();
    }
    let flooded = opened.load(SeqCst);
    eprintln!(
        "process 1 joined in {took:?} during a flood of {flooded} connections from 200 addresses"
    );
    assert!(
        flooded >= 600,
        "the flood opened only {flooded} connections"
    );
    for t in &took {
        assert!(
            *t < Duration::from_secs(3),
            "a join took {t:?} under the flood"
        );
    }
    // The stranger's idle connection was closed for a newcomer, told "busy".
    let mut heard = Vec::new();
    let _ = idle.read_to_end(&mut heard);
    assert_eq!(
        heard,
        [&MAGIC[..], &PROTOCOL.to_le_bytes(), &[1u8]].concat()
    );
    // The process's handshake outlived the flood: it proves its keys and is taken.
    hs.read_message(&second, &mut [0u8; 256]).unwrap();
    let keys = hs.into_stateless_transport_mode().unwrap();
    let mut sealed = [0u8; 64];
    let n = keys
        .write_message(0, b"xtrain-store/confirm", &mut sealed)
        .unwrap();
    proven.write_all(&(n as u16).to_le_bytes()).unwrap();
    proven.write_all(&sealed[..n]).unwrap();
    let mut len = [0u8; 2];
    proven.read_exact(&mut len).unwrap();
    let mut verdict = vec![0u8; u16::from_le_bytes(len) as usize];
    proven.read_exact(&mut verdict).unwrap();
    let mut plain = [0u8; 64];
    let n = keys.read_message(0, &verdict, &mut plain).unwrap();
    assert_eq!(
        &plain[..n.min(1)],
        [3u8],
        "the store did not take the process"
    );
}

/// A relay that changes one byte inside a put's value (its second sealed record): the put is
/// refused saying the record did not open, the store counts (and says) a changed frame, and
/// nothing is taken. It was answered "the value was cut short", and said nowhere.
#[test]
fn a_changed_record_inside_a_value_is_said_and_taken_for_nothing() {
    let (server, address) = serve();
    let zero = connect(&address, 0, the_secret()).unwrap();
    let relay = TcpListener::bind("127.0.0.1:0").unwrap();
    let relay_at = relay.local_addr().unwrap().to_string();
    let upstream = address.clone();
    let relaying = std::thread::spawn(move || {
        let (client, _) = relay.accept().unwrap();
        let server = TcpStream::connect(upstream).unwrap();
        let (mut c2, mut s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
        std::thread::spawn(move || {
            let _ = std::io::copy(&mut s2, &mut c2);
            let _ = c2.shutdown(std::net::Shutdown::Both);
        });
        let (mut client, mut server) = (client, server);
        let mut buf = [0u8; 65536];
        let mut sent = 0usize;
        // 100 KB into the stream: inside the value's second record.
        let at = 100_000;
        while let Ok(n) = client.read(&mut buf) {
            if n == 0 {
                break;
            }
            if sent <= at && at < sent + n {
                buf[at - sent] ^= 1;
            }
            sent += n;
            if server.write_all(&buf[..n]).is_err() {
                break;
            }
        }
        let _ = server.shutdown(std::net::Shutdown::Both);
    });
    let me = Credentials {
        process: 1,
        secret: the_secret(),
    };
    let through = Store::connect(&relay_at, "attack", me, Duration::from_secs(5)).unwrap();
    let e = through
        .put("gather/0/0/1", &vec![5u8; 200_000])
        .unwrap_err();
    assert!(
        matches!(&e, StoreError::Refused(m) if m.contains("a sealed record did not open")),
        "{e}"
    );
    drop(through);
    relaying.join().unwrap();
    assert_eq!(zero.try_get("gather/0/0/1").unwrap(), None);
    let frames = server.refusals().get("frame").map_or(0, |r| r.count);
    assert_eq!(frames, 1, "the store did not count the changed record");
    still_meet(&address, "after-a-changed-value");
}

/// What a process that holds the secret sends reaches process 0's log escaped: an operation
/// named with terminal escapes (which serde's error quotes) is said as `\u{1b}`, never as the
/// escape itself. And process 0's environment, as /proc shows it to the user's other programs,
/// no longer holds the XTRAIN_RUN_TOKEN it was started with.
#[test]
fn a_peers_bytes_reach_process_0s_log_escaped() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-llama3");
    let dir = std::env::temp_dir().join(format!("xtrain-escape-{}", std::process::id()));
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let address = format!("127.0.0.1:{port}");
    let zero = std::process::Command::new(env!("CARGO_BIN_EXE_xtrain"))
        .args(["train", "--model"])
        .arg(root.join("model"))
        .arg("--data")
        .arg(root.join("inputs.safetensors"))
        .arg("--out")
        .arg(&dir)
        .args(["--lora-r", "8", "--steps", "1", "--plugin", "cpu"])
        .args(["--num-processes", "2", "--process-id", "0"])
        .args(["--init-timeout", "4", "--coordinator", &address])
        .env("XTRAIN_RUN_TOKEN", TOKEN)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    let mut s = loop {
        let stream = TcpStream::connect(&address);
        if let Ok(stream) = stream {
            let soon = Instant::now() + Duration::from_secs(5);
            if let Ok(o) = handshake::open(&stream, &the_secret(), 1, soon) {
                break o;
            }
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "process 0 never served"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    // Its environment as the system shows it to the user's other programs holds no secret.
    let environ = std::fs::read(format!("/proc/{}/environ", zero.id())).unwrap();
    assert!(
        !String::from_utf8_lossy(&environ).contains(TOKEN),
        "process 0's /proc environ holds the secret"
    );
    let evil = "{\"op\":\"\\u001b[2J\\u001b]0;owned\\u0007\"}";
    send(&mut s, &frame(evil, 0, &[])).unwrap();
    let out = zero.wait_with_output().unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        said.contains("closed the connection of process 1"),
        "{said}"
    );
    assert!(
        !said.contains('\u{1b}') && !said.contains('\u{7}'),
        "{said:?}"
    );
    assert!(said.contains("\\u{1b}[2J"), "{said}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Random bytes in a file (`head -c 16 /dev/urandom`) are taken whole: a whitespace byte at
/// either end was trimmed, leaving 120 bits, and one file in 22 was refused. `xxd -p`'s hex
/// over two lines is the same secret as on one.
#[test]
fn random_bytes_and_hex_over_lines_are_taken() {
    let mut raw = [0u8; 16];
    for i in 0..2000 {
        getrandom::fill(&mut raw).unwrap();
        // Every fifth one with whitespace bytes at its ends, as one in 22 has by chance.
        if i % 5 == 0 {
            raw[0] = b'\n';
            raw[15] = b' ';
        }
        Secret::from_bytes(&raw, "a file of 16 random bytes").unwrap();
    }
    let token = random_token().unwrap();
    let xxd = format!("{}\n{}\n", &token[..60], &token[60..]);
    assert_eq!(
        Secret::from_bytes(xxd.as_bytes(), "xxd -p").unwrap(),
        Secret::from_bytes(token.as_bytes(), "one line").unwrap()
    );
}
