//! Results a process of a run of several holds only part of (the LoRA weights and AdamW moments
//! for a checkpoint, evaluation's per-token results), made whole on process 0, which alone
//! writes them: every other process puts its devices' shards in the run's store, and process 0
//! reads them. The LoRA state is small next to the frozen weights (about 2.7 GB with both
//! moments at 70B, r=16, every projection), so the store carries it; the step itself never goes
//! through here.

use crate::cluster::server::StoreServer;
use crate::cluster::store::Store;
use anyhow::{bail, Context, Result};
use pjrt::{ElementType, HostTensor};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// How process 0 gets every mesh position's shard of a result when each process holds only its
/// own.
pub trait Gather: Send + Sync {
    /// Every position's shard (in position order, `positions` of them) on process 0, given this
    /// process's own `(position, shard)` pairs; None on the other processes. Every process calls
    /// it with the same results in the same order.
    fn all(
        &self,
        mine: Vec<(usize, HostTensor)>,
        positions: usize,
    ) -> Result<Option<Vec<HostTensor>>>;
}

/// [`Gather`] through the run's store: round `r`'s shard of position `p` is key
/// `gather/r/p`. Process 0 has the store forget each shard as soon as it has read it, so that
/// the store holds at most the shards not yet read (gigabytes at 70B, on process 0's host); a
/// barrier then ends the round.
pub struct StoreGather {
    pub store: Store,
    pub process: usize,
    pub processes: usize,
    /// How long a process waits for another's shard (`--init-timeout`).
    pub timeout: Duration,
    round: AtomicU64,
}

impl StoreGather {
    pub fn new(store: Store, process: usize, processes: usize, timeout: Duration) -> StoreGather {
        StoreGather {
            store: store.scope("gather"),
            process,
            processes,
            timeout,
            round: AtomicU64::new(0),
        }
    }
}

impl Gather for StoreGather {
    fn all(
        &self,
        mine: Vec<(usize, HostTensor)>,
        positions: usize,
    ) -> Result<Option<Vec<HostTensor>>> {
        let round = self.round.fetch_add(1, Ordering::SeqCst);
        let receives = self.process == 0;
        let mut out: Vec<Option<HostTensor>> = (0..positions).map(|_| None).collect();
        for (p, t) in mine {
            if receives {
                out[p] = Some(t);
            } else {
                self.store.put(&format!("{round}/{p}"), &encode(&t))?;
            }
        }
        if receives {
            for (p, slot) in out.iter_mut().enumerate().filter(|(_, s)| s.is_none()) {
                let key = format!("{round}/{p}");
                let bytes = self
                    .store
                    .get(&key, self.timeout)
                    .with_context(|| format!("the shard of mesh position {p} (gather {round})"))?;
                self.store.delete(&key)?;
                *slot = Some(decode(bytes).with_context(|| format!("mesh position {p}'s shard"))?);
            }
        }
        // Every process leaves the round together (process 0 has read every shard).
        self.store.barrier(
            &format!("gather/{round}"),
            self.process,
            self.processes,
            self.timeout,
        )?;
        Ok(receives.then(|| out.into_iter().flatten().collect()))
    }
}

/// `--virtual-hosts`: each virtual host hands its devices' shards to host 0 through a store of
/// their own (served on loopback by this process), as separate hosts would through the run's.
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
        let server = StoreServer::serve(listener)?;
        let n = hosts.len();
        let hosts = hosts
            .iter()
            .enumerate()
            .map(|(g, positions)| {
                let store = Store::connect(&address, "virtual-hosts", timeout)?;
                Ok((positions.clone(), StoreGather::new(store, g, n, timeout)))
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
        positions: usize,
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
                .map(|((_, gather), shards)| s.spawn(move || gather.all(shards, positions)))
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

/// A tensor as bytes: its PJRT type code (i32), rank (u32), dims (i64 each), then its bytes;
/// all little-endian.
pub fn encode(t: &HostTensor) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 + 8 * t.dims.len() + t.bytes.len());
    out.extend(t.ty.pjrt_code().to_le_bytes());
    out.extend((t.dims.len() as u32).to_le_bytes());
    for d in &t.dims {
        out.extend(d.to_le_bytes());
    }
    out.extend(&t.bytes);
    out
}

/// [`encode`]'s tensor back, in the same allocation (a shard may be gigabytes); an error says
/// what was wrong with the bytes.
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
    let dims: Vec<i64> = (0..rank)
        .map(|k| Ok(i64::from_le_bytes(word(8 + 8 * k, 8)?.try_into()?)))
        .collect::<Result<_>>()?;
    bytes.drain(..(8 + 8 * rank).min(bytes.len()));
    let want = ty.byte_size(dims.iter().product::<i64>().max(0) as usize);
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
    }

    fn shard(p: usize, round: usize) -> HostTensor {
        HostTensor::from_f32(&[(10 * round + p) as f32], &[1])
    }

    /// Process `me` of two, holding positions `2me, 2me+1` of four: gathers twice.
    fn process(address: String, me: usize) -> Store {
        let store = Store::connect(&address, "g", Duration::from_secs(5)).unwrap();
        let g = StoreGather::new(store.clone(), me, 2, Duration::from_secs(10));
        for round in 0..2 {
            let mine = (2 * me..2 * me + 2).map(|p| (p, shard(p, round))).collect();
            let all = g.all(mine, 4).unwrap();
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
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let address = format!("127.0.0.1:{}", listener.local_addr().unwrap().port());
        let _server = StoreServer::serve(listener).unwrap();
        let gather = |me: usize| {
            let store = Store::connect(&address, "big", Duration::from_secs(5)).unwrap();
            StoreGather::new(store, me, 2, Duration::from_secs(120))
        };
        let (zero, one) = (gather(0), gather(1));
        let mine = vec![(1, shard.clone())];
        let started = std::time::Instant::now();
        let all = std::thread::scope(|s| {
            let sent = s.spawn(|| one.all(mine, 2));
            let all = zero.all(vec![(0, HostTensor::from_f32(&[0.0], &[1]))], 2);
            assert_eq!(sent.join().unwrap().unwrap(), None);
            all.unwrap().unwrap()
        });
        let took = started.elapsed().as_secs_f64();
        eprintln!(
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
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let _server = StoreServer::serve(listener).unwrap();
        let address = format!("127.0.0.1:{port}");
        let other = std::thread::spawn({
            let address = address.clone();
            move || process(address, 1)
        });
        let store = process(address, 0);
        other.join().unwrap();
        let store = store.scope("gather");
        for key in ["0/0", "0/3", "1/1", "1/2"] {
            assert_eq!(store.try_get(key).unwrap(), None, "{key} was left");
        }
    }
}
