"""The overrides that let rLLM and its dependencies install beside rllm-skyrl, and the checks built on them.

``constraints/rllm-overrides.txt`` is the one list: ``scripts/install_rllm.sh`` hands it to uv
(``--override``), ``pip_check`` accepts from ``pip check`` only the conflicts it names, and
``conflicts_pip_would_cause`` runs inside this project's build backend, before pip resolves or
installs anything, to refuse an install that would move a package out from under rLLM's dependencies.

Only the standard library and ``packaging`` are used: this runs where rllm_skyrl cannot be imported.
"""

from __future__ import annotations

import re
import subprocess
import sys
import sysconfig
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

ROOT = Path(__file__).resolve().parent.parent
OVERRIDES_FILE = ROOT / "constraints" / "rllm-overrides.txt"
INSTALL_COMMAND = "scripts/install_rllm.sh PATH_TO_RLLM_CHECKOUT"


@dataclass(frozen=True)
class Override:
    """One line of the overrides file: the requirement that replaces every other on its package."""

    requirement: Requirement
    overridden: tuple[Requirement, ...]  # the distributions whose requirement it replaces, with extras

    @property
    def package(self) -> str:
        return canonicalize_name(self.requirement.name)


def read_overrides(path: Path = OVERRIDES_FILE) -> list[Override]:
    overrides: list[Override] = []
    owners: list[Requirement] = []
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if line.startswith("# overrides:"):
            owners = [Requirement(name) for name in line.removeprefix("# overrides:").split()]
        elif line and not line.startswith("#"):
            if not owners:
                raise ValueError(f"{path}:{number}: '{line}' has no '# overrides:' line before it")
            overrides.append(Override(Requirement(line), tuple(owners)))
            owners = []
    return overrides


def requirements_on(
    dist: metadata.Distribution, package: str, extras: Iterable[str] = ()
) -> list[Requirement]:
    """``dist``'s requirements on ``package``, those of the given extras included."""
    found = []
    for text in dist.requires or []:
        requirement = Requirement(text)
        if canonicalize_name(requirement.name) != package:
            continue
        marker = requirement.marker
        if marker is None or any(marker.evaluate({"extra": extra}) for extra in ("", *extras)):
            found.append(requirement)
    return found


def _versions_named(specifiers: SpecifierSet) -> set[Version]:
    out = set()
    for specifier in specifiers:
        try:
            out.add(Version(specifier.version))
        except InvalidVersion:  # a wildcard (==5.6.*): its bounds are named by the other clauses
            pass
    return out


def compatible(a: SpecifierSet, b: SpecifierSet) -> bool:
    """Whether a version satisfies both, judged at the versions either names (enough for the ranges
    of ``>=``, ``<=``, ``<``, ``>`` and exclusions that requirements are made of)."""
    probes = _versions_named(a) | _versions_named(b)
    if not probes:
        return True
    return any(a.contains(v, prereleases=True) and b.contains(v, prereleases=True) for v in probes)


def _name(dist: metadata.Distribution) -> str:
    return canonicalize_name(dist.metadata["Name"])


def installed_distributions(site_dirs: Iterable[str]) -> dict[str, metadata.Distribution]:
    found: dict[str, metadata.Distribution] = {}
    for dist in metadata.distributions(path=list(site_dirs)):
        name = dist.metadata["Name"]
        if name:
            found.setdefault(canonicalize_name(name), dist)
    return found


def target_site_dirs() -> list[str]:
    """The site-packages of the environment being installed into.

    pip runs the build backend with the interpreter it installs for (``sys.prefix`` is the target
    environment even under build isolation, which only takes site-packages off ``sys.path``).
    """
    paths = sysconfig.get_paths()
    return sorted({paths["purelib"], paths["platlib"]})


def conflicts_pip_would_cause(site_dirs: Iterable[str]) -> list[str]:
    """The overridden packages that pip, installing rllm-skyrl here, would move to a version that an
    installed distribution does not allow. Empty when the environment has none of those
    distributions, or when it already has versions that SkyRL accepts (it was built with the overrides)."""
    installed = installed_distributions(site_dirs)
    problems = []
    for override in read_overrides():
        current = installed.get(override.package)
        if current is not None and override.requirement.specifier.contains(current.version, prereleases=True):
            continue  # pip leaves it as it is
        have = f"{override.package} {current.version}" if current is not None else f"no {override.package}"
        for owner in override.overridden:
            dist = installed.get(canonicalize_name(owner.name))
            if dist is None:
                continue
            for requirement in requirements_on(dist, override.package, owner.extras):
                if not compatible(requirement.specifier, override.requirement.specifier):
                    through = f" (through its {','.join(sorted(owner.extras))} extra)" if owner.extras else ""
                    problems.append(
                        f"{have}: SkyRL 0.4.0 needs {override.requirement}, but {_name(dist)} "
                        f"{dist.version} requires {requirement.name}{requirement.specifier}{through}"
                    )
    return problems


def refusal(problems: list[str], prefix: str) -> str:
    """The one message of a refused install: what would break, and the command to run instead."""
    lines = "\n".join(f"  - {p}" for p in problems)
    return (
        f"rllm-skyrl: not installing into {prefix} with pip. This environment has rLLM's\n"
        "dependencies, and pip, which resolves only what it is asked to install, would move these\n"
        "packages out from under them:\n"
        f"{lines}\n"
        "Nothing has been changed. Install with the overrides that settle these conflicts instead\n"
        "(README, 'Installing next to rLLM'), from the rllm-skyrl checkout:\n"
        f"  RLLM_SKYRL_VENV={prefix} {INSTALL_COMMAND}"
    )


# ----------------------------------------------------------------------------- pip check

_PIP_CHECK_LINE = re.compile(r"^(?P<dist>\S+) \S+ has requirement (?P<requirement>.+), but you have ")


def named_conflict(line: str, overrides: list[Override]) -> Override | None:
    """The override that explains one line of ``pip check``, if any."""
    match = _PIP_CHECK_LINE.match(line)
    if not match:
        return None
    package = canonicalize_name(Requirement(match["requirement"]).name)
    dist = canonicalize_name(match["dist"])
    for override in overrides:
        if override.package == package and dist in {canonicalize_name(o.name) for o in override.overridden}:
            return override
    return None


def overridden_requirements(site_dirs: Iterable[str]) -> list[str]:
    """Every requirement the overrides set aside that the installed version does not meet, those
    through an extra included (``pip check`` reads none of these)."""
    installed = installed_distributions(site_dirs)
    out = []
    for override in read_overrides():
        current = installed.get(override.package)
        for owner in override.overridden:
            dist = installed.get(canonicalize_name(owner.name))
            if dist is None or current is None:
                continue
            for requirement in requirements_on(dist, override.package, owner.extras):
                if not requirement.specifier.contains(current.version, prereleases=True):
                    extra = f"[{','.join(sorted(owner.extras))}]" if owner.extras else ""
                    out.append(
                        f"{_name(dist)}{extra} {dist.version} requires {requirement.name}"
                        f"{requirement.specifier}; {override.package} {current.version} is installed"
                    )
    return out


def pip_check(python: str = sys.executable) -> int:
    """Run ``pip check``; pass when every problem it reports is a conflict the overrides file names."""
    result = subprocess.run([python, "-m", "pip", "check"], capture_output=True, text=True)
    overrides = read_overrides()
    lines = [ln for ln in result.stdout.splitlines() if ln.strip() and not ln.startswith("No broken")]
    if result.returncode != 0 and not lines:
        print(f"error: pip check failed:\n{result.stderr}", file=sys.stderr)
        return 1
    unnamed = [ln for ln in lines if named_conflict(ln, overrides) is None]
    print("pip check:")
    for line in lines or ["No broken requirements found."]:
        print(f"  {line}" + ("" if line in unnamed else "  [named in constraints/rllm-overrides.txt]"))
    if unnamed:
        print(
            f"error: pip check reports {len(unnamed)} problem(s) that {OVERRIDES_FILE.name} does not name",
            file=sys.stderr,
        )
        return 1
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["pip-check"]:
        return pip_check(*argv[1:2])
    if argv[:1] == ["would-conflict"]:
        problems = conflicts_pip_would_cause(argv[1:] or target_site_dirs())
        print("\n".join(problems))
        return 1 if problems else 0
    print("usage: rllm_overrides.py pip-check [PYTHON] | would-conflict [SITE_DIR...]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
