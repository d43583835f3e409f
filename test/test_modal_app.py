"""modal_run.py declares its app locally: no credentials, no network, nothing built."""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
from pathlib import Path

import pytest

modal = pytest.importorskip("modal", reason="modal is not installed (pip install 'rllm-skyrl[modal]')")

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def load_modal_run(monkeypatch, tmp_path):
    """Import modal_run.py afresh (its GPU defaults are read at import) with the network cut off."""

    def refuse(*args, **kwargs):
        raise AssertionError("modal_run tried to use the network while being imported")

    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.modal.toml: no credentials either
    monkeypatch.delenv("MODAL_TOKEN_ID", raising=False)
    monkeypatch.delenv("MODAL_TOKEN_SECRET", raising=False)

    def load(**env: str):
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        spec = importlib.util.spec_from_file_location("modal_run_under_test", REPO / "modal_run.py")
        module = importlib.util.module_from_spec(spec)
        with monkeypatch.context() as offline:
            offline.setattr(socket.socket, "connect", refuse)
            offline.setattr(socket, "getaddrinfo", refuse)
            spec.loader.exec_module(module)
        return module

    return load


def test_app_image_secrets_volume_and_function_are_declared(load_modal_run):
    modal_run = load_modal_run()
    assert isinstance(modal_run.app, modal.App) and modal_run.app.name == "rllm-skyrl"
    assert isinstance(modal_run.image, modal.Image)
    assert isinstance(modal_run.runs_volume, modal.Volume)
    assert isinstance(modal_run.train, modal.Function)
    assert all(isinstance(secret, modal.Secret) for secret in modal_run.secrets)
    names = " ".join(repr(secret) for secret in modal_run.secrets)
    assert "wandb-secret" in names and "huggingface-secret" in names
    assert type(modal_run.main).__name__ == "LocalEntrypoint"

    spec = modal_run.train._spec_  # what the function will be created with
    assert spec.gpus == "A100-80GB"
    # The spec holds Modal's unwrapped objects: compare what they refer to.
    assert {path: repr(volume) for path, volume in spec.volumes.items()} == {
        "/runs": repr(modal_run.runs_volume)
    }
    assert [repr(secret) for secret in spec.secrets] == [repr(secret) for secret in modal_run.secrets]


def test_gpu_type_and_count_come_from_the_environment(load_modal_run):
    modal_run = load_modal_run(RLLM_SKYRL_MODAL_GPU="H100", RLLM_SKYRL_MODAL_GPU_COUNT="8")
    assert modal_run.train._spec_.gpus == "H100:8"


@pytest.mark.parametrize(
    ("gpu", "count", "spec"),
    [("A10G", 1, "A10G"), ("H100", 8, "H100:8"), ("L40S", 2, "L40S:2")],
)
def test_gpu_spec(load_modal_run, gpu, count, spec):
    assert load_modal_run().gpu_spec(gpu, count) == spec


@pytest.mark.parametrize(("gpu", "count"), [("H100:2", 1), ("", 1), ("H100", 0)])
def test_gpu_spec_rejects_ambiguous_or_empty_requests(load_modal_run, gpu, count):
    with pytest.raises(ValueError, match="gpu"):
        load_modal_run().gpu_spec(gpu, count)


def test_example_command_is_python_dash_m_with_overrides(load_modal_run):
    command = load_modal_run().example_command("examples.simple_math.train", ["a=1", "b.c=[1,2]"])
    assert command == [sys.executable, "-m", "examples.simple_math.train", "a=1", "b.c=[1,2]"]


@pytest.mark.parametrize("module", ["../train.py", "examples/simple_math/train", "x; rm -rf /", "", "1abc"])
def test_example_command_rejects_anything_but_a_module_name(load_modal_run, module):
    with pytest.raises(ValueError, match="dotted module name"):
        load_modal_run().example_command(module, [])


def test_run_example_runs_in_the_workdir_with_the_repo_importable(load_modal_run, tmp_path):
    """The function body, locally: relative outputs land in the volume dir, overrides reach the module."""
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "__init__.py").write_text("")
    (repo / "pkg" / "job.py").write_text(
        "import json, os, sys\n"
        "result = {'argv': sys.argv[1:], 'wandb': os.environ.get('WANDB_MODE')}\n"
        "open('out.json', 'w').write(json.dumps(result))\n"
    )
    workdir = tmp_path / "volume" / "runs"
    environ = {"PATH": "/usr/bin:/bin", "WANDB_API_KEY": "k"}
    load_modal_run().run_example("pkg.job", ["x=1"], workdir=workdir, pythonpath=str(repo), environ=environ)
    assert (workdir / "out.json").read_text() == '{"argv": ["x=1"], "wandb": "online"}'


def test_run_example_keeps_wandb_offline_without_a_key_and_reports_failure(load_modal_run, tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "job.py").write_text(
        "import os, sys\nopen('mode', 'w').write(str(os.environ.get('WANDB_MODE')))\nsys.exit(3)\n"
    )
    with pytest.raises(subprocess.CalledProcessError) as caught:
        load_modal_run().run_example("job", [], workdir=tmp_path / "w", pythonpath=str(repo), environ={})
    assert caught.value.returncode == 3
    assert (tmp_path / "w" / "mode").read_text() == "None"
