"""The engine's own time per decode step, outside the graphs, as the generations grow: what
detokenizing, stop strings, sampling and scheduling cost a step at token 500 and at token 15000.

    .venv/bin/python studies/engine_overhead.py ARTIFACT [--slots 8] [--tokens 16000] [--at 500,15000]
        [--window 200] [--loop]

`slots` requests of one short prompt each generate `tokens` tokens (ignore_eos, greedy, a stop
string that never occurs so the stop matching runs), through `Engine.step()` (the core and the
output processor on one thread), or with --loop through `EngineLoop` (core and output each on their
own thread, as serve runs them). A step's own time is its wall time less the backend's decode call
(the graphs and the new tokens' cache copies); with --loop it is the core thread's step less the
backend's, and the output thread's processing is timed apart. Prints one JSON line: per point of
--at the median own milliseconds of the `window` steps around it, their ratio last / first, the
CPU and the load. The artifact's model must allow the positions (`studies/random_folder.py
tiny-llama OUT --dtype float32 --positions 32768`, converted, keeps the graphs' time small).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def own_step_seconds(engine, requests, loop: bool) -> tuple[list[float], list[float]]:
    """Per decode step: its own seconds (less the backend's decode) and the output's seconds."""
    core, own, output = getattr(engine, "core", engine), [], []   # an Engine before engine/core.py: itself
    real_decode = core.backend.decode
    spent = []

    def decode(*args):
        begin = time.perf_counter()
        try:
            return real_decode(*args)
        finally:
            spent.append(time.perf_counter() - begin)
    core.backend.decode = decode
    if not loop:
        for request in requests:
            engine.submit(request)
        while not core.scheduler.idle:
            begin, before = time.perf_counter(), len(spent)
            engine.step()
            if len(spent) > before:
                own.append(time.perf_counter() - begin - spent[-1])
        return own, output
    import threading

    from snapcompile.engine.loop import EngineLoop
    event_loop = EngineLoop(engine)
    real_step, real_output = core.step, event_loop._output

    def step():
        begin, before = time.perf_counter(), len(spent)
        steps = real_step()
        if len(spent) > before:
            own.append(time.perf_counter() - begin - spent[-1])
        return steps

    def timed_output(item):
        begin = time.perf_counter()
        real_output(item)
        if item[0] == "steps":
            output.append(time.perf_counter() - begin)
    core.step, event_loop._output = step, timed_output
    done = threading.Semaphore(0)
    event_loop.start()
    event_loop.submit_all([(r, lambda update: update.result is not None and done.release()) for r in requests])
    for _ in requests:
        done.acquire()
    event_loop.stop()
    return own, output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact")
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=16000)
    parser.add_argument("--at", default="500,15000")
    parser.add_argument("--window", type=int, default=200)
    parser.add_argument("--loop", action="store_true")
    args = parser.parse_args()
    from snapcompile.bench.machine import cpu_description
    from snapcompile.engine.engine import Engine
    from snapcompile.engine.request import Request
    engine = Engine.from_artifact(args.artifact, session_cache_bytes=0)
    engine.backend.make_graphs()
    prompt = engine.encode("Tell me a long story about a lighthouse keeper.", chat=False)
    requests = [Request(prompt, max_new_tokens=args.tokens, ignore_eos=True, stop=("\x00never\x00",),
                        request_id=f"r{i}") for i in range(args.slots)]
    load = os.getloadavg()[0]
    own, output = own_step_seconds(engine, requests, args.loop)
    points = [int(p) for p in args.at.split(",")]

    def around(values, at):
        window = values[max(0, at - args.window // 2):at + args.window // 2]
        return round(1e3 * statistics.median(window), 4) if window else None
    own_ms = {at: around(own, at) for at in points}
    row = {"artifact": args.artifact, "slots": args.slots, "tokens": args.tokens, "mode": "loop" if args.loop else
           "engine", "steps": len(own), "own_ms": own_ms,
           "ratio": round(own_ms[points[-1]] / own_ms[points[0]], 3),
           "cpu": cpu_description(), "load": [round(load, 2), round(os.getloadavg()[0], 2)]}
    if args.loop:
        row["output_ms"] = {at: around(output, at) for at in points}
    print(json.dumps(row))


if __name__ == "__main__":
    main()
