"""The rows a sequence's selections dropped, kept in 4 bits for its resumed turns
(`--session-keep quantized`; docs/design.md, "Conversations that keep their cache"). Host arrays
only, no device code.

Each selection adds one chunk: per layer the rows it did not keep, [Hkv, m, D] keys and values in
4 bits (sessions/kv_quant.py, keys grouped per channel over the chunk's rows), with their positions.
Every head drops as many rows as the others (a selection keeps P of the same rows in each), so a
chunk is [Hkv, m, ...] in every layer. A resumed turn's new tokens attend over every chunk's rows;
the selection and decode never see them.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from snapcompile.sessions.kv_quant import KEY_AXIS, VALUE_AXIS, QuantizedRows, quantize_rows

DROPPED_BITS = 4


@dataclass(frozen=True)
class DroppedChunk:
    """One selection's dropped rows: per layer keys, values (QuantizedRows [Hkv, m, D]) and
    positions [Hkv, m] int32. Read-only."""

    keys: tuple[QuantizedRows, ...]
    values: tuple[QuantizedRows, ...]
    positions: tuple[np.ndarray, ...]

    def __post_init__(self):
        for array in self.positions:
            array.flags.writeable = False

    @staticmethod
    def of_layer(keys: np.ndarray, values: np.ndarray, positions: np.ndarray) -> tuple:
        """One layer's part, from its float32 keys, values [Hkv, m, D] and positions [Hkv, m]."""
        return (quantize_rows(keys, DROPPED_BITS, KEY_AXIS), quantize_rows(values, DROPPED_BITS, VALUE_AXIS),
                positions.astype(np.int32))

    @classmethod
    def of_layers(cls, layers: list[tuple]) -> DroppedChunk:
        """From every layer's part (`of_layer`, m >= 1)."""
        return cls(*(tuple(layer[part] for layer in layers) for part in range(3)))

    @classmethod
    def of(cls, layers: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> DroppedChunk:
        """From per-layer float32 keys, values [Hkv, m, D] and positions [Hkv, m] (m >= 1)."""
        return cls.of_layers([cls.of_layer(*layer) for layer in layers])

    @property
    def rows(self) -> int:
        return self.positions[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (*self.keys, *self.values, *self.positions))


@dataclass(frozen=True)
class DroppedRows:
    """The chunks of a sequence's selections, oldest first."""

    chunks: tuple[DroppedChunk, ...] = ()

    @property
    def rows(self) -> int:
        """Rows per layer and KV head over every chunk."""
        return sum(chunk.rows for chunk in self.chunks)

    @property
    def nbytes(self) -> int:
        return sum(chunk.nbytes for chunk in self.chunks)

    def layer(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values [Hkv, rows, D] float32 of every chunk's rows in `layer`, oldest first."""
        keys, values = zip(*self.layer_chunks(layer))
        return np.concatenate(keys, axis=1), np.concatenate(values, axis=1)

    def layer_chunks(self, layer: int):
        """Per chunk, oldest first: its keys and values [Hkv, m, D] float32 in `layer`."""
        for chunk in self.chunks:
            yield chunk.keys[layer].dequantize(), chunk.values[layer].dequantize()

    def with_chunk(self, chunk: DroppedChunk | None) -> DroppedRows:
        return self if chunk is None else DroppedRows((*self.chunks, chunk))

    def without_oldest(self) -> DroppedRows:
        return DroppedRows(self.chunks[1:])

