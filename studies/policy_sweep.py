#!/usr/bin/env python3
"""Compare cache-policy variants on retrieval cases with the PyTorch oracle (no artifacts built).

Each prompt is run once, densely, and recorded; every variant then starts decode from that
recorded prefill (`ReferenceSequence.from_prefill`), so a variant costs only its greedy answer.
Where a variant loses a case dense answered, it reports dense's margin at the first departing
token (dense's probability of its token minus that of the variant's): a small margin means dense
itself nearly answered the other way.
Use it to tune SnapStream's parameters for a model before building artifacts; confirm the chosen
configuration with `snapcompile eval`, which runs the compiled graphs.

    python studies/policy_sweep.py --task multikey --lengths 1000,2000 --samples 2 \\
        --variant head=scope:head --variant layer=scope:layer --variant layer-k31=scope:layer,kernel:31

A variant is NAME=key:value,... with PolicyConfig fields (policy, sinks, window, kernel, pooling,
scope) plus ratio (budget = prompt tokens // ratio; default --ratio).
"""
from __future__ import annotations

import argparse
import sys

ANSWER_TOKENS = 16
FIELDS = {"policy": str, "sinks": int, "window": int, "kernel": int, "pooling": str, "scope": str, "ratio": float}


def parse_variant(text: str) -> tuple[str, dict]:
    name, _, spec = text.partition("=")
    if not name:
        raise ValueError(f"variant {text!r}: expected NAME=key:value,...")
    options = {}
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition(":")
        if key not in FIELDS:
            raise ValueError(f"variant {name}: unknown field {key!r} (known: {', '.join(FIELDS)})")
        options[key] = FIELDS[key](value)
    return name, options


def greedy_answer(sequence, first_logits, tokenizer) -> tuple[list[int], list]:
    """Greedy tokens (up to ANSWER_TOKENS, EOS included) and the logits [V] each was chosen from."""
    logits, tokens = [first_logits], [int(first_logits.argmax())]
    while len(tokens) < ANSWER_TOKENS and tokens[-1] != tokenizer.eos_token_id:
        logits.append(sequence.feed([tokens[-1]]))
        tokens.append(int(logits[-1].argmax()))
    return tokens, logits


def dense_margin(dense_tokens: list[int], dense_logits: list, other_tokens: list[int]) -> float | None:
    """Where `other` first departs from dense: dense's probability of its own token minus its
    probability of the other's token (small: dense itself nearly chose the other way). None if
    the answers agree."""
    import torch
    for step, (mine, theirs) in enumerate(zip(dense_tokens, other_tokens)):
        if mine != theirs:
            probs = torch.softmax(dense_logits[step].float(), -1)
            return float(probs[mine] - probs[theirs])
    return None


def run_case(loaded, case, variants: dict[str, dict], default_ratio: float) -> dict[str, dict]:
    """Per answerer (dense and every variant): greedy text, and for variants the dense margin
    where the answer departs from dense."""
    from snapcompile.config import PolicyConfig
    from snapcompile.prompts import encode
    from snapcompile.reference.oracle import ReferenceSequence
    ids = encode(loaded.tokenizer, case.prompt, loaded.chat)
    window = max([32, *(v.get("window", 32) for v in variants.values())])
    dense = ReferenceSequence(loaded.model, PolicyConfig(policy="dense"), len(ids) + ANSWER_TOKENS + 1,
                              record_window=window)
    first = dense.feed(ids)
    dense_tokens, dense_logits = greedy_answer(dense, first, loaded.tokenizer)
    answers = {"dense": {"text": loaded.tokenizer.decode(dense_tokens, skip_special_tokens=True)}}
    prefill = dense.recorded_prefill()
    for name, options in variants.items():
        options = dict(options)
        budget = int(len(ids) // options.pop("ratio", default_ratio))
        policy = PolicyConfig(budget=budget, **options)
        sequence = ReferenceSequence.from_prefill(loaded.model, prefill, policy, budget)
        tokens, _ = greedy_answer(sequence, first, loaded.tokenizer)
        answers[name] = {"text": loaded.tokenizer.decode(tokens, skip_special_tokens=True),
                         "dense_margin": dense_margin(dense_tokens, dense_logits, tokens)}
    return answers


def summarize(records: list[dict], names: list[str]) -> dict:
    """Per variant and length: correct count, cases, and correct among the cases dense got right."""
    summary = {}
    for name in names:
        for length in sorted({r["length"] for r in records}):
            rows = [r for r in records if r["length"] == length]
            paired = [r for r in rows if r["correct"]["dense"]]
            summary.setdefault(name, {})[length] = {
                "correct": sum(r["correct"][name] for r in rows), "cases": len(rows),
                "kept_of_dense_correct": sum(r["correct"][name] for r in paired), "dense_correct": len(paired),
                "lost_dense_margins": sorted(r["answers"][name]["dense_margin"] for r in paired
                                             if not r["correct"][name])}
    return summary


def _margins(summary: dict) -> str:
    lost = summary["lost_dense_margins"]
    return f"; lost where dense margin was {', '.join(f'{m:.2f}' for m in lost)}" if lost else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--task", choices=["passkey", "multikey"], default="multikey")
    parser.add_argument("--lengths", default="1000,2000")
    parser.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9")
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ratio", type=float, default=4.0, help="default budget = prompt tokens // ratio")
    parser.add_argument("--variant", action="append", default=[], help="NAME=key:value,... (repeatable)")
    parser.add_argument("--json", dest="json_path", help="also write records and summary here")
    args = parser.parse_args()
    try:
        variants = dict(parse_variant(v) for v in args.variant) or {"snapstream": {}}
        lengths = [int(x) for x in args.lengths.split(",")]
        depths = [float(x) for x in args.depths.split(",")]
    except ValueError as err:
        parser.error(str(err))

    import torch

    from snapcompile.errors import SnapcompileError
    from snapcompile.evaluation.tasks import make_cases
    from snapcompile.models import load_model
    torch.manual_seed(0)
    try:
        loaded = load_model(args.model)
        cases = make_cases(args.task, loaded.tokenizer, lengths, depths, args.samples, args.seed, loaded.chat)
    except SnapcompileError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    records = []
    for number, case in enumerate(cases, 1):
        try:
            answers = run_case(loaded, case, variants, args.ratio)
        except SnapcompileError as err:
            print(f"error: {case.key}: {err}", file=sys.stderr)
            return 2
        correct = {name: case.answer in answer["text"] for name, answer in answers.items()}
        records.append({**case.to_dict(), "answers": answers, "correct": correct})
        marks = " ".join(f"{n}:{'ok' if c else 'x'}" for n, c in correct.items())
        print(f"[{number}/{len(cases)}] {case.key} {marks}", file=sys.stderr, flush=True)
    summary = summarize(records, ["dense", *variants])
    for name, by_length in summary.items():
        cells = "  ".join(f"L{length}: {s['correct']}/{s['cases']} (paired {s['kept_of_dense_correct']}/"
                          f"{s['dense_correct']}{_margins(s)})" for length, s in by_length.items())
        print(f"{name:>16}  {cells}")
    if args.json_path:
        from snapcompile.atomic import write_json_atomic
        write_json_atomic(args.json_path, {"args": vars(args), "summary": summary, "records": records})
    return 0


if __name__ == "__main__":
    sys.exit(main())
