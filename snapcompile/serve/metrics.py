"""Prometheus metrics of the server, all prefixed `snapcompile_` (prometheus_client, one registry
per server so that several can live in one process)."""
from __future__ import annotations

import time
from dataclasses import replace

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from snapcompile.engine.output import Result, TokenEvent
from snapcompile.sessions.store import SessionStore, StoreCounters

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    """Counters, gauges and latency histograms; `on_event` is called by the engine thread."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("snapcompile_requests", "Finished requests by outcome "
                                "(stop, length, error, abort, rejected)", ["outcome"], registry=r)
        self.running = Gauge("snapcompile_requests_running", "Requests holding a slot", registry=r)
        self.waiting = Gauge("snapcompile_requests_waiting", "Requests waiting for a slot", registry=r)
        self.slots = Gauge("snapcompile_slots_in_use", "Decode slots in use", registry=r)
        self.slots_total = Gauge("snapcompile_slots", "Decode slots of the engine", registry=r)
        self.kv_active = Gauge("snapcompile_kv_cache_bytes_active", "KV cache bytes of the slots in use", registry=r)
        self.kv_total = Gauge("snapcompile_kv_cache_bytes", "KV cache bytes allocated (all slots)", registry=r)
        self.prompt_tokens = Counter("snapcompile_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("snapcompile_generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("snapcompile_time_to_first_token_seconds", "Submission to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("snapcompile_inter_token_latency_seconds", "Time between two tokens of a request",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("snapcompile_e2e_request_latency_seconds", "Submission to last token",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.session_hits = Counter("snapcompile_session_cache_hits", "Requests resumed from a kept cache",
                                    registry=r)
        self.session_misses = Counter("snapcompile_session_cache_misses", "Requests prefilled whole: no kept "
                                      "cache matched", registry=r)
        self.session_tokens = Counter("snapcompile_session_cache_reused_tokens", "Prompt tokens resumed from "
                                      "kept caches instead of prefilled", registry=r)
        self.session_evictions = Counter("snapcompile_session_cache_evictions", "Kept caches evicted to stay "
                                         "within --session-cache-bytes", registry=r)
        self.session_bytes = Gauge("snapcompile_session_cache_bytes", "Bytes of the kept caches", registry=r)
        self.session_entries = Gauge("snapcompile_session_cache_entries", "Kept caches", registry=r)
        self._session_seen = StoreCounters()
        self._last_token: dict[str, float] = {}

    def set_totals(self, slots: int, kv_bytes_allocated: int) -> None:
        self.slots_total.set(slots)
        self.kv_total.set(kv_bytes_allocated)

    def set_load(self, running: int, waiting: int, slots_in_use: int, kv_bytes_active: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.slots.set(slots_in_use)
        self.kv_active.set(kv_bytes_active)

    def set_sessions(self, store: SessionStore) -> None:
        """Publish the session store's figures (its counters only grow; the difference is added)."""
        now, seen = store.counters, self._session_seen
        for counter, name in ((self.session_hits, "hits"), (self.session_misses, "misses"),
                              (self.session_tokens, "tokens_reused"), (self.session_evictions, "evictions")):
            counter.inc(getattr(now, name) - getattr(seen, name))
        self._session_seen = replace(now)
        self.session_bytes.set(store.bytes)
        self.session_entries.set(len(store))

    def on_event(self, event: TokenEvent, result: Result | None) -> None:
        now = time.perf_counter()
        if event.token_id is not None:
            self.generation_tokens.inc()
            last = self._last_token.get(event.request_id)
            if last is not None:
                self.itl.observe(now - last)
            self._last_token[event.request_id] = now
        if result is None:
            return
        self._last_token.pop(event.request_id, None)
        self.requests.labels(result.outcome).inc()
        self.prompt_tokens.inc(result.prompt_tokens)
        if result.ttft_s is not None:
            self.ttft.observe(result.ttft_s)
        self.e2e.observe(result.latency_s)

    def rejected(self) -> None:
        """A request refused before it reached the engine (bad parameters, overload, draining)."""
        self.requests.labels("rejected").inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
