"""The engine on a thread of its own, reached through a thread-safe queue.

The engine thread is the only one that touches the engine (and so the backend's tensors). Callers
(HTTP handlers, Triton's Python backend) submit requests and aborts into `inbox`, each request with
a `deliver` callback; the thread runs `Engine.step()` while there is work and calls the request's
`deliver` with every update (an HTTP handler's callback hands it to its asyncio queue with
`loop.call_soon_threadsafe`). A request's last update carries its `Result`.

The thread is supervised: an exception anywhere in its loop (a bug) fails every request in flight
with an error, marks the loop `failed` (the server's /health turns 503 and the process exits
non-zero), and ends the thread; requests submitted afterwards are refused at once.
"""
from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from snapcompile.engine.engine import Engine, Result, TokenEvent
from snapcompile.engine.request import Request
from snapcompile.errors import SnapcompileError, first_line
from snapcompile.serve.metrics import Metrics

log = logging.getLogger("snapcompile.serve")


@dataclass(frozen=True)
class Update:
    """What a handler receives: a token event, and on the last one the request's result."""

    event: TokenEvent
    result: Result | None = None


Deliver = Callable[[Update], None]    # called on the engine thread: must not block


class EngineLoop:
    """Owns `engine` on a daemon thread; `submit` and `abort` may be called from any thread."""

    def __init__(self, engine: Engine, metrics: Metrics):
        self.engine, self.metrics = engine, metrics
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._deliveries: dict[str, Deliver] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="snapcompile-engine", daemon=True)
        self._lock = threading.Lock()
        self._active = 0            # submitted and not yet finished (both threads update it)
        self.failed: str | None = None   # why the engine thread stopped, once it has
        self._waiting = 0           # in the engine's queue, without a slot (engine thread, after each step)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self.inbox.put(("wake",))
        self._thread.join(timeout)

    # ------------------------------------------------------------- event-loop side
    @property
    def active(self) -> int:
        """Requests submitted and not yet finished."""
        return self._active

    @property
    def waiting(self) -> int:
        """Requests not yet given a slot: in the engine's queue or still in the inbox."""
        return self._waiting + self.inbox.qsize()

    def submit(self, request: Request, deliver: Deliver) -> None:
        """Queue `request`; `deliver(update)` is called on the engine thread for each of its updates
        (on the caller's thread, at once, when the engine thread has failed)."""
        self.submit_all([(request, deliver)])

    def submit_all(self, pairs: list[tuple[Request, Deliver]]) -> None:
        """Queue (request, deliver) pairs as one item: the engine takes them in one go (the samples
        of one request, which share its prefill, are submitted before the engine admits any)."""
        with self._lock:            # checked and queued at once: _fail_everything drains under the lock
            failed = self.failed
            if failed is None:
                self._active += len(pairs)
                self.inbox.put(("submit", pairs))
                return
        for request, deliver in pairs:
            event = TokenEvent(request.request_id, None, "", True, "error")
            deliver(Update(event, _error_result(request.request_id, failed)))

    def abort(self, request_id: str) -> None:
        self.inbox.put(("abort", request_id))

    def running_ids(self) -> list[str]:
        """Ids of the requests not yet finished (a copy)."""
        return list(self._deliveries)

    # ------------------------------------------------------------- engine thread
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._take_inbox(block=self.engine.scheduler.idle)
                if not self.engine.scheduler.idle:
                    self._step()
                self._publish_gauges()
        except BaseException as err:      # a bug outside Engine.step: never hang the requests on it
            log.exception("the engine thread failed")
            self._fail_everything(f"internal error: the engine stopped ({type(err).__name__}: {first_line(err)})")

    def _step(self) -> None:
        try:
            events = self.engine.step()
        except Exception as err:    # Engine.step fails requests, not itself: this is a bug
            log.exception("engine step failed; failing the requests in flight")
            message = f"internal error: {type(err).__name__}: {first_line(err)}"
            events = [self._fail_event(seq_id, message) for seq_id in list(self._deliveries)]
        for event in events:
            self._deliver(event)

    def _fail_everything(self, message: str) -> None:
        """Mark the loop failed, then finish every request it holds (in flight or in the inbox)
        with `message`, without trusting the engine."""
        pending = dict(self._deliveries)
        with self._lock:            # after this, submit answers new requests itself
            self.failed = message
            while True:
                try:
                    item = self.inbox.get_nowait()
                except queue.Empty:
                    break
                if item[0] == "submit":
                    pending.update((request.request_id, deliver) for request, deliver in item[1])
        self._deliveries.clear()
        for request_id, deliver in pending.items():
            with self._lock:
                self._active -= 1
            result = _error_result(request_id, message)
            event = TokenEvent(request_id, None, "", True, "error")
            self.metrics.on_event(event, result)
            try:
                deliver(Update(event, result))
            except Exception:
                log.exception("delivering the failure of %s failed", request_id)

    def _take_inbox(self, block: bool) -> None:
        try:
            item = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(item)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, item: tuple) -> None:
        if item[0] == "submit":
            for request, deliver in item[1]:
                self._submit(request, deliver)
        elif item[0] == "abort":
            if self.engine.abort(item[1]):
                self._deliver(TokenEvent(item[1], None, "", True, "abort"))

    def _submit(self, request: Request, deliver: Deliver) -> None:
        self._deliveries[request.request_id] = deliver
        try:
            self.engine.submit(request)
        except Exception as err:      # refused: it never entered the engine
            if not isinstance(err, SnapcompileError):
                log.exception("submitting %s failed", request.request_id)
            reason = str(err) if isinstance(err, SnapcompileError) else f"internal error: {first_line(err)}"
            self._deliver(TokenEvent(request.request_id, None, "", True, "error"), refused=reason)

    def _fail_event(self, request_id: str, message: str) -> TokenEvent:
        self.engine.fail(request_id, message)
        return TokenEvent(request_id, None, "", True, "error")

    def _deliver(self, event: TokenEvent, refused: str | None = None) -> None:
        deliver = self._deliveries.get(event.request_id)
        if deliver is None:
            return
        result = None
        if event.finished:
            del self._deliveries[event.request_id]
            result = self._finished_result(event, refused)
        self.metrics.on_event(event, result)
        try:
            deliver(Update(event, result))
        except Exception:                 # a caller's callback must not stop the engine
            log.exception("delivering an update of %s failed", event.request_id)

    def _finished_result(self, event: TokenEvent, refused: str | None) -> Result:
        with self._lock:
            self._active -= 1
        if refused is not None:
            return _error_result(event.request_id, refused)
        result = self.engine.result(event.request_id)
        self.engine.forget(event.request_id)
        return result

    def _publish_gauges(self) -> None:
        scheduler = self.engine.scheduler
        in_slots = len(scheduler.decoding) + len(scheduler.prefilling)
        self._waiting = len(scheduler.waiting)
        per_slot = self.engine.backend.manifest.kv_bytes_per_slot()
        self.metrics.set_load(running=in_slots, waiting=len(scheduler.waiting), slots_in_use=in_slots,
                              kv_bytes_active=in_slots * per_slot)
        if self.engine.sessions is not None:
            self.metrics.set_sessions(self.engine.sessions)


def _error_result(request_id: str, message: str) -> Result:
    """The result of a request that failed before or outside the engine."""
    return Result(request_id, 0, [], "", "error", message, None, 0.0, [])
