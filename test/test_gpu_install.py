"""``pip install '.[gpu]'`` resolves from PyPI, so a broken pin fails here and not on a GPU machine.

The resolution is pip's own (``--dry-run --report``), in this environment, which is where
``scripts/gpu_check.sh`` installs the extra. It needs PyPI (marked slow: CI runs it). pip reads
each candidate's metadata with HTTP range requests (``fast-deps``: about 0.1 GB instead of the
~1.3 GB of wheels it would otherwise download), falling back to full downloads if this pip no
longer has that feature.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parent.parent


def _dry_run(report: Path, *options: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--dry-run",
        "--quiet",
        "--no-build-isolation",  # the project's own metadata is built with this venv's setuptools
        "--timeout=60",
        *options,
        "--report",
        str(report),
        f"{REPO}[gpu]",
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=720)


def _normalized(requirements) -> set[str]:
    """Requirement strings without markers, in one spelling (name canonical, specifiers sorted)."""
    out = set()
    for text in requirements:
        requirement = Requirement(text)
        out.add(canonicalize_name(requirement.name) + str(requirement.specifier))
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_gpu_extra_resolves_from_pypi(tmp_path):
    report_file = tmp_path / "report.json"
    result = _dry_run(report_file, "--use-feature=fast-deps")
    if result.returncode != 0 and "fast-deps" in result.stderr and "option" in result.stderr.lower():
        result = _dry_run(report_file)
    assert result.returncode == 0, f"pip could not resolve '.[gpu]':\n{result.stderr[-5000:]}"

    report = json.loads(report_file.read_text())
    resolved = {canonicalize_name(item["metadata"]["name"]): item for item in report["install"]}
    versions = {name: item["metadata"]["version"] for name, item in resolved.items()}
    assert versions.get("vllm") == "0.30.0", versions.get("vllm")
    assert "vllm-router" in versions
    assert "flash-attn" not in versions  # sdist only on PyPI: never part of the one-command install

    # What pip read from the project's metadata is what pyproject.toml says (and modal_run.py's
    # image installs the same list, see test_modal_app.py).
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    root = resolved["rllm-skyrl"]["metadata"]["requires_dist"]
    markers = [Requirement(r).marker for r in root]
    for_gpu = [r for r, m in zip(root, markers, strict=True) if m is None or m.evaluate({"extra": "gpu"})]
    assert _normalized(for_gpu) == _normalized(
        project["dependencies"] + project["optional-dependencies"]["gpu"]
    )
