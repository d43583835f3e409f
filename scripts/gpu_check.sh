#!/usr/bin/env bash
# The GPU check: on a machine with an NVIDIA GPU, install the gpu extra into .venv (created if
# needed, as train.sh does) and run short training runs through SkyRL's vLLM servers, ending with
# one table (see bench/gpu_check.py). Without a GPU it says so and exits 0, installing nothing.
#   ./scripts/gpu_check.sh [--workdir DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "No NVIDIA GPU here (nvidia-smi is missing or lists none): nothing to check."
  echo "Run ./scripts/gpu_check.sh on a machine with a CUDA GPU."
  exit 0
fi
source scripts/env.sh
echo "Installing the gpu extra (vLLM and its router) into $VIRTUAL_ENV ..."
python -m pip install --quiet -e ".[gpu]"
exec python -m bench.gpu_check "$@"
