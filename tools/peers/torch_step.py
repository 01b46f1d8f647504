"""The benchmark workload's LoRA training step as people write it with transformers + PEFT: an
eager torch loop (forward, loss.backward(), AdamW.step(), zero_grad) over LlamaForCausalLM with a
PEFT LoRA adapter. Reads the weights and batch that `xtrain bench --export` wrote, prints the first
step's loss (checked against xtrain's by tools/bench) and the timings as JSON, in the same form as
jax_step.py.

usage: torch_step.py EXPORT.safetensors --config CONFIG.json --steps N --warmup W
                     --lora-r R --lora-alpha A --targets q,v [--dtype f32|bf16]
"""
import argparse, json, time, warnings

import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM
from peft import LoraConfig, get_peft_model

PROJECTIONS = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj",
               "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("export")
    p.add_argument("--config", required=True)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--lora-alpha", type=float, default=32)
    p.add_argument("--targets", default="q,v")
    p.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    p.add_argument("--peak", action="store_true", help="also measure torch's matmul GFLOP/s (2048^3, in --dtype)")
    a = p.parse_args()

    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.manual_seed(0)
    tensors = load_file(a.export)
    ids, labels = tensors.pop("input_ids").long(), tensors.pop("labels").long()
    attention_mask = tensors.pop("attention_mask").long()
    base = {k: v.float() for k, v in tensors.items() if not k.startswith("base_model.")}
    adapter = {k: v.float() for k, v in tensors.items() if k.startswith("base_model.")}

    cfg = LlamaConfig(**json.load(open(a.config)))
    cfg.use_cache = False
    model = LlamaForCausalLM(cfg)
    missing, unexpected = model.load_state_dict(base, strict=False)
    # rotary inv_freq is a buffer computed from the config, not a checkpoint tensor
    missing = [m for m in missing if "rotary_emb" not in m]
    if missing or unexpected:
        raise SystemExit(f"{a.export}: weights do not match LlamaForCausalLM: missing {missing[:3]}, unexpected {unexpected[:3]}")
    if a.dtype == "bf16":
        # bf16 base weights and activations; PEFT keeps the adapter (and so AdamW) in f32
        model = model.to(torch.bfloat16)

    lora_cfg = LoraConfig(r=a.lora_r, lora_alpha=a.lora_alpha, lora_dropout=0.0, bias="none",
                          target_modules=[PROJECTIONS[t] for t in a.targets.split(",")])
    model = get_peft_model(model, lora_cfg)
    # PEFT's own parameter names carry the adapter name: ...q_proj.lora_A.default.weight
    named = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in adapter.items():
            target = name.replace(".lora_A.weight", ".lora_A.default.weight").replace(".lora_B.weight", ".lora_B.default.weight")
            if target not in named:
                raise SystemExit(f"{a.export}: adapter tensor {name} has no PEFT parameter {target}")
            named[target].copy_(value)
    trainable = [q for q in model.parameters() if q.requires_grad]
    if len(trainable) != len(adapter):
        raise SystemExit(f"PEFT made {len(trainable)} trainable tensors, the export has {len(adapter)}")

    # the same AdamW as xtrain's bench step and the JAX peer: no weight decay, no clipping
    opt = torch.optim.AdamW(trainable, lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    model.train()
    times, first = [], None
    for i in range(a.warmup + a.steps):
        s0 = time.time()
        loss = model(input_ids=ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = float(loss.detach())
        if i == 0:
            first = value
        if i >= a.warmup:
            times.append(time.time() - s0)
    B, T = ids.shape
    out = {"compile_s": 0.0,  # eager: nothing is compiled
           "step_s": times, "first_loss": first, "tokens_per_step": int(B * T),
           "torch": torch.__version__, "threads": torch.get_num_threads()}
    if a.peak:
        n = 2048
        x = torch.ones(n, n, dtype=torch.bfloat16 if a.dtype == "bf16" else torch.float32)
        x @ x
        best = min((lambda s: (x @ x, time.time() - s)[1])(time.time()) for _ in range(5))
        out["matmul_gflops"] = 2 * n ** 3 / best / 1e9
    print(json.dumps(out))


if __name__ == "__main__":
    main()
