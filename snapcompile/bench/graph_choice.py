"""`bench --measure decode-slots | prefill-schedules`: what the backend's choice of graph buys, on one
artifact, each alternative measured side by side in one process (alternating, repeated).

- decode-slots: decode step time per number of active slots on the slot-bucket graph the backend
  picks against the artifact's N-slot graph.
- prefill-schedules: one long prompt's prefill with each chunk on the smallest bucket holding the
  rows filled so far ("causal", what the backend does) against every chunk on the prompt's own
  bucket ("whole-prompt").
"""
from __future__ import annotations

import statistics
import time
from contextlib import contextmanager

import numpy as np

MEASURES = ("points", "decode-slots", "prefill-schedules")


def random_prompt(vocab: int, length: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(0).integers(100, vocab - 100, length)]


@contextmanager
def _decode_graph(backend, slots: int):
    """Every step of `backend` runs on the decode graph of `slots` slots while inside."""
    chosen = backend.decode_size
    backend.decode_size = lambda active: slots
    try:
        yield
    finally:
        backend.decode_size = chosen


def _step_ms(backend, layouts: dict, graph_slots: int, steps: int) -> float:
    """Median ms of `steps` decode steps of the slots in `layouts` on the graph of graph_slots."""
    times = []
    with _decode_graph(backend, graph_slots):
        for t in range(steps):
            tokens = {slot: 100 + t for slot in layouts}
            moves = {slot: layout.step(t) for slot, layout in layouts.items()}
            began = time.perf_counter()
            backend.decode(tokens, moves)
            times.append(time.perf_counter() - began)
    return statistics.median(times) * 1000


def decode_slots(backend, active: list[int], prompt_len: int, steps: int, repeats: int) -> list[dict]:
    """Per active count k (at most the artifact's N slots): median ms a step on the graph the
    backend picks for k slots and on the N-slot graph, each slot holding a prompt of prompt_len."""
    n = backend.slots
    prompt = random_prompt(backend.manifest.spec.vocab_size, prompt_len)
    active = [k for k in active if 1 <= k <= n]
    layouts = {slot: backend.prefill(slot, prompt).layout for slot in range(max(active, default=0))}
    rows = []
    for k in active:
        chosen = backend.decode_size(range(k))
        runs = {chosen: [], n: []}
        for _ in range(repeats):
            for size in runs:
                runs[size].append(_step_ms(backend, {s: layouts[s] for s in range(k)}, size, steps))
        bucket, full = statistics.median(runs[chosen]), statistics.median(runs[n])
        rows.append({"active": k, "graph_slots": chosen, "bucket_ms": round(bucket, 2), "full_slots": n,
                     "full_ms": round(full, 2), "full_over_bucket": round(full / bucket, 2)})
    return rows


@contextmanager
def _whole_prompt(backend, length: int):
    """Every chunk of a `length`-token prompt attends over the prompt's own bucket while inside."""
    rows = backend.prefill_rows(length)
    chosen = backend.prefills.chunk_rows
    backend.prefills.chunk_rows = lambda start: rows
    try:
        yield
    finally:
        backend.prefills.chunk_rows = chosen


def prefill_schedules(backend, length: int, repeats: int) -> list[dict]:
    """Median, min and max seconds of one `length`-token prefill per schedule (the selection's
    share apart), the schedules alternating within each repeat."""
    prompt = random_prompt(backend.manifest.spec.vocab_size, length)
    times = {"causal": [], "whole-prompt": []}
    select = {name: [] for name in times}
    for _ in range(repeats):
        for name in times:
            if name == "causal":
                backend.prefill(0, prompt)
            else:
                with _whole_prompt(backend, length):
                    backend.prefill(0, prompt)
            seconds = backend.last_prefill_seconds
            times[name].append(seconds["chunks"] + seconds["select"])
            select[name].append(seconds["select"])
    return [{"schedule": name, "length": length, "median_s": round(statistics.median(runs), 3),
             "min_s": round(min(runs), 3), "max_s": round(max(runs), 3),
             "select_s": round(statistics.median(select[name]), 3)} for name, runs in times.items()]
