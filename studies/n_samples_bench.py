"""n samples of one prompt sharing one prefill, against n separate requests (issue 40).

    .venv/bin/python studies/n_samples_bench.py ARTIFACT [--n 4] [--prompt-tokens 1500]
        [--new-tokens 32] [--rounds 3]

Both runs draw the same samples (seeds 1..n, temperature 1; the texts are checked equal), on one
engine, alternating; prints each round's seconds, the medians and their ratio, the load average
and the CPU.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import replace
from pathlib import Path

from snapcompile import Engine, Request, SamplingParams
from snapcompile.bench.machine import cpu_description, describe_cpu
from snapcompile.passkeys import passkey_prompt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    engine = Engine.from_artifact(args.artifact, session_cache_bytes=0)
    engine.backend.make_graphs()
    prompt = engine.encode(passkey_prompt(4711, args.prompt_tokens), chat=False)[:args.prompt_tokens]

    def run(shared: bool) -> tuple[float, list[str]]:
        requests = [Request(prompt, max_new_tokens=args.new_tokens, ignore_eos=True, request_id=f"{shared}-{seed}",
                            sampling=SamplingParams(temperature=1.0, seed=seed)) for seed in range(1, args.n + 1)]
        if shared:
            requests[1:] = [replace(r, shares_prefill_of=requests[0].request_id, cache_partition=None)
                            for r in requests[1:]]
        started = time.perf_counter()
        results = engine.generate(requests)
        for request in requests:
            engine.forget(request.request_id)
        return time.perf_counter() - started, [r.text for r in results]

    times: dict[bool, list[float]] = {False: [], True: []}
    for round_ in range(args.rounds):
        for shared in (False, True) if round_ % 2 == 0 else (True, False):
            seconds, texts = run(shared)
            times[shared].append(seconds)
            print(f"round {round_ + 1} {'shared' if shared else 'separate'}: {seconds:.2f} s", flush=True)
        assert run(True)[1] == run(False)[1], "the shared prefill changed a sample"
    separate, shared = statistics.median(times[False]), statistics.median(times[True])
    print(f"{args.n} samples of {len(prompt)} prompt tokens, {args.new_tokens} new tokens each: separate "
          f"{separate:.2f} s, shared prefill {shared:.2f} s ({separate / shared:.2f}x); load "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; {describe_cpu(cpu_description())}")


if __name__ == "__main__":
    main()
