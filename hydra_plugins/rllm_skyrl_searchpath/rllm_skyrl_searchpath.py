"""Lets ``rllm/backend=skyrl`` resolve in any Hydra app, rLLM's ``unified`` config in particular.

rLLM has no backend registry: a backend is a file in the ``rllm/backend`` config group, and Hydra
finds groups along its search path. Hydra imports this module in every app of an environment where
rllm-skyrl is installed, and the search-path plug-in below adds our configs at the end of the path.

The config package ``rllm_skyrl.config`` also holds stand-ins for rLLM's ``unified`` and
``rllm/base`` (for runs without rLLM). Putting the whole package on every search path would let
those shadow rLLM's own files in an app whose primary config directory is not rLLM's, so the
entry goes through a config source that shows only the ``rllm/backend`` group. Appended last, it
also never overrides a same-named file the app or rLLM provides.

rLLM's ``AgentTrainer(backend=...)`` dispatches with an if/elif over the backends it knows. When the
app has imported it (rLLM's example scripts do, at their top), this plug-in teaches it ``skyrl`` as
the app's config is composed, so ``rllm/backend=skyrl`` runs rLLM's own scripts unchanged.

An app may also list ``pkg://rllm.trainer.config`` ahead of ``pkg://rllm_skyrl.config`` on its own
search path (this package's examples do), so that ``rllm/base`` is rLLM's where rLLM is installed
and the stand-in where it is not; there, Hydra's warning that rLLM's source is unavailable is the
expected case, and is silenced.
"""

from __future__ import annotations

import sys
import warnings

from hydra._internal.core_plugins import importlib_resources_config_source as _pkg_source
from hydra.core.config_search_path import ConfigSearchPath
from hydra.core.object_type import ObjectType
from hydra.plugins.config_source import ConfigLoadError, ConfigResult
from hydra.plugins.search_path_plugin import SearchPathPlugin

CONFIG_PACKAGE = "rllm_skyrl.config"
VISIBLE_GROUP = "rllm/backend"
SCHEME = "rllm-skyrl"
_RLLM_CONFIG_UNAVAILABLE = r"provider=hydra\.searchpath in main, path=rllm\.trainer\.config is not available"


def _in_group(config_path: str) -> bool:
    path = config_path.strip("/")
    return path == VISIBLE_GROUP or path.startswith(VISIBLE_GROUP + "/")


def _is_ancestor(config_path: str) -> bool:
    path = config_path.strip("/")
    return path == "" or VISIBLE_GROUP.startswith(path + "/")


class RLLMSkyRLBackendConfigSource(_pkg_source.ImportlibResourcesConfigSource):
    """``pkg://`` for one config package, narrowed to the ``rllm/backend`` group and its parents."""

    @staticmethod
    def scheme() -> str:
        return SCHEME

    def load_config(self, config_path: str) -> ConfigResult:
        if not _in_group(config_path):
            raise ConfigLoadError(f"{SCHEME}:// serves only the {VISIBLE_GROUP} group, not {config_path!r}")
        return super().load_config(config_path)

    def is_group(self, config_path: str) -> bool:
        return (_in_group(config_path) or _is_ancestor(config_path)) and super().is_group(config_path)

    def is_config(self, config_path: str) -> bool:
        return _in_group(config_path) and super().is_config(config_path)

    def list(self, config_path: str, results_filter: ObjectType | None) -> list[str]:
        if _in_group(config_path):
            return super().list(config_path, results_filter)
        if not _is_ancestor(config_path) or results_filter not in (None, ObjectType.GROUP):
            return []
        prefix = config_path.strip("/")
        rest = VISIBLE_GROUP[len(prefix) + 1 :] if prefix else VISIBLE_GROUP
        return [rest.split("/")[0]]


class RLLMSkyRLSearchPathPlugin(SearchPathPlugin):
    """Appends rllm-skyrl's ``rllm/backend`` configs to every Hydra app's search path."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append(provider="rllm-skyrl", path=f"{SCHEME}://{CONFIG_PACKAGE}")
        # Here, not at import: Hydra imports plug-ins inside ``warnings.catch_warnings()``.
        warnings.filterwarnings("ignore", message=_RLLM_CONFIG_UNAVAILABLE)
        if "rllm.trainer.unified_trainer" in sys.modules:  # the app uses rLLM's AgentTrainer
            from rllm_skyrl.rllm_plugin import register

            register()
