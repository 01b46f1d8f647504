//! `--seq max`: the longest multiple of `--seq-step` tokens, up to the model's positions (or
//! `--seq-limit`), that the least-memory settings of the space fit, each probe a full compile.
//!
//! A compile costs about the same at any length (the layers are a loop), so the search spends as
//! few as it can: the longest length first (often it fits); then, since a step's memory grows
//! about linearly with its length, the length the figures point at (the secant through the two
//! nearest probes, or through zero from one), checked with its neighbour; halving the interval
//! wherever the figures do not narrow it by half (and where the compiler gave none: a TPU's
//! refusal). Taking a longer sequence than one that does not fit not to fit either, the answer
//! is the one a binary search gives.
//!
//! Each probe compiles the whole model, not a model cut to a few layers whose memory is
//! extrapolated to all of them (as the TPU time estimate does for time): the layers are one loop
//! body, so a 2- or 3-layer step compiles in about the time of the whole one, and at long lengths
//! the whole step's device memory is not their line (docs/performance.md, "Should `--seq max`
//! probe a few layers?"; `tools/bench-plan-extrapolation`).
//!
//! At each length the least-memory settings are tried in order, least device memory first
//! (everything offloaded), then those that need less host memory; one that a tried setting shows
//! cannot fit (less offload than one that did not fit the device, more than one that did not
//! fit the host budget) is skipped without compiling.

use super::options::{PlanOptions, Probe};
use super::search::{Compiled, Figures, Limits};
use super::space::Knobs;
use crate::program::{Offload, Program};
use crate::words::gib;
use anyhow::{bail, Result};

/// What a probe at one length found: whether it fits, and the least of the tried settings'
/// memory over its limit (device or host, whichever is further over; None where no compile gave
/// figures).
#[derive(Clone, Copy, Debug)]
struct Found {
    fits: bool,
    ratio: Option<f64>,
}

/// `--seq max`'s length and its probes.
pub fn longest(
    o: &PlanOptions,
    devices: i64,
    limits: &Limits,
    (step, upto): (i64, Option<i64>),
    compile: &mut dyn FnMut(&Program) -> Result<Compiled>,
) -> Result<(i64, Vec<Probe>)> {
    if step < 2 {
        bail!("--seq-step must be at least 2 tokens, got {step}");
    }
    let positions = o.model.max_position_embeddings;
    let top = upto.unwrap_or(positions).min(positions);
    let most = top / step;
    if most < 1 {
        bail!(
            "--seq-step {step} is longer than the longest sequence searched ({top} tokens: the \
             model's positions, or --seq-limit)"
        );
    }
    let mut probes = Vec::new();
    let mut at = |k: i64, probes: &mut Vec<Probe>| -> Result<Found> {
        at_length(o, devices, limits, k * step, compile, probes)
    };
    let first = at(most, &mut probes)?;
    if first.fits {
        return done(most * step, probes);
    }
    // The longest does not fit: the length its figures point at, through zero (a step's memory
    // is about proportional to its length, less what does not grow), else the shortest.
    let guess = first.ratio.map_or(1, |r| {
        ((most as f64 / r).floor() as i64).clamp(1, (most - 1).max(1))
    });
    let (mut lo, mut hi) = ((0, None), (most, first.ratio));
    let mut k = guess;
    let mut slow = false;
    while hi.0 - lo.0 > 1 {
        let width = hi.0 - lo.0;
        let found = at(k, &mut probes)?;
        if found.fits {
            lo = (k, found.ratio);
        } else {
            hi = (k, found.ratio);
        }
        if lo.0 == 0 && !found.fits && k == 1 {
            bail!(
                "not even {step} tokens fit the target with the least-memory settings of the \
                 space (see above); give more devices, --quant nf4, a larger \
                 --host-memory-limit-gib, or a smaller --seq-step"
            );
        }
        // Halve where the last step did not (at most one secant step without halving).
        slow = !slow && 2 * (hi.0 - lo.0) > width;
        if hi.0 - lo.0 > 1 {
            k = next(lo, hi, slow);
        }
    }
    if lo.0 == 0 {
        // Only reached with the shortest length never probed (the longest was 1 step).
        bail!("not even {step} tokens fit the target with the least-memory settings (see above)");
    }
    done(lo.0 * step, probes)
}

fn done(seq: i64, probes: Vec<Probe>) -> Result<(i64, Vec<Probe>)> {
    crate::esay!(
        "xtrain: plan: --seq max: {seq} tokens ({} compiled)",
        crate::words::count(probes.len(), "probe")
    );
    Ok((seq, probes))
}

/// The next length to probe between `lo` (fits; 0: none known) and `hi` (does not fit), each
/// with its ratio: the secant's length where both ratios are known and `bisect` is not asked,
/// else the middle; never an end.
fn next(lo: (i64, Option<f64>), hi: (i64, Option<f64>), bisect: bool) -> i64 {
    let mid = (lo.0 + hi.0) / 2;
    let secant = match (lo, hi) {
        ((a, Some(ra)), (b, Some(rb))) if rb > ra && a > 0 => {
            let k = a as f64 + (1.0 - ra) * (b - a) as f64 / (rb - ra);
            Some(k.floor() as i64)
        }
        _ => None,
    };
    match secant.filter(|_| !bisect) {
        Some(k) => k.clamp(lo.0 + 1, hi.0 - 1),
        None => mid.clamp(lo.0 + 1, hi.0 - 1),
    }
}

/// Probe `seq` tokens with the least-memory settings in turn until one fits.
fn at_length(
    o: &PlanOptions,
    devices: i64,
    limits: &Limits,
    seq: i64,
    compile: &mut dyn FnMut(&Program) -> Result<Compiled>,
    probes: &mut Vec<Probe>,
) -> Result<Found> {
    let mut ratio: Option<f64> = None;
    // Offloads shown not to fit: less offload than one over the device's memory, more than one
    // over the host budget (with the same other settings).
    let mut over: Vec<(Knobs, bool)> = Vec::new();
    for s in o.space.least_memory(devices, o.batch_size, seq, &o.rules) {
        if let Some((_, device)) = over.iter().find(|(t, device)| ruled_out(&s, t, *device)) {
            let limit = if *device {
                "device memory"
            } else {
                "host budget"
            };
            crate::esay!(
                "xtrain: plan: --seq {seq} with {}: skipped (a setting with {} offload is over \
                 the {limit})",
                s.line(),
                if *device { "more" } else { "less" }
            );
            continue;
        }
        let found = probe(o, &s, seq, compile)?;
        let fit = found.as_ref().is_some_and(|f| limits.holds(f));
        crate::esay!(
            "xtrain: plan: --seq {seq} with {}: {}",
            s.line(),
            match (fit, &found) {
                (true, Some(f)) =>
                    format!("fits ({}, host {})", gib(f.device_bytes), gib(f.host_bytes)),
                (false, Some(f)) => format!(
                    "does not fit ({} of {}, host {} of {})",
                    gib(f.device_bytes),
                    gib(limits.device.bytes),
                    gib(f.host_bytes),
                    gib(limits.host.bytes)
                ),
                _ => "does not fit".into(),
            }
        );
        probes.push(Probe {
            seq,
            flags: s.line(),
            fits: fit,
            device_bytes: found.as_ref().map(|f| f.device_bytes),
            host_bytes: found.as_ref().map(|f| f.host_bytes),
        });
        if let Some(f) = &found {
            let r = over_limit(f, limits);
            ratio = Some(ratio.map_or(r, |q: f64| q.min(r)));
            if f.device_bytes > limits.device.bytes {
                over.push((s.clone(), true));
            }
            if f.host_bytes > limits.host.bytes {
                over.push((s.clone(), false));
            }
        }
        if fit {
            return Ok(Found { fits: true, ratio });
        }
    }
    Ok(Found { fits: false, ratio })
}

/// How far a step's figures are over its limits: the larger of device memory over its limit and
/// host memory over its budget (at most 1 where it fits).
fn over_limit(f: &Figures, limits: &Limits) -> f64 {
    let d = f.device_bytes as f64 / limits.device.bytes as f64;
    let h = f.host_bytes as f64 / limits.host.bytes.max(1) as f64;
    d.max(h)
}

/// Whether `s` cannot fit, since `t` (the same settings but for the offload) did not: `s`
/// offloads less than `t`, which was over the device's memory (`device`), or more than `t`, which
/// was over the host budget.
fn ruled_out(s: &Knobs, t: &Knobs, device: bool) -> bool {
    let same = Knobs {
        offload: t.offload,
        ..s.clone()
    } == *t;
    let within =
        |a: Offload, b: Offload| (!a.frozen || b.frozen) && (!a.activations || b.activations);
    same && match device {
        true => within(s.offload, t.offload),
        false => within(t.offload, s.offload),
    }
}

/// The memory figures of `s`'s step at `seq`, or None where the step refuses it or the compiler
/// says it does not fit.
fn probe(
    o: &PlanOptions,
    s: &Knobs,
    seq: i64,
    compile: &mut dyn FnMut(&Program) -> Result<Compiled>,
) -> Result<Option<Figures>> {
    let spec = match s.options(&o.step).spec(o.model.clone(), o.batch_size, seq) {
        Ok(spec) => spec,
        Err(e) => {
            crate::esay!(
                "xtrain: plan: --seq {seq} with {}: refused: {e:#}",
                s.line()
            );
            return Ok(None);
        }
    };
    let program = crate::program::build_train_step(&spec)?;
    Ok(match compile(&program)? {
        Compiled::Figures(f) => Some(f),
        Compiled::OutOfMemory => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// With figures at both ends the next probe is where the line through them crosses the
    /// limit; without, or when asked to halve, the middle; never an end.
    #[test]
    fn the_next_probe_is_the_secants_length_or_the_middle() {
        // 0.5 of the limit at 10 steps, 1.5 at 30: the limit at 20.
        assert_eq!(next((10, Some(0.5)), (30, Some(1.5)), false), 20);
        assert_eq!(next((10, Some(0.5)), (30, Some(1.5)), true), 20);
        assert_eq!(next((10, Some(0.5)), (30, None), false), 20);
        // 0.9 at 10, 3.0 at 40: the limit at 10 + 0.1 x 30 / 2.1 = 11.4, floored to 11.
        assert_eq!(next((10, Some(0.9)), (40, Some(3.0)), false), 11);
        assert_eq!(next((10, Some(0.9)), (40, Some(3.0)), true), 25);
        // Never an end: just above the one that fits, just below the one that does not.
        assert_eq!(next((10, Some(0.999)), (12, Some(1.001)), false), 11);
        assert_eq!(next((0, None), (2, Some(1.2)), false), 1);
    }

    /// A setting with less offload than one over the device's memory cannot fit the device;
    /// one with more offload than one over the host budget cannot fit the host.
    #[test]
    fn offloads_a_tried_one_rules_out_are_skipped() {
        let rules = crate::program::sharding::Rules::default();
        let s = super::super::space::Space::default().least_memory(1, 1, 64, &rules)[0].clone();
        let with = |offload| Knobs {
            offload,
            ..s.clone()
        };
        let (all, act, frozen, none) = (
            with(Offload::ALL),
            with(Offload::ACTIVATIONS),
            with(Offload::FROZEN),
            with(Offload::NONE),
        );
        assert!(ruled_out(&act, &all, true) && ruled_out(&none, &all, true));
        assert!(ruled_out(&frozen, &all, true));
        assert!(!ruled_out(&all, &act, true));
        assert!(ruled_out(&all, &act, false) && !ruled_out(&frozen, &act, false));
        assert!(!ruled_out(&none, &act, false));
        let other = Knobs {
            grad_accum: 7,
            ..act.clone()
        };
        assert!(!ruled_out(&other, &all, true));
    }
}
