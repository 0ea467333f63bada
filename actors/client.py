"""Clients of a Router actor: `RouterClient` (synchronous, behind `LLM`) and `AsyncRouterClient`
(asyncio, behind the HTTP server), with the same methods as their in-process counterparts. Ray's
errors stop here: a Router's own DSparkError is raised as itself, anything else as an EngineError
that names the problem without Ray's internals."""

from __future__ import annotations

import logging
from typing import AsyncIterator, Iterator, Optional

from ray.exceptions import RayError

from dspark_cluster.config import Config
from dspark_cluster.engine import load_tokenizer
from dspark_cluster.errors import DSparkError, EngineError
from dspark_cluster.outputs import RequestOutput, StreamPiece
from dspark_cluster.model.spec import load_spec
from dspark_cluster.sampling import SamplingParams

from .cluster import ray_get, start_router, stop_router

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


class RouterClient:
    """LLM's client of a Router it started: generate, stream, the drafter's versions, shutdown."""

    def __init__(self, handle, cfg: Config, owns: bool = True):
        self.handle, self.cfg, self._owns = handle, cfg, owns
        self.tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.path)

    @classmethod
    def start(cls, cfg: Config) -> "RouterClient":
        return cls(start_router(cfg), cfg)

    def generate(self, prompts, params: list[SamplingParams]) -> list[RequestOutput]:
        return ray_get(self.handle.generate.remote(list(prompts), params))

    def stream(self, prompt, params: SamplingParams) -> Iterator[StreamPiece]:
        rid = ray_get(self.handle.submit.remote(prompt, params))
        finished = False
        try:
            for ref in self.handle.stream.options(num_returns="streaming").remote(rid):
                piece = ray_get(ref)
                finished = piece.finished
                yield piece
        finally:
            if not finished:
                self.handle.abort.remote(rid)

    def drafter_status(self) -> dict:
        return ray_get(self.handle.drafter_status.remote())

    def rollback_drafter(self, version: Optional[int] = None) -> dict:
        return ray_get(self.handle.rollback_drafter.remote(version))

    def resume_drafter(self) -> dict:
        return ray_get(self.handle.resume_drafter.remote())

    def shutdown(self) -> None:
        if self._owns:
            stop_router(self.handle)
            self._owns = False


class AsyncRouterClient:
    """The HTTP server's client of a Router (see dspark_cluster.client.EngineClient for the methods)."""

    kind = "ray"
    engine = None  # no in-process engine

    def __init__(self, handle, cfg: Config, owns: bool = True):
        self.router, self._owns = handle, owns
        spec = load_spec(cfg.model.path, cfg.model.dtype)
        self.max_model_len = cfg.scheduler.max_model_len or spec.max_position_embeddings
        self.tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.path)  # loaded here, in the driver
        self.model_path = cfg.model.path

    @classmethod
    def start(cls, cfg: Config) -> "AsyncRouterClient":
        return cls(start_router(cfg), cfg, owns=True)

    async def _call(self, method, *args):
        try:
            return await method.remote(*args)
        except RayError as e:
            raise _unwrap_ray_error(e) from None

    async def submit(self, prompt, params: Optional[SamplingParams] = None, request_id: Optional[str] = None) -> str:
        return await self._call(self.router.submit, prompt, params, request_id)

    async def stream(self, request_id: str) -> AsyncIterator[StreamPiece]:
        finished = False
        try:
            gen = self.router.stream.options(num_returns="streaming").remote(request_id)
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
        self.router.abort.remote(request_id)  # fire and forget

    async def stats(self) -> dict:
        return await self.router.stats.remote()

    async def drafter_status(self) -> dict:
        return await self._call(self.router.drafter_status)

    async def rollback_drafter(self, version: Optional[int] = None) -> dict:
        return await self._call(self.router.rollback_drafter, version)

    async def resume_drafter(self) -> dict:
        return await self._call(self.router.resume_drafter)

    def shutdown(self) -> None:
        if self._owns:
            stop_router(self.router)
            self._owns = False
