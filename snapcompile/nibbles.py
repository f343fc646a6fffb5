"""Two 4-bit values a byte, the first in the low nibble: the layout of ONNX INT4 tensors, of ONNX
Runtime's 4-bit quantizer output and MatMulNBits weights, and of the session store's 4-bit rows."""
from __future__ import annotations

import numpy as np


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """uint8 codes < 16 [..., m] -> bytes [..., ceil(m / 2)] (an odd m padded with a zero nibble)."""
    if codes.shape[-1] % 2:
        codes = np.concatenate([codes, np.zeros((*codes.shape[:-1], 1), np.uint8)], axis=-1)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """bytes uint8 [..., m] -> codes uint8 [..., 2m]."""
    out = np.empty((*packed.shape[:-1], packed.shape[-1] * 2), np.uint8)
    out[..., 0::2], out[..., 1::2] = packed & 0x0F, packed >> 4
    return out
