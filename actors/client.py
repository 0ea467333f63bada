"""RouterClient: the engine client (dspark_cluster.client.EngineClient) of a Router actor, behind
the HTTP server and `LLM` with `executor: ray`.

What crosses the process boundary: a call per batch of requests (`add_requests`: n choices, many
prompts, one round trip), and one output stream per client (`Router.outputs`), each of whose
objects holds every piece this client's requests gained since the last one (one step's, or a few
when the client fell behind), fanned out here to the requests' queues. Ray's errors stop here: a
Router's own DSparkError is raised as itself, anything else as an EngineError that names the
problem without Ray's internals."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import uuid
from typing import AsyncIterator, Optional

from ray.exceptions import RayError

from dspark_cluster.client import EngineClient
from dspark_cluster.config import Config
from dspark_cluster.errors import EngineError, RequestError
from dspark_cluster.input_processor import load_tokenizer
from dspark_cluster.outputs import RequestOutput, StreamPiece

from .calls import unwrap
from .cluster import ray_get, start_router, stop_router

log = logging.getLogger(__name__)


def _router_failed(e: BaseException) -> EngineError:
    """A Router failure other than one of this package's errors (a dead Router: its text names
    actors, PIDs, addresses) -> an EngineError that names only the problem; the details go to the log."""
    log.error("the router failed: %s: %s", type(e).__name__, e)
    return EngineError(f"the router failed ({type(e).__name__}); see the server log")


def _unwrap_ray_error(e: BaseException) -> BaseException:
    return unwrap(e, failed=_router_failed, lost=_router_failed)


class RouterClient(EngineClient):
    kind = "ray"

    def __init__(self, handle, cfg: Config, owns: bool = True):
        self.router, self._owns = handle, owns
        self.model_path = cfg.model.path
        self.max_model_len = ray_get(handle.engine_info.remote())["max_model_len"]  # the engine read config.json
        self._tokenizer_path = cfg.model.tokenizer or cfg.model.path
        self._tokenizer, self._tokenizer_lock = None, threading.Lock()
        self._queues: dict[str, asyncio.Queue] = {}  # request id -> its pieces, from submit until read or aborted
        self._reading: set[str] = set()  # requests whose stream someone is reading
        self._pump: Optional[asyncio.Task] = None  # reads this client's output stream (from the first submit)
        self._stream_id: Optional[str] = None
        self.num_batches = 0  # objects received on the output stream (each: one step's pieces, or a few)

    @classmethod
    def start(cls, cfg: Config) -> "RouterClient":
        return cls(start_router(cfg), cfg, owns=True)

    @property
    def tokenizer(self):
        """Loaded on first use (the server's templates and prompts): the Router makes the text, so
        an LLM in this process never needs it."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = load_tokenizer(self._tokenizer_path)
            return self._tokenizer

    async def _call(self, method, *args):
        try:
            return await method.remote(*args)
        except RayError as e:
            raise _unwrap_ray_error(e) from None

    # ---- the output stream ------------------------------------------------------------------
    def _ensure_pump(self) -> None:
        """One output stream per client and event loop, opened before the first request is queued
        (so that no piece arrives before its queue exists)."""
        loop = asyncio.get_running_loop()
        if self._pump is not None and not self._pump.done() and self._pump.get_loop() is loop:
            return
        if self._stream_id is not None:  # a stream of a loop that has gone
            self.router.close_outputs.remote(self._stream_id)
        self._stream_id = uuid.uuid4().hex
        gen = self.router.outputs.options(num_returns="streaming").remote(self._stream_id)
        self._pump = loop.create_task(self._read(gen), name="dspark-router-outputs")

    async def _read(self, gen) -> None:
        """Fan each batch out to its requests' queues; a failed stream fails every request waiting."""
        try:
            async for ref in gen:
                batch = await ref
                self.num_batches += 1
                for rid, item in batch:
                    q = self._queues.get(rid)
                    if q is not None:
                        q.put_nowait(item)
            error = EngineError("the router closed this client's output stream")
        except asyncio.CancelledError:
            raise
        except RayError as e:
            error = _unwrap_ray_error(e)
        except Exception as e:  # noqa: BLE001 -- e.g. a batch that does not unpickle
            log.error("the router's output stream failed: %s: %s", type(e).__name__, e)
            error = EngineError(f"the router's output stream failed ({type(e).__name__}); see the server log")
        for q in list(self._queues.values()):
            q.put_nowait(error)

    # ---- requests ---------------------------------------------------------------------------
    async def submit_many(self, prompts, params, request_ids=None) -> list[str]:
        # named here (as the engine would name them), so that each queue exists before its pieces come
        ids = [rid or uuid.uuid4().hex for rid in (request_ids or [None] * len(prompts))]
        for k, rid in enumerate(ids):
            if rid in self._queues or rid in ids[:k]:
                raise RequestError(f"request_id: {rid!r} is already in use")
        self._ensure_pump()
        for rid in ids:
            self._queues[rid] = asyncio.Queue()
        try:
            await self._call(self.router.add_requests, self._stream_id, list(prompts), list(params), ids)
        except BaseException:
            for rid in ids:
                self._queues.pop(rid, None)
            raise
        return ids

    async def stream(self, request_id: str) -> AsyncIterator[StreamPiece]:
        q = self._queues[request_id]
        self._reading.add(request_id)
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):  # an EngineError, whose message is meant for clients
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._reading.discard(request_id)
            self._queues.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    async def generate(self, prompts, params) -> list[RequestOutput]:
        """One call; the whole outputs come back together."""
        return await self._call(self.router.generate, list(prompts), list(params))

    def abort(self, request_id: str) -> None:
        if request_id not in self._reading:  # nobody reads it (submitted, then given up on): its queue goes now
            self._queues.pop(request_id, None)
        self.router.abort.remote(request_id)  # fire and forget

    async def stats(self) -> dict:
        return await self.router.stats.remote()

    async def call_utility(self, name: str, *args):
        return await self._call(self.router.call_utility, name, *args)

    def shutdown(self) -> None:
        if self._pump is not None:
            with contextlib.suppress(RuntimeError):  # its loop has closed
                self._pump.get_loop().call_soon_threadsafe(self._pump.cancel)
        if self._owns:
            stop_router(self.router)
            self._owns = False
        elif self._stream_id is not None:
            self.router.close_outputs.remote(self._stream_id)
