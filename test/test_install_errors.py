"""Missing optional dependencies: one ImportError, naming what to install."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rllm_skyrl import optional_deps
from rllm_skyrl.optional_deps import OPTIONAL, MissingDependencyError, require

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def absent(monkeypatch):
    """Make a package look uninstalled whether or not it is (a ``None`` entry in ``sys.modules``)."""

    def hide(name: str) -> None:
        monkeypatch.setitem(sys.modules, name, None)

    return hide


@pytest.mark.parametrize(
    ("name", "command"),
    [
        ("vllm", "pip install 'rllm-skyrl[gpu]'"),
        ("modal", "pip install 'rllm-skyrl[modal]'"),
        ("rllm", "scripts/install_rllm.sh <that checkout>"),
    ],
)
def test_missing_dependency_names_the_install_command(absent, name, command):
    absent(name)
    with pytest.raises(ImportError) as caught:
        require(name)
    error = caught.value
    assert isinstance(error, MissingDependencyError) and error.name == name
    assert command in str(error) and OPTIONAL[name].purpose in str(error)
    assert "not installed" in str(error)
    # One error: no chained "during handling of the above exception" traceback.
    assert error.__cause__ is None and error.__suppress_context__ is False and error.__context__ is None


def test_installed_but_broken_dependency_keeps_the_cause(tmp_path, monkeypatch):
    """A dependency whose own import fails (a missing transitive dependency) is reported as broken."""
    package = tmp_path / "modal"
    package.mkdir()
    (package / "__init__.py").write_text("import a_module_that_does_not_exist_anywhere\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "modal", raising=False)
    with pytest.raises(MissingDependencyError) as caught:
        require("modal")
    message = str(caught.value)
    assert "installed but failed to import" in message and "a_module_that_does_not_exist_anywhere" in message
    assert "pip install 'rllm-skyrl[modal]'" in message
    assert isinstance(caught.value.__cause__, ModuleNotFoundError)


def test_submodule_of_a_present_package_is_imported(tmp_path, monkeypatch):
    package = tmp_path / "rllm" / "trainer"
    package.mkdir(parents=True)
    (tmp_path / "rllm" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "unified_trainer.py").write_text("MARK = 'stand-in'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("rllm", "rllm.trainer", "rllm.trainer.unified_trainer"):
        # setitem first, so the real module (or its absence) comes back after the test
        monkeypatch.setitem(sys.modules, name, None)
        monkeypatch.delitem(sys.modules, name)
    assert require("rllm", "rllm.trainer.unified_trainer").MARK == "stand-in"
    assert optional_deps.is_installed("rllm")


def test_unknown_dependency_name_is_a_programming_error():
    with pytest.raises(KeyError):
        require("not-a-listed-dependency")


def test_rllm_plugin_entry_points_raise_the_install_error(absent):
    from rllm_skyrl.rllm_plugin import SkyRLTrainerLauncher, register

    absent("rllm")
    with pytest.raises(MissingDependencyError, match="rllm-org/rllm"):
        register()
    launcher = SkyRLTrainerLauncher(OmegaConf.create({"rllm": {}}), workflow_class=object)
    with pytest.raises(MissingDependencyError, match="rllm-org/rllm"):
        launcher.train()


def test_modal_run_without_modal_says_which_extra(absent):
    """Importing modal_run where modal is missing fails with the extra, not a bare ModuleNotFoundError."""
    absent("modal")
    spec = importlib.util.spec_from_file_location("modal_run_without_modal", REPO / "modal_run.py")
    with pytest.raises(MissingDependencyError, match=re.escape("pip install 'rllm-skyrl[modal]'")):
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
