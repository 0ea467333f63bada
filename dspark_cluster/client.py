"""EngineClient: the asyncio interface the HTTP server and benchmarks use, over the in-process
`AsyncEngine` (`executor: local`); `EngineClient.start(cfg)` gives the named backend's client for any
other executor (`ray`: actors.client.AsyncRouterClient, with the same methods).

    client = EngineClient.start(cfg)            # picks the backend from cfg.parallel.executor
    rid = await client.submit(prompt, params)   # raises RequestError at once for bad input
    async with contextlib.aclosing(client.stream(rid)) as pieces:
        async for piece in pieces: ...          # StreamPiece; leaving early aborts the request
    await client.stats(); client.tokenizer; client.max_model_len; client.shutdown()

Every method is called from an event loop (the server's); each request's tokens go to the loop
that submitted it.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, Optional

from .async_engine import AsyncEngine
from .config import Config
from .executor import backend
from .outputs import StreamPiece
from .sampling import SamplingParams


class EngineClient:
    """Use `EngineClient.start(cfg)` or `EngineClient.local(async_engine)`."""

    kind = "local"
    router = None  # no Router actor

    def __init__(self, engine: AsyncEngine, owns: bool = True):
        self._engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.engine.max_model_len
        self.model_path = engine.cfg.model.path
        self._owns = owns  # shutdown() stops the engine only if this client started it

    # ---- construction -----------------------------------------------------------------------
    @classmethod
    def start(cls, cfg: Config):
        """Start the engine the config asks for: in this process (local), or the named backend's
        (ray: a Router actor, and its client)."""
        if cfg.parallel.executor != "local":
            return backend(cfg.parallel.executor).AsyncRouterClient.start(cfg)
        return cls(AsyncEngine(cfg), owns=True)

    @classmethod
    def local(cls, engine: AsyncEngine, owns: bool = False) -> "EngineClient":
        """Wrap a running AsyncEngine."""
        return cls(engine, owns=owns)

    @property
    def engine(self) -> AsyncEngine:
        return self._engine

    # ---- requests ---------------------------------------------------------------------------
    async def submit(self, prompt, params: Optional[SamplingParams] = None, request_id: Optional[str] = None) -> str:
        """Validate and queue a request; RequestError (or another DSparkError) for bad input."""
        return self._engine.submit(prompt, params, request_id)

    async def stream(self, request_id: str) -> AsyncIterator[StreamPiece]:
        """The request's pieces as they are made. Closing this generator before the last piece
        (break, cancellation, aclose) aborts the request, which frees its KV blocks."""
        finished = False
        try:
            async with contextlib.aclosing(self._engine.stream(request_id)) as pieces:
                async for piece in pieces:
                    finished = piece.finished
                    yield piece
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Cancel a request (no-op for one that has finished); its KV blocks are freed."""
        self._engine.abort(request_id)

    async def stats(self) -> dict:
        """kv_blocks_total, kv_blocks_used, running, waiting, preemptions, steps, cost, ..."""
        return self._engine.stats()

    async def drafter_status(self) -> dict:
        """Online calibration: serving drafter version, history, the calibrator's buffer."""
        return await asyncio.to_thread(self._engine.drafter_status)

    async def rollback_drafter(self, version: Optional[int] = None) -> dict:
        """Serve an earlier drafter version (None: the original) from the next step."""
        return await self._engine.rollback_drafter(version)

    async def resume_drafter(self) -> dict:
        """After a manual rollback: let calibrated versions publish again."""
        return await self._engine.resume_drafter()

    def shutdown(self) -> None:
        if self._owns:
            self._engine.shutdown()
            self._owns = False
