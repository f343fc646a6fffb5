#!/usr/bin/env python3
"""What a resumed turn's new tokens attend over: eval-turns' conversations in the PyTorch oracle.

A study, not a policy the engine runs. Each conversation of `snapcompile eval-turns` (a document
with five facts in turn 1, turns 2..5 asking about the others) is run greedily in the oracle
(no artifacts built) under these variants:

  dense     every turn prefilled whole, dense attention: the reference
  resume    each turn resumed from the B kept rows and re-selected (the engine's policy)
  all-rows  the new tokens attend over every row the conversation ever had (kept or dropped);
            the re-selection and every decode step still see only the B kept rows and the new
            tokens, as in resume: what the new question lacks when resumed, measured alone
  summary   the oracle's policy with summaries (PolicyConfig.summaries, docs/design.md): the rows
            each selection drops are summed per KV head and position segment (--segment
            positions): one row of mean key and mean value whose logit gets log(rows summed),
            visible to a resumed turn's new tokens only. Counted within B: the prompt share P is
            lowered by the most segments the final conversation can have.
  summary-decode  summary, with every decode step attending over the summaries too (turn 1's
            answers included)
  cluster   summary with the rows grouped by key instead of position: a selection's dropped rows
            are grouped by k-means on their keys the first time (from the position segments),
            later ones join the summary of the nearest mean key

    python scripts/resume_study.py --samples 8 --kernel 31 --variants dense,resume,all-rows,summary \\
        --json resume-study.json

Correct: the asked number appears in the answer. Printed per variant: turns 2..5 answered, and of
the turns dense answered those this variant answered too. `--reference` takes dense's answers from
an earlier run's JSON on the same conversations instead of running dense again.
"""
from __future__ import annotations

import argparse
import math
import sys

VARIANTS = ("dense", "resume", "all-rows", "summary", "summary-decode", "cluster")
CLUSTER_ITERATIONS = 8
SAME_CONVERSATIONS = ("model", "length", "first", "samples", "seed", "answer_tokens")
EARLIER_DEFAULTS = {"first": 0}       # the value of an argument in a JSON written before it existed


def study_sequence_type(variant: str):
    """The ReferenceSequence subclass of a variant (the oracle's own for dense and resume)."""
    import torch

    from snapcompile.reference import oracle

    class AllRowsCache(oracle._LayerCache):
        """Keeps every row computed ([Hkv, positions, D], in position order) for resumed tokens."""

        def prefill(self, query, key, value, scale):
            self.all_keys, self.all_values = key[0].clone(), value[0].clone()
            return super().prefill(query, key, value, scale)

        def decode(self, query, key, value, scale):
            self.all_keys = torch.cat([self.all_keys, key[0]], dim=1)
            self.all_values = torch.cat([self.all_values, value[0]], dim=1)
            return super().decode(query, key, value, scale)

        def attend_resumed(self, query, keys, values, kept, scale):
            first = self.resume_at            # every position before the new tokens, one row each
            self.all_keys = torch.cat([self.all_keys[:, :first], keys[:, kept:]], dim=1)
            self.all_values = torch.cat([self.all_values[:, :first], values[:, kept:]], dim=1)
            return super().attend_resumed(query, self.all_keys, self.all_values, first, scale)

        def start_resume(self, resume_at):
            super().start_resume(resume_at)
            self.resume_at = resume_at

    class SummaryDecodeCache(oracle._LayerCache):
        """The oracle's summaries (policy.summaries), seen by every decode step too."""

        def attend_decoded(self, query, key, value, step, scale):
            summaries = self.summaries()
            if summaries is None:
                return super().attend_decoded(query, key, value, step, scale)
            rows = [r for r in range(step.cache_len) if r != step.write_index]
            keys = torch.cat([self.keys[:, rows], key[0]], dim=1)
            values = torch.cat([self.values[:, rows], value[0]], dim=1)
            return oracle.summary_attention(query, keys, values, len(rows), scale, *summaries)

    class ClusterCache(oracle._LayerCache):
        """Summaries by key instead of position: the first dropped rows are grouped by k-means on
        their keys (started from the position segments), later ones join the nearest mean key."""

        def _summarize_dropped(self, key, value, positions, kept):
            hkv, _, dim = key.shape
            weight = torch.ones(positions.shape).scatter(1, kept, 0.0)
            if self.summary_counts is None or not self.summary_counts.any():
                index = self.policy.summary_index(positions)
                for _ in range(CLUSTER_ITERATIONS):
                    sums = torch.zeros(hkv, self.policy.summaries, dim).scatter_add_(
                        1, index[..., None].expand(-1, -1, dim), key * weight[..., None])
                    counts = torch.zeros(hkv, self.policy.summaries).scatter_add_(1, index, weight)
                    index = nearest(key, sums, counts)
                self.summary_keys = self.summary_values = self.summary_counts = None
            else:
                index = nearest(key, self.summary_keys, self.summary_counts)
            self.add_to_summaries(key, value, index, weight)

    def nearest(key, sums, counts):
        """[Hkv, n] the non-empty summary whose mean key is nearest each key [Hkv, n, D]."""
        distance = torch.cdist(key, sums / counts.clamp(min=1)[..., None])
        return distance.masked_fill(counts[:, None, :] == 0, float("inf")).argmin(dim=2)

    cache_type = {"all-rows": AllRowsCache, "summary-decode": SummaryDecodeCache,
                  "cluster": ClusterCache}.get(variant, oracle._LayerCache)
    return type(f"{variant}Sequence", (oracle.ReferenceSequence,), {"cache_type": cache_type})


def greedy(sequence, logits, eos: set[int], limit: int) -> list[int]:
    tokens = [int(logits.argmax())]
    while tokens[-1] not in eos and len(tokens) < limit:
        tokens.append(int(sequence.feed([tokens[-1]]).argmax()))
    return tokens


def converse(loaded, case, variant: str, policy, answer_tokens: int) -> list[dict]:
    """Greedy answers of every turn of `case` under `variant`."""
    from snapcompile.config import PolicyConfig
    from snapcompile.evaluation.turns import FACTS, first_turn, next_turn_tokens
    from snapcompile.export.dense import eos_ids
    from snapcompile.reference.oracle import ReferenceSequence
    tokenizer, chat, eos = loaded.tokenizer, loaded.chat, set(eos_ids(loaded.tokenizer))
    ids, turns = first_turn(tokenizer, case, chat), []
    sequence_type = study_sequence_type(variant)
    sequence, fed = None, 0
    for turn in range(FACTS):
        if variant == "dense":
            sequence = ReferenceSequence(loaded.model, PolicyConfig(policy="dense"), len(ids) + answer_tokens + 1)
            logits = sequence.feed(ids)
        elif sequence is None:
            sequence = sequence_type(loaded.model, policy, policy.slot_rows)
            logits = sequence.feed(ids)
        else:
            logits = sequence.resume(ids, min(fed, len(ids) - policy.selection_window))
        tokens = greedy(sequence, logits, eos, answer_tokens)
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        turns.append({"turn": turn + 1, "text": text, "correct": case.answer(turn) in text})
        fed = len(ids) + len(tokens) - 1                 # the last sampled token is never fed
        if turn + 1 < FACTS:
            ids = ids + tokens + next_turn_tokens(tokenizer, case.question(turn + 1), chat, tokens[-1] in eos)
    return turns


def policy_of(config, variant: str, segment: int):
    """The variant's policy at the suite's length: the summary variants' summaries (one per
    segment of the final conversation) come out of the prompt share."""
    from dataclasses import replace

    from snapcompile.config import PolicyConfig
    policy = config.policy_at(config.lengths[0])
    if variant == "dense":
        return PolicyConfig(policy="dense")
    if not variant.startswith("summary") and variant != "cluster":
        return policy
    segments = math.ceil(config.final_length(config.lengths[0]) / segment)
    return replace(policy, summaries=segments, summary_segment=segment)


def reference_records(path: str, args) -> list[dict]:
    """Dense's records of an earlier run of this script on the same conversations; ValueError
    naming the file when it is not one."""
    import json
    from pathlib import Path
    try:
        earlier = json.loads(Path(path).read_text(encoding="utf-8"))
        stored, records = earlier["args"], earlier["records"]
        differ = [k for k in SAME_CONVERSATIONS if stored.get(k, EARLIER_DEFAULTS.get(k)) != getattr(args, k)]
        dense = [r for r in records if r["variant"] == "dense"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"--reference {path}: not a JSON of this script ({err})") from None
    if differ:
        raise ValueError(f"--reference {path} ran other conversations ({', '.join(differ)} differ)")
    if not dense:
        raise ValueError(f"--reference {path} holds no dense records")
    return dense


def summarize(records: list[dict], variants: list[str]) -> dict:
    dense = {(r["case"], t["turn"]): t["correct"] for r in records if r["variant"] == "dense" for t in r["turns"]}
    summary = {}
    for variant in variants:
        later = [(r["case"], t["turn"], t["correct"]) for r in records if r["variant"] == variant
                 for t in r["turns"] if t["turn"] > 1]
        paired = [c for case, turn, c in later if dense.get((case, turn))]
        summary[variant] = {"later_correct": sum(c for *_, c in later), "later_turns": len(later),
                            "kept_of_dense_correct": sum(paired) if dense else None,
                            "dense_correct": len(paired) if dense else None}
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--length", type=int, default=3000, help="turn 1's tokens")
    parser.add_argument("--samples", type=int, default=8, help="conversations --first .. SAMPLES-1 of the seed")
    parser.add_argument("--first", type=int, default=0, help="the first conversation run (to extend an earlier run)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ratio", type=int, default=4, help="B = the final conversation's length // ratio")
    parser.add_argument("--kernel", type=int, default=31)
    parser.add_argument("--answer-tokens", type=int, default=24)
    parser.add_argument("--segment", type=int, default=128, help="positions per summary row (summary)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--reference", help="dense's records from an earlier run's JSON (same conversations)")
    parser.add_argument("--json", dest="json_path", help="also write records and summary here")
    args = parser.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown or not variants:
        parser.error(f"--variants must be among {', '.join(VARIANTS)}; got {', '.join(unknown) or 'none'}")
    if args.segment < 1 or not 0 <= args.first < args.samples:
        parser.error("--segment must be >= 1 and --first in 0 .. --samples - 1")
    try:
        records = reference_records(args.reference, args) if args.reference and "dense" not in variants else []
    except ValueError as err:
        parser.error(str(err))

    import torch

    from snapcompile.errors import SnapcompileError
    from snapcompile.evaluation.turns import FACTS, TurnsConfig, check_config, make_case
    from snapcompile.models import load_model
    torch.manual_seed(0)
    config = TurnsConfig(args.model, lengths=(args.length,), samples=args.samples, seed=args.seed, ratio=args.ratio,
                         kernel=args.kernel, answer_tokens=args.answer_tokens)
    try:
        check_config(config)
        policies = {v: policy_of(config, v, args.segment) for v in variants}
        loaded = load_model(args.model)
        cases = [make_case(loaded.tokenizer, args.length, s, args.seed, loaded.chat)
                 for s in range(args.first, args.samples)]
    except SnapcompileError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for sample, case in enumerate(cases, start=args.first):
        for variant in variants:
            turns = converse(loaded, case, variant, policies[variant], args.answer_tokens)
            records.append({"variant": variant, "case": case.key, "turns": turns})
            marks = "".join("+" if t["correct"] else "." for t in turns)
            print(f"[{sample + 1}/{args.samples}] {case.key} {variant:>8} {marks}", file=sys.stderr, flush=True)
    summary = summarize(records, ["dense"] * bool(records and "dense" not in variants) + variants)
    for variant, s in summary.items():
        paired = f", of dense's right answers {s['kept_of_dense_correct']}/{s['dense_correct']}" \
            if s["dense_correct"] is not None else ""
        print(f"{variant:>8}  turns 2-{FACTS}: {s['later_correct']}/{s['later_turns']}{paired}")
    if args.json_path:
        from snapcompile.artifact.atomic import write_json_atomic
        write_json_atomic(args.json_path, {"args": vars(args), "policies": {v: str(p) for v, p in policies.items()},
                                           "summary": summary, "records": records})
    return 0


if __name__ == "__main__":
    sys.exit(main())
