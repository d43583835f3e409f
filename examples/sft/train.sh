#!/usr/bin/env bash
# SFT on the successor task (rLLM's AgentSFTTrainer on SkyRL), then GRPO from its HF export under
# rLLM's AgentTrainer. Arguments go to the SFT run (e.g. --epochs 10); RL_STEPS sets the RL steps.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/env.sh
out="${SFT_OUT:-runs/sft/$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$out"
python -m examples.sft.train "$out/sft" "$@" | tee "$out/sft.log"
model="$(sed -n 's/^HF model: //p' "$out/sft.log" | tail -1)"
# 3e-4, not the digit example's 1e-3: that rate is tuned for learning from scratch and erodes
# what SFT taught.
exec python -m examples.sft.rl "hydra.run.dir=$out/rl" "model.path=$model" \
  "rllm.trainer.total_batches=${RL_STEPS:-20}" "training.learning_rate=3e-4" \
  "rllm.trainer.experiment_name=sft_then_grpo"
