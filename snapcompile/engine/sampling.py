"""Next-token choice from logits: greedy, temperature, top-k, top-p."""
from __future__ import annotations

import numpy as np

from snapcompile.engine.request import SamplingParams


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """logits: [V] float32. Greedy when temperature is 0 (ties to the lowest id)."""
    if params.temperature == 0.0:
        return int(np.argmax(logits))
    scaled = logits.astype(np.float64) / params.temperature
    order = np.argsort(-scaled, kind="stable")
    if params.top_k:
        order = order[: params.top_k]
    probs = np.exp(scaled[order] - scaled[order[0]])
    probs /= probs.sum()
    if params.top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(probs), params.top_p) + 1)
        order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
    return int(order[rng.choice(len(order), p=probs)])


def top_logprobs(logits: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The k most likely tokens of logits [V] as (token id, natural-log probability), most likely
    first (ties to the lower id, as greedy sampling breaks them)."""
    scaled = logits.astype(np.float64)
    log_probs = scaled - scaled.max()
    log_probs -= np.log(np.exp(log_probs).sum())
    order = np.argsort(-log_probs, kind="stable")[:k]
    return [(int(i), float(log_probs[i])) for i in order]
