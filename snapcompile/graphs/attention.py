"""The standard-op cached-attention subgraph, emitted by the exporter and by the lowering pass.

One block reads a fixed-size cache plus the K/V of the tokens fed this call, without
concatenating (copying) the cache: scores against the cache and against the new tokens are
computed separately, joined for one softmax, and the two value products are summed.
"""
from __future__ import annotations

import numpy as np

from snapcompile.graphs.builder import GraphBuilder

MASK_MIN = float(np.finfo(np.float32).min)  # additive mask value of a hidden slot; finite, never NaN


def emit_cached_attention(b: GraphBuilder, q: str, k_new: str, v_new: str, k_cache: str,
                          v_cache: str, cache_mask: str, new_mask: str | None, scale: float,
                          cache_len: int, new_len: int) -> str:
    """Masked GQA attention over [cache ; new tokens].

    q: [Bt, Hkv, R, D] queries (R = G query heads x queries per sequence), post-RoPE.
    k_new, v_new: [Bt, Hkv, new_len, D]; k_cache, v_cache: [Bt, Hkv, cache_len, D].
    cache_mask: additive, broadcastable to [Bt, Hkv, R, cache_len] (0 visible, MASK_MIN hidden).
    new_mask: additive, broadcastable to [Bt, Hkv, R, new_len], or None when all are visible.
    Returns [Bt, Hkv, R, D].
    """
    scale_c = b.const(scale, np.float32)
    s_cache = b.op("Mul", b.op("MatMul", q, b.op("Transpose", k_cache, perm=[0, 1, 3, 2])), scale_c)
    s_cache = b.op("Add", s_cache, cache_mask)                               # [Bt,Hkv,R,Lc]
    s_new = b.op("Mul", b.op("MatMul", q, b.op("Transpose", k_new, perm=[0, 1, 3, 2])), scale_c)
    if new_mask is not None:
        s_new = b.op("Add", s_new, new_mask)                                 # [Bt,Hkv,R,Cn]
    probs = b.op("Softmax", b.op("Concat", s_cache, s_new, axis=-1), axis=-1)
    p_cache, p_new = b.op("Split", probs, b.const([cache_len, new_len]), outputs=2, axis=-1)
    return b.op("Add", b.op("MatMul", p_cache, v_cache), b.op("MatMul", p_new, v_new))


def additive_mask(b: GraphBuilder, visible: str) -> str:
    """bool -> float32 additive mask (0 where visible, MASK_MIN elsewhere)."""
    return b.op("Where", visible, b.const(0.0, np.float32), b.const(MASK_MIN, np.float32))
