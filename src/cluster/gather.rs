//! Results a process of a run of several holds only part of (the LoRA weights and AdamW moments
//! for a checkpoint, evaluation's per-token results), made whole on process 0, which alone
//! writes them: every other process puts its devices' shards in the run's store, and process 0
//! reads them. The LoRA state is small next to the frozen weights (about 2.7 GB with both
//! moments at 70B, r=16, every projection), so the store carries it; the step itself never goes
//! through here.

use crate::cluster::auth::Secret;
use crate::cluster::server::{Config, StoreServer};
use crate::cluster::store::{Credentials, Store};
use anyhow::{bail, Context, Result};
use pjrt::{ElementType, HostTensor};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// How process 0 gets every mesh position's shard of a result when each process holds only its
/// own.
pub trait Gather: Send + Sync {
    /// Every position's shard (in position order) on process 0, given this process's own
    /// `(position, shard)` pairs and each process's positions (`hosts`, by process); None on the
    /// other processes. Every process calls it with the same results in the same order.
    fn all(
        &self,
        mine: Vec<(usize, HostTensor)>,
        hosts: &[Vec<usize>],
    ) -> Result<Option<Vec<HostTensor>>>;
}

/// [`Gather`] through the run's store: round `r`'s shard of position `p`, held by process `k`,
/// is key `gather/r/p/k`, which only process `k` can write (and only once). Process 0 has the store forget each shard as soon as it has read it, so that
/// the store holds at most the shards not yet read (gigabytes at 70B, on process 0's host); a
/// barrier then ends the round.
pub struct StoreGather {
    /// Whose credentials say which process this is.
    pub store: Store,
    /// How long a process waits for another's shard (`--init-timeout`).
    pub timeout: Duration,
    round: AtomicU64,
}

impl StoreGather {
    pub fn new(store: Store, timeout: Duration) -> StoreGather {
        StoreGather {
            store: store.scope("gather"),
            timeout,
            round: AtomicU64::new(0),
        }
    }
}

impl Gather for StoreGather {
    fn all(
        &self,
        mine: Vec<(usize, HostTensor)>,
        hosts: &[Vec<usize>],
    ) -> Result<Option<Vec<HostTensor>>> {
        let round = self.round.fetch_add(1, Ordering::SeqCst);
        let me = self.store.process();
        let receives = me == 0;
        let positions: usize = hosts.iter().map(|h| h.len()).sum();
        let mut out: Vec<Option<HostTensor>> = (0..positions).map(|_| None).collect();
        for (p, t) in mine {
            match out.get_mut(p) {
                Some(slot) if receives => *slot = Some(t),
                Some(_) => self
                    .store
                    .put_parts(&format!("{round}/{p}/{me}"), &[&header(&t), &t.bytes])?,
                None => bail!("mesh position {p} is outside the step's {positions}"),
            }
        }
        if receives {
            for (p, slot) in out.iter_mut().enumerate().filter(|(_, s)| s.is_none()) {
                let holder = hosts
                    .iter()
                    .position(|h| h.contains(&p))
                    .with_context(|| format!("mesh position {p} belongs to no process"))?;
                let key = format!("{round}/{p}/{holder}");
                let bytes = self
                    .store
                    .get(&key, self.timeout)
                    .with_context(|| format!("the shard of mesh position {p} (gather {round})"))?;
                self.store.delete(&key)?;
                *slot = Some(decode(bytes).with_context(|| format!("mesh position {p}'s shard"))?);
            }
        }
        // Every process leaves the round together (process 0 has read every shard).
        self.store
            .barrier(&format!("gather/{round}"), self.timeout)?;
        Ok(receives.then(|| out.into_iter().flatten().collect()))
    }
}

/// `--virtual-hosts`: each virtual host hands its devices' shards to host 0 through a store of
/// their own (served on loopback by this process, with a random secret of its own: nothing else
/// on the host can reach it), as separate hosts would through the run's.
pub struct VirtualHosts {
    /// One per host, in host order.
    hosts: Vec<(Vec<usize>, StoreGather)>,
    _server: StoreServer,
}

impl VirtualHosts {
    /// Serve a store on loopback and reach it once per host (`hosts`: each host's positions).
    pub fn start(hosts: &[Vec<usize>], timeout: Duration) -> Result<VirtualHosts> {
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        let address = listener.local_addr()?.to_string();
        let secret = Secret::random()?;
        let n = hosts.len();
        let server = StoreServer::serve(listener, Config::new(n, secret.clone()))?;
        let hosts = hosts
            .iter()
            .enumerate()
            .map(|(g, positions)| {
                let me = Credentials {
                    process: g,
                    secret: secret.clone(),
                };
                let store = Store::connect(&address, "virtual-hosts", me, timeout)?;
                Ok((positions.clone(), StoreGather::new(store, timeout)))
            })
            .collect::<Result<_>>()?;
        Ok(VirtualHosts {
            hosts,
            _server: server,
        })
    }
}

impl Gather for VirtualHosts {
    fn all(
        &self,
        mine: Vec<(usize, HostTensor)>,
        hosts: &[Vec<usize>],
    ) -> Result<Option<Vec<HostTensor>>> {
        let mut by_host: Vec<Vec<(usize, HostTensor)>> =
            self.hosts.iter().map(|_| Vec::new()).collect();
        for (p, t) in mine {
            let g = self.hosts.iter().position(|(h, _)| h.contains(&p));
            by_host[g.with_context(|| format!("mesh position {p} belongs to no virtual host"))?]
                .push((p, t));
        }
        // Every host at once, as separate processes would be (each waits at the round's barrier).
        std::thread::scope(|s| {
            let handles: Vec<_> = self
                .hosts
                .iter()
                .zip(by_host)
                .map(|((_, gather), shards)| s.spawn(move || gather.all(shards, hosts)))
                .collect();
            let mut results = handles.into_iter().map(|h| {
                h.join()
                    .unwrap_or_else(|_| bail!("a virtual host's gather panicked"))
            });
            let first = results.next().context("no virtual hosts")??;
            for r in results {
                r?;
            }
            Ok(first)
        })
    }
}

/// A tensor as bytes: [`header`], then its bytes.
pub fn encode(t: &HostTensor) -> Vec<u8> {
    [header(t), t.bytes.clone()].concat()
}

/// What goes before a tensor's bytes in the store: its PJRT type code (i32), rank (u32), dims
/// (i64 each); all little-endian. A shard goes as this and its bytes, never copied together.
pub fn header(t: &HostTensor) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 + 8 * t.dims.len());
    out.extend(t.ty.pjrt_code().to_le_bytes());
    out.extend((t.dims.len() as u32).to_le_bytes());
    for d in &t.dims {
        out.extend(d.to_le_bytes());
    }
    out
}

/// The most dims a shard has (a tensor of the step has at most a handful).
const MAX_RANK: usize = 16;

/// [`encode`]'s tensor back, in the same allocation (a shard may be gigabytes); an error says
/// what was wrong with the bytes (sizes computed with checked arithmetic: the bytes are a
/// peer's).
pub fn decode(mut bytes: Vec<u8>) -> Result<HostTensor> {
    let word = |at: usize, n: usize| -> Result<&[u8]> {
        bytes
            .get(at..at + n)
            .context("a shard in the store is cut short")
    };
    let code = i32::from_le_bytes(word(0, 4)?.try_into()?);
    let ty = ElementType::from_pjrt_code(code)
        .with_context(|| format!("a shard in the store has unknown element type {code}"))?;
    let rank = u32::from_le_bytes(word(4, 4)?.try_into()?) as usize;
    if rank > MAX_RANK {
        bail!("a shard in the store has {rank} dims (at most {MAX_RANK})");
    }
    let dims: Vec<i64> = (0..rank)
        .map(|k| Ok(i64::from_le_bytes(word(8 + 8 * k, 8)?.try_into()?)))
        .collect::<Result<_>>()?;
    let elements = dims
        .iter()
        .try_fold(1usize, |n, d| n.checked_mul(usize::try_from(*d).ok()?))
        .with_context(|| format!("a shard in the store has dims {dims:?}"))?;
    let want = elements
        .checked_mul(ty.size_bytes())
        .with_context(|| format!("a shard in the store has dims {dims:?}"))?;
    bytes.drain(..(8 + 8 * rank).min(bytes.len()));
    if bytes.len() != want {
        bail!(
            "a shard in the store of {ty:?}{dims:?} holds {} bytes, expected {want}",
            bytes.len()
        );
    }
    Ok(HostTensor { ty, dims, bytes })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensors_survive_the_store_bytes() {
        let t = HostTensor::from_f32(&[1.0, -2.5, 3.0, 0.0, 5.0, 6.0], &[2, 3]);
        assert_eq!(decode(encode(&t)).unwrap(), t);
        // 24 bytes of header (type, rank, two dims), then 6 of the 24 bytes of data.
        let e = decode(encode(&t)[..30].to_vec()).unwrap_err().to_string();
        assert!(e.contains("holds 6 bytes, expected 24"), "{e}");
        let e = decode(encode(&t)[..12].to_vec()).unwrap_err().to_string();
        assert_eq!(e, "a shard in the store is cut short");
        // A peer's sizes never overflow or allocate: negative, huge and too many dims.
        for (dims, want) in [
            (vec![-1i64, 4], "has dims [-1, 4]"),
            (vec![i64::MAX, i64::MAX], "has dims ["),
        ] {
            let mut bytes = encode(&t)[..8].to_vec();
            bytes[4..8].copy_from_slice(&(dims.len() as u32).to_le_bytes());
            for d in &dims {
                bytes.extend(d.to_le_bytes());
            }
            let e = decode(bytes).unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
        }
        let mut bytes = encode(&t);
        bytes[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        let e = decode(bytes).unwrap_err().to_string();
        assert!(e.contains("4294967295 dims (at most 16)"), "{e}");
    }

    /// A store on loopback for a run of `processes`, and a way to reach it as process `k`.
    pub(crate) fn store_for(processes: usize) -> (StoreServer, impl Fn(usize, &str) -> Store) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let server = StoreServer::serve(listener, Config::new(processes, Secret::none())).unwrap();
        let connect = move |k: usize, run: &str| {
            let me = Credentials {
                process: k,
                secret: Secret::none(),
            };
            Store::connect(&address, run, me, Duration::from_secs(5)).unwrap()
        };
        (server, connect)
    }

    fn shard(p: usize, round: usize) -> HostTensor {
        HostTensor::from_f32(&[(10 * round + p) as f32], &[1])
    }

    /// Process `me` of two, holding positions `2me, 2me+1` of four: gathers twice.
    fn process(store: Store, me: usize) -> Store {
        let g = StoreGather::new(store.clone(), Duration::from_secs(10));
        for round in 0..2 {
            let mine = (2 * me..2 * me + 2).map(|p| (p, shard(p, round))).collect();
            let all = g.all(mine, &[vec![0, 1], vec![2, 3]]).unwrap();
            let want = (0..4).map(|p| shard(p, round)).collect::<Vec<_>>();
            assert_eq!(all, (me == 0).then_some(want), "process {me}");
        }
        store
    }

    /// How long a gather of a 256 MiB shard from process 1 to process 0 takes over loopback
    /// (the store's raw-bytes frames; `XTRAIN_GATHER_MB` sets another size), printed for
    /// docs/performance.md; the shard arrives intact.
    #[test]
    fn a_large_shard_gathers_over_loopback_intact() {
        let mb: usize = std::env::var("XTRAIN_GATHER_MB")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(256);
        let n = (mb << 20) / 4;
        let values: Vec<f32> = (0..n).map(|i| (i % 9973) as f32 * 0.5 - 7.0).collect();
        let shard = HostTensor::from_f32(&values, &[n as i64]);
        drop(values);
        let (_server, connect) = store_for(2);
        let gather = |me: usize| StoreGather::new(connect(me, "big"), Duration::from_secs(120));
        let (zero, one) = (gather(0), gather(1));
        let mine = vec![(1, shard.clone())];
        let started = std::time::Instant::now();
        let hosts = [vec![0], vec![1]];
        let all = std::thread::scope(|s| {
            let sent = s.spawn(|| one.all(mine, &hosts));
            let all = zero.all(vec![(0, HostTensor::from_f32(&[0.0], &[1]))], &hosts);
            assert_eq!(sent.join().unwrap().unwrap(), None);
            all.unwrap().unwrap()
        });
        let took = started.elapsed().as_secs_f64();
        crate::esay!(
            "gathered a {mb} MiB shard over loopback in {took:.2} s ({:.0} MiB/s)",
            mb as f64 / took
        );
        assert!(all[1] == shard, "the shard changed on the way");
    }

    /// Two processes (threads here), each holding two of four positions: process 0 ends with
    /// all four, twice (rounds do not mix), process 1 with none, and nothing is left in the
    /// store.
    #[test]
    fn process_0_gets_every_shard() {
        let (_server, connect) = store_for(2);
        let one = connect(1, "g");
        let other = std::thread::spawn(move || process(one, 1));
        let store = process(connect(0, "g"), 0);
        other.join().unwrap();
        let store = store.scope("gather");
        for key in ["0/2/1", "0/3/1", "1/2/1", "1/3/1"] {
            assert_eq!(store.try_get(key).unwrap(), None, "{key} was left");
        }
    }
}
