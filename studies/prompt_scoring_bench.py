"""What a prompt's log probabilities cost: one prompt prefilled into a slot as a plain request is, and
again with every position's log probability and top-k computed (`logits_to` reduced as the engine
reduces it, engine/sampling.prompt_logprobs), alternating, on the same backend.

    .venv/bin/python studies/prompt_scoring_bench.py ARTIFACT [ARTIFACT ...] [--tokens 1024] [--top 1]
                                                    [--repeats 2]

Prints per artifact the median seconds of each, their ratio, and the load average and CPU.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from snapcompile.bench.machine import cpu_description, describe_cpu
from snapcompile.engine.sampling import prompt_logprobs
from snapcompile.runtime.device import drain
from snapcompile.runtime.ort_backend import OrtBackend


def timed_prefill(backend: OrtBackend, prompt: list[int], top: int | None) -> float:
    scores = []
    def score(first: int, logits: np.ndarray) -> None:
        scores.extend(prompt_logprobs(logits, prompt[first + 1:first + 1 + len(logits)], top))
    began = time.perf_counter()
    drain(backend.prefill_chunks(0, prompt, logits_to=score if top is not None else None))
    seconds = time.perf_counter() - began
    assert top is None or len(scores) == len(prompt) - 1
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifacts", nargs="+")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--top", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print(describe_cpu(cpu_description()))
    for folder in args.artifacts:
        backend = OrtBackend(folder)
        vocab = backend.manifest.spec.vocab_size
        prompt = [int(t) for t in np.random.default_rng(0).integers(0, vocab, args.tokens)]
        timed_prefill(backend, prompt[:128], args.top)             # graphs made, scorer built
        plain, scored = [], []
        for _ in range(args.repeats):
            plain.append(timed_prefill(backend, prompt, None))
            scored.append(timed_prefill(backend, prompt, args.top))
        p, s = statistics.median(plain), statistics.median(scored)
        print(f"{folder}: {backend.manifest.policy.policy}, vocab {vocab}, {args.tokens} tokens: plain {p:.2f} s, "
              f"with prompt logprobs (top {args.top}) {s:.2f} s ({s / p:.2f}x); load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
