"""A finished sequence's cache kept in host memory, and the rule for resuming a request from it
(docs/design.md, "Conversations that keep their cache"). Host arrays only, no device code.

A request resumes from a kept cache at its resume point r: the kept rows of positions < r stand
for the request's tokens [0, r) and only [r, T) is prefilled, against them. r is the length of the
common token prefix, moved back so that the new tokens hold the whole observation window (a
snapstream artifact re-selects with the window of the new turn) and at least one token (whose
logits start the answer). r may not lie before the point where the kept rows were last selected
(`compressed_at`): there the rows are the cache the sequence itself had; before it they are a
selection made for tokens the request does not share, so such a request is prefilled whole (and a
prompt sent again gets the same answer as the first time).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from snapcompile.layout import WindowRing
from snapcompile.sessions.dropped import DroppedRows
from snapcompile.sessions.kv_quant import KEY_AXIS, VALUE_AXIS, QuantizedRows, quantize_rows
from snapcompile.sessions.summaries import RowSummaries

KEPT_BITS = 8           # the bits a `quantized` entry holds its rows in (its dropped rows: dropped.py)


@dataclass(frozen=True)
class KeptCache:
    """token_ids: [F] int64, the tokens the cache stands for (prompt and fed output; the last
    sampled token was never fed, so it is not among them). keys / values: per layer [Hkv, n, D] in
    the cache's dtype (float32 or float16), or in KEPT_BITS (QuantizedRows, `quantized`); positions:
    per layer [Hkv, n] int64, ascending per head, all < F. compressed_at: the positions the cache
    held when its rows were last selected (0: never; every position < F that the ring did not
    overwrite is a row). summaries: the rows its selections dropped, summed (policies with summaries;
    None otherwise). dropped: those rows themselves in 4 bits (`quantized`; None otherwise).
    ring_layers: the model's sliding-window layers (Gemma 3's local ones), each holding its window
    ring's rows: the last min(F, ring rows) positions, in order (layout.WindowRing.held). Every
    array is read-only: requests that resume from one entry at once copy it, none changes it."""

    token_ids: np.ndarray
    keys: tuple[np.ndarray | QuantizedRows, ...]
    values: tuple[np.ndarray | QuantizedRows, ...]
    positions: tuple[np.ndarray, ...]
    compressed_at: int = 0
    summaries: RowSummaries | None = None
    dropped: DroppedRows | None = None
    ring_layers: tuple[int, ...] = ()

    def __post_init__(self):
        for array in (self.token_ids, *self.keys, *self.values, *self.positions):
            if isinstance(array, np.ndarray):
                array.flags.writeable = False

    @property
    def rows(self) -> int:
        """Cache rows per layer and KV head (at most the slot's budget) of the layers that are not rings."""
        return next(p for i, p in enumerate(self.positions) if i not in self.ring_layers).shape[1]

    @property
    def nbytes(self) -> int:
        arrays = sum(a.nbytes for a in (self.token_ids, *self.keys, *self.values, *self.positions))
        extra = (self.summaries, self.dropped)
        return arrays + sum(held.nbytes for held in extra if held is not None)

    def layer_rows(self, layer: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values [Hkv, rows, D] of the layer's first `rows` rows (in their dtype; quantized ones
        float32)."""
        return tuple(held.dequantize(rows) if isinstance(held, QuantizedRows) else held[:, :rows]
                     for held in (self.keys[layer], self.values[layer]))

    def ring_order(self, layer: int, ring: WindowRing) -> tuple[np.ndarray, np.ndarray]:
        """A ring layer's keys and values [Hkv, ring.rows, D] laid out as its window ring: position p
        at row p % ring.rows (rows it does not hold are zeros, which the graphs never see)."""
        rows = self.positions[layer][0] % ring.rows
        laid_out = []
        for held in (self.keys[layer], self.values[layer]):
            ring_rows = np.zeros((held.shape[0], ring.rows, held.shape[2]), held.dtype)
            ring_rows[:, rows] = held
            laid_out.append(ring_rows)
        return tuple(laid_out)

    def quantized(self, dropped: DroppedRows, max_bytes: int) -> KeptCache:
        """This entry with its rows in KEPT_BITS and `dropped` beside them, less their oldest
        chunks until it holds at most max_bytes (none left: no dropped rows)."""
        held = replace(self, keys=tuple(quantize_rows(k, KEPT_BITS, KEY_AXIS) for k in self.keys),
                       values=tuple(quantize_rows(v, KEPT_BITS, VALUE_AXIS) for v in self.values), dropped=None)
        while dropped.chunks and held.nbytes + dropped.nbytes > max_bytes:
            dropped = dropped.without_oldest()
        return replace(held, dropped=dropped if dropped.chunks else None)


@dataclass(frozen=True)
class ResumePlan:
    """Resume a request from `kept`: its tokens [resume_at, T) are prefilled against the first
    `rows` kept rows (those of positions < resume_at, as many in every layer and head) and, when
    dropped_rows > 0, the entry's dropped rows (all of them: their positions are < compressed_at)."""

    kept: KeptCache
    resume_at: int
    rows: int
    dropped_rows: int = 0


def common_prefix(a: np.ndarray, b: list[int]) -> int:
    """The length of the longest common prefix of two token-id sequences."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != np.asarray(b[:n], np.int64))
    return int(differ[0]) if differ.size else n


def plan_resume(kept: KeptCache, token_ids: list[int], window: int, max_rows: int,
                min_tokens: int = 1, ring: WindowRing | None = None) -> ResumePlan | None:
    """How `token_ids` (T of them) resumes from `kept`, or None when it cannot: fewer than
    `min_tokens` common tokens left once the last max(window, 1) are prefilled anew, a resume point
    before the kept rows' selection (`compressed_at`) or one that cuts them unevenly across heads,
    one whose first new token's window the entry's rings no longer hold (`ring`: the model's window
    ring, WindowRing.resumes), or more than `max_rows` rows to prefill against (the artifact's
    prefill cache). The entry's dropped rows are attended too when they fit in max_rows as well."""
    resume_at = min(common_prefix(kept.token_ids, token_ids), len(token_ids) - max(window, 1))
    if resume_at < max(min_tokens, 1) or resume_at < kept.compressed_at:
        return None
    if any(not ring.resumes(int(kept.positions[i][0, 0]), resume_at) for i in kept.ring_layers):
        return None
    counts = {int(c) for i, positions in enumerate(kept.positions) if i not in kept.ring_layers
              for c in (positions < resume_at).sum(axis=1)}
    if len(counts) != 1:
        return None
    rows = counts.pop()
    needed = rows + len(token_ids) - resume_at
    if rows == 0 or needed > max_rows:
        return None
    dropped = kept.dropped.rows if kept.dropped is not None else 0
    return ResumePlan(kept, resume_at, rows, dropped if needed + dropped <= max_rows else 0)


def row_positions(plan: ResumePlan | None, prompt_len: int, filled: int, kv_heads: int,
                  layer: int) -> np.ndarray:
    """[Hkv, filled] the position each prefilled row of `layer` stands for: the row's own for a
    fresh prompt; for a resumed one the plan's kept rows' positions, then resume_at .. prompt_len-1."""
    if plan is None:
        return np.broadcast_to(np.arange(filled), (kv_heads, filled))
    new = np.broadcast_to(np.arange(plan.resume_at, prompt_len), (kv_heads, prompt_len - plan.resume_at))
    return np.concatenate([plan.kept.positions[layer][:, :plan.rows], new], axis=1)


def positions_of_rows(plan: ResumePlan, prompt_len: int, kept_rows: list[np.ndarray] | None,
                      kept: int) -> list[np.ndarray]:
    """Per layer [Hkv, kept] positions of the rows a resumed prefill kept (kept_rows: per layer
    [Hkv, kept] prefilled rows the selection kept; None: rows [0, kept)); None for a ring layer."""
    hkv, filled = plan.kept.positions[0].shape[0], plan.rows + prompt_len - plan.resume_at
    tables = (None if i in plan.kept.ring_layers else row_positions(plan, prompt_len, filled, hkv, i)
              for i in range(len(plan.kept.positions)))
    return [None if table is None else table[:, :kept].copy() if kept_rows is None
            else np.take_along_axis(table, kept_rows[i], axis=1) for i, table in enumerate(tables)]
