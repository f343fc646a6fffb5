"""Compare `snapcompile eval` results of the same cases under two weight formats.

    .venv/bin/python studies/compare_weights.py REFERENCE.json OTHER.json [OTHER.json ...]

REFERENCE: an fp32 run (or any run); each OTHER: a run with other --weights / --block-size and the
same seed (a case is the same case in every run with that seed; only cases present in all the files
are compared, so the reference may be a wider grid). Retrieval tasks: per (policy, budget, length)
the answers each run got right, the paired retention (answers right in both / right in the
reference) and the reference answers lost.
Fidelity: agreement and KL of each run (all measured against the fp32 dense model). Markdown;
quantized runs are labelled with their block size ("int4 b128").
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
    config = payload["config"]   # results written before the field was renamed say "weights"
    weights = config.get("weight_format", config.get("weights", "fp32"))
    return weights + (f" b{config.get('block_size', 32)}" if weights in ("int8", "int4") else ""), cells


def retrieval_rows(reference: tuple[str, dict], others: list[tuple[str, dict]]) -> list[str]:
    label, reference = reference
    lines = ["| policy, budget, length | " + " | ".join(f"{w} right / retained of {label} (lost)" for w, _ in others)
             + f" | {label} right |", "|" + "---|" * (len(others) + 2)]
    for key in sorted(reference, key=lambda k: (k[2], k[0], str(k[1]))):
        shared = set(reference[key]).intersection(*(cellset.get(key, {}) for _, cellset in others))
        if not shared:
            continue
        right = {i for i in shared if reference[key][i]["correct"]}
        cells = []
        for _, cellset in others:
            kept = {i for i in shared if cellset[key][i]["correct"]}
            paired = len(right & kept) / len(right) if right else float("nan")
            cells.append(f"{len(kept)}/{len(shared)} / {100 * paired:.0f}% ({len(right - kept)})")
        lines.append(f"| {key[0]}, {key[1]}, {key[2]} | " + " | ".join(cells) + f" | {len(right)}/{len(shared)} |")
    return lines


def fidelity_rows(reference: tuple[str, dict], others: list[tuple[str, dict]]) -> list[str]:
    runs = [reference, *others]
    reference = reference[1]
    lines = ["| policy, budget, length | " + " | ".join(f"{w} agreement / KL" for w, _ in runs) + " |",
             "|" + "---|" * (len(runs) + 1)]
    for key in sorted(reference, key=lambda k: (k[2], k[0], str(k[1]))):
        shared = set(reference[key]).intersection(*(cellset.get(key, {}) for _, cellset in others))
        if not shared:
            continue
        cells = []
        for _, cellset in runs:
            records = [cellset[key][i] for i in sorted(shared)]
            agreement = sum(r["agreement"] for r in records) / max(len(records), 1)
            kl = sum(r["kl"] for r in records) / max(len(records), 1)
            cells.append(f"{agreement:.3f} / {kl:.3f} ({len(records)})")
        lines.append(f"| {key[0]}, {key[1]}, {key[2]} | " + " | ".join(cells) + " |")
    return lines


def main(paths: list[str]) -> None:
    if len(paths) < 2:
        sys.exit(__doc__)
    reference = _cells(paths[0])
    others = [_cells(p) for p in paths[1:]]
    fidelity = "agreement" in next(iter(next(iter(reference[1].values())).values()))
    print("\n".join((fidelity_rows if fidelity else retrieval_rows)(reference, others)))


if __name__ == "__main__":
    main(sys.argv[1:])
