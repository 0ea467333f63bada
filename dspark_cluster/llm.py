"""The public API: `LLM(model, config).generate(prompts, params)` and `.stream(prompt, params)`.

A synchronous wrapper over the engine client (client.EngineClient: the in-process engine, or the
Router actor with `executor: ray`), the one the HTTP server uses: each call runs the client's
coroutine on an event loop of LLM's own, in the caller's thread, until it is done. In process the
engine is stepped by that loop (AsyncEngine with step_thread=False): in the caller's thread, only
while a call waits, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import weakref
from typing import Iterator, Optional, Sequence as Seq, Union

from .client import EngineClient
from .config import load_config
from .errors import RequestError
from .outputs import RequestOutput, StreamPiece
from .sampling import SamplingParams

Prompt = Union[str, list[int]]

__all__ = ["LLM", "RequestOutput", "StreamPiece"]


class _Loop:
    """An event loop of LLM's own, run in the caller's thread for the length of each call: the
    in-process engine steps there (where it was built), and only while a call waits for it."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()

    def run(self, coro):
        task = self.loop.create_task(coro)
        try:
            return self.loop.run_until_complete(task)
        except BaseException:
            if not task.done():  # an interrupt (Ctrl-C): let the call clean up (abort its requests)
                task.cancel()
                with contextlib.suppress(BaseException):
                    self.loop.run_until_complete(task)
            raise

    def iterate(self, agen) -> Iterator:
        """A synchronous iterator over an async generator; closing it closes the generator."""
        async def step():
            return await agen.__anext__()

        try:
            while True:
                try:
                    item = self.run(step())
                except StopAsyncIteration:
                    return
                yield item
        finally:
            if not self.loop.is_closed():
                self.run(agen.aclose())

    def close(self) -> None:
        """Cancel what is left on the loop (the engine's step task, a Router client's reader), as
        asyncio.run does, and close it."""
        loop = self.loop
        if loop.is_closed():
            return
        try:
            tasks = asyncio.all_tasks(loop)
            for t in tasks:
                t.cancel()
            if tasks:
                loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        except RuntimeError:  # collected inside another running loop: close it as it is
            pass
        finally:
            loop.close()


def _shutdown(client: EngineClient, loop: _Loop) -> None:
    try:
        client.shutdown()
    finally:
        loop.close()


class LLM:
    """Serve a checkpoint. `config`: a YAML path, a dict of overrides nested like the YAML, or a
    Config. `model` (optional) overrides `model.path`."""

    def __init__(self, model: Optional[Union[str, os.PathLike]] = None, config=None):
        overrides = {"model.path": str(model)} if model is not None else None
        self.config = load_config(config, overrides)
        self._loop = _Loop()
        try:
            self.client = EngineClient.start(self.config, step_thread=False)
        except BaseException:
            self._loop.close()
            raise
        # in process: the engine (LLMEngine) itself
        self.engine = self.client.engine.engine if self.client.engine is not None else None
        # an LLM dropped without shutdown() still stops its engine (or Router) when collected
        self._finalizer = weakref.finalize(self, _shutdown, self.client, self._loop)
        self._finalizer.atexit = False

    @property
    def router(self):
        """On Ray: the Router actor's handle (the current one: a lost Router is replaced); else None."""
        return getattr(self.client, "router", None) if self.client is not None else None

    @property
    def tokenizer(self):
        return self.client.tokenizer

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
        try:
            return self._loop.run(self.client.generate(list(prompts), plist))
        finally:
            self._settle()

    def stream(self, prompt: Prompt, params: Optional[SamplingParams] = None) -> Iterator[StreamPiece]:
        rid = self._loop.run(self.client.submit(prompt, params or SamplingParams()))
        try:
            yield from self._loop.iterate(self.client.stream(rid))  # leaving early aborts the request
        finally:
            self._settle()

    def _settle(self) -> None:
        """In process, a call returns with no step of its requests in flight (async scheduling
        schedules one past the last stop token), so the engine's state is final when read."""
        if self.client is not None and self.client.engine is not None:
            self._loop.run(self.client.engine.drain())

    # ---- admin: online drafter calibration, speculation, balancing ---------------------------
    def call_utility(self, name: str, *args):
        """An admin operation of the engine by name (async_engine.UTILITIES), as the server's
        admin routes call it."""
        return self._loop.run(self.client.call_utility(name, *args))

    def drafter_status(self) -> dict:
        """The serving drafter version, the history of versions (version, time, rounds trained on,
        shadow score, live tau), the versions held for rollback and the calibrator's buffer."""
        return self.call_utility("drafter_status")

    def rollback_drafter(self, version: Optional[int] = None) -> dict:
        """Serve an earlier drafter version from the next step (None: the original, uncalibrated
        weights) and hold it: no calibrated version publishes until resume_drafter(). Returns
        drafter_status(); RequestError for a version the drafters do not hold."""
        return self.call_utility("rollback_drafter", version)

    def resume_drafter(self) -> dict:
        """After rollback_drafter (which holds the version it rolled back to): let calibrated
        versions publish again."""
        return self.call_utility("resume_drafter")

    # ---- lifecycle -------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self.client is not None:
            self._finalizer()  # once: client.shutdown(), then the loop
            self.client = self.engine = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
