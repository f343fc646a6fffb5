"""Fidelity cases: dense greedy continuations, teacher-forced through each policy's backend to
compare next-token distributions (agreement of the argmax, KL from dense), and each policy's own
greedy continuation (where it first leaves dense's).

Long generations (`--generate` past the budget, so the ring buffer wraps) add two measures: the
agreement on the tokens generated after the first B (by then every ring row was overwritten), and
a recall probe on text the model itself generated: after the generation, its first RECALL_CUE
tokens are quoted again, and the next RECALL_TOKENS predictions are scored against what followed
them the first time (dense can look the quote up in its cache; a ring that evicted it cannot).
"""
from __future__ import annotations

import numpy as np

from snapcompile.compiler.cache import ArtifactCache
from snapcompile.evaluation.config import RECALL_CUE, RECALL_TOKENS, EvalConfig, policy_for
from snapcompile.evaluation.metrics import kl_divergence
from snapcompile.evaluation.partial_results import ResultStore
from snapcompile.evaluation.tasks import Case


def run_fidelity(config: EvalConfig, cases: list[Case], pending: dict, cache: ArtifactCache, store: ResultStore,
                 tokenizer, progress) -> None:
    """pending: (policy, budget) -> the cases still to run for it."""
    from snapcompile.prompts import encode
    from snapcompile.runtime.ort_backend import OrtBackend
    if not any(pending.values()):
        return
    steps = config.generate
    dense_backend = OrtBackend(cache.dense(config.reference_export))
    prompts = {c.key: encode(tokenizer, c.prompt, chat=False) for c in cases}
    wanted = [c for c in cases if any(c in todo for todo in pending.values())]
    dense = {c.key: _greedy_with_quote(dense_backend, prompts[c.key], steps) for c in wanted}
    del dense_backend
    for (policy, budget), todo in pending.items():
        if not todo:
            continue
        policy_config = policy_for(policy, budget, config.scope, config.kernel)
        quantized_dense = policy == "dense" and config.export != config.reference_export
        backend = OrtBackend(cache.get(config.export, policy_config)) if policy != "dense" or quantized_dense else None
        for case in todo:
            tokens, reference, dense_recall = dense[case.key]
            if backend is None:
                logits, recall, own = reference, dense_recall, tokens
            else:
                logits, recall = _forced_with_quote(backend, prompts[case.key], tokens)
                own = _decode(backend, prompts[case.key], steps, _greedy)[0]
            store.add({"id": store.record_id(case, policy, budget), "policy": policy, "budget": budget,
                       **case.to_dict(), "prompt_tokens": len(prompts[case.key]), "generated": steps,
                       **_measures(logits, reference, tokens, own, budget),
                       "recall": recall, "dense_recall": dense_recall})
            if progress:
                progress(1, None)


def _measures(logits: np.ndarray, reference: np.ndarray, tokens: np.ndarray, own: np.ndarray,
              budget: int | None) -> dict:
    """agreement / kl over every generated token; agreement_past_budget over those after the first
    `budget` (None when there are none); first_divergence: the index of the first token of the
    policy's own greedy continuation that differs from dense's (len(tokens) when none does)."""
    agree = np.argmax(logits, -1) == tokens
    differs = np.flatnonzero(own != tokens)
    past = agree[budget:] if budget is not None and budget < len(tokens) else None
    return {"agreement": float(np.mean(agree)), "kl": float(np.mean(kl_divergence(reference, logits))),
            "agreement_past_budget": float(np.mean(past)) if past is not None else None,
            "first_divergence": int(differs[0]) if differs.size else len(tokens)}


def _decode(backend, prompt: list[int], steps: int, token_at) -> tuple[np.ndarray, np.ndarray]:
    """Prefill, then `steps` positions; token_at(g, logits, chosen) is the token at position g given
    the logits predicting it and the tokens chosen before. Returns (tokens [S], logits [S, V])."""
    result = backend.prefill(0, prompt)
    logits, chosen = [result.logits], []
    for g in range(steps):
        chosen.append(int(token_at(g, logits[-1], chosen)))
        if g == steps - 1:
            break
        logits.append(backend.decode({0: chosen[-1]}, {0: result.layout.step(g)})[0].copy())
    return np.array(chosen), np.stack(logits)


def _greedy(g: int, logits: np.ndarray, chosen: list[int]) -> int:
    return int(np.argmax(logits))


def _greedy_with_quote(backend, prompt: list[int], steps: int) -> tuple[np.ndarray, np.ndarray, float]:
    """The reference in one pass: `steps` greedy tokens, then the quote of their first RECALL_CUE +
    RECALL_TOKENS; returns (tokens [steps], logits [steps, V], recall probe)."""
    quote = RECALL_CUE + RECALL_TOKENS
    tokens, logits = _decode(backend, prompt, steps + quote,
                             lambda g, last, chosen: np.argmax(last) if g < steps else chosen[g - steps])
    return tokens[:steps], logits[:steps], _recall(logits, tokens[:quote], steps)


def _forced_with_quote(backend, prompt: list[int], tokens: np.ndarray) -> tuple[np.ndarray, float]:
    """`tokens` (the generation) teacher-forced, then its first RECALL_CUE + RECALL_TOKENS tokens
    once more: returns the logits over the generation [len(tokens), V] and the recall probe."""
    quoted = tokens[:RECALL_CUE + RECALL_TOKENS]
    fed = np.concatenate([tokens, quoted])
    logits = _decode(backend, prompt, len(fed), lambda g, last, chosen: fed[g])[1]
    return logits[:len(tokens)], _recall(logits, quoted, len(tokens))


def _recall(logits: np.ndarray, quoted: np.ndarray, steps: int) -> float:
    """The share of the quote's last RECALL_TOKENS tokens predicted (argmax) from the tokens
    before them; the quote starts at position `steps` of `logits`."""
    return float(np.mean(np.argmax(logits[steps + RECALL_CUE:], -1) == quoted[RECALL_CUE:]))
