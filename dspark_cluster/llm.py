"""The public API: `LLM(model, config).generate(prompts, params)` and `.stream(prompt, params)`.

A synchronous client: in process it steps the same `EngineCore` the asynchronous engine runs (in
the caller's thread, until its requests finish); with `executor: ray` it asks the Router actor,
whose AsyncEngine runs that core.
"""

from __future__ import annotations

import os
from typing import Iterator, Optional, Sequence as Seq, Union

from .config import load_config
from .engine import LLMEngine
from .engine_core import EngineCore, request_output
from .errors import RequestError
from .executor import backend
from .outputs import RequestOutput, StreamPiece
from .sampling import SamplingParams

Prompt = Union[str, list[int]]

__all__ = ["LLM", "RequestOutput", "StreamPiece"]


class LLM:
    """Serve a checkpoint. `config`: a YAML path, a dict of overrides nested like the YAML, or a
    Config. `model` (optional) overrides `model.path`."""

    def __init__(self, model: Optional[Union[str, os.PathLike]] = None, config=None):
        overrides = {"model.path": str(model)} if model is not None else None
        self.config = load_config(config, overrides)
        self.engine = None  # executor: local -- the engine runs in this process
        self._core: Optional[EngineCore] = None
        self._remote = None  # executor: ray -- a client of the Router actor that owns the engine
        self.router = None  # (and that actor's handle)
        if self.config.parallel.executor != "local":
            self._remote = backend(self.config.parallel.executor).RouterClient.start(self.config)
            self.router, self.tokenizer = self._remote.handle, self._remote.tokenizer
        else:
            self._core = EngineCore(LLMEngine(self.config))
            self.engine, self.tokenizer = self._core.engine, self._core.tokenizer

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
        core = self._core
        seqs = [self.engine.make_sequence(p, sp) for p, sp in zip(prompts, plist)]  # all validated first
        texts = {s.request_id: [] for s in seqs}
        pending = set(texts)
        try:
            for s in seqs:
                core.add(s)
            while pending:
                for o in core.step():
                    rid = o.event.request_id
                    if rid in texts:
                        texts[rid].append(o.text)
                        if o.event.finished:
                            pending.discard(rid)
        finally:
            for rid in pending:  # a failed step, an interrupt: none of this call's requests is left running
                core.abort(rid)
            core.drain()  # async scheduling: a step scheduled past the last stop token
        return [request_output(s, "".join(texts[s.request_id])) for s in seqs]

    def stream(self, prompt: Prompt, params: Optional[SamplingParams] = None) -> Iterator[StreamPiece]:
        if self._remote is not None:
            yield from self._remote.stream(prompt, params or SamplingParams())
            return
        core = self._core
        seq = self.engine.make_sequence(prompt, params or SamplingParams())
        core.add(seq)
        started = done = False
        try:
            while not done:
                for o in core.step():
                    if o.event.request_id == seq.request_id:
                        yield o.piece(first=not started)
                        started, done = True, o.event.finished
        finally:
            if not done:
                core.abort(seq.request_id)  # the consumer stopped early: free the KV
            core.drain()

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

    # ---- lifecycle -------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = self._core = None
        if self._remote is not None:
            self._remote.shutdown()
            self._remote = self.router = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
