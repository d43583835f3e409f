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


def _pyproject() -> dict:
    import tomllib

    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def test_image_requirements_are_the_gpu_install_set_of_pyproject(load_modal_run):
    """What the image installs is what `pip install '.[gpu]'` installs: pyproject's list, nothing else."""
    project = _pyproject()
    expected = set(project["dependencies"]) | set(project["optional-dependencies"]["gpu"])
    requirements = load_modal_run().image_requirements()
    assert set(requirements) == expected and len(requirements) == len(expected)
    assert any(r.startswith("vllm==") for r in requirements)
    assert any(r.startswith("vllm-router") for r in requirements)
    # PyPI only: no direct URLs, and no source-only package that needs torch to build.
    assert not [r for r in requirements if "@" in r or "://" in r]
    assert not [r for r in requirements if r.lower().startswith(("flash-attn", "flash_attn"))]


def test_image_requirements_name_an_unknown_extra(load_modal_run, tmp_path):
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\ndependencies = ["a"]\n[project.optional-dependencies]\ngpu = ["b"]\n')
    modal_run = load_modal_run()
    assert modal_run.image_requirements(pyproject, ("gpu",)) == ["a", "b"]
    with pytest.raises(ValueError, match=r"\['cuda'\] are not in"):
        modal_run.image_requirements(pyproject, ("cuda",))


class RecordingImage:
    """Stands in for ``modal.Image`` and records the builder calls; each is checked against Modal's
    own signature, so the recording cannot drift from the real API."""

    def __init__(self, calls: list | None = None):
        self.calls = [] if calls is None else calls

    @classmethod
    def debian_slim(cls, *args, **kwargs):
        image = cls()
        return image._record("debian_slim", args, kwargs)

    def _record(self, name, args, kwargs):
        import inspect

        signature = inspect.signature(getattr(modal.Image, name))
        takes_self = next(iter(signature.parameters), None) == "self"  # debian_slim is static
        signature.bind(*((None, *args) if takes_self else args), **kwargs)
        self.calls.append((name, args, kwargs))
        return self

    def __getattr__(self, name):
        if name.startswith("_") or not hasattr(modal.Image, name):
            raise AttributeError(name)
        return lambda *args, **kwargs: self._record(name, args, kwargs)


@pytest.mark.parametrize("wheel", [None, "https://example.org/flash_attn-2.8.3-cp312-linux_x86_64.whl"])
def test_image_layers_install_pyproject_then_optional_flash_attn_then_the_repo(load_modal_run, wheel):
    modal_run = load_modal_run()
    image = modal_run.build_image(RecordingImage, flash_attn_wheel=wheel)
    names = [name for name, _, _ in image.calls]
    pip_layers = [args for name, args, _ in image.calls if name == "pip_install"]
    assert pip_layers[0] == tuple(modal_run.image_requirements())
    assert pip_layers[1:] == ([(wheel,)] if wheel else [])
    assert names[-2:] == ["add_local_dir", "run_commands"]
    assert names.index("pip_install") < names.index("add_local_dir")  # dependencies cached apart


def test_flash_attn_layer_comes_from_the_environment_only(load_modal_run):
    assert load_modal_run().FLASH_ATTN_WHEEL is None
    url = "https://example.org/fa.whl"
    assert load_modal_run(RLLM_SKYRL_MODAL_FLASH_ATTN_WHEEL=url).FLASH_ATTN_WHEEL == url
