"""The standard-op cached-attention subgraphs, emitted by the exporter and matched by the passes.

Two forms, chosen by how many queries read the cache:
- split (decode, one query per head): scores against the cache and against the new tokens are
  computed separately, joined for one softmax, and the two value products are summed, so the
  cache is never concatenated (copied) for a score matrix of a few rows;
- joined (prefill, C queries per head): the cache and the chunk's K/V are concatenated once and
  read by one score product, one mask, one softmax and one value product. Copying the K/V rows
  (2 x R x D per KV head) is G x C / D times cheaper than the split form's join and split of the
  score matrix (2 x G x C x R per KV head): at SmolLM2's 256-token chunk over 4096 rows, one
  layer's attention takes 28 instead of 39 ms (docs/results/performance.md).
"""
from __future__ import annotations

import numpy as np

from snapcompile.graphs.builder import GraphBuilder, Size, SymbolicSize

MASK_MIN = float(np.finfo(np.float32).min)  # additive mask value of a hidden slot; finite, never NaN


def emit_cached_attention(b: GraphBuilder, q: str, k_new: str, v_new: str, k_cache: str,
                          v_cache: str, cache_mask: str, scale: float, cache_len: int, new_len: int) -> str:
    """Masked GQA attention over [cache ; new tokens], split form (decode).

    q: [Bt, Hkv, R, D] queries (R = G query heads x queries per sequence), post-RoPE.
    k_new, v_new: [Bt, Hkv, new_len, D]; k_cache, v_cache: [Bt, Hkv, cache_len, D].
    cache_mask: additive, broadcastable to [Bt, Hkv, R, cache_len] (0 visible, MASK_MIN hidden).
    Every query sees every new token (decode feeds one); C causal queries take the joined form.
    Returns [Bt, Hkv, R, D].
    """
    scale_c = b.const(scale, np.float32)
    s_cache = b.op("Mul", b.op("MatMul", q, b.op("Transpose", k_cache, perm=[0, 1, 3, 2])), scale_c)
    s_cache = b.op("Add", s_cache, cache_mask)                               # [Bt,Hkv,R,Lc]
    s_new = b.op("Mul", b.op("MatMul", q, b.op("Transpose", k_new, perm=[0, 1, 3, 2])), scale_c)
    probs = b.op("Softmax", b.op("Concat", s_cache, s_new, axis=-1), axis=-1)
    p_cache, p_new = b.op("Split", probs, b.const([cache_len, new_len]), outputs=2, axis=-1)
    return b.op("Add", b.op("MatMul", p_cache, v_cache), b.op("MatMul", p_new, v_new))


def emit_joined_attention(b: GraphBuilder, q: str, k_new: str, v_new: str, k_cache: str,
                          v_cache: str, mask: str, scale: float) -> str:
    """Masked GQA attention over [cache ; new tokens], joined form.

    q: [Bt, Hkv, G, C, D] queries, post-RoPE (query head h = kv * G + g, as HF's repeat_kv).
    k_new, v_new: [Bt, Hkv, C, D]; k_cache, v_cache: [Bt, Hkv, Lc, D].
    mask: additive [C, Lc + C] (0 visible, MASK_MIN hidden), shared by every head: the cache
    rows' validity followed by the causal triangle of the chunk (`joined_mask`).
    Returns [Bt, Hkv, G, C, D].
    """
    heads_axis = b.const([2])
    keys = b.op("Unsqueeze", b.op("Concat", k_cache, k_new, axis=2), heads_axis)     # [Bt,Hkv,1,Lc+C,D]
    values = b.op("Unsqueeze", b.op("Concat", v_cache, v_new, axis=2), heads_axis)
    scores = b.op("Mul", b.op("MatMul", q, b.op("Transpose", keys, perm=[0, 1, 2, 4, 3])),
                  b.const(scale, np.float32))
    probs = b.op("Softmax", b.op("Add", scores, mask), axis=-1)                      # [Bt,Hkv,G,C,Lc+C]
    return b.op("MatMul", probs, values)


def joined_mask(b: GraphBuilder, cache_visible: str, cache_len: Size, new_len: int) -> str:
    """The additive [new_len, cache_len + new_len] mask of emit_joined_attention: cache row j is
    seen where cache_visible[j] (bool [cache_len]); chunk token t sees chunk tokens <= t."""
    rows = 1 if isinstance(cache_len, SymbolicSize) else cache_len      # Expand broadcasts [cache_len] to it
    cache = b.op("Expand", additive_mask(b, cache_visible), b.const([new_len, rows]))
    causal = np.arange(new_len)[None, :] <= np.arange(new_len)[:, None]
    new = additive_mask(b, b.const(causal, np.bool_))
    return b.op("Concat", cache, new, axis=-1)


def additive_mask(b: GraphBuilder, visible: str) -> str:
    """bool -> float32 additive mask (0 where visible, MASK_MIN elsewhere)."""
    return b.op("Where", visible, b.const(0.0, np.float32), b.const(MASK_MIN, np.float32))
