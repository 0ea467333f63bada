"""The public API: `LLM(model, config).generate(prompts, params)` and `.stream(prompt, params)`."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence as Seq, Union

from .config import load_config
from .engine import LLMEngine
from .errors import RequestError
from .executor import backend
from .sampling import SamplingParams

Prompt = Union[str, list[int]]


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: Optional[str]
    metrics: dict = field(default_factory=dict)


@dataclass
class StreamPiece:
    """New tokens of one request, as they are made; the last piece has `finished` set."""

    request_id: str
    token_ids: list[int]
    text: str  # text delta (complete characters only)
    finished: bool = False
    finish_reason: Optional[str] = None


class _Detokenizer:
    """Incremental text: decode the whole output, emit what is new and complete."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.emitted = ""

    def full(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def delta(self, ids, final: bool) -> str:
        text = self.full(ids)
        if not final and text.endswith("\ufffd"):  # a multi-byte character is not complete yet
            return ""
        new, self.emitted = text[len(self.emitted) :], text
        return new


class LLM:
    """Serve a checkpoint. `config`: a YAML path, a dict of overrides nested like the YAML, or a
    Config. `model` (optional) overrides `model.path`."""

    def __init__(self, model: Optional[Union[str, os.PathLike]] = None, config=None):
        overrides = {"model.path": str(model)} if model is not None else None
        self.config = load_config(config, overrides)
        self.engine = None  # executor: local -- the engine runs in this process
        self._remote = None  # executor: ray -- a client of the Router actor that owns the engine
        self.router = None  # (and that actor's handle)
        if self.config.parallel.executor != "local":
            self._remote = backend(self.config.parallel.executor).RouterClient.start(self.config)
            self.router, self.tokenizer = self._remote.handle, self._remote.tokenizer
        else:
            self.engine = LLMEngine(self.config)
            self.tokenizer = self.engine.tokenizer

    # ---- generation ------------------------------------------------------------------------
    def _params_list(self, n, params) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        params = list(params)
        if len(params) != n:
            raise RequestError(f"params: got {len(params)} SamplingParams for {n} prompts; give one or one per prompt")
        return params

    def generate(self, prompts: Union[Prompt, Seq[Prompt]], params=None) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        plist = self._params_list(len(prompts), params)
        if self._remote is not None:
            return self._remote.generate(prompts, plist)
        ids = []
        try:
            for p, sp in zip(prompts, plist):
                ids.append(self.engine.add_request(p, sp))
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        pending = set(ids)
        while pending:
            for ev in self.engine.step():
                if ev.finished:
                    pending.discard(ev.request_id)
        self.engine.drain()  # async scheduling: a step scheduled past the last stop token
        return [self._output(rid) for rid in ids]

    def stream(self, prompt: Prompt, params: Optional[SamplingParams] = None) -> Iterator[StreamPiece]:
        if self._remote is not None:
            yield from self._remote.stream(prompt, params or SamplingParams())
            return
        rid = self.engine.add_request(prompt, params or SamplingParams())
        detok = _Detokenizer(self.tokenizer)
        seq = self.engine.seqs[rid]
        try:
            done = False
            while not done:
                for ev in self.engine.step():
                    if ev.request_id != rid:
                        continue
                    done = ev.finished
                    text = detok.delta(seq.output_token_ids, final=done)
                    yield StreamPiece(rid, ev.new_token_ids, text, done, ev.finish_reason)
        finally:
            if not seq.finished:
                self.engine.abort_request(rid)  # the consumer stopped early: free the KV
            self.engine.drain()
            self.engine.release(rid)

    def _output(self, rid: str) -> RequestOutput:
        seq = self.engine.seqs[rid]
        self.engine.release(rid)
        detok = _Detokenizer(self.tokenizer)
        return RequestOutput(
            request_id=rid,
            prompt_token_ids=seq.token_ids[: seq.num_prompt_tokens],
            token_ids=seq.output_token_ids,
            text=detok.full(seq.output_token_ids),
            finish_reason=seq.finish_reason,
            metrics=seq.metrics(),
        )

    # ---- lifecycle -------------------------------------------------------------------------
    # ---- online drafter calibration ---------------------------------------------------------
    def drafter_status(self) -> dict:
        """The serving drafter version, the history of versions (version, time, rounds trained on,
        shadow score, live tau), the versions held for rollback and the calibrator's buffer."""
        if self._remote is not None:
            return self._remote.drafter_status()
        return self.engine.drafter_status()

    def rollback_drafter(self, version: Optional[int] = None) -> dict:
        """Serve an earlier drafter version from the next step (None: the original, uncalibrated
        weights) and hold it: no calibrated version publishes until resume_drafter(). Returns
        drafter_status(); RequestError for a version the drafters do not hold."""
        if self._remote is not None:
            return self._remote.rollback_drafter(version)
        return self.engine.rollback_drafter(version)

    def resume_drafter(self) -> dict:
        """After rollback_drafter (which holds the version it rolled back to): let calibrated
        versions publish again."""
        if self._remote is not None:
            return self._remote.resume_drafter()
        return self.engine.resume_drafter()

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        if self._remote is not None:
            self._remote.shutdown()
            self._remote = self.router = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
