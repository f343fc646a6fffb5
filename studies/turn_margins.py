#!/usr/bin/env python3
"""Dense's own margin on every later-turn answer of resume_study's conversations.

For each conversation of a `studies/resume_study.py` JSON, dense's whole conversation (every turn
and dense's recorded answers, re-encoded) goes through the dense model once, teacher-forced; the
logits at each answer step give the gap between dense's two likeliest tokens, and an answer's
margin is the least gap over the tokens that spell the asked number (as `eval`'s multikey
margins). A rebuilt answer that is not dense's own greedy continuation (its text did not
re-encode to the tokens generated) gets no margin. Printed: per variant, of the later answers
dense gave right, how many it kept, and of those dense was sure of (margin >= --sure) how many.

    python studies/turn_margins.py resume-study.json resume-study-16-32.json --json margins.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

SURE_MARGIN = 0.1            # evaluation.report.SURE_MARGIN: dense was sure at or above it


def dense_conversation(loaded, case, texts: list[str]):
    """Dense's conversation rebuilt from its answers `texts` (one per turn): the token ids of the
    whole conversation and, per turn, the span (start, end) of its answer in them. An answer that
    re-encodes to fewer than its turn's answer_tokens ended with EOS."""
    from snapcompile.evaluation.conversation_eval import first_turn, next_turn_tokens
    from snapcompile.evaluation.conversations import TURNS
    from snapcompile.export.dense import eos_ids
    from snapcompile.prompts import encode_text
    tokenizer, eos = loaded.tokenizer, eos_ids(loaded.tokenizer)[0]
    ids, spans = first_turn(tokenizer, case, loaded.chat), []
    for turn, text in enumerate(texts):
        answer = encode_text(tokenizer, text)
        ended = len(answer) < case.answer_tokens[turn]
        answer = answer + [eos] * ended
        spans.append((len(ids), len(ids) + len(answer)))
        ids = ids + answer
        if turn + 1 < TURNS:
            ids = ids + next_turn_tokens(tokenizer, case.questions[turn + 1], loaded.chat, ended)
    return ids, spans


def teacher_forced_top2(model, ids: list[int], spans: list[tuple[int, int]]):
    """Per span (start, end) of `ids`: the dense model's two likeliest next tokens at each of its
    positions when fed `ids` whole (causal, so each as if the sequence ended there): indices and
    log-probabilities [end - start, 2]."""
    import torch
    with torch.no_grad():
        hidden = model.model(input_ids=torch.tensor([ids[:-1]])).last_hidden_state[0]
        return [torch.log_softmax(model.lm_head(hidden[start - 1:end - 1]).float(), dim=-1).topk(2, dim=-1)
                for start, end in spans]


def answer_margins(loaded, case, texts: list[str]) -> list[float | None]:
    """Per turn: dense's answer margin, None when the rebuilt answer is not its greedy continuation
    or no accepted answer is in it."""
    from snapcompile.evaluation.metrics import answer_margin
    ids, spans = dense_conversation(loaded, case, texts)
    margins = []
    for turn, ((start, end), top) in enumerate(zip(spans, teacher_forced_top2(loaded.model, ids, spans))):
        answer = ids[start:end]
        if top.indices[:, 0].tolist() != answer:
            margins.append(None)
            continue
        text = loaded.tokenizer.decode(answer, skip_special_tokens=True)
        found = case.found(turn, text)
        pairs = [list(zip(i.tolist(), v.tolist())) for i, v in zip(top.indices, top.values)]
        result = SimpleNamespace(text=text, output_ids=answer, top_logprobs=pairs)
        margins.append(None if found is None else answer_margin(loaded.tokenizer, result, found))
    return margins


def tally(records: list[dict], margins: dict, sure: float) -> dict:
    """Per variant: later answers dense gave right and the variant kept, overall and where dense
    was sure; the lost ones with dense's margin."""
    dense = {(r["case"], t["turn"]): t["correct"] for r in records if r["variant"] == "dense" for t in r["turns"]}
    out = {}
    for variant in dict.fromkeys(r["variant"] for r in records if r["variant"] != "dense"):
        right = [(r["case"], t["turn"], t["correct"]) for r in records if r["variant"] == variant
                 for t in r["turns"] if t["turn"] > 1 and dense.get((r["case"], t["turn"]))]
        certain = [c for case, turn, c in right if (margins.get(f"{case}/{turn}") or 0) >= sure]
        out[variant] = {"dense_right": len(right), "kept": sum(c for *_, c in right),
                        "dense_sure": len(certain), "kept_of_sure": sum(certain),
                        "lost": [{"case": case, "turn": turn, "dense_margin": margins.get(f"{case}/{turn}")}
                                 for case, turn, c in right if not c]}
    return out


def _margin(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("studies", nargs="+", help="resume_study.py JSON files (with dense records)")
    parser.add_argument("--sure", type=float, default=SURE_MARGIN, help="dense was sure at this margin or more")
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    try:
        studies = [json.loads(Path(p).read_text(encoding="utf-8")) for p in args.studies]
        runs = [(s["args"], s["records"]) for s in studies]
    except (OSError, ValueError, KeyError, TypeError) as err:
        parser.error(f"not resume_study.py JSON: {err}")
    import torch

    from snapcompile.evaluation.conversations import make_conversation
    from snapcompile.models import load_model
    torch.manual_seed(0)
    loaded, margins, records = None, {}, []
    for study_args, study_records in runs:
        records += study_records
        loaded = loaded or load_model(study_args["model"])
        for record in (r for r in study_records if r["variant"] == "dense"):
            if f"{record['case']}/1" in margins:         # a study run with --reference repeats dense's records
                continue
            part, kind, _, sample = record["case"].split("/")          # resume_study's case.key
            case = make_conversation(loaded.tokenizer, kind, part, study_args["seed"], study_args["length"],
                                     int(sample[1:]), loaded.chat)
            texts = [t["text"] for t in record["turns"]]
            for turn, margin in enumerate(answer_margins(loaded, case, texts), 1):
                margins[f"{case.key}/{turn}"] = margin
            print(f"{case.key}: " + " ".join(_margin(margins[f"{case.key}/{t}"]) for t in range(1, len(texts) + 1)),
                  file=sys.stderr, flush=True)
    summary = tally(records, margins, args.sure)
    for variant, s in summary.items():
        lost = ", ".join(f"{x['case']} t{x['turn']} ({_margin(x['dense_margin'])})" for x in s["lost"])
        print(f"{variant:>10}  kept {s['kept']}/{s['dense_right']} of dense's right later answers, "
              f"{s['kept_of_sure']}/{s['dense_sure']} where dense was sure (margin >= {args.sure}); lost: {lost}")
    if args.json_path:
        from snapcompile.atomic import write_json_atomic
        write_json_atomic(args.json_path, {"studies": args.studies, "sure": args.sure, "margins": margins,
                                           "summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
