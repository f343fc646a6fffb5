"""Decode step time by number of active slots, on the slot-bucket graph the backend picks and on
the artifact's N-slot graph, measured side by side in one process (alternating, repeated).

    .venv/bin/python scripts/decode_bench.py ARTIFACT [--active 1,2,4,8] [--steps 30] [--repeats 3]
        [--one-slot ARTIFACT_1]

The slots hold a prompt of --prompt tokens each. Prints one JSON line per active count (median
ms per step on each graph, and their ratio), with --one-slot a line comparing one request on
ARTIFACT with one on a 1-slot artifact of the same model, the process RSS and the CPU with its
load average.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

from snapcompile.bench.machine import cpu_description, describe_cpu, rss_bytes
from snapcompile.runtime.ort_backend import OrtBackend


def step_ms(backend: OrtBackend, layouts: dict, graph_size: int, steps: int) -> float:
    """Median ms of `steps` decode steps of the slots in `layouts`, on the graph of graph_size."""
    chosen = backend.decode_size
    backend.decode_size = lambda slots: graph_size
    try:
        times = []
        for t in range(steps):
            tokens = {slot: 100 + t for slot in layouts}
            moves = {slot: layout.step(t) for slot, layout in layouts.items()}
            began = time.perf_counter()
            backend.decode(tokens, moves)
            times.append(time.perf_counter() - began)
        return statistics.median(times) * 1000
    finally:
        backend.decode_size = chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--active", default="1,2,4,8")
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--one-slot", type=Path, default=None, help="a 1-slot artifact to compare a lone request with")
    args = parser.parse_args()
    backend = OrtBackend(args.artifact)
    vocab, n = backend.manifest.spec.vocab_size, backend.slots
    prompt = [int(t) for t in np.random.default_rng(0).integers(100, vocab - 100, args.prompt)]
    active = [k for k in map(int, args.active.split(",")) if k <= n]
    layouts = {slot: backend.prefill(slot, prompt).layout for slot in range(max(active))}
    for k in active:
        chosen = backend.decode_size(range(k))
        runs = {chosen: [], n: []}
        for _ in range(args.repeats):
            for size in runs:
                runs[size].append(step_ms(backend, {s: layouts[s] for s in range(k)}, size, args.steps))
        bucket, full = statistics.median(runs[chosen]), statistics.median(runs[n])
        print(json.dumps({"artifact": args.artifact.name, "active": k, "graph_slots": chosen,
                          "bucket_ms": round(bucket, 2), f"full_{n}_slot_ms": round(full, 2),
                          "full_over_bucket": round(full / bucket, 2)}))
    if args.one_slot is not None:
        single = OrtBackend(args.one_slot)
        alone = {0: single.prefill(0, prompt).layout}
        runs = {"lone": [], "one_slot": []}
        for _ in range(args.repeats):
            runs["lone"].append(step_ms(backend, {0: layouts[0]}, backend.decode_size([0]), args.steps))
            runs["one_slot"].append(step_ms(single, alone, 1, args.steps))
        lone, one = statistics.median(runs["lone"]), statistics.median(runs["one_slot"])
        print(json.dumps({"lone_request_ms": round(lone, 2), "one_slot_artifact_ms": round(one, 2),
                          "ratio": round(lone / one, 2)}))
    print(f"RSS {rss_bytes() / 2**20:.0f} MiB;", describe_cpu(cpu_description()),
          "| load average", " ".join(f"{x:.2f}" for x in os.getloadavg()))


if __name__ == "__main__":
    main()
