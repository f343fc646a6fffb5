"""What a finished sequence leaves in the session store, one keeper per `--session-keep` mode
(docs/design.md, "Conversations that keep their cache"). Host arrays only: a keeper is handed the
prompt's rows after each selection (`PromptRows`) and, at the end, the slot's entry to make
(sessions/restore.slot_entry); it gives what a resumed prefill attends over besides the kept rows
(`ResumeRows`). The engine drives it; it never calls the backend.

| mode | entry | a resumed turn's new tokens also see |
|---|---|---|
| `slot` | the slot's rows (B) in float32 | the summaries, on an artifact converted with them |
| `full` (default) | every prompt position in float32 (the answer is prefilled again) | (nothing: every row is kept) |
| `quantized` | the slot's rows in 8 bits, every dropped row in 4 | the dropped rows (the last tail tokens) |
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import numpy as np

from snapcompile.config import SESSION_KEEP
from snapcompile.errors import SnapcompileError
from snapcompile.sessions.dropped import DroppedChunk, DroppedRows
from snapcompile.sessions.kept import KeptCache, ResumePlan, row_positions
from snapcompile.sessions.summaries import RowSummaries


@dataclass(frozen=True)
class PromptRows:
    """A compressed prompt's prefilled rows right after their selection, readable until the next
    prefill starts. token_ids: [T] int64, the prompt. read(layer): keys, values [Hkv, filled, D]
    float32 on the host. kept_rows: per layer [Hkv, kept] the rows the selection kept (None: it
    kept rows [0, filled), every one)."""

    slot: int
    plan: ResumePlan | None
    token_ids: np.ndarray
    filled: int
    kept_rows: list[np.ndarray] | None
    kv_heads: int
    layers: int
    read: Callable[[int], tuple[np.ndarray, np.ndarray]]

    def not_kept(self) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """Per layer i: (i, positions [Hkv, filled] of the rows, [Hkv, filled] bool: not kept)."""
        tables = row_positions(self.plan, self.prompt_len, self.filled, self.kv_heads, self.layers)
        for i in range(self.layers):
            dropped = np.ones(tables[i].shape, bool)
            np.put_along_axis(dropped, self.kept_rows[i], False, axis=1)
            yield i, tables[i], dropped

    @property
    def prompt_len(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class ResumeRows:
    """Rows a resumed prefill's new tokens attend over besides the plan's kept rows, `count` per
    layer and KV head. tail_only: only the last `export.tail` new tokens see them (on the tail
    graph), and they sit after the earlier new tokens; else every new token does and they sit
    right after the kept rows. pieces(layer): (keys, values [Hkv, m, D] float32, logit bias
    [Hkv, m] or None) in row order."""

    count: int
    tail_only: bool
    pieces: Callable[[int], Iterator[tuple[np.ndarray, np.ndarray, np.ndarray | None]]]


class Keeper:
    """`slot`: an entry is the slot's rows; on an artifact with summaries (policy.summaries
    rows) a resumed turn sees the entry's summaries (empty ones for an entry without). Per-slot
    state follows the sequence (`move`) and is dropped with it (`forget`)."""

    needs_tail = False          # resumed turns run their last tokens on the tail graph

    def __init__(self, manifest):
        self.manifest = manifest
        self._held: dict[int, object] = {}     # slot -> what this mode holds for the sequence until `keep`

    def selected(self, rows: PromptRows) -> KeptCache | None:
        """A compressed prompt's rows were just selected into its slot; returns an entry to keep
        now (the engine stores it in the request's partition), or None."""
        return None

    def keep(self, slot: int, entry: Callable[[], KeptCache]) -> KeptCache | None:
        """What the store keeps of the finished sequence in `slot`, or None: nothing at its end.
        entry(): the slot's rows as a KeptCache (sessions/restore.slot_entry), made only when asked."""
        return entry()

    def resume_rows(self, plan: ResumePlan) -> ResumeRows | None:
        summaries = self.manifest.policy.summaries
        if not summaries:
            return None
        held = plan.kept.summaries or _no_summaries(self.manifest)

        def pieces(layer):
            yield held.attended(layer)
        return ResumeRows(summaries, False, pieces)

    def forget(self, slot: int) -> None:
        self._held.pop(slot, None)

    def move(self, source: int, target: int) -> None:
        if source in self._held:
            self._held[target] = self._held.pop(source)


class SummaryKeeper(Keeper):
    """`slot` on an artifact with summaries: each selection's dropped rows are summed into
    the entry's summaries (sessions/summaries.py)."""

    def selected(self, rows: PromptRows) -> None:
        before = (rows.plan.kept.summaries if rows.plan else None) or _no_summaries(self.manifest)
        if rows.kept_rows is None:
            self._held[rows.slot] = before
            return
        layer_rows = [(*rows.read(i), positions, dropped) for i, positions, dropped in rows.not_kept()]
        self._held[rows.slot] = before.with_dropped(self.manifest.policy.summary_index, layer_rows)

    def keep(self, slot, entry):
        return replace(entry(), summaries=self._held.pop(slot, None))


class FullKeeper(Keeper):
    """`full` (the default): an entry is the whole prompt cache, copied to the host at its
    selection and kept at once (so it counts against the store's bytes from then on and no running
    sequence holds a copy of its own): every position of the prompt, in order, each row computed
    while attending over every row before it. Nothing is kept at the end: the answer's rows were
    computed by decode against the B selected rows, not the whole conversation, so the next turn
    prefills the answer again with its new tokens, and a resumed turn's rows and selection are
    those of prefilling it whole. A resume from rows that are not every position before it keeps
    nothing (no store of this mode holds such an entry)."""

    def selected(self, rows: PromptRows) -> KeptCache | None:
        if rows.plan is not None and rows.plan.rows != rows.plan.resume_at:
            return None
        layers = [rows.read(i) for i in range(rows.layers)]
        keys, values = tuple(k.copy() for k, _ in layers), tuple(v.copy() for _, v in layers)
        hkv, n = keys[0].shape[:2]
        positions = tuple(np.broadcast_to(np.arange(n, dtype=np.int64), (hkv, n)).copy() for _ in keys)
        return KeptCache(np.array(rows.token_ids, np.int64), keys, values, positions, 0)

    def keep(self, slot, entry):
        return None


class QuantizedKeeper(Keeper):
    """`quantized`: each selection's dropped rows are kept in 4 bits (sessions/dropped.py); an
    entry is the slot's rows in 8 bits with them beside, less the oldest chunks until it costs no
    more than a float32 entry of the slot's every row would. A resumed turn's last tail tokens
    attend over every dropped row."""

    needs_tail = True

    def selected(self, rows: PromptRows) -> None:
        before = (rows.plan.kept.dropped if rows.plan else None) or DroppedRows()
        if rows.kept_rows is None:
            self._held[rows.slot] = before
            return
        layers = []
        for i, positions, dropped in rows.not_kept():
            picked = np.nonzero(dropped)[1].reshape(dropped.shape[0], -1)     # each head drops as many rows
            keys, values = rows.read(i)
            layers.append((np.take_along_axis(keys, picked[..., None], axis=1),
                           np.take_along_axis(values, picked[..., None], axis=1),
                           np.take_along_axis(positions, picked, axis=1)))
        self._held[rows.slot] = before.with_chunk(DroppedChunk.of(layers) if layers[0][2].shape[1] else None)

    def keep(self, slot, entry):
        kept = entry()
        dropped = self._held.pop(slot, None)
        if dropped is None:
            return kept
        m = self.manifest
        rows_bound = m.kv_bytes_per_slot() + m.spec.num_layers * kept.positions[0].shape[0] * m.rows_per_slot \
            * kept.positions[0].itemsize
        return kept.quantized(dropped, rows_bound + kept.token_ids.nbytes)

    def resume_rows(self, plan: ResumePlan) -> ResumeRows | None:
        if not plan.dropped_rows:
            return None

        def pieces(layer):
            for keys, values in plan.kept.dropped.layer_chunks(layer):
                yield keys, values, None
        return ResumeRows(plan.dropped_rows, True, pieces)


def keeper_for(manifest, mode: str) -> Keeper:
    """The keeper of `mode` (SESSION_KEEP) for an artifact (a dense one keeps its slot's rows)."""
    if mode not in SESSION_KEEP:
        raise SnapcompileError(f"--session-keep must be one of {', '.join(SESSION_KEEP)}, got {mode!r}")
    if mode == "quantized" and manifest.policy.summaries:
        raise SnapcompileError("--session-keep quantized keeps the dropped rows themselves: it does not go with "
                               "an artifact converted with --summaries (their rows take the same place)")
    if not manifest.policy.compressed or mode == "slot":
        return SummaryKeeper(manifest) if manifest.policy.summaries else Keeper(manifest)
    return FullKeeper(manifest) if mode == "full" else QuantizedKeeper(manifest)


def _no_summaries(manifest) -> RowSummaries:
    spec = manifest.spec
    return RowSummaries.empty(spec.num_layers, spec.num_kv_heads, manifest.policy.summaries, spec.head_dim)
