#!/usr/bin/env bash
# Everything one short lease of one NVIDIA GPU should measure, in one command of under ten
# minutes (the device tool's limit), most important first:
#   1. `--kernel cudnn` against the key-block loops and `every-key` on the tiny model: the loss
#      before each of 7 steps (the same batch every step), so that a wrong forward (first loss)
#      or gradient (the next ones) shows before any timing is trusted;
#   2. tools/gpu-long-context.sh: 8B at 8k and 32k tokens, the loops, cudnn, JAX's attention
#      ('xla', 'cudnn') and, with --before BIN, an earlier build;
#   3. tools/gpu-bench.sh: the 8B step against JAX's at seq 2048, batch 16, with what is left.
# Logs go to $OUT (the device tool's folder that comes back) or /tmp/xtrain-gpu-session.
#
# usage: tools/gpu-session.sh [--before BIN]
#   --before BIN  an earlier xtrain (e.g. built at a9b9f6e, the flat attention loop), carried
#                 beside target/release/xtrain
set -uo pipefail
cd "$(dirname "$0")/.."
BEFORE=()
while [ $# -gt 0 ]; do
  case "$1" in
    --before) BEFORE=(--before "$2"); shift 2;;
    *) echo "gpu-session: unknown option $1" >&2; exit 2;;
  esac
done
S=$(date +%s)
LOGS=${OUT:-/tmp/xtrain-gpu-session}; mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1
XTRAIN=target/release/xtrain
[ -x "$XTRAIN" ] || { echo "gpu-session: build $XTRAIN first (cargo build --release) or carry it" >&2; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tail -1
"$XTRAIN" plugins 2>&1 | sed -n '/^cuda/,/^[a-z]/p' | head -6

echo "== --kernel cudnn against the loops, tiny model ($(( $(date +%s) - S )) s)"
for k in loops cudnn every-key; do
  extra=(); [ "$k" = loops ] || extra=(--kernel "$k")
  timeout 90 "$XTRAIN" bench --plugin cuda --model tiny-llama3 --dtype bf16 --batch 2 --seq 512 \
    --key-block 64 --lora-r 16 --lora-targets q,k,v,o,gate,up,down --steps 6 --warmup 1 "${extra[@]}" \
    > "$LOGS/tiny-$k.json" 2> "$LOGS/tiny-$k.err" \
    && python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[2], ' '.join(f'{x:.6f}' for x in r['losses']))" \
         "$LOGS/tiny-$k.json" "$k" \
    || tail -5 "$LOGS/tiny-$k.err"
done

echo "== long context ($(( $(date +%s) - S )) s)"
timeout 380 bash tools/gpu-long-context.sh --seqs "8192 32768" --key-block 512 "${BEFORE[@]}" \
  --steps 3 --warmup 1 2>&1 | tee "$LOGS/long-context.log"

LEFT=$(( 565 - ($(date +%s) - S) ))
echo "== the 8B step against JAX, seq 2048, batch 16 ($(( $(date +%s) - S )) s; $LEFT s left)"
if [ "$LEFT" -gt 90 ]; then
  timeout "$LEFT" bash tools/gpu-bench.sh --batch 16 --steps 3 --warmup 1 2>&1 | tee "$LOGS/gpu-bench.log"
else
  echo "skipped: too little time left"
fi
echo "== done at $(( $(date +%s) - S )) s"
