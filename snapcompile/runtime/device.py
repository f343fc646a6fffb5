"""What the slot backend asks of a device (ONNX Runtime on host memory, TensorRT on CUDA memory), and
the prefill's result and chunking rules that its parts share."""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from snapcompile.artifact.manifest import Manifest
from snapcompile.layout import SlotLayout


class Graph(Protocol):
    def bind(self, name: str, array, output: bool = False) -> None: ...
    def run(self) -> None: ...


class Device(Protocol):
    """Allocates arrays, runs graphs, and moves small arrays to and from the host. `release_pages`
    lets file pages that runs mapped leave the process's memory (called after each prefill chunk
    and every few decode steps)."""

    runs_ort_graphs: bool      # runs ONNX Runtime's graphs (naming.ort_graphs), not only the static ones

    def check(self, folder: Path, manifest: Manifest) -> None: ...
    def available_bytes(self) -> int: ...
    def zeros(self, shape: tuple[int, ...], dtype: str): ...
    def graph(self, name: str, manifest: Manifest) -> Graph: ...
    def kernels(self, manifest: Manifest) -> str: ...
    def upload(self, target, host: np.ndarray) -> None: ...
    def download(self, array) -> np.ndarray: ...
    def indices(self, host: np.ndarray): ...
    def release_pages(self) -> None: ...


class LazyGraph:
    """An artifact's graph made at its first run, so that opening an artifact costs only the graphs
    the process uses: on ONNX Runtime every weight-bearing session pre-packs all the weights once
    more before its container recognises them (~1.3 s a session at the 1B shape; on the CPU one
    session serves a family of buckets), and TensorRT builds an engine a graph. Binds made before it
    exists are kept (the latest for each name) and made on it, in order, when it is made."""

    def __init__(self, device: Device, name: str, manifest: Manifest):
        self.device, self.name, self.manifest = device, name, manifest
        self.graph: Graph | None = None
        self.make_seconds: float | None = None       # how long making it took, once made
        self._binds: dict[str, tuple] = {}           # input / output name -> (array, output)

    def bind(self, name: str, array, output: bool = False) -> None:
        if self.graph is None:
            self._binds.pop(name, None)               # a rebind moves to the end, as it would happen
            self._binds[name] = (array, output)
        else:
            self.graph.bind(name, array, output=output)

    def run(self) -> None:
        self.make().run()

    def make(self) -> Graph:
        """The graph itself, made now if it was not."""
        if self.graph is None:
            start = time.perf_counter()
            graph = self.device.graph(self.name, self.manifest)
            for name, (array, output) in self._binds.items():
                graph.bind(name, array, output=output)
            self.graph, self._binds = graph, {}
            self.make_seconds = time.perf_counter() - start
        return self.graph


@dataclass
class PrefillResult:
    """logits: [V] float32 for the prompt's last token. filled: the prompt's cache rows prefilled
    (a resumed prompt's loaded rows, then its new tokens'). kept_rows: per layer [Hkv, kept] the
    filled rows the selection moved into the slot, ascending (None: rows 0 .. kept-1, all of them).
    compressed: the prompt was prefilled into a prompt cache and compressed into its slot (False: a
    dense prompt, prefilled into its slot)."""

    logits: np.ndarray
    layout: SlotLayout
    kept_rows: list[np.ndarray] | None
    filled: int = 0
    compressed: bool = False


RowsTo = Callable[[int, np.ndarray, np.ndarray, "np.ndarray | None"], None]
"""rows_to(layer, keys, values, kept) of a compressed prefill: `layer`'s filled rows, keys and
values [Hkv, filled, D] in the cache's dtype (export.kv_dtype) on the host, valid during the call
only, and kept, [Hkv, kept] the rows its selection moved into the slot (None: rows [0, kept));
called once a layer, in order, after the layer's selection (a keeper reads a prompt's rows so, sessions/keepers.py).
A local (sliding-window) layer's are its window ring's rows once the prompt is in, the positions
it holds in order (layout.WindowRing.held), kept None."""


LogitsTo = Callable[[int, np.ndarray], None]
"""logits_to(first, logits) of a prefill asked for its prompt's logits: logits [R, V] float32 at new
tokens first .. first + R - 1 (host memory, valid during the call only); called in order until every
new token but the last was handed over."""


@dataclass(frozen=True)
class ResumeFrom:
    """Where a resumed prefill starts, in rows: `rows` rows loaded first (kept(layer): keys, values
    [Hkv, rows, D] float32 or the cache's dtype), the new tokens prefilled after them from token (and RoPE position)
    `position` on. `extra_count` more rows (extra(layer): (keys, values [Hkv, m, D], logit bias
    [Hkv, m] or None) in row order) are attended too: right after the loaded rows, by every new
    token, or with `extra_tail_only` after the earlier new tokens, by the last export.tail new tokens
    only (on the tail graph); the rows after them then move down over them before the selection.
    ring(layer): a local (sliding-window) layer's window ring whole, keys and values [Hkv, ring rows,
    D] with position p at row p % rows (layout.WindowRing), loaded into the slot's ring before the
    layer's chunks (the kept rows are then a global layer's). What the rows stand for is the session
    store's business (sessions/restore.py)."""

    rows: int
    position: int
    kept: Callable[[int], tuple[np.ndarray, np.ndarray]]
    extra_count: int = 0
    extra_tail_only: bool = False
    extra: Callable[[int], Iterator[tuple[np.ndarray, np.ndarray, np.ndarray | None]]] | None = None
    ring: Callable[[int], tuple[np.ndarray, np.ndarray]] | None = None


def chunk_starts(prompt_len: int, chunk: int) -> list[int]:
    """Chunk start positions; the last chunk ends exactly at the prompt's end (it may overlap
    the previous one) so the observation window always lies inside one chunk."""
    starts = list(range(0, max(prompt_len - chunk, 0), chunk))
    starts.append(max(prompt_len - chunk, 0))
    return starts


def bucket_holding(rows: int, buckets, max_context: int) -> int:
    """The cache rows of the prefill graph for `rows` filled rows: the smallest bucket that holds them,
    else max_context (the full graph). Both prefill orders choose their graphs by it."""
    return min((bucket for bucket in buckets if bucket >= rows), default=max_context)


def chunk_spans(length: int, split: int, chunk: int, last_chunk: int):
    """(offset, count) of the chunks of `length` new tokens, none across `split` (0: one run):
    chunk_starts over [0, split) in chunks of `chunk`, then over [split, length) in `last_chunk`."""
    for first, last, size in ((0, split, chunk), (split, length, last_chunk)):
        if last > first:
            for offset in chunk_starts(last - first, size):
                yield first + offset, min(size, last - first - offset)


def drain(chunks) -> PrefillResult:
    """Run a prefill generator (`prefill_chunks`, sessions.restore.resumed_prefill) to its end; its result."""
    while True:
        try:
            next(chunks)
        except StopIteration as stop:
            return stop.value
