"""The placement group SkyRL's ``SFTTrainer.setup`` reserves, found and removed with Ray's public API.

SkyRL's trainer reserves one placement group for its workers and releases neither it nor the actors
in it (``shutdown`` finishes the tracker only: its own entry point ends Ray with the process). A run
on a Ray that outlives it (a test session, a notebook, a cluster) would keep the workers' memory and
the reserved GPUs. The group is unnamed, so it is recognised in Ray's placement group table as one
that appeared while ``setup`` ran, with the bundles SkyRL asks for; removing it makes Ray kill the
actors placed in it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

import ray
from ray.util import placement_group_table, remove_placement_group
from ray.util.placement_group import PlacementGroup


def live_placement_groups() -> dict[str, dict[str, Any]]:
    """Ray's placement group table without the removed ones (id -> Ray's description)."""
    if not ray.is_initialized():
        return {}
    return {pg_id: info for pg_id, info in placement_group_table().items() if info["state"] != "REMOVED"}


class WorkerPlacementGroups:
    """The groups with the workers' bundles (one per node, a CPU with each GPU) that appear while
    ``recording()`` is entered; ``remove()`` releases them."""

    def __init__(self, num_nodes: int, gpus_per_node: int) -> None:
        self.bundles = [{"CPU": float(gpus_per_node), "GPU": float(gpus_per_node)}] * num_nodes
        self.ids: set[str] = set()

    @contextmanager
    def recording(self) -> Iterator[None]:
        before = set(live_placement_groups())
        try:
            yield
        finally:  # also when setup failed half-way: what it reserved is still to release
            self.ids |= {
                pg_id
                for pg_id, info in live_placement_groups().items()
                if pg_id not in before and self._is_workers(info)
            }

    def _is_workers(self, info: dict[str, Any]) -> bool:
        bundles = info["bundles"]  # bundle index -> resources
        return [bundles[index] for index in sorted(bundles)] == self.bundles

    def remove(self) -> None:
        """Remove the groups; Ray kills every actor placed in them."""
        ids, self.ids = self.ids, set()
        if not ray.is_initialized():
            return
        for pg_id in ids:
            with suppress(Exception):  # already removed: nothing left to release
                remove_placement_group(PlacementGroup(ray.PlacementGroupID.from_hex(pg_id)))
