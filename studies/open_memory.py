"""RSS of a process that opens an artifact on ONNX Runtime, then runs one prompt through it, beside
the artifact's own estimate (`inspect`'s memory to run).

    .venv/bin/python studies/open_memory.py ARTIFACT [--prompt-tokens N] [--requests R --short-tokens S]
        [--decode-tokens D]

Prints one JSON line: rss_before_open (the process with its libraries imported), rss_open (every
graph open), peak_rss (after a prompt of N random tokens, default 0: none, and R - 1 prompts of S
tokens beside it, each decoding D tokens: with R = slots and D past the ring's rows every slot's
cache is written, the worst case the estimate is for),
after (RssAnon and RssFile once it ended), estimate and estimate_parts
(footprint.memory_needed). To compare two code versions, run it from each checkout in turn,
alternating (docs/results/memory.md).
"""
from __future__ import annotations

import argparse
import json

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("artifact")
    parser.add_argument("--prompt-tokens", type=int, default=0)
    parser.add_argument("--requests", type=int, default=1)
    parser.add_argument("--short-tokens", type=int, default=1024)
    parser.add_argument("--decode-tokens", type=int, default=4)
    args = parser.parse_args()
    from snapcompile.artifact.files import artifact_tokenizer
    from snapcompile.artifact.footprint import memory_needed
    from snapcompile.bench.machine import peak_rss_bytes, rss_bytes
    from snapcompile.engine.engine import Engine
    from snapcompile.engine.request import Request
    from snapcompile.memory import process_status_kib
    from snapcompile.runtime import open_backend
    before = rss_bytes()
    backend = open_backend(args.artifact)
    backend.make_graphs()
    opened = rss_bytes()
    if args.prompt_tokens:
        m = backend.manifest
        engine = Engine(backend, artifact_tokenizer(backend.folder, m), m.eos_token_ids, session_cache_bytes=0)
        rng = np.random.default_rng(0)
        lengths = [args.prompt_tokens] + [args.short_tokens] * (args.requests - 1)
        engine.generate([Request([int(t) for t in rng.integers(100, m.spec.vocab_size - 100, length)],
                                 max_new_tokens=args.decode_tokens, ignore_eos=True) for length in lengths])
    peak = peak_rss_bytes()
    now = {field: process_status_kib(field) * 1024 for field in ("RssAnon", "RssFile")}
    print(json.dumps({"rss_before_open": before, "rss_open": opened, "peak_rss": peak, "after": now,
                      "estimate": sum(memory_needed(backend.manifest).values()),
                      "estimate_parts": memory_needed(backend.manifest)}))


if __name__ == "__main__":
    main()
