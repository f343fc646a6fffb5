"""The quantized blocks of a GGUF file's linear layers, mapped to Hugging Face parameter names.

Only the block formats a BlockQuantized represents without loss are read: Q4_0 (w = d (u - 8)),
Q4_1 (w = d u + m) and Q8_0 (w = d q), each 32 values a block with float16 d and m. A block is
*kept* only after checking that the file's own dequantization of it equals the float weight
the model loaded (so a name or row-order mismatch can never slip a wrong block in).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from snapcompile.export.quantize import BlockQuantized

GGUF_BLOCK = 32
_LAYER_TENSORS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                  "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                  "ffn_down": "mlp.down_proj"}


def hf_name(gguf_name: str) -> str | None:
    """"blk.3.attn_q.weight" -> "model.layers.3.self_attn.q_proj.weight"; the embedding and the
    output head too; None for tensors that are not linear weights."""
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS and parts[3] == "weight":
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.weight"
    return None


def read_blocks(path: Path, num_heads: int, num_kv_heads: int) -> dict[str, tuple[np.ndarray, ...]]:
    """HF name -> (u int [N, K] as stored, d float32 [N, K/32], m float32 [N, K/32] or None,
    zero: the value subtracted from u) for every Q4_0 / Q4_1 / Q8_0 linear weight of the file.
    Rows of q_proj / k_proj are reordered as transformers' GGUF loader reorders them (llama.cpp
    stores them permuted for its RoPE layout)."""
    import gguf
    reader = gguf.GGUFReader(str(path))
    out = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        kind = tensor.tensor_type.name
        if name is None or kind not in ("Q4_0", "Q4_1", "Q8_0"):
            continue
        u, d, m = _split_blocks(np.asarray(tensor.data), kind)
        heads = num_heads if name.endswith("q_proj.weight") else num_kv_heads
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            order = _unpermute_rows(u.shape[0], heads)
            u, d, m = u[order], d[order], None if m is None else m[order]
        out[name] = (u, d, m, 8 if kind.startswith("Q4") else 0)
    return out


def _split_blocks(data: np.ndarray, kind: str):
    """Raw block bytes [N, blocks * bytes] -> u [N, K] int16, d [N, blocks], m [N, blocks] | None."""
    rows = data.shape[0]
    size = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[kind]
    blocks = data.reshape(rows, -1, size)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q8_0":
        u = blocks[..., 2:].copy().view(np.int8).astype(np.int16)
        return u.reshape(rows, -1), d, None
    start = 4 if kind == "Q4_1" else 2
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if kind == "Q4_1" else None
    qs = blocks[..., start:]
    u = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int16)   # values j and j + 16 share byte j
    return u.reshape(rows, -1), d, m


def _unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """The row order transformers' GGUF loader applies to q_proj / k_proj (undoing llama.cpp's
    interleaved-RoPE permutation): row r of the result is row order[r] of the file."""
    index = np.arange(rows).reshape(heads, rows // heads // 2, 2)
    return index.swapaxes(1, 2).reshape(rows)


def kept_blocks(blocks: tuple[np.ndarray, ...], weight: np.ndarray, bits: int) -> BlockQuantized | None:
    """The file's blocks as a BlockQuantized of `bits`, or None when they cannot be kept exactly:
    the target has fewer bits than the file's values, or the file's dequantization differs from
    `weight` [N, K] (the float weights the model loaded)."""
    u, d, m, zero = blocks
    if u.shape != weight.shape or (zero == 0 and bits < 8):
        return None
    scale = np.repeat(d, GGUF_BLOCK, axis=1)
    if m is not None:                      # Q4_1, dequantized by the file's reader as d u + m
        file_values = u.astype(np.float32) * scale + np.repeat(m, GGUF_BLOCK, axis=1)
    else:                                  # Q4_0: d (u - 8); Q8_0: d q
        file_values = (u - zero).astype(np.float32) * scale
    if not np.array_equal(file_values, weight):
        return None
    offsets = None if m is None else (m + np.float32(zero) * d).astype(np.float32)
    return BlockQuantized((u - zero).astype(np.int8), d, offsets, bits, GGUF_BLOCK,
                          exact_blocks=d.size)
