"""Router: the Ray actor that owns the scheduler and the shard workers, and serves requests.

A thin shell over the core's AsyncEngine: requests are submitted and streamed through this actor;
every step is one round trip to the ShardWorkers (a compiled graph on one node, actor calls across
nodes), and only token ids come back. Towards its clients (actors.client.RouterClient) a batch of
requests is one call, and each client's pieces leave as one object per step on one stream.
"""

from __future__ import annotations

import asyncio
import os

from dspark_cluster.errors import EngineError


class _Outbox:
    """One client's pieces between the engine's hand-overs and its output stream: everything since
    the stream last took, as one list of (request id, piece or error)."""

    def __init__(self):
        self.items: list = []
        self.ready = asyncio.Event()
        self.closed = False

    def put(self, request_id: str, item) -> None:
        if isinstance(item, BaseException) and not isinstance(item, EngineError):  # our messages only cross
            item = EngineError(f"request {request_id} failed ({type(item).__name__}); see the server log")
        self.items.append((request_id, item))
        self.ready.set()

    async def take(self) -> list:
        await self.ready.wait()
        self.ready.clear()
        items, self.items = self.items, []
        return items

    def close(self) -> None:
        self.closed = True
        self.ready.set()


class Router:
    def __init__(self, cfg: dict):
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.cfg = cfg
        self.core = None
        self._outboxes: dict[str, _Outbox] = {}  # client stream id -> its outbox

    def start(self) -> dict:
        """Start the shard workers and the step loop. Separate from __init__ so that a failure
        (a checkpoint error, a bad topology) reaches the caller as its own exception type."""
        from dspark_cluster.async_engine import AsyncEngine
        from dspark_cluster.config import load_config

        from .metrics import RayMetrics

        cfg = load_config(self.cfg)
        self.core = AsyncEngine(cfg, metrics=RayMetrics(os.path.basename(cfg.model.path.rstrip("/"))))
        return self.core.stats()

    def engine_info(self) -> dict:
        """What a client needs of the model (read here once, from the checkpoint)."""
        return {"max_model_len": self.core.engine.max_model_len}

    # ---- requests ---------------------------------------------------------------------------
    def _outbox(self, stream_id: str) -> _Outbox:
        box = self._outboxes.get(stream_id)
        if box is None:
            box = self._outboxes[stream_id] = _Outbox()
        return box

    async def add_requests(self, stream_id: str, prompts, params, request_ids, resume=None) -> list:
        """Validate and queue a batch (n choices, many prompts) in one call; their pieces go to the
        client's output stream `stream_id`. resume: per request, the output tokens it already has
        (a client re-submitting what a lost Router had in flight), or None."""
        return self.core.submit_many(prompts, params, request_ids, sink=self._outbox(stream_id), resume=resume)

    async def outputs(self, stream_id: str):
        """Ray streaming generator: one object per step in which this client's requests gained
        pieces (a list of (request id, StreamPiece or EngineError)), until close_outputs."""
        box = self._outbox(stream_id)
        try:
            while not box.closed:
                items = await box.take()
                if items:
                    yield items
        finally:
            self._outboxes.pop(stream_id, None)

    def close_outputs(self, stream_id: str) -> None:
        box = self._outboxes.get(stream_id)
        if box is not None:
            box.close()

    async def generate(self, prompts, params):
        return await self.core.generate(prompts, params)

    async def run_workload(self, requests):
        return await self.core.run_workload(requests)

    def abort(self, request_id: str) -> None:
        self.core.abort(request_id)

    # ---- admin ------------------------------------------------------------------------------
    async def call_utility(self, name: str, *args):
        """The engine's admin operations by name (dspark_cluster.async_engine.UTILITIES)."""
        return await self.core.call_utility(name, *args)

    async def set_speculation(self, enabled: bool) -> None:
        """(Documented shorthand: router.set_speculation.remote(False).)"""
        await self.call_utility("set_speculation", enabled)

    async def rebalance_now(self) -> None:
        """(Shorthand: router.rebalance_now.remote().)"""
        await self.call_utility("rebalance_now")

    # ---- inspection -------------------------------------------------------------------------
    def balancer_summary(self) -> dict:
        b = self.core.engine.balancer
        return b.summary() if b is not None else {}

    def stats(self) -> dict:
        return self.core.stats()

    def finished_count(self) -> int:
        return len(self.core.finished)

    def pid(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def drafter_names(self) -> list[str]:
        """This engine's drafter actors, by name (none in process or with the drafter on the target)."""
        spec = self.core.engine.speculation
        backend = spec.drafter.backend if spec is not None else None
        return list(getattr(backend, "names", None) or [])

    def worker_reports(self) -> list:
        return getattr(self.core.engine.executor, "reports", [])

    def comm_stats(self) -> list:
        return self.core.engine.executor.comm_stats()

    def debug_logits(self, step):
        return self.core.engine.executor.debug_logits(step)

    def shutdown(self) -> None:
        for box in list(self._outboxes.values()):
            box.close()
        if self.core is not None:
            self.core.shutdown()
