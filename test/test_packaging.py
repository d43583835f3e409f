"""The Hydra configs in the top-level ``config/`` folder reach users of a wheel and of a checkout.

The wheel is built from this checkout and installed into a scratch environment that sees the
project's dependencies but not the checkout itself; every composition runs from a directory
outside the repository, so nothing can be found by accident through the working directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# Composes the packaged entry config, and a bare app whose only config picks `rllm/backend=skyrl`
# through the search-path plug-in; prints where the package came from and what was composed.
COMPOSE = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from hydra import compose, initialize_config_dir, initialize_config_module
    import rllm_skyrl

    with initialize_config_module("rllm_skyrl.config", version_base=None):
        packaged = compose("unified", overrides=["model.path=tiny", "rllm.rollout.n=3"])
    app_dir = Path(sys.argv[1])
    (app_dir / "app.yaml").write_text("defaults:\\n  - rllm/backend: skyrl\\n  - _self_\\n")
    with initialize_config_dir(config_dir=str(app_dir), version_base=None):
        plugged = compose("app", overrides=["model.path=tiny"])
    print(json.dumps({
        "package": rllm_skyrl.__file__,
        "n": packaged.rllm.rollout.n,
        "backend": plugged.rllm.backend,
        "learning_rate": plugged.training.learning_rate,
    }))
    """
)


def _compose(python: str, cwd: Path, env: dict[str, str] | None = None) -> dict:
    app_dir = cwd / "app"
    app_dir.mkdir()
    result = subprocess.run(
        [python, "-c", COMPOSE, str(app_dir)], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_editable_install_composes_from_outside_the_checkout(tmp_path):
    report = _compose(sys.executable, tmp_path)
    assert Path(report["package"]).is_relative_to(REPO)
    assert report == {**report, "n": 3, "backend": "skyrl"}


@pytest.mark.timeout(300)
def test_wheel_carries_the_configs_and_composes_in_a_scratch_environment(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", wheels, REPO],
        check=True,
        capture_output=True,
        timeout=240,
    )
    (wheel,) = wheels.glob("rllm_skyrl-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for config in ("unified.yaml", "rllm/base.yaml", "rllm/backend/skyrl.yaml"):
        assert f"rllm_skyrl/config/{config}" in names, f"{config} missing from {wheel.name}"
    assert "hydra_plugins/rllm_skyrl_searchpath/rllm_skyrl_searchpath.py" in names

    # A fresh environment: the project's dependencies on its path, this package only from the wheel.
    venv = tmp_path / "venv"
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", venv], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    (Path(site) / "project_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    report = _compose(python, tmp_path, env)
    assert Path(report["package"]).is_relative_to(site)
    assert report == {**report, "n": 3, "backend": "skyrl"}


def test_every_package_folder_is_in_the_wheel():
    """The wheel lists its packages by name (setuptools), so a new folder must be added there too."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {
        ".".join(init.parent.relative_to(REPO).parts) for init in (REPO / "rllm_skyrl").rglob("__init__.py")
    }
    assert folders - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"


# Imports what a run's processes import at start-up, from the installed packages, and lists the
# modules among them that have no current byte-code beside their source.
UNCOMPILED = textwrap.dedent(
    """
    import importlib.util, json, os, sys, sysconfig
    import ray, torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
    from skyrl.train.utils.utils import prepare_runtime_environment
    import rllm_skyrl.backend
    installed = {sysconfig.get_paths()[key] for key in ("purelib", "platlib")}
    checked, missing = 0, []
    for name, module in list(sys.modules.items()):
        source = getattr(module, "__file__", None) or ""
        if not source.endswith(".py") or not any(source.startswith(root) for root in installed):
            continue
        checked += 1
        cached = importlib.util.cache_from_source(source)
        if not os.path.exists(cached) or os.path.getmtime(cached) < os.path.getmtime(source):
            missing.append(name)
    print(json.dumps({"checked": checked, "missing": sorted(missing)}))
    """
)


def test_installed_packages_come_with_their_byte_code():
    """The set-up scripts compile what they install: where ``PYTHONDONTWRITEBYTECODE`` is set, Python
    never writes byte-code itself, and each of a run's processes would compile torch, transformers
    and the rest from source again (bench/README.md: 'Start-up')."""
    result = subprocess.run(
        [sys.executable, "-c", UNCOMPILED],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        cwd="/",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["checked"] > 1000 and report["missing"] == [], report["missing"][:20]


@pytest.mark.parametrize(
    ("dont_write", "compiled", "warned"), [(True, False, True), (True, True, False), (False, False, False)]
)
def test_a_run_warns_when_its_processes_would_compile_the_libraries_again(
    tmp_path, monkeypatch, caplog, dont_write, compiled, warned
):
    import py_compile

    from rllm_skyrl.run.bytecode import warn_if_compiled_at_every_start

    package = tmp_path / "bigpackage"
    package.mkdir()
    (package / "__init__.py").write_text("VALUE = 1\n")
    if compiled:
        py_compile.compile(str(package / "__init__.py"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", dont_write)
    with caplog.at_level("WARNING"):
        warn_if_compiled_at_every_start("bigpackage")
    lines = [r.getMessage() for r in caplog.records]
    assert ("compileall" in " ".join(lines)) == warned, lines
    assert len(lines) == int(warned)
