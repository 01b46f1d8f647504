#!/usr/bin/env bash
# xtrain against JAX on one GPU: Llama 3.1 8B shapes, random bf16 weights, seq 2048, LoRA r=16
# alpha=32 on all seven projections, remat per layer, AdamW, the largest batch that fits; prints
# tokens/s, MFU and the ratio. For a CUDA machine with JAX and the jax-cuda13-pjrt plugin installed
# and no network: it needs target/release/xtrain (built elsewhere and carried over, or built here
# when cargo exists) and `python3` with JAX.
#
# usage: tools/gpu-bench.sh [--plugin cuda] [--model llama-3.1-8b] [--seq 2048] [--batch N]
#                           [--steps 5] [--warmup 2] [--mem-gib G] [--peak-tflops 989]
#   --batch N     skip the search for the largest batch (otherwise: two `xtrain compile --check`
#                 probes give XLA's memory per row, and the largest batch under 92% of the GPU's
#                 memory is tried, then smaller ones if it does not fit)
#   --mem-gib G   device memory (default: nvidia-smi's figure)
#   --plugin cpu  a dry run of this script on the CPU (with a small --model), JAX on CPU too
# With about 15 minutes of GPU time, `--steps 3 --warmup 1` leaves room for the four compiles
# (two memory probes, xtrain, JAX) of the 8B step.
set -euo pipefail
cd "$(dirname "$0")/.."

PLUGIN=cuda; MODEL=llama-3.1-8b; SEQ=2048; BATCH=; STEPS=5; WARMUP=2; MEM_GIB=; PEAK=989
while [ $# -gt 0 ]; do
  case "$1" in
    --plugin) PLUGIN="$2"; shift 2;;
    --model) MODEL="$2"; shift 2;;
    --seq) SEQ="$2"; shift 2;;
    --batch) BATCH="$2"; shift 2;;
    --steps) STEPS="$2"; shift 2;;
    --warmup) WARMUP="$2"; shift 2;;
    --mem-gib) MEM_GIB="$2"; shift 2;;
    --peak-tflops) PEAK="$2"; shift 2;;
    *) echo "unknown option $1" >&2; exit 2;;
  esac
done

. tools/gpu-common.sh
gpu_setup gpu-bench "$MODEL" "$PLUGIN"
STEP=(--model "$MODEL" --dtype bf16 --seq "$SEQ" --remat layer --lora-r 16 --lora-alpha 32
      --lora-targets q,k,v,o,gate,up,down --plugin "$PLUGIN")

echo "== devices"
"$XTRAIN" plugins 2>&1 | sed -n "/^$PLUGIN\b/,/^[a-z]/p" | head -20 || true
[ "$PLUGIN" != cuda ] || nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv || true

# XLA's figure for the whole step at one batch size: arguments + outputs not aliased + temporaries
probe() {
  "$XTRAIN" compile "${STEP[@]}" --batch "$1" --out "$WORK/probe$1" --check \
    | sed -n 's/^per device total[^:]*: \([0-9.]*\) GiB$/\1/p'
}
if [ -z "$BATCH" ]; then
  if [ -z "$MEM_GIB" ]; then
    MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
    MEM_GIB=$(python3 -c "print($MIB / 1024)")
  fi
  echo "== finding the largest batch for $MEM_GIB GiB (XLA's memory figures at batch 1 and 2)"
  M1=$(probe 1); M2=$(probe 2)
  [ -n "$M1" ] && [ -n "$M2" ] || { echo "gpu-bench: the memory probes printed no figures" >&2; exit 1; }
  BATCH=$(python3 -c "
m1, m2, mem = $M1, $M2, $MEM_GIB
per_row = max(m2 - m1, 1e-3)
print(max(1, min(256, int((0.92 * mem - m1) / per_row) + 1)))")
  echo "   batch 1: $M1 GiB, batch 2: $M2 GiB -> $(python3 -c "print(f'{$M2 - $M1:.2f}')") GiB per row -> batch $BATCH"
fi

# Run one peer at the largest batch that works, from $2 down (halving each time it does not fit:
# every try costs a compile, and the GPU time is short).
run_peer() {
  local name=$1 b=$2; shift 2
  while :; do
    echo "== $name, batch $b" >&2
    if "$@" --batch "$b" > "$WORK/$name.json" 2> "$WORK/$name.err"; then
      echo "$b"; return 0
    fi
    tail -3 "$WORK/$name.err" >&2
    if ! grep -qiE "out of memory|RESOURCE_EXHAUSTED|OOM|allocat" "$WORK/$name.err"; then
      echo "gpu-bench: $name failed (not for memory); see above" >&2; return 1
    fi
    [ "$b" -gt 1 ] || { echo "gpu-bench: $name does not fit even at batch 1" >&2; return 1; }
    b=$(( b / 2 ))
  done
}
XB=$(run_peer xtrain "$BATCH" "$XTRAIN" bench "${STEP[@]}" --warmup "$WARMUP" --steps "$STEPS")
JB=$(run_peer jax "$XB" "$PY" tools/peers/jax_step.py --random --config "$CONFIG" --seq "$SEQ" \
     --dtype bf16 --targets all --remat layer --lora-r 16 --lora-alpha 32 --warmup "$WARMUP" --steps "$STEPS")

python3 - "$WORK" "$CONFIG" "$SEQ" "$PEAK" "$XB" "$JB" "$PLUGIN" <<'PY'
import json, statistics, sys
work, config, T, peak, xb, jb, plugin = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), sys.argv[7]
# Model FLOPs per token, as xtrain counts them for the step it ran (src/train/bench.rs,
# model_flops_per_step; no recomputation counted): forward 2*P and the activation gradients
# through the frozen weights 2*P (P = matmul weights incl. the LM head; no weight gradients),
# attention 4*T*heads*head_dim per layer forward and twice that backward (full T x T), LoRA
# 6*r*(in+out) per adapted projection. The JAX peer runs the same model, batch shape aside.
xrun = json.load(open(f"{work}/xtrain.json"))
per_token = xrun["model_flops_per_step"] / xrun["tokens_per_step"]
print(f"model FLOPs per token: 4*P + 12*L*T*heads*head_dim + LoRA = {per_token/1e9:.2f} GFLOP (T = {T}; xtrain's model_flops_per_step)")
print(f"peak: {peak:g} TFLOP/s dense bf16")
rows = {}
for name, b in [("xtrain", xb), ("JAX", jb)]:
    run = json.load(open(f"{work}/{name.lower()}.json"))
    med = statistics.median(run["step_s"])
    tps = b * T / med
    rows[name] = tps
    print(f"{name:7s} batch {b:3d} x {T} | compile {run['compile_s']:6.1f} s | step median {med:.3f} s "
          f"(min {min(run['step_s']):.3f}, max {max(run['step_s']):.3f}, n={len(run['step_s'])}) | {tps:8.0f} tokens/s | "
          f"MFU {100 * tps * per_token / (peak * 1e12):5.1f}% | loss {run['first_loss']:.4f}")
print(f"xtrain / JAX tokens/s: {rows['xtrain'] / rows['JAX']:.2f}x (on {plugin})")
PY
