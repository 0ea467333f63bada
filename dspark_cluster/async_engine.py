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
import queue
from collections import deque
import threading
import time
from typing import AsyncIterator, Optional

from .config import Config
from .engine import LLMEngine, TokenEvent
from .errors import DSparkError
from .llm import RequestOutput, StreamPiece, _Detokenizer
from .sampling import SamplingParams
from .sequence import Sequence


class AsyncEngine:
    def __init__(self, cfg: Config, metrics=None):
        self.cfg = cfg
        self.engine = LLMEngine(cfg)
        self.tokenizer = self.engine.tokenizer
        self.metrics = metrics  # optional sink: observe_step(dict), observe_request(Sequence)
        self._commands: "queue.SimpleQueue" = queue.SimpleQueue()
        self._wake = threading.Event()
        self._queues: dict[str, asyncio.Queue] = {}
        self._seqs: dict[str, Sequence] = {}
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._stop = False
        self._error: Optional[BaseException] = None
        # per-request metrics of finished requests, for reports (bounded: a server runs for long)
        self.finished: deque = deque(maxlen=200_000)
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
            try:
                events = eng.step()
            except BaseException as e:  # a dead worker: fail every request loudly, never drop one
                self._error = e
                self._fail_all(e)
                return
            if eng.step_stats and self.metrics is not None:
                self.metrics.observe_step(eng.step_stats[-1])
                if eng.balancer is not None and len(eng.step_stats) % 10 == 0:  # cheap, but not every step
                    self.metrics.observe_experts(eng.balancer.balancedness().tolist(), len(eng.balancer.events))
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
            elif kind == "abort":
                removed = self.engine.abort_request(arg)
                self._deliver([TokenEvent(s.request_id, [], True, "abort", s) for s in removed])

    def _deliver(self, events: list[TokenEvent]) -> None:
        for ev in events:
            if ev.finished:
                self.engine.release(ev.request_id)
                m = dict(request_id=ev.request_id, finish_reason=ev.finish_reason, **ev.seq.metrics())
                self.finished.append(m)
                if self.metrics is not None:
                    self.metrics.observe_request(ev.seq)
            q = self._queues.get(ev.request_id)
            if q is not None and self._loop is not None:
                self._loop.call_soon_threadsafe(q.put_nowait, ev)

    def _fail_all(self, error: BaseException) -> None:
        for rid, q in list(self._queues.items()):
            if self._loop is not None:
                self._loop.call_soon_threadsafe(q.put_nowait, error)

    # ---- the asyncio API ------------------------------------------------------------------
    def submit(self, prompt, params: Optional[SamplingParams] = None, request_id: Optional[str] = None) -> str:
        """Validate (raises RequestError here) and queue a request; returns its id. Call from the
        event loop's thread."""
        if self._error is not None:
            raise DSparkError(f"the engine stopped after an error: {self._error}")
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        seq = self.engine.make_sequence(prompt, params, request_id)
        if seq.request_id in self._queues:
            raise DSparkError(f"request_id {seq.request_id!r} is already in use")
        self._queues[seq.request_id] = asyncio.Queue()
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
        q = self._queues[request_id]
        seq = self._seqs[request_id]
        try:
            while True:
                ev = await q.get()
                if isinstance(ev, BaseException):
                    raise DSparkError(f"request {request_id} failed: {ev}") from ev
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
        start = time.monotonic()
        self.finished.clear()
        first_step = len(self.engine.step_stats)

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
        return {
            "duration_s": time.monotonic() - start,
            "requests": list(self.finished),
            "steps": self.engine.step_stats[first_step:],
            "kv_blocks_total": self.engine.num_blocks * self.engine.num_groups,
            "preemptions": sum(r["num_preemptions"] for r in self.finished),
            "speculative": self.engine.drafter.stats.summary() if self.engine.drafter is not None else None,
            "experts": self.engine.balancer.summary() if self.engine.balancer is not None else None,
        }

    def stats(self) -> dict:
        eng = self.engine
        return {
            **eng.load(),
            "steps": len(eng.step_stats),
            "async_scheduling": eng.async_scheduling,
            "overlapped_steps": sum(1 for s in eng.step_stats if s["overlapped"]),
            "speculation_enabled": eng.scheduler.speculation_enabled,
            "speculative": eng.drafter.stats.summary() if eng.drafter is not None else None,
        }

    def rebalance_now(self) -> None:
        """Ask for an expert rebalance at the next step."""
        self._commands.put(("rebalance", None))
        self._wake.set()

    def set_speculation(self, enabled: bool) -> None:
        """Switch speculative decoding on or off for all requests, from the next step."""
        self._commands.put(("speculation", enabled))
        self._wake.set()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)
        self.engine.shutdown()
