"""A real training run for the tests: ``python test/apps/train_digits.py hydra.run.dir=DIR [overrides]``.

Under rLLM's trainer and records when rLLM is installed, the fallback's otherwise (as the examples).

The workflow appends one JSON line per rollout to ``$ROLLOUT_LOG`` (when set): episode id, whether
it was a validation rollout, the weight version it sampled from, its data source, its reward and
its response length. The tests rebuild the data order and pass@k from that record.
The reward is 1 when the first response token id is even, so pass@1 sits near 0.5 and pass@k is
informative even for a random model.

With ``HOLD_SAVE_AT_STEP=N`` and ``HOLD_SAVE_MARKER=PATH``, the save of step N stops once every part
is written and flushed but before it is published, writes the temporary directory's name to PATH
and waits there for the test to kill the run.
"""

from __future__ import annotations

import json
import os
import random
import threading
from pathlib import Path

import hydra
from omegaconf import DictConfig

from rllm_skyrl.checkpoint import dirs as checkpoint_dirs
from rllm_skyrl.rllm_names import Episode, Step, TerminationReason, Trajectory, Workflow
from rllm_skyrl.training_run import train

VAL_SOURCES = ("digits_a", "digits_b")


def make_rows(num_rows: int, seed: int, prefix: str, sources: tuple[str, ...]) -> list[dict]:
    rng = random.Random(seed)
    return [
        {
            "id": f"{prefix}-{i}",
            "question": f"what is {rng.randrange(10)}?",
            "data_source": sources[i % len(sources)],
        }
        for i in range(num_rows)
    ]


class LoggedParityWorkflow(Workflow):
    async def run(self, task: dict, uid: str, **kwargs) -> Episode:
        validation = bool(self.rollout_engine.is_validation)
        messages = [{"role": "user", "content": task["question"]}]
        output = await self.rollout_engine.get_model_response(messages, application_id=uid, **kwargs)
        ids = output.completion_ids
        reward = float(bool(ids) and ids[0] % 2 == 0)
        if os.environ.get("ROLLOUT_LOG"):
            record = {
                "task_id": task["id"],
                "val": validation,
                "version": output.weight_version,
                "source": task["data_source"],
                "reward": reward,
                "tokens": len(ids),
            }
            with open(os.environ["ROLLOUT_LOG"], "a") as f:
                f.write(json.dumps(record) + "\n")
        step = Step(chat_completions=messages, reward=reward, done=True, model_output=output)
        return Episode(
            id=uid,
            task=task,
            trajectories=[Trajectory(name="agent", task=task, steps=[step], reward=reward)],
            is_correct=reward > 0,
            termination_reason=TerminationReason.ENV_DONE,
        )


def hold_save(step: int, marker: Path) -> None:
    def hold(saved_step: int, tmp: Path) -> None:
        if saved_step == step:
            partial = marker.with_name(marker.name + ".partial")
            partial.write_text(tmp.name)
            os.replace(partial, marker)
            threading.Event().wait()  # until SIGKILL

    checkpoint_dirs.before_publish = hold


@hydra.main(config_path=".", config_name="train_digits", version_base=None)
def main(cfg: DictConfig) -> None:
    if os.environ.get("HOLD_SAVE_AT_STEP"):
        hold_save(int(os.environ["HOLD_SAVE_AT_STEP"]), Path(os.environ["HOLD_SAVE_MARKER"]))
    train(
        cfg,
        workflow_class=LoggedParityWorkflow,
        train_dataset=make_rows(cfg.dataset.train_rows, cfg.dataset.seed, "train", ("digits",)),
        val_dataset=make_rows(6, cfg.dataset.seed + 1, "val", VAL_SOURCES),
    )


if __name__ == "__main__":
    main()
