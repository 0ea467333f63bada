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
field; an explicit `max_tokens` / `max_completion_tokens` that does not fit the context with the
prompt is a 400 naming both numbers (absent: what the context has left, at most 16 in completions).
Parsing, chat templating and tokenisation run in a small thread pool, so a large request never
stalls `/health` or other streams. Below the app (`HTTPLimits`, uvicorn's h11 protocol extended):
a request's head must arrive within `header_timeout_s`, its body within `body_timeout_s` (else the
connection is closed, a body's with a 408), and past `max_connections` a new connection gets a 503
and is closed. Chat messages are text: the tokenizer's control tokens (`<|endoftext|>`,
`<|im_start|>`...) written in a message are tokenised as ordinary text, never as control tokens.
Every body and SSE event is strict JSON (no NaN / Infinity; log-probabilities of impossible tokens
are -9999.0, as vLLM shows them). `GET /openapi.json` is off unless `openapi=True` (`--openapi`),
then behind the API key; `/docs` and `/redoc` are never served.
Clients never see internals: an unexpected failure is logged with its request id (also sent as the
`x-request-id` header) and answered with a message naming only the problem; an engine failure is a
503. `/health` is 503 while the engine is restarting or has failed, and 200 with status "degraded" and
the reason while it serves but a background part (the calibrator, expert staging, a drafter restart)
has not progressed for `parallel.stall_after_s`.

    DSPARK_API_KEY=KEY dspark serve [CONFIG] --host 127.0.0.1 --port 8000 --max-body-mb 8
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from .client import EngineClient
from .errors import RequestError
from .http_edge import DEFAULT_MAX_BODY_BYTES, CountRequests, HTTPLimits, LimitBody, ServerMetrics, request_id
from .openai_generation import SSEResponse, collect_unless_gone, sse_events, start
from .openai_logprobs import LogprobFormat
from .openai_prompts import PromptReader
from .openai_protocol import APIError, AsciiJSON, DrafterRollbackRequest, clip, load_json, validate, validation_error

logger = logging.getLogger(__name__)

HTTP_THREADS = 4  # the pool that parses, templates and tokenises (off the event loop)


def build_app(client, served_model_name: str, api_key: Optional[str] = None,
              max_body_bytes: Optional[int] = DEFAULT_MAX_BODY_BYTES, health_timeout_s: float = 5.0,
              openapi: bool = False) -> FastAPI:
    """The FastAPI app over `client` (an EngineClient); bodies over `max_body_bytes` get a 413
    (None or 0: no limit). The context length is the engine's (client.max_model_len), which its
    InputProcessor enforces on every prompt. openapi: serve the schema at GET /openapi.json, behind
    the API key like /v1/* (off by default: it lists every route, /admin/* included); FastAPI's
    /docs and /redoc pages are never served (they fetch the schema without the key)."""
    max_model_len = int(client.max_model_len)
    metrics = ServerMetrics()
    reader = PromptReader(client, served_model_name, max_model_len)
    lp = LogprobFormat(client)
    created = int(time.time())
    pool = ThreadPoolExecutor(max_workers=HTTP_THREADS, thread_name_prefix="dspark-http")

    @contextlib.asynccontextmanager
    async def lifespan(app):
        try:
            yield
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="DSpark Cluster", description="OpenAI-compatible MoE serving", docs_url=None, redoc_url=None,
                  openapi_url=None, lifespan=lifespan, default_response_class=AsciiJSON)  # AsciiJSON: strict JSON
    app.state.client, app.state.metrics, app.state.served_model_name = client, metrics, served_model_name
    app.state.max_body_bytes = max_body_bytes
    app.add_middleware(LimitBody, max_bytes=max_body_bytes)
    app.add_middleware(CountRequests, metrics=metrics)  # added last: outermost, so it sees the 413s too

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
        return validation_error(list(exc.errors())).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, str(exc.detail), code=code).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        rid = request_id(request.scope)
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

    # ---- routes ------------------------------------------------------------------------------
    @app.get("/health")
    async def health(request: Request):
        try:
            s = await asyncio.wait_for(client.stats(), timeout=health_timeout_s)
        except Exception as e:  # noqa: BLE001
            logger.warning("health: the engine's stats failed (request id %s): %s: %s", request_id(request.scope),
                           type(e).__name__, e)
            reason = "the engine did not answer in time" if isinstance(e, asyncio.TimeoutError) \
                else "the engine did not answer; see the server log"
            return AsciiJSON({"status": "unavailable", "reason": reason}, status_code=503)
        state = str(s.get("state") or "ok")
        if state != "ok":
            reason = s.get("error") or {"restarting": "the engine is restarting after a worker failure",
                                        "failed": "the engine failed and stopped serving"}.get(state, state)
            return AsciiJSON({"status": state, "reason": clip(str(reason), 500), "restarts": s.get("restarts", 0)},
                              status_code=503)
        out = {"status": "ok", "running": s.get("running"), "waiting": s.get("waiting"),
               "restarts": s.get("restarts", 0)}
        degraded = s.get("degraded") or []
        if degraded:  # a background part stopped (heartbeat.py): still serving, so 200 and load balancers route on
            out.update(status="degraded", reason=clip("; ".join(map(str, degraded)), 500))
        return out

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
        return AsciiJSON(await client.call_utility("drafter_status"))

    @app.post("/admin/drafter/rollback")
    async def drafter_rollback(request: Request):
        check_auth(request)
        body = await request.body()
        req = validate(DrafterRollbackRequest, load_json(body) if body.strip() else {})
        try:
            return AsciiJSON(await client.call_utility("rollback_drafter", req.version))
        except RequestError as e:
            raise APIError(400, str(e), code="invalid_value", param="version") from None

    @app.post("/admin/drafter/resume")
    async def drafter_resume(request: Request):
        check_auth(request)
        try:
            return AsciiJSON(await client.call_utility("resume_drafter"))
        except RequestError as e:
            raise APIError(400, str(e), code="invalid_value") from None

    def model_card() -> dict:
        return {"id": served_model_name, "object": "model", "created": created, "owned_by": "dspark",
                "root": client.model_path, "max_model_len": max_model_len}

    if openapi:
        @app.get("/openapi.json", include_in_schema=False)
        async def openapi_schema(request: Request):
            check_auth(request)
            return AsciiJSON(app.openapi())

    @app.get("/v1/models")
    async def list_models(request: Request):
        check_auth(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request):
        check_auth(request)
        if model_id != served_model_name:
            raise APIError(404, f"the model '{clip(model_id)}' does not exist", code="model_not_found", param="model")
        return model_card()


    def prompt_text(ids: list[int]) -> str:
        tok = client.tokenizer
        return tok.decode(ids) if tok is not None else ""

    @app.post("/v1/completions")
    async def completions(request: Request):
        check_auth(request)
        req, prompts = await off_loop(reader.completion, await request.body())
        max_tokens = [reader.max_tokens(req.max_tokens, "max_tokens", len(p), default=16) for p in prompts]
        rid, gen = await start(client, metrics, request, req, prompts, max_tokens, "cmpl")
        base = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": served_model_name}
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        if req.stream:
            offsets: dict = {}  # choice -> characters of its text sent so far (text_offset)
            texts: dict = {}  # choice -> its lp.token_texts()

            def chunks(index, d):
                text, ids, entries = d.text, [e.token_id for e in d.logprobs or ()], list(d.logprobs or ())
                if req.echo and index not in offsets:  # a choice's first chunk starts with its prompt
                    prompt = prompts[index // req.n]
                    text = prompt_text(prompt) + text
                    ids, entries = prompt + ids, (d.prompt_logprobs or [None] * len(prompt)) + entries
                logprobs = None
                if req.logprobs is not None:
                    own = texts.setdefault(index, lp.token_texts())  # echo: one stream over the prompt, then the output
                    logprobs = lp.completion(own if req.echo else lp.made_texts(d.token_texts, own), ids, entries,
                                                   offsets.get(index, 0))
                offsets[index] = offsets.get(index, 0) + len(text)
                reason = d.finish_reason if d.finished else None
                if text or reason is not None or (logprobs and logprobs["tokens"]):
                    yield {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}

            return SSEResponse(sse_events(request, gen, base, include_usage, chunks))

        jobs = await collect_unless_gone(request, gen)
        choices = []
        for j in jobs:
            prompt = prompts[j.index // req.n]
            head = prompt_text(prompt) if req.echo else ""
            logprobs = None
            if req.logprobs is not None:
                out_ids = [e.token_id for e in j.logprobs]
                logprobs = lp.completion(lp.token_texts(), prompt + out_ids,
                                               (j.prompt_logprobs or [None] * len(prompt)) + j.logprobs) \
                    if req.echo else lp.completion(lp.made_texts(j.token_texts, lp.token_texts()), out_ids, j.logprobs)
            choices.append({"index": j.index, "text": head + j.text, "logprobs": logprobs,
                            "finish_reason": j.finish_reason})
        return {**base, "choices": choices, "usage": gen.usage()}


    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        check_auth(request)
        req, ids = await off_loop(reader.chat, await request.body())
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = reader.max_tokens(req.max_completion_tokens or req.max_tokens, param, len(ids))
        rid, gen = await start(client, metrics, request, req, [ids], [max_tokens], "chatcmpl",
                               prompt_param="messages")
        base = {"id": rid, "object": "chat.completion.chunk" if req.stream else "chat.completion",
                "created": int(time.time()), "model": served_model_name}
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        if req.stream:
            texts: dict = {}  # choice -> its lp.token_texts()

            def chunks(index, d):
                logprobs = None
                if req.logprobs:
                    logprobs = lp.chat(lp.made_texts(d.token_texts, texts.setdefault(index, lp.token_texts())),
                                             d.logprobs or [])
                if d.text or (logprobs and logprobs["content"]):
                    yield {"index": index, "delta": {"content": d.text}, "logprobs": logprobs, "finish_reason": None}
                if d.finished:
                    yield {"index": index, "delta": {}, "logprobs": None, "finish_reason": d.finish_reason}

            role = [{"index": j.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None} for j in gen.jobs]  # the role first, as OpenAI does
            return SSEResponse(sse_events(request, gen, base, include_usage, chunks, first=role))

        jobs = await collect_unless_gone(request, gen)
        choices = [{"index": j.index, "message": {"role": "assistant", "content": j.text},
                    "logprobs": lp.chat(lp.made_texts(j.token_texts, lp.token_texts()), j.logprobs) if req.logprobs
                    else None,
                    "finish_reason": j.finish_reason} for j in jobs]
        return {**base, "choices": choices, "usage": gen.usage()}

    return app


def default_model_name(cfg) -> str:
    return os.path.basename(str(cfg.model.path).rstrip("/")) or "model"


def uvicorn_config(app, host: str = "127.0.0.1", port: int = 8000, limits: HTTPLimits = HTTPLimits(),
                   log_level: str = "info"):
    """The uvicorn.Config `serve` runs `app` with: the connection's limits (read deadlines, the
    connection cap: `HTTPLimits`) enforced by uvicorn's h11 protocol, extended."""
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
                          **limits.uvicorn_settings())


def serve(cfg, host: str = "127.0.0.1", port: int = 8000, api_key: Optional[str] = None,
          served_model_name: Optional[str] = None, log_level: str = "info",
          max_body_bytes: Optional[int] = DEFAULT_MAX_BODY_BYTES, limits: HTTPLimits = HTTPLimits(),
          openapi: bool = False) -> None:
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
        app = build_app(client, name, api_key=api_key, max_body_bytes=max_body_bytes, openapi=openapi)
        auth = "on" if api_key else "off"
        limit = f"{max_body_bytes / 2**20:g} MiB" if max_body_bytes else "none"
        print(f"dspark serve: model '{name}' ({cfg.parallel.executor} executor) on http://{host}:{port}/v1 "
              f"(API key {auth}, max_model_len {client.max_model_len}, body limit {limit}, header/body timeouts "
              f"{limits.header_timeout_s:g}/{limits.body_timeout_s:g} s, at most {limits.max_connections} "
              "connections)", flush=True)
        server = uvicorn.Server(uvicorn_config(app, host, port, limits, log_level))
        server.run()
        if not server.started:  # e.g. the port is taken (uvicorn logged why), as uvicorn.run exits
            raise SystemExit(3)
    finally:
        client.shutdown()

