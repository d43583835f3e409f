"""Shared fixtures: a tiny model built once per session, one CPU inference server and one Ray for
every test that asks for them."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

# Keep test artefacts (tiny models) out of the user's cache, but reuse them across runs.
os.environ.setdefault("RLLM_SKYRL_CACHE", str(Path(__file__).resolve().parent.parent / ".cache"))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# rLLM's DatasetRegistry reads RLLM_HOME when rllm.data is first imported: a scratch one for each test
# process (a worker would inherit the controlling process's), since modules register data sets under
# the same names (countdown) and the two test processes may run such modules at the same time.
os.environ["RLLM_HOME"] = tempfile.mkdtemp(prefix="rllm_home_")

PARTLY_TAUGHT_STEPS = 20


@pytest.fixture(scope="session")
def tiny_model_dir() -> str:
    from rllm_skyrl.tiny_model import build_tiny_model

    return str(build_tiny_model())


@pytest.fixture(scope="session")
def tied_tiny_model_dir() -> str:
    """The tiny model with tied input and output embeddings (same tokenizer as ``tiny_model_dir``)."""
    from rllm_skyrl.tiny_model import TinyModelConfig, build_tiny_model

    return str(build_tiny_model(TinyModelConfig(tie_word_embeddings=True)))


@pytest.fixture(scope="session")
def partly_taught_model(tmp_path_factory) -> str:
    """The tiny model after 20 of the distillation teacher's 100 cross-entropy steps on the ten digit
    questions: it samples the right digit ~13% of the time (reward ~0.1), and RL at lr 3e-3 takes it
    past 0.8 in ~30 steps, where the random model needs ~130 at 1e-3 (bench/README.md: 'The test
    suite'). The learning tests start here: the same proof, a quarter of the steps."""
    from examples.distill.teacher import train_teacher

    return str(train_teacher(tmp_path_factory.mktemp("partly_taught") / "model", steps=PARTLY_TAUGHT_STEPS))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def cpu_server(tiny_model_dir):
    """One in-process CPU inference server on the tiny model, shared by every test that asks for it.

    Tests that pause, sleep or patch it put it back as they found it.
    """
    from rllm_skyrl.inference import InferenceServer

    with InferenceServer(tiny_model_dir) as server:
        yield server


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """One local Ray (with the CPU patches as worker hook) for the whole run."""
    import ray

    from rllm_skyrl.compat import local_ray
    from rllm_skyrl.ray_cluster import start_ray
    from rllm_skyrl.run_config import make_skyrl_config

    log_dir = tmp_path_factory.mktemp("ray_logs")
    started = start_ray(make_skyrl_config(), log_dir=str(log_dir))
    yield
    if started:
        ray.shutdown()
        local_ray.stop()


@pytest.fixture(scope="session")
def slow_selected(request) -> bool:
    """Whether this session runs the slow tests too (CI, ``RLLM_SKYRL_SLOW=1``): a run shared by a
    fast and a slow test is then made long enough for both, once."""
    return "not slow" not in (request.config.getoption("markexpr") or "")


@pytest.fixture(scope="session")
def digits_runs(tmp_path_factory):
    """Three real training runs (straight / killed mid-save / resumed), see training_runs.py."""
    from training_runs import shared_digits_runs

    return shared_digits_runs(tmp_path_factory.mktemp("digits_runs"))


# --------------------------------------------------------------------------- two test processes
# scripts/test.sh runs the suite in two pytest-xdist processes. The default suite's modules wait on
# servers and subprocesses, and two at a time finish it 1.36x sooner; the training runs of the slow
# tests are bound by the cores' work, and gain little (bench/README.md: 'The test suite').
# A module runs whole in one process, so its module fixtures (one run, one Ray) stay shared. Modules
# that read one session-scoped run are scheduled as one unit, so the run is made once:
SHARED_SESSION_RUNS = {
    "digits_runs": ("test/test_checkpoint_resume.py", "test/test_validation_metrics.py"),
}
_UNIT_OF_MODULE = {module: run for run, modules in SHARED_SESSION_RUNS.items() for module in modules}


def _module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def pytest_configure(config):
    """Each test process's runs get its share of the cores (``OMP_NUM_THREADS``, which a run's
    default thread counts stay within): two runs side by side with a thread per core each were ~15%
    slower than with one each (bench/README.md: 'Start-up')."""
    processes = int(getattr(config, "workerinput", {}).get("workercount", 1))
    if processes > 1:
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // processes)))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Modules (or the groups above) as units of work, dealt in collection order."""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = _module_of(nodeid)
            return _UNIT_OF_MODULE.get(module, module)

    config.option.loadscopereorder = False  # keep the order pytest_collection_modifyitems chose
    return ModuleScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """Modules with slow tests first, so the short modules fill the other process's gaps at the
    end instead of one long module running alone; and every user of a shared run in the table."""
    for item in items:
        for run in SHARED_SESSION_RUNS:
            if (
                run in getattr(item, "fixturenames", ())
                and _UNIT_OF_MODULE.get(_module_of(item.nodeid)) != run
            ):
                raise pytest.UsageError(
                    f"{item.nodeid} uses the session run {run!r}: add its module to SHARED_SESSION_RUNS "
                    "in test/conftest.py, so both test processes do not each make the run"
                )
    slow_modules = {_module_of(item.nodeid) for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: _module_of(item.nodeid) not in slow_modules)


# --------------------------------------------------------------------------- skips in CI
# A CI run (CI=true) must run every test family; only these skips are expected there, each for a
# reason that no CPU machine can change. Any other skip fails the run, naming the test.
ALLOWED_SKIPS_IN_CI = ("CPU patches are inert on CUDA machines", "needs CUDA")
_skipped: list[tuple[str, str]] = []


def pytest_runtest_logreport(report):
    # A report from a test process arrives with its (path, line, reason) as a list.
    if report.skipped and isinstance(report.longrepr, (tuple, list)):
        reason = str(report.longrepr[2]).removeprefix("Skipped: ")
        _skipped.append((report.nodeid, reason))


def pytest_sessionfinish(session, exitstatus):
    # Only the controlling process sees every test's report.
    if os.environ.get("CI") != "true" or hasattr(session.config, "workerinput"):
        return
    unexpected = [(test, why) for test, why in _skipped if not why.startswith(ALLOWED_SKIPS_IN_CI)]
    if unexpected:
        lines = "\n".join(f"  {test}: {why}" for test, why in unexpected)
        print(f"\nerror: {len(unexpected)} test(s) skipped in CI, where they must run:\n{lines}", flush=True)
        session.exitstatus = 1
