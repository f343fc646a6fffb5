"""One artifact's prefill and decode speed at one context, the figures `ov_bench.py` prints for
OpenVINO GenAI (../shared/peers/README.md), so the two can be run side by side, alternating.

    .venv/bin/python studies/artifact_point.py ARTIFACT --context 4096 --slots 1,4 [--steps 32] [--repeats 3]
        [--no-prefill] [--prefill-order chunks]

Prints one JSON line: load_s (open every graph), prefill_s (one prompt of `context` random tokens,
each repeat), and per slot count the median decode step (`steps` steps with every slot at
`context`, the first excluded) and tok/s = slots / median step, the rule of `snapcompile bench` and
`ov_bench.py`; peak_rss_bytes of the process. --no-prefill: decode only (a decode step does not depend
on the cache's values, so a long context's step is measured without prefilling it). --prefill-order
chunks: a layer-by-layer artifact's prefill chunk by chunk through the whole model (to compare).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("artifact")
    parser.add_argument("--context", type=int, required=True)
    parser.add_argument("--slots", default="1")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-prefill", dest="prefill", action="store_false")
    parser.add_argument("--prefill-order", choices=["layers", "chunks"], default=None)
    args = parser.parse_args()
    from snapcompile.bench.machine import cpu_description, peak_rss_bytes
    from snapcompile.bench.measure import ort_decode_seconds, ort_prefill_seconds
    from snapcompile.runtime import open_backend
    start = time.perf_counter()
    backend = open_backend(args.artifact, prefill_order=args.prefill_order)
    backend.make_graphs()
    load_s = time.perf_counter() - start
    prefill = [ort_prefill_seconds(backend, args.context, seed=r)[0] for r in range(args.repeats * args.prefill)]
    decode = {}
    for slots in (int(s) for s in args.slots.split(",")):
        steps = [ort_decode_seconds(backend, args.context, slots, args.steps, seed=r)[1:] for r in range(args.repeats)]
        median = statistics.median(s for repeat in steps for s in repeat)
        decode[slots] = {"step_median_s": median, "tok_s": slots / median}
    print(json.dumps({"artifact": args.artifact, "context": args.context, "cpu": cpu_description(),
                      "load_s": load_s, "prefill_s": prefill, "decode": decode, "peak_rss_bytes": peak_rss_bytes()}))


if __name__ == "__main__":
    main()
