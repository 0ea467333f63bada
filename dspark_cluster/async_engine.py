"""AsyncEngine: the engine behind an asyncio API, stepping continuously in its own thread.

Requests join the running batch at the next step and leave it as soon as they finish
(iteration-level scheduling). Callers `submit` (validated at once, in the caller's thread),
then `stream` the pieces or await the `result`. The step thread owns the engine: commands reach it
through a queue, and tokens come back to the event loop with `call_soon_threadsafe`.
The Ray `Router` actor is this class behind a Ray handle; the HTTP server and `dspark run`
use it too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
from collections import deque
import threading
import time
from typing import AsyncIterator, Optional

from .config import Config
from .engine import LLMEngine, TokenEvent
from .errors import EngineError, RequestError, StepError
from .llm import RequestOutput, StreamPiece, _Detokenizer
from .sampling import SamplingParams
from .sequence import Sequence

log = logging.getLogger(__name__)

FINISHED_KEPT = 1024  # finished requests' metrics a server keeps for inspection


class AsyncEngine:
    def __init__(self, cfg: Config, metrics=None):
        self.cfg = cfg
        self.engine = LLMEngine(cfg)
        self.tokenizer = self.engine.tokenizer
        self.metrics = metrics  # optional sink: observe_step(dict), observe_request(Sequence)
        self._commands: "queue.SimpleQueue" = queue.SimpleQueue()
        self._wake = threading.Event()
        # request id -> (the event loop of its caller, its event queue)
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._seqs: dict[str, Sequence] = {}
        self._stop = False
        self._error: Optional[BaseException] = None
        # per-request metrics of the latest finished requests (bounded: a server runs for long); a
        # workload run records all of its own
        self.finished = deque(maxlen=FINISHED_KEPT)
        self.num_finished = 0
        self._ledger_t = 0.0  # when the metrics sink last got the cost ledger
        self._thread = threading.Thread(target=self._run, name="dspark-engine", daemon=True)
        self._thread.start()

    # ---- the step thread ------------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        while not self._stop:
            self._drain_commands()
            if not eng.has_unfinished():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            steps, restarts = eng.num_steps, eng.num_restarts
            try:
                events = eng.step()
            except StepError as e:  # that step's requests fail; the engine and the others go on
                self._fail(e.request_ids, e)
                continue
            except BaseException as e:  # the engine's own failure (restarts spent): fail every request loudly
                log.error("the engine stopped: %s: %s", type(e).__name__, e, exc_info=e)
                self._error = e if isinstance(e, EngineError) else EngineError(
                    f"the engine stopped after an internal error ({type(e).__name__}); see the server log")
                self._fail(list(self._queues), self._error)
                return
            if self.metrics is not None and eng.num_restarts != restarts:
                self.metrics.observe_restarts(eng.num_restarts - restarts)
            if eng.num_steps != steps and self.metrics is not None:
                self.metrics.observe_step(eng.step_stats[-1])
                if eng.balancer is not None and eng.num_steps % 10 == 0:  # cheap, but not every step
                    self.metrics.observe_experts(eng.balancer.balancedness().tolist(), len(eng.balancer.events))
                if time.monotonic() - self._ledger_t > 5.0:  # the cost gauges move slowly
                    self._ledger_t = time.monotonic()
                    ledger = self._live_ledger()
                    if ledger is not None:
                        self.metrics.observe_ledger(ledger)
            self._deliver(events)

    def _drain_commands(self) -> None:
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self.engine.enqueue(arg)
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
                removed = self.engine.abort_request(arg)
                self._deliver([TokenEvent(s.request_id, [], True, "abort", s) for s in removed])

    def _deliver(self, events: list[TokenEvent]) -> None:
        for ev in events:
            if ev.finished:
                self.engine.release(ev.request_id)
                self.num_finished += 1
                m = dict(request_id=ev.request_id, finish_reason=ev.finish_reason, **ev.seq.metrics())
                self.finished.append(m)
                if self.metrics is not None:
                    self.metrics.observe_request(ev.seq)
            self._put(ev.request_id, ev)

    def _fail(self, request_ids, error: BaseException) -> None:
        """Hand `error` to these requests' streams (their sequences are already finished)."""
        for rid in request_ids:
            self.num_finished += 1
            seq = self._seqs.get(rid)
            if seq is not None:  # in the report too, with its reason
                self.finished.append(dict(request_id=rid, finish_reason=seq.finish_reason or "error", **seq.metrics()))
            self._put(rid, error)

    def _put(self, request_id: str, item) -> None:
        entry = self._queues.get(request_id)
        if entry is not None:
            loop, q = entry
            with contextlib.suppress(RuntimeError):  # its loop has closed: nobody is listening
                loop.call_soon_threadsafe(q.put_nowait, item)

    # ---- the asyncio API ------------------------------------------------------------------
    def submit(self, prompt, params: Optional[SamplingParams] = None, request_id: Optional[str] = None) -> str:
        """Validate (raises RequestError here) and queue a request; returns its id. Call from the
        event loop's thread."""
        if self._error is not None:
            raise EngineError(f"the engine stopped after an error: {self._error}")
        seq = self.engine.make_sequence(prompt, params, request_id)
        if seq.request_id in self._queues:
            raise RequestError(f"request_id: {seq.request_id!r} is already in use")
        self._queues[seq.request_id] = (asyncio.get_running_loop(), asyncio.Queue())
        self._seqs[seq.request_id] = seq
        self._commands.put(("add", seq))
        self._wake.set()
        return seq.request_id

    def abort(self, request_id: str) -> None:
        """Cancel a request: it leaves the batch at the next step and its KV blocks are freed."""
        self._commands.put(("abort", request_id))
        self._wake.set()

    async def _events(self, request_id: str) -> AsyncIterator[TokenEvent]:
        """The request's token events until it finishes; an engine error is raised here."""
        _, q = self._queues[request_id]
        seq = self._seqs[request_id]
        try:
            while True:
                ev = await q.get()
                if isinstance(ev, EngineError):  # its message is meant for clients
                    raise ev
                if isinstance(ev, BaseException):
                    raise EngineError(f"request {request_id} failed ({type(ev).__name__}); see the server log") from ev
                yield ev
                if ev.finished:
                    return
        finally:
            if not seq.finished:
                self.abort(request_id)  # the consumer went away: free the KV
            self._queues.pop(request_id, None)
            self._seqs.pop(request_id, None)

    async def stream(self, request_id: str) -> AsyncIterator[StreamPiece]:
        seq = self._seqs[request_id]
        detok = _Detokenizer(self.tokenizer)
        async with contextlib.aclosing(self._events(request_id)) as events:
            async for ev in events:
                text = detok.delta(seq.output_token_ids, final=ev.finished)
                yield StreamPiece(request_id, ev.new_token_ids, text, ev.finished, ev.finish_reason)

    async def result(self, request_id: str) -> RequestOutput:
        """Wait for the whole output; the text is decoded once at the end, not per step."""
        seq = self._seqs[request_id]
        async with contextlib.aclosing(self._events(request_id)) as events:
            async for _ in events:
                pass
        return RequestOutput(
            request_id=request_id,
            prompt_token_ids=seq.token_ids[: seq.num_prompt_tokens],
            token_ids=seq.output_token_ids,
            text=_Detokenizer(self.tokenizer).full(seq.output_token_ids),
            finish_reason=seq.finish_reason,
            metrics=seq.metrics(),
        )

    async def generate(self, prompts, params) -> list[RequestOutput]:
        """Submit all prompts (all validated first), then wait for every result."""
        seqs = []
        for p, sp in zip(prompts, params):
            seqs.append(self.engine.make_sequence(p, sp))  # validate every prompt before queueing any
        ids = [self.submit(s.token_ids, s.params, s.request_id) for s in seqs]
        return list(await asyncio.gather(*(self.result(rid) for rid in ids)))

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
            "cost": self._live_ledger(),
        }

    def _live_ledger(self) -> Optional[dict]:
        """The cost ledger since start, without the bytes communicated (a call to every worker) and
        with the devices' memory as last read (constant time after the first call); None if it
        cannot be made (/health must answer whatever the ledger does)."""
        try:
            return self.engine.cost_ledger(num_requests=self.num_finished, refresh=False)
        except Exception as e:  # noqa: BLE001
            log.warning("cost ledger unavailable (%s: %s)", type(e).__name__, e)
            return None

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
        import concurrent.futures

        done: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("rollback_drafter", (arg, done)))
        self._wake.set()
        return await asyncio.wrap_future(done)

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)
        self.engine.shutdown()
