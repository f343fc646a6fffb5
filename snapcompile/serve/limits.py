"""What one client may cost the server: body size and read time, connections, header time, and the
rate of one noisy log line. Every bound has a `serve` flag (docs/serving.md, "Limits").

uvicorn times idle keep-alive connections but not a request's head: a client sending a byte a
second would hold its connection (and a file descriptor) for ever. `bounded_h11_protocol` gives
each connection `head_timeout_s` from its opening, or from its previous response, to deliver a
complete request head, and closes it otherwise.
"""
from __future__ import annotations

import asyncio
import logging
import time

from uvicorn.protocols.http.h11_impl import H11Protocol

from snapcompile.config import ServerLimits
from snapcompile.errors import JsonTooDeep, SnapcompileError, parse_json
from snapcompile.serve.protocol import ApiError

JSON_MAX_DEPTH = 64         # nesting of a request body (OpenAI's bodies need 4 or 5)


def bounded_h11_protocol(head_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing connections that do not deliver a request head in time."""

    class BoundedH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_head_timer()

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None and not self.cycle.response_complete:
                self._cancel_head_timer()          # a whole head arrived: the request runs

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_head_timer()

        def connection_lost(self, exc) -> None:
            self._cancel_head_timer()
            super().connection_lost(exc)

        def _arm_head_timer(self) -> None:
            self._cancel_head_timer()
            self._head_timer = self.loop.call_later(head_timeout_s, self._head_timed_out)

        def _cancel_head_timer(self) -> None:
            timer = getattr(self, "_head_timer", None)
            if timer is not None:
                timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
                self.transport.close()

    return BoundedH11Protocol


async def read_json_body(request, limits: ServerLimits):
    """The request's JSON body, checked before any work: 415 unless application/json, 413 past
    max_body_bytes (by Content-Length or while reading), 408 past body_timeout_s, 400 for invalid
    JSON, nesting past JSON_MAX_DEPTH, integers too long to convert, or lone surrogates. The body is
    parsed on a worker thread: its size is the client's, and the event loop serves everyone."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type != "application/json":
        raise ApiError(415, "send the request body as JSON with Content-Type: application/json")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limits.max_body_bytes:
        raise ApiError(413, f"the request body has {declared} bytes; this server takes at most "
                            f"{limits.max_body_bytes} (serve --max-body-bytes)")
    try:
        raw = await asyncio.wait_for(_read_bounded(request, limits.max_body_bytes), limits.body_timeout_s)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {limits.body_timeout_s:g} s") from None
    return await asyncio.to_thread(parse_request_json, raw)


async def _read_bounded(request, max_bytes: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise ApiError(413, f"the request body is larger than {max_bytes} bytes (serve --max-body-bytes)")
        chunks.append(chunk)
    return b"".join(chunks)


def parse_request_json(raw: bytes):
    """errors.parse_json with every failure a 400 (never a 500), then the depth and surrogate checks."""
    try:
        value = parse_json(raw, "the request body")
    except JsonTooDeep:
        raise ApiError(400, f"the request body nests deeper than {JSON_MAX_DEPTH} levels") from None
    except SnapcompileError as err:     # invalid JSON, ints past the digit limit
        raise ApiError(400, str(err)) from None
    _check_json_value(value)
    return value


def _check_json_value(value) -> None:
    """Depth at most JSON_MAX_DEPTH and no string that UTF-8 cannot encode (walked without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > JSON_MAX_DEPTH:
            raise ApiError(400, f"the request body nests deeper than {JSON_MAX_DEPTH} levels")
        if isinstance(item, dict):
            stack.extend((k, depth + 1) for k in item)
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise ApiError(400, "the request body holds a lone UTF-16 surrogate (\\ud800-\\udfff), "
                                    "which is not text") from None


class RateLimitedLog(logging.Filter):
    """Let a record through at most once per `interval_s` when its message contains `fragment`
    (asyncio logs "socket.accept() out of system resource" once per refused accept); the count of
    those dropped is added to the next one let through."""

    def __init__(self, fragment: str, interval_s: float = 10.0, clock=time.monotonic):
        super().__init__()
        self.fragment, self.interval_s, self.clock = fragment, interval_s, clock
        self._last, self._dropped = -float("inf"), 0

    def filter(self, record: logging.LogRecord) -> bool:
        if self.fragment not in record.getMessage():
            return True
        now = self.clock()
        if now - self._last < self.interval_s:
            self._dropped += 1
            return False
        if self._dropped:
            record.msg = f"{record.getMessage()} (and {self._dropped} more in the last {self.interval_s:g} s)"
            record.args = ()
        self._last, self._dropped = now, 0
        return True
