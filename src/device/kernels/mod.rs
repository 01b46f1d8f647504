//! Kernels: a target's own implementation of a composite op of the program, put in place of the
//! composite's decomposition just before the target's compiler sees the text.
//!
//! The program dir keeps the one program for every target (`stablehlo.composite` ops whose
//! decompositions every plugin can inline: `model::flash`'s attention). A kernel is looked up
//! by the composite's name and version and by the platform it runs on; where one is chosen
//! (`--kernel NAME`), the decomposition's function is rewritten with the kernel's body and the
//! build records which kernel replaced what ([`KernelUse`], in the manifest's builds), so that
//! a run says what it ran. The composite's attributes (read and checked by the contract in
//! `model::flash`) and the decomposition's signature are all a kernel is given: it needs
//! nothing else of the program.
//!
//! Built in:
//! - `every-key`: attention over every key at once in plain StableHLO (a reference for the
//!   mechanism and for the nested loops it replaces, any platform);
//! - `cudnn`: cuDNN's fused flash attention on NVIDIA GPUs, as custom calls in the function's
//!   body (one device's whole sequence, one document per row; see [`cudnn`]);
//! - `cudnn-standin`: the same kernel with plain StableHLO computing what cuDNN's calls compute
//!   in their place, for any plugin: the CPU checks the layout changes around the calls, the
//!   head grouping and the row rule against the loops (the calls themselves need a GPU).
//!
//! Pallas splash attention on TPUs or a ROCm kernel would plug in the same way:
//! docs/architecture.md says how.

mod cudnn;
mod every_key;
mod site;

pub use crate::formats::program_dir::KernelUse;
use anyhow::{bail, Context, Result};
use hlo::Func;
pub use site::Site;

/// A kernel's rule for a batch's `attention_mask` ([B, T] row-major, and T).
type RowRule = fn(&[i32], usize) -> Result<()>;

/// One implementation of one composite.
pub struct Kernel {
    /// The name `--kernel` takes (one name may cover several composites, e.g. an op and its
    /// gradient).
    pub name: &'static str,
    pub composite: &'static str,
    pub version: i32,
    /// The platforms it may run on (PJRT's names: cpu, cuda, rocm, tpu).
    pub platforms: &'static [&'static str],
    build: fn(&Site) -> Result<Func>,
    /// What the kernel asks of each batch's `attention_mask` ([B, T], row-major), where it
    /// covers fewer layouts than the composite: checked before every step that uses it.
    rows: Option<RowRule>,
}

const ALL_PLATFORMS: &[&str] = &["cpu", "cuda", "rocm", "tpu"];

/// The built-in kernels.
pub const KERNELS: &[Kernel] = &[
    Kernel {
        name: "every-key",
        composite: crate::model::flash::ATTENTION,
        version: crate::model::flash::VERSION,
        platforms: ALL_PLATFORMS,
        build: every_key::every_key_forward,
        rows: None,
    },
    Kernel {
        name: "every-key",
        composite: crate::model::flash::ATTENTION_GRAD,
        version: crate::model::flash::VERSION,
        platforms: ALL_PLATFORMS,
        build: every_key::every_key_backward,
        rows: None,
    },
    Kernel {
        name: "cudnn",
        composite: crate::model::flash::ATTENTION,
        version: crate::model::flash::VERSION,
        platforms: &["cuda"],
        build: cudnn::forward,
        rows: Some(cudnn::check_rows),
    },
    Kernel {
        name: "cudnn",
        composite: crate::model::flash::ATTENTION_GRAD,
        version: crate::model::flash::VERSION,
        platforms: &["cuda"],
        build: cudnn::backward,
        rows: Some(cudnn::check_rows),
    },
    Kernel {
        name: "cudnn-standin",
        composite: crate::model::flash::ATTENTION,
        version: crate::model::flash::VERSION,
        platforms: ALL_PLATFORMS,
        build: cudnn::stand_in_forward,
        rows: Some(cudnn::check_rows),
    },
    Kernel {
        name: "cudnn-standin",
        composite: crate::model::flash::ATTENTION_GRAD,
        version: crate::model::flash::VERSION,
        platforms: ALL_PLATFORMS,
        build: cudnn::stand_in_backward,
        rows: Some(cudnn::check_rows),
    },
];

/// Whether the kernel `name` takes only rows of one document (its batches are checked, and a
/// run that packs rows is refused before it starts).
pub fn needs_one_document_rows(name: &str) -> bool {
    KERNELS.iter().any(|k| k.name == name && k.rows.is_some())
}

/// Refuse a batch that a chosen kernel would compute wrongly (see [`Kernel`]'s `rows`), by
/// row and token. `attention_mask` [B, T] is read only where a kernel has a rule, and each
/// rule runs once (a kernel's forward and gradient entries share theirs).
pub fn check_batch(kernels: &[&Kernel], attention_mask: &pjrt::HostTensor) -> Result<()> {
    let mut rules: Vec<(&str, RowRule)> = kernels
        .iter()
        .filter_map(|k| Some((k.name, k.rows?)))
        .collect();
    rules.dedup_by_key(|(name, _)| *name);
    if rules.is_empty() {
        return Ok(());
    }
    let mask = attention_mask.to_i32()?;
    let seq = attention_mask.dims.get(1).copied().unwrap_or(1) as usize;
    for (name, rule) in rules {
        rule(&mask, seq).map_err(|e| anyhow::anyhow!("--kernel {name}: {e}"))?;
    }
    Ok(())
}

/// The kernels `--kernel NAME` names, for `platform`; a clear refusal for an unknown name or
/// one that does not run there.
pub fn chosen(names: &[String], platform: &str) -> Result<Vec<&'static Kernel>> {
    let mut out = Vec::new();
    for (i, name) in names.iter().enumerate() {
        if names[..i].contains(name) {
            continue; // named twice: the same choice
        }
        let all: Vec<&Kernel> = KERNELS.iter().filter(|k| k.name == name).collect();
        if all.is_empty() {
            let mut known: Vec<&str> = KERNELS.iter().map(|k| k.name).collect();
            known.dedup();
            bail!(
                "--kernel {name}: no such kernel (built in: {})",
                known.join(", ")
            );
        }
        let here: Vec<&Kernel> = all
            .into_iter()
            .filter(|k| k.platforms.contains(&platform))
            .collect();
        if here.is_empty() {
            bail!("--kernel {name} does not run on the {platform} plugin");
        }
        for k in &here {
            if let Some(other) = out
                .iter()
                .find(|o: &&&Kernel| o.composite == k.composite && o.version == k.version)
            {
                bail!(
                    "--kernel {} and --kernel {name} both implement {} v{}: choose one",
                    other.name,
                    k.composite,
                    k.version
                );
            }
        }
        out.extend(here);
    }
    Ok(out)
}

/// Say which composites the chosen kernels replace (nothing where none were): the caller's
/// word, once per run or build, of what [`replace`] did.
pub fn announce(used: &[KernelUse]) {
    if !used.is_empty() {
        let list: Vec<String> = used.iter().map(|u| u.to_string()).collect();
        crate::esay!(
            "xtrain: kernels in place of composites: {} (the program's text is unchanged)",
            list.join(", ")
        );
    }
}

/// A program's text as a runtime's compiler sees it: the chosen kernels in place of the
/// composites they implement, and what they replaced (for the build's record).
#[derive(Clone, Debug)]
pub struct Replaced {
    pub text: String,
    pub uses: Vec<KernelUse>,
}

/// The texts a runtime's kernels rewrote, each kept by the sha256 of the program text it came
/// from: a program is read, checked and rewritten once however often it is compiled, keyed or
/// recorded.
#[derive(Debug, Default)]
pub struct Rewritten(std::sync::Mutex<Vec<(String, std::sync::Arc<Replaced>)>>);

impl Rewritten {
    /// `text` with `kernels` in place (see [`replace`]), rewritten on the first call only.
    pub fn get(&self, text: &str, kernels: &[&Kernel]) -> Result<std::sync::Arc<Replaced>> {
        if kernels.is_empty() {
            // Nothing to rewrite or keep: the text as it is.
            return Ok(std::sync::Arc::new(Replaced {
                text: text.to_string(),
                uses: Vec::new(),
            }));
        }
        let key = crate::formats::program_dir::sha256_hex(text.as_bytes());
        let mut kept = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, r)) = kept.iter().find(|(k, _)| *k == key) {
            return Ok(r.clone());
        }
        let (text, uses) = replace(text, kernels)?;
        let r = std::sync::Arc::new(Replaced { text, uses });
        kept.push((key, r.clone()));
        Ok(r)
    }

    /// Forget every text (the kernels changed).
    pub fn clear(&self) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }
}

/// `text` with the decomposition of every composite a kernel of `kernels` implements replaced
/// by that kernel, and what was replaced (nothing: the text as it was). A composite no kernel
/// names keeps its decomposition; a kernel whose composite the program lacks is not used. The
/// text is read and rewritten by `hlo`'s reader, beside the printer that wrote it. A chosen
/// kernel whose composite the program lacks is refused: a `--kernel` that would change nothing.
pub fn replace(text: &str, kernels: &[&Kernel]) -> Result<(String, Vec<KernelUse>)> {
    let mut out = text.to_string();
    let mut uses: Vec<KernelUse> = Vec::new();
    let mut done: Vec<String> = Vec::new();
    for call in hlo::composite_calls(text)? {
        let Some(k) = kernels
            .iter()
            .find(|k| k.composite == call.name && k.version == call.version)
        else {
            continue;
        };
        if done.contains(&call.decomposition) {
            continue;
        }
        let func = Site::of(&call)
            .and_then(|site| (k.build)(&site))
            .with_context(|| format!("kernel {} for {}", k.name, call.name))?;
        out = hlo::replace_function(&out, &call.decomposition, &func).with_context(|| {
            format!(
                "kernel {} in place of {} v{} (line {})",
                k.name, call.name, call.version, call.line
            )
        })?;
        done.push(call.decomposition.clone());
        let u = KernelUse {
            composite: call.name.clone(),
            version: call.version,
            kernel: k.name.to_string(),
        };
        if !uses.contains(&u) {
            uses.push(u);
        }
    }
    for k in kernels {
        if !uses.iter().any(|u| u.kernel == k.name) {
            bail!(
                "--kernel {}: the program has no composite it implements ({} v{}: attention is \
                 one with --key-block or a context mesh)",
                k.name,
                k.composite,
                k.version
            );
        }
    }
    Ok((out, uses))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A runtime's texts: each program rewritten once and kept (the same text back, not
    /// rewritten again), and a kernel whose composite the program lacks refused by name.
    #[test]
    fn a_program_is_rewritten_once_and_a_kernel_that_replaces_nothing_is_refused() {
        let cfg = crate::model::presets::preset_config("tiny-llama3")
            .unwrap()
            .unwrap();
        let lora = crate::model::lora::LoraConfig {
            r: 2,
            alpha: 4.0,
            dropout: 0.0,
            targets: vec![crate::model::lora::Projection::Q],
        };
        let mut spec =
            crate::program::StepSpec::new(cfg, lora, 1, 16, hlo::DType::F32).with_default_form();
        spec.key_block = Some(4);
        let with = crate::program::build_train_step(&spec).unwrap();
        spec.key_block = None;
        let without = crate::program::build_train_step(&spec).unwrap();
        let kernels = chosen(&["every-key".into()], "cpu").unwrap();
        let kept = Rewritten::default();
        let first = kept.get(&with.text, &kernels).unwrap();
        let again = kept.get(&with.text, &kernels).unwrap();
        assert!(std::sync::Arc::ptr_eq(&first, &again));
        assert_eq!(first.uses.len(), 2);
        assert_ne!(first.text, with.text);
        let e = kept.get(&without.text, &kernels).unwrap_err().to_string();
        assert!(
            e.contains("--kernel every-key: the program has no composite it implements"),
            "{e}"
        );
        assert_eq!(kept.get(&without.text, &[]).unwrap().text, without.text);
    }

    /// A kernel with a row rule refuses a packed batch by row and token; one without takes it.
    #[test]
    fn batches_are_checked_by_the_chosen_kernels_rules() {
        let packed = pjrt::HostTensor::from_i32(&[1, 1, 1, 1, 1, 1, 3, 3], &[2, 4]);
        let reference = chosen(&["every-key".into()], "cpu").unwrap();
        check_batch(&reference, &packed).unwrap();
        let stand_in = chosen(&["cudnn-standin".into()], "cpu").unwrap();
        let e = check_batch(&stand_in, &packed).unwrap_err().to_string();
        assert!(
            e.contains(
                "--kernel cudnn-standin: row 1 holds several documents (a second one starts at token 2)"
            ),
            "{e}"
        );
        let one_each = pjrt::HostTensor::from_i32(&[1, 1, 1, 0, 1, 1, 1, 1], &[2, 4]);
        check_batch(&stand_in, &one_each).unwrap();
    }

    #[test]
    fn unknown_kernels_and_platforms_are_refused_by_name() {
        let e = chosen(&["fast".into()], "cpu").err().unwrap().to_string();
        assert!(
            e.contains("--kernel fast: no such kernel (built in: every-key, cudnn, cudnn-standin)"),
            "{e}"
        );
        assert_eq!(chosen(&["every-key".into()], "tpu").unwrap().len(), 2);
        let two = chosen(&["cudnn".into(), "every-key".into()], "cuda");
        let e = two.err().unwrap().to_string();
        assert!(
            e.contains("--kernel cudnn and --kernel every-key both implement xtrain.attention v1: choose one"),
            "{e}"
        );
        let e = chosen(&["cudnn".into()], "cpu").err().unwrap().to_string();
        assert!(
            e.contains("--kernel cudnn does not run on the cpu plugin"),
            "{e}"
        );
    }
}
