"""The table of patch sets: where each applies, its version guard, and that SkyRL still needs it.

What each set does is tested beside it: the CUDA bug fixes in ``test_compat_bugs.py``, the CPU
enablement in ``test_compat_cpu.py``, the speed sets in ``test_compat_speed.py``.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import re
from pathlib import Path

import pytest
from helpers import partly_taught, run_python

from rllm_skyrl import compat
from rllm_skyrl.compat import (
    cpu,
    flash_attn,
    lazy_imports,
    registries,
    response_logits,
    tied_embeddings,
)
from rllm_skyrl.compat import transformers_import_cache as import_cache
from rllm_skyrl.hardware import Platform

README = Path(__file__).resolve().parent.parent / "README.md"
CPU_SETS = (
    "transformers_import_cache",
    "lazy_imports",
    "registries",
    "flash_attn_stub",
    "cpu",
    "tied_embeddings",
    "response_logits",
)


@pytest.fixture
def fresh_guards(monkeypatch):
    """Each test sees the warnings of its own decisions (the guard warns once per process)."""
    monkeypatch.setattr(compat, "_warned", set())
    monkeypatch.delenv(compat.DISABLE_VAR, raising=False)


def fake_versions(monkeypatch, **versions: str) -> None:
    """Pretend ``distribution=version`` is installed (``torch="2.14.0"``)."""
    real = compat.installed_version
    monkeypatch.setattr(compat, "installed_version", lambda name: versions.get(name, real(name)))


# --------------------------------------------------------------------------- where each set applies


@pytest.mark.parametrize(
    ("platform", "sets"),
    [
        (Platform(cuda=True, flash_attn=True), ("tied_embeddings",)),
        (Platform(cuda=True, flash_attn=False), ("flash_attn_stub", "tied_embeddings")),
    ],
    ids=["cuda-flash-attn", "cuda-sdpa"],
)
def test_cuda_runs_skyrls_stock_code_but_for_bug_fixes(platform, sets):
    """On CUDA nothing is applied for speed: only the bug fixes, each naming its upstream change."""
    assert compat.for_platform(platform) == sets
    for name in sets:
        assert compat.BY_NAME[name].purpose == compat.BUG and compat.BY_NAME[name].upstream


def test_cpu_gets_the_enablement_the_bug_fixes_and_the_speed_sets():
    assert compat.for_platform(Platform(cuda=False)) == CPU_SETS


def test_workers_get_what_the_driver_applies(fresh_guards):
    env = compat.ray_runtime_env(Platform(cuda=False))
    assert env == {
        "worker_process_setup_hook": compat.SETUP_HOOK,
        "env_vars": {compat.ENV_VAR: ",".join(CPU_SETS)},
    }
    cuda = compat.ray_runtime_env(Platform(cuda=True, flash_attn=True))
    assert cuda["env_vars"] == {compat.ENV_VAR: "tied_embeddings"}


@pytest.mark.slow
def test_worker_hook_applies_what_the_driver_listed():
    program = """
        import json, importlib
        from rllm_skyrl import compat
        module, _, name = compat.SETUP_HOOK.rpartition(".")
        getattr(importlib.import_module(module), name)()  # what Ray does in each worker
        from rllm_skyrl.compat import cpu, flash_attn
        from skyrl.backends.skyrl_train.distributed import fsdp_strategy
        print(json.dumps({
            "applied": sorted(compat.applied()),
            "cpu": cpu.is_applied(),
            "retie": getattr(fsdp_strategy.apply_fsdp2, "_rllm_skyrl_patched", False),
        }))
    """
    outcome = run_python(program, env={compat.ENV_VAR: "flash_attn_stub,tied_embeddings"})
    assert outcome == {"applied": ["flash_attn_stub", "tied_embeddings"], "cpu": False, "retie": True}


def test_unknown_patch_set_is_refused():
    with pytest.raises(ValueError, match="unknown patch set.*'fast_mode'"):
        compat.apply(["fast_mode"])


def test_the_readme_shows_the_table_of_the_code():
    assert compat.table_markdown() in README.read_text()


def test_cuda_changes_skyrls_training_code_only_by_bug_fixes():
    """On CUDA every set is a bug fix, or acts on the driver process and rLLM's entry points only
    (not in SkyRL's training path, not in any Ray worker): never speed."""
    for platform in (Platform(cuda=True, flash_attn=True), Platform(cuda=True, flash_attn=False)):
        for patch_set in compat.on_platform(platform):
            driver_side = patch_set.purpose in (compat.PROCESS, compat.INTEGRATION)
            assert patch_set.purpose == compat.BUG or (driver_side and not patch_set.training_path), (
                patch_set.name
            )
    assert {p.name for p in compat.on_platform(Platform(cuda=True, flash_attn=True))} == {
        "tied_embeddings",
        "output_masking",
        "quiet_logs",
        "sigterm",
        "rllm_agent_trainer",
        "rllm_gateway",
        "rllm_sft_trainer",
        "rllm_tracking",
        "rllm_distill_rewards",
    }


def test_every_set_has_an_apply_that_the_table_calls():
    for patch_set in compat.PATCH_SETS:
        module = importlib.import_module(patch_set.module_name)
        assert callable(getattr(module, "apply", None)), patch_set.name


@pytest.mark.parametrize("name", [p.name for p in compat.PATCH_SETS])
def test_every_set_can_be_turned_off_by_name(name, fresh_guards, monkeypatch):
    """``RLLM_SKYRL_COMPAT_DISABLE=name``: the table never calls the set's ``apply``; on, it does
    (with the arguments of a set that acts on what a run built)."""
    calls = []

    class Module:
        @staticmethod
        def apply(*args):
            calls.append(args)

    real_import = importlib.import_module
    monkeypatch.setattr(
        compat.importlib,
        "import_module",
        lambda module: Module if module == compat.BY_NAME[name].module_name else real_import(module),
    )
    monkeypatch.setattr(compat, "_applied", set())
    # The switch alone, wherever it runs: the versions the set was verified on (rLLM's sets included,
    # on a machine without rLLM); the version guard has tests of its own.
    fake_versions(monkeypatch, **{d: versions[0] for d, versions in compat.BY_NAME[name].verified.items()})
    args = ("built by the run",) if compat.BY_NAME[name].each_call else ()
    monkeypatch.setenv(compat.DISABLE_VAR, f"other,{name}")
    assert compat.apply([name], *args) == [] and calls == []
    monkeypatch.delenv(compat.DISABLE_VAR)
    assert compat.apply([name], *args) == [name] and calls == [args]


def test_turning_off_rllm_tracking_leaves_rllms_tracking_as_rllm_built_it(fresh_guards, monkeypatch):
    tracking_module = pytest.importorskip("rllm.utils.tracking")
    tracking = tracking_module.Tracking("project", "experiment", default_backend=[])
    sinks = {"metrics_jsonl": object()}
    monkeypatch.setenv(compat.DISABLE_VAR, "rllm_tracking")
    assert compat.apply(["rllm_tracking"], tracking, sinks) == []
    assert tracking.logger == {}
    monkeypatch.delenv(compat.DISABLE_VAR)
    assert compat.apply(["rllm_tracking"], tracking, sinks) == ["rllm_tracking"]
    assert tracking.logger == sinks


def test_a_cpu_only_set_is_not_applied_where_the_caller_says_cuda(fresh_guards):
    assert compat.apply(["rllm_metrics_table"], object(), platform=Platform(cuda=True)) == []


def test_measured_figures_live_in_bench_readme_under_the_section_named():
    """A gain names what it buys and where the figures are (with their date and command), so the
    code does not carry numbers that go stale."""
    bench = (README.parent / "bench" / "README.md").read_text()
    for patch_set in compat.PATCH_SETS:
        assert not re.search(r"\d", patch_set.gain), patch_set.name
        for section in re.findall(r"bench/README\.md: '([^']+)'", patch_set.gain):
            assert f"### {section}\n" in bench, (patch_set.name, section)


LOGURU_SINKS = """
    import io, json, sys
    from loguru import logger  # SkyRL's modules log through loguru's logger, imported so
    from rllm_skyrl import compat

    users = []
    logger.add(users.append, level="DEBUG", format="{message}")
    console = io.StringIO()
    sys.stderr = console  # quiet_logs' sink goes to the current stderr
    compat.apply(["quiet_logs"])
    logger.info("skyrl start-up note")
    logger.warning("skyrl warning")
    print(json.dumps({"user": [m.strip() for m in users], "console": console.getvalue()}))
"""


def test_quiet_logs_keeps_a_users_loguru_sink_and_quiets_only_the_console():
    outcome = run_python(LOGURU_SINKS)
    assert outcome["user"] == ["skyrl start-up note", "skyrl warning"]
    assert "skyrl warning" in outcome["console"] and "skyrl start-up note" not in outcome["console"]


# --------------------------------------------------------------------------- version guards


def test_a_speed_set_on_an_unverified_version_is_skipped_with_one_warning(fresh_guards, monkeypatch, caplog):
    fake_versions(monkeypatch, skyrl="0.4.1")
    with caplog.at_level(logging.WARNING, logger=compat.__name__):
        first = compat.usable(CPU_SETS)
        second = compat.usable(CPU_SETS)
    assert first == second == ["transformers_import_cache", "flash_attn_stub", "cpu", "tied_embeddings"]
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 3  # lazy_imports, registries, response_logits: once each
    assert any("'response_logits'" in m and "skyrl 0.4.1" in m and "skyrl 0.4.0" in m for m in skipped)
    env = compat.ray_runtime_env(Platform(cuda=False))
    assert env["env_vars"][compat.ENV_VAR] == "transformers_import_cache,flash_attn_stub,cpu,tied_embeddings"


def test_what_a_run_needs_is_applied_on_an_unverified_version_with_a_warning(
    fresh_guards, monkeypatch, caplog
):
    fake_versions(monkeypatch, skyrl="0.5.0", torch="2.14.0")
    with caplog.at_level(logging.WARNING, logger=compat.__name__):
        assert compat.usable(["flash_attn_stub", "cpu", "tied_embeddings"]) == [
            "flash_attn_stub",
            "cpu",
            "tied_embeddings",
        ]
    messages = [r.getMessage() for r in caplog.records]
    assert sum("applied anyway" in m for m in messages) == 3
    assert any("'cpu'" in m and "torch 2.14.0" in m for m in messages)


def test_a_set_whose_target_moved_is_skipped_on_an_unverified_version(fresh_guards, monkeypatch, caplog):
    """An unverified SkyRL that renamed what a needed set changes: the set is skipped with a
    warning, not a crash at start-up; on the verified version the same failure is raised."""

    class Moved:
        @staticmethod
        def apply():
            raise AttributeError("module 'fsdp_strategy' has no attribute 'apply_fsdp2'")

    real_import = importlib.import_module
    monkeypatch.setattr(
        compat.importlib,
        "import_module",
        lambda name: Moved if name.endswith(".tied_embeddings") else real_import(name),
    )
    monkeypatch.setattr(compat, "_applied", set())
    with pytest.raises(AttributeError):
        compat.apply(["tied_embeddings"])
    fake_versions(monkeypatch, skyrl="0.5.0")
    with caplog.at_level(logging.WARNING, logger=compat.__name__):
        assert compat.apply(["tied_embeddings"]) == []
    assert any("could not be applied" in r.getMessage() for r in caplog.records)


def test_sets_can_be_turned_off_by_name(fresh_guards, monkeypatch):
    monkeypatch.setenv(compat.DISABLE_VAR, "response_logits,registries")
    assert "response_logits" not in compat.usable(CPU_SETS)
    assert "registries" not in compat.usable(CPU_SETS)
    assert "cpu" in compat.usable(CPU_SETS)


def test_versions_match_by_release_prefix():
    assert compat._matches("3.12.1", ("3.12",)) and compat._matches("0.4.0", ("0.4.0",))
    assert compat._matches("0.4.0.post1", ("0.4.0",))
    assert not compat._matches("3.13.0", ("3.12",)) and not compat._matches("0.4.10", ("0.4.1",))
    assert not compat._matches(None, ("0.4.0",))


def test_every_set_states_why_what_it_gains_and_is_verified_here():
    """This environment (the suite's) is the one each set was verified on."""
    for patch_set in compat.PATCH_SETS:
        assert patch_set.why and patch_set.gain and patch_set.upstream and patch_set.verified, patch_set.name
        installed = all(compat.installed_version(d) for d in patch_set.verified)
        assert not installed or compat.unverified(patch_set.name) == [], patch_set.name


# --------------------------------------------------------------------------- still needed


@pytest.mark.parametrize(
    "patch",
    import_cache.PATCHES
    + lazy_imports.PATCHES
    + registries.PATCHES
    + flash_attn.PATCHES
    + cpu.PATCHES
    + tied_embeddings.PATCHES
    + response_logits.PATCHES,
    ids=lambda p: p.name,
)
def test_the_verified_skyrl_still_has_what_each_patch_changes(patch):
    """A patch names the source that needs it; when SkyRL stops having it, the patch is reviewed."""
    module_name, attribute, marker = patch.needed_by
    flash_attn.apply()  # SkyRL's worker modules import flash-attn at module level
    target = importlib.import_module(module_name)
    for part in filter(None, attribute.split(".")):
        target = getattr(target, part)
    assert marker in inspect.getsource(target), (
        f"{module_name}{'.' + attribute if attribute else ''} no longer contains {marker!r}: "
        f"SkyRL changed; check whether patch {patch.name!r} is still needed and update or remove it."
    )


# --------------------------------------------------------------------------- a run on another SkyRL

UNVERIFIED_SKYRL_RUN = """
    import json, runpy, sys
    from rllm_skyrl import compat
    real = compat.installed_version
    compat.installed_version = lambda name: "0.4.99" if name == "skyrl" else real(name)
    sys.argv = ["train", *sys.argv[1:]]
    try:
        runpy.run_module("examples.simple_math.train", run_name="__main__")
    except SystemExit as stop:
        assert not stop.code, stop.code
    print(json.dumps({"applied": sorted(compat.applied())}))
"""


def quickstart_on_an_unverified_skyrl(
    tmp_path: Path, steps: int, *overrides: str
) -> tuple[dict, list[dict], str]:
    """The quickstart, with the installed SkyRL pretending to be a version no set was verified on."""
    import json
    import os
    import subprocess
    import sys
    import textwrap

    run_dir = tmp_path / "run"
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent(UNVERIFIED_SKYRL_RUN),
            f"rllm.trainer.total_batches={steps}",
            "rllm.trainer.test_freq=0",
            f"hydra.run.dir={run_dir}",
            *overrides,
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=Path(__file__).resolve().parent.parent,
        env={**os.environ, "RLLM_SKYRL_LOG_LEVEL": "WARNING"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return json.loads(result.stdout.strip().splitlines()[-1]), records, result.stdout + result.stderr


SKIPPED_ON_ANOTHER_SKYRL = ("lazy_imports", "registries", "response_logits")
LEARNING_STEPS = 45


@pytest.fixture(scope="module")
def unverified_skyrl_run(tmp_path_factory, partly_taught_model):
    """One quickstart on the pretended SkyRL, long enough to learn from ``partly_taught_model``."""
    return quickstart_on_an_unverified_skyrl(
        tmp_path_factory.mktemp("unverified"),
        LEARNING_STEPS,
        *partly_taught(partly_taught_model),
    )


@pytest.mark.slow
def test_a_run_on_an_unverified_skyrl_trains_without_the_speed_sets(unverified_skyrl_run):
    """Each SkyRL speed set is skipped with one warning; the trainer then runs SkyRL's own forward,
    whose log-probs still match the server's."""
    outcome, records, output = unverified_skyrl_run
    assert not set(SKIPPED_ON_ANOTHER_SKYRL) & set(outcome["applied"])
    assert {"cpu", "flash_attn_stub", "tied_embeddings"} <= set(outcome["applied"])
    for name in SKIPPED_ON_ANOTHER_SKYRL:
        assert output.count(f"patch set '{name}' was verified on") == 1, (name, output[-3000:])
    assert [r["step"] for r in records] == list(range(1, len(records) + 1)) and len(records) >= 3
    assert max(r["train/logprob_abs_diff/max"] for r in records) < 1e-3


@pytest.mark.slow
def test_the_quickstart_learns_on_an_unverified_skyrl(unverified_skyrl_run):
    _, records, _ = unverified_skyrl_run
    rewards = [r["reward/mean"] for r in records]
    print("\nreward per step:", " ".join(f"{r:.2f}" for r in rewards))
    assert len(rewards) == LEARNING_STEPS
    assert sum(rewards[:10]) / 10 <= 0.3 and sum(rewards[-10:]) / 10 >= 0.8, rewards
