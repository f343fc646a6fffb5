"""Compare `snapcompile eval` results of the same cases under two weight formats.

    .venv/bin/python scripts/compare_weights.py REFERENCE.json OTHER.json [OTHER.json ...]

REFERENCE: the fp32 run; each OTHER: the same command with another --weights (same seed, so the
same cases). Retrieval tasks: per (policy, budget, length) the answers each run got right, the
paired retention (answers right in both / right in the reference) and the reference answers lost.
Fidelity: agreement and KL of each run (all measured against the fp32 dense model). Markdown.
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict


def _cells(path: str) -> tuple[str, dict]:
    payload = json.loads(open(path, encoding="utf-8").read())
    cells = defaultdict(dict)
    for record in payload["records"]:
        budget = record["budget"] or "-"
        cells[(record["policy"], budget, record["length"])][record["id"]] = record
    return payload["config"].get("weights", "fp32"), cells


def retrieval_rows(reference: dict, others: list[tuple[str, dict]]) -> list[str]:
    lines = ["| policy, budget, length | " + " | ".join(f"{w} right / retained of fp32 (lost)" for w, _ in others)
             + " | fp32 right |", "|" + "---|" * (len(others) + 2)]
    for key in sorted(reference, key=lambda k: (k[2], k[0], str(k[1]))):
        base = reference[key]
        right = {i for i, r in base.items() if r["correct"]}
        cells = []
        for _, cellset in others:
            theirs = cellset.get(key, {})
            kept = {i for i, r in theirs.items() if r["correct"]}
            paired = len(right & kept) / len(right) if right else float("nan")
            cells.append(f"{len(kept)}/{len(theirs)} / {100 * paired:.0f}% ({len(right - kept)})")
        lines.append(f"| {key[0]}, {key[1]}, {key[2]} | " + " | ".join(cells) + f" | {len(right)}/{len(base)} |")
    return lines


def fidelity_rows(reference: dict, others: list[tuple[str, dict]]) -> list[str]:
    runs = [("fp32", reference), *others]
    lines = ["| policy, budget, length | " + " | ".join(f"{w} agreement / KL" for w, _ in runs) + " |",
             "|" + "---|" * (len(runs) + 1)]
    for key in sorted(reference, key=lambda k: (k[2], k[0], str(k[1]))):
        cells = []
        for _, cellset in runs:
            records = list(cellset.get(key, {}).values())
            agreement = sum(r["agreement"] for r in records) / max(len(records), 1)
            kl = sum(r["kl"] for r in records) / max(len(records), 1)
            cells.append(f"{agreement:.3f} / {kl:.3f} ({len(records)})")
        lines.append(f"| {key[0]}, {key[1]}, {key[2]} | " + " | ".join(cells) + " |")
    return lines


def main(paths: list[str]) -> None:
    if len(paths) < 2:
        sys.exit(__doc__)
    _, reference = _cells(paths[0])
    others = [_cells(p) for p in paths[1:]]
    fidelity = "agreement" in next(iter(next(iter(reference.values())).values()))
    print("\n".join((fidelity_rows if fidelity else retrieval_rows)(reference, others)))


if __name__ == "__main__":
    main(sys.argv[1:])
