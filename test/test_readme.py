"""The README's user guide against the code: its snippets' names and signatures, the backend's key
table against the yaml, and the troubleshooting lines against the messages the code produces."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import re
import socket
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
OWN_SECTIONS = ("model", "training", "validation", "rollout_engine", "inference")


def _section(title: str) -> str:
    return README.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def _leaves(tree: dict, prefix: str = "") -> dict[str, object]:
    leaves = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            leaves.update(_leaves(value, f"{prefix}{key}."))
        else:
            leaves[f"{prefix}{key}"] = value
    return leaves


def _key_table() -> dict[str, str]:
    """``{key: default text}`` from the backend key table's rows."""
    rows = re.findall(r"^\| `([\w.]+)` \| `([^`]*)` \|", _section("Using it"), flags=re.M)
    assert len(rows) == len(dict(rows)), "a key is listed twice"
    return dict(rows)


def test_the_key_table_lists_every_own_key_of_the_yaml_with_its_default():
    yaml_tree = yaml.safe_load((REPO / "config/rllm/backend/skyrl.yaml").read_text())
    ours = {key: value for key, value in _leaves(yaml_tree).items() if key.split(".")[0] in OWN_SECTIONS}
    table = _key_table()
    assert sorted(table) == sorted(ours)
    for key, default in table.items():
        assert yaml.safe_load(default) == ours[key], key


def test_every_other_top_level_key_of_the_yaml_is_in_the_alias_table():
    from rllm_skyrl.run_config.aliases import KEYS

    yaml_tree = yaml.safe_load((REPO / "config/rllm/backend/skyrl.yaml").read_text())
    others = {k for k in _leaves(yaml_tree) if k.split(".")[0] not in (*OWN_SECTIONS, "skyrl", "rllm")}
    assert others <= {spec.key for spec in KEYS}
    assert all(f"| `{key}` |" in _section("With rLLM") for key in others)


def _snippets() -> list[ast.Module]:
    blocks = re.findall(r"```python\n(.*?)```", _section("Using it"), flags=re.S)
    assert len(blocks) == 3
    return [ast.parse(block) for block in blocks]


def _imported(tree: ast.Module) -> dict[str, object]:
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = importlib.import_module(node.module)
            names.update({alias.asname or alias.name: getattr(module, alias.name) for alias in node.names})
        elif isinstance(node, ast.Import):
            names.update({alias.name: importlib.import_module(alias.name) for alias in node.names})
    return names


@pytest.mark.skipif(importlib.util.find_spec("rllm") is None, reason="rLLM is not installed")
def test_the_snippets_import_real_names_and_call_them_with_their_parameters():
    for tree in _snippets():
        names = _imported(tree)
        made = {}  # variable -> the class that made it
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                made[node.targets[0].id] = names.get(getattr(node.value.func, "id", None))
            if not isinstance(node, ast.Call):
                continue
            if isinstance(node.func, ast.Name) and node.func.id in names and callable(names[node.func.id]):
                target = names[node.func.id]
                parameters = inspect.signature(target).parameters
                explicit = {n for n, p in parameters.items() if p.kind is not p.VAR_KEYWORD}
                for keyword in node.keywords:
                    assert keyword.arg in explicit, (node.func.id, keyword.arg)
                inspect.signature(target).bind_partial(*node.args, **{k.arg: None for k in node.keywords})
            elif isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name):
                owner = made.get(node.func.value.id)
                if inspect.isclass(owner):
                    assert callable(getattr(owner, node.func.attr, None)), (owner, node.func.attr)


def test_the_train_signature_in_the_readme_is_the_codes():
    from rllm_skyrl.training_run import train

    text = re.search(r"`train\((config, workflow_class.*?)\)`", _section("Using it"), flags=re.S).group(1)
    written = ast.parse(f"def train({' '.join(text.split())}): pass").body[0].args
    real = inspect.signature(train).parameters
    names = [a.arg for a in written.posonlyargs + written.args + written.kwonlyargs]
    names += [written.kwarg.arg] if written.kwarg else []
    assert names == list(real)
    defaults = [ast.literal_eval(d) for d in written.defaults]
    assert defaults == [
        p.default for p in real.values() if p.default is not p.empty and p.kind is p.POSITIONAL_OR_KEYWORD
    ]


def _resolve(name: str) -> object:
    """The module, or the longest importable module prefix's attribute, that ``name`` names."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for part in parts[cut:]:
            obj = getattr(obj, part)
        return obj
    raise ModuleNotFoundError(name)


def test_dotted_names_of_the_package_in_the_readme_exist():
    for name in sorted(set(re.findall(r"`(rllm_skyrl(?:\.\w+)+)", README))):
        _resolve(name)


def test_troubleshooting_quotes_the_codes_messages():
    import torch
    from omegaconf import OmegaConf

    from rllm_skyrl import compat
    from rllm_skyrl.checkpoint.manager import MEMORY_ADVICE, failure_report
    from rllm_skyrl.inference.http_server import PortInUseError, bind
    from rllm_skyrl.optional_deps import OPTIONAL, MissingDependencyError
    from rllm_skyrl.ray_cluster import RayAddressError, check_reachable
    from rllm_skyrl.run_config.aliases import alias_values
    from rllm_skyrl.run_config.settings import ConfigError

    text = " ".join(_section("Troubleshooting").split())
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(PortInUseError) as in_use:
            bind("127.0.0.1", port)
        assert f"error: {in_use.value}".replace(str(port), "8000") in text
        taken.close()
        with pytest.raises(RayAddressError) as stale:
            check_reachable(f"127.0.0.1:{port}")
        assert f"error: {stale.value}".replace(str(port), "6379") in text
    report = failure_report(torch.OutOfMemoryError("x"), 3, None)
    assert f"out of memory (OutOfMemoryError: x); {MEMORY_ADVICE}" in report and MEMORY_ADVICE in text
    verified = compat._verified_text("response_logits")
    assert f"rllm_skyrl: patch set 'response_logits' was verified on {verified}, not on" in text
    with pytest.raises(ConfigError) as refused:
        alias_values(OmegaConf.create({"tinker_base_url": "http://x"}))
    assert f"error: {refused.value}" in text
    missing = str(MissingDependencyError(OPTIONAL["rllm"]))
    assert missing.split(" (rLLM is not on PyPI")[0] in text
