"""One HTTP request's generation: its choices submitted to the engine together, then streamed as
server-sent events (merged in the order they are made) or collected; a client that goes away
cancels them. What the engine refuses becomes a 400; an engine failure a 503 whose message names
the problem, never internals (those go to the log, under the request id)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import StreamingResponse

from .errors import ConfigError, EngineError, PromptError, PromptTooLongError, RequestError
from .http_edge import ServerMetrics, request_id
from .openai_protocol import APIError, ChatCompletionRequest, json_text
from .outputs import StreamPiece
from .sampling import SamplingParams

logger = logging.getLogger(__name__)

# errors whose text is ours and safe to show a client; any other exception's text stays in the log
_SAFE_ERRORS = (RequestError, ConfigError, EngineError)


def engine_failure_message(exc: BaseException, rid: str) -> str:
    """What a client is told when generation fails: our own messages as they are, anything else
    (which may name actors, PIDs, addresses) only as a pointer to the server log."""
    if isinstance(exc, _SAFE_ERRORS):
        return f"generation failed: {exc}"
    return f"generation failed: the engine hit an internal error (request id {rid}; see the server log); " \
           "retry the request"


def engine_failed(exc: BaseException, request: Request, what: str) -> APIError:
    """An exception out of the engine -> a 503 whose message names the problem, not internals."""
    rid = request_id(request.scope)
    log = logger.warning if isinstance(exc, EngineError) else logger.error
    log("%s failed (request id %s): %s: %s", what, rid, type(exc).__name__, exc,
        exc_info=None if isinstance(exc, EngineError) else exc)
    return APIError(503, engine_failure_message(exc, rid), type="server_error", code="engine_unavailable")


def refused(exc: RequestError, prompt_param: str = "prompt") -> APIError:
    """What the engine refused (its InputProcessor checks every prompt: empty, too long for the
    context, ids outside the vocabulary) -> a 400 naming the field the client sent."""
    if isinstance(exc, PromptTooLongError):
        return APIError(400, str(exc), code="context_length_exceeded", param=prompt_param)
    return APIError(400, str(exc), code="invalid_value", param=prompt_param if isinstance(exc, PromptError) else None)


# ---------------------------------------------------------------------------------------------
# generation
# ---------------------------------------------------------------------------------------------


@dataclass
class Job:
    """One choice: an engine request and where its output goes."""

    index: int
    request_id: str
    num_prompt_tokens: int
    logprobs: list = field(default_factory=list)  # a TokenLogprob per output token (when asked)
    token_texts: Optional[list] = field(default_factory=list)  # each one's text, as the output path made it (or None)
    prompt_logprobs: Optional[list] = None  # per prompt token (echo with logprobs)
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    text: str = ""
    num_tokens: int = 0
    finish_reason: Optional[str] = None
    t_first: Optional[float] = None
    t_last: Optional[float] = None


_DONE = object()


class Generation:
    """The choices of one HTTP request: submitted together, streamed (merged) or collected."""

    def __init__(self, client, metrics: ServerMetrics, jobs: list[Job], arrival: float, n: int):
        self.client, self.metrics, self.jobs, self.arrival, self.n = client, metrics, jobs, arrival, n

    async def _pieces(self, job: Job) -> AsyncIterator[StreamPiece]:
        async with contextlib.aclosing(self.client.stream(job.request_id)) as pieces:
            async for p in pieces:
                now = time.monotonic()
                if p.token_ids:
                    job.num_tokens += len(p.token_ids)
                    if job.t_first is None:
                        job.t_first = now
                        self.metrics.ttft.observe(now - self.arrival)
                    job.t_last = now
                job.text += p.text  # stop strings were applied where the tokens were made
                if p.logprobs:
                    job.logprobs += p.logprobs
                    job.token_texts = None if p.token_texts is None or job.token_texts is None \
                        else job.token_texts + p.token_texts
                if p.prompt_logprobs is not None:
                    job.prompt_logprobs = p.prompt_logprobs
                job.cached_tokens = p.num_cached_tokens
                if p.finished:
                    job.finish_reason = p.finish_reason or "stop"
                    if p.finish_reason is None:
                        p = dataclasses.replace(p, finish_reason=job.finish_reason)
                yield p
                if p.finished:
                    return

    def _observe(self) -> None:
        m = self.metrics
        for j in self.jobs:
            m.generation_tokens.inc(j.num_tokens)
            if j.finish_reason is not None:
                m.finished.labels(j.finish_reason).inc()
            if j.t_first is not None and j.num_tokens > 1 and j.finish_reason is not None:
                m.tpot.observe((j.t_last - j.t_first) / (j.num_tokens - 1))
        m.e2e.observe(time.monotonic() - self.arrival)

    async def stream(self) -> AsyncIterator[tuple[int, StreamPiece]]:
        """(choice index, piece) in the order they are made; closing it aborts unfinished choices."""
        try:
            if len(self.jobs) == 1:
                job = self.jobs[0]
                async with contextlib.aclosing(self._pieces(job)) as it:
                    async for d in it:
                        yield job.index, d
                return
            q: asyncio.Queue = asyncio.Queue()

            async def pump(job: Job):
                try:
                    async with contextlib.aclosing(self._pieces(job)) as it:
                        async for d in it:
                            q.put_nowait((job.index, d))
                    q.put_nowait((job.index, _DONE))
                except asyncio.CancelledError:
                    raise
                except BaseException as e:  # noqa: BLE001 -- handed to the consumer
                    q.put_nowait((job.index, e))

            tasks = [asyncio.create_task(pump(j)) for j in self.jobs]
            try:
                remaining = len(tasks)
                while remaining:
                    index, item = await q.get()
                    if item is _DONE:
                        remaining -= 1
                    elif isinstance(item, BaseException):
                        raise item
                    else:
                        yield index, item
            finally:
                for t in tasks:
                    t.cancel()  # each pump's engine stream closes, aborting its request
        finally:
            for j in self.jobs:
                if j.finish_reason is None:
                    self.client.abort(j.request_id)
            self._observe()

    async def collect(self) -> list[Job]:
        async with contextlib.aclosing(self.stream()) as it:
            async for _ in it:
                pass
        return self.jobs

    def usage(self) -> dict:
        seen, prompt, cached = set(), 0, 0
        for j in self.jobs:  # a prompt counts once however many choices it has
            key = j.index // self.n
            if key not in seen:
                seen.add(key)
                prompt += j.num_prompt_tokens
                cached += j.cached_tokens
        completion = sum(j.num_tokens for j in self.jobs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}


class SSEResponse(StreamingResponse):
    """StreamingResponse that always closes its generator: a client gone mid-stream cancels the
    requests even when the generator was paused at a `yield`."""

    def __init__(self, content, **kw):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}, **kw)

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def sse(obj) -> str:
    return f"data: {json_text(obj)}\n\n"



def sampling_params(req, max_tokens: int, i: int, stops: tuple) -> SamplingParams:
    """Choice i's SamplingParams (seed + i) from a validated request body."""
    if isinstance(req, ChatCompletionRequest):
        logprobs, prompt_logprobs = (req.top_logprobs or 0) if req.logprobs else None, None
    else:
        logprobs = req.logprobs
        prompt_logprobs = req.logprobs if req.echo else None
    try:
        return SamplingParams(
            stop=stops,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k or 0,
            seed=None if req.seed is None else req.seed + i,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            speculative=req.speculative,
            calibrate=req.calibrate,
        )
    except RequestError as e:  # the body's fields carry SamplingParams' bounds: not expected
        raise APIError(400, str(e), code="invalid_value") from None


async def start(client, metrics: ServerMetrics, request: Request, req, prompts: list[list[int]],
                max_tokens: list[int], prefix: str, prompt_param: str = "prompt") -> tuple[str, Generation]:
    """Submit every choice (prompt-major, n per prompt) in one call; a refusal queues none."""
    rid = f"{prefix}-{uuid.uuid4().hex}"
    stops = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    arrival = time.monotonic()
    params = [sampling_params(req, mt, i, stops) for mt in max_tokens for i in range(req.n)]
    choices = [ids for ids in prompts for _ in range(req.n)]
    engine_ids = [rid] if len(choices) == 1 else [f"{rid}-{index}" for index in range(len(choices))]
    jobs = [Job(index, engine_id, len(ids)) for index, (engine_id, ids) in enumerate(zip(engine_ids, choices))]
    try:
        await client.submit_many(choices, params, engine_ids)
    except BaseException as e:
        for r in engine_ids:  # (cancelled while the call was on its way: they may be queued)
            client.abort(r)
        if isinstance(e, RequestError):
            raise refused(e, prompt_param) from None
        if isinstance(e, Exception) and not isinstance(e, APIError):
            raise engine_failed(e, request, f"submitting {rid}") from None
        raise
    metrics.prompt_tokens.inc(sum(len(ids) for ids in prompts))
    return rid, Generation(client, metrics, jobs, arrival, req.n)


async def collect_unless_gone(request: Request, gen: Generation) -> list[Job]:
    """Collect the output; if the client disconnects first, cancel (which aborts the requests).
    An engine failure is a 503 with a message safe to show."""
    task = asyncio.ensure_future(gen.collect())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                try:
                    return task.result()
                except RequestError as e:
                    raise APIError(400, str(e), code="invalid_value") from None
                except APIError:
                    raise
                except Exception as e:  # noqa: BLE001 -- the engine failed this request
                    raise engine_failed(e, request, f"generating {gen.jobs[0].request_id}") from None
            if await request.is_disconnected():
                raise APIError(499, "client closed the request", code="client_closed")
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


async def sse_events(request: Request, gen: Generation, base: dict, include_usage: bool, chunks, first=()):
    """The SSE body of a streamed completion: `first` choices, then each delta's choices from
    `chunks(index, delta)`, the usage chunk when asked, and [DONE]; an engine error ends it
    with an error event (its message safe to show; the details go to the log)."""
    gen.metrics.streams_open.inc()
    extra = {"usage": None} if include_usage else {}
    try:
        for choice in first:
            yield sse({**base, "choices": [choice], **extra})
        async with contextlib.aclosing(gen.stream()) as it:
            async for index, d in it:
                for choice in chunks(index, d):
                    yield sse({**base, "choices": [choice], **extra})
        if include_usage:
            yield sse({**base, "choices": [], "usage": gen.usage()})
        yield "data: [DONE]\n\n"
    except Exception as e:  # noqa: BLE001 -- the status line is sent; tell the client in the stream
        yield sse(engine_failed(e, request, f"streaming {base['id']}").body())
    finally:
        gen.metrics.streams_open.dec()
