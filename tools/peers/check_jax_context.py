"""The JAX peer's long-context form (jax_step.py --context, on host CPU devices) against its own
step with every key at once: the loss and every LoRA gradient, on the tiny model, for several
context sizes, key blocks and remat policies. f32 to 1e-5 of the largest gradient; bf16 printed.

usage: tools/.venv/bin/python tools/peers/check_jax_context.py
"""
import os, sys, json
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from types import SimpleNamespace

import numpy as np
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_step as js

root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
cfg = json.load(open(os.path.join(root, "models/tiny-llama3/config.json")))
targets = ["q", "k", "v", "o", "gate", "up", "down"]
failed = False
for cp, seq, block, remat, dtype, form in [(4, 64, 4, "none", "f32", "flat"), (2, 48, 4, "save-proj", "f32", "flat"),
                                           (4, 64, 8, "layer", "f32", "flat"), (2, 64, 8, "save-proj", "bf16", "flat"),
                                           (4, 64, 4, "none", "f32", "nested"), (2, 48, 4, "save-proj", "f32", "nested")]:
    a = SimpleNamespace(lora_r=8, lora_alpha=16, batch=2, seq=seq, remat=remat, key_block=block, trips_per_body=1,
                        loop_form=form)
    cd = jnp.float32 if dtype == "f32" else jnp.bfloat16
    d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    frozen, embed, norm, head, lora, ids, labels = js.random_inputs(cfg, targets, a, cd, d)
    labels = labels.at[0, :5].set(-100)
    ends = (embed, norm, head)
    plain = js.make_step(cfg, a, 2, seq, cd, targets).loss_fn
    mesh = Mesh(np.array(jax.devices()[:cp]), ("context",))
    split = js.make_step(cfg, a, 2, seq, cd, targets, context=(mesh, cp)).loss_fn
    l0, g0 = jax.jit(jax.value_and_grad(plain))(lora, frozen, ends, ids, labels)
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P()))
    l1, g1 = jax.jit(jax.value_and_grad(split))(put(lora), put(frozen), put(ends), put(ids), put(labels))
    worst = max(float(jnp.max(jnp.abs(g0[k] - g1[k])) / jnp.max(jnp.abs(g0[k]))) for k in g0)
    ok = dtype != "f32" or (abs(float(l0) - float(l1)) <= 1e-5 and worst <= 1e-5)
    failed |= not ok
    print(f"context={cp} seq={seq} key block {block} remat {remat} {dtype} {form} loops: loss {float(l0):.6f} vs "
          f"{float(l1):.6f}, largest gradient difference / largest gradient {worst:.2e}"
          + ("" if dtype != "f32" else (" ok" if ok else " FAILED (tolerance 1e-5)")))
sys.exit(1 if failed else 0)
