//! Text in and out: the model's tokenizer (`tokenizer.json`, via the `tokenizers` crate) and its
//! chat template (from `tokenizer_config.json` or `chat_template.jinja`, run by minijinja).

use anyhow::{bail, Context, Result};
use serde_json::Value as Json;
use std::path::Path;

/// One chat message.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

pub struct TextTokenizer {
    tok: tokenizers::Tokenizer,
    template: String,
    pub bos: Option<String>,
    pub eos: Option<String>,
    pub eos_id: Option<u32>,
    pub pad_id: u32,
    /// The tokenizer config's own `eos_token`, as transformers reads it (`eos` may be the chat
    /// template's end-of-turn token instead): what TRL appends to plain-text completions.
    pub eos_token: Option<String>,
}

/// Llama 3's header format, used when a model ships no template but has Llama 3's special tokens.
const LLAMA3_TEMPLATE: &str = "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content | trim }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}";
/// ChatML, for models with `<|im_start|>` and no template.
const CHATML_TEMPLATE: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

fn token_text(v: Option<&Json>) -> Option<String> {
    match v? {
        Json::String(s) => Some(s.clone()),
        Json::Object(o) => o.get("content").and_then(|c| c.as_str()).map(String::from),
        _ => None,
    }
}

/// The template named `name` in a list-form `chat_template` (`[{"name", "template"}, ...]`,
/// as transformers writes a tokenizer with several): transformers uses `default` unless told
/// otherwise, and refuses a list without one.
fn named_template(list: &[Json], name: &str) -> Result<String> {
    let mut names = Vec::new();
    for entry in list {
        let n = entry.get("name").and_then(|n| n.as_str());
        let t = entry.get("template").and_then(|t| t.as_str());
        match (n, t) {
            (Some(n), Some(t)) if n == name => return Ok(t.to_string()),
            (Some(n), Some(_)) => names.push(n.to_string()),
            _ => bail!("`chat_template` is a list whose entries are not {{\"name\", \"template\"}} objects"),
        }
    }
    bail!(
        "`chat_template` lists templates named {} but none named `{name}`, which is the one used",
        names.join(", ")
    )
}

impl TextTokenizer {
    pub fn load(dir: &Path) -> Result<TextTokenizer> {
        let path = dir.join("tokenizer.json");
        if !path.is_file() {
            bail!("{} has no tokenizer.json", dir.display());
        }
        let tok = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        let cfg: Json = match std::fs::read_to_string(dir.join("tokenizer_config.json")) {
            Ok(t) => serde_json::from_str(&t).with_context(|| {
                format!(
                    "{} is not valid JSON",
                    dir.join("tokenizer_config.json").display()
                )
            })?,
            Err(_) => Json::Null,
        };
        let jinja = std::fs::read_to_string(dir.join("chat_template.jinja")).ok();
        let vocab_has = |t: &str| tok.token_to_id(t).is_some();
        let template = match (cfg.get("chat_template"), jinja) {
            (Some(Json::String(t)), _) => t.clone(),
            (Some(Json::Array(list)), _) => named_template(list, "default")
                .with_context(|| format!("{}", dir.join("tokenizer_config.json").display()))?,
            (_, Some(t)) => t,
            _ if vocab_has("<|start_header_id|>") => LLAMA3_TEMPLATE.to_string(),
            _ if vocab_has("<|im_start|>") => CHATML_TEMPLATE.to_string(),
            _ => "{% for m in messages %}{{ m.content }}\n{% endfor %}".to_string(),
        };
        let bos = token_text(cfg.get("bos_token"));
        let eos_token = token_text(cfg.get("eos_token"));
        let mut eos = eos_token.clone();
        // Chat models end a turn with their end-of-turn token; prefer it for stopping.
        for t in ["<|im_end|>", "<|eot_id|>"] {
            if template.contains(t) && vocab_has(t) {
                eos = Some(t.to_string());
            }
        }
        let eos_id = eos.as_deref().and_then(|t| tok.token_to_id(t));
        let pad_id = token_text(cfg.get("pad_token"))
            .and_then(|t| tok.token_to_id(&t))
            .or(eos_id)
            .unwrap_or(0);
        Ok(TextTokenizer {
            tok,
            template,
            bos,
            eos,
            eos_id,
            pad_id,
            eos_token,
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.tok.get_vocab_size(true)
    }

    /// Token ids of `text`, special tokens in it recognised, nothing added.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .tok
            .encode(text, false)
            .map_err(|e| anyhow::anyhow!("tokenizer: {e}"))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Token ids of `text` as transformers' `tokenizer(text)` gives them: special tokens in it
    /// recognised, and the tokenizer's own additions (its post-processor: a BOS) made.
    pub fn encode_with_specials(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .tok
            .encode(text, true)
            .map_err(|e| anyhow::anyhow!("tokenizer: {e}"))?;
        Ok(enc.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.tok
            .decode(ids, true)
            .map_err(|e| anyhow::anyhow!("tokenizer: {e}"))
    }

    /// Render messages with the model's chat template.
    pub fn render_chat(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        let mut env = minijinja::Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_template("chat", &self.template)
            .context("the chat template does not parse")?;
        let ctx = minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos.clone().unwrap_or_default(),
            eos_token => self.eos.clone().unwrap_or_default(),
        };
        env.get_template("chat")?
            .render(ctx)
            .context("rendering the chat template")
    }
}
