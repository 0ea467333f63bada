"""Placement groups named after the process that makes them (a Router: its actor id).

When a Router dies, Ray ends the actors it made (their owner is gone) but keeps its placement
groups: they live as long as the job (or a detached actor) that made them, and a Router is neither.
Left alone they would hold the lost Router's devices for ever and its replacement could not be
placed. So each is named after its maker, and whoever replaces a lost Router removes them by name."""

from __future__ import annotations

import contextlib
import uuid


def placement_group_name(role: str) -> str:
    """A unique name for a placement group this process makes, after its maker."""
    import ray

    ctx = ray.get_runtime_context()
    return f"dspark-{ctx.get_actor_id() or ctx.get_job_id()}-{role}-{uuid.uuid4().hex[:8]}"


def remove_placement_groups_of(actor_id: str) -> int:
    """Remove the placement groups the actor `actor_id` (hex) made and left; returns how many."""
    from ray.util.placement_group import get_placement_group, placement_group_table, remove_placement_group

    removed = 0
    for info in placement_group_table().values():
        name = info.get("name") or ""
        if name.startswith(f"dspark-{actor_id}-") and info.get("state") != "REMOVED":
            with contextlib.suppress(ValueError):  # (removed meanwhile)
                remove_placement_group(get_placement_group(name))
                removed += 1
    return removed
