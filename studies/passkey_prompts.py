#!/usr/bin/env python3
"""Write pass-key prompts as JSONL for `snapcompile run --prompts` (each line: id, prompt, answer).

    python studies/passkey_prompts.py --count 32 --min-tokens 1000 --max-tokens 4000 -o passkey32.jsonl
Lengths are spread evenly over [min, max] (approximate, in SmolLM2 tokens), depths cycle over 0.1..0.9.
"""
from __future__ import annotations

import argparse
import json
import random
import sys

from snapcompile.passkeys import passkey_prompt


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=32)
    parser.add_argument("--min-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("-o", "--output", default="-")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    lines = []
    for i in range(args.count):
        tokens = args.min_tokens + (args.max_tokens - args.min_tokens) * i // max(1, args.count - 1)
        key = rng.randint(10000, 99999)
        depth = (0.1, 0.3, 0.5, 0.7, 0.9)[i % 5]
        lines.append(json.dumps({"id": f"pk{i:02d}", "prompt": passkey_prompt(key, tokens, depth),
                                 "answer": str(key), "max_new_tokens": 16}))
    text = "\n".join(lines) + "\n"
    if args.output == "-":
        sys.stdout.write(text)
    else:
        with open(args.output, "w") as handle:
            handle.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
