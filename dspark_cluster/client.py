"""The one front door to an engine: `EngineClient`, an asyncio interface with two implementations,
`InprocClient` over the in-process `AsyncEngine` (`executor: local`) and the named backend's (`ray`:
actors.client.RouterClient, over the Router actor). The HTTP server, `LLM` (a synchronous wrapper)
and the benchmarks use it; none of them knows which engine is behind it.

    client = EngineClient.start(cfg)                 # picks the implementation from cfg.parallel.executor
    ids = await client.submit_many(prompts, params)  # n choices, many prompts: one call; RequestError at once
    async with contextlib.aclosing(client.stream(ids[0])) as pieces:
        async for piece in pieces: ...               # StreamPiece; leaving early aborts the request
    outs = await client.generate(prompts, params)    # RequestOutput per prompt
    await client.call_utility("rollback_drafter", 2) # admin operations by name (async_engine.UTILITIES)
    await client.stats(); client.tokenizer; client.max_model_len; client.shutdown()

Every coroutine is called from one event loop (the server's, LLM's own); each request's pieces go
to the loop that submitted it.
"""

from __future__ import annotations

import contextlib
from typing import AsyncIterator, Optional

from .async_engine import AsyncEngine
from .backends import backend
from .config import Config
from .outputs import RequestOutput, StreamPiece
from .sampling import SamplingParams


class EngineClient:
    """The interface (use `EngineClient.start(cfg)` or `EngineClient.local(async_engine)`).
    kind: "local" | "ray"; engine: the in-process AsyncEngine (None on Ray); router: the Router
    actor's handle (None in process); tokenizer, max_model_len, model_path: the served model's."""

    kind: str
    engine: Optional[AsyncEngine] = None
    router = None
    tokenizer = None
    max_model_len: int
    model_path: str

    @classmethod
    def start(cls, cfg: Config, step_thread: bool = True) -> "EngineClient":
        """Start the engine the config asks for: in this process (local), or the named backend's
        (ray: a Router actor, and its client). step_thread=False: the in-process engine steps in
        the event loop of its caller instead of a thread of its own (LLM: see AsyncEngine)."""
        if cfg.parallel.executor != "local":
            return backend(cfg.parallel.executor).RouterClient.start(cfg)
        return InprocClient(AsyncEngine(cfg, step_thread=step_thread), owns=True)

    @classmethod
    def local(cls, engine: AsyncEngine, owns: bool = False) -> "InprocClient":
        """Wrap a running AsyncEngine."""
        return InprocClient(engine, owns=owns)

    # ---- requests ---------------------------------------------------------------------------
    async def submit(self, prompt, params: Optional[SamplingParams] = None, request_id: Optional[str] = None) -> str:
        """Validate and queue one request; RequestError (or another DSparkError) for bad input."""
        return (await self.submit_many([prompt], [params], [request_id]))[0]

    async def submit_many(self, prompts, params, request_ids=None) -> list[str]:
        """Validate every request (a bad one raises, and none is queued), then queue them together
        in one call: they join the same step. Returns their ids."""
        raise NotImplementedError

    def stream(self, request_id: str) -> AsyncIterator[StreamPiece]:
        """The request's pieces as they are made. Closing this generator before the last piece
        (break, cancellation, aclose) aborts the request, which frees its KV blocks."""
        raise NotImplementedError

    async def generate(self, prompts, params) -> list[RequestOutput]:
        """Submit every prompt together and wait for their whole outputs."""
        raise NotImplementedError

    def abort(self, request_id: str) -> None:
        """Cancel a request (no-op for one that has finished); its KV blocks are freed."""
        raise NotImplementedError

    async def stats(self) -> dict:
        """kv_blocks_total, kv_blocks_used, running, waiting, preemptions, steps, cost, ..."""
        raise NotImplementedError

    async def call_utility(self, name: str, *args):
        """An admin operation of the engine by name (async_engine.UTILITIES): drafter_status(),
        rollback_drafter(version), resume_drafter(), set_speculation(enabled), rebalance_now()."""
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError


class InprocClient(EngineClient):
    """The engine in this process (an AsyncEngine stepping in its own thread)."""

    kind = "local"

    def __init__(self, engine: AsyncEngine, owns: bool = True):
        self.engine = engine
        self.tokenizer = engine.tokenizer  # the engine's: one per process
        self.max_model_len = engine.engine.max_model_len
        self.model_path = engine.cfg.model.path
        self._owns = owns  # shutdown() stops the engine only if this client started it

    async def submit_many(self, prompts, params, request_ids=None) -> list[str]:
        return self.engine.submit_many(prompts, params, request_ids)

    async def stream(self, request_id: str) -> AsyncIterator[StreamPiece]:
        finished = False
        try:
            async with contextlib.aclosing(self.engine.stream(request_id)) as pieces:
                async for piece in pieces:
                    finished = piece.finished
                    yield piece
        finally:
            if not finished:
                self.abort(request_id)

    async def generate(self, prompts, params) -> list[RequestOutput]:
        return await self.engine.generate(prompts, params)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    async def stats(self) -> dict:
        return self.engine.stats()

    async def call_utility(self, name: str, *args):
        return await self.engine.call_utility(name, *args)

    def shutdown(self) -> None:
        if self._owns:
            self.engine.shutdown()
            self._owns = False
