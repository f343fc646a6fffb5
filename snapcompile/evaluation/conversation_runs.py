"""Runs `eval-turns`: every (mode, conversation) through the artifacts, one conversation at a time
(turn k+1 needs turn k's answer), resumable per conversation (`conversation_eval.TurnsStore`)."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from snapcompile.evaluation.config import TOP_LOGPROBS
from snapcompile.evaluation.conversation_eval import (
    MODES,
    TurnsConfig,
    TurnsStore,
    engine_turns,
    first_turn,
    next_turn_tokens,
    rows_kept_of,
    session_keep_of,
)
from snapcompile.evaluation.conversations import TURNS, Conversation
from snapcompile.evaluation.metrics import answer_margin
from snapcompile.prompts import encode_text

STORE_BYTES = 2**30        # the resume mode's session store (one conversation's entries at a time)


def run_turns(config: TurnsConfig, output: Path, cache_dir: Path, progress: Callable[[int], None] | None = None,
              log: Callable[[str], None] = print) -> list[dict]:
    """Every mode on every conversation not yet in the store; returns all records."""
    from snapcompile.artifact.files import artifact_tokenizer
    from snapcompile.artifact.manifest import read_manifest
    from snapcompile.compiler.cache import ArtifactCache
    store = TurnsStore(output, config)
    cache = ArtifactCache(config.source, cache_dir, log)
    dense = cache.dense(config.export())
    manifest = read_manifest(dense)
    tokenizer, chat = artifact_tokenizer(dense, manifest), manifest.chat
    for length in config.lengths:
        cases = config.conversations(tokenizer, length, chat)
        compressed = cache.get(config.export(), config.policy_at(length))
        folders = {mode: dense if mode == "dense" else compressed for mode in MODES}
        for mode in config.modes:
            todo = [c for c in cases if f"{mode}/{c.key}" not in store.records]
            if not todo:
                continue
            converse = _ring_runner(folders[mode], tokenizer, chat) if mode == "ring" else \
                _engine_runner(folders[mode], tokenizer, chat, STORE_BYTES if mode.startswith("resume") else 0,
                               session_keep_of(mode))
            for case in todo:
                store.add({"id": f"{mode}/{case.key}", "mode": mode, "case": case.key, "kind": case.kind,
                           "length": length,
                           "budget": None if mode == "dense" else config.budget(length), "turns": converse(case)})
                if progress:
                    progress(1)
    return list(store.records.values())


def _turn_record(tokenizer, case: Conversation, turn: int, result, prompt_tokens: int,
                 asked_kept: float | None = None) -> dict:
    """result: the turn's engine Result, or (for the ring) one with text, output_ids and no
    top_logprobs. margin: how firmly the answer found was chosen (metrics.answer_margin; None
    when it is not in the reply). asked_kept: the share of (layer, KV head) pairs whose cache held
    the answer while answering (resume mode; None elsewhere)."""
    error = getattr(result, "error", None)
    found = case.found(turn, result.text) if error is None else None
    return {"turn": turn + 1, "asked_depth": case.depths[turn], "answer": case.answers[turn][0],
            "text": result.text, "correct": found is not None, "error": error,
            "margin": answer_margin(tokenizer, result, found) if found else None,
            "prompt_tokens": prompt_tokens, "cached_tokens": getattr(result, "cached_tokens", 0),
            "ttft_s": getattr(result, "ttft_s", None), "asked_kept": asked_kept}


def _engine_runner(folder: Path, tokenizer, chat: bool, session_bytes: int, session_keep: str):
    """A function running one conversation through an Engine (with a session store when session_bytes)."""
    from snapcompile.engine.engine import Engine
    engine = Engine.from_artifact(folder, session_cache_bytes=session_bytes, session_keep=session_keep)

    def asked_kept(case: Conversation, turn: int, ids: list[int]) -> float | None:
        kept = engine.sessions.newest() if engine.sessions is not None else None
        if kept is None or not engine.backend.manifest.policy.compressed or session_keep != "slot":
            return None
        return rows_kept_of(kept, ids, encode_text(tokenizer, case.answers[turn][0]))

    def converse(case: Conversation) -> list[dict]:
        turns = engine_turns(engine, chat, first_turn(tokenizer, case, chat), list(case.questions[1:]),
                             list(case.answer_tokens), top_logprobs=TOP_LOGPROBS)
        return [_turn_record(tokenizer, case, turn, result, len(ids), asked_kept(case, turn, ids))
                for turn, (ids, result) in enumerate(turns)]
    return converse


def _ring_runner(folder: Path, tokenizer, chat: bool):
    """A function running one conversation on the backend itself: after turn 1's prefill every
    token (answers and the later turns alike) goes through decode steps into the ring."""
    from types import SimpleNamespace

    from snapcompile.artifact.manifest import read_manifest
    from snapcompile.runtime import open_backend
    backend = open_backend(folder, "ort")
    eos = set(read_manifest(folder).eos_token_ids)

    def converse(case: Conversation) -> list[dict]:
        ids = first_turn(tokenizer, case, chat)
        prefill = backend.prefill(0, ids)
        layout, logits, fed, turns = prefill.layout, prefill.logits, 0, []

        def feed(token: int) -> np.ndarray:
            nonlocal fed
            out = backend.decode({0: token}, {0: layout.step(fed)})[0].copy()
            fed += 1
            return out
        for turn in range(TURNS):
            output = [int(np.argmax(logits))]
            while output[-1] not in eos and len(output) < case.answer_tokens[turn]:
                logits = feed(output[-1])
                output.append(int(np.argmax(logits)))
            text = tokenizer.decode(output, skip_special_tokens=True)
            turns.append(_turn_record(tokenizer, case, turn, SimpleNamespace(text=text, output_ids=output,
                                                                             top_logprobs=[]), len(ids)))
            if turn + 1 < TURNS:
                new = [output[-1], *next_turn_tokens(tokenizer, case.questions[turn + 1], chat, output[-1] in eos)]
                for token in new:
                    logits = feed(token)
                ids = ids + output + new[1:]
        return turns
    return converse
