"""Per-case measures: how firmly an answer was chosen, and how far two next-token distributions lie apart."""
from __future__ import annotations

import math

import numpy as np


def answer_margin(tokenizer, result, answer: str) -> float | None:
    """How firmly the answer was chosen: over the generated tokens that spell `answer` (its first
    occurrence in result.text), the least gap between the probabilities of the likeliest and the
    second likeliest token (0..1; near 0: a coin toss between two continuations). None when the
    answer is absent or the result carries no top_logprobs."""
    start = result.text.find(answer)
    if start < 0 or not answer or len(result.top_logprobs) < len(result.output_ids):
        return None
    end, gaps, emitted = start + len(answer), [], 0
    for step, top in enumerate(result.top_logprobs):
        text = tokenizer.decode(result.output_ids[:step + 1], skip_special_tokens=True)
        if emitted < end and len(text) > start and len(top) >= 2:
            gaps.append(math.exp(top[0][1]) - math.exp(top[1][1]))
        emitted = len(text)
        if emitted >= end:
            break
    return min(gaps) if gaps else None


def kl_divergence(reference: np.ndarray, other: np.ndarray) -> np.ndarray:
    """KL(reference || other) per row of logits [S, V]."""
    def log_softmax(x):
        x = x.astype(np.float64)
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))
    p_log, q_log = log_softmax(reference), log_softmax(other)
    return (np.exp(p_log) * (p_log - q_log)).sum(-1)
