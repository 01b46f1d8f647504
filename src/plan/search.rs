//! The search of `xtrain plan` over the points of a [`Space`](super::space::Space): each point
//! made a step (or refused by the step's own checks), a lower bound of its memory and a model
//! of its time computed without compiling, then the points compiled in the model's order,
//! fastest first, skipping those whose bound is above the limit and those with larger
//! microbatches than a point that did not fit, until enough fit. Every figure of a point that
//! fits is the target compiler's, from a full compile of the step: no pick that does not fit.

use super::cost::{lower_bound_bytes, modelled, Modelled};
use super::space::Knobs;
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
    /// Its lower bound is above the limit: not compiled.
    AboveBound,
    /// The point with the same settings and smaller microbatches (its index) does not fit:
    /// not compiled.
    LargerThan(usize),
    Fits,
    DoesNotFit,
    /// Ranked below the points that fit: not compiled.
    Unexplored,
}

impl Outcome {
    pub fn says(&self, all: &[Point]) -> String {
        match self {
            Outcome::Refused(why) => format!("refused: {why}"),
            Outcome::AboveBound => "skipped: its lower bound is above the limit".into(),
            Outcome::LargerThan(i) => format!(
                "skipped: larger microbatches than {}, which does not fit",
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
    pub limit_bytes: i64,
    /// The host memory per device a point may use (`--host-memory-limit-gib`; None: any).
    pub host_limit_bytes: Option<i64>,
    pub confirm: usize,
    pub exhaustive: bool,
}

impl Limits {
    /// Whether a compiled step's figures are within the limits.
    pub fn holds(&self, f: &Figures) -> bool {
        f.device_bytes <= self.limit_bytes
            && self.host_limit_bytes.is_none_or(|h| f.host_bytes <= h)
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
                modelled: None,
                figures: None,
                estimate_s: None,
                outcome: Outcome::Unexplored,
            };
            match built {
                Ok((program, spec)) => {
                    p.bound_bytes = Some(lower_bound_bytes(&spec, &program));
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

/// Run the search over `points`: `compile` compiles a step for the target. Returns the
/// points with their outcomes; the indices of those that fit, fastest by the model first.
pub fn search(
    mut built: Vec<(Point, Option<Program>)>,
    limits: &Limits,
    compile: &mut dyn FnMut(&Program) -> Result<Compiled>,
) -> Result<(Vec<Point>, Vec<usize>)> {
    let mut order: Vec<usize> = (0..built.len()).filter(|&i| built[i].1.is_some()).collect();
    let seconds = |p: &Point| p.modelled.map_or(f64::MAX, |m| m.seconds);
    order.sort_by(|&a, &b| seconds(&built[a].0).total_cmp(&seconds(&built[b].0)));
    let mut fits = Vec::new();
    let mut compiled_s = Vec::new();
    let started = Instant::now();
    for (k, &i) in order.iter().enumerate() {
        if !limits.exhaustive {
            if fits.len() >= limits.confirm {
                break;
            }
            if built[i]
                .0
                .bound_bytes
                .is_some_and(|b| b > limits.limit_bytes)
            {
                built[i].0.outcome = Outcome::AboveBound;
                continue;
            }
            let smaller = (0..built.len()).find(|&j| {
                let (p, q) = (&built[j].0, &built[i].0);
                p.outcome == Outcome::DoesNotFit
                    && p.knobs.same_but_accumulation(&q.knobs)
                    && p.knobs.grad_accum > q.knobs.grad_accum
            });
            if let Some(j) = smaller {
                built[i].0.outcome = Outcome::LargerThan(j);
                continue;
            }
        }
        let (point, program) = &mut built[i];
        let program = program.as_ref().expect("built");
        say_progress(k, order.len(), &compiled_s, started, &point.knobs);
        let t0 = Instant::now();
        let result = compile(program)?;
        compiled_s.push(t0.elapsed().as_secs_f64());
        match result {
            Compiled::Figures(f) => {
                let ok = limits.holds(&f);
                point.outcome = if ok {
                    Outcome::Fits
                } else {
                    Outcome::DoesNotFit
                };
                point.figures = Some(f);
                if ok {
                    fits.push(i);
                }
            }
            Compiled::OutOfMemory => point.outcome = Outcome::DoesNotFit,
        }
    }
    let points: Vec<Point> = built.into_iter().map(|(p, _)| p).collect();
    fits.sort_by(|&a, &b| seconds(&points[a]).total_cmp(&seconds(&points[b])));
    Ok((points, fits))
}

/// One line on stderr before each compile: which of how many, the settings, and an ETA from
/// the compiles so far (an upper bound: points may yet be skipped).
fn say_progress(k: usize, n: usize, compiled_s: &[f64], started: Instant, s: &Knobs) {
    let eta = match compiled_s.is_empty() {
        true => String::new(),
        false => {
            let mean = compiled_s.iter().sum::<f64>() / compiled_s.len() as f64;
            format!(
                ", {} so far, at most {} more",
                clock(started.elapsed().as_secs_f64()),
                clock(mean * (n - k) as f64)
            )
        }
    };
    crate::esay!("xtrain: plan [{}/{n}{eta}] compiling {}", k + 1, s.line());
}
