"""Where opening an artifact and making every graph spends its time (what `serve`, a Triton instance
and the measuring tools pay before they are ready), phase by phase, a fresh process each time.

    .venv/bin/python studies/open_phases.py ARTIFACT [--repeats 3]

Phases: `files` (every file's size and sha256 against the manifest), `graph_checks` (loading ONNX
Runtime's graphs and bounding each family's at every member's size), `sessions` (creating them:
ONNX Runtime's optimizer and its pre-packing of every weight, per graph in `session_s`), and the
rest (buffers, the backend). Prints one JSON line: per phase the median seconds over `repeats`
processes and every repeat's, `every_graph_s` (open + every graph made), the CPU and the load.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def one_open(artifact: str) -> dict:
    """Seconds of each phase of one open in this process."""
    from snapcompile.runtime import open_backend, ort_backend
    from snapcompile.runtime.ort_capi import OrtEnvironment
    spent, sessions = {"files": 0.0, "graph_checks": 0.0, "sessions": 0.0}, {}

    def timed(key, function, per_call=None):
        def wrapper(*args, **kwargs):
            begin = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - begin
                if per_call is not None:
                    sessions[args[-1]] = round(time.perf_counter() - begin, 3)
        return wrapper
    ort_backend.check_files = timed("files", ort_backend.check_files)
    ort_backend.load_ort_graph = timed("graph_checks", ort_backend.load_ort_graph)
    original = OrtEnvironment.open_graph
    OrtEnvironment.open_graph = lambda self, model, arrays, config, what: timed(
        "sessions", original, per_call=True)(self, model, arrays, config, what)
    begin = time.perf_counter()
    backend = open_backend(artifact)
    backend.make_graphs()
    total = time.perf_counter() - begin
    return {"every_graph_s": total, **{f"{k}_s": v for k, v in spent.items()},
            "rest_s": total - sum(spent.values()), "session_s": sessions}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--once", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.once:
        print(json.dumps(one_open(args.artifact)))
        return 0
    from snapcompile.bench.machine import cpu_description
    loads, runs = [os.getloadavg()[0]], []
    for _ in range(args.repeats):
        done = subprocess.run([sys.executable, __file__, args.artifact, "--once"], capture_output=True, text=True)
        if done.returncode:
            sys.stderr.write(done.stderr)
            return done.returncode
        runs.append(json.loads(done.stdout))
        loads.append(os.getloadavg()[0])
    phases = [key for key in runs[0] if key.endswith("_s") and key != "session_s"]
    print(json.dumps({"artifact": args.artifact, "cpu": cpu_description(),
                      "load": [round(min(loads), 2), round(max(loads), 2)],
                      **{key: round(statistics.median(run[key] for run in runs), 3) for key in phases},
                      "runs": [{key: round(value, 3) if isinstance(value, float) else value
                                for key, value in run.items()} for run in runs]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
