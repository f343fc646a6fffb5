"""The session store's lookup time with many kept conversations, by the prefix index and by comparing
the prompt with every entry (the store before the index), side by side in one process.

    .venv/bin/python studies/store_lookup_bench.py [--entries 1024] [--tokens 4000] [--system 32]
                                                  [--compressed-at 0] [--new] [--repeats 20]

Every entry is a conversation of --tokens tokens that begins with the same --system-token system
prompt, with SmolLM2-135M's layer and KV-head counts and B = 1024 kept rows, its rows selected at
--compressed-at (0: a dense cache's entry, never selected; a SnapStream entry's is its first
prompt's length). The prompt resumes one of them, or with --new is a new conversation that shares
only the system prompt with every entry (a request's admission: no entry can be resumed). Prints
the median ms per lookup of each store and the CPU.
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


def entries(count: int, tokens: int, system: np.ndarray, compressed_at: int, rng) -> list[KeptCache]:
    kept_rows = min(ROWS, tokens)
    rows = np.sort(rng.choice(tokens, kept_rows, replace=False))
    positions = np.broadcast_to(rows, (KV_HEADS, kept_rows))
    placeholder = np.zeros((KV_HEADS, kept_rows, 1), np.float32)      # a lookup reads tokens and positions only
    kept = []
    for _ in range(count):
        ids = np.concatenate([system, rng.integers(0, 49152, tokens - len(system))]).astype(np.int64)
        kept.append(KeptCache(ids, (placeholder,) * LAYERS, (placeholder,) * LAYERS, (positions,) * LAYERS,
                              compressed_at))
    return kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--system", type=int, default=32, help="tokens of the system prompt every entry begins with")
    parser.add_argument("--compressed-at", type=int, default=0)
    parser.add_argument("--new", action="store_true", help="a new conversation: only the system prompt is shared")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    system = rng.integers(0, 49152, args.system)
    kept = entries(args.entries, args.tokens, system, args.compressed_at, rng)
    stores = {"prefix index": SessionStore(10**12, 32, 10**6, min_tokens=64, max_entries=args.entries),
              "every entry": SessionStore(10**12, 32, 10**6, min_tokens=1, max_entries=args.entries)}
    for store in stores.values():
        for entry in kept:
            store.put(entry)
    target = kept[args.entries // 2]
    prompt = [*system.tolist(), *rng.integers(0, 49152, 300).tolist()] if args.new \
        else [*target.token_ids.tolist(), *range(100)]
    times = {name: [] for name in stores}
    for _ in range(args.repeats):                 # alternating
        for name, store in stores.items():
            began = time.perf_counter()
            plan = store.lookup(prompt)
            times[name].append(time.perf_counter() - began)
            assert (plan is None) if args.new and args.compressed_at >= args.system else \
                (plan is not None and (args.new or plan.kept is target))
    shape = (f"{args.entries} entries of {args.tokens} tokens sharing {args.system}, rows selected at "
             f"{args.compressed_at}, {'a new conversation' if args.new else 'resuming one'}")
    for name, runs in times.items():
        print(f"{name}: {statistics.median(runs) * 1000:.2f} ms a lookup (median of {args.repeats}; {shape})")
    print(describe_cpu(cpu_description()))


if __name__ == "__main__":
    main()
