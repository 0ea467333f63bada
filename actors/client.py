"""RouterClient: the engine client (dspark_cluster.client.EngineClient) of a Router actor, behind
the HTTP server and `LLM` with `executor: ray`.

What crosses the process boundary: a call per batch of requests (`add_requests`: n choices, many
prompts, one round trip), and one output stream per client (`Router.outputs`), each of whose
objects holds every piece this client's requests gained since the last one (one step's, or a few
when the client fell behind), fanned out here to the requests' queues. Ray's errors stop here: a
Router's own DSparkError is raised as itself, anything else as an EngineError that names the
problem without Ray's internals.

Router recovery: this client knows each streamed request's prompt, parameters and the tokens its
reader has had, which is all a Router holds of it that matters. When the Router dies (its process
killed, its node lost) the client that started it starts a new one (its workers die with it: Ray
ends an actor's children with it, so they are started again under the same placement rules) and
re-submits every request in flight with the tokens already streamed (`resume`): the streams go on
after a pause, greedy outputs as without the fault. Bounded by `parallel.max_restarts`; `stats()`
says `restarting` meanwhile (the server's /health answers 503), and requests submitted meanwhile
wait for the new Router."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional

from ray.exceptions import ActorUnavailableError, RayActorError, RayError

from dspark_cluster.client import EngineClient
from dspark_cluster.config import Config
from dspark_cluster.errors import EngineError, RequestError
from dspark_cluster.input_processor import load_tokenizer
from dspark_cluster.outputs import RequestOutput, StreamPiece

from .calls import unwrap
from .cluster import ray_get, start_router, stop_router
from .placement_groups import remove_placement_groups_of

log = logging.getLogger(__name__)


def _router_failed(e: BaseException) -> EngineError:
    """A Router failure other than one of this package's errors (a dead Router: its text names
    actors, PIDs, addresses) -> an EngineError that names only the problem; the details go to the log."""
    log.error("the router failed: %s: %s", type(e).__name__, e)
    return EngineError(f"the router failed ({type(e).__name__}); see the server log")


def _unwrap_ray_error(e: BaseException) -> BaseException:
    return unwrap(e, failed=_router_failed, lost=_router_failed)


def _router_lost(e: BaseException) -> bool:
    """The Router actor is gone (not merely slow to answer, which ActorUnavailableError says)."""
    return isinstance(e, RayActorError) and not isinstance(e, ActorUnavailableError)


@dataclass
class _InFlight:
    """What a new Router needs to continue a streamed request: as it was submitted, and the output
    tokens its reader has been given."""

    prompt: object
    params: object
    token_ids: list = field(default_factory=list)


class RouterClient(EngineClient):
    kind = "ray"

    def __init__(self, handle, cfg: Config, owns: bool = True):
        self.router, self._owns = handle, owns
        self.cfg = cfg
        self.model_path = cfg.model.path
        self.max_model_len = ray_get(handle.engine_info.remote())["max_model_len"]  # the engine read config.json
        self._tokenizer_path = cfg.model.tokenizer or cfg.model.path
        self._tokenizer, self._tokenizer_lock = None, threading.Lock()
        self._queues: dict[str, asyncio.Queue] = {}  # request id -> its pieces, from submit until read or aborted
        self._reading: set[str] = set()  # requests whose stream someone is reading
        self._pump: Optional[asyncio.Task] = None  # reads this client's output stream (from the first submit)
        self._stream_id: Optional[str] = None
        self.num_batches = 0  # objects received on the output stream (each: one step's pieces, or a few)
        self._in_flight: dict[str, _InFlight] = {}  # streamed requests not finished: what a new Router needs
        self._recovery: Optional[asyncio.Task] = None  # a Router restart under way (or the last one)
        self._failed: Optional[EngineError] = None  # set once the restarts allowed are spent
        self.num_router_restarts = 0
        self.last_router_restart: Optional[dict] = None  # {"pause_s", "resubmitted"} of the latest

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

    async def _call(self, name: str, *args):
        """Router.<name>(*args); a lost Router is restarted (when this client started it) and the
        call made again on the new one."""
        while True:
            await self._wait_up()
            router = self.router
            try:
                return await getattr(router, name).remote(*args)
            except RayError as e:
                if not (_router_lost(e) and self._owns):
                    raise _unwrap_ray_error(e) from None
                await self._recover(router, e)

    async def _wait_up(self) -> None:
        """Wait for a Router restart under way (bounded: the restart itself is); raise once failed."""
        if self._recovery is not None and not self._recovery.done():
            await asyncio.shield(self._recovery)
        if self._failed is not None:
            raise self._failed

    # ---- Router recovery --------------------------------------------------------------------
    async def _recover(self, lost_router, error: BaseException) -> None:
        """Restart the Router `lost_router` (once, however many callers saw it die) and re-submit
        the requests in flight; returns when done. Raises EngineError when no restart is left."""
        self._start_restart(lost_router, error)
        await self._wait_up()

    def _start_restart(self, lost_router, error: BaseException) -> None:
        if self.router is lost_router and (self._recovery is None or self._recovery.done()):
            self._recovery = asyncio.get_running_loop().create_task(self._restart(error), name="dspark-router-restart")

    async def _restart(self, error: BaseException) -> None:
        limit = self.cfg.parallel.max_restarts
        lost, t0 = self.router, time.perf_counter()
        with contextlib.suppress(Exception):  # its process is gone; make sure Ray agrees
            import ray

            ray.kill(lost, no_restart=True)
        try:  # its actors went with it, its placement groups did not: free their devices (restarted or not)
            freed = await asyncio.to_thread(remove_placement_groups_of, lost._actor_id.hex())
            log.warning("removed %d placement group(s) of the lost router", freed)
        except Exception as e:  # noqa: BLE001 -- the GCS unreachable: the restart below says more
            log.error("could not remove the lost router's placement groups: %s: %s", type(e).__name__, e)
        while True:
            if self.num_router_restarts >= limit:
                self._failed = EngineError(f"the router was lost and the {limit} restart(s) allowed "
                                           "(parallel.max_restarts) are spent")
                log.error("%s (last: %s: %s)", self._failed, type(error).__name__, error)
                self._fail_all(self._failed)
                return
            self.num_router_restarts += 1
            log.error("the router was lost (%s: %s); restart %d of %d", type(error).__name__, error,
                      self.num_router_restarts, limit)
            try:
                self.router = await asyncio.to_thread(start_router, self.cfg)
                break
            except Exception as e:  # noqa: BLE001 -- e.g. the lost node's resources are not back yet
                log.error("router restart %d failed: %s: %s", self.num_router_restarts, type(e).__name__, e)
                error = e
                await asyncio.sleep(min(2.0 ** self.num_router_restarts, 30.0))
        resubmitted = await self._resubmit()
        self.last_router_restart = {"pause_s": round(time.perf_counter() - t0, 3), "resubmitted": resubmitted}
        log.warning("router restarted in %.2f s; %d request(s) in flight resumed", time.perf_counter() - t0, resubmitted)

    async def _resubmit(self) -> int:
        """Every request in flight, on the new Router's output stream, after the tokens its reader has."""
        if self._pump is None:  # nothing was ever submitted: no stream to read on
            return 0
        self._open_stream()  # the pump reads it once it sees the old one fail
        rids = list(self._in_flight)
        if not rids:
            return 0
        f = [self._in_flight[r] for r in rids]
        try:
            await self.router.add_requests.remote(self._stream_id, [x.prompt for x in f], [x.params for x in f],
                                                  rids, [list(x.token_ids) for x in f])
        except RayError as e:
            if _router_lost(e):  # the new one died at once: the pump sees its stream fail and restarts again
                return len(rids)
            err = _unwrap_ray_error(e)  # the new Router refused them: those requests end here
            for rid in rids:
                self._end(rid, err if isinstance(err, EngineError) else EngineError(f"resuming failed: {err}"))
        return len(rids)

    def _end(self, rid: str, error: BaseException) -> None:
        self._in_flight.pop(rid, None)
        q = self._queues.get(rid)
        if q is not None:
            q.put_nowait(error)

    def _fail_all(self, error: BaseException) -> None:
        for rid in list(self._queues):
            self._end(rid, error)

    # ---- the output stream ------------------------------------------------------------------
    def _ensure_pump(self) -> None:
        """One output stream per client and event loop, opened before the first request is queued
        (so that no piece arrives before its queue exists)."""
        loop = asyncio.get_running_loop()
        if self._pump is not None and not self._pump.done() and self._pump.get_loop() is loop:
            return
        if self._stream_id is not None:  # a stream of a loop that has gone
            self.router.close_outputs.remote(self._stream_id)
        self._open_stream()
        self._pump = loop.create_task(self._read(), name="dspark-router-outputs")

    def _open_stream(self) -> None:
        self._stream_id = uuid.uuid4().hex
        self._gen = self.router.outputs.options(num_returns="streaming").remote(self._stream_id)

    async def _read(self) -> None:
        """Fan each batch out to its requests' queues. A lost Router is restarted (the new one's
        stream is read on); any other failure of the stream fails every request waiting."""
        while True:
            router, gen = self.router, self._gen
            try:
                async for ref in gen:
                    self._deliver(await ref)
                error = EngineError("the router closed this client's output stream")
            except asyncio.CancelledError:
                raise
            except RayError as e:
                if _router_lost(e) and self._owns:
                    with contextlib.suppress(EngineError):  # (then every request has its error)
                        await self._recover(router, e)
                    if self._failed is None:
                        continue
                    return
                error = _unwrap_ray_error(e)
            except Exception as e:  # noqa: BLE001 -- e.g. a batch that does not unpickle
                log.error("the router's output stream failed: %s: %s", type(e).__name__, e)
                error = EngineError(f"the router's output stream failed ({type(e).__name__}); see the server log")
            self._fail_all(error)
            return

    def _deliver(self, batch) -> None:
        self.num_batches += 1
        for rid, item in batch:
            q = self._queues.get(rid)
            if q is None:
                continue
            f = self._in_flight.get(rid)
            if f is not None and not isinstance(item, BaseException):
                f.token_ids += item.token_ids
                if item.finished:
                    del self._in_flight[rid]
            q.put_nowait(item)

    # ---- requests ---------------------------------------------------------------------------
    async def submit_many(self, prompts, params, request_ids=None) -> list[str]:
        # named here (as the engine would name them), so that each queue exists before its pieces come
        ids = [rid or uuid.uuid4().hex for rid in (request_ids or [None] * len(prompts))]
        await self._wait_up()
        for k, rid in enumerate(ids):  # (after the wait: checked and registered with no await between)
            if rid in self._queues or rid in ids[:k]:
                raise RequestError(f"request_id: {rid!r} is already in use")
        self._ensure_pump()
        for rid, p, sp in zip(ids, prompts, params):
            self._queues[rid] = asyncio.Queue()
            self._in_flight[rid] = _InFlight(p, sp)
        router = self.router
        try:
            try:
                await router.add_requests.remote(self._stream_id, list(prompts), list(params), ids)
            except RayError as e:
                if not (_router_lost(e) and self._owns):
                    raise _unwrap_ray_error(e) from None
                await self._recover(router, e)  # the new Router has them (re-submitted as in flight)
        except BaseException:
            for rid in ids:
                self._queues.pop(rid, None)
                self._in_flight.pop(rid, None)
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
            self._in_flight.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    async def generate(self, prompts, params) -> list[RequestOutput]:
        """One call; the whole outputs come back together (after a Router restart, from the start:
        nothing of them had been given out)."""
        return await self._call("generate", list(prompts), list(params))

    def abort(self, request_id: str) -> None:
        if request_id not in self._reading:  # nobody reads it (submitted, then given up on): its queue goes now
            self._queues.pop(request_id, None)
        self._in_flight.pop(request_id, None)
        self.router.abort.remote(request_id)  # fire and forget

    async def stats(self) -> dict:
        """The Router's stats; while a lost Router is restarted, this client's own account of it."""
        if self._failed is not None:
            return {"state": "failed", "error": str(self._failed), "restarts": self.num_router_restarts}
        restarting = {"state": "restarting", "restarts": self.num_router_restarts,
                      "error": "the router was lost; a new one is starting and requests will resume"}
        if self._recovery is not None and not self._recovery.done():
            return restarting
        router = self.router
        try:
            s = await router.stats.remote()
        except RayError as e:
            if not (_router_lost(e) and self._owns):
                raise
            self._start_restart(router, e)
            return restarting
        s["router_restarts"] = self.num_router_restarts
        s["last_router_restart"] = self.last_router_restart
        return s

    async def call_utility(self, name: str, *args):
        return await self._call("call_utility", name, *args)

    def shutdown(self) -> None:
        if self._recovery is not None and not self._recovery.done():
            with contextlib.suppress(RuntimeError):
                self._recovery.get_loop().call_soon_threadsafe(self._recovery.cancel)
        if self._pump is not None:
            with contextlib.suppress(RuntimeError):  # its loop has closed
                self._pump.get_loop().call_soon_threadsafe(self._pump.cancel)
        if self._owns:
            stop_router(self.router)
            self._owns = False
        elif self._stream_id is not None:
            self.router.close_outputs.remote(self._stream_id)
