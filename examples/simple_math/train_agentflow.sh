#!/usr/bin/env bash
# The digit task as an AgentFlow + Evaluator under rLLM's AgentTrainer with the SkyRL backend
# (rLLM installed); the flow samples through rLLM's model gateway on 127.0.0.1 (port 0: a free one).
# The keys are the ones an rLLM tinker user writes; only `rllm/backend` names SkyRL.
# 64 flows at a time, not a step's 512: rLLM's engine gives every running flow an executor thread and
# HTTP connections, and 512 of them cost 1.7x the CPU of 64 per step (bench/gateway_breakdown.py).
# Fully-async: add  rllm.async_training.enable=true rllm.async_training.mini_batch_size=16
#                   rllm.async_training.fwd_bwd_group_size=4 rllm.workflow.raise_on_error=false
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/env.sh
exec python -m examples.simple_math.train_agentflow \
    rllm/backend=skyrl \
    model.name=tiny \
    training.group_size=32 \
    training.learning_rate=1e-3 \
    validation.group_size=4 \
    data.train_batch_size=16 \
    data.val_batch_size=50 \
    data.max_prompt_length=64 \
    data.max_response_length=2 \
    rllm.trainer.total_batches=150 \
    rllm.trainer.test_freq=50 \
    rllm.trainer.save_freq=-1 \
    rllm.trainer.project_name=simple_math \
    rllm.trainer.experiment_name=tiny_grpo_agentflow \
    rllm.gateway.port=0 \
    skyrl.trainer.micro_train_batch_size_per_gpu=512 \
    skyrl.trainer.micro_forward_batch_size_per_gpu=512 \
    rllm.workflow.n_parallel_tasks=64 \
    inference.max_batch_size=512 \
    inference.deterministic_sampling=true \
    "$@"
