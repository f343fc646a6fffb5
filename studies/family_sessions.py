"""One ONNX Runtime session a family of bucket graphs (runtime/shape_family.py) against a session a
graph, in one process: making every graph, whole prefills and decode steps, alternating.

    .venv/bin/python studies/family_sessions.py ARTIFACT [--context 4096] [--rounds 6] [--slots 1,4]
        [--steps 32]
    .venv/bin/python studies/family_sessions.py ARTIFACT --graph prefill_4096 --start 4000 [--runs 30]
    .venv/bin/python studies/family_sessions.py ARTIFACT --phases

Opens the artifact twice (`open_backend(..., family_sessions=False)`, then the default) and makes
every graph of each (seconds printed as make_s); then `rounds` times a prefill of `context` random
tokens on each (the order swapped every round, so neither always runs first) and, per slot count,
`steps` decode steps at `context` (the first excluded). Prints one JSON line: per mode the seconds
of each prefill and their median, the median decode step and tok/s, the CPU and load averages.
With --graph, one graph alone instead: bound to random inputs (`start` and `position` set to
--start, a full chunk), run `runs` times on each mode's session, one run each in turn, the median
milliseconds printed. With --phases, where making every graph (the default mode) spends its time:
seconds in `ort_form` (the weights' conversion, the first session's), in `symbolic_form` and in
creating the sessions (ONNX Runtime's pre-packing). Memory is measured a process per mode: `studies/open_memory.py
[--session-a-graph]`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("artifact")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--slots", default="1")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--graph", help="time this graph of the artifact alone")
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--phases", action="store_true")
    args = parser.parse_args()
    if args.phases:
        print(json.dumps(making_phases(args.artifact)))
        return
    if args.graph:
        print(json.dumps(time_graph(args.artifact, args.graph, args.start, args.runs)))
        return
    from snapcompile.bench.machine import cpu_description
    from snapcompile.bench.measure import ort_decode_seconds, ort_prefill_seconds
    from snapcompile.runtime import open_backend
    backends, make_s = {}, {}
    for mode, family in (("session_a_graph", False), ("family", True)):
        start = time.perf_counter()
        backends[mode] = open_backend(args.artifact, family_sessions=family)
        backends[mode].make_graphs()
        make_s[mode] = round(time.perf_counter() - start, 2)
    loads = [os.getloadavg()[0]]
    prefill = {mode: [] for mode in backends}
    decode = {mode: {int(s): [] for s in args.slots.split(",")} for mode in backends}
    for r in range(args.rounds):
        order = list(backends.items()) if r % 2 else list(reversed(backends.items()))
        for mode, backend in order:
            prefill[mode].append(round(ort_prefill_seconds(backend, args.context, seed=r)[0], 3))
            for slots, steps in decode[mode].items():
                steps.extend(ort_decode_seconds(backend, args.context, slots, args.steps, seed=r)[1:])
        loads.append(os.getloadavg()[0])
    print(json.dumps({"artifact": args.artifact, "context": args.context, "cpu": cpu_description(),
                      "load": [round(min(loads), 2), round(max(loads), 2)], "make_s": make_s,
                      "prefill_s": prefill, "prefill_median_s": {m: statistics.median(v) for m, v in prefill.items()},
                      "decode": {m: {s: {"step_median_s": statistics.median(v), "tok_s": s / statistics.median(v)}
                                     for s, v in by_slots.items()} for m, by_slots in decode.items()}}))


def making_phases(artifact: str) -> dict:
    """Seconds opening the artifact and making every graph spends in each phase."""
    from snapcompile.runtime import open_backend, ort_backend
    from snapcompile.runtime.ort_capi import SharedSessions
    spent = {"ort_form": 0.0, "symbolic_form": 0.0, "sessions": 0.0}

    def timed(key, function):
        def wrapper(*args, **kwargs):
            begin = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - begin
        return wrapper
    ort_backend.ort_form = timed("ort_form", ort_backend.ort_form)
    ort_backend.symbolic_form = timed("symbolic_form", ort_backend.symbolic_form)
    SharedSessions.session = timed("sessions", SharedSessions.session)
    begin = time.perf_counter()
    backend = open_backend(artifact)
    opened = time.perf_counter() - begin
    backend.make_graphs()
    return {"artifact": artifact, "open_s": round(opened, 2), "every_graph_s": round(time.perf_counter() - begin, 2),
            **{f"{key}_s": round(value, 2) for key, value in spent.items()}, "load": os.getloadavg()[0]}


def time_graph(artifact: str, name: str, start: int, runs: int) -> dict:
    """Median ms of a run of graph `name` on a session a graph and on its family's session."""
    import numpy as np

    from snapcompile.artifact.manifest import read_manifest
    from snapcompile.runtime.ort_backend import OrtDevice
    manifest = read_manifest(artifact)
    entry, rng = manifest.graphs[name], np.random.default_rng(0)
    arrays = {value["name"]: (rng.standard_normal(value["shape"]).astype(np.float32) if value["dtype"] == "float"
                              else rng.integers(1, 8, value["shape"]).astype(np.int64)) for value in entry["inputs"]}
    for key, value in (("start", start), ("position", start), ("chunk_len", manifest.export.chunk)):
        if key in arrays:
            arrays[key][:] = value
    outputs = {value["name"]: np.zeros(value["shape"], np.float32 if value["dtype"] == "float" else np.int64)
               for value in entry["outputs"]}
    graphs = {}
    for mode, family in (("session_a_graph", False), ("family", True)):
        graphs[mode] = OrtDevice(artifact, family_sessions=family).graph(name, manifest)
        for key, array in arrays.items():
            graphs[mode].bind(key, array)
        for key, array in outputs.items():
            graphs[mode].bind(key, array, output=True)
        graphs[mode].run()
    seconds = {mode: [] for mode in graphs}
    for _ in range(runs):
        for mode, graph in graphs.items():
            begin = time.perf_counter()
            graph.run()
            seconds[mode].append(time.perf_counter() - begin)
    return {"artifact": artifact, "graph": name, "start": start, "runs": runs, "load": os.getloadavg()[0],
            "median_ms": {mode: round(1e3 * statistics.median(v), 2) for mode, v in seconds.items()}}


if __name__ == "__main__":
    main()
