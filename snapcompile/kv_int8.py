"""The int8 KV row (`--kv-dtype int8`): what the graphs store, in numpy (passes/kv_dtype.py writes the
same arithmetic as ONNX nodes; the tests hold the two to the same bytes).

One head's key or value row of D float32 elements is stored as D + SCALE_BYTES int8 values: D values
q in [-127, 127], then the row's scale s as two bytes e and m, s = 2**(e - 8) * (384 + m). With
amax the row's largest |x|, e = floor(log2(amax / 127)) and m the smallest byte with s >= amax / 127,
so s is amax / 127 to within 1/256 and x = q * s to within s / 2 (about amax / 254: each row keeps
about 8 bits relative to its own largest element). A row of zeros stores zeros and reads back zeros.
Every step is exact in float32 but the division x / s and its rounding (half to even, as ONNX's
Round), so numpy and ONNX Runtime write the same bytes.
"""
from __future__ import annotations

import numpy as np

SCALE_BYTES = 2          # e and m, after the D values
LIMIT = 127.0            # |q| <= LIMIT
MANTISSA_BIAS = 384.0    # s = 2**(e - 8) * (MANTISSA_BIAS + m), m in [-128, 127]: 2**e * (256..511) / 256
TINY = 2.0 ** -100       # amax is at least this, so log2 is finite (a zero row: q = 0)


def row_scale(amax: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float32 amax [..., 1] -> (e, m, s), each float32 [..., 1] (e and m hold integers)."""
    needed = np.maximum(amax, np.float32(TINY)) / np.float32(LIMIT)
    e = np.floor(np.log2(needed))
    ratio = needed / np.exp2(e)                        # in [1, 2) once e is corrected below
    e = e + (ratio >= 2) - (ratio < 1)                 # log2's last bit, either way
    m = np.clip(np.ceil(needed / np.exp2(e - 8)) - MANTISSA_BIAS, -128, 127)
    return e, m, scale_of(e, m)


def scale_of(e: np.ndarray, m: np.ndarray) -> np.ndarray:
    """2**(e - 8) * (384 + m): exact in float32 (a power of two times a 9-bit integer)."""
    return (np.exp2(e - 8) * (MANTISSA_BIAS + m)).astype(np.float32)


def encode(rows: np.ndarray) -> np.ndarray:
    """float32 [..., D] -> int8 [..., D + SCALE_BYTES]."""
    rows = np.asarray(rows, np.float32)
    e, m, s = row_scale(np.abs(rows).max(axis=-1, keepdims=True))
    q = np.clip(np.round(rows / s), -LIMIT, LIMIT)
    return np.concatenate([q, e, m], axis=-1).astype(np.int8)


def decode(stored: np.ndarray) -> np.ndarray:
    """int8 [..., D + SCALE_BYTES] -> float32 [..., D]."""
    wide = stored.astype(np.float32)
    q, e, m = wide[..., :-SCALE_BYTES], wide[..., -2:-1], wide[..., -1:]
    return q * scale_of(e, m)
