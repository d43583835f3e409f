"""One change this package makes to SkyRL at run time, and the SkyRL source that makes it necessary."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Patch:
    """A SkyRL assumption that does not hold here, and how we neutralise it.

    ``needed_by`` is ``(module, qualified attribute, source text that shows the need)``: the tests
    read that source from the pinned SkyRL and fail loudly when an upgrade stops needing (or
    changes) the patch.
    """

    name: str
    needed_by: tuple[str, str, str]
    install: Callable[[], None]
