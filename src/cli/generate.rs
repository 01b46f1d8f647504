//! `xtrain generate`: a prompt in, the model's continuation out.

use anyhow::{bail, Result};
use clap::Args;
use std::path::PathBuf;
use xtrain::device::generate::Stop;

#[derive(Args)]
pub struct GenerateArgs {
    /// Hugging Face model directory (with tokenizer.json), or a repo id (org/name) in the hub
    /// cache.
    #[arg(long)]
    pub model: PathBuf,
    /// With a repo id: the branch, tag or commit (default main).
    #[arg(long)]
    pub revision: Option<String>,
    /// A PEFT adapter directory to apply.
    #[arg(long)]
    pub adapter: Option<PathBuf>,
    /// The user message (rendered with the model's chat template unless --raw).
    #[arg(long)]
    pub prompt: String,
    /// Use the prompt as raw text, without the chat template.
    #[arg(long)]
    pub raw: bool,
    /// Maximum new tokens (at least 1).
    #[arg(long, default_value_t = 64)]
    pub max_new_tokens: usize,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// Seed of the sampler (with --temperature above 0; greedy decoding does not use it).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Context length of the compiled program (prompt + new tokens must fit).
    #[arg(long, default_value_t = 256)]
    pub context: i64,
    /// PJRT plugin: cpu, cuda, rocm, tpu or a path to a plugin .so (default: $XTRAIN_PLUGIN or
    /// cpu).
    #[arg(long)]
    pub plugin: Option<String>,
}

pub fn generate(mut a: GenerateArgs) -> Result<()> {
    if a.max_new_tokens == 0 {
        bail!("--max-new-tokens must be at least 1 (0 would generate nothing)");
    }
    if a.context < 2 {
        bail!(
            "--context must be at least 2 (a prompt token and one generated), got {}",
            a.context
        );
    }
    if !(a.temperature.is_finite() && a.temperature >= 0.0) {
        bail!(
            "--temperature must be a number >= 0 (0 = greedy), got {}",
            a.temperature
        );
    }
    a.model = crate::cli::model::model_dir(&a.model, a.revision.as_deref(), "generate")?;
    let cfg = xtrain::model::config::LlamaConfig::load(&a.model)?;
    if a.context > cfg.max_position_embeddings {
        bail!(
            "--context {} is longer than the model's max_position_embeddings {} (config.json): it \
             was not trained on positions past that; use --context {} or less",
            a.context,
            cfg.max_position_embeddings,
            cfg.max_position_embeddings
        );
    }
    if let Some(w) = cfg.sliding_window.filter(|w| a.context > *w) {
        bail!(
            "--context {} is longer than the model's sliding window of {w} tokens (config.json's \
             `sliding_window`): its layers let a token see only the last {w} tokens, itself \
             included, which xtrain's attention does not implement; use --context {w} or less",
            a.context
        );
    }
    let tok = xtrain::data::text::TextTokenizer::load(&a.model)?;
    let text = if a.raw {
        a.prompt.clone()
    } else {
        tok.render_chat(
            &[xtrain::data::text::Message {
                role: "user".into(),
                content: a.prompt.clone(),
            }],
            true,
        )?
    };
    let ids = tok.encode(&text)?;
    let adapter = match &a.adapter {
        Some(d) => {
            xtrain::formats::gguf::export::warn_if_trained_on_nf4(d, "generate");
            xtrain::formats::adapter_base::warn_if_another_base(d, &a.model, "generate");
            Some(xtrain::formats::peft::load_adapter(d, &cfg)?)
        }
        None => None,
    };
    let rt = xtrain::device::runtime::Runtime::open(a.plugin.as_deref(), Some(1))?;
    let f = xtrain::device::generate::Forward::new(
        &rt,
        &cfg,
        &a.model,
        adapter.as_ref().map(|(c, t)| (c, t)),
        xtrain::device::generate::Kind::NextToken,
        1,
        a.context,
        hlo::DType::F32,
    )?;
    let (out, stop) = xtrain::device::generate::generate_until(
        &f,
        &ids,
        a.max_new_tokens,
        a.temperature,
        a.seed,
        tok.eos_id,
    )?;
    xtrain::say!("{}", tok.decode(&out)?);
    if stop == Stop::Context {
        xtrain::esay!(
            "xtrain: stopped at the context limit after {} new tokens (--context {}: the prompt takes {} tokens); raise --context for a longer answer",
            out.len(),
            a.context,
            ids.len()
        );
    }
    Ok(())
}
