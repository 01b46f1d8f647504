//! The attention composites' contract, written once: their names and version, their operands
//! (forward and backward, in order and by name), and their attributes with the names the
//! program text gives them. The loops that decompose them (`loops`) and every kernel that
//! replaces them (`device::kernels`) read operands and attributes through these types, never
//! by position or by a name typed again: a new operand (segment ids, say) is added here and
//! nowhere shifts.

use hlo::{Attr, CompositeCall, Shape};
use std::fmt;

/// The composites' names and version: what a kernel that replaces them is looked up by.
pub const ATTENTION: &str = "xtrain.attention";
pub const ATTENTION_GRAD: &str = "xtrain.attention_grad";
pub const VERSION: i32 = 1;

/// Which keys a query sees, as the `causal` attribute names it: the natural positions of the
/// device's two query chunks (ids c0, c1 with c0 + c1 = NC - 1) and of every key chunk, keys
/// no later than the query and in its document (see `model::flash`).
pub const CAUSAL_RULE: &str = "balanced_chunk_pairs";

/// The forward composite's operands (-> out, lse), in the loops' layout: q
/// [B, KV, 2, Cp, G, D], k and v [B, KV, NC Cp, D], query starts [B, 2, Cp], key starts
/// [B, NC Cp] (-1 for padding), chunk ids [2]. Also the same operands in the model's layout
/// before they are laid out (`flash::attend`), and their shardings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Operands<T> {
    pub q: T,
    pub k: T,
    pub v: T,
    pub query_docs: T,
    pub key_docs: T,
    pub chunk_ids: T,
}

impl<T: Clone> Operands<T> {
    /// The operands' names, in order: the decomposition's parameter names.
    pub const NAMES: [&'static str; 6] = ["q", "k", "v", "query_docs", "key_docs", "chunk_ids"];

    /// The operands from a list in [`Self::NAMES`]' order (at least that long: the rest is
    /// ignored).
    pub fn of(list: &[T]) -> Operands<T> {
        Operands {
            q: list[0].clone(),
            k: list[1].clone(),
            v: list[2].clone(),
            query_docs: list[3].clone(),
            key_docs: list[4].clone(),
            chunk_ids: list[5].clone(),
        }
    }

    pub fn list(&self) -> Vec<T> {
        vec![
            self.q.clone(),
            self.k.clone(),
            self.v.clone(),
            self.query_docs.clone(),
            self.key_docs.clone(),
            self.chunk_ids.clone(),
        ]
    }

    pub fn named(&self) -> Vec<(&'static str, T)> {
        Self::NAMES.into_iter().zip(self.list()).collect()
    }

    /// The same operands, each mapped.
    pub fn map<U>(&self, mut f: impl FnMut(&T) -> U) -> Operands<U> {
        Operands {
            q: f(&self.q),
            k: f(&self.k),
            v: f(&self.v),
            query_docs: f(&self.query_docs),
            key_docs: f(&self.key_docs),
            chunk_ids: f(&self.chunk_ids),
        }
    }
}

/// The backward composite's operands (-> dq, dk, dv): the forward's, then its results and the
/// output's cotangent (out and dout shaped as q, lse [B, KV, 2, Cp, G] f32).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GradOperands<T> {
    pub ins: Operands<T>,
    pub out: T,
    pub lse: T,
    pub dout: T,
}

impl<T: Clone> GradOperands<T> {
    pub const NAMES: [&'static str; 9] = [
        "q",
        "k",
        "v",
        "query_docs",
        "key_docs",
        "chunk_ids",
        "out",
        "lse",
        "dout",
    ];

    pub fn of(list: &[T]) -> GradOperands<T> {
        GradOperands {
            ins: Operands::of(list),
            out: list[6].clone(),
            lse: list[7].clone(),
            dout: list[8].clone(),
        }
    }

    pub fn list(&self) -> Vec<T> {
        let mut l = self.ins.list();
        l.extend([self.out.clone(), self.lse.clone(), self.dout.clone()]);
        l
    }

    pub fn named(&self) -> Vec<(&'static str, T)> {
        Self::NAMES.into_iter().zip(self.list()).collect()
    }
}

/// The composites' attributes: what a kernel needs to know beyond its operands' shapes.
#[derive(Clone, Debug, PartialEq)]
pub struct Attributes {
    /// The key/value block of the loops.
    pub block: i64,
    /// Natural tokens per chunk: chunk c starts at position c x `chunk`.
    pub chunk: i64,
    /// Key chunks in the sequence (2 on one device, 2CP over a context axis).
    pub chunks: i64,
    /// Tokens per chunk padded to whole blocks (Cp).
    pub padded_chunk: i64,
    pub head_dim: i64,
    pub kv_heads: i64,
    pub q_heads: i64,
    /// The scores' scale, 1 / sqrt(head_dim) (read back at f32, as printed).
    pub scale: f64,
    /// Which keys a query sees: [`CAUSAL_RULE`].
    pub causal: String,
}

/// The attributes' names in the program text, in the order printed.
const BLOCK: &str = "block";
const CAUSAL: &str = "causal";
const CHUNK: &str = "chunk";
const CHUNKS: &str = "chunks";
const HEAD_DIM: &str = "head_dim";
const KV_HEADS: &str = "kv_heads";
const PADDED_CHUNK: &str = "padded_chunk";
const Q_HEADS: &str = "q_heads";
const SCALE: &str = "scale";

/// Why a composite call is not the attention this contract describes.
#[derive(Debug)]
pub struct ContractError(String);

impl fmt::Display for ContractError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ContractError {}

fn refuse<T>(message: String) -> Result<T, ContractError> {
    Err(ContractError(message))
}

impl Attributes {
    /// As the composites carry them, by name in the printed order.
    pub fn to_attrs(&self) -> Vec<(String, Attr)> {
        vec![
            (BLOCK.into(), Attr::Int(self.block)),
            (CAUSAL.into(), Attr::Str(self.causal.clone())),
            (CHUNK.into(), Attr::Int(self.chunk)),
            (CHUNKS.into(), Attr::Int(self.chunks)),
            (HEAD_DIM.into(), Attr::Int(self.head_dim)),
            (KV_HEADS.into(), Attr::Int(self.kv_heads)),
            (PADDED_CHUNK.into(), Attr::Int(self.padded_chunk)),
            (Q_HEADS.into(), Attr::Int(self.q_heads)),
            (SCALE.into(), Attr::Float(self.scale)),
        ]
    }

    /// The attributes of an attention composite read from the program text, checked: the
    /// call is [`ATTENTION`] or [`ATTENTION_GRAD`] at [`VERSION`], every attribute is there
    /// with its type, the causal rule is [`CAUSAL_RULE`], and the operands are as many and
    /// shaped as the attributes say.
    pub fn from_site(call: &CompositeCall) -> Result<Attributes, ContractError> {
        let names: &[&str] = match call.name.as_str() {
            ATTENTION => &Operands::<()>::NAMES,
            ATTENTION_GRAD => &GradOperands::<()>::NAMES,
            other => return refuse(format!("{other} is not an attention composite")),
        };
        if call.version != VERSION {
            return refuse(format!(
                "{} v{}: xtrain reads v{VERSION}",
                call.name, call.version
            ));
        }
        let int = |name: &str| match call.attribute(name) {
            Some(Attr::Int(v)) => Ok(*v),
            other => refuse(format!(
                "the composite's attribute {name} is {other:?}, not an integer"
            )),
        };
        let a = Attributes {
            block: int(BLOCK)?,
            chunk: int(CHUNK)?,
            chunks: int(CHUNKS)?,
            padded_chunk: int(PADDED_CHUNK)?,
            head_dim: int(HEAD_DIM)?,
            kv_heads: int(KV_HEADS)?,
            q_heads: int(Q_HEADS)?,
            scale: match call.attribute(SCALE) {
                Some(Attr::Float(v)) => *v,
                other => {
                    return refuse(format!(
                        "the composite's attribute {SCALE} is {other:?}, not a float"
                    ))
                }
            },
            causal: match call.attribute(CAUSAL) {
                Some(Attr::Str(s)) if s == CAUSAL_RULE => s.clone(),
                other => {
                    return refuse(format!(
                        "the composite's attribute {CAUSAL} is {other:?}: xtrain's kernels \
                         know the rule \"{CAUSAL_RULE}\" only"
                    ))
                }
            },
        };
        if call.operands.len() != names.len() {
            return refuse(format!(
                "{} takes {} operands, the contract {} ({})",
                call.name,
                call.operands.len(),
                names.len(),
                names.join(", ")
            ));
        }
        a.check_shapes(&Operands::of(&call.operands))?;
        Ok(a)
    }

    /// The operands' shapes against the attributes: q [B, KV, 2, Cp, G, D] with KV G the query
    /// heads, k and v [B, KV, NC Cp, D], query starts [B, 2, Cp], key starts [B, NC Cp], chunk
    /// ids [2].
    fn check_shapes(&self, s: &Operands<Shape>) -> Result<(), ContractError> {
        let q = &s.q.dims;
        let (cp, nc) = (self.padded_chunk, self.chunks);
        let ok_q = q.len() == 6
            && q[1] == self.kv_heads
            && q[2] == 2
            && q[3] == cp
            && q[1] * q[4] == self.q_heads
            && q[5] == self.head_dim;
        let bs = q.first().copied().unwrap_or(0);
        let keys = [bs, self.kv_heads, nc * cp, self.head_dim];
        let want = [
            ("k", &s.k, keys.to_vec()),
            ("v", &s.v, keys.to_vec()),
            ("query_docs", &s.query_docs, vec![bs, 2, cp]),
            ("key_docs", &s.key_docs, vec![bs, nc * cp]),
            ("chunk_ids", &s.chunk_ids, vec![2]),
        ];
        if !ok_q {
            return refuse(format!(
                "q is {}, not [B, {}, 2, {cp}, {}, {}] as the attributes say",
                s.q,
                self.kv_heads,
                self.q_heads / self.kv_heads.max(1),
                self.head_dim
            ));
        }
        for (name, shape, dims) in want {
            if shape.dims != dims {
                return refuse(format!(
                    "{name} is {shape}, not {dims:?} as the attributes say"
                ));
            }
        }
        if self.chunk > cp || cp % self.block.max(1) != 0 {
            return refuse(format!(
                "chunk {} in padded chunks of {cp} and blocks of {}: not whole blocks",
                self.chunk, self.block
            ));
        }
        Ok(())
    }

    /// Query heads per key/value head (G).
    pub fn groups(&self) -> i64 {
        self.q_heads / self.kv_heads
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hlo::DType;

    fn attributes() -> Attributes {
        Attributes {
            block: 4,
            chunk: 6,
            chunks: 2,
            padded_chunk: 8,
            head_dim: 16,
            kv_heads: 2,
            q_heads: 4,
            scale: 0.25,
            causal: CAUSAL_RULE.into(),
        }
    }

    /// The forward call as the program text carries it for [`attributes`], batch 3.
    fn call(attrs: Vec<(String, Attr)>) -> CompositeCall {
        let s = |d: &[i64], t: DType| Shape::new(d, t);
        CompositeCall {
            name: ATTENTION.into(),
            version: VERSION,
            attributes: attrs,
            decomposition: "xtrain.attention.impl".into(),
            operands: vec![
                s(&[3, 2, 2, 8, 2, 16], DType::BF16),
                s(&[3, 2, 16, 16], DType::BF16),
                s(&[3, 2, 16, 16], DType::BF16),
                s(&[3, 2, 8], DType::S32),
                s(&[3, 16], DType::S32),
                s(&[2], DType::S32),
            ],
            results: vec![],
            line: 1,
        }
    }

    #[test]
    fn the_attributes_read_back_as_written_and_every_one_is_checked() {
        let a = attributes();
        assert_eq!(Attributes::from_site(&call(a.to_attrs())).unwrap(), a);
        let names: Vec<String> = a.to_attrs().into_iter().map(|(n, _)| n).collect();
        let mut sorted = names.clone();
        sorted.sort();
        assert_eq!(names, sorted, "printed in name order");
        // Each attribute missing is named.
        for name in &names {
            let without: Vec<_> = a
                .to_attrs()
                .into_iter()
                .filter(|(n, _)| n != name)
                .collect();
            let e = Attributes::from_site(&call(without))
                .unwrap_err()
                .to_string();
            assert!(e.contains(&format!("attribute {name} is None")), "{e}");
        }
        // Another causal rule is refused by name.
        let other = Attributes {
            causal: "sliding_window".into(),
            ..attributes()
        };
        let e = Attributes::from_site(&call(other.to_attrs()))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("sliding_window") && e.contains(CAUSAL_RULE),
            "{e}"
        );
        // Shapes that disagree with the attributes, a version or a name not read.
        let wider = Attributes {
            head_dim: 32,
            ..attributes()
        };
        let e = Attributes::from_site(&call(wider.to_attrs()))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("q is") && e.contains("as the attributes say"),
            "{e}"
        );
        let mut later = call(a.to_attrs());
        later.version = VERSION + 1;
        assert!(Attributes::from_site(&later).is_err());
        let mut other = call(a.to_attrs());
        other.name = "xtrain.other".into();
        assert!(Attributes::from_site(&other).is_err());
        let mut fewer = call(a.to_attrs());
        fewer.operands.pop();
        let e = Attributes::from_site(&fewer).unwrap_err().to_string();
        assert!(e.contains("takes 5 operands, the contract 6"), "{e}");
    }

    #[test]
    fn operands_list_and_read_back_in_the_names_order() {
        let names = Operands::<&str>::of(&Operands::<&str>::NAMES);
        assert_eq!(names.list(), Operands::<&str>::NAMES.to_vec());
        let grad = GradOperands::<&str>::of(&GradOperands::<&str>::NAMES);
        assert_eq!(grad.list(), GradOperands::<&str>::NAMES.to_vec());
        assert_eq!(
            &GradOperands::<&str>::NAMES[..6],
            &Operands::<&str>::NAMES[..]
        );
    }
}
