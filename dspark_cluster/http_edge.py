"""The HTTP server's edge, in front of every route: pure ASGI middlewares (streaming and client
disconnects pass through them untouched) that give each request an id and count it, and refuse a
body over the size limit before anything parses it; and the metrics `/metrics` exports."""

from __future__ import annotations

import contextlib
import uuid
from typing import Optional

from .metrics import EngineMetrics, PrometheusSink, names
from .openai_protocol import APIError

DEFAULT_MAX_BODY_BYTES = 8 * 2**20  # 8 MiB
REQUEST_ID_KEY = "dspark.request_id"  # in the ASGI scope; also the x-request-id response header


def request_id(scope) -> str:
    """The id CountRequests gave this request ("-" outside it)."""
    return scope.get(REQUEST_ID_KEY) or "-"


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


class CountRequests:
    """Pure ASGI middleware (streaming and disconnects pass through untouched): gives each request
    an id (scope[REQUEST_ID_KEY], the `x-request-id` response header, the key to the server log)
    and counts requests by endpoint and status code (499: the client left before any answer)."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = scope[REQUEST_ID_KEY] = f"req-{uuid.uuid4().hex[:20]}"
        path = scope.get("path", "")
        endpoint = path if path in _ENDPOINTS else "other"
        status = {"code": None}

        async def send_status(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", rid.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        except BaseException:
            status["code"] = status["code"] or 500
            raise
        finally:
            self.metrics.requests.labels(endpoint, str(status["code"] or 499)).inc()


class LimitBody:
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

