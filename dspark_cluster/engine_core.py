"""EngineCore: the request lifecycle over the engine, in one place for both of its drivers.

`AsyncEngine` steps it in a thread of its own and hands each request's outputs to its asyncio
queue; `LLM` steps it in the caller's thread until its requests finish. Either way a request is
added, stepped, its text made as its tokens are produced (`OutputProcessor`: incremental
detokenisation, stop strings ending it in the step that completed them), and on finishing it is
released and recorded (per-request metrics, the metrics sink) once.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Optional

from .engine import LLMEngine
from .errors import StepError
from .outputs import OutputProcessor, RequestOutput, StreamPiece, TokenEvent
from .sequence import Sequence

log = logging.getLogger(__name__)

FINISHED_KEPT = 1024  # finished requests' metrics a server keeps for inspection


@dataclass
class Output:
    """What one step gave one request: the engine's event and the text its tokens completed."""

    event: TokenEvent
    text: str

    def piece(self, first: bool = False) -> StreamPiece:
        """first: the request's first piece, which carries its prompt log-probabilities (if asked)."""
        ev = self.event
        return StreamPiece(ev.request_id, ev.new_token_ids, self.text, ev.finished, ev.finish_reason, ev.logprobs,
                           _prompt_logprobs(ev.seq) if first else None, ev.seq.num_cached_tokens)


def _prompt_logprobs(seq: Sequence) -> Optional[list]:
    if seq.params.prompt_logprobs is None:
        return None
    return list(seq.prompt_logprobs or [None] * seq.num_prompt_tokens)  # a one-token prompt has nothing scored


def request_output(seq: Sequence, text: str) -> RequestOutput:
    return RequestOutput(request_id=seq.request_id, prompt_token_ids=seq.token_ids[: seq.num_prompt_tokens],
                         token_ids=seq.output_token_ids, text=text, finish_reason=seq.finish_reason,
                         metrics=seq.metrics(),
                         logprobs=list(seq.output_logprobs) if seq.params.logprobs is not None else None,
                         prompt_logprobs=_prompt_logprobs(seq))


class EngineCore:
    """Not thread-safe: one thread adds, aborts and steps (AsyncEngine's step thread, or LLM's caller)."""

    def __init__(self, engine: LLMEngine, metrics=None):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.metrics = metrics  # optional sink: observe_step / observe_request / observe_experts / observe_ledger
        self._live: dict[str, tuple[Sequence, OutputProcessor]] = {}  # requests added and not finished
        # per-request metrics of the latest finished requests (bounded: a server runs for long); a
        # workload run records all of its own
        self.finished = deque(maxlen=FINISHED_KEPT)
        self.num_finished = 0
        self._ledger_t = 0.0  # when the metrics sink last got the cost ledger

    def add(self, seq: Sequence) -> None:
        """Queue a sequence made by engine.make_sequence (validated)."""
        self.engine.enqueue(seq)  # raises RequestError for an id in use, before anything is kept
        self._live[seq.request_id] = (seq, OutputProcessor(self.tokenizer, seq.params.stop))

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def step(self) -> list[Output]:
        """One engine step and what it gave each request. A StepError (that step's requests failed,
        the engine goes on) is raised after recording them; the engine's own failure as it is."""
        eng = self.engine
        steps, restarts = eng.num_steps, eng.num_restarts
        try:
            events = eng.step()
        except StepError as e:
            self.failed(e.request_ids)
            raise
        finally:
            if self.metrics is not None and eng.num_restarts != restarts:
                self.metrics.observe_restarts(eng.num_restarts - restarts)
        if eng.num_steps != steps and self.metrics is not None:
            self._observe_step()
        return self.process(events)

    def drain(self) -> list[Output]:
        """The step still in flight (async scheduling), processed without scheduling another."""
        return self.process(self.engine.drain())

    def abort(self, request_id: str, reason: str = "abort") -> list[Output]:
        """End a request now (no-op for one that has finished); its KV blocks are freed."""
        removed = self.engine.abort_request(request_id, reason)
        return self.process([TokenEvent(s.request_id, [], True, reason, s) for s in removed])

    def process(self, events: list[TokenEvent]) -> list[Output]:
        """Text for each event's tokens; a stop string ends its request here, in this step."""
        outputs = []
        for ev in events:
            live = self._live.get(ev.request_id)
            text = ""
            if live is not None:
                text, stopped = live[1].add(ev.new_token_ids, ev.finished)
                if stopped:
                    if not ev.finished:  # the engine drops it before the next step: no round trip from a client
                        self.engine.abort_request(ev.request_id, "stop")
                    ev.seq.finish_reason = "stop"
                    ev = TokenEvent(ev.request_id, ev.new_token_ids, True, "stop", ev.seq, ev.logprobs)
            if ev.finished:
                self._finish(ev.seq)
            outputs.append(Output(ev, text))
        return outputs

    def failed(self, request_ids) -> None:
        """Record requests the engine failed (their sequences are finished and released)."""
        for rid in request_ids:
            live = self._live.pop(rid, None)
            self.num_finished += 1
            if live is not None:  # in the report too, with its reason
                seq = live[0]
                self.finished.append(dict(request_id=rid, finish_reason=seq.finish_reason or "error", **seq.metrics()))

    def _finish(self, seq: Sequence) -> None:
        if self._live.pop(seq.request_id, None) is None:
            return  # not added through this core (or already recorded)
        self.engine.release(seq.request_id)
        self.num_finished += 1
        self.finished.append(dict(request_id=seq.request_id, finish_reason=seq.finish_reason, **seq.metrics()))
        if self.metrics is not None:
            self.metrics.observe_request(seq)

    def _observe_step(self) -> None:
        eng, m = self.engine, self.metrics
        m.observe_step(eng.step_stats[-1])
        if eng.balancer is not None and eng.num_steps % 10 == 0:  # cheap, but not every step
            m.observe_experts(eng.balancer.balancedness().tolist(), len(eng.balancer.events))
        if time.monotonic() - self._ledger_t > 5.0:  # the cost gauges move slowly
            self._ledger_t = time.monotonic()
            ledger = self.live_ledger()
            if ledger is not None:
                m.observe_ledger(ledger)

    def live_ledger(self) -> Optional[dict]:
        """The cost ledger since start, without the bytes communicated (a call to every worker) and
        with the devices' memory as last read (constant time after the first call); None if it
        cannot be made (/health must answer whatever the ledger does)."""
        try:
            return self.engine.cost_ledger(num_requests=self.num_finished, refresh=False)
        except Exception as e:  # noqa: BLE001
            log.warning("cost ledger unavailable (%s: %s)", type(e).__name__, e)
            return None
