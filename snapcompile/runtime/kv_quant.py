"""Cache rows held in low precision in host memory: a `quantized` session entry's rows (8 bits)
and dropped rows (4 bits; runtime/dropped.py), and the study's (scripts/resume_study.py). Host
arrays only.

As KIVI stores a KV cache (Liu et al., 2024): asymmetric round-to-nearest integers in groups of
GROUP values, one float16 minimum and one float16 step per group. Keys are grouped per channel
over GROUP consecutive rows (a few channels of rotated keys hold large values, so a group along
one row would spend its range on them); values per row over GROUP consecutive dimensions.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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
        padded = [hkv, n, dim]
        padded[self.axis] += -padded[self.axis] % GROUP
        codes = self.codes if self.bits == 8 else _unpack4(self.codes)[..., :padded[2]]
        grouped = _grouped(codes.astype(np.float32), self.axis)
        values = grouped * self.step.astype(np.float32)[..., None] + self.low.astype(np.float32)[..., None]
        out = _ungrouped(values, self.axis, tuple(padded))[:, :n if rows is None else min(rows, n), :dim]
        return np.ascontiguousarray(out)


def quantize_rows(rows: np.ndarray, bits: int, axis: int) -> QuantizedRows:
    """rows [Hkv, n, D] float32 (n >= 1) in `bits`-bit (4 or 8) groups along `axis` (KEY_AXIS or
    VALUE_AXIS). Each value comes back within half a step of its group (step = range / (2^bits - 1))."""
    if bits not in STORED_BITS or axis not in (KEY_AXIS, VALUE_AXIS):
        raise ValueError(f"bits must be one of {STORED_BITS} and axis {KEY_AXIS} or {VALUE_AXIS}")
    hkv, n, dim = rows.shape
    padding = [(0, 0), (0, 0), (0, 0)]
    padding[axis] = (0, -rows.shape[axis] % GROUP)
    padded = np.pad(np.asarray(rows, np.float32), padding, mode="edge")
    grouped = _grouped(padded, axis)                                           # [..., groups, GROUP]
    low, high = grouped.min(axis=-1), grouped.max(axis=-1)
    step = ((high - low) / (2 ** bits - 1)).astype(np.float16)
    low = low.astype(np.float16)
    safe = np.where(step > 0, step.astype(np.float32), 1.0)
    codes = np.rint((grouped - low.astype(np.float32)[..., None]) / safe[..., None])
    codes = np.clip(codes, 0, 2 ** bits - 1).astype(np.uint8)
    codes = _ungrouped(codes, axis, padded.shape)
    packed = codes if bits == 8 else _pack4(codes)
    return QuantizedRows(np.ascontiguousarray(packed), low, step, (hkv, n, dim), axis, bits)


def _grouped(array: np.ndarray, axis: int) -> np.ndarray:
    """[Hkv, n, D] (the axis a whole number of groups) -> [..., groups, GROUP], groups last."""
    hkv, n, dim = array.shape
    if axis == VALUE_AXIS:
        return array.reshape(hkv, n, dim // GROUP, GROUP)
    return array.reshape(hkv, n // GROUP, GROUP, dim).transpose(0, 1, 3, 2)   # [Hkv, n/G, D, G]


def _ungrouped(grouped: np.ndarray, axis: int, shape: tuple[int, ...]) -> np.ndarray:
    if axis == VALUE_AXIS:
        return grouped.reshape(shape)
    return grouped.transpose(0, 1, 3, 2).reshape(shape)


def _pack4(codes: np.ndarray) -> np.ndarray:
    """uint8 codes < 16 [..., m] -> [..., ceil(m / 2)], low nibble first."""
    if codes.shape[-1] % 2:
        codes = np.concatenate([codes, np.zeros((*codes.shape[:-1], 1), np.uint8)], axis=-1)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _unpack4(packed: np.ndarray) -> np.ndarray:
    out = np.empty((*packed.shape[:-1], packed.shape[-1] * 2), np.uint8)
    out[..., 0::2], out[..., 1::2] = packed & 0x0F, packed >> 4
    return out
