"""The server's periodic throughput line (at --log-level info), as vLLM prints one: every `interval_s`
while requests run or wait, the prompt tokens prefilled and the tokens generated per second over the
interval, the requests running and waiting, the slots in use and the kept caches' reuse."""
from __future__ import annotations

import logging
import threading
import time

from snapcompile.engine.output import Result, TokenEvent

log = logging.getLogger("snapcompile.serve")
INTERVAL_S = 10.0


class ThroughputLog:
    """An EngineLoop reporter (on_event from the output thread, set_load and set_sessions from the
    engine thread): counts tokens and logs one line an interval in which anything happened."""

    def __init__(self, slots: int, interval_s: float = INTERVAL_S, clock=time.monotonic, logger=log):
        self.slots, self.interval_s, self.clock, self.log = slots, interval_s, clock, logger
        self._lock = threading.Lock()
        self._since = clock()
        self._prefilled = self._generated = 0
        self._load = (0, 0, 0)             # running, waiting, slots in use
        self._reused = 0                   # prompt tokens resumed from kept caches, in all

    def on_event(self, event: TokenEvent, result: Result | None) -> None:
        with self._lock:
            self._generated += event.token_id is not None
            if result is not None:
                self._prefilled += max(result.prompt_tokens - result.cached_tokens, 0)
                self._reused += result.cached_tokens

    def set_load(self, running: int, waiting: int, slots_in_use: int, kv_bytes_active: int) -> None:
        with self._lock:
            self._load = (running, waiting, slots_in_use)
            now = self.clock()
            seconds = now - self._since
            if seconds < self.interval_s:
                return
            busy = self._prefilled or self._generated or running or waiting
            if busy:
                self.log.info("throughput: prompt %.1f tok/s, generation %.1f tok/s; %d running, %d waiting, "
                              "%d of %d slots in use; %d prompt tokens reused from kept caches so far",
                              self._prefilled / seconds, self._generated / seconds, running, waiting,
                              slots_in_use, self.slots, self._reused)
            self._since, self._prefilled, self._generated = now, 0, 0

    def set_sessions(self, store) -> None: ...
