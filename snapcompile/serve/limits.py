"""What one client may cost the server: body size and read time, connections (in all and per
address), requests in flight per address, header and send time, and the rate of one noisy log
line. Every bound has a `serve` flag (docs/serving.md, "Limits").

uvicorn times idle keep-alive connections but not a request's head, nor a response its client
stopped reading: a client sending a byte a second, or reading none, would hold its connection (and
a file descriptor, and a streamed request) for ever. `bounded_h11_protocol` gives each connection
`head_timeout_s` from its opening, or from its previous response, to deliver a complete request
head, drops it once its client has let a response wait `send_timeout_s` unread, closes at once
the connections of an address past its share, and, when a new connection finds every one of
`max_connections` taken, closes idle ones (no request running: kept alive, or not yet sent a head),
the longest idle first, so that idle sockets never keep a new client out; uvicorn answers 503 only
when the connections are busy.

A client is its connection's address (an IPv6 one by its /56, a subscriber's usual share). uvicorn
believes X-Forwarded-For only from the proxies `serve --forwarded-allow-ips` names: by default from
none, so that a header cannot make one client many.
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from collections import Counter

from uvicorn.protocols.http.h11_impl import H11Protocol

from snapcompile.errors import SnapcompileError
from snapcompile.serve.bodies import BodyParser
from snapcompile.serve.bounds import ServerLimits
from snapcompile.serve.protocol import ApiError


class PeerBudget:
    """Units (connections, requests) held per client address, at most `limit` each (0: no bound).
    Used from the event loop only."""

    def __init__(self, limit: int):
        self.limit = limit
        self._held: Counter[str] = Counter()

    def take(self, peer: str, units: int = 1) -> bool:
        """Hold `units` more for `peer`; False (nothing held) when that would pass the limit."""
        if self.limit and self._held[peer] + units > self.limit:
            return False
        self._held[peer] += units
        return True

    def give_back(self, peer: str, units: int = 1) -> None:
        self._held[peer] -= units
        if self._held[peer] <= 0:
            del self._held[peer]

    def held(self, peer: str) -> int:
        return self._held[peer]


def bounded_h11_protocol(limits: ServerLimits, connections: PeerBudget) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing connections that do not deliver a request head in time,
    that leave a response unread past the send timeout, or that pass their address's share of
    `connections`."""
    head_timeout_s, send_timeout_s = limits.head_timeout_s, limits.send_timeout_s

    class BoundedH11Protocol(H11Protocol):
        _peer: str | None = None
        _head_timer = _send_timer = None
        idle_since: float | None = None            # monotonic time since no request runs on it, else None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            peer = _peer_address(transport)
            if not connections.take(peer):
                transport.abort()                 # past this address's share: nothing is read from it
                return
            self._peer = peer
            self.idle_since = time.monotonic()
            self._arm_head_timer()
            close_idle_connections(self.connections, limits.max_connections, keep=self)

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None and not self.cycle.response_complete:
                self.idle_since = None
                self._cancel_head_timer()          # a whole head arrived: the request runs

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self.idle_since = time.monotonic()
            self._arm_head_timer()

        def pause_writing(self) -> None:
            super().pause_writing()                # the client reads slower than the response comes
            self._send_timer = self.loop.call_later(send_timeout_s, self._send_timed_out)

        def resume_writing(self) -> None:
            self._cancel(self._send_timer)
            self._send_timer = None
            super().resume_writing()

        def connection_lost(self, exc) -> None:
            self._cancel_head_timer()
            self._cancel(self._send_timer)
            if self._peer is not None:
                connections.give_back(self._peer)
                self._peer = None
            super().connection_lost(exc)

        def _arm_head_timer(self) -> None:
            self._cancel_head_timer()
            self._head_timer = self.loop.call_later(head_timeout_s, self._head_timed_out)

        def _cancel_head_timer(self) -> None:
            self._cancel(self._head_timer)
            self._head_timer = None

        @staticmethod
        def _cancel(timer) -> None:
            if timer is not None:
                timer.cancel()

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
                self.transport.close()

        def _send_timed_out(self) -> None:
            """The unread response is dropped: the request sees its client gone and is aborted."""
            self._send_timer = None
            self.transport.abort()

    return BoundedH11Protocol


def close_idle_connections(open_connections, limit: int, keep) -> int:
    """Close idle connections (those with an `idle_since`), the longest idle first and never `keep`,
    until fewer than `limit` remain open: uvicorn answers 503 to a request that finds `limit`
    connections. Returns how many were closed."""
    if len(open_connections) < limit:          # the common case, in O(1)
        return 0
    live = [c for c in open_connections if not c.transport.is_closing()]
    excess = len(live) - limit + 1
    if excess <= 0:
        return 0
    idle = sorted((c for c in live if c is not keep and getattr(c, "idle_since", None) is not None),
                  key=lambda c: c.idle_since)[:excess]
    for connection in idle:
        connection.transport.close()
    return len(idle)


class PeerRequests:
    """Engine requests in flight per client address, at most `budget.limit` (429 beyond). A route
    takes them with `hold`; this ASGI middleware gives them back when the HTTP request ends,
    however it ends (answered, streamed to its end, failed, or its client gone)."""

    SCOPE_KEY = "snapcompile.peer_requests"

    def __init__(self, app, budget: PeerBudget):
        self.app, self.budget = app, budget

    async def __call__(self, scope, receive, send) -> None:
        try:
            await self.app(scope, receive, send)
        finally:
            held = scope.pop(self.SCOPE_KEY, None)
            if held is not None:
                self.budget.give_back(*held)

    @classmethod
    def hold(cls, budget: PeerBudget, request, units: int) -> None:
        peer = client_of(request.client.host) if request.client else ""
        if 0 < budget.limit < units:
            raise ApiError(400, f"{units} prompts in one request: more than this server runs from one address "
                                f"({budget.limit}, serve --max-requests-per-client)", param="prompt")
        if not budget.take(peer, units):
            raise ApiError(429, f"this client already has {budget.held(peer)} requests in flight; this server "
                                f"runs at most {budget.limit} from one address (serve --max-requests-per-client)",
                           headers={"Retry-After": "1"})
        request.scope[cls.SCOPE_KEY] = (peer, units)


def _peer_address(transport) -> str:
    """The client of a connection (client_of its address; "" for a Unix socket)."""
    peer = transport.get_extra_info("peername")
    return client_of(str(peer[0])) if isinstance(peer, tuple) and peer else ""


def client_of(host: str) -> str:
    """Who a per-client bound counts an address as: an IPv4 address itself (an IPv4-mapped IPv6
    one as IPv4), an IPv6 address by its /56 (what an ISP usually gives one subscriber: 256 /64s)."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 56), strict=False))
    return str(address)


async def read_json_body(request, limits: ServerLimits, bodies: BodyParser):
    """The request's JSON body, checked before any work: 415 unless application/json, 413 past
    max_body_bytes (by Content-Length or while reading), 408 past body_timeout_s, 400 for what
    `bodies` refuses (invalid JSON, nesting, too many values, lone surrogates). The body is parsed
    off the event loop (serve.bodies): its size is the client's, and the event loop serves everyone."""
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
    try:
        return await asyncio.to_thread(bodies.parse, raw)
    except SnapcompileError as err:
        raise ApiError(400, str(err)) from None


async def _read_bounded(request, max_bytes: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise ApiError(413, f"the request body is larger than {max_bytes} bytes (serve --max-body-bytes)")
        chunks.append(chunk)
    return b"".join(chunks)


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
