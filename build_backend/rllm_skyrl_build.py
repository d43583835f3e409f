"""setuptools' build backend, with one check first: installing with pip into an environment that holds
rLLM's dependencies stops, before pip resolves or changes anything, when pip would move a package out
from under them (see rllm_overrides.py and the README section "Installing next to rLLM").

pip builds this project's metadata before it resolves dependencies, and runs these hooks with the
interpreter of the environment it installs into, so the check sees that environment as it is.
"""

from __future__ import annotations

import functools
import sys

import rllm_overrides
from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F403  (the hooks this module does not wrap)


def _checked(hook):
    @functools.wraps(hook)
    def run(*args, **kwargs):
        problems = rllm_overrides.conflicts_pip_would_cause(rllm_overrides.target_site_dirs())
        if problems:
            print(rllm_overrides.refusal(problems, sys.prefix), file=sys.stderr, flush=True)
            raise SystemExit(1)
        return hook(*args, **kwargs)

    return run


get_requires_for_build_wheel = _checked(_setuptools.get_requires_for_build_wheel)
prepare_metadata_for_build_wheel = _checked(_setuptools.prepare_metadata_for_build_wheel)
build_wheel = _checked(_setuptools.build_wheel)
get_requires_for_build_editable = _checked(_setuptools.get_requires_for_build_editable)
prepare_metadata_for_build_editable = _checked(_setuptools.prepare_metadata_for_build_editable)
build_editable = _checked(_setuptools.build_editable)
