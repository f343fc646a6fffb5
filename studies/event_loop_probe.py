"""How long `/health` waits while four clients send large bodies of small token-id lists (issue 42's
probe): the event loop must not parse or validate client-sized bodies itself.

    .venv/bin/python studies/event_loop_probe.py ARTIFACT [--seconds 15]

Prints the body size and /health's median, p95 and maximum latency over the run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import httpx

from snapcompile.serve.process import ServerProcess


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--seconds", type=float, default=15.0)
    args = parser.parse_args()
    body = json.dumps({"model": "tiny", "prompt": [[1, 2, 3]] * 260_000, "max_tokens": 1}).encode()
    print(f"body {len(body) / 2**20:.2f} MiB")
    with ServerProcess(args.artifact) as server:
        stop = time.monotonic() + args.seconds

        def flood() -> None:
            with httpx.Client(timeout=60) as client:
                while time.monotonic() < stop:
                    client.post(server.url + "/v1/completions", content=body,
                                headers={"Content-Type": "application/json"})
        threads = [threading.Thread(target=flood) for _ in range(4)]
        for thread in threads:
            thread.start()
        waits = []
        with httpx.Client(timeout=60) as client:
            while time.monotonic() < stop:
                began = time.perf_counter()
                client.get(server.url + "/health")
                waits.append(time.perf_counter() - began)
                time.sleep(0.05)
        for thread in threads:
            thread.join()
    waits.sort()
    print(f"/health: {len(waits)} probes, median {statistics.median(waits) * 1000:.0f} ms, "
          f"p95 {waits[int(len(waits) * 0.95)] * 1000:.0f} ms, max {waits[-1] * 1000:.0f} ms")


if __name__ == "__main__":
    main()
