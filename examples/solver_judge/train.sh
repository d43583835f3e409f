#!/usr/bin/env bash
# Solver-judge on CPU with the tiny model; extra arguments are Hydra overrides.
# Realistic run: ./examples/solver_judge/train.sh model.path=smollm2 rllm.data.max_response_length=16
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/env.sh
exec python -m examples.solver_judge.train "$@"
