"""Dense's own margin on the RULER samples a compressed cell lost.

lm-eval's `local-completions` asks for text only, so how close dense itself came to the lost
answer is measured afterwards: dense's request (the prompt lm-eval sent, from its per-sample log)
is replayed greedily through the dense artifact with the two likeliest tokens of every step, and
read at the step where the compressed cell's answer first parts from dense's. A margin near 0 there
means dense was itself a coin toss between the two continuations (a near-tie the compression
tipped); near 1, dense was sure and the compression lost something it needed.
"""
from __future__ import annotations

import math
from pathlib import Path

MARGIN_TOP = 2                 # top log-probabilities per step: the two likeliest


def parting_char(dense: str, other: str) -> int:
    """Index of the first character where `other` leaves `dense`; the shorter one's length when one
    answer is the start of the other."""
    for index, (a, b) in enumerate(zip(dense, other)):
        if a != b:
            return index
    return min(len(dense), len(other))


def step_at(tokenizer, output_ids: list[int], char: int) -> int | None:
    """The generation step whose token emits the character at index `char` of the decoded output
    (None when the output is shorter)."""
    for step in range(len(output_ids)):
        if len(tokenizer.decode(output_ids[:step + 1], skip_special_tokens=True)) > char:
            return step
    return None


def margin_at(tokenizer, result, dense_answer: str, char: int) -> dict:
    """From dense's replayed `result` (greedy, with top_logprobs >= 2): the step that writes
    character `char` (or the EOS that ended dense's answer before it), the gap p1 - p2 between
    dense's two likeliest tokens there (0..1) and those two tokens' text; `replayed` says the
    replay wrote `dense_answer` up to that character (else the margin would belong to another
    continuation and is None)."""
    replayed = result.text[:char + 1] == dense_answer[:char + 1] or result.text.startswith(dense_answer)
    step = step_at(tokenizer, result.output_ids, char)
    if step is None and result.finish_reason == "eos":
        step = len(result.output_ids) - 1        # dense ended its answer where the cell wrote on
    top = result.top_logprobs[step] if step is not None and step < len(result.top_logprobs) else []
    if not replayed or len(top) < 2:
        return {"dense_margin": None, "parting_step": step, "replayed": replayed}
    (first, lp1), (second, lp2) = top[0], top[1]
    return {"dense_margin": math.exp(lp1) - math.exp(lp2), "parting_step": step, "replayed": True,
            "dense_choices": [tokenizer.decode([first]), tokenizer.decode([second])]}


def read_log(path: Path) -> dict[tuple[str, int], dict]:
    """lm-eval's per-sample log (ruler.evaluate_served) by (task, doc_id); empty when absent."""
    from snapcompile.errors import parse_json
    from snapcompile.userfiles import json_lines
    path = Path(path)
    if not path.is_file():
        return {}
    lines = json_lines(path.read_text(encoding="utf-8"))
    entries = (parse_json(line, f"{path} line {n}") for n, line in enumerate(lines, 1) if line.strip())
    return {(e["task"], e["doc_id"]): e for e in entries}


def measure(engine, dense_log: dict, lost: list[dict], cell_logs: dict[str, dict]) -> dict[str, dict]:
    """Dense's margin on each `lost` sample (ruler_report.lost_samples items of one weights and
    length), keyed by `margin_id`. `dense_log`: dense's per-sample log; `cell_logs`: each cell's.
    One replay per (task, doc_id), shared by every cell that lost it; a sample whose prompt or
    answers are not in the logs, or whose log entries hold another prompt (input_sha), gets no entry."""
    from snapcompile.engine.request import Request
    from snapcompile.prompts import encode_prompt, encode_text
    wanted: dict[tuple[str, int], list[tuple[dict, int]]] = {}
    for item in lost:
        key = (item["task"], item["doc_id"])
        dense, mine = dense_log.get(key, {}), cell_logs.get(item["cell"], {}).get(key, {})
        if dense and mine and dense.get("input_sha") == mine.get("input_sha") == item["input_sha"]:
            wanted.setdefault(key, []).append((item, parting_char(dense["answer"], mine["answer"])))
    requests = {}
    for key, items in wanted.items():
        entry = dense_log[key]
        steps = len(encode_text(engine.tokenizer, entry["answer"][:max(c for _, c in items) + 1])) + 4
        requests[key] = Request(encode_prompt(engine.tokenizer, entry["context"]), top_logprobs=MARGIN_TOP,
                                max_new_tokens=max(1, min(steps, int(entry["gen_kwargs"].get("max_gen_toks", steps)))))
    results = dict(zip(requests, engine.generate(requests.values())))
    return {margin_id(item): margin_at(engine.tokenizer, results[key], dense_log[key]["answer"], char)
            for key, items in wanted.items() for item, char in items}


def margin_id(item: dict) -> str:
    return f"margin|{item['weights']}|{item['cell']}|{item['length']}|{item['task']}|{item['doc_id']}"
