"""OpenAI-compatible HTTP serving: FastAPI + uvicorn in front of an `EngineClient`.

Routes: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions` (streaming as
server-sent events ending with `data: [DONE]`), `GET /health`, `GET /metrics` (Prometheus).
With an API key every `/v1/*` route needs `Authorization: Bearer <key>`; `/health` and `/metrics`
stay open. Bad input gets a 400 with an OpenAI-style error body and touches nothing else.
A client that goes away (mid-stream or while waiting for a non-streamed answer) cancels its
requests, which frees their KV blocks.

Beyond OpenAI's fields, requests accept (top level or inside `extra_body`): `speculative` (bool,
default true: speculative decoding for this request), `calibrate` (bool, default true: with online
calibration on, this request's verify rounds may teach the drafter), `top_k`, `ignore_eos`,
`stop_token_ids`. Log-probabilities (`logprobs` / `top_logprobs` in chat; `logprobs` and `echo` in
completions, with the prompt's log-probabilities) are of the target's law after temperature, before
top-k / top-p (prompt tokens: temperature 1), computed by the worker that samples. An unknown model
is a 404; `logit_bias`, `suffix`, `tools` and the penalties are refused with a 400.

Admin routes (behind the API key like `/v1/*`): `GET /admin/drafter` (the serving drafter version,
its history and the calibration buffer), `POST /admin/drafter/rollback` with `{"version": N}`
(null or absent: the original weights; the version is then held) and `POST /admin/drafter/resume`
(calibrated versions publish again).

Hardening at the edge: bodies over `max_body_bytes` get a 413 before they are parsed (Content-Length
first, then counted while a chunked body is read); JSON nested deeper than 64 levels, lists longer
than max(max_model_len, 4096), strings UTF-8 cannot carry (lone surrogates) and numbers the engine
cannot represent (seed / top_k / token ids outside int64, non-finite floats) get a 400 naming the
field. Parsing, chat templating and tokenisation run in a small thread pool, so a large request
never stalls `/health` or other streams.
Clients never see internals: an unexpected failure is logged with its request id (also sent as the
`x-request-id` header) and answered with a message naming only the problem; an engine failure is a
503. `/health` is 503 while the engine is restarting or has failed.

    dspark serve [CONFIG] --host 127.0.0.1 --port 8000 --api-key KEY --max-body-mb 8
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import os
import secrets
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Annotated, Any, AsyncIterator, Callable, Literal, Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException
from tokenizers.decoders import DecodeStream

from .client import EngineClient
from .errors import ConfigError, EngineError, RequestError
from .metrics import EngineMetrics, PrometheusSink, names
from .outputs import StreamPiece
from .sampling import INT64_MAX, MAX_LOGPROBS, MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_TOKENS_LIMIT, SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 8 * 2**20  # 8 MiB
MAX_JSON_DEPTH = 64  # nesting levels a request body may have (OpenAI bodies need about 6)
MAX_STOP_TOKEN_IDS = 1024  # checked by the engine on every token
HTTP_THREADS = 4  # the pool that parses, templates and tokenises (off the event loop)
REQUEST_ID_KEY = "dspark.request_id"  # in the ASGI scope; also the x-request-id response header

# errors whose text is ours and safe to show a client; any other exception's text stays in the log
_SAFE_ERRORS = (RequestError, ConfigError, EngineError)

# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------


class APIError(Exception):
    """An error answered with OpenAI's body: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, code: Optional[str] = None, param: Optional[str] = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.type = status, message, code, param, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, headers: Optional[dict] = None) -> JSONResponse:
        headers = dict(headers or {})
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return _AsciiJSON(self.body(), status_code=self.status, headers=headers or None)


class _AsciiJSON(JSONResponse):
    """JSON with every non-ASCII character escaped: a message quoting the client's input cannot
    fail to encode (a lone surrogate is legal in JSON but not in UTF-8)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def _clip(text: str, limit: int = 80) -> str:
    """A client-supplied string, short enough to quote in an error message."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _request_id(scope) -> str:
    return scope.get(REQUEST_ID_KEY) or "-"


def _engine_failure_message(exc: BaseException, request_id: str) -> str:
    """What a client is told when generation fails: our own messages as they are, anything else
    (which may name actors, PIDs, addresses) only as a pointer to the server log."""
    if isinstance(exc, _SAFE_ERRORS):
        return f"generation failed: {exc}"
    return f"generation failed: the engine hit an internal error (request id {request_id}; see the server log); " \
           "retry the request"


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "literal"}


def _param_of(loc) -> Optional[str]:
    """('messages', 0, 'content', 'str') -> 'messages.0.content' (union-branch tags dropped)."""
    parts = []
    for x in loc:
        if isinstance(x, int):
            parts.append(str(x))
        elif isinstance(x, str) and x.isidentifier() and x.lower() not in _TYPE_TAGS and x != "body":
            parts.append(x)
    return ".".join(parts) or None


def _validation_error(errors: list[dict]) -> APIError:
    problems, params = [], []
    for err in errors[:8]:
        param = _param_of(err.get("loc", ()))
        if param not in params:
            params.append(param)
        got = repr(err.get("input"))
        got = got if len(got) <= 60 else got[:57] + "..."
        problems.append(f"{param or 'body'}: {err.get('msg')} (got {got})")
    kind = str(errors[0].get("type", "")) if errors else ""
    code = "invalid_type" if kind.endswith("_type") else "missing_required_parameter" if kind == "missing" else "invalid_value"
    # a union reports one error per branch; the first few say enough
    return APIError(400, "; ".join(problems[:4]), code=code, param=params[0] if params else None)


# ---------------------------------------------------------------------------------------------
# request bodies
# ---------------------------------------------------------------------------------------------

_EXTENSIONS = ("speculative", "calibrate", "top_k", "ignore_eos", "stop_token_ids")


class _Body(BaseModel):
    """Unknown fields are ignored; known ones must have the right JSON type (strict: "5" is not 5);
    floats must be finite (Python's json accepts NaN and Infinity)."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _lift_extra_body(cls, data: Any) -> Any:
        # the openai client merges `extra_body` into the top level; raw clients may nest it
        if isinstance(data, dict) and isinstance(data.get("extra_body"), dict):
            data = {**data["extra_body"], **{k: v for k, v in data.items() if k != "extra_body"}}
        return data


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingFields(_Body):
    model: str
    temperature: Optional[float] = Field(None, ge=0.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=64)
    stop: Union[Annotated[str, Field(max_length=MAX_STOP_CHARS)],
                Annotated[list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]], Field(max_length=MAX_STOP_STRINGS)],
                None] = None
    seed: Optional[int] = Field(None, ge=0, le=INT64_MAX)  # choice i samples with seed + i (checked in parse)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict] = None  # refused unless empty (not applied by this server)
    user: Optional[str] = None
    # extensions (vLLM-style)
    speculative: bool = True
    calibrate: bool = True  # false: this request's verify rounds never teach the drafter (online calibration)
    top_k: Optional[int] = Field(None, ge=0, le=INT64_MAX)  # the engine also refuses top_k > vocabulary
    ignore_eos: bool = False
    stop_token_ids: Optional[list[Annotated[int, Field(ge=0, le=INT64_MAX)]]] = Field(
        None, max_length=MAX_STOP_TOKEN_IDS)


class DrafterRollbackRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    version: Optional[int] = Field(None, ge=0)  # None: the original, uncalibrated weights


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = Field(16, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)  # the top alternatives per token
    echo: bool = False  # the prompt before the completion (with its log-probabilities when logprobs is set)
    suffix: Optional[str] = None
    best_of: Optional[int] = None


class ContentPart(_Body):
    type: str
    text: Optional[str] = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    max_completion_tokens: Optional[int] = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: Optional[list] = None
    response_format: Optional[dict] = None


# ---------------------------------------------------------------------------------------------
# metrics
# ---------------------------------------------------------------------------------------------

_ENDPOINTS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics")


class ServerMetrics(EngineMetrics):
    """What /metrics exports (each name's meaning: metrics.METRICS): the engine's state, set from
    the client's stats() at each scrape, and the HTTP layer's own, in a registry of this server's."""

    def __init__(self):
        super().__init__(PrometheusSink(declare=names("http") + names("state")))
        self.registry = self.sink.registry
        get = self.sink.get
        self.ttft = get("dspark_http_time_to_first_token_seconds")
        self.tpot = get("dspark_http_time_per_output_token_seconds")
        self.e2e = get("dspark_http_request_latency_seconds")
        self.requests = get("dspark_http_requests_total")
        self.finished = get("dspark_http_choices_finished_total")
        self.prompt_tokens = get("dspark_http_prompt_tokens_total")
        self.generation_tokens = get("dspark_http_generation_tokens_total")
        self.streams_open = get("dspark_http_streams_open")


class _CountRequests:
    """Pure ASGI middleware (streaming and disconnects pass through untouched): gives each request
    an id (scope[REQUEST_ID_KEY], the `x-request-id` response header, the key to the server log)
    and counts requests by endpoint and status code (499: the client left before any answer)."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = scope[REQUEST_ID_KEY] = f"req-{uuid.uuid4().hex[:20]}"
        path = scope.get("path", "")
        endpoint = path if path in _ENDPOINTS else "other"
        status = {"code": None}

        async def send_status(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", request_id.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        except BaseException:
            status["code"] = status["code"] or 500
            raise
        finally:
            self.metrics.requests.labels(endpoint, str(status["code"] or 499)).inc()


class _LimitBody:
    """Pure ASGI middleware: a body over `max_bytes` gets a 413 before anything parses it. The
    Content-Length header is checked first; a chunked body is counted while it is read. The body
    is read here (never more than `max_bytes` + one chunk) and handed on in one piece."""

    def __init__(self, app, max_bytes: Optional[int]):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.max_bytes:
            return await self.app(scope, receive, send)
        length = None
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                with contextlib.suppress(ValueError):
                    length = int(value)
        if length is not None and length > self.max_bytes:
            return await self._too_large(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before its body arrived
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await self._too_large(scope, receive, send)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # then disconnects, as the app expects

        await self.app(scope, replay, send)

    async def _too_large(self, scope, receive, send):
        mib = self.max_bytes / 2**20
        err = APIError(413, f"the request body is larger than this server's limit of {mib:g} MiB "
                            f"({self.max_bytes} bytes); send a smaller request", code="request_too_large")
        # no "Connection: close": closing with the rest of the body unread resets the connection, and
        # the client, still sending, may never see this answer; uvicorn reads and drops the rest instead
        await err.response()(scope, receive, send)


# ---------------------------------------------------------------------------------------------
# generation
# ---------------------------------------------------------------------------------------------


@dataclass
class _Job:
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


class _Generation:
    """The choices of one HTTP request: submitted together, streamed (merged) or collected."""

    def __init__(self, client, metrics: ServerMetrics, jobs: list[_Job], arrival: float, n: int):
        self.client, self.metrics, self.jobs, self.arrival, self.n = client, metrics, jobs, arrival, n

    async def _pieces(self, job: _Job) -> AsyncIterator[StreamPiece]:
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

            async def pump(job: _Job):
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

    async def collect(self) -> list[_Job]:
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


class _SSEResponse(StreamingResponse):
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


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


# ---------------------------------------------------------------------------------------------
# parsing untrusted bodies
# ---------------------------------------------------------------------------------------------


def _path(parts) -> Optional[str]:
    return ".".join(_clip(str(p), 40) for p in parts) or None


def _utf8_ok(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate ("\ud800" is legal JSON)
        return False
    return True


def _check_json(data: Any, max_items: int, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Bound the nesting depth and the length of lists, and refuse strings UTF-8 cannot carry,
    naming the field. Iterative: no recursion, whatever the input."""
    stack = [(data, 1, ())]
    while stack:
        node, depth, where = stack.pop()
        if depth > max_depth:
            raise APIError(400, f"the request body nests deeper than {max_depth} levels (at {_path(where)})",
                           code="invalid_json", param=_path(where))
        if isinstance(node, list) and len(node) > max_items:
            raise APIError(400, f"{_path(where) or 'body'}: {len(node)} items; at most {max_items}",
                           code="invalid_value", param=_path(where))
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            if isinstance(key, str) and not _utf8_ok(key):
                raise APIError(400, f"{_path(where) or 'body'}: a key is not valid Unicode (a lone surrogate "
                                    "such as \\ud800); send UTF-8 text", code="invalid_value", param=_path(where))
            if isinstance(value, str):
                if not _utf8_ok(value):
                    param = _path((*where, key))
                    raise APIError(400, f"{param}: not valid Unicode (it holds a lone surrogate such as \\ud800); "
                                        "send UTF-8 text", code="invalid_value", param=param)
            elif isinstance(value, (dict, list)):
                stack.append((value, depth + 1, (*where, key)))


def _load_json(body: bytes) -> dict:
    try:
        data = json.loads(body)
    except RecursionError:
        raise APIError(400, f"the request body nests too deeply; at most {MAX_JSON_DEPTH} levels",
                       code="invalid_json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except ValueError:  # e.g. an integer literal of more than 4300 digits
        raise APIError(400, "the request body holds a number too long to read", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}",
                       code="invalid_type")
    return data


def _truncate_lists(node: Any, keep: int) -> Any:
    """A copy with every list cut to its first `keep` items (the body is at most 64 levels deep)."""
    if isinstance(node, dict):
        return {k: _truncate_lists(v, keep) for k, v in node.items()}
    if isinstance(node, list):
        return [_truncate_lists(v, keep) for v in node[:keep]]
    return node


def _validate(model_cls, data: dict):
    """model_cls.model_validate, with a 400 naming the first problems. Listing every problem of a
    list with hundreds of thousands of bad items takes seconds: past 20,000 problems, the first
    ones are found again in a copy with short lists."""
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        count = e.error_count()
        if count <= 20_000:
            raise _validation_error(e.errors(include_url=False)) from None
    try:
        model_cls.model_validate(_truncate_lists(data, 8))
    except ValidationError as e:
        first = _validation_error(e.errors())
        raise APIError(400, f"{count} problems, among them: {first.message}", code=first.code,
                       param=first.param) from None
    raise APIError(400, f"the request body has {count} invalid values (deep inside a list); check the types "
                        "of the list items", code="invalid_value")


# ---------------------------------------------------------------------------------------------
# the app
# ---------------------------------------------------------------------------------------------


def build_app(client, served_model_name: str, api_key: Optional[str] = None,
              max_model_len: Optional[int] = None, max_body_bytes: Optional[int] = DEFAULT_MAX_BODY_BYTES,
              health_timeout_s: float = 5.0) -> FastAPI:
    """The FastAPI app over `client` (an EngineClient). `max_model_len` defaults to the client's;
    bodies over `max_body_bytes` get a 413 (None or 0: no limit)."""
    max_model_len = int(max_model_len or client.max_model_len)
    metrics = ServerMetrics()
    created = int(time.time())
    pool = ThreadPoolExecutor(max_workers=HTTP_THREADS, thread_name_prefix="dspark-http")

    @contextlib.asynccontextmanager
    async def lifespan(app):
        try:
            yield
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="DSpark Cluster", description="OpenAI-compatible MoE serving", docs_url=None, redoc_url=None,
                  lifespan=lifespan)
    app.state.client, app.state.metrics, app.state.served_model_name = client, metrics, served_model_name
    app.state.max_body_bytes = max_body_bytes
    app.add_middleware(_LimitBody, max_bytes=max_body_bytes)
    app.add_middleware(_CountRequests, metrics=metrics)  # added last: outermost, so it sees the 413s too

    async def off_loop(fn: Callable, *args):
        """CPU work on a request (parsing, chat templates, tokenisation) in the pool, so the event
        loop keeps serving /health and the other streams meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args))

    # ---- errors in OpenAI's shape ----------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return _validation_error(list(exc.errors())).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, str(exc.detail), code=code).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        rid = _request_id(request.scope)
        logger.error("internal error on %s %s (request id %s)", request.method, request.url.path, rid, exc_info=exc)
        return APIError(500, f"internal error (request id {rid}); see the server log", type="server_error",
                        code="internal_error").response(headers={"x-request-id": rid})

    # ---- helpers -----------------------------------------------------------------------------
    def check_auth(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
            msg = "missing API key: send 'Authorization: Bearer <key>'" if not header else "incorrect API key provided"
            raise APIError(401, msg, code="invalid_api_key")

    def parse(body: bytes, model_cls):
        """JSON -> a validated request body (in the pool: big bodies take a while)."""
        data = _load_json(body)
        p = data.get("prompt")
        if isinstance(p, list) and len(p) >= max_model_len and type(p[0]) is int:
            raise too_long(str(len(p)), "prompt")  # token ids: no need to look at each
        _check_json(data, max_items=max(max_model_len, 4096))
        req = _validate(model_cls, data)
        if req.model != served_model_name:
            raise APIError(404, f"the model '{_clip(req.model)}' does not exist; this server serves "
                                f"'{served_model_name}'", code="model_not_found", param="model")
        if req.logit_bias:
            raise APIError(400, "logit_bias: not supported by this server; leave it out", param="logit_bias",
                           code="unsupported_parameter")
        if req.presence_penalty or req.frequency_penalty:
            param = "presence_penalty" if req.presence_penalty else "frequency_penalty"
            raise APIError(400, f"{param}: not supported by this server; leave it at 0", param=param,
                           code="unsupported_parameter")
        if req.seed is not None and req.seed > INT64_MAX - (req.n - 1):
            raise APIError(400, f"seed: {req.seed} with n={req.n}: choice i samples with seed + i, which must stay "
                                f"at most 2**63 - 1; use a seed of at most {INT64_MAX - (req.n - 1)}",
                           param="seed", code="invalid_value")
        return req

    def tokenizer_or_400(what: str):
        tok = client.tokenizer
        if tok is None:
            raise APIError(400, f"{what} needs a tokenizer, but the checkpoint ships none; "
                                "send token ids to /v1/completions instead", param="prompt")
        return tok

    def too_long(n: str, param: str) -> APIError:
        return APIError(
            400,
            f"{param}: {n} tokens, but this model's maximum context length is {max_model_len} "
            "(the prompt plus at least one new token); shorten the prompt",
            code="context_length_exceeded", param=param,
        )

    def encode(tok, text: str, **kw) -> list[int]:
        try:
            return list(tok(text, **kw)["input_ids"])
        except RuntimeError as e:  # a fast tokenizer used from two threads while one reconfigures it
            if "borrow" not in str(e):
                raise
            return list(tok(text, **kw)["input_ids"])

    def tokenize(tok, text: str, param: str, **kw) -> list[int]:
        """Token ids of `text`; a text far over the context length is refused after tokenising
        only its head (a token never spans the cut by more than a few ids; 16 are allowed)."""
        head_chars = max(64 * max_model_len, 1 << 16)
        if len(text) > head_chars:
            head = encode(tok, text[:head_chars], **kw)
            if len(head) >= max_model_len + 16:
                raise too_long(f"more than {len(head) - 16}", param)
        return encode(tok, text, **kw)

    def check_len(ids: list[int], param: str) -> None:
        if not ids:
            raise APIError(400, f"{param}: empty; give at least one token", param=param)
        if len(ids) >= max_model_len:
            raise too_long(str(len(ids)), param)
        if not all(0 <= t <= INT64_MAX for t in ids):  # the engine names those outside its vocabulary
            raise APIError(400, f"{param}: token ids must be in [0, 2**63 - 1]", param=param, code="invalid_value")

    def sampling(req, max_tokens: int, i: int, stops: tuple) -> SamplingParams:
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
        except RequestError as e:
            raise APIError(400, str(e), code="invalid_value") from None

    def engine_failed(exc: BaseException, request: Request, what: str) -> APIError:
        """An exception out of the engine -> a 503 whose message names the problem, not internals."""
        rid = _request_id(request.scope)
        log = logger.warning if isinstance(exc, EngineError) else logger.error
        log("%s failed (request id %s): %s: %s", what, rid, type(exc).__name__, exc,
            exc_info=None if isinstance(exc, EngineError) else exc)
        return APIError(503, _engine_failure_message(exc, rid), type="server_error", code="engine_unavailable")

    async def start(request: Request, req, prompts: list[list[int]], max_tokens: list[int],
                    prefix: str) -> tuple[str, _Generation]:
        """Submit every choice (prompt-major, n per prompt) in one call; a refusal queues none."""
        rid = f"{prefix}-{uuid.uuid4().hex}"
        stops = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        arrival = time.monotonic()
        params = [sampling(req, mt, i, stops) for mt in max_tokens for i in range(req.n)]
        choices = [ids for ids in prompts for _ in range(req.n)]
        engine_ids = [rid] if len(choices) == 1 else [f"{rid}-{index}" for index in range(len(choices))]
        jobs = [_Job(index, engine_id, len(ids)) for index, (engine_id, ids) in enumerate(zip(engine_ids, choices))]
        try:
            await client.submit_many(choices, params, engine_ids)
        except BaseException as e:
            for r in engine_ids:  # (cancelled while the call was on its way: they may be queued)
                client.abort(r)
            if isinstance(e, RequestError):
                raise APIError(400, str(e), code="invalid_value") from None
            if isinstance(e, Exception) and not isinstance(e, APIError):
                raise engine_failed(e, request, f"submitting {rid}") from None
            raise
        metrics.prompt_tokens.inc(sum(len(ids) for ids in prompts))
        return rid, _Generation(client, metrics, jobs, arrival, req.n)

    async def collect_unless_gone(request: Request, gen: _Generation) -> list[_Job]:
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

    async def sse_events(request: Request, gen: _Generation, base: dict, include_usage: bool, chunks, first=()):
        """The SSE body of a streamed completion: `first` choices, then each delta's choices from
        `chunks(index, delta)`, the usage chunk when asked, and [DONE]; an engine error ends it
        with an error event (its message safe to show; the details go to the log)."""
        metrics.streams_open.inc()
        extra = {"usage": None} if include_usage else {}
        try:
            for choice in first:
                yield _sse({**base, "choices": [choice], **extra})
            async with contextlib.aclosing(gen.stream()) as it:
                async for index, d in it:
                    for choice in chunks(index, d):
                        yield _sse({**base, "choices": [choice], **extra})
            if include_usage:
                yield _sse({**base, "choices": [], "usage": gen.usage()})
            yield "data: [DONE]\n\n"
        except Exception as e:  # noqa: BLE001 -- the status line is sent; tell the client in the stream
            yield _sse(engine_failed(e, request, f"streaming {base['id']}").body())
        finally:
            metrics.streams_open.dec()

    # ---- log-probabilities in OpenAI's shapes ------------------------------------------------
    @functools.lru_cache(maxsize=1 << 16)
    def token_str(token_id: int) -> str:
        """A token's text on its own (the alternatives in top_logprobs), decoded once per id."""
        tok = client.tokenizer
        return tok.decode([token_id]) if tok is not None else f"token_id:{token_id}"

    def token_texts():
        """For one choice: ids -> the text each token adds to the choice's text so far (a DecodeStream
        kept across calls, so the pieces concatenate to the text; a token that ends inside a
        multi-byte character adds "", the next one the character)."""
        tok = client.tokenizer
        backend = getattr(tok, "backend_tokenizer", None)  # transformers' fast tokenizers
        if backend is None:
            return lambda ids: [token_str(t) for t in ids]
        stream = DecodeStream(skip_special_tokens=True)
        return lambda ids: [stream.step(backend, t) or "" for t in ids]

    def made_texts(made: Optional[list], own):
        """The tokens' texts as the output path made them (its DecodeStream over the output, where
        the tokens were produced: StreamPiece.token_texts), or else (a slow tokenizer) `own`."""
        return own if made is None else (lambda ids: made)

    def completion_logprobs(texts, token_ids: list[int], entries: list, offset: int = 0) -> dict:
        """/v1/completions' logprobs: tokens, token_logprobs, top_logprobs (the top alternatives and
        the chosen token, as vLLM gives them), text_offset. texts: the choice's token_texts();
        entries: a TokenLogprob per token, None for a prompt's first (nothing predicts it)."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, e, s in zip(token_ids, entries, texts(token_ids)):
            out["tokens"].append(s)
            out["text_offset"].append(offset)
            offset += len(s)
            out["token_logprobs"].append(None if e is None else e.logprob)
            out["top_logprobs"].append(None if e is None else {**{token_str(t): lp for t, lp in e.top}, s: e.logprob})
        return out

    def chat_logprobs(texts, entries: list) -> dict:
        """/v1/chat/completions' logprobs: {"content": [{token, logprob, bytes, top_logprobs}]}."""
        def one(s: str, logprob: float) -> dict:
            return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}

        return {"content": [{**one(s, e.logprob), "top_logprobs": [one(token_str(t), lp) for t, lp in e.top]}
                            for e, s in zip(entries, texts([e.token_id for e in entries]))]}

    # ---- routes ------------------------------------------------------------------------------
    @app.get("/health")
    async def health(request: Request):
        try:
            s = await asyncio.wait_for(client.stats(), timeout=health_timeout_s)
        except Exception as e:  # noqa: BLE001
            logger.warning("health: the engine's stats failed (request id %s): %s: %s", _request_id(request.scope),
                           type(e).__name__, e)
            reason = "the engine did not answer in time" if isinstance(e, asyncio.TimeoutError) \
                else "the engine did not answer; see the server log"
            return _AsciiJSON({"status": "unavailable", "reason": reason}, status_code=503)
        state = str(s.get("state") or "ok")
        if state != "ok":
            reason = s.get("error") or {"restarting": "the engine is restarting after a worker failure",
                                        "failed": "the engine failed and stopped serving"}.get(state, state)
            return _AsciiJSON({"status": state, "reason": _clip(str(reason), 500), "restarts": s.get("restarts", 0)},
                              status_code=503)
        return {"status": "ok", "running": s.get("running"), "waiting": s.get("waiting"),
                "restarts": s.get("restarts", 0)}

    @app.get("/metrics")
    async def prometheus():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        try:
            metrics.set_stats(await asyncio.wait_for(client.stats(), timeout=health_timeout_s))
        except Exception:  # noqa: BLE001 -- an engine that does not answer is down
            metrics.set_up(False)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/admin/drafter")
    async def drafter_status(request: Request):
        check_auth(request)
        return _AsciiJSON(await client.call_utility("drafter_status"))

    @app.post("/admin/drafter/rollback")
    async def drafter_rollback(request: Request):
        check_auth(request)
        body = await request.body()
        req = _validate(DrafterRollbackRequest, _load_json(body) if body.strip() else {})
        try:
            return _AsciiJSON(await client.call_utility("rollback_drafter", req.version))
        except RequestError as e:
            raise APIError(400, str(e), code="invalid_value", param="version") from None

    @app.post("/admin/drafter/resume")
    async def drafter_resume(request: Request):
        check_auth(request)
        try:
            return _AsciiJSON(await client.call_utility("resume_drafter"))
        except RequestError as e:
            raise APIError(400, str(e), code="invalid_value") from None

    def model_card() -> dict:
        return {"id": served_model_name, "object": "model", "created": created, "owned_by": "dspark",
                "root": client.model_path, "max_model_len": max_model_len}

    @app.get("/v1/models")
    async def list_models(request: Request):
        check_auth(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request):
        check_auth(request)
        if model_id != served_model_name:
            raise APIError(404, f"the model '{_clip(model_id)}' does not exist", code="model_not_found", param="model")
        return model_card()

    def prepare_completion(body: bytes) -> tuple[CompletionRequest, list[list[int]]]:
        """(in the pool) the validated request and its prompts as token ids."""
        req: CompletionRequest = parse(body, CompletionRequest)
        if req.suffix is not None:
            raise APIError(400, "suffix: not supported by this server", param="suffix", code="unsupported_parameter")
        if req.best_of not in (None, 1, req.n):
            raise APIError(400, "best_of: not supported by this server (use n)", param="best_of",
                           code="unsupported_parameter")
        p = req.prompt
        num_prompts = len(p) if isinstance(p, list) and p and isinstance(p[0], (str, list)) else 1
        if num_prompts * req.n > 256:
            raise APIError(400, f"{num_prompts} prompts x n={req.n}: at most 256 choices per request", param="n")
        if isinstance(p, str):
            texts = [p]
        elif p and all(isinstance(x, str) for x in p):
            texts = list(p)
        else:
            texts = None
        if texts is not None:
            tok = tokenizer_or_400("a text prompt")
            prompts = [tokenize(tok, t, "prompt" if len(texts) == 1 else f"prompt.{k}") for k, t in enumerate(texts)]
        elif p and isinstance(p[0], list):
            prompts = [list(x) for x in p]
        else:
            prompts = [list(p)]
        for k, ids in enumerate(prompts):
            check_len(ids, "prompt" if len(prompts) == 1 else f"prompt.{k}")
        return req, prompts

    def prompt_text(ids: list[int]) -> str:
        tok = client.tokenizer
        return tok.decode(ids) if tok is not None else ""

    @app.post("/v1/completions")
    async def completions(request: Request):
        check_auth(request)
        req, prompts = await off_loop(prepare_completion, await request.body())
        rid, gen = await start(request, req, prompts, [req.max_tokens or 16] * len(prompts), "cmpl")
        base = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": served_model_name}
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        if req.stream:
            offsets: dict = {}  # choice -> characters of its text sent so far (text_offset)
            texts: dict = {}  # choice -> its token_texts()

            def chunks(index, d):
                text, ids, entries = d.text, [e.token_id for e in d.logprobs or ()], list(d.logprobs or ())
                if req.echo and index not in offsets:  # a choice's first chunk starts with its prompt
                    prompt = prompts[index // req.n]
                    text = prompt_text(prompt) + text
                    ids, entries = prompt + ids, (d.prompt_logprobs or [None] * len(prompt)) + entries
                logprobs = None
                if req.logprobs is not None:
                    own = texts.setdefault(index, token_texts())  # echo: one stream over the prompt, then the output
                    logprobs = completion_logprobs(own if req.echo else made_texts(d.token_texts, own), ids, entries,
                                                   offsets.get(index, 0))
                offsets[index] = offsets.get(index, 0) + len(text)
                reason = d.finish_reason if d.finished else None
                if text or reason is not None or (logprobs and logprobs["tokens"]):
                    yield {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}

            return _SSEResponse(sse_events(request, gen, base, include_usage, chunks))

        jobs = await collect_unless_gone(request, gen)
        choices = []
        for j in jobs:
            prompt = prompts[j.index // req.n]
            head = prompt_text(prompt) if req.echo else ""
            logprobs = None
            if req.logprobs is not None:
                out_ids = [e.token_id for e in j.logprobs]
                logprobs = completion_logprobs(token_texts(), prompt + out_ids,
                                               (j.prompt_logprobs or [None] * len(prompt)) + j.logprobs) \
                    if req.echo else completion_logprobs(made_texts(j.token_texts, token_texts()), out_ids, j.logprobs)
            choices.append({"index": j.index, "text": head + j.text, "logprobs": logprobs,
                            "finish_reason": j.finish_reason})
        return {**base, "choices": choices, "usage": gen.usage()}

    def prepare_chat(body: bytes) -> tuple[ChatCompletionRequest, list[int]]:
        """(in the pool) the validated request and its templated prompt as token ids."""
        req: ChatCompletionRequest = parse(body, ChatCompletionRequest)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs: set logprobs to true to use it", param="top_logprobs",
                           code="invalid_value")
        if req.tools:
            raise APIError(400, "tools: not supported by this server", param="tools", code="unsupported_parameter")
        if req.response_format and req.response_format.get("type", "text") != "text":
            raise APIError(400, "response_format: only {'type': 'text'} is supported", param="response_format",
                           code="unsupported_parameter")
        tok = tokenizer_or_400("chat")
        if not getattr(tok, "chat_template", None):
            raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions with a prompt",
                           param="messages", code="no_chat_template")
        messages = []
        for k, m in enumerate(req.messages):
            content = m.content
            if isinstance(content, list):
                texts = []
                for part in content:
                    if part.type != "text" or part.text is None:
                        raise APIError(400, f"messages.{k}.content: only text parts are supported, "
                                            f"got {_clip(part.type)!r}",
                                       param=f"messages.{k}.content", code="unsupported_content")
                    texts.append(part.text)
                content = "".join(texts)
            msg = {"role": m.role, "content": content or ""}
            if m.name is not None:
                msg["name"] = m.name
            messages.append(msg)
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # noqa: BLE001 -- a template that refuses these messages
            logger.info("the chat template refused a request: %s: %s", type(e).__name__, e)
            raise APIError(400, f"messages: the chat template refused them: {_clip(str(e), 200)}",
                           param="messages") from None
        ids = tokenize(tok, text, "messages", add_special_tokens=False)
        check_len(ids, "messages")
        return req, ids

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        check_auth(request)
        req, ids = await off_loop(prepare_chat, await request.body())
        max_tokens = req.max_completion_tokens or req.max_tokens or (max_model_len - len(ids))
        rid, gen = await start(request, req, [ids], [max_tokens], "chatcmpl")
        base = {"id": rid, "object": "chat.completion.chunk" if req.stream else "chat.completion",
                "created": int(time.time()), "model": served_model_name}
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        if req.stream:
            texts: dict = {}  # choice -> its token_texts()

            def chunks(index, d):
                logprobs = None
                if req.logprobs:
                    logprobs = chat_logprobs(made_texts(d.token_texts, texts.setdefault(index, token_texts())),
                                             d.logprobs or [])
                if d.text or (logprobs and logprobs["content"]):
                    yield {"index": index, "delta": {"content": d.text}, "logprobs": logprobs, "finish_reason": None}
                if d.finished:
                    yield {"index": index, "delta": {}, "logprobs": None, "finish_reason": d.finish_reason}

            role = [{"index": j.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None} for j in gen.jobs]  # the role first, as OpenAI does
            return _SSEResponse(sse_events(request, gen, base, include_usage, chunks, first=role))

        jobs = await collect_unless_gone(request, gen)
        choices = [{"index": j.index, "message": {"role": "assistant", "content": j.text},
                    "logprobs": chat_logprobs(made_texts(j.token_texts, token_texts()), j.logprobs) if req.logprobs
                    else None,
                    "finish_reason": j.finish_reason} for j in jobs]
        return {**base, "choices": choices, "usage": gen.usage()}

    return app


def default_model_name(cfg) -> str:
    return os.path.basename(str(cfg.model.path).rstrip("/")) or "model"


def serve(cfg, host: str = "127.0.0.1", port: int = 8000, api_key: Optional[str] = None,
          served_model_name: Optional[str] = None, log_level: str = "info",
          max_body_bytes: Optional[int] = DEFAULT_MAX_BODY_BYTES) -> None:
    """Start the engine the config asks for (in process or a Router actor) and serve it until
    interrupted; the engine is shut down on the way out."""
    import uvicorn

    if not logging.getLogger("dspark_cluster").handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logging.getLogger("dspark_cluster").addHandler(handler)
        logging.getLogger("dspark_cluster").setLevel(log_level.upper())
    name = served_model_name or default_model_name(cfg)
    client = EngineClient.start(cfg)
    try:
        app = build_app(client, name, api_key=api_key, max_body_bytes=max_body_bytes)
        auth = "on" if api_key else "off"
        limit = f"{max_body_bytes / 2**20:g} MiB" if max_body_bytes else "none"
        print(f"dspark serve: model '{name}' ({cfg.parallel.executor} executor) on http://{host}:{port}/v1 "
              f"(API key {auth}, max_model_len {client.max_model_len}, body limit {limit})", flush=True)
        uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    finally:
        client.shutdown()
