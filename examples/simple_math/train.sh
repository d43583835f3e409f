#!/usr/bin/env bash
# GRPO on the digit task; extra arguments are Hydra overrides (e.g. rllm.trainer.total_batches=50).
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/env.sh
exec python -m examples.simple_math.train "$@"
