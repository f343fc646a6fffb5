"""The cache policy's math in PyTorch: SnapKV selection, StreamingLLM's kept positions, ring decode
attention. The oracle (snapcompile.reference.oracle) and the custom ops' PyTorch implementations
(plugins.torch_ops) both use it; every backend is checked against it.

Shapes use H query heads, Hkv KV heads (G = H / Hkv), W window, T prompt length, D head dim.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from snapcompile.config import PolicyConfig


@dataclass(frozen=True)
class Selection:
    """Kept prompt positions of one layer.

    indices: [Hkv, P] int64, ascending per head. scores: [Hkv, T] float32 pooled scores of the
    candidates (sinks, window and positions >= T hold -inf); None for streamingllm.
    """

    indices: torch.Tensor
    scores: torch.Tensor | None


def window_scores(window_query: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention the last W prompt queries pay to each prefix position.

    window_query: [H, W, D] post-RoPE queries of positions T-W..T-1; keys: [Hkv, T, D] post-RoPE.
    Returns [Hkv, T-W]: softmax probabilities (causal inside the window) averaged over the W
    queries and over the G query heads of each KV head.
    """
    heads, window, _ = window_query.shape
    kv_heads, length, _ = keys.shape
    group = heads // kv_heads
    q = window_query.reshape(kv_heads, group * window, -1)           # [Hkv, G*W, D]
    logits = torch.matmul(q, keys.transpose(1, 2)) * scale             # [Hkv, G*W, T]
    device = keys.device
    query_pos = (length - window) + torch.arange(group * window, device=device) % window
    visible = torch.arange(length, device=device)[None, :] <= query_pos[:, None]      # [G*W, T]
    logits = logits.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return probs.mean(dim=1)[:, : length - window]


def pool_scores(scores: torch.Tensor, kernel: int, kind: str) -> torch.Tensor:
    """Stride-1 "same" pooling along the last axis of [R, n] scores.

    max pads with -inf; avg is the sum of the K neighbours / K with zero padding counted.
    """
    pad = kernel // 2
    x = scores[:, None, :]
    if kind == "max":
        return torch.nn.functional.max_pool1d(x, kernel, stride=1, padding=pad)[:, 0]
    return torch.nn.functional.avg_pool1d(x, kernel, stride=1, padding=pad, count_include_pad=True)[:, 0]


def top_positions(candidate_scores: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the `count` largest scores per row; ties go to the lower index (ONNX TopK)."""
    order = torch.sort(candidate_scores, dim=-1, descending=True, stable=True).indices
    return order[:, :count]


def snapkv_select(window_query: torch.Tensor, keys: torch.Tensor, cfg: PolicyConfig,
                  scale: float, scorer=window_scores) -> Selection:
    """SnapKV selection of one layer for a prompt of T > P tokens (docs/design.md, "The cache policy").

    scorer: the window_scores implementation (the Triton kernel passes its own).
    """
    kv_heads, length, _ = keys.shape
    share, sinks, window = cfg.resolved_prompt_share, cfg.sinks, cfg.window
    prefix = scorer(window_query, keys, scale)                         # [Hkv, T-W]
    if cfg.scope == "layer":
        prefix = prefix.sum(dim=0, keepdim=True)                       # [1, T-W], summed before pooling
    prefix = pool_scores(prefix, cfg.kernel, cfg.pooling)
    scores = torch.full((prefix.shape[0], length), float("-inf"), device=keys.device)
    scores[:, sinks: length - window] = prefix[:, sinks:]
    chosen = top_positions(scores, share - sinks - window)
    device = keys.device
    fixed = torch.cat([torch.arange(sinks, device=device), torch.arange(length - window, length, device=device)])
    fixed = fixed.expand(prefix.shape[0], -1)
    indices = torch.sort(torch.cat([fixed, chosen], dim=1), dim=1).values
    return Selection(indices.expand(kv_heads, -1).contiguous(), scores.expand(kv_heads, -1).contiguous())


def streaming_select(length: int, kv_heads: int, cfg: PolicyConfig) -> Selection:
    """StreamingLLM: the first S positions and the most recent P - S."""
    kept = torch.tensor(cfg.streaming_positions(length), dtype=torch.int64)
    return Selection(kept.expand(kv_heads, -1).contiguous(), None)


def ring_decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          key_cache: torch.Tensor, value_cache: torch.Tensor, write_index: torch.Tensor,
                          cache_len: torch.Tensor, scale: float) -> torch.Tensor:
    """One decode step of fixed-budget GQA attention (the reference of the fused decode op).

    query: [N, Hkv, G, D]; key, value: [N, Hkv, 1, D] (the new token, post-RoPE);
    key_cache, value_cache: [N, Hkv, B, D]; write_index, cache_len: [N] int64.
    Each query attends to cache rows r < cache_len with r != write_index (that row is being
    overwritten by the new token) and to the new token. Computed in float32; returns
    [N, Hkv, G, D] in the query's dtype. The caches are not modified.
    """
    q, k, v = query.float(), key.float(), value.float()
    rows = torch.arange(key_cache.shape[2], device=query.device)
    visible = (rows[None] < cache_len[:, None]) & (rows[None] != write_index[:, None])    # [N, B]
    s_cache = torch.matmul(q, key_cache.float().transpose(-1, -2)) * scale               # [N,Hkv,G,B]
    s_cache = s_cache.masked_fill(~visible[:, None, None, :], float("-inf"))
    s_new = torch.matmul(q, k.transpose(-1, -2)) * scale                                # [N,Hkv,G,1]
    probs = torch.softmax(torch.cat([s_cache, s_new], dim=-1), dim=-1)
    out = torch.matmul(probs[..., :-1], value_cache.float()) + probs[..., -1:] * v
    return out.to(query.dtype)
