"""rLLM's ``DistillationWorkflow`` gives every episode its trajectory rewards, however it ends.

Its ``run`` returns the episode it built, which rLLM's workflow runner takes as already
post-processed: the trajectory keeps ``reward=None``. A rollout cut at ``max_response_length``
raises ``TerminationEvent`` instead, and the runner post-processes that one, setting the reward. A
group holding both kinds then fails rLLM's transform ("Trajectories in a group must either ALL NOT
have a trajectory-level reward or ALL have ..."), on the first step of a run whose student sometimes
runs out of tokens. Here ``run``'s episode goes through the same ``postprocess_episode``.
"""

from __future__ import annotations

from typing import Any

MODULE = "rllm.workflows.distillation_workflow"


def apply() -> None:
    from rllm.workflows.distillation_workflow import DistillationWorkflow
    from rllm.workflows.workflow import TerminationReason

    original = DistillationWorkflow.run
    if getattr(original, "__wrapped__", None) is not None:
        return

    async def run(self: Any, task: dict, uid: str, **kwargs: Any) -> Any:
        episode = await original(self, task, uid, **kwargs)
        return self.postprocess_episode(episode, TerminationReason.ENV_DONE)

    run.__wrapped__ = original  # type: ignore[attr-defined]
    DistillationWorkflow.run = run
