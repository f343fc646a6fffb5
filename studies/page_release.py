"""What releasing weights.bin's pages after every prefill chunk costs in time and saves in memory
(`Device.release_pages`, docs/design.md "Weights resident once").

    .venv/bin/python studies/page_release.py ARTIFACT [--context 4096] [--rounds 6]

One process, one opened artifact on ONNX Runtime: `rounds` prefills of `context` random tokens,
alternating between the device's release and a no-op in its place (the order swapped every
round). After each prefill it reads the RSS of weights.bin's mapping (/proc/self/smaps) and then
releases it (timed: release_ms, the median), so every prefill starts from none. Prints one JSON
line: per mode the prefill seconds, their median, and the KiB of weights.bin resident after each.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    from snapcompile.artifact.manifest import WEIGHTS
    from snapcompile.bench.machine import cpu_description, file_rss_kib
    from snapcompile.bench.measure import ort_prefill_seconds
    from snapcompile.runtime import open_backend
    backend = open_backend(args.artifact)
    backend.make_graphs()
    device = backend.device
    release = device.release_pages
    modes = {"released": release, "kept": lambda: None}
    seconds = {mode: [] for mode in modes}
    resident = {mode: [] for mode in modes}
    release_s = []
    loads = [os.getloadavg()[0]]
    for r in range(args.rounds):
        for mode, function in (list(modes.items()) if r % 2 else list(reversed(modes.items()))):
            device.release_pages = function
            seconds[mode].append(round(ort_prefill_seconds(backend, args.context, seed=r)[0], 3))
            resident[mode].append(file_rss_kib(args.artifact / WEIGHTS))
            begin = time.perf_counter()
            release()
            release_s.append(time.perf_counter() - begin)
        loads.append(os.getloadavg()[0])
    print(json.dumps({"artifact": str(args.artifact), "context": args.context, "cpu": cpu_description(),
                      "load": [round(min(loads), 2), round(max(loads), 2)], "prefill_s": seconds,
                      "prefill_median_s": {m: statistics.median(v) for m, v in seconds.items()},
                      "weights_rss_kib": resident, "release_ms": round(1e3 * statistics.median(release_s), 3)}))


if __name__ == "__main__":
    main()
