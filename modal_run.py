"""Train on Modal GPUs: ``modal run modal_run.py --module examples.simple_math.train --overrides "k=v ..."``.

The image is Debian with this repository installed with its ``gpu`` extra: the packages are read
from ``pyproject.toml`` (``image_requirements``), so the image installs exactly what
``pip install '.[gpu]'`` does. flash-attn is not among them (PyPI has no wheel for it; without it
SkyRL trains with sdpa); set ``RLLM_SKYRL_MODAL_FLASH_ATTN_WHEEL`` to a wheel URL matching the
image's torch 2.13 / CUDA / Python 3.12 to add it as its own layer. Weights & Biases and
Hugging Face credentials come from Modal secrets; run directories (and so checkpoints) are written
to a Modal volume, where a later run can resume from them. The GPU type and count default to
``RLLM_SKYRL_MODAL_GPU`` / ``RLLM_SKYRL_MODAL_GPU_COUNT`` and can be changed per run with ``--gpu``
and ``--gpu-count``; secret and volume names can be changed with the variables below.

Importing this file only declares the app: nothing is built, uploaded or contacted, and no Modal
credentials are needed, until ``modal run`` (or ``modal deploy``) executes it.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath

from rllm_skyrl.optional_deps import require

modal = require("modal")

APP_NAME = "rllm-skyrl"
REPO_DIR = Path(__file__).resolve().parent
REMOTE_REPO = PurePosixPath("/opt/rllm-skyrl")
RUNS_MOUNT = PurePosixPath("/runs")
DEFAULT_GPU = os.environ.get("RLLM_SKYRL_MODAL_GPU", "A100-80GB")
DEFAULT_GPU_COUNT = int(os.environ.get("RLLM_SKYRL_MODAL_GPU_COUNT", "1"))
WANDB_SECRET = os.environ.get("RLLM_SKYRL_MODAL_WANDB_SECRET", "wandb-secret")
HF_SECRET = os.environ.get("RLLM_SKYRL_MODAL_HF_SECRET", "huggingface-secret")
VOLUME_NAME = os.environ.get("RLLM_SKYRL_MODAL_VOLUME", "rllm-skyrl-runs")
TIMEOUT_S = 24 * 60 * 60
IMAGE_EXTRAS = ("gpu",)
FLASH_ATTN_WHEEL = os.environ.get("RLLM_SKYRL_MODAL_FLASH_ATTN_WHEEL") or None

# Local state that must not be baked into the image (and would make every build miss the cache).
IMAGE_IGNORE = [".git", ".venv", ".cache", "runs", "outputs", "**/__pycache__", "*.egg-info", "build", "dist"]
_MODULE_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def gpu_spec(gpu: str, count: int) -> str:
    """Modal's GPU string: ``H100`` for one, ``H100:8`` for eight."""
    if not gpu or ":" in gpu:
        raise ValueError(f"gpu={gpu!r}: give the type alone (e.g. H100) and the count as gpu_count")
    if count < 1:
        raise ValueError(f"gpu_count={count}: must be >= 1")
    return gpu if count == 1 else f"{gpu}:{count}"


def example_command(module: str, overrides: Sequence[str]) -> list[str]:
    """``python -m <module> <overrides...>``; the module must be a dotted name, not a path or shell code."""
    if not _MODULE_NAME.fullmatch(module):
        raise ValueError(
            f"module={module!r}: expected a dotted module name such as examples.simple_math.train"
        )
    return [sys.executable, "-m", module, *overrides]


def run_example(
    module: str,
    overrides: Sequence[str],
    workdir: Path,
    pythonpath: str,
    environ: Mapping[str, str] | None = None,
) -> None:
    """Run an example module in ``workdir`` so its relative run/checkpoint paths land there.

    ``pythonpath`` makes the repository's ``examples`` package importable (it is not part of the
    wheel). With a W&B key present (the secret), W&B logs online unless ``WANDB_MODE`` says otherwise.
    """
    env = dict(os.environ if environ is None else environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH")) if p)
    if env.get("WANDB_API_KEY"):
        env.setdefault("WANDB_MODE", "online")
    workdir.mkdir(parents=True, exist_ok=True)
    subprocess.run(example_command(module, overrides), cwd=workdir, env=env, check=True)


def image_requirements(pyproject: Path = REPO_DIR / "pyproject.toml", extras: Sequence[str] = IMAGE_EXTRAS):
    """The project's dependencies plus those of ``extras``, as pyproject.toml lists them (sorted)."""
    project = tomllib.loads(Path(pyproject).read_text())["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [extra for extra in extras if extra not in optional]
    if unknown:
        raise ValueError(f"extras {unknown} are not in {pyproject}; it has {sorted(optional)}")
    return sorted({*project["dependencies"], *(req for extra in extras for req in optional[extra])})


def build_image(image_cls=None, flash_attn_wheel: str | None = FLASH_ATTN_WHEEL):
    """Debian + the pyproject's ``gpu`` install set, (optionally) flash-attn, then this repository."""
    image_cls = image_cls or modal.Image
    # Dependencies first, from pyproject.toml alone: this layer is rebuilt only when they change.
    image = (
        image_cls.debian_slim(python_version="3.12")
        .apt_install("git", "build-essential")
        .pip_install(*image_requirements())
    )
    if flash_attn_wheel:  # its own layer, after torch: the wheel must match torch, CUDA and Python
        image = image.pip_install(flash_attn_wheel)
    return image.add_local_dir(REPO_DIR, str(REMOTE_REPO), copy=True, ignore=IMAGE_IGNORE).run_commands(
        f"python -m pip install --no-deps '{REMOTE_REPO}'"
    )


image = build_image()
runs_volume = modal.Volume.from_name(VOLUME_NAME, create_if_missing=True)
secrets = [modal.Secret.from_name(WANDB_SECRET), modal.Secret.from_name(HF_SECRET)]
app = modal.App(APP_NAME, image=image)


@app.function(
    gpu=gpu_spec(DEFAULT_GPU, DEFAULT_GPU_COUNT),
    secrets=secrets,
    volumes={str(RUNS_MOUNT): runs_volume},
    timeout=TIMEOUT_S,
)
def train(module: str, overrides: list[str]) -> None:
    """Run one example on the GPU container; the volume is committed even when the run fails."""
    try:
        run_example(module, overrides, workdir=Path(RUNS_MOUNT), pythonpath=str(REMOTE_REPO))
    finally:
        runs_volume.commit()


@app.local_entrypoint()
def main(
    module: str = "examples.simple_math.train",
    overrides: str = "",
    gpu: str = DEFAULT_GPU,
    gpu_count: int = DEFAULT_GPU_COUNT,
) -> None:
    """``overrides`` is one string of Hydra overrides, split like a shell command line."""
    arguments = shlex.split(overrides)
    example_command(module, arguments)  # reject a bad module name before a container starts
    train.with_options(gpu=gpu_spec(gpu, gpu_count)).remote(module, arguments)
