"""The HTTP server's edge, in front of every route: pure ASGI middlewares (streaming and client
disconnects pass through them untouched) that give each request an id and count it, and refuse a
body over the size limit before anything parses it; the connection's own limits, below the app
(`HTTPLimits`, `limited_h11`: read deadlines for a request's head and body, a cap on connections);
and the metrics `/metrics` exports."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import uuid
from typing import Optional

from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import ConfigError
from .metrics import EngineMetrics, PrometheusSink, names
from .openai_protocol import APIError, json_text

logger = logging.getLogger(__name__)

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



# ---------------------------------------------------------------------------------------------
# the connection's limits (below the app: uvicorn reads a request's head before any ASGI code runs)
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HTTPLimits:
    """What one client may hold of the server. A slow client (trickling its headers, or sending a
    body shorter than its Content-Length) is closed when its deadline passes, so each connection
    lives a bounded time unless it is being answered; past `max_connections` a new connection is
    answered 503 and closed at once, so the server's sockets (file descriptors) stay bounded: at
    most max_connections held, plus, for a moment in a burst, the ones accepted and not yet answered
    (measured: 3,000 half-sent bodies at once, 2,210 sockets for ~1 s, then the 1,024 held)."""

    header_timeout_s: float = 10.0  # the request line and headers, from the connection's start (or the last answer)
    body_timeout_s: float = 60.0  # the whole body, from the end of the headers (8 MiB in 60 s: ~140 KB/s)
    keep_alive_s: float = 5.0  # an idle connection between requests (uvicorn's timeout_keep_alive)
    max_connections: int = 1024  # open at once; also bounds requests in flight (uvicorn's limit_concurrency)
    max_header_bytes: int = 16 * 1024  # request line + headers (h11's max_incomplete_event_size)

    def __post_init__(self):
        bad = [f"HTTPLimits.{f.name}: got {getattr(self, f.name)!r}; must be positive"
               for f in dataclasses.fields(self) if not getattr(self, f.name) > 0]
        if bad:
            raise ConfigError(bad)

    def uvicorn_settings(self) -> dict:
        """uvicorn.Config's keywords for these limits (the protocol enforcing the deadlines included)."""
        # limit_concurrency counts connections too, and answers 503 at the limit: one above ours, so
        # every connection we accept is served and it bounds only the requests in flight
        return {"http": limited_h11(self), "timeout_keep_alive": self.keep_alive_s,
                "limit_concurrency": self.max_connections + 1, "h11_max_incomplete_event_size": self.max_header_bytes}


def limited_h11(limits: HTTPLimits) -> type:
    """uvicorn's h11 protocol with `limits` (an `http=` class for uvicorn.Config)."""
    return type("LimitedH11Protocol", (LimitedH11Protocol,), {"limits": limits})


def _raw_response(status: int, reason: str, message: str) -> bytes:
    """A whole HTTP/1.1 answer with an OpenAI-style error body that closes the connection."""
    body = json_text(APIError(status, message, code=reason.lower().replace(" ", "_")).body()).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n")
    return head.encode() + body


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with read deadlines and a connection cap (HTTPLimits). Each request's
    head must arrive within header_timeout_s (counted from the connection's start, or from the end
    of the previous answer), its body within body_timeout_s of the head; a connection that misses a
    deadline is closed (a body's with a 408 first, unless the answer has started). While the request
    is being answered (a long stream) no deadline runs."""

    limits: HTTPLimits = HTTPLimits()

    def connection_made(self, transport: asyncio.Transport) -> None:
        self._deadline: Optional[asyncio.TimerHandle] = None
        self._waiting_for = (None, None)  # (cycle, "head" | "body" | None): what the running deadline is for
        if len(self.connections) >= self.limits.max_connections:  # never held: closed once the answer is written
            logger.debug("refused a connection: %d open, at most %d", len(self.connections),
                         self.limits.max_connections)
            self.transport = transport
            transport.write(_raw_response(503, "Service Unavailable", f"this server holds at most "
                                          f"{self.limits.max_connections} connections; retry later"))
            transport.close()
            return
        super().connection_made(transport)
        self._check_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._check_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._check_deadline()

    def connection_lost(self, exc) -> None:
        self._cancel_deadline()
        super().connection_lost(exc)

    def _stage(self):
        """What the connection waits for from the client: the next head, the body, or nothing."""
        c = self.cycle
        if c is None or c.response_complete:
            return "head"
        return "body" if c.more_body and not c.disconnected else None

    def _check_deadline(self) -> None:
        if self.transport.is_closing():
            return self._cancel_deadline()
        waiting = (self.cycle, self._stage())
        if waiting[0] is self._waiting_for[0] and waiting[1] == self._waiting_for[1]:
            return  # the same wait: its deadline keeps running
        self._cancel_deadline()
        self._waiting_for = waiting
        if waiting[1] is not None:
            timeout = self.limits.header_timeout_s if waiting[1] == "head" else self.limits.body_timeout_s
            self._deadline = self.loop.call_later(timeout, self._expired, waiting[1], timeout)

    def _cancel_deadline(self) -> None:
        deadline, self._deadline = getattr(self, "_deadline", None), None
        if deadline is not None:
            deadline.cancel()

    def _expired(self, stage: str, timeout: float) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        logger.debug("closed the connection from %s: its request %s did not arrive within %g s", self.client,
                     stage, timeout)
        c = self.cycle
        if stage == "body" and c is not None and not c.response_started:
            c.response_started = c.response_complete = True  # the app's answer, if it makes one, is dropped
            self.transport.write(_raw_response(408, "Request Timeout", f"the request body did not arrive within "
                                               f"{timeout:g} s of its headers; send it faster, or a smaller one"))
        if c is not None:
            c.disconnected = True  # the app's receive() answers http.disconnect
            c.message_event.set()
        self.transport.close()
