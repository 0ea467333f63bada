"""EngineClient: one asyncio interface over the in-process `AsyncEngine` (`executor: local`) and the
`Router` Ray actor (`executor: ray`), for the HTTP server and benchmarks.

    client = EngineClient.start(cfg)            # picks the backend from cfg.parallel.executor
    rid = await client.submit(prompt, params)   # raises RequestError at once for bad input
    async with contextlib.aclosing(client.stream(rid)) as pieces:
        async for piece in pieces: ...          # StreamPiece; leaving early aborts the request
    await client.stats(); client.tokenizer; client.max_model_len; client.shutdown()

Every method is called from an event loop (the server's); each request's tokens go to the loop
that submitted it.
"""

from __future__ import annotations

import contextlib
import logging
from typing import AsyncIterator, Optional

from .config import Config
from .errors import DSparkError, EngineError
from .llm import StreamPiece
from .sampling import SamplingParams

log = logging.getLogger(__name__)


def _unwrap_ray_error(e: BaseException) -> BaseException:
    """A RayTaskError whose cause is one of this package's errors -> that error, as itself; any
    other Ray error (a dead Router: its text names actors, PIDs, addresses) -> an EngineError that
    names only the problem, the details going to the log."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, DSparkError):
        return cause
    log.error("the router failed: %s: %s", type(e).__name__, e)
    return EngineError(f"the router failed ({type(e).__name__}); see the server log")


class EngineClient:
    """Use `EngineClient.start(cfg)`, `EngineClient.local(async_engine)` or `EngineClient.ray(router, cfg)`."""

    def __init__(self, *, engine=None, router=None, tokenizer=None, max_model_len: int = 0,
                 model_path: str = "", owns: bool = True):
        if (engine is None) == (router is None):
            raise ValueError("EngineClient needs exactly one of engine= (AsyncEngine) or router= (Router handle)")
        self._engine = engine
        self._router = router
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.model_path = model_path
        self._owns = owns  # shutdown() stops the engine / router only if this client started it

    # ---- construction -----------------------------------------------------------------------
    @classmethod
    def start(cls, cfg: Config) -> "EngineClient":
        """Start the engine the config asks for: in this process (local) or a Router actor (ray)."""
        if cfg.parallel.executor == "ray":
            from .cluster import start_router

            return cls.ray(start_router(cfg), cfg, owns=True)
        from .async_engine import AsyncEngine

        return cls.local(AsyncEngine(cfg), owns=True)

    @classmethod
    def local(cls, engine, owns: bool = False) -> "EngineClient":
        """Wrap a running AsyncEngine."""
        return cls(engine=engine, tokenizer=engine.tokenizer, max_model_len=engine.engine.max_model_len,
                   model_path=engine.cfg.model.path, owns=owns)

    @classmethod
    def ray(cls, router, cfg: Config, owns: bool = False) -> "EngineClient":
        """Wrap a started Router actor handle; the tokenizer is loaded here, in the driver."""
        from .engine import load_tokenizer
        from .model.spec import load_spec

        spec = load_spec(cfg.model.path, cfg.model.dtype)
        max_model_len = cfg.scheduler.max_model_len or spec.max_position_embeddings
        return cls(router=router, tokenizer=load_tokenizer(cfg.model.tokenizer or cfg.model.path),
                   max_model_len=max_model_len, model_path=cfg.model.path, owns=owns)

    @property
    def kind(self) -> str:
        return "local" if self._engine is not None else "ray"

    @property
    def engine(self):
        """The in-process AsyncEngine (None for the ray backend)."""
        return self._engine

    @property
    def router(self):
        """The Router actor handle (None for the local backend)."""
        return self._router

    # ---- requests ---------------------------------------------------------------------------
    async def submit(self, prompt, params: Optional[SamplingParams] = None, request_id: Optional[str] = None) -> str:
        """Validate and queue a request; RequestError (or another DSparkError) for bad input."""
        if self._engine is not None:
            return self._engine.submit(prompt, params, request_id)
        from ray.exceptions import RayError

        try:
            return await self._router.submit.remote(prompt, params, request_id)
        except RayError as e:
            raise _unwrap_ray_error(e) from None

    async def stream(self, request_id: str) -> AsyncIterator[StreamPiece]:
        """The request's pieces as they are made. Closing this generator before the last piece
        (break, cancellation, aclose) aborts the request, which frees its KV blocks."""
        finished = False
        try:
            if self._engine is not None:
                async with contextlib.aclosing(self._engine.stream(request_id)) as pieces:
                    async for piece in pieces:
                        finished = piece.finished
                        yield piece
            else:
                from ray.exceptions import RayError

                gen = self._router.stream.options(num_returns="streaming").remote(request_id)
                try:
                    async for ref in gen:
                        piece = await ref
                        finished = piece.finished
                        yield piece
                except RayError as e:
                    raise _unwrap_ray_error(e) from None
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Cancel a request (no-op for one that has finished); its KV blocks are freed."""
        if self._engine is not None:
            self._engine.abort(request_id)
        else:
            self._router.abort.remote(request_id)  # fire and forget

    async def stats(self) -> dict:
        """kv_blocks_total, kv_blocks_used, running, waiting, preemptions, steps."""
        if self._engine is not None:
            return self._engine.stats()
        return await self._router.stats.remote()

    async def drafter_status(self) -> dict:
        """Online calibration: serving drafter version, history, the calibrator's buffer."""
        if self._engine is not None:
            import asyncio

            return await asyncio.to_thread(self._engine.drafter_status)
        return await self._router_call(self._router.drafter_status)

    async def rollback_drafter(self, version: Optional[int] = None) -> dict:
        """Serve an earlier drafter version (None: the original) from the next step."""
        if self._engine is not None:
            return await self._engine.rollback_drafter(version)
        return await self._router_call(self._router.rollback_drafter, version)

    async def resume_drafter(self) -> dict:
        """After a manual rollback: let calibrated versions publish again."""
        if self._engine is not None:
            return await self._engine.resume_drafter()
        return await self._router_call(self._router.resume_drafter)

    async def _router_call(self, method, *args):
        from ray.exceptions import RayError

        try:
            return await method.remote(*args)
        except RayError as e:
            raise _unwrap_ray_error(e) from None

    def shutdown(self) -> None:
        if not self._owns:
            return
        if self._engine is not None:
            self._engine.shutdown()
        else:
            from .cluster import stop_router

            stop_router(self._router)
        self._owns = False
