"""EngineCore: the request lifecycle over the engine, in one place: a request is added, stepped,
its pieces made as its tokens are produced (`StreamPiece`: the text its tokens completed, stop
strings ending it in the step that completed them), and on finishing it is released and recorded
(per-request metrics, the metrics sink) once. `AsyncEngine` steps it (in a thread of its own, or
for LLM in the caller's thread) and hands each step's pieces to their readers, in process and in
the Router actor.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Optional

from .engine import LLMEngine
from .errors import StepError
from .outputs import OutputProcessor, StreamPiece, TokenEvent
from .sequence import Sequence

log = logging.getLogger(__name__)

FINISHED_KEPT = 1024  # finished requests' metrics a server keeps for inspection


@dataclass
class _Live:
    """A request added and not finished: its sequence, its output path, whether a piece went out."""

    seq: Sequence
    out: OutputProcessor
    started: bool = False


def _prompt_logprobs(seq: Sequence) -> Optional[list]:
    if seq.params.prompt_logprobs is None:
        return None
    return list(seq.prompt_logprobs or [None] * seq.num_prompt_tokens)  # a one-token prompt has nothing scored


class EngineCore:
    """Not thread-safe: one thread adds, aborts and steps (AsyncEngine's step loop)."""

    def __init__(self, engine: LLMEngine, metrics=None):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.metrics = metrics  # optional sink (metrics.EngineMetrics): observe_step / observe_request / observe_experts
        self._live: dict[str, _Live] = {}
        # per-request metrics of the latest finished requests (bounded: a server runs for long); a
        # workload run records all of its own
        self.finished = deque(maxlen=FINISHED_KEPT)
        self.num_finished = 0

    def add(self, seq: Sequence) -> None:
        """Queue a sequence made by engine.inputs.make_sequence (validated)."""
        self.engine.enqueue(seq)  # raises RequestError for an id in use, before anything is kept
        out = OutputProcessor(self.tokenizer, seq.params.stop, token_texts=seq.params.logprobs is not None)
        resumed = seq.num_output_tokens > 0
        if resumed:  # its reader has the text of these: the next pieces continue after it
            out.add(seq.output_token_ids, final=False)
        self._live[seq.request_id] = _Live(seq, out, started=resumed)

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def step(self) -> list[StreamPiece]:
        """One engine step and the pieces it made. A StepError (that step's requests failed, the
        engine goes on) is raised after recording them; the engine's own failure as it is."""
        eng = self.engine
        steps = eng.num_steps
        try:
            events = eng.step()
        except StepError as e:
            self.failed(e.request_ids)
            raise
        if eng.num_steps != steps and self.metrics is not None:
            self._observe_step()
        return self.process(events)

    def drain(self) -> list[StreamPiece]:
        """The step still in flight (async scheduling), processed without scheduling another."""
        return self.process(self.engine.drain())

    def abort(self, request_id: str, reason: str = "abort") -> list[StreamPiece]:
        """End a request now (no-op for one that has finished); its KV blocks are freed."""
        removed = self.engine.abort_request(request_id, reason)
        return self.process([TokenEvent(s.request_id, [], True, reason, s) for s in removed])

    def process(self, events: list[TokenEvent]) -> list[StreamPiece]:
        """A piece for each event of a request added here: the text its tokens complete; a stop
        string ends its request here, in this step."""
        pieces = []
        for ev in events:
            live = self._live.get(ev.request_id)
            if live is None:  # not added through this core, or already ended: nobody reads it
                continue
            seq = live.seq
            text, stopped = live.out.add(ev.new_token_ids, ev.finished)
            finished, reason = ev.finished, ev.finish_reason
            if stopped:
                if not finished:  # the engine drops it before the next step: no round trip from a client
                    self.engine.abort_request(ev.request_id, "stop")
                seq.finish_reason = reason = "stop"
                finished = True
            logprobs = ev.logprobs
            if logprobs is None and seq.params.logprobs is not None:
                logprobs = []  # asked for: a list on every piece
            piece = StreamPiece(ev.request_id, ev.new_token_ids, text, finished, reason, logprobs,
                                None if live.started else _prompt_logprobs(seq), seq.num_cached_tokens,
                                live.out.token_texts)
            live.started = True
            if finished:
                piece.prompt_token_ids = seq.token_ids[: seq.num_prompt_tokens]
                piece.metrics = seq.metrics()
                self._finish(seq)
            pieces.append(piece)
        return pieces

    def failed(self, request_ids) -> None:
        """Record requests the engine failed (their sequences are finished and released)."""
        for rid in request_ids:
            live = self._live.pop(rid, None)
            self.num_finished += 1
            if live is not None:  # in the report too, with its reason
                seq = live.seq
                self.finished.append(dict(request_id=rid, finish_reason=seq.finish_reason or "error", **seq.metrics()))

    def _finish(self, seq: Sequence) -> None:
        if self._live.pop(seq.request_id, None) is None:
            return  # already recorded
        self.engine.release(seq.request_id)
        self.num_finished += 1
        self.finished.append(dict(request_id=seq.request_id, finish_reason=seq.finish_reason, **seq.metrics(),
                                  output_token_ids=list(seq.output_token_ids)))  # runs compare outputs
        if self.metrics is not None:
            self.metrics.observe_request(seq)

    def _observe_step(self) -> None:
        eng, m = self.engine, self.metrics
        m.observe_step(eng.step_stats[-1])
        if eng.balancer is not None and eng.num_steps % 10 == 0:  # cheap, but not every step
            m.observe_experts(eng.balancer.balancedness().tolist(), len(eng.balancer.events))

    def live_ledger(self) -> Optional[dict]:
        """The cost ledger since start, without the bytes communicated (a call to every worker) and
        with the devices' memory as last read (constant time after the first call); None if it
        cannot be made (/health must answer whatever the ledger does)."""
        try:
            return self.engine.cost_ledger(num_requests=self.num_finished, refresh=False)
        except Exception as e:  # noqa: BLE001
            log.warning("cost ledger unavailable (%s: %s)", type(e).__name__, e)
            return None
