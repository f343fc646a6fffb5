"""Fidelity cases: dense greedy continuations, teacher-forced through each policy's backend to
compare next-token distributions (agreement of the argmax, KL from dense)."""
from __future__ import annotations

import numpy as np

from snapcompile.artifact.cache import ArtifactCache
from snapcompile.evaluation.config import FIDELITY_TOKENS, EvalConfig, policy_for
from snapcompile.evaluation.metrics import kl_divergence
from snapcompile.evaluation.store import ResultStore
from snapcompile.evaluation.tasks import Case


def run_fidelity(config: EvalConfig, cases: list[Case], pending: dict, cache: ArtifactCache, store: ResultStore,
                  tokenizer, progress) -> None:
    """pending: (policy, budget) -> the cases still to run for it."""
    from snapcompile.prompts import encode
    from snapcompile.runtime.ort_backend import OrtBackend
    if not any(pending.values()):
        return
    dense_backend = OrtBackend(cache.dense(config.reference_export))
    prompts = {c.key: encode(tokenizer, c.prompt, chat=False) for c in cases}
    dense = {c.key: _teacher_forced(dense_backend, prompts[c.key], None) for c in cases
             if any(c in todo for todo in pending.values())}
    del dense_backend
    for (policy, budget), todo in pending.items():
        if not todo:
            continue
        policy_config = policy_for(policy, budget, config.scope)
        quantized_dense = policy == "dense" and config.weight_format != "fp32"
        backend = OrtBackend(cache.get(config.export, policy_config)) if policy != "dense" or quantized_dense else None
        for case in todo:
            tokens, reference = dense[case.key]
            logits = reference if backend is None else _teacher_forced(backend, prompts[case.key], tokens)[1]
            store.add({"id": store.record_id(case, policy, budget), "policy": policy, "budget": budget,
                       **case.to_dict(), "prompt_tokens": len(prompts[case.key]),
                       "agreement": float(np.mean(np.argmax(logits, -1) == tokens)),
                       "kl": float(np.mean(kl_divergence(reference, logits)))})
            if progress:
                progress(1, None)


def _teacher_forced(backend, prompt: list[int], tokens: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Greedy continuation (tokens None) or teacher-forced logits; returns (tokens, logits [S, V])."""
    result = backend.prefill(0, prompt)
    logits, chosen = [result.logits], []
    for g in range(FIDELITY_TOKENS):
        token = int(np.argmax(logits[-1])) if tokens is None else int(tokens[g])
        chosen.append(token)
        if g == FIDELITY_TOKENS - 1:
            break
        logits.append(backend.decode({0: token}, {0: result.layout.step(g)})[0].copy())
    return np.array(chosen), np.stack(logits)
