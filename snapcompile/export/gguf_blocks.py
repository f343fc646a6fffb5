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
from snapcompile.models.tensors import GGUFTensors, gguf_row_order

GGUF_BLOCK = 32
KEPT_KINDS = ("Q4_0", "Q4_1", "Q8_0")
FLOAT_KINDS = ("F32", "F16", "BF16", "F64")


class GGUFBlocks:
    """HF name -> (u int [N, K] as stored, d float32 [N, K/32], m float32 [N, K/32] or None, zero: the
    value subtracted from u) for every Q4_0 / Q4_1 / Q8_0 linear weight of a GGUF file, read from the
    memory-mapped file when asked (one tensor at a time, as the export streams). Rows of q_proj /
    k_proj are reordered as transformers' GGUF loader reorders them (`gguf_row_order`)."""

    def __init__(self, path: Path, config):
        self.config = config
        self.file = GGUFTensors(path)

    def quantized_types(self) -> dict[str, str]:
        """HF name -> type of every quantized tensor of the file (whatever its type: K-quants too)."""
        return {name: tensor.tensor_type.name for name, tensor in self.file.by_name.items()
                if tensor.tensor_type.name not in FLOAT_KINDS}

    def __contains__(self, name: str) -> bool:
        tensor = self.file.by_name.get(name)
        return tensor is not None and name.endswith(".weight") and tensor.tensor_type.name in KEPT_KINDS

    def __getitem__(self, name: str) -> tuple[np.ndarray, ...]:
        tensor = self.file.by_name[name]
        kind = tensor.tensor_type.name
        u, d, m = _split_blocks(np.asarray(tensor.data), kind)
        self.file.release(tensor)
        order = gguf_row_order(name, self.config)
        if order is not None:
            u, d, m = u[order], d[order], None if m is None else m[order]
        return u, d, m, 8 if kind.startswith("Q4") else 0


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
