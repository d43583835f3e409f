"""On-policy distillation on the digit task:
``python -m examples.distill.train teacher.url=URL teacher.model_dir=DIR [overrides]``.

rLLM's ``DistillationWorkflow`` samples the student (served by this backend) and asks the teacher,
through rLLM's own ``OpenAIEngine``, for the logprob of each sampled token (``/v1/completions`` with
``echo``): any OpenAI-compatible server that answers ``echo`` with prompt logprobs will do, vLLM on a
GPU or this package's CPU server (``train.sh`` starts one). The server's token, if it has one, is
read from ``RLLM_SKYRL_SERVER_TOKEN`` and passed as the API key.
"""

from __future__ import annotations

import os

import hydra
from omegaconf import DictConfig

from examples.simple_math.task import digit_reward, make_rows
from rllm_skyrl.inference.middleware import TOKEN_ENV
from rllm_skyrl.training_run import train


def teacher_engine(cfg: DictConfig):
    """rLLM's OpenAI engine on the teacher's server, rendering with the teacher's tokenizer."""
    from rllm.engine.rollout.openai_engine import OpenAIEngine
    from rllm.parser.chat_template_parser import QwenChatTemplateParser
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.teacher.model_dir)
    return OpenAIEngine(
        model=cfg.teacher.model_dir,
        tokenizer=tokenizer,
        # The tiny model's chat template is ChatML, Qwen's; rLLM picks a parser by model name, which a
        # local directory lacks, and its generic parser cannot read the completions the engine parses.
        chat_parser=QwenChatTemplateParser(tokenizer),
        base_url=cfg.teacher.url,
        api_key=os.environ.get(TOKEN_ENV) or "none",
        max_prompt_length=cfg.rllm.data.max_prompt_length + cfg.rllm.data.max_response_length,
        max_response_length=1,
    )


@hydra.main(config_path=".", config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    clip = cfg.teacher.clip
    train(
        cfg,
        workflow_class="rllm.workflows.distillation_workflow.DistillationWorkflow",
        workflow_args={
            "reward_function": digit_reward,
            "teacher_engine": teacher_engine(cfg),
            "shared_tokenizer": cfg.teacher.shared_tokenizer,
            "clip_min": None if clip is None else -clip,
            "clip_max": clip,
        },
        train_dataset=make_rows(cfg.dataset.train_rows, seed=cfg.dataset.seed),
        val_dataset=make_rows(cfg.dataset.val_rows, seed=cfg.dataset.seed + 1),
    )


if __name__ == "__main__":
    main()
