"""AsyncEngine: the engine core behind an asyncio API, stepping continuously in its own thread
(or, with step_thread=False, in its caller's event loop: see below).

Requests join the running batch at the next step and leave it as soon as they finish
(iteration-level scheduling). Callers `submit` / `submit_many` (validated at once, in the caller's
thread), then `stream` the pieces or await the `result`. The step thread owns the `EngineCore`:
commands reach it through a queue, and each step's pieces (tokens and the text they completed,
made in the step thread) go to each reader's event loop in one hand-over per step, fanned out to
the requests' queues there. A caller may instead name a sink for its requests' pieces (the Router
actor's outbox of one client, which ships them to that client as one object). Admin operations go
through one door, `call_utility(name, *args)`. The Router actor is this class behind a Ray handle;
the HTTP server, `LLM` and `dspark run` use it in process.

step_thread=False (LLM in process): no thread of its own; a task of the caller's event loop steps
the engine while that loop runs, and LLM runs its loop in the caller's thread, only during a call.
So the engine steps in the thread that built it, and only while someone waits for it, as a
synchronous API should (torch's intra-op threads ran LLM's steps 2-3x slower from a second thread).
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
from .engine_core import EngineCore
from .errors import EngineError, RequestError, StepError
from .heartbeat import stalled_reasons
from .outputs import RequestOutput, StreamPiece, request_output
from .sampling import SamplingParams

log = logging.getLogger(__name__)

# The engine's admin operations, by name, for every client (vLLM's `call_utility`): where each
# runs. "step": on the step thread between two steps, where it cannot race one (it changes what the
# next step does); "thread": in a worker thread, a read that may wait on another actor
# (drafter_status asks the calibrator) and must not stall the steps.
UTILITIES = {
    "drafter_status": "thread",
    "rollback_drafter": "step",
    "resume_drafter": "step",
    "set_speculation": "step",
    "rebalance_now": "step",
}

STATS_EVERY_S = 5.0  # the state gauges (stats()) to the metrics sink: they move slowly; scrapes are ~15 s apart


def _ends(item) -> bool:
    """A request's last item: its finished piece, or an error."""
    return isinstance(item, BaseException) or item.finished


class AsyncEngine:
    def __init__(self, cfg: Config, metrics=None, step_thread: bool = True):
        self.metrics = metrics  # optional: metrics.EngineMetrics (the Router's Ray metrics)
        self.core = EngineCore(LLMEngine(cfg), metrics)
        self.engine = self.core.engine
        self.cfg = self.engine.cfg  # its `auto` settings resolved where the executor runs the work
        self.tokenizer = self.engine.tokenizer
        self._commands: "queue.SimpleQueue" = queue.SimpleQueue()
        self._wake = threading.Event()
        # request id -> (the event loop of its caller, its output queue), from submit until its
        # consumer is done (or, with no consumer, until it is aborted)
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._consumed: set[str] = set()  # requests whose outputs someone is reading
        # request id -> (event loop, sink with put(request_id, item)): requests submitted with a
        # sink, until their last item
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, object]] = {}
        self._stop = False
        self._error: Optional[BaseException] = None
        self._stats_at: Optional[float] = None  # when the metrics sink last got stats()
        self._stats_restarts = 0
        self._thread: Optional[threading.Thread] = None
        self._stepper: Optional[asyncio.Task] = None  # step_thread=False: the task that steps
        self._kicked: Optional[asyncio.Event] = None  # ... and what wakes it
        if step_thread:
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
        while not self._stop:
            if not self._tick():
                self._wake.wait(1.0)  # submit, abort and commands wake it
                self._wake.clear()

    async def _step_in_loop(self) -> None:
        """(step_thread=False) The step loop as a task: one step, then the readers of its pieces
        run, then the next; asleep while there is nothing to do."""
        while not self._stop:
            if self._tick():
                await asyncio.sleep(0)
            else:
                await self._kicked.wait()
                self._kicked.clear()

    def _tick(self) -> bool:
        """Commands, then one step if there is work; False when there was nothing to step."""
        self._publish_stats()
        self._drain_commands()
        core = self.core
        if self._stop or not core.has_unfinished():
            return False
        try:
            pieces = core.step()
        except StepError as e:  # that step's requests fail; the engine and the others go on
            self._fail(e.request_ids, e)
            return True
        except BaseException as e:
            if self._thread is None and not isinstance(e, Exception):
                raise  # an interrupt of LLM's caller (Ctrl-C): the engine undid the step and goes on
            # the engine's own failure (restarts spent): fail every request loudly
            log.error("the engine stopped: %s: %s", type(e).__name__, e, exc_info=e)
            self._error = e if isinstance(e, EngineError) else EngineError(
                f"the engine stopped after an internal error ({type(e).__name__}); see the server log")
            # (the event loops add and remove entries meanwhile: copies)
            self._fail(list(self._queues.copy()) + list(self._sinks.copy()), self._error)
            self._fail_commands()
            self._publish_stats(force=True)  # engine_up 0
            self._stop = True
            return False
        self._deliver(pieces)
        return True

    def _kick(self) -> None:
        """Wake the step loop: a request, an abort or a call is queued."""
        self._wake.set()
        if self._thread is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # called outside the loop (an abort from a plain function)
                if self._stepper is not None and not self._stepper.done():
                    self._stepper.get_loop().call_soon_threadsafe(self._kicked.set)
                return
            if self._stepper is None or self._stepper.done():
                if self._stepper is not None and not self._stepper.cancelled():
                    self._stepper.exception()  # (an interrupt ended it: seen)
                self._kicked = asyncio.Event()
                self._stepper = loop.create_task(self._step_in_loop(), name="dspark-engine")
            self._kicked.set()

    def _queued_commands(self):
        """The commands queued now, each taken off the queue as it is handed out."""
        while True:
            try:
                yield self._commands.get_nowait()
            except queue.Empty:
                return

    def _drain_commands(self) -> None:
        for kind, arg in self._queued_commands():
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
                    self._send([(seq.request_id, e if isinstance(e, EngineError) else
                                 EngineError(f"request {seq.request_id} could not be queued: {e}"))])
        elif kind == "call":  # at a step boundary, on the step thread; the caller awaits `done`
            fn, args, done = arg
            try:
                done.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 -- the caller gets it (RequestError: no such version)
                done.set_exception(e)
        elif kind == "abort":
            self._deliver(self.core.abort(arg))

    def _fail_commands(self) -> None:
        """The step thread stops: calls still queued fail instead of waiting forever."""
        for kind, arg in self._queued_commands():
            if kind == "call":
                arg[2].set_exception(EngineError(f"the engine stopped: {self._error}" if self._error is not None
                                                 else "the engine has shut down"))

    def _deliver(self, pieces: list[StreamPiece]) -> None:
        self._send([(p.request_id, p) for p in pieces])

    def _send(self, items: list) -> None:
        """(request id, piece or error) pairs to their readers: one hand-over per event loop per
        step (not one per request), fanned out in that loop."""
        by_loop: dict = {}
        for rid, item in items:
            entry = self._queues.get(rid) or self._sinks.get(rid)
            if entry is not None:
                by_loop.setdefault(entry[0], []).append((rid, item))
        here = self._stepper.get_loop() if self._stepper is not None else None
        for loop, batch in by_loop.items():
            if loop is here:  # stepped in this loop: its readers run right after this step
                self._fan_out(batch)
                continue
            with contextlib.suppress(RuntimeError):  # its loop has closed: nobody is listening
                loop.call_soon_threadsafe(self._fan_out, batch)

    def _fan_out(self, batch: list) -> None:
        """(In the readers' event loop.) Each item to its request's queue or sink."""
        for rid, item in batch:
            entry = self._queues.get(rid)
            if entry is not None:
                entry[1].put_nowait(item)
                continue
            entry = self._sinks.get(rid)
            if entry is not None:
                if _ends(item):
                    del self._sinks[rid]
                entry[1].put(rid, item)

    def _fail(self, request_ids, error: BaseException) -> None:
        """Hand `error` to these requests' readers (their sequences are already finished)."""
        self.core.failed(request_ids)
        self._send([(rid, error) for rid in request_ids])

    def _publish_stats(self, force: bool = False) -> None:
        """stats() to the metrics sink every STATS_EVERY_S, and at once after a restart (the
        state gauges: one source for every sink, see metrics.py)."""
        m = self.metrics
        if m is None:
            return
        now, restarts = time.monotonic(), self.engine.num_restarts
        due = self._stats_at is None or now - self._stats_at >= STATS_EVERY_S
        if force or due or restarts != self._stats_restarts:
            self._stats_at, self._stats_restarts = now, restarts
            try:
                m.set_stats(self.stats())
            except Exception as e:  # noqa: BLE001 -- metrics never stop the engine
                log.warning("metrics: stats unavailable (%s: %s)", type(e).__name__, e)

    # ---- the asyncio API ------------------------------------------------------------------
    def _check_up(self) -> None:
        if self._error is not None:
            raise EngineError(f"the engine stopped after an error: {self._error}")

    def submit(self, prompt, params: Optional[SamplingParams] = None, request_id: Optional[str] = None) -> str:
        """Validate (raises RequestError here) and queue a request; returns its id. Call from the
        event loop's thread; then read its outputs with stream() or result() (or abort it)."""
        return self.submit_many([prompt], [params], [request_id])[0]

    def submit_many(self, prompts, params, request_ids=None, sink=None, resume=None) -> list[str]:
        """Validate every request (the first bad one raises RequestError, and none is queued), then
        queue them together: they join the same step. sink: an object whose put(request_id, item)
        gets each piece (or error) in this event loop, instead of stream()/result(). resume: per
        request, the output tokens it already has (InputProcessor.make_sequence), or None."""
        self._check_up()
        ids = list(request_ids) if request_ids is not None else [None] * len(prompts)
        resume = list(resume) if resume is not None else [None] * len(prompts)
        seqs = [self.engine.inputs.make_sequence(p, sp, rid, done)
                for p, sp, rid, done in zip(prompts, params, ids, resume)]
        seen: set = set()
        for s in seqs:
            rid = s.request_id
            if rid in self._queues or rid in self._sinks or rid in seen:
                raise RequestError(f"request_id: {rid!r} is already in use")
            seen.add(rid)
        loop = asyncio.get_running_loop()
        for s in seqs:
            if sink is None:
                self._queues[s.request_id] = (loop, asyncio.Queue())
            else:
                self._sinks[s.request_id] = (loop, sink)
        self._commands.put(("add", seqs))
        self._kick()
        return [s.request_id for s in seqs]

    def abort(self, request_id: str) -> None:
        """Cancel a request: it leaves the batch at the next step and its KV blocks are freed. One
        nobody reads (submitted, then given up on) has its queue dropped now."""
        if request_id not in self._consumed:
            self._queues.pop(request_id, None)
        self._commands.put(("abort", request_id))
        self._kick()

    async def stream(self, request_id: str) -> AsyncIterator[StreamPiece]:
        """The request's pieces until it finishes; an engine error is raised here. Leaving early
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
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._commands.put(("abort", request_id))  # the consumer went away: free the KV
                self._kick()
            self._consumed.discard(request_id)
            self._queues.pop(request_id, None)

    async def result(self, request_id: str) -> RequestOutput:
        """Wait for the whole output (its pieces folded; their text made in the step thread)."""
        pieces = []
        async with contextlib.aclosing(self.stream(request_id)) as it:
            async for p in it:
                pieces.append(p)
        return request_output(pieces)

    async def generate(self, prompts, params) -> list[RequestOutput]:
        """Validate every prompt, then submit them together (they join the same step) and wait for
        every result; the first failure is raised once all have ended."""
        ids = self.submit_many(prompts, params)
        results = await asyncio.gather(*(self.result(rid) for rid in ids), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return list(results)

    async def call_utility(self, name: str, *args):
        """An admin operation of the engine by name (UTILITIES): rollback_drafter(version),
        resume_drafter(), drafter_status(), set_speculation(enabled), rebalance_now()."""
        where = UTILITIES.get(name)
        if where is None:
            raise RequestError(f"utility: no engine operation named {name!r}; known: {', '.join(UTILITIES)}")
        fn = getattr(self.engine, name)
        if where == "thread":
            return await asyncio.to_thread(fn, *args)
        return await self._on_step_thread(fn, *args)

    async def _on_step_thread(self, fn, *args):
        """fn(*args) on the step thread between two steps; its result (or exception) here."""
        self._check_up()
        if self._stop:
            raise EngineError("the engine has shut down")
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("call", (fn, args, done)))
        self._kick()
        return await asyncio.wrap_future(done)

    async def drain(self) -> None:
        """Process the step in flight (async scheduling: one scheduled past the last requests'
        stop), without scheduling another: for a caller that reads the engine's state next (LLM)."""
        await self._on_step_thread(lambda: self._deliver(self.core.drain()))

    async def run_workload(self, requests, on_finish=None) -> dict:
        """Replay a workload in real time: each request is submitted at its arrival offset.
        Returns per-request metrics, step stats and the wall time."""
        # the run's report and ledger start here (between two steps: the engine is idle)
        usage = await self._on_step_thread(self.engine.start_run)
        start = time.monotonic()
        self.finished = []  # this run's requests, all of them

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
            "config": self.cfg.to_dict(),  # as the engine runs it: `auto` settings resolved where the work runs
            "duration_s": duration,
            "cost": cost,
            "requests": list(self.finished),
            "steps": self.engine.step_record,
            "kv_blocks_total": self.engine.num_blocks * self.engine.num_groups,
            "preemptions": sum(r["num_preemptions"] for r in self.finished),
            "speculative": self.engine.speculative_summary(),
            "compile": self.engine.compile_summary(),  # (the cost ledger above read the workers' reports)
            "experts": self.engine.balancer.summary() if self.engine.balancer is not None else None,
        }

    def state(self) -> tuple[str, Optional[str]]:
        """("ok" | "restarting" | "failed", a reason safe to show clients)."""
        if self._error is not None or (self._thread is not None and not self._thread.is_alive()):
            return "failed", str(self._error or "the engine's step thread is not running")
        if self.engine.restarting:
            return "restarting", "a target worker was lost; the workers are restarting and requests will resume"
        return "ok", None

    def background(self) -> list[dict]:
        """The background parts' heartbeats (heartbeat.py): a drafter group's restart, the
        calibrator, the expert staging (with more than one rank). Constant time."""
        eng = self.engine
        beats = eng.drafter.heartbeats() if eng.drafter is not None else []
        if eng.balancer is not None and eng.balancer.num_ranks > 1:
            beats.append(eng.balancer.heartbeat.snapshot())
        return beats

    def stats(self) -> dict:
        """Constant time (the server's /health and /metrics call it often). `degraded`: the reasons
        of the background parts that stopped progressing; the engine serves on meanwhile (its
        `state` stays ok: /health answers 200 with status "degraded")."""
        eng = self.engine
        state, reason = self.state()
        beats = self.background()
        return {
            "state": state,
            "error": reason,
            "background": beats,
            "degraded": stalled_reasons(beats),
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

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        elif self._stepper is not None and not self._stepper.done():
            with contextlib.suppress(RuntimeError):  # (its loop's owner closes it; it may have)
                self._stepper.get_loop().call_soon_threadsafe(self._stepper.cancel)
        self._fail_commands()
        self.engine.shutdown()
