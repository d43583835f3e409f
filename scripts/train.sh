#!/usr/bin/env bash
# The quickstart: GRPO on the digit task with a tiny in-process model, on CPU, through SkyRL's
# real workers (creates/refreshes .venv first). Extra arguments are Hydra overrides, e.g.
#   ./scripts/train.sh rllm.trainer.total_batches=50 training.learning_rate=5e-4
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
exec python -m examples.simple_math.train "$@"
