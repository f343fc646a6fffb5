"""Next-token choice from logits: bias and penalties, then greedy or temperature, top-k, top-p,
min-p (SamplingParams states the semantics). Every step is numpy over the vocabulary."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from snapcompile.engine.request import SamplingParams


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator,
           prompt_ids: Sequence[int] = (), output_ids: Sequence[int] = ()) -> int:
    """logits: [V] float32; `prompt_ids` and `output_ids`: the sequence's tokens so far (read by
    the penalties only). Greedy when temperature is 0 (ties to the lowest id)."""
    if params.penalized:
        logits = penalized_logits(logits, params, prompt_ids, output_ids)
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
    if params.min_p > 0.0:
        keep = int(np.count_nonzero(probs >= params.min_p * probs[0]))      # probs are sorted, largest first
        order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
    return int(order[rng.choice(len(order), p=probs)])


def penalized_logits(logits: np.ndarray, params: SamplingParams, prompt_ids: Sequence[int],
                     output_ids: Sequence[int]) -> np.ndarray:
    """logits [V] with the bias added and the repetition, frequency and presence penalties applied
    (a float64 copy)."""
    adjusted = logits.astype(np.float64)
    if params.logit_bias:
        tokens, biases = zip(*params.logit_bias)
        adjusted[list(tokens)] += biases
    if params.repetition_penalty != 1.0:
        seen = np.unique(np.concatenate([np.asarray(prompt_ids, np.int64), np.asarray(output_ids, np.int64)]))
        values = adjusted[seen]
        adjusted[seen] = np.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if (params.frequency_penalty or params.presence_penalty) and len(output_ids):
        counts = np.bincount(np.asarray(output_ids, np.int64), minlength=adjusted.size)
        adjusted -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    return adjusted


@dataclass(frozen=True)
class PromptLogprob:
    """A prompt token's natural-log probability given the tokens before it, its rank among the
    vocabulary (1: the likeliest; ties share the best rank) and the request's `top` likeliest tokens
    there (as top_logprobs gives them)."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


def prompt_logprobs(logits: np.ndarray, tokens, k: int) -> list[PromptLogprob]:
    """Each row's PromptLogprob: `tokens[r]` under logits [R, V] float32 of the position before it,
    with the k likeliest there (ties to the lower id). Exponentials in float32, sums in float64: a
    token's log probability and the top entries' come from the same numbers (a greedy token's equals
    the top one's exactly)."""
    rows = np.arange(len(logits))
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_norm = np.log(np.exp(shifted).sum(axis=1, dtype=np.float64))
    picked = shifted[rows, np.asarray(tokens)]
    ranks = 1 + np.count_nonzero(shifted > picked[:, None], axis=1)
    if k == 1:                     # lm-eval's case: argmax (the lowest id of a tie) of every row at once
        likeliest = shifted.argmax(axis=1)
        tops = [[(int(i), float(shifted[r, i]) - float(log_norm[r]))] for r, i in enumerate(likeliest)]
    else:
        tops = [_top(shifted[r], float(log_norm[r]), k) for r in rows]
    return [PromptLogprob(int(token), float(picked[r]) - float(log_norm[r]), int(ranks[r]), tops[r])
            for r, token in enumerate(tokens)]


def top_logprobs(logits: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The k most likely tokens of logits [V] as (token id, natural-log probability), most likely
    first (ties to the lower id, as greedy sampling breaks them)."""
    return _top(*_shifted_log_norm(logits), k)


def _top(shifted: np.ndarray, log_norm: float, k: int) -> list[tuple[int, float]]:
    k = min(k, shifted.size)
    if k <= 0:
        return []
    kth = np.partition(shifted, shifted.size - k)[shifted.size - k]   # O(V): no sort of the vocabulary
    candidates = np.flatnonzero(shifted >= kth)
    order = candidates[np.lexsort((candidates, -shifted[candidates]))][:k]
    return [(int(i), float(shifted[i]) - log_norm) for i in order]


def token_logprob(logits: np.ndarray, token: int) -> float:
    """The natural-log probability of `token` under logits [V]."""
    shifted, log_norm = _shifted_log_norm(logits)
    return float(shifted[token] - log_norm)


def _shifted_log_norm(logits: np.ndarray) -> tuple[np.ndarray, float]:
    """logits - max (float64) and the log of the softmax denominator of those shifted logits."""
    shifted = logits.astype(np.float64) - float(logits.max())
    return shifted, float(np.log(np.exp(shifted).sum()))
