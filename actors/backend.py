"""The `ray` backend, as the core finds it by name (`dspark_cluster.backends.backend("ray")`):
the target's executor, the drafter group, the engine client of a Router, and runs on a Ray cluster."""

from __future__ import annotations

import ray

from .client import RouterClient
from .cluster import Cluster as Executor
from .cluster import ensure_ray, num_actors, ray_get, resolve_on_cluster, start_router, stop_router
from .drafter_group import RayDrafterGroup as DrafterGroup

__all__ = ["DrafterGroup", "Executor", "RouterClient", "prepare", "resolve_config", "run_workload"]


def prepare(cfgs: list) -> None:
    """Before several runs in one process (a sweep): join or start Ray once, sized for the run with
    the most actors (a private instance's CPU count is fixed when it starts)."""
    ensure_ray(max(num_actors(c) + int(c.speculative.calibration.enabled) for c in cfgs), cfgs[0].parallel.ray_address)


def resolve_config(cfg):
    """`cfg` with `auto` resolved for the devices this Ray cluster gives the work (joining or starting Ray)."""
    return resolve_on_cluster(cfg, ensure_ray(num_actors(cfg), cfg.parallel.ray_address))


def run_workload(cfg, requests, on_progress=None) -> dict:
    """Start a Router, have it replay the workload (the driver only polls its progress, calling
    on_progress(finished) about twice a second), stop it; returns the Router's raw results."""
    router = start_router(cfg)
    try:
        ref = router.run_workload.remote(requests)
        while True:
            ready, _ = ray.wait([ref], timeout=0.5)
            if on_progress is not None:
                on_progress(ray.get(router.finished_count.remote()))
            if ready:
                return ray_get(ref)
    finally:
        stop_router(router)
