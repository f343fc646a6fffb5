"""One layer's rows moved in or out of a cache, the steps both prefill orders share: the chunk-by-chunk
prefill (runtime/prefill.py) runs them for every layer at once, the layer-by-layer one
(runtime/layer_prefill.py) for each layer as it starts. A cache here is one layer's keys or values
[1, Hkv, R, D] (a prompt's rows), or a slot's window ring [Hkv, rows, D], on the device."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from snapcompile.layout import WindowRing
from snapcompile.runtime.device import Device, ResumeFrom


def load_resumed_rows(device: Device, keys, values, resume: ResumeFrom, layer: int, extra_at: int,
                      set_bias: Callable[[slice, np.ndarray], None]) -> int:
    """`layer`'s rows that `resume` loads into the caches keys / values: its kept rows into rows
    [0, resume.rows), its extra rows from row `extra_at` on, set_bias(rows, bias) called for each
    piece that has a logit bias. Returns the end of the rows filled."""
    kept_keys, kept_values = resume.kept(layer)
    device.upload(keys[0, :, :resume.rows], kept_keys)
    device.upload(values[0, :, :resume.rows], kept_values)
    if not resume.extra_count:
        return resume.rows
    first = extra_at
    for extra_keys, extra_values, bias in resume.extra(layer):
        rows = slice(first, first + extra_keys.shape[1])
        device.upload(keys[0, :, rows], extra_keys)
        device.upload(values[0, :, rows], extra_values)
        if bias is not None:
            set_bias(rows, bias)
        first = rows.stop
    return first


def move_rows_down(device: Device, caches, first: int, count: int, new: int) -> None:
    """In each cache the `new` rows after rows [first, first + count) move down to `first`, over them
    (a resumed prefill's extra rows, once its new tokens attended over them)."""
    for cache in caches:
        moved = device.download(cache[0, :, first + count:first + count + new]).copy()
        device.upload(cache[0, :, first:first + new], moved)


def load_ring(device: Device, keys, values, resume: ResumeFrom, layer: int) -> None:
    """A local layer's window ring that `resume` loads, whole, into a slot's ring keys / values."""
    ring_keys, ring_values = resume.ring(layer)
    device.upload(keys, ring_keys)
    device.upload(values, ring_values)


def ring_rows(device: Device, keys, values, ring: WindowRing, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """A slot's window ring, keys and values, on the host once positions [0, positions) were written:
    [Hkv, n, D] the positions it holds, in order (WindowRing.held)."""
    rows = np.array(ring.held(positions), np.int64) % ring.rows
    return device.download(keys)[:, rows], device.download(values)[:, rows]


def streaming_rows(device: Device, policy, filled: int) -> tuple[np.ndarray, object]:
    """StreamingLLM's kept rows of `filled` prompt rows: their positions [kept] int64 on the host, and
    the same as the device's indices."""
    positions = np.array(policy.streaming_positions(filled), np.int64)
    return positions, device.indices(positions)
