"""Timing of one system at one point (context T, slots N).

Decode timings start from slots that hold a context of T tokens. The graphs' work does not
depend on the cache contents, so slots are set up by their layouts without running N prefills
(only the prompt length matters: the dense graph masks rows >= T, the compressed one holds B
rows). The PyTorch eager baseline gets a DynamicCache of T random tokens per sequence and runs
the same forward call `generate` runs per step (sdpa attention, cache appended each step).
"""
from __future__ import annotations

import inspect
import time

import numpy as np
import torch

from snapcompile.layout import SlotLayout
from snapcompile.models.spec import hf_head_dim


def ort_decode_seconds(backend, context: int, slots: int, steps: int, seed: int = 0) -> list[float]:
    """Seconds of each of `steps` decode steps with `slots` active slots at context T."""
    share = backend.manifest.policy.resolved_prompt_share if backend.manifest.policy.compressed else None
    layouts = {s: SlotLayout.for_prompt(context, backend.rows_per_slot, share) for s in range(slots)}
    rng = np.random.default_rng(seed)
    vocab = backend.manifest.spec.vocab_size
    seconds = []
    for g in range(steps):
        tokens = {s: int(rng.integers(0, vocab)) for s in layouts}
        start = time.perf_counter()
        backend.decode(tokens, {s: layout.step(g) for s, layout in layouts.items()})
        seconds.append(time.perf_counter() - start)
    return seconds


def ort_prefill_seconds(backend, context: int, seed: int = 0) -> tuple[float, float]:
    """(total seconds, seconds spent in selection) of one prompt of `context` tokens."""
    rng = np.random.default_rng(seed)
    tokens = [int(t) for t in rng.integers(0, backend.manifest.spec.vocab_size, context)]
    start = time.perf_counter()
    backend.prefill(0, tokens)
    return time.perf_counter() - start, backend.last_prefill_seconds["select"]


@torch.no_grad()
def eager_decode_seconds(model, context: int, slots: int, steps: int, seed: int = 0) -> list[float]:
    from transformers import DynamicCache
    config = model.config
    kv_heads = config.num_key_value_heads
    head_dim = hf_head_dim(config)
    gen = torch.Generator().manual_seed(seed)
    cache = DynamicCache()
    for layer in range(config.num_hidden_layers):
        k = torch.randn(slots, kv_heads, context, head_dim, generator=gen)
        cache.update(k, torch.randn_like(k), layer)
    # transformers 5.x renamed past_key_values to cache
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    seconds = []
    for g in range(steps):
        ids = torch.randint(0, config.vocab_size, (slots, 1), generator=gen)
        position = torch.full((slots, 1), context + g)
        start = time.perf_counter()
        model(input_ids=ids, position_ids=position, use_cache=True, logits_to_keep=1, **{cache_arg: cache})
        seconds.append(time.perf_counter() - start)
    return seconds


@torch.no_grad()
def eager_prefill_seconds(model, context: int, seed: int = 0) -> float:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (1, context), generator=gen)
    start = time.perf_counter()
    model(input_ids=ids, use_cache=True, logits_to_keep=1)
    return time.perf_counter() - start


def eager_kv_bytes(model, context: int, slots: int) -> int:
    """KV bytes an eager DynamicCache holds for `slots` sequences of `context` tokens (fp32)."""
    c = model.config
    head_dim = hf_head_dim(c)
    return 2 * c.num_hidden_layers * slots * c.num_key_value_heads * context * head_dim * 4
