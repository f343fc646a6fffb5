"""Triton kernel of the fused decode attention (SnapKVDecodeAttention, see plugins.contracts).

One program per (slot, KV head): it streams the slot's B cache rows in blocks with an online
softmax and adds the new token (the runner stores the new K/V at the ring row after the step).
Without a CUDA device the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set here
before Triton is imported), which is how CI tests it.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # after TRITON_INTERPRET is set
import triton.language as tl


@triton.jit
def _decode_attention_kernel(
    q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, write_ptr, len_ptr, out_ptr, scale,
    budget, group, head_dim,
    stride_qn, stride_qh, stride_qg,
    stride_kn, stride_kh,
    stride_cn, stride_ch, stride_cb,
    BLOCK_G: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr,
):
    slot = tl.program_id(0)
    head = tl.program_id(1)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_ok = g < group
    d_ok = d < head_dim
    q = tl.load(q_ptr + slot * stride_qn + head * stride_qh + g[:, None] * stride_qg + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)           # [G, D]
    k_new = tl.load(k_ptr + slot * stride_kn + head * stride_kh + d, mask=d_ok, other=0.0).to(tl.float32)
    v_new = tl.load(v_ptr + slot * stride_kn + head * stride_kh + d, mask=d_ok, other=0.0).to(tl.float32)
    write = tl.load(write_ptr + slot)
    valid_len = tl.load(len_ptr + slot)

    # the new token opens the online softmax: it is always visible
    m_i = tl.sum(q * k_new[None, :], axis=1) * scale                                   # [G]
    l_i = tl.full([BLOCK_G], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32) + v_new[None, :]

    cache = kc_ptr + slot * stride_cn + head * stride_ch
    values = vc_ptr + slot * stride_cn + head * stride_ch
    for start in range(0, budget, BLOCK_B):
        rows = start + tl.arange(0, BLOCK_B)
        visible = (rows < valid_len) & (rows != write) & (rows < budget)
        tile_mask = visible[:, None] & d_ok[None, :]
        k = tl.load(cache + rows[:, None] * stride_cb + d[None, :], mask=tile_mask, other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale                       # [G, BLOCK_B]
        s = tl.where(visible[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        v = tl.load(values + rows[:, None] * stride_cb + d[None, :], mask=tile_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(out_ptr + slot * stride_qn + head * stride_qh + g[:, None] * stride_qg + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                     value_cache: torch.Tensor, write_index: torch.Tensor, cache_len: torch.Tensor,
                     scale: float, block_rows: int = 64,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Launch the kernel. Shapes and semantics as plugins.torch_ops.decode_attention; the last
    axis of every tensor must be contiguous. The caches are read, never written."""
    slots, kv_heads, group, head_dim = query.shape
    budget = key_cache.shape[2]
    for tensor in (query, key, value, key_cache, value_cache):
        if tensor.stride(-1) != 1:
            raise ValueError("decode_attention needs a contiguous last axis")
    if key.stride() != value.stride() or key_cache.stride() != value_cache.stride():
        raise ValueError("key/value (and their caches) must share a layout")
    out = torch.empty_like(query) if out is None else out
    if out.stride() != query.stride():
        raise ValueError("out must have the query's layout")
    _decode_attention_kernel[(slots, kv_heads)](
        query, key, value, key_cache, value_cache, write_index, cache_len, out, float(scale),
        budget, group, head_dim,
        query.stride(0), query.stride(1), query.stride(2),
        key.stride(0), key.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        BLOCK_G=max(triton.next_power_of_2(group), 2),
        BLOCK_B=min(block_rows, max(triton.next_power_of_2(budget), 16)),
        BLOCK_D=max(triton.next_power_of_2(head_dim), 16))
    return out


@triton.jit
def _window_row_stats_kernel(q_ptr, k_ptr, m_ptr, l_ptr, scale, length, window_start, window, rows, head_dim,
                             stride_qh, stride_qr, stride_kh, stride_kl,
                             BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr):
    """Softmax statistics (running max m, sum l) of one window query row over its visible keys."""
    head = tl.program_id(0)
    row = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    q = tl.load(q_ptr + head * stride_qh + row * stride_qr + d, mask=d_ok, other=0.0).to(tl.float32)
    last_visible = window_start + row % window
    m_i = float("-inf")
    l_i = 0.0
    for start in range(0, length, BLOCK_L):
        cols = start + tl.arange(0, BLOCK_L)
        visible = cols <= last_visible
        k = tl.load(k_ptr + head * stride_kh + cols[:, None] * stride_kl + d[None, :],
                    mask=visible[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        s = tl.where(visible, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(s - m_new), axis=0)
        m_i = m_new
    tl.store(m_ptr + head * rows + row, m_i)
    tl.store(l_ptr + head * rows + row, l_i)


@triton.jit
def _window_scores_kernel(q_ptr, k_ptr, m_ptr, l_ptr, out_ptr, scale, length, window_start, window, rows, head_dim,
                          stride_qh, stride_qr, stride_kh, stride_kl,
                          BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Mean softmax probability that the window rows give to one block of key positions."""
    head = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    k = tl.load(k_ptr + head * stride_kh + cols[:, None] * stride_kl + d[None, :],
                mask=(cols < length)[:, None] & d_ok[None, :], other=0.0).to(tl.float32)     # [L, D]
    acc = tl.zeros([BLOCK_L], tl.float32)
    for start in range(0, rows, BLOCK_R):
        r = start + tl.arange(0, BLOCK_R)
        r_ok = r < rows
        q = tl.load(q_ptr + head * stride_qh + r[:, None] * stride_qr + d[None, :],
                    mask=r_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)           # [R, D]
        m = tl.load(m_ptr + head * rows + r, mask=r_ok, other=0.0)
        norm = tl.load(l_ptr + head * rows + r, mask=r_ok, other=1.0)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale                          # [R, L]
        visible = (cols[None, :] <= (window_start + r % window)[:, None]) & r_ok[:, None]
        p = tl.where(visible, tl.exp(s - m[:, None]) / norm[:, None], 0.0)
        acc += tl.sum(p, axis=0)
    tl.store(out_ptr + head * length + cols, acc / rows, mask=cols < length)


def window_scores(window_query: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """Triton version of snapcompile.reference.policy.window_scores: [H, W, D] queries, [Hkv, T, D] keys
    -> [Hkv, T-W] mean window attention per prefix position (float32)."""
    heads, window, head_dim = window_query.shape
    kv_heads, length, _ = keys.shape
    rows = heads // kv_heads * window
    q = window_query.reshape(kv_heads, rows, head_dim).contiguous()
    keys = keys.contiguous()
    m = torch.empty(kv_heads, rows, dtype=torch.float32, device=keys.device)
    l_sum = torch.empty_like(m)
    out = torch.empty(kv_heads, length, dtype=torch.float32, device=keys.device)
    block_d = max(triton.next_power_of_2(head_dim), 16)
    common = (float(scale), length, length - window, window, rows, head_dim,
              q.stride(0), q.stride(1), keys.stride(0), keys.stride(1))
    _window_row_stats_kernel[(kv_heads, rows)](q, keys, m, l_sum, *common, BLOCK_L=64, BLOCK_D=block_d)
    _window_scores_kernel[(kv_heads, triton.cdiv(length, 64))](q, keys, m, l_sum, out, *common,
                                                               BLOCK_L=64, BLOCK_R=16, BLOCK_D=block_d)
    return out[:, : length - window]
