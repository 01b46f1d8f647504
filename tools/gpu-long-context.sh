#!/usr/bin/env bash
# Long context on one NVIDIA GPU: xtrain's step with key blocks (the nested attention loops) at
# 8k and 32k tokens, the same step with cuDNN's fused attention in the composites' place
# (`--kernel cudnn`, on cuda), optionally beside an earlier xtrain build (the flat loop of
# 2026-12-03), and JAX's attention alone (jax.nn.dot_product_attention, implementation 'xla' and 'cudnn')
# on the same shapes, forward and backward. Prints one table; record it in docs/performance.md
# ("Long context in nested loops") with the date and the GPU.
#
# For a CUDA machine with JAX and the jax-cuda13-pjrt plugin installed and no network: it needs
# target/release/xtrain (built elsewhere and carried over, or built here when cargo exists) and
# python3 with JAX.
#
# usage: tools/gpu-long-context.sh [--plugin cuda] [--model llama-3.1-8b] [--seqs "8192 32768"]
#                                  [--key-block 512] [--before BIN] [--steps 3] [--warmup 1]
#   --before BIN  also time this xtrain binary (e.g. one built at a9b9f6e, the flat loop)
#   --plugin cpu  a dry run of this script on the CPU (with --model tiny-llama3 --seqs 256):
#                 JAX on CPU too, 'xla' only (cuDNN needs a GPU)
# Before spending GPU time, check that the step fits:
#   xtrain compile --model llama-3.1-8b --dtype bf16 --lora-r 16 --batch 1 --seq 32768
#     --remat save-proj --target cuda:h200:1 --check --out /tmp/p
# With about 15 minutes of GPU time, keep --steps 3 --warmup 1 (two compiles per length).
set -euo pipefail
cd "$(dirname "$0")/.."

PLUGIN=cuda; MODEL=llama-3.1-8b; SEQS="8192 32768"; KEY_BLOCK=512; BEFORE=; STEPS=3; WARMUP=1
while [ $# -gt 0 ]; do
  case "$1" in
    --plugin) PLUGIN="$2"; shift 2;;
    --model) MODEL="$2"; shift 2;;
    --seqs) SEQS="$2"; shift 2;;
    --key-block) KEY_BLOCK="$2"; shift 2;;
    --before) BEFORE="$2"; shift 2;;
    --steps) STEPS="$2"; shift 2;;
    --warmup) WARMUP="$2"; shift 2;;
    *) echo "gpu-long-context: unknown option $1" >&2; exit 2;;
  esac
done

. tools/gpu-common.sh
gpu_setup gpu-long-context "$MODEL" "$PLUGIN"
[ -z "$BEFORE" ] || [ -x "$BEFORE" ] || { echo "gpu-long-context: --before $BEFORE is not an executable" >&2; exit 1; }
if [ "$PLUGIN" = cuda ]; then
  nvidia-smi --query-gpu=name,memory.total --format=csv || true
  export IMPLS="xla cudnn"
else
  export IMPLS="xla"
fi

# One xtrain step timing: bf16, LoRA r=16 on all seven projections, batch 1, save-proj, key blocks.
bench() {
  local name=$1 bin=$2 seq=$3; shift 3
  echo "== $name at $seq tokens" >&2
  if ! "$bin" bench --plugin "$PLUGIN" --model "$MODEL" --dtype bf16 --batch 1 --seq "$seq" \
      --lora-r 16 --lora-alpha 32 --lora-targets q,k,v,o,gate,up,down --remat save-proj \
      --key-block "$KEY_BLOCK" --warmup "$WARMUP" --steps "$STEPS" "$@" \
      > "$WORK/$name.$seq.json" 2> "$WORK/$name.$seq.err"; then
    tail -3 "$WORK/$name.$seq.err" >&2
    echo "failed" > "$WORK/$name.$seq.json"
  fi
  grep -E "random weights|compiled in|step [0-9]+/" "$WORK/$name.$seq.err" >&2 || true
}

for seq in $SEQS; do
  bench after "$XTRAIN" "$seq"
  [ "$PLUGIN" != cuda ] || bench cudnn "$XTRAIN" "$seq" --kernel cudnn
  echo "== JAX attention alone at $seq tokens ($IMPLS)" >&2
  "$PY" - "$CONFIG" "$seq" "$STEPS" > "$WORK/jax.$seq.json" 2> "$WORK/jax.$seq.err" <<'PY' || { tail -3 "$WORK/jax.$seq.err" >&2; echo '{}' > "$WORK/jax.$seq.json"; }
# jax.nn.dot_product_attention forward and backward (the gradients of q, k and v) on one
# layer's shapes, causal, bf16, batch 1; the median of `steps` timed calls after one warm-up.
import json, os, statistics, sys, time
import jax, jax.numpy as jnp
cfg = json.load(open(sys.argv[1])); T = int(sys.argv[2]); steps = int(sys.argv[3])
H = cfg["num_attention_heads"]; KV = cfg.get("num_key_value_heads", H)
D = cfg.get("head_dim", cfg["hidden_size"] // H)
key = jax.random.PRNGKey(0)
q = jax.random.normal(key, (1, T, H, D), jnp.bfloat16)
k = jax.random.normal(jax.random.fold_in(key, 1), (1, T, KV, D), jnp.bfloat16)
v = jax.random.normal(jax.random.fold_in(key, 2), (1, T, KV, D), jnp.bfloat16)
out = {}
for impl in os.environ["IMPLS"].split():
    def loss(q, k, v):
        o = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
        return jnp.sum(o.astype(jnp.float32))
    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    try:
        jax.block_until_ready(step(q, k, v))
        times = []
        for _ in range(steps):
            t0 = time.perf_counter(); jax.block_until_ready(step(q, k, v)); times.append(time.perf_counter() - t0)
        out[impl] = statistics.median(times)
    except Exception as e:  # cuDNN refuses some shapes: say so in the table
        out[impl] = f"failed: {str(e).splitlines()[0][:80]}"
json.dump({"layers": cfg["num_hidden_layers"], **out}, sys.stdout)
PY
  echo "   $(cat "$WORK/jax.$seq.json")" >&2
  # The earlier build last: the slowest, and the one a short GPU lease can best do without.
  [ -z "$BEFORE" ] || bench before "$BEFORE" "$seq"
done

python3 - "$WORK" "$SEQS" "$MODEL" "$PLUGIN" "$KEY_BLOCK" "${BEFORE:+yes}" <<'PY'
import json, statistics, sys
work, seqs, model, plugin, kb, before = sys.argv[1], sys.argv[2].split(), sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6]
def step(name, seq):
    try:
        r = json.load(open(f"{work}/{name}.{seq}.json"))
        m = statistics.median(r["step_s"])
        return f"{m:.3f} s ({int(seq) / m:,.0f} tokens/s)"
    except Exception:
        return "failed (see above)"
print(f"\n{model}, bf16, LoRA r=16 on all projections, batch 1, --remat save-proj, --key-block {kb}, on {plugin}")
cuda = plugin == "cuda"
cols = ["xtrain step (nested loops)"] + (["xtrain step, --kernel cudnn"] if cuda else []) + (["xtrain step (--before)"] if before else []) + ["JAX attention fwd+bwd x layers: xla", "cudnn"]
print("| tokens | " + " | ".join(cols) + " |")
print("|---" * (len(cols) + 1) + "|")
for seq in seqs:
    row = [step("after", seq)] + ([step("cudnn", seq)] if cuda else []) + ([step("before", seq)] if before else [])
    j = json.load(open(f"{work}/jax.{seq}.json"))
    for impl in ("xla", "cudnn"):
        t = j.get(impl, "not run")
        row.append(f"{t * j['layers']:.3f} s" if isinstance(t, float) else str(t))
    print(f"| {seq} | " + " | ".join(row) + " |")
def losses(name, seq):
    try:
        return json.load(open(f"{work}/{name}.{seq}.json"))["losses"]
    except Exception:
        return None
print("\nThe loss before each step (the same random batch every step; warm-up steps included):")
for seq in seqs:
    for name in ["after"] + (["cudnn"] if cuda else []) + (["before"] if before else []):
        l = losses(name, seq)
        print(f"  {seq} {name}: " + (" ".join(f"{x:.5f}" for x in l) if l else "none"))
    a, c = losses("after", seq), (losses("cudnn", seq) if cuda else None)
    if a and c:
        worst = max(abs(x - y) / max(abs(x), 1e-9) for x, y in zip(a, c))
        print(f"  {seq}: cudnn against the loops: largest relative difference {worst:.2e}")
print("\nJAX's columns are attention alone (one layer's forward and backward, times the layers):")
print("what a fused kernel in the composites' place could bring, not a whole step.")
PY
