"""AsyncEngine: the engine core behind an asyncio API, stepping continuously in its own thread.

Requests join the running batch at the next step and leave it as soon as they finish
(iteration-level scheduling). Callers `submit` (validated at once, in the caller's thread),
then `stream` the pieces or await the `result`. The step thread owns the `EngineCore`: commands
reach it through a queue, and each request's outputs (tokens and the text they completed, made in
the step thread) come back to its event loop with `call_soon_threadsafe`. The Ray `Router` actor
is this class behind a Ray handle; the HTTP server and `dspark run` use it too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from typing import AsyncIterator, Optional

from .config import Config
from .engine import LLMEngine
from .engine_core import EngineCore, Output, request_output
from .errors import EngineError, RequestError, StepError
from .outputs import RequestOutput, StreamPiece
from .sampling import SamplingParams

log = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, cfg: Config, metrics=None):
        self.cfg = cfg
        self.core = EngineCore(LLMEngine(cfg), metrics)
        self.engine = self.core.engine
        self.tokenizer = self.engine.tokenizer
        self._commands: "queue.SimpleQueue" = queue.SimpleQueue()
        self._wake = threading.Event()
        # request id -> (the event loop of its caller, its output queue), from submit until its
        # consumer is done (or, with no consumer, until it is aborted)
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._consumed: set[str] = set()  # requests whose outputs someone is reading
        self._stop = False
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="dspark-engine", daemon=True)
        self._thread.start()

    @property
    def finished(self):
        """Per-request metrics of the latest finished requests (a workload run keeps all of its own)."""
        return self.core.finished

    @finished.setter
    def finished(self, value) -> None:
        self.core.finished = value

    @property
    def num_finished(self) -> int:
        return self.core.num_finished

    # ---- the step thread ------------------------------------------------------------------
    def _run(self) -> None:
        core = self.core
        while not self._stop:
            self._drain_commands()
            if not core.has_unfinished():
                self._wake.wait(1.0)  # submit, abort and commands wake it
                self._wake.clear()
                continue
            try:
                outputs = core.step()
            except StepError as e:  # that step's requests fail; the engine and the others go on
                self._fail(e.request_ids, e)
                continue
            except BaseException as e:  # the engine's own failure (restarts spent): fail every request loudly
                log.error("the engine stopped: %s: %s", type(e).__name__, e, exc_info=e)
                self._error = e if isinstance(e, EngineError) else EngineError(
                    f"the engine stopped after an internal error ({type(e).__name__}); see the server log")
                self._fail(list(self._queues.copy()), self._error)  # (the event loop adds and removes entries)
                return
            self._deliver(outputs)

    def _drain_commands(self) -> None:
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                self._command(kind, arg)
            except Exception as e:  # noqa: BLE001 -- a command never stops the step thread
                log.error("engine command %r failed: %s: %s", kind, type(e).__name__, e, exc_info=e)

    def _command(self, kind: str, arg) -> None:
        if kind == "add":  # a list: requests submitted together join the same step
            for seq in arg:
                try:
                    self.core.add(seq)
                except Exception as e:  # noqa: BLE001 -- that request fails (e.g. its id is in use); the rest go on
                    self._put(seq.request_id, e if isinstance(e, EngineError) else
                              EngineError(f"request {seq.request_id} could not be queued: {e}"))
        elif kind == "rebalance":
            self.engine.rebalance_now()
        elif kind == "speculation":
            self.engine.set_speculation(arg)
        elif kind == "rollback_drafter":  # at a step boundary, on the step thread
            version, done = arg
            try:
                done.set_result(self.engine.resume_drafter() if version == "resume"
                                else self.engine.rollback_drafter(version))
            except BaseException as e:  # noqa: BLE001 -- the caller gets it (RequestError: no such version)
                done.set_exception(e)
        elif kind == "abort":
            self._deliver(self.core.abort(arg))

    def _deliver(self, outputs: list[Output]) -> None:
        for o in outputs:
            self._put(o.event.request_id, o)

    def _fail(self, request_ids, error: BaseException) -> None:
        """Hand `error` to these requests' streams (their sequences are already finished)."""
        self.core.failed(request_ids)
        for rid in request_ids:
            self._put(rid, error)

    def _put(self, request_id: str, item) -> None:
        entry = self._queues.get(request_id)
        if entry is not None:
            loop, q = entry
            with contextlib.suppress(RuntimeError):  # its loop has closed: nobody is listening
                loop.call_soon_threadsafe(q.put_nowait, item)

    # ---- the asyncio API ------------------------------------------------------------------
    def _check_up(self) -> None:
        if self._error is not None:
            raise EngineError(f"the engine stopped after an error: {self._error}")

    def _queue(self, seq) -> None:
        if seq.request_id in self._queues:
            raise RequestError(f"request_id: {seq.request_id!r} is already in use")
        self._queues[seq.request_id] = (asyncio.get_running_loop(), asyncio.Queue())

    def submit(self, prompt, params: Optional[SamplingParams] = None, request_id: Optional[str] = None) -> str:
        """Validate (raises RequestError here) and queue a request; returns its id. Call from the
        event loop's thread; then read its outputs with stream() or result() (or abort it)."""
        self._check_up()
        seq = self.engine.make_sequence(prompt, params, request_id)
        self._queue(seq)
        self._commands.put(("add", [seq]))
        self._wake.set()
        return seq.request_id

    def abort(self, request_id: str) -> None:
        """Cancel a request: it leaves the batch at the next step and its KV blocks are freed. One
        nobody reads (submitted, then given up on) has its queue dropped now."""
        if request_id not in self._consumed:
            self._queues.pop(request_id, None)
        self._commands.put(("abort", request_id))
        self._wake.set()

    async def _outputs(self, request_id: str) -> AsyncIterator[Output]:
        """The request's outputs until it finishes; an engine error is raised here. Leaving early
        aborts the request; its queue goes either way."""
        _, q = self._queues[request_id]
        self._consumed.add(request_id)
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, EngineError):  # its message is meant for clients
                    finished = True
                    raise item
                if isinstance(item, BaseException):
                    finished = True
                    raise EngineError(f"request {request_id} failed ({type(item).__name__}); see the server log") from item
                finished = item.event.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._commands.put(("abort", request_id))  # the consumer went away: free the KV
                self._wake.set()
            self._consumed.discard(request_id)
            self._queues.pop(request_id, None)

    async def stream(self, request_id: str) -> AsyncIterator[StreamPiece]:
        first = True
        async with contextlib.aclosing(self._outputs(request_id)) as outputs:
            async for o in outputs:
                yield o.piece(first)
                first = False

    async def result(self, request_id: str) -> RequestOutput:
        """Wait for the whole output (its text made as the tokens came, in the step thread)."""
        text, last = [], None
        async with contextlib.aclosing(self._outputs(request_id)) as outputs:
            async for o in outputs:
                text.append(o.text)
                last = o
        return request_output(last.event.seq, "".join(text))

    async def generate(self, prompts, params) -> list[RequestOutput]:
        """Validate every prompt, then submit them together (they join the same step) and wait for
        every result; the first failure is raised once all have ended."""
        self._check_up()
        seqs = [self.engine.make_sequence(p, sp) for p, sp in zip(prompts, params)]
        for s in seqs:
            self._queue(s)
        self._commands.put(("add", seqs))
        self._wake.set()
        results = await asyncio.gather(*(self.result(s.request_id) for s in seqs), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return list(results)

    async def run_workload(self, requests, on_finish=None) -> dict:
        """Replay a workload in real time: each request is submitted at its arrival offset.
        Returns per-request metrics, step stats and the wall time."""
        # the cost ledger covers the run only: usage counters from here, the KV peak from zero
        self.engine.kv_peak_blocks = [0] * self.engine.num_groups
        usage = await asyncio.to_thread(self.engine.usage, True)
        start = time.monotonic()
        self.finished = []  # this run's requests, all of them
        self.engine.step_record = []
        if self.engine.balancer is not None:
            self.engine.balancer.keep_history()

        async def one(r):
            delay = r.arrival_s - (time.monotonic() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            rid = self.submit(r.prompt, r.params)
            out = await self.result(rid)
            if on_finish is not None:
                on_finish(out)
            return out

        await asyncio.gather(*(one(r) for r in requests))
        duration = time.monotonic() - start
        cost = await asyncio.to_thread(self.engine.cost_ledger, usage, len(requests), True)
        return {
            "duration_s": duration,
            "cost": cost,
            "requests": list(self.finished),
            "steps": self.engine.step_record,
            "kv_blocks_total": self.engine.num_blocks * self.engine.num_groups,
            "preemptions": sum(r["num_preemptions"] for r in self.finished),
            "speculative": self.engine.speculative_summary(),
            "experts": self.engine.balancer.summary() if self.engine.balancer is not None else None,
        }

    def state(self) -> tuple[str, Optional[str]]:
        """("ok" | "restarting" | "failed", a reason safe to show clients)."""
        if self._error is not None or not self._thread.is_alive():
            return "failed", str(self._error or "the engine's step thread is not running")
        if self.engine.restarting:
            return "restarting", "a target worker was lost; the workers are restarting and requests will resume"
        return "ok", None

    def stats(self) -> dict:
        """Constant time (the server's /health and /metrics call it often)."""
        eng = self.engine
        state, reason = self.state()
        return {
            "state": state,
            "error": reason,
            "restarts": eng.num_restarts,
            "last_restart": eng.last_restart,
            "drafter_restarts": eng.drafter.num_restarts if eng.drafter is not None else 0,
            **eng.load(),
            "steps": eng.num_steps,
            "step_transport": eng.executor.transport,
            "async_scheduling": eng.async_scheduling,
            "overlapped_steps": eng.num_overlapped_steps,
            "speculation_enabled": eng.scheduler.speculation_enabled,
            "speculative": eng.speculative_summary(),
            "verify_budget": eng.step_stats[-1]["verify_budget"] if eng.step_stats else 0,
            "cost": self.core.live_ledger(),
        }

    def rebalance_now(self) -> None:
        """Ask for an expert rebalance at the next step."""
        self._commands.put(("rebalance", None))
        self._wake.set()

    def set_speculation(self, enabled: bool) -> None:
        """Switch speculative decoding on or off for all requests, from the next step."""
        self._commands.put(("speculation", enabled))
        self._wake.set()

    def drafter_status(self) -> dict:
        """Online calibration: the serving drafter version, its history, the calibrator's buffer."""
        return self.engine.drafter_status()

    async def rollback_drafter(self, version: Optional[int] = None) -> dict:
        """Serve an earlier drafter version (None: the original) from the next step; returns the
        drafter status after it. Raises RequestError for a version no drafter holds."""
        return await self._drafter_command(version)

    async def resume_drafter(self) -> dict:
        """After a manual rollback: let calibrated drafter versions publish again."""
        return await self._drafter_command("resume")

    async def _drafter_command(self, arg) -> dict:
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("rollback_drafter", (arg, done)))
        self._wake.set()
        return await asyncio.wrap_future(done)

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)
        self.engine.shutdown()
