"""Cache rows held in low precision in host memory: a `quantized` session entry's rows (8 bits)
and dropped rows (4 bits; sessions/dropped.py), and the study's (studies/resume_study.py). Host
arrays only.

As KIVI stores a KV cache (Liu et al., 2024): asymmetric round-to-nearest integers in groups of
GROUP values, one float16 minimum and one float16 step per group. Keys are grouped per channel
over GROUP consecutive rows (a few channels of rotated keys hold large values, so a group along
one row would spend its range on them); values per row over GROUP consecutive dimensions.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from snapcompile.nibbles import pack_nibbles, unpack_nibbles

GROUP = 32
KEY_AXIS, VALUE_AXIS = 1, 2      # the axis of [Hkv, n, D] a group runs along: rows (keys), dimensions (values)
STORED_BITS = (4, 8)


@dataclass(frozen=True)
class QuantizedRows:
    """Rows [Hkv, n, D] float32 as `bits`-bit codes in groups of GROUP along `axis` (a last group
    shorter than GROUP is padded with its edge value, which changes neither its minimum nor its
    maximum). codes: uint8 [Hkv, n', D'] (n', D' padded to whole groups), two 4-bit codes a byte,
    low nibble first, along the last axis; low, step: float16, one per group. Read-only."""

    codes: np.ndarray
    low: np.ndarray
    step: np.ndarray
    shape: tuple[int, int, int]
    axis: int
    bits: int

    def __post_init__(self):
        for array in (self.codes, self.low, self.step):
            array.flags.writeable = False

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.low.nbytes + self.step.nbytes

    def dequantize(self, rows: int | None = None) -> np.ndarray:
        """The first `rows` rows (all: None) as float32 [Hkv, rows, D]: code * step + low."""
        hkv, n, dim = self.shape
        rows = n if rows is None else min(rows, n)
        keys = self.axis == KEY_AXIS               # groups run along rows (else along dimensions)
        whole = -(-rows // GROUP) * GROUP if keys else rows          # rows of whole groups
        codes = self.codes[:, :whole]
        if self.bits == 4:                         # the last axis, padded to whole bytes: back to its codes
            codes = unpack_nibbles(codes)[..., :dim if keys else dim + -dim % GROUP]
        grouped, group_axis = _grouped(codes, self.axis)
        low_rows = whole // GROUP if keys else whole                 # their rows of low and step
        low, step = (np.expand_dims(a[:, :low_rows], group_axis).astype(np.float32) for a in (self.low, self.step))
        values = np.multiply(grouped, step, dtype=np.float32)
        values += low
        return np.ascontiguousarray(values.reshape(codes.shape)[:, :rows, :dim])


def quantize_rows(rows: np.ndarray, bits: int, axis: int) -> QuantizedRows:
    """rows [Hkv, n, D] float32 (n >= 1) in `bits`-bit (4 or 8) groups along `axis` (KEY_AXIS or
    VALUE_AXIS). Each value comes back within half a step of its group (step = range / (2^bits - 1))."""
    if bits not in STORED_BITS or axis not in (KEY_AXIS, VALUE_AXIS):
        raise ValueError(f"bits must be one of {STORED_BITS} and axis {KEY_AXIS} or {VALUE_AXIS}")
    hkv, n, dim = rows.shape
    padded = np.asarray(rows, np.float32)
    if rows.shape[axis] % GROUP:
        padding = [(0, 0), (0, 0), (0, 0)]
        padding[axis] = (0, -rows.shape[axis] % GROUP)
        padded = np.pad(padded, padding, mode="edge")
    grouped, group_axis = _grouped(padded, axis)
    low, high = grouped.min(axis=group_axis), grouped.max(axis=group_axis)
    step = ((high - low) / (2 ** bits - 1)).astype(np.float16)
    low = low.astype(np.float16)
    safe = np.where(step > 0, step.astype(np.float32), 1.0)
    codes = grouped - np.expand_dims(low.astype(np.float32), group_axis)
    codes /= np.expand_dims(safe, group_axis)
    codes = np.clip(np.rint(codes, out=codes), 0, 2 ** bits - 1, out=codes).astype(np.uint8).reshape(padded.shape)
    packed = codes if bits == 8 else pack_nibbles(codes)
    return QuantizedRows(np.ascontiguousarray(packed), low, step, (hkv, n, dim), axis, bits)


def _grouped(array: np.ndarray, axis: int) -> tuple[np.ndarray, int]:
    """[Hkv, n, D] (the axis a whole number of groups) as a view with the GROUP members of each
    group along an axis of their own, and that axis: [Hkv, n/G, G, D] (keys, axis 2) or
    [Hkv, n, D/G, G] (values, axis 3). Reducing over it gives one value per group."""
    hkv, n, dim = array.shape
    if axis == VALUE_AXIS:
        return array.reshape(hkv, n, dim // GROUP, GROUP), 3
    return array.reshape(hkv, n // GROUP, GROUP, dim), 2


