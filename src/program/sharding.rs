//! Device meshes and sharding rules: every weight and input carries logical axis names
//! (vocab, embed, q_heads, kv_heads, mlp, rank, layers, batch, length) and a rule table maps
//! logical axes to mesh axes, as MaxText does. Host-side, tensors are split into the shard each
//! device holds and reassembled from shards.

use anyhow::{bail, Context, Result};
use hlo::{Mesh, Sharding};
use std::collections::BTreeMap;

/// Parse `data=2,fsdp=4,tensor=1`. Axes of size 1 are dropped (they shard nothing).
pub fn parse_mesh(s: &str) -> Result<Mesh> {
    let mut axes = Vec::new();
    for part in s.split(',').filter(|p| !p.trim().is_empty()) {
        let (name, size) = part
            .split_once('=')
            .with_context(|| format!("--mesh: `{part}` is not axis=size"))?;
        let size: i64 = size
            .trim()
            .parse()
            .with_context(|| format!("--mesh: `{size}` is not a number"))?;
        let name = name.trim();
        if size < 1
            || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
            || name.is_empty()
        {
            bail!("--mesh: bad axis `{part}`");
        }
        if axes.iter().any(|(n, _): &(String, i64)| n == name) {
            bail!("--mesh: axis `{name}` given twice");
        }
        if size > 1 {
            axes.push((name.to_string(), size));
        }
    }
    Ok(Mesh { axes })
}

/// The logical axes tensors carry (see [`logical_axes`]), which rules may map to mesh axes.
pub const LOGICAL_AXES: [&str; 9] = [
    "batch", "length", "embed", "mlp", "q_heads", "kv_heads", "vocab", "rank", "layers",
];

/// ` (did you mean `x`?)` for the known name closest to `name`, when one is close.
pub fn did_you_mean<'a>(name: &str, known: impl Iterator<Item = &'a str>) -> String {
    known
        .map(|k| (crate::program::spelling::edit_distance(name, k), k))
        .filter(|(d, k)| *d <= 2 && *d < k.len())
        .min()
        .map(|(_, k)| format!(" (did you mean `{k}`?)"))
        .unwrap_or_default()
}

/// Refuse mesh axes that no rule places a tensor on: such an axis would only replicate (a typo
/// like `fdsp`, or `dp`, `model`, which the rules do not know).
pub fn check_axes(axes: &[(String, i64)], rules: &Rules) -> Result<()> {
    let mut known: Vec<&str> = rules.0.values().flatten().map(|s| s.as_str()).collect();
    known.sort();
    known.dedup();
    for (name, _) in axes {
        if !known.contains(&name.as_str()) {
            bail!(
                "--mesh: unknown axis `{name}`{}; the sharding rules place tensors on {} (--sharding-rules FILE maps logical axes to other names)",
                did_you_mean(name, known.iter().copied()),
                known.join(", ")
            );
        }
    }
    Ok(())
}

/// A mesh axis that would split nothing on a program ([`check_splits`]).
#[derive(Debug)]
pub struct SplitsNothing {
    /// The axis and its size.
    pub axis: String,
    pub size: i64,
    /// The dimensions its rules apply to, as `batch 4`, and their sizes.
    pub tried: Vec<String>,
    pub sizes: Vec<i64>,
    /// The other mesh axes of the rules that, in its place at the same size, would split
    /// something (`tensor`).
    pub would_split: Vec<String>,
}

impl SplitsNothing {
    /// Why: `no dimension it applies to is divisible by 3 (batch 4), so every tensor would be
    /// replicated over it`.
    pub fn why(&self) -> String {
        format!(
            "no dimension it applies to is divisible by {} ({}), so every tensor would be \
             replicated over it",
            self.size,
            if self.tried.is_empty() {
                "none".to_string()
            } else {
                self.tried.join(", ")
            }
        )
    }
}

impl std::fmt::Display for SplitsNothing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "--mesh {}={} splits nothing: {}; choose a size that divides them",
            self.axis,
            self.size,
            self.why()
        )
    }
}

impl std::error::Error for SplitsNothing {}

/// Whether mesh axis `name` of `axes` splits some dimension of `tensors` under `rules`.
fn splits(
    name: &str,
    axes: &[(String, i64)],
    rules: &Rules,
    tensors: &[(String, Vec<i64>)],
) -> bool {
    let mesh = Mesh {
        axes: axes.to_vec(),
    };
    tensors.iter().any(|(t, shape)| {
        let logical = logical_axes(t, shape.len());
        rules
            .sharding(&logical, shape, &mesh)
            .dims
            .iter()
            .any(|d| d.iter().any(|a| a == name))
    })
}

/// Refuse a mesh axis that would split nothing on this program: no dimension its rules give it
/// (the batch, the weights' dims) is divisible by its size, so every tensor would be replicated
/// over it. `tensors` are (name, shape) of the program's weights and batch. The error is a
/// [`SplitsNothing`].
pub fn check_splits(
    axes: &[(String, i64)],
    rules: &Rules,
    tensors: &[(String, Vec<i64>)],
) -> Result<()> {
    for (name, size) in axes {
        if splits(name, axes, rules, tensors) {
            continue;
        }
        let mut tried: Vec<String> = Vec::new();
        let mut sizes: Vec<i64> = Vec::new();
        for (t, shape) in tensors {
            for (l, d) in logical_axes(t, shape.len()).iter().zip(shape) {
                let entry = format!("{l} {d}");
                if rules.0.get(*l).is_some_and(|m| m.contains(name)) && !tried.contains(&entry) {
                    tried.push(entry);
                    sizes.push(*d);
                }
            }
        }
        let mut others: Vec<&String> = rules.0.values().flatten().collect();
        others.sort();
        others.dedup();
        let would_split = others
            .into_iter()
            .filter(|o| !axes.iter().any(|(a, _)| a == *o))
            .filter(|o| {
                let instead: Vec<(String, i64)> = axes
                    .iter()
                    .map(|(a, n)| (if a == name { (*o).clone() } else { a.clone() }, *n))
                    .collect();
                splits(o, &instead, rules, tensors)
            })
            .cloned()
            .collect();
        return Err(SplitsNothing {
            axis: name.clone(),
            size: *size,
            tried,
            sizes,
            would_split,
        }
        .into());
    }
    Ok(())
}

/// Logical axis -> mesh axes, in priority order.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Rules(pub BTreeMap<String, Vec<String>>);

impl Default for Rules {
    /// Llama defaults: tensor parallel over heads, MLP and vocab; FSDP over the first dim that
    /// takes it (a projection's output dim, else the embedding dim), so that every weight, LoRA
    /// matrix and optimizer moment is split over the FSDP axis; data (and FSDP) over the batch;
    /// context over the sequence (see `model::context`), and over the weights after FSDP, so
    /// that devices that share a sequence share its weights' memory too, as FSDP devices do
    /// (an activation's sequence dim comes first and takes it there).
    /// LoRA's rank and the layer axis are never sharded.
    fn default() -> Self {
        let mut m = BTreeMap::new();
        for (logical, mesh) in [
            ("batch", vec!["data", "fsdp"]),
            ("length", vec!["context"]),
            ("embed", vec!["fsdp", "context"]),
            ("mlp", vec!["tensor", "fsdp", "context"]),
            ("q_heads", vec!["tensor", "fsdp", "context"]),
            ("kv_heads", vec!["tensor", "fsdp", "context"]),
            ("vocab", vec!["tensor", "fsdp", "context"]),
        ] {
            m.insert(
                logical.to_string(),
                mesh.into_iter().map(String::from).collect(),
            );
        }
        Rules(m)
    }
}

impl Rules {
    /// Defaults overridden by the text of a rules file (`file` names it in messages; the file
    /// is read by `formats::sharding_rules`: nothing here reads a file): one
    /// `logical = mesh_axis[,mesh_axis]` per line (empty right side = replicated), `#` comments.
    pub fn parse(text: &str, file: &std::path::Path) -> Result<Rules> {
        let path = file;
        let mut r = Rules::default();
        for (i, line) in text.lines().enumerate() {
            let line = line.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let (k, v) = line.split_once('=').with_context(|| {
                format!(
                    "{}:{}: expected `logical = mesh axes`",
                    path.display(),
                    i + 1
                )
            })?;
            let axes: Vec<String> = v
                .split(',')
                .map(|a| a.trim().to_string())
                .filter(|a| !a.is_empty())
                .collect();
            let k = k.trim();
            if !LOGICAL_AXES.contains(&k) {
                bail!(
                    "{}:{}: unknown logical axis `{k}`{} (the axes tensors have are {})",
                    path.display(),
                    i + 1,
                    did_you_mean(k, LOGICAL_AXES.iter().copied()),
                    LOGICAL_AXES.join(", ")
                );
            }
            if let Some(bad) = axes
                .iter()
                .find(|a| !a.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
            {
                bail!(
                    "{}:{}: `{bad}` is not a mesh axis name",
                    path.display(),
                    i + 1
                );
            }
            r.0.insert(k.to_string(), axes);
        }
        Ok(r)
    }

    /// The sharding of a tensor with these logical axes and dims: each dim takes its rule's mesh
    /// axes that exist, are unused by an earlier dim, and keep the dim divisible.
    pub fn sharding(&self, logical: &[&str], dims: &[i64], mesh: &Mesh) -> Sharding {
        let mut used: Vec<String> = Vec::new();
        let mut out = Vec::new();
        for (l, &d) in logical.iter().zip(dims) {
            let mut axes = Vec::new();
            let mut split = 1;
            for a in self.0.get(*l).map(|v| v.as_slice()).unwrap_or(&[]) {
                let Some(size) = mesh.axis_size(a) else {
                    continue;
                };
                if used.contains(a) || d % (split * size) != 0 {
                    continue;
                }
                split *= size;
                axes.push(a.clone());
                used.push(a.clone());
            }
            out.push(axes);
        }
        Sharding { dims: out }
    }
}

/// The logical axes of a program argument, from its name and rank.
pub fn logical_axes(name: &str, rank: usize) -> Vec<&'static str> {
    let base = name
        .trim_start_matches("exp_avg_sq.")
        .trim_start_matches("exp_avg.");
    let stacked = base.contains("layers.*.");
    let (out_ax, in_ax) = if base.contains("q_proj") {
        ("q_heads", "embed")
    } else if base.contains("k_proj") || base.contains("v_proj") {
        ("kv_heads", "embed")
    } else if base.contains("o_proj") {
        ("embed", "q_heads")
    } else if base.contains("gate_proj") || base.contains("up_proj") {
        ("mlp", "embed")
    } else if base.contains("down_proj") {
        ("embed", "mlp")
    } else {
        ("", "")
    };
    let mut axes: Vec<&'static str> = if base.contains("lora_A") {
        vec!["rank", in_ax]
    } else if base.contains("lora_B") {
        vec![out_ax, "rank"]
    } else if !out_ax.is_empty() && base.ends_with(".bias") {
        // A projection's bias is split as its outputs are.
        vec![out_ax]
    } else if !out_ax.is_empty() {
        vec![out_ax, in_ax]
    } else if base.contains("embed_tokens") || base.starts_with("lm_head") {
        vec!["vocab", "embed"]
    } else if base.contains("q_norm") || base.contains("k_norm") {
        // One weight over a head's dims, shared by the heads: whole on every device.
        vec!["none"]
    } else if base.contains("norm") {
        vec!["embed"]
    } else if matches!(base, "input_ids" | "labels" | "attention_mask") {
        vec!["batch", "length"]
    } else {
        vec!["none"; rank]
    };
    if stacked {
        axes.insert(0, "layers");
    }
    axes.truncate(rank);
    while axes.len() < rank {
        axes.push("none");
    }
    axes
}

/// Mesh coordinates of partition `p` (row-major over the mesh axes, as Shardy numbers devices).
pub fn coords(mesh: &Mesh, p: usize) -> BTreeMap<String, i64> {
    let mut rest = p as i64;
    let mut out = BTreeMap::new();
    for (name, size) in mesh.axes.iter().rev() {
        out.insert(name.clone(), rest % size);
        rest /= size;
    }
    out
}

/// Start offsets and sizes of partition `p`'s shard of a tensor.
pub fn shard_box(dims: &[i64], sharding: &Sharding, mesh: &Mesh, p: usize) -> (Vec<i64>, Vec<i64>) {
    let c = coords(mesh, p);
    let mut starts = Vec::new();
    let mut sizes = Vec::new();
    for (&d, axes) in dims.iter().zip(&sharding.dims) {
        // The first axis listed is the most major part of the split.
        let (mut index, mut parts) = (0, 1);
        for a in axes {
            let size = mesh.axis_size(a).unwrap_or(1);
            index = index * size + c.get(a).copied().unwrap_or(0);
            parts *= size;
        }
        let n = d / parts;
        starts.push(index * n);
        sizes.push(n);
    }
    (starts, sizes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_respect_divisibility_and_axis_reuse() {
        let mesh = parse_mesh("data=2,fsdp=4,tensor=1").unwrap();
        assert_eq!(mesh.axes.len(), 2, "size-1 axes are dropped");
        let r = Rules::default();
        // batch 2 cannot take data x fsdp = 8; it takes data only.
        assert_eq!(
            r.sharding(&["batch", "length"], &[2, 16], &mesh).dims,
            vec![vec!["data".to_string()], vec![]]
        );
        assert_eq!(
            r.sharding(&["batch", "length"], &[8, 16], &mesh).dims,
            vec![vec!["data".to_string(), "fsdp".to_string()], vec![]]
        );
        assert_eq!(
            logical_axes(
                "base_model.model.model.layers.*.mlp.down_proj.lora_B.weight",
                3
            ),
            vec!["layers", "embed", "rank"]
        );
        assert_eq!(
            logical_axes("exp_avg.model.layers.0.self_attn.q_proj.weight", 2),
            vec!["q_heads", "embed"]
        );
    }
}
