# What the GPU scripts (gpu-bench.sh, gpu-long-context.sh) share, sourced from the repository
# root after their options are read: `gpu_setup NAME MODEL PLUGIN` sets
#   XTRAIN  target/release/xtrain (built here when cargo exists, else it must be carried over)
#   CONFIG  models/MODEL/config.json
#   WORK    a temporary directory, removed on exit
#   PY      the Python with JAX: $PYTHON, else python3 (the GPU machine has JAX there), else
#           tools/bench's venv (the CPU dry runs here)
# and exports JAX_PLATFORMS (PLUGIN's) and XLA_PYTHON_CLIENT_MEM_FRACTION=0.92.
gpu_setup() {
  local name=$1 model=$2 plugin=$3
  XTRAIN=target/release/xtrain
  if [ ! -x "$XTRAIN" ]; then
    command -v cargo >/dev/null || { echo "$name: $XTRAIN is missing and there is no cargo to build it" >&2; exit 1; }
    cargo build --release --quiet
  fi
  CONFIG="models/$model/config.json"
  [ -f "$CONFIG" ] || { echo "$name: no preset config $CONFIG" >&2; exit 1; }
  WORK=$(mktemp -d)
  trap 'rm -rf "$WORK"' EXIT
  export JAX_PLATFORMS=$plugin XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
  PY=${PYTHON:-python3}
  if [ -z "${PYTHON:-}" ] && ! python3 -c "import jax" 2>/dev/null && [ -x tools/.venv/bin/python ]; then
    PY=tools/.venv/bin/python
  fi
}
