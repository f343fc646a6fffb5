"""Summaries of the rows a sequence's selections dropped (docs/design.md, "Summaries of the dropped
rows"). Host arrays only, no device code.

Per layer and KV head, summary row j sums the keys and values of the dropped rows whose position
p has summary_index(p) = j (p // segment, the last row taking every later position) and counts
them. A resumed turn's new tokens attend over each summary as one row of the mean key and mean
value whose logit gets log(count): the weight the rows it stands for would have if they shared one
key. Decode and the selection never see them, and a row the decode ring overwrites is not summed.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from snapcompile.graphs.attention import MASK_MIN


@dataclass(frozen=True)
class RowSummaries:
    """key_sums / value_sums: per layer [Hkv, S, D] float32; counts: per layer [Hkv, S] float32,
    rows summed (0: an empty summary). Read-only, like the KeptCache that holds them."""

    key_sums: tuple[np.ndarray, ...]
    value_sums: tuple[np.ndarray, ...]
    counts: tuple[np.ndarray, ...]

    def __post_init__(self):
        for array in (*self.key_sums, *self.value_sums, *self.counts):
            array.flags.writeable = False

    @classmethod
    def empty(cls, layers: int, kv_heads: int, summaries: int, head_dim: int) -> RowSummaries:
        sums = tuple(np.zeros((kv_heads, summaries, head_dim), np.float32) for _ in range(layers))
        return cls(sums, sums, tuple(np.zeros((kv_heads, summaries), np.float32) for _ in range(layers)))

    @property
    def rows(self) -> int:
        """S, summary rows per layer and KV head."""
        return self.counts[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (*self.key_sums, *self.value_sums, *self.counts))

    def layer_with_dropped(self, summary_of, layer: int, keys: np.ndarray, values: np.ndarray,
                           positions: np.ndarray, dropped: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`layer`'s key sums, value sums and counts with one selection's dropped rows added.
        summary_of: position array -> summary index array (PolicyConfig.summary_index); keys,
        values [Hkv, n, D], positions [Hkv, n] int64, dropped [Hkv, n] bool: the rows it chose from."""
        onehot = (summary_of(positions)[:, None, :] == np.arange(self.rows)[None, :, None]) & dropped[:, None, :]
        weights = onehot.astype(np.float32)                                       # [Hkv, S, n]
        return (self.key_sums[layer] + weights @ keys, self.value_sums[layer] + weights @ values,
                self.counts[layer] + weights.sum(axis=2))

    @classmethod
    def of_layers(cls, layers: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> RowSummaries:
        """From per layer (key sums, value sums, counts)."""
        return cls(*(tuple(layer[part] for layer in layers) for part in range(3)))

    def attended(self, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """What a resumed turn attends over in `layer`: mean keys and values [Hkv, S, D] and the
        logit bias [Hkv, S] (log count; MASK_MIN for an empty summary, which no query sees)."""
        counts = self.counts[layer]
        n = np.maximum(counts, 1.0)[..., None]
        bias = np.where(counts > 0, np.log(np.maximum(counts, 1.0)), np.float32(MASK_MIN)).astype(np.float32)
        return (self.key_sums[layer] / n).astype(np.float32), (self.value_sums[layer] / n).astype(np.float32), bias
