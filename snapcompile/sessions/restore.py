"""The resume boundary: a kept conversation's rows into a prefill, and a finished slot's rows into a
kept conversation. The runtime only moves rows (runtime.device.ResumeFrom, SlotBackend.slot_rows);
what they stand for (positions, tokens, the keeper's pieces) is decided here.

- `resumed_prefill`: a prompt prefilled from a ResumePlan and the keeper's ResumeRows (the engine
  core's and validate's one way to resume);
- `kept_positions`: the positions the selection kept, from the rows the runtime reports;
- `prompt_reading`: the keeper's reading of a prompt's rows as they are selected (`Keeper.reading`);
- `slot_entry`: the KeptCache of a finished slot (`Keeper.keep`).
"""
from __future__ import annotations

import numpy as np

from snapcompile.errors import SnapcompileError
from snapcompile.layout import SlotLayout, WindowRing
from snapcompile.runtime.device import PrefillResult, ResumeFrom
from snapcompile.sessions.keepers import PromptRows, Reading, ResumeRows
from snapcompile.sessions.kept import KeptCache, ResumePlan, positions_of_rows


def resumed_prefill(backend, slot: int, plan: ResumePlan, token_ids: list[int], extra: ResumeRows | None = None,
                    rows_to=None):
    """Generator form of a resumed prefill (`sessions/kept.py`): the plan's kept rows go into the
    prompt's cache, tokens [resume_at, T) are prefilled against them at their own positions (and
    over `extra`, the keeper's `resume_rows(plan)`), and the cache is compressed back into the slot
    as a prompt of T positions (snapstream re-selects with the new tokens' window). A conversation
    may pass max_context this way; the rows prefilled against (the entry's dropped rows included)
    may not. rows_to: the keeper's reading of the rows (runtime.device.RowsTo). Yields each chunk's
    token count; returns the runtime's PrefillResult."""
    rows = plan.rows + plan.dropped_rows + len(token_ids) - plan.resume_at
    if rows > backend.max_resume_rows() or not 0 < plan.resume_at < len(token_ids):
        raise SnapcompileError(f"cannot resume {len(token_ids)} tokens at token {plan.resume_at} from "
                               f"{plan.rows} kept rows and {plan.dropped_rows} dropped ones: {rows} rows, "
                               f"the artifact's resumed prefill takes {backend.max_resume_rows()}")
    tail_rows = extra.count if extra is not None and extra.tail_only else 0
    if plan.dropped_rows != tail_rows:
        raise SnapcompileError(f"the plan attends over {plan.dropped_rows} dropped rows but {tail_rows} were "
                               "given (the quantized keeper's resume_rows)")
    ring = backend.manifest.window_ring
    resume = ResumeFrom(plan.rows, plan.resume_at, lambda layer: plan.kept.layer_rows(layer, plan.rows),
                        extra.count if extra else 0, bool(extra and extra.tail_only), extra.pieces if extra else None,
                        lambda layer: plan.kept.ring_order(layer, ring))
    return (yield from backend.prefill_chunks(slot, token_ids, resume, rows_to))


def kept_positions(plan: ResumePlan | None, prompt_len: int, result: PrefillResult) -> list[np.ndarray] | None:
    """Per layer [Hkv, kept] the prompt positions now in the slot (None: 0 .. kept-1, the whole prompt
    kept): a fresh prompt's rows are its positions, and so are a dense one's; a compressed resumed
    one's rows are the plan's kept rows, then its new tokens'."""
    if plan is None or not result.compressed:
        return result.kept_rows
    return positions_of_rows(plan, prompt_len, result.kept_rows, result.layout.kept)


def prompt_reading(keeper, manifest, slot: int, plan: ResumePlan | None, token_ids: list[int]) -> Reading | None:
    """The keeper's reading of a compressed prompt's rows as each layer is selected (`Keeper.reading`;
    None for a dense artifact's prompt, prefilled into its slot)."""
    if not manifest.policy.compressed:
        return None
    return keeper.reading(PromptRows(slot, plan, np.asarray(token_ids, np.int64)))


def slot_entry(rows: list[tuple[np.ndarray, np.ndarray]], layout: SlotLayout, kept: list[np.ndarray] | None,
               fed: int, token_ids: list[int], ring: WindowRing | None = None,
               ring_layers: tuple[int, ...] = ()) -> KeptCache:
    """The cache of a finished sequence as host arrays in position order (the cache's dtype): its kept prompt
    rows (`kept`, per layer [Hkv, kept] positions as `kept_positions` gives them) and the `fed` decode
    tokens the slot still holds; a ring layer's (`ring_layers`, Gemma 3's local ones) the positions
    its window `ring` holds. rows: the slot's keys and values per layer [Hkv, rows_per_slot, D] (a
    ring layer's [Hkv, ring.rows, D]; SlotBackend.slot_rows); token_ids: the prompt and the fed
    output tokens (len = positions covered)."""
    hkv = rows[0][0].shape[0]
    decoded = layout.fed_rows(fed)
    prompt = np.broadcast_to(np.arange(layout.kept), (hkv, layout.kept))
    slot_rows = np.concatenate([prompt, np.broadcast_to(np.array([r for r, _ in decoded], np.int64),
                                                        (hkv, len(decoded)))], axis=1)
    decoded_positions = np.broadcast_to(np.array([p for _, p in decoded], np.int64), (hkv, len(decoded)))
    keys, values, positions = [], [], []
    held = np.array(ring.held(len(token_ids)), np.int64) if ring_layers else None
    for i, (layer_keys, layer_values) in enumerate(rows):
        if i in ring_layers:
            keys.append(layer_keys[:, held % ring.rows])
            values.append(layer_values[:, held % ring.rows])
            positions.append(np.broadcast_to(held, (hkv, len(held))).copy())
            continue
        layer_positions = np.concatenate([prompt if kept is None else kept[i], decoded_positions], axis=1)
        order = np.argsort(layer_positions, axis=1, kind="stable")
        layer_rows = np.take_along_axis(slot_rows, order, axis=1)[:, :, None]
        keys.append(np.take_along_axis(layer_keys, layer_rows, axis=1))
        values.append(np.take_along_axis(layer_values, layer_rows, axis=1))
        positions.append(np.take_along_axis(layer_positions, order, axis=1))
    return KeptCache(np.array(token_ids, np.int64), tuple(keys), tuple(values), tuple(positions),
                     layout.prompt_len if layout.compressed else 0, ring_layers=tuple(ring_layers))
