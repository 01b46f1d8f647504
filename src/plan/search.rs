//! The search of `xtrain plan` over the points of a [`Space`](super::space::Space): each point
//! made a step (or refused by the step's own checks), a lower bound of its memory and a model
//! of its time computed without compiling, then the points compiled in the model's order,
//! fastest first, until enough fit. Skipped without compiling: a point whose bound is above a
//! limit, and one that needs at least the memory of a point that does not fit (knob by knob,
//! [`Knobs::needs_no_more`]: more offload, a chunked loss, MLP tiles, remat per layer and more
//! microbatches need less device memory). Where memory is tight (once a point did not fit, or
//! from the start with `--seq max`, whose length the least-memory settings barely fit), a
//! point's neighbours with less device memory are settled first: one that does not fit rules
//! out every point above it, so a family that cannot fit costs one compile, not one per point.
//! Every figure of a point that fits is the target compiler's, from a full compile of the step:
//! no pick that does not fit.

use super::cost::{host_lower_bound_bytes, lower_bound_bytes, modelled, Modelled};
use super::space::{Knobs, Memory};
use crate::program::{Program, StepOptions, StepSpec};
use crate::words::clock;
use anyhow::Result;
use std::time::Instant;

/// What compiling a point's step gave.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Figures {
    /// Device memory per device (arguments + non-aliased outputs + temporaries), and host memory
    /// per device, as the compiler says.
    pub device_bytes: i64,
    pub host_bytes: i64,
    pub compile_s: f64,
    /// What the compiled step launches per run, from its optimized HLO (where the compiler
    /// gave it).
    pub launches: Option<crate::device::launches::Launches>,
}

/// A memory budget per device, and where it came from.
#[derive(Clone, Debug, PartialEq)]
pub struct Budget {
    pub bytes: i64,
    /// What the figure is, as the plan's output says it (`--memory-limit-gib`, `what the device
    /// gives XLA`, ...).
    pub source: String,
}

/// How a compile ended.
#[derive(Clone)]
pub enum Compiled {
    Figures(Figures),
    /// The compiler refused the step for its memory (the TPU compiler does).
    OutOfMemory,
}

/// What became of a point.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    /// The step's checks refuse these settings (the reason).
    Refused(String),
    /// Its lower bound of device memory, or of host memory, is above that limit: not compiled.
    AboveBound,
    /// A point (its index) that needs no more of a memory does not fit that memory: not
    /// compiled.
    Dominated(usize, Memory),
    Fits,
    DoesNotFit,
    /// Ranked below the points that fit: not compiled.
    Unexplored,
}

impl Outcome {
    pub fn says(&self, all: &[Point]) -> String {
        match self {
            Outcome::Refused(why) => format!("refused: {why}"),
            Outcome::AboveBound => {
                "skipped: its lower bound of device or host memory is above that limit".into()
            }
            Outcome::Dominated(i, m) => format!(
                "skipped: needs at least the {} of {}, which does not fit it",
                m.name(),
                all[*i].knobs.line()
            ),
            Outcome::Fits => "fits".into(),
            Outcome::DoesNotFit => "does not fit".into(),
            Outcome::Unexplored => "not compiled: ranked below the points that fit".into(),
        }
    }
}

/// One point of the search.
pub struct Point {
    pub knobs: Knobs,
    pub spec: Option<StepSpec>,
    pub bound_bytes: Option<i64>,
    /// The lower bound of its host memory per device ([`host_lower_bound_bytes`]).
    pub host_bound_bytes: Option<i64>,
    /// The modelled time of its step ([`super::cost`]).
    pub modelled: Option<Modelled>,
    pub figures: Option<Figures>,
    /// The TPU compiler's estimate of the whole step, seconds (TPUs, points that fit).
    pub estimate_s: Option<f64>,
    pub outcome: Outcome,
}

/// How the search runs: the memory to fit, how many points that fit to compile (the table's
/// rows; 1 for the pick alone), and whether to compile every point (to check the pruning).
pub struct Limits {
    /// The device memory per device a point may use.
    pub device: Budget,
    /// The host memory per device a point may use.
    pub host: Budget,
    pub confirm: usize,
    pub exhaustive: bool,
}

impl Limits {
    /// Whether a compiled step's figures are within the limits.
    pub fn holds(&self, f: &Figures) -> bool {
        f.device_bytes <= self.device.bytes && f.host_bytes <= self.host.bytes
    }
}

/// The points of `knobs` over `base` for `model` at `batch` x `seq`: each made a step and
/// a program, with its bound and modelled time (refused ones say why).
pub fn points(
    knobs: Vec<Knobs>,
    base: &StepOptions,
    model: &crate::model::config::LlamaConfig,
    batch: i64,
    seq: i64,
    peak_tflops: f64,
) -> Vec<(Point, Option<Program>)> {
    knobs
        .into_iter()
        .map(|s| {
            let built = s
                .options(base)
                .spec(model.clone(), batch, seq)
                .and_then(|spec| Ok((crate::program::build_train_step(&spec)?, spec)));
            let mut p = Point {
                knobs: s,
                spec: None,
                bound_bytes: None,
                host_bound_bytes: None,
                modelled: None,
                figures: None,
                estimate_s: None,
                outcome: Outcome::Unexplored,
            };
            match built {
                Ok((program, spec)) => {
                    p.bound_bytes = Some(lower_bound_bytes(&spec, &program));
                    p.host_bound_bytes = Some(host_lower_bound_bytes(&spec, &program));
                    p.modelled = Some(modelled(&spec, &program, peak_tflops));
                    p.spec = Some(spec);
                    (p, Some(program))
                }
                Err(e) => {
                    p.outcome = Outcome::Refused(format!("{e:#}"));
                    (p, None)
                }
            }
        })
        .collect()
}

/// Run the search over `points`: `compile` compiles a step for the target; `tight`: settle
/// each point's neighbours with less memory first from the start (else once a point did not
/// fit). Returns the points with their outcomes; the indices of those that fit, fastest by the
/// model first.
pub fn search(
    built: Vec<(Point, Option<Program>)>,
    limits: &Limits,
    tight: bool,
    compile: &mut dyn FnMut(&Program) -> Result<Compiled>,
) -> Result<(Vec<Point>, Vec<usize>)> {
    let mut order: Vec<usize> = (0..built.len()).filter(|&i| built[i].1.is_some()).collect();
    order.sort_by(|&a, &b| seconds(&built[a].0).total_cmp(&seconds(&built[b].0)));
    let mut s = Search {
        built,
        limits,
        tight,
        compile,
        compiled_s: Vec::new(),
        compiles: 0,
        started: Instant::now(),
        order: order.clone(),
        fits_in_order: 0,
    };
    for &i in &order {
        if !limits.exhaustive && s.fits_in_order >= limits.confirm {
            break;
        }
        s.settle(i)?;
        if s.built[i].0.outcome == Outcome::Fits {
            s.fits_in_order += 1;
        }
    }
    let points: Vec<Point> = s.built.into_iter().map(|(p, _)| p).collect();
    let mut fits: Vec<usize> = (0..points.len())
        .filter(|&i| points[i].outcome == Outcome::Fits)
        .collect();
    rank(&points, &mut fits, |p| p.modelled.map(|m| m.seconds));
    Ok((points, fits))
}

/// Order `ranked` fastest first by `time` (None last); points whose times agree to a part in a
/// million by the device memory they need, least first (a tie goes to the point that leaves the
/// most room, not to whichever was compiled first).
pub fn rank(points: &[Point], ranked: &mut [usize], time: impl Fn(&Point) -> Option<f64>) {
    // The time in steps of a millionth of itself (a total order, unlike "within a millionth").
    let bucket = |i: usize| match time(&points[i]) {
        Some(t) if t > 0.0 => (t.ln() * 1e6).round() as i64,
        Some(_) => i64::MIN,
        None => i64::MAX,
    };
    let memory = |i: usize| {
        points[i]
            .figures
            .as_ref()
            .map_or(i64::MAX, |f| f.device_bytes)
    };
    ranked.sort_by_key(|&i| (bucket(i), memory(i)));
}

/// A point's modelled seconds (unbuilt points last).
fn seconds(p: &Point) -> f64 {
    p.modelled.map_or(f64::MAX, |m| m.seconds)
}

/// The search's state.
struct Search<'a> {
    built: Vec<(Point, Option<Program>)>,
    limits: &'a Limits,
    tight: bool,
    compile: &'a mut dyn FnMut(&Program) -> Result<Compiled>,
    /// Seconds of each compile that took any, and how many compiles were asked for.
    compiled_s: Vec<f64>,
    compiles: usize,
    started: Instant,
    /// The points in the model's order, and how many of those taken in that order fit.
    order: Vec<usize>,
    fits_in_order: usize,
}

impl Search<'_> {
    /// Give point `i` its outcome: skipped by its bound or by a point below it that does not
    /// fit, else compiled (where memory is tight, after its neighbours with less memory).
    fn settle(&mut self, i: usize) -> Result<()> {
        if self.built[i].0.outcome != Outcome::Unexplored || self.built[i].1.is_none() {
            return Ok(());
        }
        if !self.limits.exhaustive {
            if self.above_bound(i) {
                self.built[i].0.outcome = Outcome::AboveBound;
                return Ok(());
            }
            if self.skip_dominated(i) {
                return Ok(());
            }
            if self.tight {
                for j in self.neighbours_below(i) {
                    self.settle(j)?;
                }
                if self.skip_dominated(i) {
                    return Ok(());
                }
            }
        }
        self.compile_point(i)
    }

    fn above_bound(&self, i: usize) -> bool {
        let p = &self.built[i].0;
        p.bound_bytes.is_some_and(|b| b > self.limits.device.bytes)
            || p.host_bound_bytes
                .is_some_and(|b| b > self.limits.host.bytes)
    }

    /// Mark `i` skipped where a point that needs no more of a memory did not fit it.
    fn skip_dominated(&mut self, i: usize) -> bool {
        let q = &self.built[i].0.knobs;
        let found = self.built.iter().enumerate().find_map(|(j, (p, _))| {
            over(p, self.limits)
                .into_iter()
                .find(|&m| p.knobs.needs_no_more(q, m))
                .map(|m| (j, m))
        });
        if let Some((j, m)) = found {
            self.built[i].0.outcome = Outcome::Dominated(j, m);
        }
        found.is_some()
    }

    /// The built points one knob away from `i` that need no more device memory (and so, for
    /// every knob but the offload, no more host memory either), least memory last.
    fn neighbours_below(&self, i: usize) -> Vec<usize> {
        let q = &self.built[i].0.knobs;
        (0..self.built.len())
            .filter(|&j| {
                let p = &self.built[j];
                p.1.is_some()
                    && p.0.knobs.differences(q) == 1
                    && p.0.knobs.needs_no_more(q, Memory::Device)
            })
            .collect()
    }

    fn compile_point(&mut self, i: usize) -> Result<()> {
        self.say_progress(i);
        let (point, program) = &mut self.built[i];
        let program = program.as_ref().expect("built");
        let t0 = Instant::now();
        self.compiles += 1;
        let result = (self.compile)(program)?;
        // A step compiled before (a probe of --seq max) costs nothing, and says nothing of the
        // time compiles take.
        let took = t0.elapsed().as_secs_f64();
        if took > 0.05 {
            self.compiled_s.push(took);
        }
        match result {
            Compiled::Figures(f) => {
                point.outcome = match self.limits.holds(&f) {
                    true => Outcome::Fits,
                    false => Outcome::DoesNotFit,
                };
                point.figures = Some(f);
            }
            Compiled::OutOfMemory => point.outcome = Outcome::DoesNotFit,
        }
        if point.outcome == Outcome::DoesNotFit {
            self.tight = true;
        }
        Ok(())
    }

    /// One line on stderr before each compile: how many were compiled and are still to settle,
    /// the settings, and an estimate of the time left from the compiles so far.
    fn say_progress(&self, i: usize) {
        let settled = |p: &Point| p.outcome != Outcome::Unexplored;
        let left = self
            .order
            .iter()
            .filter(|&&j| !settled(&self.built[j].0))
            .count();
        let eta = match self.compiled_s.is_empty() {
            true => String::new(),
            false => format!(
                ", {} so far, about {} more (an estimate)",
                clock(self.started.elapsed().as_secs_f64()),
                clock(self.estimate_left(left))
            ),
        };
        crate::esay!(
            "xtrain: plan [compile {}, {left} of {} points to settle{eta}] {}",
            self.compiles + 1,
            self.order.len(),
            self.built[i].0.knobs.line()
        );
    }

    /// Seconds the search likely has left: the mean compile so far, times the compiles still
    /// likely: the fits still wanted over the share of compiles that fit so far (counted as
    /// one more of each, so that neither is zero), at most every point left.
    fn estimate_left(&self, left: usize) -> f64 {
        let mean = self.compiled_s.iter().sum::<f64>() / self.compiled_s.len().max(1) as f64;
        if self.limits.exhaustive {
            return mean * left as f64;
        }
        let compiled = self.compiles as f64;
        let fit = self
            .built
            .iter()
            .filter(|(p, _)| p.outcome == Outcome::Fits)
            .count() as f64;
        let wanted = self.limits.confirm.saturating_sub(self.fits_in_order) as f64;
        let likely = (wanted * (compiled + 2.0) / (fit + 1.0)).ceil();
        mean * likely.min(left as f64)
    }
}

/// The memories a compiled point did not fit (the device's where the compiler refused it).
fn over(p: &Point, limits: &Limits) -> Vec<Memory> {
    if p.outcome != Outcome::DoesNotFit {
        return Vec::new();
    }
    match &p.figures {
        None => vec![Memory::Device],
        Some(f) => [
            (f.device_bytes > limits.device.bytes, Memory::Device),
            (f.host_bytes > limits.host.bytes, Memory::Host),
        ]
        .into_iter()
        .filter_map(|(o, m)| o.then_some(m))
        .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(seconds: f64, device_bytes: i64) -> Point {
        let rules = crate::program::sharding::Rules::default();
        let knobs = super::super::space::Space::default().least_memory(1, 1, 64, &rules)[0].clone();
        Point {
            knobs,
            spec: None,
            bound_bytes: None,
            host_bound_bytes: None,
            modelled: Some(Modelled {
                seconds,
                ..Modelled::default()
            }),
            figures: Some(Figures {
                device_bytes,
                host_bytes: 0,
                compile_s: 0.0,
                launches: None,
            }),
            estimate_s: None,
            outcome: Outcome::Fits,
        }
    }

    /// Faster first; equal times (to a part in a million) go to the point needing less device
    /// memory, whichever was compiled first.
    #[test]
    fn a_tie_goes_to_the_point_with_less_memory() {
        let points = vec![point(2.0, 100), point(1.0, 900), point(1.0 + 1e-9, 400)];
        let mut ranked = vec![0, 1, 2];
        rank(&points, &mut ranked, |p| p.modelled.map(|m| m.seconds));
        assert_eq!(ranked, vec![2, 1, 0]);
    }
}
