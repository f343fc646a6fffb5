"""The engine for servers: the core on a thread of its own, the output processor on another, both
reached through thread-safe queues (serve's HTTP handlers and the Triton model use it).

The core thread is the only one that touches the core (and so the backend's tensors): callers
submit requests and aborts into `inbox`, each request with a `deliver` callback; the thread runs
`EngineCore.step()` while there is work and puts each step's token ids into `outbox`. The output
thread turns them into text, events and results (engine/output.py) and calls each request's
`deliver` with every update (an HTTP handler's callback hands it to its asyncio queue with
`loop.call_soon_threadsafe`); a request's last update carries its `Result`. When a request's text
reaches a stop string the output thread asks the core to stop it; the tokens the core made
meanwhile are dropped. So detokenizing and matching stop strings never hold up a step.

Both threads are supervised: an exception in either loop (a bug) fails every request in flight
with an error, marks the loop `failed` (the server's /health turns 503 and the process exits
non-zero), and ends the threads; requests submitted afterwards are refused at once. A fault in one
request's output fails that request alone.
"""
from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from snapcompile.engine.engine import Engine
from snapcompile.engine.output import OutputProcessor, Result, TokenEvent, error_result
from snapcompile.engine.request import Request
from snapcompile.errors import SnapcompileError, first_line

log = logging.getLogger("snapcompile.engine")


@dataclass(frozen=True)
class Update:
    """What a caller receives: a token event, and on the last one the request's result."""

    event: TokenEvent
    result: Result | None = None


Deliver = Callable[[Update], None]    # called on the output thread: must not block


class NoMetrics:
    """What EngineLoop reports to (serve/metrics.Metrics has these methods), when nobody listens."""

    def on_event(self, event: TokenEvent, result: Result | None) -> None: ...
    def set_load(self, **gauges) -> None: ...
    def set_sessions(self, store) -> None: ...


class Reporters:
    """Reports to each of `targets` in turn (a server's metrics and its throughput log)."""

    def __init__(self, *targets):
        self.targets = targets

    def on_event(self, event: TokenEvent, result: Result | None) -> None:
        for target in self.targets:
            target.on_event(event, result)

    def set_load(self, **gauges) -> None:
        for target in self.targets:
            target.set_load(**gauges)

    def set_sessions(self, store) -> None:
        for target in self.targets:
            target.set_sessions(store)


class EngineLoop:
    """Owns `engine`'s core on a daemon thread and its output on another; `submit` and `abort` may be
    called from any thread."""

    def __init__(self, engine: Engine, metrics=None):
        self.engine, self.core, self.metrics = engine, engine.core, metrics or NoMetrics()
        self.output = OutputProcessor(engine.tokenizer)
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()     # to the core thread
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()    # to the output thread
        self._deliveries: dict[str, Deliver] = {}              # output thread's
        self._stop = threading.Event()
        self._core_thread = threading.Thread(target=self._run_core, name="snapcompile-engine", daemon=True)
        self._output_thread = threading.Thread(target=self._run_output, name="snapcompile-output", daemon=True)
        self._lock = threading.Lock()
        self._active = 0            # submitted and not yet finished (every thread updates it)
        self.failed: str | None = None   # why the loop stopped, once it has
        self._waiting = 0           # in the core's queue, without a slot (core thread, after each step)

    def start(self) -> None:
        self._core_thread.start()
        self._output_thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self.inbox.put(("wake",))
        self.outbox.put(("wake",))
        self._core_thread.join(timeout)
        self._output_thread.join(timeout)

    # ------------------------------------------------------------- callers' side
    @property
    def active(self) -> int:
        """Requests submitted and not yet finished."""
        return self._active

    @property
    def waiting(self) -> int:
        """Requests not yet given a slot: in the core's queue or still in the inbox."""
        return self._waiting + self.inbox.qsize()

    def submit(self, request: Request, deliver: Deliver) -> None:
        """Queue `request`; `deliver(update)` is called on the output thread for each of its updates
        (on the caller's thread, at once, when the loop has failed)."""
        self.submit_all([(request, deliver)])

    def submit_all(self, pairs: list[tuple[Request, Deliver]]) -> None:
        """Queue (request, deliver) pairs as one item: the core takes them in one go (the samples
        of one request, which share its prefill, are submitted before the core admits any)."""
        with self._lock:            # checked and queued at once: _fail_everything drains under the lock
            failed = self.failed
            if failed is None:
                self._active += len(pairs)
                self.inbox.put(("submit", pairs))
                return
        for request, deliver in pairs:
            deliver(Update(TokenEvent(request.request_id, None, "", True, "error"),
                           error_result(request.request_id, failed)))

    def abort(self, request_id: str) -> None:
        self.inbox.put(("abort", request_id))

    def running_ids(self) -> list[str]:
        """Ids of the requests not yet finished (a copy)."""
        return list(self._deliveries)

    # ------------------------------------------------------------- core thread
    def _run_core(self) -> None:
        try:
            while not self._stop.is_set() and self.failed is None:
                self._take_inbox(block=self.core.scheduler.idle)
                if not self.core.scheduler.idle:
                    self._step()
                self._publish_gauges()
        except BaseException as err:      # a bug outside EngineCore.step: never hang the requests on it
            log.exception("the engine thread failed")
            self.outbox.put(("fail", f"internal error: the engine stopped ({type(err).__name__}: {first_line(err)})"))

    def _step(self) -> None:
        try:
            steps = self.core.step()
        except Exception as err:    # EngineCore.step fails requests, not itself: this is a bug
            log.exception("engine step failed; failing the requests in flight")
            message = f"internal error: {type(err).__name__}: {first_line(err)}"
            steps = [step for seq_id in list(self.core.sequences) for step in self.core.fail(seq_id, message)]
        self._forget_ended(steps)
        self.outbox.put(("steps", steps))

    def _forget_ended(self, steps) -> None:
        for step in steps:
            if step.finished:
                self.core.forget(step.request_id)

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
        elif item[0] in ("abort", "stop"):
            steps = self.core.abort(item[1]) if item[0] == "abort" else self.core.stop(item[1])
            self._forget_ended(steps)
            self.outbox.put(("steps", steps))

    def _submit(self, request: Request, deliver: Deliver) -> None:
        try:
            seq = self.core.submit(request)
        except Exception as err:      # refused: it never entered the core
            if not isinstance(err, SnapcompileError):
                log.exception("submitting %s failed", request.request_id)
            reason = str(err) if isinstance(err, SnapcompileError) else f"internal error: {first_line(err)}"
            self.outbox.put(("refused", request.request_id, deliver, reason))
            return
        self.outbox.put(("add", seq.request, seq.submitted_at, deliver))

    def _publish_gauges(self) -> None:
        scheduler = self.core.scheduler
        in_slots = len(scheduler.decoding) + len(scheduler.prefilling)
        self._waiting = len(scheduler.waiting)
        per_slot = self.core.backend.manifest.kv_bytes_per_slot()
        self.metrics.set_load(running=in_slots, waiting=len(scheduler.waiting), slots_in_use=in_slots,
                              kv_bytes_active=in_slots * per_slot)
        if self.core.sessions is not None:
            self.metrics.set_sessions(self.core.sessions)

    # ------------------------------------------------------------- output thread
    def _run_output(self) -> None:
        """Until stopped: every item the core thread sends, in order. Once the loop failed it only
        answers the requests that still arrive (submitted before the core thread saw the failure)."""
        while True:
            item = self.outbox.get()
            if item[0] == "wake" and self._stop.is_set():
                return
            try:
                if self.failed is None:
                    self._output(item)
                elif item[0] in ("add", "refused"):
                    self._answer_failed(*_request_of(item))
            except BaseException as err:       # a bug outside one request's output
                log.exception("the output thread failed")
                self._fail_everything(f"internal error: the engine's output stopped ({type(err).__name__}: "
                                      f"{first_line(err)})")

    def _output(self, item: tuple) -> None:
        if item[0] == "add":
            _, request, submitted_at, deliver = item
            self._deliveries[request.request_id] = deliver
            self.output.add(request, submitted_at)
        elif item[0] == "refused":
            _, request_id, deliver, reason = item
            self._deliveries[request_id] = deliver
            self._deliver(Update(TokenEvent(request_id, None, "", True, "error"), error_result(request_id, reason)))
        elif item[0] == "steps":
            for step in item[1]:
                self._output_step(step)
        elif item[0] == "fail":
            self._fail_everything(item[1])

    def _output_step(self, step) -> None:
        try:
            processed = self.output.process(step)
        except Exception as err:           # this request's text failed: fail it, not the others
            log.exception("the output of %s failed", step.request_id)
            self.output.requests.pop(step.request_id, None)
            if not step.finished:
                self.inbox.put(("abort", step.request_id))
            message = f"internal error: {type(err).__name__}: {first_line(err)}"
            self._deliver(Update(TokenEvent(step.request_id, None, "", True, "error"),
                                 error_result(step.request_id, message)))
            return
        if processed is None:
            return
        if processed.stop:
            self.inbox.put(("stop", step.request_id))
        self._deliver(Update(processed.event, processed.result))

    def _deliver(self, update: Update) -> None:
        request_id = update.event.request_id
        deliver = self._deliveries.get(request_id)
        if deliver is None:
            return
        if update.result is not None:
            del self._deliveries[request_id]
            with self._lock:
                self._active -= 1
        self.metrics.on_event(update.event, update.result)
        try:
            deliver(update)
        except Exception:                 # a caller's callback must not stop the loop
            log.exception("delivering an update of %s failed", request_id)

    def _fail_everything(self, message: str) -> None:
        """Mark the loop failed, then finish every request it holds (in flight, in either queue)
        with `message`, without trusting the core."""
        with self._lock:            # after this, submit answers new requests itself
            self.failed = message
        pending = dict(self._deliveries)
        self._deliveries.clear()
        for box in (self.inbox, self.outbox):
            while True:
                try:
                    item = box.get_nowait()
                except queue.Empty:
                    break
                if item[0] == "submit":
                    pending.update((request.request_id, deliver) for request, deliver in item[1])
                elif item[0] in ("add", "refused"):
                    pending.update([_request_of(item)])
        for request_id, deliver in pending.items():
            self._answer_failed(request_id, deliver)

    def _answer_failed(self, request_id: str, deliver: Deliver) -> None:
        with self._lock:
            self._active -= 1
        result = error_result(request_id, self.failed)
        event = TokenEvent(request_id, None, "", True, "error")
        self.metrics.on_event(event, result)
        try:
            deliver(Update(event, result))
        except Exception:
            log.exception("delivering the failure of %s failed", request_id)


def _request_of(item: tuple) -> tuple[str, Deliver]:
    """(request id, deliver) of an outbox item that introduces a request ("add" or "refused")."""
    if item[0] == "add":
        return item[1].request_id, item[3]
    return item[1], item[2]
