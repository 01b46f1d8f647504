"""The benchmark workload's LoRA training step in JAX: forward + backward of the LoRA parameters
only + AdamW in one jax.jit, layers in lax.scan. Reads the weights and batch that
`xtrain bench --export` wrote, prints the first step's loss (checked against xtrain's by
tools/bench) and the timings as JSON.

usage: jax_step.py EXPORT.safetensors --config CONFIG.json --steps N --warmup W --lora-r R
                   --lora-alpha A --targets q,v [--dtype f32|bf16] [--remat none|layer|save-proj]
       jax_step.py --random --batch B --seq T --config CONFIG.json ...   (weights made on the
                   device, for models too large to export: tools/gpu-bench.sh)
       jax_step.py ... --context CP [--key-block TB]   (long context: the sequence split over a
                   `context` mesh axis as xtrain's --mesh context=CP splits it; with --aot the
                   target's devices, else CP host devices; tools/aot-bench --context)

bf16 is xtrain's mixed precision: bf16 frozen weights and activations (LoRA terms included),
RMSNorm statistics, attention scores, softmax and the loss in f32, LoRA parameters and AdamW in f32.
"""
import argparse, json, struct, time

import numpy as np
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

jax.config.update("jax_default_matmul_precision", "highest")


def read_safetensors(path):
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    kinds = {"F32": np.float32, "I32": np.int32, "I64": np.int64, "BF16": jnp.bfloat16}
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        out[name] = np.frombuffer(raw[8 + n + a:8 + n + b], dtype=kinds[info["dtype"]]).reshape(info["shape"])
    return out


def random_inputs(cfg, targets, a, cd, d):
    """Uniform weights (std ~0.02, norms 1) and LoRA (A ~ U(+-1/sqrt(in)), B ~ U(+-0.01)) made on
    the device in the compute type, and random token ids: the same distributions as xtrain bench."""
    L, H, F, V = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    shapes = {"self_attn.q_proj": (nh * d, H), "self_attn.k_proj": (nkv * d, H), "self_attn.v_proj": (nkv * d, H),
              "self_attn.o_proj": (H, nh * d), "mlp.gate_proj": (F, H), "mlp.up_proj": (F, H), "mlp.down_proj": (H, F)}
    keys = iter(jax.random.split(jax.random.PRNGKey(1), 64))
    uniform = lambda shape, bound, dtype: jax.random.uniform(next(keys), shape, dtype, -bound, bound)
    frozen = {k: uniform((L,) + s, 0.0346, cd) for k, s in shapes.items()}
    frozen["input_layernorm"] = jnp.ones((L, H), cd)
    frozen["post_attention_layernorm"] = jnp.ones((L, H), cd)
    embed, head, norm = uniform((V, H), 0.0346, cd), uniform((V, H), 0.0346, cd), jnp.ones((H,), cd)
    names = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
             "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
    lora = {}
    for tg in targets:
        out, inp = shapes[names[tg]]
        lora[f"{tg}_A"] = uniform((L, a.lora_r, inp), 1.0 / np.sqrt(inp), jnp.float32)
        lora[f"{tg}_B"] = uniform((L, out, a.lora_r), 0.01, jnp.float32)
    ids = jax.random.randint(next(keys), (a.batch, a.seq), 0, V, jnp.int32)
    return frozen, embed, norm, head, lora, ids, ids


def rope_tables(cfg, d, T, cd):
    """llama3 RoPE frequencies, in f32 as transformers computes them; cos and sin [T, d]."""
    theta = cfg["rope_theta"]
    inv = 1.0 / (np.float32(theta) ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d)))
    rs = cfg["rope_scaling"]
    lo_w, hi_w = rs["original_max_position_embeddings"] / rs["low_freq_factor"], rs["original_max_position_embeddings"] / rs["high_freq_factor"]
    wl = 2 * np.pi / inv
    smooth = (rs["original_max_position_embeddings"] / wl - rs["low_freq_factor"]) / (rs["high_freq_factor"] - rs["low_freq_factor"])
    inv = np.where(wl < hi_w, inv, np.where(wl > lo_w, inv / rs["factor"], (1 - smooth) * inv / rs["factor"] + smooth * inv)).astype(np.float32)
    ang = np.arange(T, dtype=np.float32)[:, None] * inv[None, :]
    ang = np.concatenate([ang, ang], -1)
    return jnp.asarray(np.cos(ang)).astype(cd), jnp.asarray(np.sin(ang)).astype(cd)


def balanced_chunks(cp):
    """The natural chunk at each place of context parallelism's balanced order: the sequence cut
    into 2CP chunks, device r holding chunks r and 2CP-1-r (the Llama 3 paper's layout)."""
    return [c for r in range(cp) for c in (r, 2 * cp - 1 - r)]


def reorder(x, cp, to_natural=False, axis=1):
    """`x`'s rows along `axis` from natural into balanced order, or back: slices joined."""
    order = balanced_chunks(cp)
    if to_natural:
        order = [order.index(c) for c in range(2 * cp)]
    C = x.shape[axis] // (2 * cp)
    return jnp.concatenate([jax.lax.slice_in_dim(x, c * C, (c + 1) * C, axis=axis) for c in order], axis)


def context_grid(T, cp, tb):
    """The context form's loop sizes: (key blocks per chunk NBc, key-block visits per device
    (2CP+1) x NBc, trips of each of a layer's attention loops: every visit with each query block
    of a chunk)."""
    nbc = T // (2 * cp) // tb
    visits = (2 * cp + 1) * nbc
    return nbc, visits, visits * nbc


def context_attention(mesh, cp, T, tb, G, cd, trips_per_body=1, nested=False):
    """Causal attention with the sequence split over the mesh's `context` axis: keys and values
    all-gathered in each layer, rows in balanced order, and on each device the flash recurrence
    over key/value blocks of `tb` tokens with its own backward pass (jax.custom_vjp), which
    recomputes each block's probabilities from the saved row statistic (max + log sum).

    Each device runs one loop of (2CP+1) x NBc x NBc trips (NBc = blocks per chunk): its first
    chunk's query blocks against key chunks 0..r, then its second chunk's against 0..2CP-1-r; the
    work above the diagonal of a chunk's own key chunk is masked, not skipped. q [B, T, KV, G, D]
    and k, v [B, T, KV, D] arrive in balanced order, sharded over `context`; the result is
    [B, T, KV, G, D] in the same order. `trips_per_body` > 1 puts that many trips in each loop
    body (for pricing only, by a cost model that counts a loop body once; a remainder is dropped).

    `nested`: the same trips in nested loops whose inner trips carry one block's state: the
    forward pass and the query gradients loop over the query blocks u and, inside, over the
    (2CP+1) NBc key-block visits, carrying the two query blocks u of the device's chunks; the key
    and value gradients loop over the visits and, inside, over u, carrying the visit's key block.
    Each loop's inner trips write nothing long; the outer trips write one block. (3 loops where
    the flat form has 2: the backward pass recomputes the probabilities twice.)"""
    from jax.sharding import PartitionSpec as P
    C = T // (2 * cp)
    nbc, visits, trips = context_grid(T, cp, tb)

    def run(n):
        """How many trips a loop of n runs: n, or for pricing whole bodies of trips_per_body
        (a remainder outside the loop would be priced on its own; pricing only)."""
        return n if trips_per_body == 1 else max(n - n % trips_per_body, trips_per_body)
    lowest = jnp.finfo(jnp.float32).min

    def where(s, r):
        """Trip s on device r: (the query block's first row among the device's 2C, its natural
        position, the key block's first position)."""
        n, u = s // nbc, s % nbc
        first = (r + 1) * nbc
        second = n >= first
        key = jnp.where(second, n - first, n)
        chunk = jnp.where(second, 2 * cp - 1 - r, r)
        return second * C + u * tb, chunk * C + u * tb, key * tb

    def block(q, k, v, s, r):
        row, q_at, k_at = where(s, r)
        qb = jax.lax.dynamic_slice_in_dim(q, row, tb, 1)
        kb = jax.lax.dynamic_slice_in_dim(k, k_at, tb, 1)
        vb = jax.lax.dynamic_slice_in_dim(v, k_at, tb, 1)
        sc = jnp.einsum("bqhgd,bkhd->bhgqk", qb, kb, preferred_element_type=jnp.float32) / np.sqrt(q.shape[-1])
        causal = (k_at + jnp.arange(tb))[None, :] <= (q_at + jnp.arange(tb))[:, None]
        return row, k_at, qb, kb, vb, jnp.where(causal, sc, lowest)

    def forward_flat(q, k, v):
        B, _, KV, _, D = q.shape
        r = jax.lax.axis_index("context")

        def trip(s, carry):
            m, l, acc = carry
            row, _, _, _, vb, sc = block(q, k, v, s, r)
            mb, lb, ab = (jax.lax.dynamic_slice_in_dim(x, row, tb, 3) for x in (m, l, acc))
            m_new = jnp.maximum(mb, sc.max(-1))
            p = jnp.exp(sc - m_new[..., None])
            corr = jnp.exp(mb - m_new)
            l_new = lb * corr + p.sum(-1)
            a_new = ab * corr[..., None] + jnp.einsum("bhgqk,bkhd->bhgqd", p.astype(cd), vb,
                                                      preferred_element_type=jnp.float32)
            return tuple(jax.lax.dynamic_update_slice_in_dim(x, y, row, 3)
                         for x, y in ((m, m_new), (l, l_new), (acc, a_new)))

        rows = (B, KV, G, 2 * C)
        m, l, acc = jax.lax.fori_loop(0, run(trips), trip, (jnp.full(rows, lowest), jnp.zeros(rows),
                                                       jnp.zeros(rows + (D,))), unroll=trips_per_body)
        out = (acc / l[..., None]).astype(cd)  # [B, KV, G, 2C, D]
        return out, m + jnp.log(l)

    def first_or_second(n, r):
        """Whether visit n serves the device's second chunk, as an index (0 or 1)."""
        return (n >= (r + 1) * nbc).astype(jnp.int32)

    def forward_nested(q, k, v):
        B, _, KV, _, D = q.shape
        r = jax.lax.axis_index("context")

        def query_block(u, carry):
            def trip(n, st):
                m, l, acc = st  # [2, B, KV, G, TB(, D)]: the query blocks u of both chunks
                _, _, _, _, vb, sc = block(q, k, v, n * nbc + u, r)
                c = first_or_second(n, r)
                mb, lb, ab = m[c], l[c], acc[c]
                m_new = jnp.maximum(mb, sc.max(-1))
                p = jnp.exp(sc - m_new[..., None])
                corr = jnp.exp(mb - m_new)
                a_new = ab * corr[..., None] + jnp.einsum("bhgqk,bkhd->bhgqd", p.astype(cd), vb,
                                                          preferred_element_type=jnp.float32)
                return m.at[c].set(m_new), l.at[c].set(lb * corr + p.sum(-1)), acc.at[c].set(a_new)

            st = (B, KV, G, tb)
            init = (jnp.full((2,) + st, lowest), jnp.zeros((2,) + st), jnp.zeros((2,) + st + (D,)))
            m, l, acc = jax.lax.fori_loop(0, run(visits), trip, init, unroll=trips_per_body)
            out_all, lse_all = carry
            for c in (0, 1):
                at = c * C + u * tb
                out_all = jax.lax.dynamic_update_slice_in_dim(out_all, (acc[c] / l[c][..., None]).astype(cd), at, 3)
                lse_all = jax.lax.dynamic_update_slice_in_dim(lse_all, m[c] + jnp.log(l[c]), at, 3)
            return out_all, lse_all

        rows = (B, KV, G, 2 * C)
        return jax.lax.fori_loop(0, nbc, query_block, (jnp.zeros(rows + (D,), cd), jnp.zeros(rows)))

    def backward_nested(q, k, v, out, lse, dout):
        r = jax.lax.axis_index("context")
        delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), -1)
        scale = 1 / np.sqrt(q.shape[-1])

        def grads(n, u):
            """(q, k, v blocks, dS, P, dO block) of visit n and query block u."""
            row, _, qb, kb, vb, sc = block(q, k, v, n * nbc + u, r)
            lb, db = (jax.lax.dynamic_slice_in_dim(x, row, tb, 3) for x in (lse, delta))
            ob = jax.lax.dynamic_slice_in_dim(dout, row, tb, 3)
            p = jnp.exp(sc - lb[..., None])
            dp = jnp.einsum("bhgqd,bkhd->bhgqk", ob, vb, preferred_element_type=jnp.float32)
            return qb, kb, (p * (dp - db[..., None]) * scale).astype(cd), p, ob

        def query_block(u, dq_all):
            def trip(n, dq):
                _, kb, ds, _, _ = grads(n, u)
                c = first_or_second(n, r)
                return dq.at[c].add(jnp.einsum("bhgqk,bkhd->bqhgd", ds, kb, preferred_element_type=jnp.float32))

            B, _, KV, _, D = q.shape
            dq = jax.lax.fori_loop(0, run(visits), trip, jnp.zeros((2, B, tb, KV, G, D)), unroll=trips_per_body)
            for c in (0, 1):
                dq_all = jax.lax.dynamic_update_slice_in_dim(dq_all, dq[c], c * C + u * tb, 1)
            return dq_all

        def key_visit(n, dkv_all):
            def trip(u, dkv):
                qb, _, ds, p, ob = grads(n, u)
                dk, dv = dkv
                return (dk + jnp.einsum("bhgqk,bqhgd->bkhd", ds, qb, preferred_element_type=jnp.float32),
                        dv + jnp.einsum("bhgqk,bhgqd->bkhd", p.astype(cd), ob, preferred_element_type=jnp.float32))

            B, _, KV, D = k.shape
            zero = jnp.zeros((B, tb, KV, D))
            dk, dv = jax.lax.fori_loop(0, run(nbc), trip, (zero, zero), unroll=trips_per_body)
            at = where(n * nbc, r)[2]
            add = lambda x, y: jax.lax.dynamic_update_slice_in_dim(x, jax.lax.dynamic_slice_in_dim(x, at, tb, 1) + y, at, 1)
            return add(dkv_all[0], dk), add(dkv_all[1], dv)

        f32 = lambda x: jnp.zeros(x.shape, jnp.float32)
        dq = jax.lax.fori_loop(0, nbc, query_block, f32(q))
        dk, dv = jax.lax.fori_loop(0, visits, key_visit, (f32(k), f32(v)))
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)

    forward = forward_nested if nested else forward_flat

    @jax.custom_vjp
    def attend(q, k, v):
        return forward(q, k, v)

    def attend_fwd(q, k, v):
        out, lse = forward(q, k, v)
        # named for the save-proj policy: xtrain's save-proj keeps attention's output and row
        # statistic, so that the backward pass does not rerun the forward loop
        out = checkpoint_name(out, "attention_out")
        lse = checkpoint_name(lse, "attention_lse")
        return (out, lse), (q, k, v, out, lse)

    def attend_bwd(res, cts):
        q, k, v, out, lse = res
        dout = cts[0]  # the statistic's cotangent is zero: only `out` leaves the layer
        if nested:
            return backward_nested(q, k, v, out, lse, dout)
        r = jax.lax.axis_index("context")
        delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), -1)

        def trip(s, carry):
            dq, dk, dv = carry
            row, k_at, qb, kb, vb, sc = block(q, k, v, s, r)
            lb, db = (jax.lax.dynamic_slice_in_dim(x, row, tb, 3) for x in (lse, delta))
            ob = jax.lax.dynamic_slice_in_dim(dout, row, tb, 3)
            p = jnp.exp(sc - lb[..., None])
            dvb = jnp.einsum("bhgqk,bhgqd->bkhd", p.astype(cd), ob, preferred_element_type=jnp.float32)
            dp = jnp.einsum("bhgqd,bkhd->bhgqk", ob, vb, preferred_element_type=jnp.float32)
            ds = (p * (dp - db[..., None]) / np.sqrt(q.shape[-1])).astype(cd)
            dqb = jnp.einsum("bhgqk,bkhd->bqhgd", ds, kb, preferred_element_type=jnp.float32)
            dkb = jnp.einsum("bhgqk,bqhgd->bkhd", ds, qb, preferred_element_type=jnp.float32)
            add = lambda x, y, at: jax.lax.dynamic_update_slice_in_dim(
                x, jax.lax.dynamic_slice_in_dim(x, at, tb, 1) + y, at, 1)
            return add(dq, dqb, row), add(dk, dkb, k_at), add(dv, dvb, k_at)

        f32 = lambda x: jnp.zeros(x.shape, jnp.float32)
        dq, dk, dv = jax.lax.fori_loop(0, run(trips), trip, (f32(q), f32(k), f32(v)), unroll=trips_per_body)
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)

    attend.defvjp(attend_fwd, attend_bwd)

    def per_device(q, k, v):
        gather = lambda x: reorder(jax.lax.all_gather(x, "context", axis=1, tiled=True), cp, to_natural=True)
        out, _ = attend(q, gather(k), gather(v))
        return jnp.moveaxis(out, 3, 1)  # [B, 2C, KV, G, D]

    seq = P(None, "context")
    return jax.shard_map(per_device, mesh=mesh, in_specs=(seq, seq, seq), out_specs=seq, check_vma=False)


def make_step(cfg, a, B, T, cd, targets, unroll=False, context=None):
    """The training step as a function of every weight: (lora, m, v, t, frozen, ends, ids, labels)
    -> (lora, m, v, loss), ends = (embed, norm, head). Layers in lax.scan, or a Python loop when
    `unroll` (for compilers whose cost analysis counts a loop body once); remat per layer with
    --remat layer (jax.checkpoint, which keeps the recomputation apart in an unrolled program).
    `context` = (mesh, CP): the sequence split over the mesh's `context` axis
    (context_attention; rows in balanced order from the embedding's input to the last layer)."""
    H = cfg["hidden_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or H // nh
    eps = cfg["rms_norm_eps"]
    scale = a.lora_alpha / a.lora_r
    cos, sin = rope_tables(cfg, d, T, cd)
    causal = None if context else jnp.tril(jnp.ones((T, T), bool))
    if context:
        from jax.sharding import NamedSharding, PartitionSpec as P
        mesh, cp = context
        cos, sin = reorder(cos, cp, axis=0), reorder(sin, cp, axis=0)  # the rows' natural positions
        attention = context_attention(mesh, cp, T, a.key_block, nh // nkv, cd, a.trips_per_body,
                                      nested=getattr(a, "loop_form", "flat") == "nested")
        along = lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(None, "context")))

    def rms(x, g):
        x = x.astype(jnp.float32)
        return (x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps)).astype(cd) * g

    def rope(x):
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return x * cos[:, None, :] + jnp.concatenate([-x2, x1], -1) * sin[:, None, :]

    def layer(h, xs):
        w, lw = xs

        def lin(x, name, tg):
            y = x @ w[name].T
            if tg in targets:
                y = y + scale * ((x @ lw[f"{tg}_A"].astype(cd).T) @ lw[f"{tg}_B"].astype(cd).T)
            return y

        x = rms(h, w["input_layernorm"])
        q = rope(lin(x, "self_attn.q_proj", "q").reshape(B, T, nh, d))
        k = rope(lin(x, "self_attn.k_proj", "k").reshape(B, T, nkv, d))
        v = lin(x, "self_attn.v_proj", "v").reshape(B, T, nkv, d)
        if context:
            o = attention(q.reshape(B, T, nkv, nh // nkv, d), k, v).reshape(B, T, nh * d)
            h = along(h + lin(o, "self_attn.o_proj", "o"))
            x = rms(h, w["post_attention_layernorm"])
            m = jax.nn.silu(lin(x, "mlp.gate_proj", "gate")) * lin(x, "mlp.up_proj", "up")
            return along(h + lin(m, "mlp.down_proj", "down")), None
        k = jnp.repeat(k, nh // nkv, axis=2)
        v = jnp.repeat(v, nh // nkv, axis=2)
        s = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32) / np.sqrt(d)
        s = jnp.where(causal, s, jnp.finfo(jnp.float32).min)
        o = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, -1).astype(cd), v).reshape(B, T, nh * d)
        h = h + lin(o, "self_attn.o_proj", "o")
        x = rms(h, w["post_attention_layernorm"])
        m = jax.nn.silu(lin(x, "mlp.gate_proj", "gate")) * lin(x, "mlp.up_proj", "up")
        return h + lin(m, "mlp.down_proj", "down"), None

    if a.remat == "layer":
        body = jax.checkpoint(layer)
    elif a.remat == "save-proj":
        # xtrain's --remat save-proj keeps each layer's input and its projections' outputs; the
        # projections are this layer's only dots without batch dimensions (attention's have them)
        policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
        if context:
            policy = jax.checkpoint_policies.save_from_both_policies(
                policy, jax.checkpoint_policies.save_only_these_names("attention_out", "attention_lse"))
        body = jax.checkpoint(layer, policy=policy)
    else:
        body = layer

    def loss_fn(lora, frozen, ends, ids, labels):
        embed, norm, head = ends
        if context:
            h = along(embed[reorder(ids, cp)])
        else:
            h = embed[ids]
        if unroll:
            for l in range(cfg["num_hidden_layers"]):
                h, _ = body(h, jax.tree.map(lambda x: x[l], (frozen, lora)))
        else:
            h, _ = jax.lax.scan(body, h, (frozen, lora))
        if context:
            h = along(reorder(h, cp, to_natural=True))  # the logits and loss stay split by sequence
        logits = (rms(h, norm) @ head.T).astype(jnp.float32)
        lp = jax.nn.log_softmax(logits[:, :-1], -1)
        tgt = labels[:, 1:]
        valid = tgt != -100
        nll = -jnp.take_along_axis(lp, jnp.where(valid, tgt, 0)[..., None], -1)[..., 0]
        return jnp.sum(nll * valid) / jnp.maximum(jnp.sum(valid), 1)

    def step(lora, m, v, t, frozen, ends, ids, labels):
        loss, g = jax.value_and_grad(loss_fn)(lora, frozen, ends, ids, labels)
        b1, b2, lr, e = 0.9, 0.999, 1e-4, 1e-8
        m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, m, g)
        v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, v, g)
        upd = lambda p, m, v: p - lr / (1 - b1 ** t) * m / (jnp.sqrt(v) / jnp.sqrt(1 - b2 ** t) + e)
        return jax.tree.map(upd, lora, m, v), m, v, loss

    step.loss_fn = loss_fn  # for checking one form's gradients against another's
    return step


PROJ = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
        "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
KINDS = ["input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
         "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]


def aot(a, cfg, targets, cd):
    """Compile the step for an absent TPU slice or GPU (the target's plugin, no device) and print
    the compiler's figures: memory per device, and for TPUs its cost analysis."""
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    platform, device, count = a.aot.split(":", 2)
    if platform == "tpu":
        topo = topologies.get_topology_desc(topology_name=f"{device}:{count}", platform="tpu",
                                            **({"chips_per_host_bounds": [1, 1, 1]} if count in ("1x1", "1x1x1") else {}))
    else:
        hosts, per_host = (count.split("x") + [None])[:2] if "x" in count else ("1", count)
        topo = topologies.get_topology_desc(platform=platform, topology_name="",
                                            target_config=open(a.target_config).read(),
                                            topology=f"1x{hosts}x{per_host}")
    devices = np.array(topo.devices)
    n = len(devices)
    if a.context and a.context != n:
        raise SystemExit(f"--context {a.context}: the context axis takes all of {a.aot}'s {n} devices")
    axis = "context" if a.context else "fsdp"
    mesh = Mesh(devices, (axis,))
    L, H, F, V = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or H // nh
    B, T = a.batch, a.seq
    shapes = {"self_attn.q_proj": (nh * d, H), "self_attn.k_proj": (nkv * d, H), "self_attn.v_proj": (nkv * d, H),
              "self_attn.o_proj": (H, nh * d), "mlp.gate_proj": (F, H), "mlp.up_proj": (F, H), "mlp.down_proj": (H, F)}

    def fsdp(shape, dtype, skip=0):
        """Abstract array sharded over the chips along its first dim (after `skip`) that they divide."""
        spec = [None] * len(shape)
        for i in range(skip, len(shape)):
            if shape[i] % n == 0 and shape[i] >= n:
                spec[i] = axis
                break
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P(*spec)))

    frozen = {k: fsdp((L,) + s, cd, skip=1) for k, s in shapes.items()}
    frozen["input_layernorm"] = fsdp((L, H), cd, skip=1)
    frozen["post_attention_layernorm"] = fsdp((L, H), cd, skip=1)
    ends = (fsdp((V, H), cd), fsdp((H,), cd), fsdp((V, H), cd))
    lora = {}
    for tg in targets:
        out, inp = shapes[PROJ[tg]]
        lora[f"{tg}_A"] = fsdp((L, a.lora_r, inp), jnp.float32, skip=1)
        lora[f"{tg}_B"] = fsdp((L, out, a.lora_r), jnp.float32, skip=1)
    if a.context:
        ids = jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=NamedSharding(mesh, P(None, axis)))
    else:
        ids = fsdp((B, T), jnp.int32)
    t = jax.ShapeDtypeStruct((), jnp.float32, sharding=NamedSharding(mesh, P()))
    step = make_step(cfg, a, B, T, cd, targets, unroll=a.unroll, context=(mesh, n) if a.context else None)
    lora_s = jax.tree.map(lambda x: x.sharding, lora)
    jitted = jax.jit(step, donate_argnums=(0, 1, 2),
                     out_shardings=(lora_s, lora_s, lora_s, NamedSharding(mesh, P())))
    t0 = time.time()
    compiled = jitted.lower(lora, lora, lora, t, frozen, ends, ids, ids).compile()
    compile_s = time.time() - t0
    mem = compiled.memory_analysis()
    out = {"target": a.aot, "devices": n, "layers": L, "batch": B, "seq": T, "compile_s": compile_s,
           "mesh": axis, **({"key_block": a.key_block, "trips": context_grid(a.seq, n, a.key_block)[2],
                             "trips_per_body": a.trips_per_body} if a.context else {}),
           "memory": {k: getattr(mem, k) for k in dir(mem) if k.endswith("_in_bytes")}}
    try:
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        out["cost"] = {k: float(v) for k, v in cost.items() if "{" not in k}
        # libtpu 0.0.42.1's cost model prices each ConcatBitcast call (it joins the views of an
        # async-sliced fetch and moves nothing) and each PrepareAsyncCallStart / Done (the
        # bracket of an async call; the call inside is priced) at -1 s; add them back as xtrain
        # does (xtrain::device::absent::aot::unpriced_calls)
        text = compiled.as_text()
        unpriced = sum(text.count(f'custom_call_target="{c}"')
                       for c in ("ConcatBitcast", "PrepareAsyncCallStart", "PrepareAsyncCallDone"))
        if unpriced and "optimal_seconds" in out["cost"]:
            out["cost"]["optimal_seconds"] += unpriced
            out["unpriced_calls"] = unpriced
    except Exception as e:  # the GPU compilers have none
        out["cost_error"] = str(e)
    if a.hlo_out:
        open(a.hlo_out, "w").write(compiled.as_text())
    print(json.dumps(out))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("export", nargs="?")
    p.add_argument("--random", action="store_true", help="random weights and batch made on the device")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--remat", choices=["none", "layer", "save-proj"], default="none",
                   help="layer: jax.checkpoint around the scanned layer (keep each layer's input); "
                        "save-proj: also keep the projections' outputs (dots without batch dims)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--lora-alpha", type=float, default=32)
    p.add_argument("--targets", default="q,v")
    p.add_argument("--config", required=True)
    p.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    p.add_argument("--peak", action="store_true", help="also measure matmul GFLOP/s (2048^3, in --dtype)")
    p.add_argument("--aot", metavar="TARGET",
                   help="compile for absent hardware instead of running: tpu:<gen>:<chips> (libtpu from "
                        "TPU_LIBRARY_PATH) or cuda|rocm:<name>:<count> with --target-config; FSDP over all devices")
    p.add_argument("--target-config", help="with --aot cuda|rocm: the GPU description (GpuTargetConfigProto text)")
    p.add_argument("--layers", type=int, help="with --aot: override the config's number of layers")
    p.add_argument("--unroll", action="store_true", help="with --aot: layers as a Python loop, not lax.scan")
    p.add_argument("--hlo-out", help="with --aot: write the optimized HLO text here")
    p.add_argument("--context", type=int, metavar="CP", default=0,
                   help="split the sequence over a `context` mesh axis of CP devices (with --aot: all "
                        "the target's devices), attention over key/value blocks (context_attention); "
                        "without --aot, CP host devices")
    p.add_argument("--key-block", type=int, default=512, help="with --context: tokens per key/value block")
    p.add_argument("--loop-form", choices=["flat", "nested"], default="flat",
                   help="with --context: flat (one loop over the block pairs, as xtrain's) or nested "
                        "(inner loops carry one block's state; context_attention)")
    p.add_argument("--trips-per-body", type=int, default=1,
                   help="with --context: trips of the attention loops in each loop body (pricing)")
    a = p.parse_args()
    for flag, value, low in (("--context", a.context, 0), ("--key-block", a.key_block, 1), ("--trips-per-body", a.trips_per_body, 1)):
        if value < low:
            p.error(f"{flag} must be at least {low}, got {value}")
    if a.context:
        if a.seq % (2 * a.context * a.key_block):
            p.error(f"--seq {a.seq} must be a multiple of 2 x --context x --key-block = {2 * a.context * a.key_block}")
        if not a.aot:
            import os
            os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={a.context}"
    cfg = json.load(open(a.config))
    if a.layers:
        cfg["num_hidden_layers"] = a.layers
    targets = ["q", "k", "v", "o", "gate", "up", "down"] if a.targets == "all" else a.targets.split(",")
    cd = jnp.bfloat16 if a.dtype == "bf16" else jnp.float32  # the compute type
    if a.aot:
        return aot(a, cfg, targets, cd)
    if a.random == (a.export is not None):
        p.error("give either an export file or --random")
    L, H = cfg["num_hidden_layers"], cfg["hidden_size"]
    d = cfg.get("head_dim") or H // cfg["num_attention_heads"]
    if a.random:
        frozen, embed, norm, head, lora, ids, labels = random_inputs(cfg, targets, a, cd, d)
    else:
        t = read_safetensors(a.export)
        frozen = {k: jnp.stack([t[f"model.layers.{l}.{k}.weight"] for l in range(L)]).astype(cd) for k in KINDS}
        embed, norm, head = (jnp.asarray(t[n]).astype(cd) for n in ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"])
        lora = {}
        for tg in targets:
            for w in "AB":
                lora[f"{tg}_{w}"] = jnp.stack([t[f"base_model.model.model.layers.{l}.{PROJ[tg]}.lora_{w}.weight"] for l in range(L)])
        ids, labels = jnp.asarray(t["input_ids"]), jnp.asarray(t["labels"])
    B, T = ids.shape
    if a.context:
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        mesh = Mesh(np.array(jax.devices()[:a.context]), ("context",))
        ids, labels = (jax.device_put(x, NamedSharding(mesh, P(None, "context"))) for x in (ids, labels))
        frozen, embed, norm, head, lora = jax.device_put((frozen, embed, norm, head, lora), NamedSharding(mesh, P()))
        step = jax.jit(make_step(cfg, a, B, T, cd, targets, context=(mesh, a.context)))
    else:
        step = jax.jit(make_step(cfg, a, B, T, cd, targets))
    ends = (embed, norm, head)

    zeros = jax.tree.map(jnp.zeros_like, lora)
    m, v = zeros, zeros
    t0 = time.time()
    compiled = step.lower(lora, m, v, 1.0, frozen, ends, ids, labels).compile()
    compile_s = time.time() - t0
    times, first = [], None
    for i in range(a.warmup + a.steps):
        s0 = time.time()
        lora, m, v, loss = compiled(lora, m, v, float(i + 1), frozen, ends, ids, labels)
        loss.block_until_ready()
        if i == 0:
            first = float(loss)
        if i >= a.warmup:
            times.append(time.time() - s0)
    out = {"compile_s": compile_s, "step_s": times, "first_loss": first, "tokens_per_step": int(B * T)}
    if a.peak:
        n = 2048
        # In the benchmark's type, with an f32 result: XLA CPU runs bf16 x bf16 -> f32 on the CPU's
        # native bf16 GEMM but computes a bf16-result product in f32 (about half the speed here).
        x = jnp.ones((n, n), cd)
        f = jax.jit(lambda x: jnp.matmul(x, x, preferred_element_type=jnp.float32))
        f(x).block_until_ready()
        best = min((lambda s: (f(x).block_until_ready(), time.time() - s)[1])(time.time()) for _ in range(5))
        out["matmul_gflops"] = 2 * n ** 3 / best / 1e9
    print(json.dumps(out))


if __name__ == "__main__":
    main()
