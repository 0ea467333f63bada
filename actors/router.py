"""Router: the Ray actor that owns the scheduler and the shard workers, and serves requests.

A thin shell over the core's AsyncEngine: requests are submitted and streamed through this actor;
every step is one round trip to the ShardWorkers (a compiled graph on one node, actor calls across nodes), and only token ids come back.
"""

from __future__ import annotations

import os


class Router:
    def __init__(self, cfg: dict):
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.cfg = cfg
        self.core = None

    def start(self) -> dict:
        """Start the shard workers and the step loop. Separate from __init__ so that a failure
        (a checkpoint error, a bad topology) reaches the caller as its own exception type."""
        from dspark_cluster.async_engine import AsyncEngine
        from dspark_cluster.config import load_config

        from .metrics import RayMetrics

        cfg = load_config(self.cfg)
        self.core = AsyncEngine(cfg, metrics=RayMetrics(os.path.basename(cfg.model.path.rstrip("/"))))
        return self.core.stats()

    async def submit(self, prompt, params=None, request_id=None) -> str:
        return self.core.submit(prompt, params, request_id)

    async def stream(self, request_id: str):
        """Ray streaming generator: one StreamPiece per step in which the request gained tokens."""
        async for piece in self.core.stream(request_id):
            yield piece

    async def result(self, request_id: str):
        return await self.core.result(request_id)

    async def generate(self, prompts, params):
        return await self.core.generate(prompts, params)

    async def run_workload(self, requests):
        return await self.core.run_workload(requests)

    def abort(self, request_id: str) -> None:
        self.core.abort(request_id)

    def set_speculation(self, enabled: bool) -> None:
        self.core.set_speculation(enabled)

    async def drafter_status(self) -> dict:
        import asyncio

        return await asyncio.to_thread(self.core.drafter_status)  # it may ask the calibrator actor

    async def rollback_drafter(self, version=None) -> dict:
        return await self.core.rollback_drafter(version)

    async def resume_drafter(self) -> dict:
        return await self.core.resume_drafter()

    def balancer_summary(self) -> dict:
        b = self.core.engine.balancer
        return b.summary() if b is not None else {}

    def rebalance_now(self) -> None:
        self.core.rebalance_now()

    def stats(self) -> dict:
        return self.core.stats()

    def finished_count(self) -> int:
        return len(self.core.finished)

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def worker_reports(self) -> list:
        return getattr(self.core.engine.executor, "reports", [])

    def comm_stats(self) -> list:
        return self.core.engine.executor.comm_stats()

    def debug_logits(self, step):
        return self.core.engine.executor.debug_logits(step)

    def shutdown(self) -> None:
        if self.core is not None:
            self.core.shutdown()
