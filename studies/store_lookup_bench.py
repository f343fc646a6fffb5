"""The session store's lookup time with many kept conversations, by the prefix index and by comparing
the prompt with every entry (the store before the index), side by side in one process.

    .venv/bin/python studies/store_lookup_bench.py [--entries 1024] [--tokens 4000] [--repeats 20]

Every entry is a conversation of --tokens tokens that begins with the same 32-token system prompt
(so the first token matches everywhere), with SmolLM2-135M's layer and KV-head counts and B = 1024
kept rows; the prompt resumes one of them. Prints the median ms per lookup of each and the CPU.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from snapcompile.bench.machine import cpu_description, describe_cpu
from snapcompile.sessions.kept import KeptCache
from snapcompile.sessions.store import SessionStore

LAYERS, KV_HEADS, ROWS = 30, 3, 1024


def entries(count: int, tokens: int, rng) -> list[KeptCache]:
    system = rng.integers(0, 49152, 32)
    kept_rows = min(ROWS, tokens)
    rows = np.sort(rng.choice(tokens, kept_rows, replace=False))
    positions = np.broadcast_to(rows, (KV_HEADS, kept_rows))
    placeholder = np.zeros((KV_HEADS, kept_rows, 1), np.float32)      # a lookup reads tokens and positions only
    kept = []
    for _ in range(count):
        ids = np.concatenate([system, rng.integers(0, 49152, tokens - 32)]).astype(np.int64)
        kept.append(KeptCache(ids, (placeholder,) * LAYERS, (placeholder,) * LAYERS, (positions,) * LAYERS, 0))
    return kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    kept = entries(args.entries, args.tokens, np.random.default_rng(0))
    stores = {"prefix index": SessionStore(10**12, 32, 10**6, min_tokens=64, max_entries=args.entries),
              "every entry": SessionStore(10**12, 32, 10**6, min_tokens=1, max_entries=args.entries)}
    for store in stores.values():
        for entry in kept:
            store.put(entry)
    prompt = [*kept[args.entries // 2].token_ids.tolist(), *range(100)]
    times = {name: [] for name in stores}
    for _ in range(args.repeats):                 # alternating
        for name, store in stores.items():
            began = time.perf_counter()
            plan = store.lookup(prompt)
            times[name].append(time.perf_counter() - began)
            assert plan is not None and plan.kept is kept[args.entries // 2]
    for name, runs in times.items():
        print(f"{name}: {statistics.median(runs) * 1000:.2f} ms a lookup (median of {args.repeats}; "
              f"{args.entries} entries of {args.tokens} tokens)")
    print(describe_cpu(cpu_description()))


if __name__ == "__main__":
    main()
