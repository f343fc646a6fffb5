"""Retrieval cases (pass-key, multi-key) through the Engine with continuous batching: the answer
must appear in the generated text."""
from __future__ import annotations

from pathlib import Path

from snapcompile.evaluation.config import ANSWER_TOKENS, TOP_LOGPROBS
from snapcompile.evaluation.metrics import answer_margin
from snapcompile.evaluation.partial_results import ResultStore
from snapcompile.evaluation.tasks import Case


def run_retrieval(folder: Path, cases: list[Case], policy: str, budget: int | None, chat: bool,
                   store: ResultStore, progress) -> None:
    from snapcompile.engine.engine import Engine
    from snapcompile.engine.request import Request
    engine = Engine.from_artifact(folder, session_cache_bytes=0)
    by_id = {}
    for case in cases:
        request = Request(engine.encode(case.prompt, chat), max_new_tokens=ANSWER_TOKENS,
                          request_id=store.record_id(case, policy, budget), top_logprobs=TOP_LOGPROBS)
        by_id[request.request_id] = (case, request)
    for event in engine.stream([r for _, r in by_id.values()]):
        if not event.finished:
            continue
        case, _ = by_id[event.request_id]
        result = engine.result(event.request_id)
        correct = result.error is None and case.answer in result.text
        store.add({"id": event.request_id, "policy": policy, "budget": budget, **case.to_dict(),
                   "prompt_tokens": result.prompt_tokens, "text": result.text, "error": result.error,
                   "correct": correct,
                   "answer_margin": answer_margin(engine.tokenizer, result, case.answer) if correct else None})
        if progress:
            progress(1, None)
