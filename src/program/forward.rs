//! The forward-only passes (generation, evaluation's logits): the layers unrolled, or looped
//! as the step loops them, with nothing saved for a backward pass.

use super::layout::{Layout, ModelValues};
use crate::model::llama::{LayerAdapters, Saves};
use hlo::{Builder, Value};

impl Layout<'_> {
    /// The last hidden state h_L [B, T, H] (layers looped when the spec loops them).
    pub(super) fn hidden(
        &self,
        b: &mut Builder,
        m: &ModelValues,
        ids: Value,
        mask: Value,
    ) -> hlo::Result<Value> {
        let model = self.model();
        let (embed, _, _) = self.ends(&m.frozen);
        let h0 = model.embed(b, embed, ids)?;
        let ctx = model.context(b, mask, self.spec.lora.scale())?;
        if !self.spec.remat.scan() {
            let mut h = h0;
            let per_layer = 2 * self.spec.lora.targets.len();
            let per_layer_w: usize = self.kind_sizes().iter().sum();
            let none = LayerAdapters::new();
            for l in 0..self.spec.model.num_hidden_layers as usize {
                let lw = self.layer_weights(
                    b,
                    &self.layer_values(&m.frozen)[per_layer_w * l..per_layer_w * (l + 1)],
                )?;
                let adapters = if m.lora.is_empty() {
                    none.clone()
                } else {
                    self.adapters(&m.lora[per_layer * l..per_layer * (l + 1)])
                };
                let mut c = ctx.clone();
                h = b.scoped(&format!("layers.{l}"), |b| {
                    model.layer(b, h, &lw, &adapters, &mut c, &mut Saves::Off)
                })?;
            }
            return model.in_natural_order(b, h);
        }
        let at = self.loop_invariants(m, &ctx, None);
        let out = b.fori_loop(
            self.spec.model.num_hidden_layers,
            &[h0],
            &at.values,
            |bb, i, carry, inv| {
                let (stacked, lora, c, _) = self.unpack(&at, inv);
                let (h, _) = self.layer_in_loop(
                    bb,
                    i,
                    carry[0],
                    &stacked,
                    &lora,
                    &c,
                    None,
                    &mut Saves::Off,
                )?;
                Ok(vec![h])
            },
        )?;
        model.in_natural_order(b, out[0])
    }

    /// Logits for a forward-only program.
    pub(super) fn logits(
        &self,
        b: &mut Builder,
        m: &ModelValues,
        ids: Value,
        mask: Value,
    ) -> hlo::Result<Value> {
        let h = self.hidden(b, m, ids, mask)?;
        let (_, norm, lm_head) = self.ends(&m.frozen);
        self.model().head(b, h, norm, lm_head)
    }
}
