"""Prefill time of one long prompt on ONNX Runtime, per artifact and chunk schedule, measured
side by side in one process (the systems alternate, each repeat runs every one once).

    .venv/bin/python scripts/prefill_bench.py ARTIFACT [ARTIFACT ...] [--length 4096] [--repeats 3]

Schedules: "causal" (each chunk on the smallest bucket that holds the rows filled so far, what
the backend does) and "whole-prompt" (every chunk on the prompt's own bucket, the behaviour
before per-chunk buckets). Prints one JSON line per artifact and schedule (median, min, max
seconds; chunk and select shares) and the CPU with its load average.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import numpy as np

from snapcompile.bench.machine import cpu_description, describe_cpu
from snapcompile.runtime.ort_backend import OrtBackend


def whole_prompt(backend: OrtBackend, length: int):
    """The schedule before per-chunk buckets: every chunk attends over the prompt's bucket."""
    rows = backend.prefill_rows(length)
    backend.chunk_rows = lambda start: rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifacts", nargs="+", type=Path)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--schedules", default="causal,whole-prompt")
    args = parser.parse_args()
    schedules = args.schedules.split(",")
    systems = {}
    for folder in args.artifacts:
        for schedule in schedules:
            backend = OrtBackend(folder)
            if schedule == "whole-prompt":
                whole_prompt(backend, args.length)
            systems[(folder.name, schedule)] = backend
    vocab = next(iter(systems.values())).manifest.spec.vocab_size
    prompt = [int(t) for t in np.random.default_rng(0).integers(100, vocab - 100, args.length)]
    times = {key: [] for key in systems}
    shares = {key: [] for key in systems}
    for _ in range(args.repeats):
        for key, backend in systems.items():
            backend.prefill(0, prompt)
            seconds = backend.last_prefill_seconds
            times[key].append(seconds["chunks"] + seconds["select"])
            shares[key].append(seconds["select"])
    for (name, schedule), runs in times.items():
        print(json.dumps({"artifact": name, "schedule": schedule, "length": args.length,
                          "median_s": round(statistics.median(runs), 3), "min_s": round(min(runs), 3),
                          "max_s": round(max(runs), 3),
                          "select_s": round(statistics.median(shares[(name, schedule)]), 3)}))
    print(describe_cpu(cpu_description()), "| load average", " ".join(f"{x:.2f}" for x in os.getloadavg()))


if __name__ == "__main__":
    main()
