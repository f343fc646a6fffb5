"""Study: where SnapStream loses a pass key that dense found — is the needle among the kept rows?

For each `eval` passkey case named (length, depth, sample, seed: the same prompts `eval` builds), the
PyTorch oracle (fp32, transformers' own model under the policy) prefills the prompt under SnapStream at
B = length // ratio and prints, for every layer it selects in, whether the needle's answer tokens were
kept and their ranks among the selection's scores; then (unless --no-variants) `run`-style greedy
answers of int8 artifacts: dense, SnapStream with the defaults, and each --variant, for the eval's
question and for a completion-style one ("... The pass key is"). A diagnostic on cases already
evaluated: any variant it favours needs a held-out run (another seed) before it counts.

    .venv/bin/python studies/passkey_selection.py gemma-3-270m --case 8000,0.9,0 --case 16000,0.5,0 \
        --seed 1 --ratio 4 --variant kernel=31 --variant window=64 --work /tmp/passkey-selection
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from snapcompile.compiler.route import compile_artifact
from snapcompile.config import ExportConfig, PolicyConfig
from snapcompile.engine.engine import Engine
from snapcompile.engine.request import Request
from snapcompile.evaluation.tasks import passkey_case
from snapcompile.models import load_model
from snapcompile.prompts import encode
from snapcompile.reference.oracle import ReferenceSequence

COMPLETION = "The pass key is"


def answer_tokens(tokenizer, ids: list[int], answer: str) -> list[int]:
    """Positions of the tokens spelling the first occurrence of `answer` in the prompt `ids`."""
    pieces = [tokenizer.decode([token]) for token in ids]
    starts, total = [], 0
    for piece in pieces:
        starts.append(total)
        total += len(piece)
    at = "".join(pieces).index(answer)
    return [i for i, start in enumerate(starts) if start < at + len(answer) and start + len(pieces[i]) > at]


def selection_report(loaded, ids: list[int], answer: str, budget: int) -> list[dict]:
    """Per selecting layer: the needle's tokens kept, and their ranks among the selection's scores."""
    policy = PolicyConfig(policy="snapstream", budget=budget)
    sequence = ReferenceSequence(loaded.model, policy, policy.slot_rows)
    with torch.no_grad():
        sequence.feed(ids)
    needle = answer_tokens(loaded.tokenizer, ids, answer)
    rows = []
    for layer, selection in enumerate(sequence.selections()):
        if selection is None:
            continue
        kept = set(selection.indices[0].tolist())
        rank = {int(p): r for r, p in enumerate(torch.argsort(selection.scores[0], descending=True).tolist())}
        rows.append({"layer": layer, "kept_rows": len(kept), "needle": needle,
                     "needle_kept": [p in kept for p in needle], "needle_ranks": [rank[p] for p in needle]})
    return rows


def answers(loaded, case, policy: PolicyConfig, folder: Path, max_context: int) -> dict[str, str]:
    """Greedy answers (16 tokens) of an int8 artifact of `policy` to the eval's and the completion-style question."""
    compile_artifact(loaded, ExportConfig(slots=1, max_context=max_context, chunk=64, weight_format="int8", tail=0),
                     policy, folder, force=True)
    engine = Engine.from_artifact(folder, session_cache_bytes=0)
    out = {}
    for kind, text in (("eval", case.prompt), ("completion", case.prompt.replace("Answer with the number only.",
                                                                                  COMPLETION))):
        result = engine.generate([Request(encode(loaded.tokenizer, text, chat=False), max_new_tokens=16)])[0]
        out[kind] = result.text
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--case", action="append", required=True, help="length,depth,sample (an eval passkey case)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--ratio", type=int, default=4)
    parser.add_argument("--variant", action="append", default=[], help="a PolicyConfig field=value, e.g. kernel=31")
    parser.add_argument("--no-variants", action="store_true", help="the selection report only")
    parser.add_argument("--selection-max", type=int, default=8192,
                        help="the oracle's selection report only for prompts up to this many tokens (its float32 "
                             "eager attention holds three heads x T x T score matrices: ~12 GiB at 16000 tokens)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/passkey-selection"))
    args = parser.parse_args()
    loaded = load_model(args.model)
    chat = loaded.chat
    max_context = max(int(spec.split(",")[0]) for spec in args.case) + 24     # eval's artifacts' (length + 24)
    for spec in args.case:
        length, depth, sample = spec.split(",")
        case = passkey_case(loaded.tokenizer, int(length), float(depth), int(sample), args.seed, chat)
        ids = encode(loaded.tokenizer, case.prompt, chat=chat)
        budget = case.length // args.ratio
        selection = selection_report(loaded, ids, case.answer, budget) if len(ids) <= args.selection_max else None
        print(json.dumps({"case": case.key, "tokens": len(ids), "budget": budget, "selection": selection}), flush=True)
        if args.no_variants:
            continue
        policies = {"dense": PolicyConfig(policy="dense"),
                    "snapstream": PolicyConfig(policy="snapstream", budget=budget)}
        for variant in args.variant:
            field, value = variant.split("=")
            policies[variant] = PolicyConfig(policy="snapstream", budget=budget, **{field: int(value)})
        for name, policy in policies.items():
            texts = answers(loaded, case, policy, args.work / f"{name.replace('=', '')}-{case.length}", max_context)
            print(json.dumps({"case": case.key, "policy": name, "answer": case.answer,
                              **{k: {"text": t, "correct": case.answer in t} for k, t in texts.items()}}), flush=True)


if __name__ == "__main__":
    main()
