"""Start the training workers' processes early, so their imports overlap the driver's own bring-up.

An actor runs in a process Ray starts when the actor is created; the process first runs the set-up
hook (SkyRL's patches, which import torch, transformers and SkyRL's worker modules: about 4 s on
two cores) and only then builds the model. A no-op task asking for what the actor will ask for
(same CPUs and GPUs, same runtime env) makes Ray start such processes at once. Once the task is
done they wait in Ray's pool, and the actor created later takes one whose imports are done. If none
is left by then (another task took it, Ray's idle timeout reaped it), Ray starts a process as it
would have anyway: this only moves work earlier, it never changes what runs.

This module is what the prewarm task's process imports: keep it light.
"""

from __future__ import annotations

import os

import ray


@ray.remote(max_calls=0)  # the process stays in Ray's pool after the task (GPU tasks default to 1)
def _started() -> int:
    return os.getpid()


def prewarm_worker_processes(shapes: list[tuple[float, float]]) -> list[ray.ObjectRef]:
    """Ask Ray for a worker process per ``(num_cpus, num_gpus)``; returns the tasks' refs (each
    resolves to the pid that ran it), which callers may drop."""
    return [_started.options(num_cpus=cpus, num_gpus=gpus).remote() for cpus, gpus in shapes]
