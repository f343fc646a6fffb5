"""What a finished sequence leaves in the session store, one keeper per `--session-keep` mode
(docs/design.md, "Conversations that keep their cache"). Host arrays only: a keeper reads a
compressed prompt's rows a layer at a time as they are selected (`reading`) and, at the end, is
handed the slot's entry to make
(sessions/restore.slot_entry); it gives what a resumed prefill attends over besides the kept rows
(`ResumeRows`). The engine drives it; it never calls the backend.

| mode | entry | a resumed turn's new tokens also see |
|---|---|---|
| `slot` | the slot's rows (B) in the cache's dtype (`--kv-dtype`) | the summaries, on an artifact converted with them |
| `full` (default) | every prompt position in the cache's dtype (the answer prefilled again) | (nothing: all kept) |
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
    """A compressed prompt being prefilled, whose rows a keeper reads a layer at a time, right after
    each layer's selection (`Keeper.reading`). token_ids: [T] int64, the prompt."""

    slot: int
    plan: ResumePlan | None
    token_ids: np.ndarray

    @property
    def prompt_len(self) -> int:
        return len(self.token_ids)

    def not_kept(self, layer: int, filled: int, kept: np.ndarray, kv_heads: int) -> tuple[np.ndarray, np.ndarray]:
        """`layer`'s positions [Hkv, filled] of the filled rows, and [Hkv, filled] bool: not kept
        (kept: [Hkv, kept] the rows its selection kept)."""
        positions = row_positions(self.plan, self.prompt_len, filled, kv_heads, layer)
        dropped = np.ones(positions.shape, bool)
        np.put_along_axis(dropped, kept, False, axis=1)
        return positions, dropped


class Reading:
    """A keeper's reading of one prompt's rows: `layer` once a layer, in order (runtime.device.RowsTo:
    the arrays are valid during the call only), then `done`, which gives an entry to keep now (the
    engine stores it in the request's partition) or None. oversized: the entry it would make is larger
    than the store, so it reads nothing and makes none (the store counts it refused)."""

    oversized = False

    def layer(self, i: int, keys: np.ndarray, values: np.ndarray, kept: np.ndarray | None) -> None:
        raise NotImplementedError

    def done(self) -> KeptCache | None:
        raise NotImplementedError


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

    def reading(self, prompt: PromptRows) -> Reading | None:
        """How this mode reads a compressed prompt's rows as they are selected into its slot (None:
        it reads none)."""
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

    def reading(self, prompt: PromptRows) -> Reading:
        return _SummaryReading(self, prompt)

    def keep(self, slot, entry):
        return replace(entry(), summaries=self._held.pop(slot, None))


class _SummaryReading(Reading):
    def __init__(self, keeper: SummaryKeeper, prompt: PromptRows):
        self.keeper, self.prompt, self.layers = keeper, prompt, []
        self.before = (prompt.plan.kept.summaries if prompt.plan else None) or _no_summaries(keeper.manifest)

    def layer(self, i, keys, values, kept):
        if kept is None:                  # the selection kept every row
            self.layers.append((self.before.key_sums[i], self.before.value_sums[i], self.before.counts[i]))
            return
        positions, dropped = self.prompt.not_kept(i, keys.shape[1], kept, keys.shape[0])
        self.layers.append(self.before.layer_with_dropped(self.keeper.manifest.policy.summary_index, i, keys, values,
                                                          positions, dropped))

    def done(self):
        self.keeper._held[self.prompt.slot] = RowSummaries.of_layers(self.layers)
        return None


class FullKeeper(Keeper):
    """`full` (the default): an entry is the whole prompt cache, copied to the host as each layer is
    selected and kept at once (so it counts against the store's bytes from then on and no running
    sequence holds a copy of its own): every position of the prompt, in order, each row computed
    while attending over every row before it. Nothing is kept at the end: the answer's rows were
    computed by decode against the B selected rows, not the whole conversation, so the next turn
    prefills the answer again with its new tokens, and a resumed turn's rows and selection are
    those of prefilling it whole. A resume from rows that are not every position before it keeps
    nothing (no store of this mode holds such an entry), nor does a prompt whose entry would be
    larger than the store (`max_bytes`): its rows are not copied."""

    def __init__(self, manifest, max_bytes: int | None = None):
        super().__init__(manifest)
        self.max_bytes = max_bytes

    def reading(self, prompt: PromptRows) -> Reading | None:
        if prompt.plan is not None and prompt.plan.rows != prompt.plan.resume_at:
            return None
        spec, ring = self.manifest.spec, self.manifest.window_ring
        rows = sum(min(prompt.prompt_len, ring.rows) if i in spec.local_layers else prompt.prompt_len
                   for i in range(spec.num_layers))
        entry_bytes = prompt.token_ids.nbytes + rows * spec.num_kv_heads * (
            2 * self.manifest.export.kv_row_bytes(spec.head_dim) + 8)        # keys and values, int64 positions
        oversized = self.max_bytes is not None and entry_bytes > self.max_bytes
        return _Oversized() if oversized else _FullReading(prompt, spec.local_layers)

    def keep(self, slot, entry):
        return None


class _FullReading(Reading):
    """Every layer's rows as handed (device.RowsTo): a global layer's every prompt position, a ring
    layer's (`ring_layers`) the last positions of the prompt its window ring holds."""

    def __init__(self, prompt: PromptRows, ring_layers: tuple[int, ...]):
        self.prompt, self.ring_layers, self.keys, self.values = prompt, ring_layers, [], []

    def layer(self, i, keys, values, kept):
        self.keys.append(keys.copy())
        self.values.append(values.copy())

    def done(self):
        end = self.prompt.prompt_len
        positions = tuple(np.broadcast_to(np.arange(end - k.shape[1], end, dtype=np.int64), k.shape[:2]).copy()
                          for k in self.keys)
        return KeptCache(np.array(self.prompt.token_ids, np.int64), tuple(self.keys), tuple(self.values), positions,
                         0, ring_layers=self.ring_layers)


class _Oversized(Reading):
    oversized = True

    def layer(self, i, keys, values, kept):
        pass

    def done(self):
        return None


class QuantizedKeeper(Keeper):
    """`quantized`: each selection's dropped rows are kept in 4 bits (sessions/dropped.py), quantized
    as each layer is selected; an entry is the slot's rows in 8 bits with them beside, less the
    oldest chunks until it costs no more than an entry of the slot's every row in the cache's dtype. A
    resumed turn's last tail tokens attend over every dropped row."""

    needs_tail = True

    def reading(self, prompt: PromptRows) -> Reading:
        return _QuantizedReading(self, prompt)

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


class _QuantizedReading(Reading):
    def __init__(self, keeper: QuantizedKeeper, prompt: PromptRows):
        self.keeper, self.prompt, self.layers = keeper, prompt, []
        self.before = (prompt.plan.kept.dropped if prompt.plan else None) or DroppedRows()

    def layer(self, i, keys, values, kept):
        if kept is None:                  # the selection kept every row
            return
        positions, dropped = self.prompt.not_kept(i, keys.shape[1], kept, keys.shape[0])
        picked = np.nonzero(dropped)[1].reshape(dropped.shape[0], -1)     # each head drops as many rows
        self.layers.append(DroppedChunk.of_layer(np.take_along_axis(keys, picked[..., None], axis=1),
                                                 np.take_along_axis(values, picked[..., None], axis=1),
                                                 np.take_along_axis(positions, picked, axis=1)))

    def done(self):
        chunk = DroppedChunk.of_layers(self.layers) if self.layers and self.layers[0][2].shape[1] else None
        self.keeper._held[self.prompt.slot] = self.before.with_chunk(chunk)
        return None


def check_keep_with_cache(mode: str, kv_dtype: str) -> None:
    """Refuse a keep mode an artifact with KV cache `kv_dtype` cannot take (before it is converted too)."""
    if mode == "quantized" and kv_dtype == "int8":
        raise SnapcompileError("--session-keep quantized holds the slot's rows in 8 bits: an artifact with "
                               "--kv-dtype int8 stores them so already; use slot or full")


def keeper_for(manifest, mode: str, max_bytes: int | None = None) -> Keeper:
    """The keeper of `mode` (SESSION_KEEP) for an artifact (a dense one keeps its slot's rows), for a
    store of `max_bytes` (None: unbounded)."""
    if mode not in SESSION_KEEP:
        raise SnapcompileError(f"--session-keep must be one of {', '.join(SESSION_KEEP)}, got {mode!r}")
    if mode == "quantized" and manifest.window_ring is not None:
        raise SnapcompileError("--session-keep quantized is not built for a model with sliding-window layers "
                               "(Gemma 3's local layers): use full or slot")
    check_keep_with_cache(mode, manifest.export.kv_dtype)
    if mode == "quantized" and manifest.policy.summaries:
        raise SnapcompileError("--session-keep quantized keeps the dropped rows themselves: it does not go with "
                               "an artifact converted with --summaries (their rows take the same place)")
    if not manifest.policy.compressed or mode == "slot":
        return SummaryKeeper(manifest) if manifest.policy.summaries else Keeper(manifest)
    return FullKeeper(manifest, max_bytes) if mode == "full" else QuantizedKeeper(manifest)


def _no_summaries(manifest) -> RowSummaries:
    spec = manifest.spec
    return RowSummaries.empty(spec.num_layers, spec.num_kv_heads, manifest.policy.summaries, spec.head_dim)
