"""rLLM installed as its users install it, with every declared dependency, beside this backend.

``scripts/install_rllm.sh`` builds that environment with the overrides of
``constraints/rllm-overrides.txt``; CI runs the whole suite in it. Here:

- the overrides file, its table in the README, and the check that stops ``pip install`` from breaking
  rLLM's dependencies (run everywhere);
- the environment itself: rLLM's dependencies import, ``pip check`` lists only the named conflicts,
  and each override holds where rLLM uses the package (run where install_rllm.sh built the venv;
  skipped elsewhere, and a CI run fails on that skip);
- an environment that already has rLLM's dependencies at the versions rLLM asks for: ``pip install
  -e .`` stops with one message and changes nothing; in the environment the command it names built
  (the one the suite runs in), ``pip install -e .`` would change nothing but the project itself
  (slow: pip builds the project's metadata, twice).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "build_backend"))
import rllm_overrides  # noqa: E402
import rllm_skyrl_build  # noqa: E402

RLLM_DEPENDENCIES = ("rllm", "litellm", "tinker", "tinker_cookbook", "rllm_model_gateway")
FULL_ENV_MISSING = (
    "rLLM's dependencies are not installed here (scripts/install_rllm.sh installs them; CI runs it)"
)
requires_full_env = pytest.mark.skipif(
    not all(importlib.util.find_spec(name) for name in RLLM_DEPENDENCIES), reason=FULL_ENV_MISSING
)


def overrides() -> dict[str, rllm_overrides.Override]:
    return {o.package: o for o in rllm_overrides.read_overrides()}


def rllm_source() -> Path:
    import rllm

    return Path(rllm.__file__).resolve().parent.parent


# ------------------------------------------------------------------ the overrides file and the README


def test_each_override_is_skyrls_own_requirement_and_names_whom_it_overrides():
    skyrl = {
        canonicalize_name(r.name): r.specifier
        for r in map(Requirement, metadata.requires("skyrl"))
        if r.marker is None
    }
    found = overrides()
    assert sorted(found) == ["rich", "transformers"]
    for package, override in found.items():
        assert override.requirement.specifier == skyrl[package], package
        assert override.overridden, package
    assert [(o.name, o.extras) for o in found["rich"].overridden] == [("litellm", {"proxy"})]
    assert [o.name for o in found["transformers"].overridden] == ["tinker-cookbook"]


def test_pyproject_asks_for_what_the_overrides_give():
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    ours = {canonicalize_name(Requirement(r).name): Requirement(r).specifier for r in project["dependencies"]}
    for package, override in overrides().items():
        assert ours.get(package, SpecifierSet()) in (SpecifierSet(), override.requirement.specifier), package


def _readme_conflict_rows() -> dict[str, str]:
    text = (REPO / "README.md").read_text()
    section = text.split("\n## Installing next to rLLM\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return {line.split("|")[1].strip().strip("`"): line for line in rows}


def test_the_readme_table_shows_every_override():
    rows = _readme_conflict_rows()
    assert sorted(rows) == sorted(overrides())
    for package, override in overrides().items():
        quoted = [Requirement(q) for q in rows[package].split("`")[1::2] if q.startswith(package)]
        assert override.requirement.specifier in [q.specifier for q in quoted if q.specifier], rows[package]
        for owner in override.overridden:
            assert owner.name in rows[package], (owner.name, rows[package])


# ------------------------------------------------------------------ the check before pip installs


@pytest.mark.parametrize(
    ("a", "b", "both"),
    [
        (">=14.1.0", ">=13.9.4,<14.0", False),
        (">=14.1.0", "<14.0.0,>=13.7.1", False),
        (">=14.1.0", ">=13.0.0", True),
        (">=5.6.1,<=5.16.1", "!=5.4.*,!=5.5.0,!=5.5.3,<=5.5.4,>=4.57.6", False),
        (">=5.6.1,<=5.16.1", ">=4.50.0", True),
        (">=5.6.1,<=5.16.1", "", True),
        ("==1.2", "!=1.2", False),
    ],
)
def test_compatible_is_judged_at_the_versions_either_names(a, b, both):
    assert rllm_overrides.compatible(SpecifierSet(a), SpecifierSet(b)) is both
    assert rllm_overrides.compatible(SpecifierSet(b), SpecifierSet(a)) is both


def _site(tmp_path: Path, *dists: tuple[str, str, list[str]]) -> list[str]:
    """A site-packages holding only the given (name, version, Requires-Dist lines) distributions."""
    site = tmp_path / "site-packages"
    for name, version, requires in dists:
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True)
        lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
        (info / "METADATA").write_text("\n".join([*lines, *(f"Requires-Dist: {r}" for r in requires)]) + "\n")
    return [str(site)]


LITELLM = ("litellm", "1.83.0", ['rich<14.0.0,>=13.7.1; extra == "proxy"', "tokenizers"])
COOKBOOK = ("tinker-cookbook", "0.5.8", ["transformers!=5.4.*,<=5.5.4,>=4.57.6", "rich>=13.0.0"])


def test_install_check_names_what_pip_would_break(tmp_path):
    site = _site(tmp_path, LITELLM, COOKBOOK, ("rich", "13.9.4", []), ("transformers", "5.5.4", []))
    problems = rllm_overrides.conflicts_pip_would_cause(site)
    assert len(problems) == 2
    assert problems[0].startswith("rich 13.9.4: SkyRL 0.4.0 needs rich>=14.1.0, but litellm 1.83.0")
    assert "through its proxy extra" in problems[0]
    assert problems[1].startswith("transformers 5.5.4: SkyRL 0.4.0 needs transformers")
    assert "tinker-cookbook 0.5.8 requires transformers" in problems[1]
    message = rllm_overrides.refusal(problems, "/opt/their-venv")
    assert "Nothing has been changed" in message
    command = "RLLM_SKYRL_VENV=/opt/their-venv scripts/install_rllm.sh PATH_TO_RLLM_CHECKOUT"
    assert message.splitlines()[-1] == f"  {command}"


@pytest.mark.parametrize(
    "dists",
    [
        # built with the overrides: pip leaves rich and transformers where they are
        [LITELLM, COOKBOOK, ("rich", "15.0.0", []), ("transformers", "5.16.1", [])],
        # rLLM without its dependencies, or none at all: nothing of theirs to break
        [("rllm", "0.3.0rc0", ["litellm[proxy]"]), ("rich", "13.9.4", []), ("transformers", "5.5.4", [])],
        # a package that allows what SkyRL needs
        [("tinker", "0.38.0", ["rich>=13.0.0", "transformers"]), ("rich", "13.9.4", [])],
        # litellm installed without its proxy extra's conflict in force: rich 13 is what it allows
        [("litellm", "1.83.0", ["tokenizers"]), ("rich", "13.9.4", [])],
    ],
)
def test_install_check_lets_harmless_installs_through(tmp_path, dists):
    assert rllm_overrides.conflicts_pip_would_cause(_site(tmp_path, *dists)) == []


HOOKS = (
    "get_requires_for_build_wheel",
    "prepare_metadata_for_build_wheel",
    "build_wheel",
    "get_requires_for_build_editable",
    "prepare_metadata_for_build_editable",
    "build_editable",
)


def test_build_backend_checks_before_every_hook_pip_calls(tmp_path, monkeypatch, capsys):
    """pip prepares the project's metadata (these hooks) before it resolves or installs anything."""
    from setuptools import build_meta

    site = _site(tmp_path, COOKBOOK, ("transformers", "5.5.4", []))
    monkeypatch.setattr(rllm_overrides, "target_site_dirs", lambda: site)
    for hook in HOOKS:
        assert getattr(rllm_skyrl_build, hook).__wrapped__ is getattr(build_meta, hook)
        with pytest.raises(SystemExit) as stopped:
            getattr(rllm_skyrl_build, hook)(str(tmp_path / "out"))
        assert stopped.value.code == 1
        assert "tinker-cookbook 0.5.8 requires transformers" in capsys.readouterr().err
    monkeypatch.setattr(rllm_overrides, "target_site_dirs", lambda: _site(tmp_path / "clean"))
    assert rllm_skyrl_build._checked(lambda: "built")() == "built"


def test_pip_check_lines_are_matched_to_the_override_that_names_them():
    found = list(overrides().values())
    named = (
        "tinker-cookbook 0.5.8 has requirement transformers!=5.4.*,<=5.5.4,>=4.57.6, "
        "but you have transformers 5.16.1."
    )
    assert rllm_overrides.named_conflict(named, found).package == "transformers"
    for line in (
        "vllm 0.30.0 has requirement transformers<5, but you have transformers 5.16.1.",
        "tinker-cookbook 0.5.8 has requirement torch<2, but you have torch 2.13.0.",
        "rllm 0.3.0rc0 requires litellm, which is not installed.",
    ):
        assert rllm_overrides.named_conflict(line, found) is None, line


# ------------------------------------------------------------------ the full environment


def _run(command, **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", **kwargs.pop("env", {})}
    return subprocess.run(command, capture_output=True, text=True, env=env, **kwargs)


@pytest.mark.slow
@requires_full_env
def test_rllm_and_its_dependencies_import_with_the_overridden_versions():
    code = (  # the four, and rLLM's modules that use them
        "import rllm, litellm.proxy.proxy_server, tinker, tinker_cookbook, rllm_model_gateway; "
        "import rllm.eval.proxy, rllm.gateway.manager, rllm.engine.rollout.tinker_engine"
    )
    result = _run([sys.executable, "-c", code], cwd="/", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    for package, override in overrides().items():
        assert override.requirement.specifier.contains(metadata.version(package)), package


@requires_full_env
def test_pip_check_lists_only_the_named_conflicts():
    result = _run([sys.executable, str(REPO / "build_backend/rllm_overrides.py"), "pip-check"], timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "tinker-cookbook" in result.stdout  # the environment does hold the conflict it names
    overridden = rllm_overrides.overridden_requirements(rllm_overrides.target_site_dirs())
    assert [line.split()[0] for line in overridden] == ["litellm[proxy]", "tinker-cookbook"]


@requires_full_env
def test_tinker_cookbook_renders_rllm_sft_data_with_skyrls_transformers(tiny_model_dir):
    """rLLM's tinker SFT data path: tinker-cookbook loads the tokenizer and renders a conversation
    into a tinker Datum, under transformers 5.16 (tinker-cookbook 0.5.8 asks for <=5.5.4)."""
    import datasets
    from omegaconf import OmegaConf
    from rllm.trainer.sft.tinker_backend import build_sft_data

    config = OmegaConf.create({"model": {"name": tiny_model_dir}, "data": {"renderer_name": "role_colon"}})
    rows = [{"messages": [{"role": "user", "content": "What is 7?"}, {"role": "assistant", "content": "7"}]}]
    tokenizer, train, _ = build_sft_data(config, datasets.Dataset.from_list(rows), None)
    (datum,) = train.get_batch(0)
    inputs = datum.model_input.to_ints()
    targets = datum.loss_fn_inputs["target_tokens"].tolist()
    weights = datum.loss_fn_inputs["weights"].tolist()
    assert inputs[1:] == targets[:-1]
    assert tokenizer.decode(inputs + targets[-1:]).startswith("User: What is 7?\n\nAssistant: 7")
    assert tokenizer.decode([t for t, w in zip(targets, weights, strict=True) if w > 0]).startswith(" 7")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@requires_full_env
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_litellm_proxy_serves_and_renders_with_skyrls_rich(tmp_path, monkeypatch):
    """rLLM's LiteLLM proxy launcher (rllm eval's bridge to providers) serves a chat completion, and
    litellm's proxy client prints its rich table, with rich 15 (litellm[proxy] asks for <14).
    The provider is litellm's mock: nothing leaves the machine."""
    import requests
    from rllm.eval import proxy

    key = "sk-" + os.urandom(16).hex()
    monkeypatch.setenv("LITELLM_MASTER_KEY", key)  # the proxy (a child process) takes it from here
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    monkeypatch.setenv("LITELLM_PROXY_STATE_DIR", str(tmp_path / "state"))  # else ./.litellm_proxy
    monkeypatch.setattr(proxy, "_STARTUP_TIMEOUT_S", 300.0)
    manager = proxy.EvalProxyManager(
        provider="openai", model_name="mock-model", api_key="unused", proxy_port=_free_port()
    )
    config = manager.build_proxy_config()
    config["model_list"][0]["litellm_params"]["mock_response"] = "pong"
    try:
        manager.start_proxy_subprocess(config, snapshot_directory=str(tmp_path))
        response = requests.post(
            f"{manager.get_proxy_url()}/chat/completions",
            json={"model": "mock-model", "messages": [{"role": "user", "content": "ping"}]},
            headers={"Authorization": f"Bearer {key}"},
            timeout=120,
        )
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"] == "pong"
        client = Path(sys.executable).with_name("litellm-proxy")
        base_url = manager.get_proxy_url(include_v1=False)
        listed = _run([client, "--base-url", base_url, "--api-key", key, "models", "list"], timeout=300)
        assert listed.returncode == 0, listed.stderr[-3000:]
        assert "Available Models" in listed.stdout and "mock-model" in listed.stdout
        assert "┏" in listed.stdout  # drawn by rich
    finally:
        manager.shutdown_proxy()


# ------------------------------------------------------------------ an environment that has rLLM already


def _freeze(uv: str, python: Path) -> list[str]:
    result = _run([uv, "pip", "freeze", "--python", python], timeout=300)
    assert result.returncode == 0, result.stderr
    return sorted(result.stdout.splitlines())


def _pip_warned(output: str) -> bool:
    return "dependency resolver does not currently take into account" in output or "incompatible" in output


def _as_rllm_asks(site_dirs: list[str]) -> list[str]:
    """What the check reads of an environment rLLM's install guide built: each package that overrides
    one of rLLM's requirements, at the versions rLLM's packages ask for, and those packages at the
    versions this environment has (taken from its own metadata, not written down here)."""
    installed = rllm_overrides.installed_distributions(site_dirs)
    out = []
    for override in rllm_overrides.read_overrides():
        asked = SpecifierSet()
        for owner in override.overridden:
            dist = installed[canonicalize_name(owner.name)]
            out.append(f"{owner.name}=={dist.version}")
            for requirement in rllm_overrides.requirements_on(dist, override.package, owner.extras):
                asked &= requirement.specifier
        assert not rllm_overrides.compatible(asked, override.requirement.specifier), override.package
        out.append(f"{override.package}{asked}")
    return out


@requires_full_env
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_pip_install_beside_rllm_stops_with_one_message_and_the_command_it_names_works(tmp_path):
    """A venv holding rLLM's dependencies at the versions rLLM asks for: ``pip install -e .`` of this
    project stops before changing anything, naming install_rllm.sh. The environment that command
    built (the one this suite runs in, as scripts/test.sh installs it) is left as it is by ``pip
    install -e .``: pip would reinstall the project alone, with nothing to warn of."""
    uv = shutil.which("uv") or str(Path(sys.executable).with_name("uv"))
    here = rllm_overrides.target_site_dirs()
    venv = tmp_path / "venv"
    python = venv / "bin" / "python"
    base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    assert _run([base, "-m", "venv", "--without-pip", venv], timeout=300).returncode == 0
    packages = _as_rllm_asks(here)
    installed = _run([uv, "pip", "install", "--python", python, "--no-deps", *packages], timeout=900)
    assert installed.returncode == 0, installed.stderr[-3000:]
    before = _freeze(uv, python)

    refused = _run([sys.executable, "-m", "pip", "--python", python, "install", "-e", REPO], timeout=600)
    output = refused.stdout + refused.stderr
    assert refused.returncode != 0, output[-3000:]
    assert output.count("rllm-skyrl: not installing") == 1, output[-5000:]
    assert f"RLLM_SKYRL_VENV={venv} scripts/install_rllm.sh PATH_TO_RLLM_CHECKOUT" in output
    assert "tinker-cookbook 0.5.8 requires transformers" in output
    assert not _pip_warned(output)
    assert _freeze(uv, python) == before

    # The suite's own environment is what install_rllm.sh built (its marker), with every override.
    assert Path(sys.prefix, ".rllm_full_source").exists(), "run scripts/install_rllm.sh (CI does)"
    report = tmp_path / "report.json"
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--report", report, "-e", REPO]
    again = _run(command, timeout=600)
    assert again.returncode == 0, (again.stdout + again.stderr)[-5000:]
    assert not _pip_warned(again.stdout + again.stderr), again.stdout + again.stderr
    would_install = [item["metadata"]["name"] for item in json.loads(report.read_text())["install"]]
    assert set(would_install) <= {"rllm-skyrl"}, would_install
