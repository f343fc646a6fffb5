"""The slot backend: the only runtime code that touches tensors.

It owns the N static cache slots ([N, Hkv, rows_per_slot, D] per layer, allocated once and bound to
every decode graph once by address: a graph of k slots sees the first k) and a prefill scratch
cache for one sequence. Each prefill chunk runs on the smallest bucket graph that holds the rows
filled before it (or the full graph), so no chunk pays attention over more rows than it needs.
A decode step runs on the smallest decode graph holding its active slots and moves only the new
tokens' K/V into the slots; nothing copies a whole cache. Where the tensors
live and how a graph runs is the Device's business (ONNX Runtime on host memory, TensorRT on
CUDA memory); small per-step inputs are prepared in numpy and uploaded.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from snapcompile.artifact.manifest import Manifest, read_manifest
from snapcompile.artifact.naming import (
    TAIL_GRAPH,
    bucket_rows,
    decode_graph_size,
    expected_graphs,
    graph_name,
    is_decode_graph,
    is_prefill_graph,
)
from snapcompile.errors import PromptError, SnapcompileError
from snapcompile.runtime.dropped import DroppedChunk, DroppedRows
from snapcompile.runtime.kept import KeptCache, ResumePlan
from snapcompile.runtime.layout import DecodeStep, SlotLayout
from snapcompile.runtime.memory import check_fits, gib
from snapcompile.runtime.summaries import RowSummaries


class Graph(Protocol):
    def bind(self, name: str, array, output: bool = False) -> None: ...
    def run(self) -> None: ...


class Device(Protocol):
    """Allocates arrays, runs graphs, and moves small arrays to and from the host."""

    def check(self, folder: Path, manifest: Manifest) -> None: ...
    def available_bytes(self) -> int: ...
    def zeros(self, shape: tuple[int, ...], dtype: str): ...
    def graph(self, name: str, manifest: Manifest) -> Graph: ...
    def kernels(self, manifest: Manifest) -> str: ...
    def upload(self, target, host: np.ndarray) -> None: ...
    def download(self, array) -> np.ndarray: ...
    def indices(self, host: np.ndarray): ...


@dataclass
class PrefillResult:
    """logits: [V] float32 for the prompt's last token. kept_positions: per layer [Hkv, kept]
    prompt positions now in the slot, ascending (None when they are 0 .. kept-1: the whole prompt
    was kept)."""

    logits: np.ndarray
    layout: SlotLayout
    kept_positions: list[np.ndarray] | None


def chunk_starts(prompt_len: int, chunk: int) -> list[int]:
    """Chunk start positions; the last chunk ends exactly at the prompt's end (it may overlap
    the previous one) so the observation window always lies inside one chunk."""
    starts = list(range(0, max(prompt_len - chunk, 0), chunk))
    starts.append(max(prompt_len - chunk, 0))
    return starts


def _chunk_spans(length: int, split: int, chunk: int, last_chunk: int):
    """(offset, count) of the chunks of `length` new tokens, none across `split` (0: one run):
    chunk_starts over [0, split) in chunks of `chunk`, then over [split, length) in `last_chunk`."""
    for first, last, size in ((0, split, chunk), (split, length, last_chunk)):
        if last > first:
            for offset in chunk_starts(last - first, size):
                yield first + offset, min(size, last - first - offset)


def drain(chunks) -> PrefillResult:
    """Run a prefill generator (`prefill_chunks`, `resume_chunks`) to its end; its result."""
    while True:
        try:
            next(chunks)
        except StopIteration as stop:
            return stop.value


def packed_weight_copies(manifest: Manifest) -> int:
    """Graphs whose ONNX Runtime CPU session keeps a pre-packed copy of the weights: every decode
    graph, and every prefill graph of a quantized artifact (float prefill sessions share the
    memory-mapped weights.bin; `OrtDevice.graph`)."""
    names = expected_graphs(manifest.export, manifest.policy)
    prefill = sum(map(is_prefill_graph, names)) if manifest.export.quantized else 0
    return sum(map(is_decode_graph, names)) + prefill


def memory_needed(manifest: Manifest, weight_bytes: int | None = None) -> dict[str, int]:
    """Bytes the backend allocates for an artifact, by purpose (an estimate that leaves out the
    runtime's own work space): the slot caches, the one-prompt prefill caches, the weights
    (weight_bytes, or the artifact's weights.bin) and the sessions' pre-packed copies of them."""
    m, per_token = manifest, manifest.spec.kv_bytes_per_token
    prefill_rows = m.export.max_context if m.policy.compressed else 0
    prefill_rows += max(m.export.prefill_buckets(), default=0)
    weights = m.files.get("weights.bin", {}).get("bytes", 0) if weight_bytes is None else weight_bytes
    return {"slot_caches": m.export.slots * m.rows_per_slot * per_token,
            "prefill_caches": prefill_rows * per_token, "weights": weights,
            "packed_weights": packed_weight_copies(m) * weights}


def check_memory(manifest: Manifest, available: int | None = None, weight_bytes: int | None = None) -> None:
    """Refuse, before allocating anything, an artifact that needs more memory than is available
    (run and serve check the artifact they open; export checks the shapes it is asked for)."""
    needed = memory_needed(manifest, weight_bytes)
    what = (f"the artifact ({gib(needed['slot_caches'])} of KV cache for {manifest.export.slots} slots x "
            f"{manifest.rows_per_slot} rows, {gib(needed['weights'] + needed['packed_weights'])} of weights with "
            "the sessions' packed copies)")
    check_fits(sum(needed.values()), what, "convert with fewer --slots (or --no-slot-buckets) or a smaller "
               "--budget / --max-context", available)


class SlotBackend:
    """Runs an artifact's graphs on a Device. Slot state (layouts, positions) is the caller's."""

    def __init__(self, folder: Path, device: Device):
        self.folder, self.device = Path(folder), device
        self.manifest: Manifest = read_manifest(self.folder)
        m = self.manifest
        device.check(self.folder, m)             # the graphs belong to this manifest
        check_memory(m, device.available_bytes())
        self.num_layers, self.slots, self.chunk = m.spec.num_layers, m.export.slots, m.export.chunk
        self.rows_per_slot = m.rows_per_slot
        self._layers = range(self.num_layers)
        self.keys = [self._kv(self.slots, self.rows_per_slot) for _ in self._layers]
        self.values = [self._kv(self.slots, self.rows_per_slot) for _ in self._layers]
        self.prefill_graph = device.graph("prefill", m)
        self.bucket_graphs = {bucket_rows(name): device.graph(name, m)           # rows -> graph
                              for name in m.graphs if bucket_rows(name) is not None}
        self.decode_sizes = m.export.decode_sizes()
        self.decode_graphs = {k: device.graph(graph_name("decode", k, self.slots), m)       # slots -> graph
                              for k in self.decode_sizes}
        self.select_graph = device.graph("select", m) if "select" in m.graphs else None
        self.select_buckets = {bucket_rows(name, "select"): device.graph(name, m)  # rows -> graph
                               for name in m.graphs if bucket_rows(name, "select") is not None}
        self._init_prefill()
        self._init_decode()
        self.last_prefill_seconds = {"chunks": 0.0, "select": 0.0}   # of the latest prefill, for benchmarks
        # keep_full_prompt (session store, mode "full"): a compressed slot's whole prompt cache is
        # copied to host at its prefill (slot -> per-layer K, V [Hkv, T, D]) for `keep`
        self.keep_full_prompt = False
        self._full_prompts: dict[int, tuple[list[np.ndarray], list[np.ndarray]]] = {}
        self._summaries: dict[int, RowSummaries] = {}    # slot -> its sequence's dropped rows (summaries on)
        # keep_dropped (session store, mode "quantized", `keep_dropped_rows`): slot -> the dropped
        # rows its sequence's entry will hold (the resumed entry's and its own prefill's selection's)
        self._dropped: dict[int, DroppedRows] = {}
        self.tail_graph: Graph | None = None      # loaded by keep_dropped_rows

    def _kv(self, batch: int, rows: int):
        return self.device.zeros((batch, self.manifest.spec.num_kv_heads, rows, self.manifest.spec.head_dim), "float32")

    # ---------------------------------------------------------------- buffers
    def _init_prefill(self) -> None:
        m, zeros = self.manifest, self.device.zeros
        self.p_ids = zeros((1, self.chunk), "int64")
        self.p_start, self.p_pos, self.p_len = (zeros((1,), "int64") for _ in range(3))
        self.p_logits = zeros((1, m.spec.vocab_size), "float32")
        self.p_new_k = [self._kv(1, self.chunk) for _ in self._layers]
        self.p_new_v = [self._kv(1, self.chunk) for _ in self._layers]
        if m.policy.compressed:    # the full prompt lives here until it is compressed into a slot
            self.scratch_k = [self._kv(1, m.export.max_context) for _ in self._layers]
            self.scratch_v = [self._kv(1, m.export.max_context) for _ in self._layers]
        for g in self._all_prefill_graphs():
            for name, array in (("input_ids", self.p_ids), ("start", self.p_start), ("position", self.p_pos),
                                ("chunk_len", self.p_len)):
                g.bind(name, array)
            g.bind("logits", self.p_logits, output=True)
            for i in self._layers:
                g.bind(f"key.{i}", self.p_new_k[i], output=True)
                g.bind(f"value.{i}", self.p_new_v[i], output=True)
        self._init_buckets()
        self._init_cache_bias()
        if self.select_graph is not None:
            self._init_select()

    def _init_cache_bias(self) -> None:
        """With summaries, every prefill graph's cache_bias.{i} [1, Hkv, R]: zero but while a resumed
        prefill attends over summary rows (passes/cache_bias.py)."""
        self.p_bias: dict[int, list] = {}          # graph rows R -> per layer bias
        self._bias_set = False                     # a resumed prefill's summaries are in p_bias
        if not self.manifest.policy.summaries:
            return
        hkv = self.manifest.spec.num_kv_heads
        graphs = {self.manifest.export.max_context: self.prefill_graph, **self.bucket_graphs}
        for rows, g in graphs.items():
            self.p_bias[rows] = [self.device.zeros((1, hkv, rows), "float32") for _ in self._layers]
            for i in self._layers:
                g.bind(f"cache_bias.{i}", self.p_bias[rows][i])

    def _all_prefill_graphs(self) -> list[Graph]:
        return [self.prefill_graph, *self.bucket_graphs.values()]

    def _init_buckets(self) -> None:
        """One K and one V buffer per layer, as large as the largest bucket; each bucket graph
        sees its prefix as [1, Hkv, rows, D] (one prefill runs at a time)."""
        self.bucket_k, self.bucket_v = {}, {}
        if not self.bucket_graphs:
            return
        hkv, d = self.manifest.spec.num_kv_heads, self.manifest.spec.head_dim
        size = hkv * max(self.bucket_graphs) * d
        flat_k = [self.device.zeros((size,), "float32") for _ in self._layers]
        flat_v = [self.device.zeros((size,), "float32") for _ in self._layers]
        for rows, g in self.bucket_graphs.items():
            shape = (1, hkv, rows, d)
            self.bucket_k[rows] = [flat[: hkv * rows * d].reshape(shape) for flat in flat_k]
            self.bucket_v[rows] = [flat[: hkv * rows * d].reshape(shape) for flat in flat_v]
            for i in self._layers:
                g.bind(f"past_key.{i}", self.bucket_k[rows][i])
                g.bind(f"past_value.{i}", self.bucket_v[rows][i])

    def prefill_rows(self, prompt_len: int) -> int:
        """The smallest bucket that holds `prompt_len` cache rows, else max_context (the full
        prefill graph): the cache a whole prompt of that length is selected from."""
        fitting = [rows for rows in self.bucket_graphs if rows >= prompt_len]
        return min(fitting) if fitting else self.manifest.export.max_context

    def _init_select(self) -> None:
        m, zeros = self.manifest, self.device.zeros
        heads, window, d = m.spec.num_heads, m.policy.window, m.spec.head_dim
        share, hkv = m.policy.resolved_prompt_share, m.spec.num_kv_heads
        self.window_q = [zeros((1, heads, window, d), "float32") for _ in self._layers]
        self.sel_k = [self._kv(1, share) for _ in self._layers]
        self.sel_v = [self._kv(1, share) for _ in self._layers]
        self.sel_idx = [zeros((1, hkv, share), "int64") for _ in self._layers]
        self.sel_len = zeros((1,), "int64")
        missing = set(self.select_buckets) - set(self.bucket_k)
        if missing:
            raise SnapcompileError(f"{self.folder}: select graphs for {sorted(missing)} rows have no prefill bucket "
                                   "of those rows; convert the artifact again")
        reads = [(self.select_graph, self.scratch_k, self.scratch_v),    # each select graph and its cache
                 *((s, self.bucket_k[rows], self.bucket_v[rows]) for rows, s in self.select_buckets.items())]
        for s, keys, values in reads:
            s.bind("prompt_len", self.sel_len)
            for i in self._layers:
                s.bind(f"window_query.{i}", self.window_q[i])
                s.bind(f"key.{i}", keys[i])
                s.bind(f"value.{i}", values[i])
                s.bind(f"selected_key.{i}", self.sel_k[i], output=True)
                s.bind(f"selected_value.{i}", self.sel_v[i], output=True)
                s.bind(f"selected_index.{i}", self.sel_idx[i], output=True)
        for g in self._all_prefill_graphs():
            for i in self._layers:
                g.bind(f"window_query.{i}", self.window_q[i], output=True)

    def keep_dropped_rows(self) -> None:
        """Turn keep_dropped on (a compressed artifact's session store in mode "quantized"): load the
        tail graph, which runs a resumed turn's last T (export.tail) tokens over the entry's
        dropped rows, bound to the scratch cache. Raises SnapcompileError for an artifact without it."""
        m, zeros = self.manifest, self.device.zeros
        if TAIL_GRAPH not in m.graphs:
            raise SnapcompileError(f"{self.folder}: --session-keep quantized runs a resumed turn's last tokens on the "
                                   f"graph {TAIL_GRAPH}, which this artifact lacks (converted before it, or with "
                                   "--tail 0); convert it again")
        g = self.tail_graph = self.device.graph(TAIL_GRAPH, m)
        self.t_ids = zeros((1, m.export.tail), "int64")
        self.t_new_k = [self._kv(1, m.export.tail) for _ in self._layers]
        self.t_new_v = [self._kv(1, m.export.tail) for _ in self._layers]
        for name, array in (("input_ids", self.t_ids), ("start", self.p_start), ("position", self.p_pos),
                            ("chunk_len", self.p_len)):
            g.bind(name, array)
        g.bind("logits", self.p_logits, output=True)
        for i in self._layers:
            g.bind(f"past_key.{i}", self.scratch_k[i])
            g.bind(f"past_value.{i}", self.scratch_v[i])
            g.bind(f"key.{i}", self.t_new_k[i], output=True)
            g.bind(f"value.{i}", self.t_new_v[i], output=True)
            if self.select_graph is not None:
                g.bind(f"window_query.{i}", self.window_q[i], output=True)

    @property
    def keep_dropped(self) -> bool:
        """Each selection's dropped rows are kept for `keep` (on once `keep_dropped_rows` ran)."""
        return self.tail_graph is not None

    def _init_decode(self) -> None:
        """Per-step buffers for N slots; a decode graph of k slots is bound to their first k rows
        (and to the first k slot caches), so every graph reads and writes the same buffers."""
        n, zeros = self.slots, self.device.zeros
        self.d_ids = zeros((n, 1), "int64")
        self.d_inputs = {name: zeros((n,), "int64") for name in ("position", "cache_len", "write_index")}
        self.d_logits = zeros((n, self.manifest.spec.vocab_size), "float32")
        self.d_new_k = [self._kv(n, 1) for _ in self._layers]
        self.d_new_v = [self._kv(n, 1) for _ in self._layers]
        for k, g in self.decode_graphs.items():
            g.bind("input_ids", self.d_ids[:k])
            for name, array in self.d_inputs.items():
                if name != "write_index" or self.manifest.policy.compressed:
                    g.bind(name, array[:k])
            g.bind("logits", self.d_logits[:k], output=True)
            for i in self._layers:
                g.bind(f"past_key.{i}", self.keys[i][:k])
                g.bind(f"past_value.{i}", self.values[i][:k])
                g.bind(f"key.{i}", self.d_new_k[i][:k], output=True)
                g.bind(f"value.{i}", self.d_new_v[i][:k], output=True)

    def decode_size(self, slots) -> int:
        """Slots of the decode graph a step of these active slots runs on: the smallest graph
        that holds the highest of them."""
        return decode_graph_size(self.decode_sizes, max(slots))

    # ---------------------------------------------------------------- prefill
    def max_prompt_len(self) -> int:
        """A compressed slot takes any prompt up to max_context; a dense one needs a row left for decode."""
        return self.manifest.export.max_context - (0 if self.manifest.policy.compressed else 1)

    def max_resume_rows(self) -> int:
        """Rows a resumed prefill's kept rows and new tokens may take: the prompt's, less the summary rows."""
        return self.max_prompt_len() - self.manifest.policy.summaries

    def check_prompt(self, token_ids: list[int]) -> None:
        """The one rule on a prompt's length: raise PromptError unless 1 <= len <= max_prompt_len()."""
        if not token_ids:
            raise PromptError("empty", 0, self.max_prompt_len())
        if len(token_ids) > self.max_prompt_len():
            raise PromptError("too_long", len(token_ids), self.max_prompt_len())

    def chunk_rows(self, start: int) -> int:
        """Cache rows the chunk starting at `start` attends over: those of the smallest bucket that
        holds the `start` rows already filled (`prefill_rows`, the same rule). So a prompt's chunks
        follow the causal triangle in bucket steps instead of all paying the whole prompt's bucket."""
        return self.prefill_rows(start)

    def prefill_chunks(self, slot: int, token_ids: list[int]):
        """Generator form of `prefill`: yields the tokens of each chunk once it ran (so an
        engine can interleave decode steps) and returns the PrefillResult."""
        self.check_prompt(token_ids)
        return (yield from self._prefill(slot, token_ids, None))

    def resume_chunks(self, slot: int, plan: ResumePlan, token_ids: list[int]):
        """Generator form of a resumed prefill (`runtime/kept.py`): the plan's kept rows go into the
        prompt's cache, tokens [resume_at, T) are prefilled against them at their own positions,
        and the cache is compressed back into the slot as a prompt of T positions (snapstream
        re-selects with the new tokens' window). A conversation may pass max_context this way;
        the rows prefilled against (the entry's dropped rows included) may not."""
        rows = plan.rows + plan.dropped_rows + len(token_ids) - plan.resume_at
        if rows > self.max_resume_rows() or not 0 < plan.resume_at < len(token_ids):
            raise SnapcompileError(f"cannot resume {len(token_ids)} tokens at token {plan.resume_at} from "
                                   f"{plan.rows} kept rows and {plan.dropped_rows} dropped ones: {rows} rows, "
                                   f"the artifact's resumed prefill takes {self.max_resume_rows()}")
        if plan.dropped_rows and self.tail_graph is None:
            raise SnapcompileError("a resumed prefill over dropped rows runs on the tail graph: call "
                                   "keep_dropped_rows first")
        return (yield from self._prefill(slot, token_ids, plan))

    def _prefill(self, slot: int, token_ids: list[int], plan: ResumePlan | None):
        """Every chunk's K/V goes to the targets (the slot, or the scratch cache of a compressed
        prompt); a bucket's own cache is a copy of their first rows, filled when a chunk moves
        to that bucket (the buckets share one buffer, so one holds this prompt at a time).
        A resumed prefill with summaries attends over them as rows between the kept rows and the
        new tokens; with the entry's dropped rows, only its last T new tokens do (export.tail,
        which hold the window), on the tail graph: the dropped rows lie between the earlier new
        tokens and those. The rows after them move down over them before the selection."""
        targets = self._prefill_targets(slot)
        if self._bias_set:               # a resumed prefill abandoned mid-way (its request cancelled)
            self._clear_cache_bias()
        base, first_position = (plan.rows, plan.resume_at) if plan else (0, 0)
        new = token_ids[first_position:]
        extra_rows = self.manifest.policy.summaries + plan.dropped_rows if plan else 0
        tail = self.manifest.export.tail if plan and plan.dropped_rows else 0
        early = max(len(new) - tail, 0) if tail else 0
        if plan:
            self._load_kept(targets, plan, base + early)
        synced = None                    # the bucket whose cache holds the rows filled so far
        began = time.perf_counter()
        for offset, count in _chunk_spans(len(new), early, self.chunk, tail or self.chunk):
            start = base + offset + (extra_rows if offset >= early else 0)
            tokens = new[offset:offset + count]
            if tail and offset >= early:
                self._run_chunk(self.tail_graph, self.t_ids, tokens, start, first_position + offset)
                self._write_chunk(targets, start, count, (self.t_new_k, self.t_new_v))
                yield count
                continue
            rows = self.chunk_rows(start)
            if rows != synced:
                synced = self._prepare_chunk_graph(rows, targets, start)
            self._run_chunk(self.bucket_graphs.get(rows) or self.prefill_graph, self.p_ids, tokens, start,
                            first_position + offset)
            self._write_chunk(targets, start, count)
            if synced is not None:
                if start + count <= synced:
                    self._write_chunk(self._bucket_cache(synced), start, count)
                else:
                    synced = None        # the bucket has no room for these rows
            yield count
        compressed_at = time.perf_counter()
        if extra_rows:
            self._drop_extra_rows(targets, base + early, extra_rows, len(new) - early)
            synced = None
        filled = base + len(new)
        share = self.manifest.policy.resolved_prompt_share if self.manifest.policy.compressed else None
        layout = SlotLayout.for_rows(len(token_ids), filled, self.rows_per_slot, share)
        kept = None
        if self.manifest.policy.compressed:
            rows = self.prefill_rows(filled)
            if rows in self.select_buckets and rows != synced:
                self._copy_rows(targets, self._bucket_cache(rows), filled)
            self._copy_full_prompt(slot, targets, filled, plan)
            kept = self._compress_into_slot(slot, layout, filled, rows)
            if self.manifest.policy.summaries:
                self._summaries[slot] = self._summaries_after(plan, targets, len(token_ids), filled, kept)
            if self.keep_dropped:
                self._dropped[slot] = self._dropped_after(plan, targets, len(token_ids), filled, kept)
            if plan:
                kept = _positions_of_rows(plan, len(token_ids), kept, layout.kept)
        self.last_prefill_seconds = {"chunks": compressed_at - began, "select": time.perf_counter() - compressed_at}
        return PrefillResult(self.device.download(self.p_logits)[0].copy(), layout, kept)

    def _copy_full_prompt(self, slot: int, targets, filled: int, plan: ResumePlan | None) -> None:
        """With keep_full_prompt, the prompt's `filled` rows (every position, in order) to host
        for `keep`; a resume from rows that are not every position before it (a compressed entry)
        keeps nothing."""
        self._full_prompts.pop(slot, None)
        if not self.keep_full_prompt or (plan is not None and plan.rows != plan.resume_at):
            return
        self._full_prompts[slot] = ([self.device.download(k[0])[:, :filled].copy() for k in targets[0]],
                                    [self.device.download(v[0])[:, :filled].copy() for v in targets[1]])

    def _load_kept(self, targets, plan: ResumePlan, dropped_at: int) -> None:
        """The plan's first kept rows into rows [0, plan.rows) of the prompt's cache, the entry's
        dropped rows (plan.dropped_rows) from row `dropped_at` on, and with summaries its summary
        rows after the kept ones, their bias in every prefill graph's input."""
        for i in self._layers:
            keys, values = plan.kept.layer_rows(i, plan.rows)
            self.device.upload(targets[0][i][0, :, :plan.rows], keys)
            self.device.upload(targets[1][i][0, :, :plan.rows], values)
        if plan.dropped_rows:
            for i in self._layers:
                first = dropped_at
                for keys, values in plan.kept.dropped.layer_chunks(i):
                    rows = slice(first, first + keys.shape[1])
                    self.device.upload(targets[0][i][0, :, rows], keys)
                    self.device.upload(targets[1][i][0, :, rows], values)
                    first = rows.stop
        if not self.manifest.policy.summaries:
            return
        summaries = plan.kept.summaries or self._no_summaries()
        first, last = plan.rows, plan.rows + summaries.rows
        for i in self._layers:
            keys, values, bias = summaries.attended(i)
            self.device.upload(targets[0][i][0, :, first:last], keys)
            self.device.upload(targets[1][i][0, :, first:last], values)
            for rows, layers in self.p_bias.items():
                if last <= rows:
                    self.device.upload(layers[i][0, :, first:last], bias)
        self._bias_set = True

    def _no_summaries(self) -> RowSummaries:
        spec = self.manifest.spec
        return RowSummaries.empty(self.num_layers, spec.num_kv_heads, self.manifest.policy.summaries, spec.head_dim)

    def _drop_extra_rows(self, targets, first: int, count: int, new: int) -> None:
        """After a resumed prefill: the `new` tokens' rows move from `first + count` down to `first`
        (over the summary or dropped rows) and every cache bias is zero again."""
        for cache in (*targets[0], *targets[1]):
            moved = self.device.download(cache[0, :, first + count:first + count + new]).copy()
            self.device.upload(cache[0, :, first:first + new], moved)
        self._clear_cache_bias()

    def _clear_cache_bias(self) -> None:
        for layers in self.p_bias.values():
            for bias in layers:
                self.device.upload(bias, np.zeros(bias.shape, np.float32))
        self._bias_set = False

    def _summaries_after(self, plan: ResumePlan | None, targets, prompt_len: int, filled: int,
                         kept_rows: list[np.ndarray] | None) -> RowSummaries:
        """The slot's summaries once its prompt's rows were selected: the resumed entry's (or
        none) and the `filled` scratch rows the selection did not keep (kept_rows as
        `_compress_into_slot` returns them; None: it kept every row)."""
        before = (plan.kept.summaries if plan else None) or self._no_summaries()
        if kept_rows is None:
            return before
        layer_rows = [(self.device.download(targets[0][i][0, :, :filled]),
                       self.device.download(targets[1][i][0, :, :filled]), positions, dropped)
                      for i, positions, dropped in self._not_kept(plan, prompt_len, filled, kept_rows)]
        return before.with_dropped(self.manifest.policy.summary_index, layer_rows)

    def _not_kept(self, plan: ResumePlan | None, prompt_len: int, filled: int, kept_rows: list[np.ndarray]):
        """Per layer i: (i, positions [Hkv, filled] of the prefilled rows, [Hkv, filled] bool: the
        rows the selection did not keep)."""
        tables = _row_positions(plan, prompt_len, filled, self.manifest.spec.num_kv_heads, self.num_layers)
        for i in self._layers:
            dropped = np.ones(tables[i].shape, bool)
            np.put_along_axis(dropped, kept_rows[i], False, axis=1)
            yield i, tables[i], dropped

    def _dropped_after(self, plan: ResumePlan | None, targets, prompt_len: int, filled: int,
                       kept_rows: list[np.ndarray] | None) -> DroppedRows:
        """The dropped rows a slot's entry will hold once its prompt's rows were selected: the
        resumed entry's (whether attended or not) and, in 4 bits, the `filled` scratch rows this
        selection did not keep (kept_rows as `_compress_into_slot` returns them)."""
        before = (plan.kept.dropped if plan else None) or DroppedRows()
        if kept_rows is None:
            return before
        layers = []
        for i, positions, dropped in self._not_kept(plan, prompt_len, filled, kept_rows):
            rows = np.nonzero(dropped)[1].reshape(dropped.shape[0], -1)     # each head drops as many rows
            keys, values = (self.device.download(cache[i][0, :, :filled]) for cache in targets)
            layers.append((np.take_along_axis(keys, rows[..., None], axis=1),
                           np.take_along_axis(values, rows[..., None], axis=1),
                           np.take_along_axis(positions, rows, axis=1)))
        return before.with_chunk(DroppedChunk.of(layers) if layers[0][2].shape[1] else None)

    def prefill(self, slot: int, token_ids: list[int]) -> PrefillResult:
        return drain(self.prefill_chunks(slot, token_ids))

    def _prepare_chunk_graph(self, rows: int, targets, filled: int) -> int | None:
        """Make the prefill graph over `rows` cache rows see the `filled` rows of the targets:
        copy them into the bucket's cache (returns rows, the bucket now in sync), or bind the
        full graph to the targets themselves (returns None)."""
        if rows in self.bucket_graphs:
            self._copy_rows(targets, self._bucket_cache(rows), filled)
            return rows
        for i in self._layers:
            self.prefill_graph.bind(f"past_key.{i}", targets[0][i])
            self.prefill_graph.bind(f"past_value.{i}", targets[1][i])
        return None

    def _bucket_cache(self, rows: int):
        return self.bucket_k[rows], self.bucket_v[rows]

    def _copy_rows(self, source, target, count: int) -> None:
        """Rows [0, count) of every layer's K and V from the caches `source` to `target`."""
        for i in self._layers:
            target[0][i][:, :, :count] = source[0][i][:, :, :count]
            target[1][i][:, :, :count] = source[1][i][:, :, :count]

    def _run_chunk(self, graph: Graph, ids, tokens: list[int], start: int, position: int) -> None:
        """Run a prefill graph whose input_ids are `ids` ([1, chunk]) on `tokens` (at most a chunk),
        the first of them at cache row `start` and RoPE position `position`."""
        host = np.zeros(ids.shape, np.int64)
        host[0, :len(tokens)] = tokens
        self.device.upload(ids, host)
        for array, value in ((self.p_start, start), (self.p_pos, position), (self.p_len, len(tokens))):
            self.device.upload(array, np.array([value], np.int64))
        graph.run()

    def _write_chunk(self, caches, start: int, count: int, outputs=None) -> None:
        """The chunk's new K/V (`outputs`, per layer [1, Hkv, chunk, D]: the prefill graphs' by
        default) into rows [start, start + count)."""
        keys, values = caches
        new_keys, new_values = outputs or (self.p_new_k, self.p_new_v)
        for i in self._layers:
            keys[i][:, :, start:start + count] = new_keys[i][:, :, :count]
            values[i][:, :, start:start + count] = new_values[i][:, :, :count]

    def _prefill_targets(self, slot: int):
        if self.manifest.policy.compressed:
            return self.scratch_k, self.scratch_v
        return [k[slot:slot + 1] for k in self.keys], [v[slot:slot + 1] for v in self.values]

    def _compress_into_slot(self, slot: int, layout: SlotLayout, filled: int, rows: int) -> list[np.ndarray] | None:
        """Move the kept prompt rows from the `filled` rows of the scratch cache into the slot (once
        per request); returns per layer [Hkv, kept] the scratch rows kept, ascending (None: rows
        [0, kept), all of them). rows: the cache rows the prompt was prefilled on; a select graph of
        that bucket, where the artifact has one, selects from the bucket's cache instead of
        scoring max_context rows."""
        kept = layout.kept
        if kept == filled:
            for i in self._layers:
                self.keys[i][slot, :, :kept] = self.scratch_k[i][0, :, :kept]
                self.values[i][slot, :, :kept] = self.scratch_v[i][0, :, :kept]
            return None
        if self.select_graph is None:
            return self._streaming_into_slot(slot, filled, kept)
        self.device.upload(self.sel_len, np.array([filled], np.int64))
        self.select_buckets.get(rows, self.select_graph).run()
        for i in self._layers:
            self.keys[i][slot, :, :kept] = self.sel_k[i][0]
            self.values[i][slot, :, :kept] = self.sel_v[i][0]
        return [self.device.download(idx)[0].copy() for idx in self.sel_idx]

    def _streaming_into_slot(self, slot: int, filled: int, kept: int) -> list[np.ndarray]:
        positions = np.array(self.manifest.policy.streaming_positions(filled), np.int64)
        rows = self.device.indices(positions)
        for i in self._layers:
            self.keys[i][slot, :, :kept] = self.scratch_k[i][0][:, rows]
            self.values[i][slot, :, :kept] = self.scratch_v[i][0][:, rows]
        hkv = self.manifest.spec.num_kv_heads
        return [np.broadcast_to(positions, (hkv, kept)).copy() for _ in self._layers]

    # ---------------------------------------------------------------- decode
    def decode(self, tokens: dict[int, int], steps: dict[int, DecodeStep]) -> np.ndarray:
        """One decode step for the active slots (keys of `tokens`) on the smallest decode graph
        that holds them (`decode_size`); idle slots below it are masked.

        Returns logits [N, V] as a host array (rows of idle slots are meaningless). The new K/V
        of each active slot is written at its step's write_index.
        """
        ids = np.zeros((self.slots, 1), np.int64)
        host = {name: np.zeros(self.slots, np.int64) for name in self.d_inputs}
        for slot, token in tokens.items():
            step = steps[slot]
            ids[slot, 0] = token
            host["position"][slot], host["cache_len"][slot] = step.position, step.cache_len
            host["write_index"][slot] = step.write_index
        self.device.upload(self.d_ids, ids)
        for name, array in self.d_inputs.items():
            self.device.upload(array, host[name])
        self.decode_graphs[self.decode_size(tokens)].run()
        active = np.fromiter(tokens.keys(), np.int64, len(tokens))
        slots, writes = self.device.indices(active), self.device.indices(host["write_index"][active])
        for i in self._layers:
            self.keys[i][slots, :, writes] = self.d_new_k[i][slots, :, 0]
            self.values[i][slots, :, writes] = self.d_new_v[i][slots, :, 0]
        return self.device.download(self.d_logits)

    def keep(self, slot: int, layout: SlotLayout, kept_positions: list[np.ndarray] | None, fed: int,
             token_ids: list[int]) -> KeptCache:
        """The cache of a finished sequence in `slot` as host arrays in position order: its kept
        prompt rows (`kept_positions`, as PrefillResult gives them) and the `fed` decode tokens the
        slot still holds. token_ids: the prompt and the fed output tokens (len = positions covered).
        With keep_dropped, the rows in 8 bits and the rows its selections dropped beside them, in 4
        bits, less the oldest of those until the entry costs no more than a float32 one of the
        slot's every row would."""
        if slot in self._full_prompts:
            return self._keep_full(slot, layout, fed, token_ids)
        kept = self._keep_slot(slot, layout, kept_positions, fed, token_ids)
        dropped = self._dropped.pop(slot, None)
        if dropped is None:
            return kept
        rows_bound = self.manifest.kv_bytes_per_slot() + self.num_layers * kept.positions[0].shape[0] \
            * self.rows_per_slot * kept.positions[0].itemsize
        return kept.quantized(dropped, rows_bound + kept.token_ids.nbytes)

    def _keep_slot(self, slot: int, layout: SlotLayout, kept_positions: list[np.ndarray] | None, fed: int,
                   token_ids: list[int]) -> KeptCache:
        """The slot's own rows (see `keep`), in float32."""
        hkv = self.manifest.spec.num_kv_heads
        decoded = layout.fed_rows(fed)
        prompt_rows = np.broadcast_to(np.arange(layout.kept), (hkv, layout.kept))
        rows = np.concatenate([prompt_rows, np.broadcast_to(np.array([r for r, _ in decoded], np.int64),
                                                            (hkv, len(decoded)))], axis=1)
        decoded_positions = np.broadcast_to(np.array([p for _, p in decoded], np.int64), (hkv, len(decoded)))
        keys, values, positions = [], [], []
        for i in self._layers:
            prompt = prompt_rows if kept_positions is None else kept_positions[i]
            layer_positions = np.concatenate([prompt, decoded_positions], axis=1)
            order = np.argsort(layer_positions, axis=1, kind="stable")
            layer_rows = np.take_along_axis(rows, order, axis=1)[:, :, None]
            keys.append(np.take_along_axis(self.device.download(self.keys[i][slot]), layer_rows, axis=1))
            values.append(np.take_along_axis(self.device.download(self.values[i][slot]), layer_rows, axis=1))
            positions.append(np.take_along_axis(layer_positions, order, axis=1))
        return KeptCache(np.array(token_ids, np.int64), tuple(keys), tuple(values), tuple(positions),
                         layout.prompt_len if layout.compressed else 0, self._summaries.pop(slot, None))

    def _keep_full(self, slot: int, layout: SlotLayout, fed: int, token_ids: list[int]) -> KeptCache:
        """The whole prompt cache copied at prefill, and the fed decode tokens after it while the
        ring still holds every one of them (else the prompt alone): every position, in order."""
        keys, values = self._full_prompts.pop(slot)
        self._summaries.pop(slot, None)      # every row is kept: nothing to summarise
        decoded = layout.fed_rows(fed)
        if len(decoded) != fed:
            decoded, token_ids = [], token_ids[:layout.prompt_len]
        rows = np.array([r for r, _ in decoded], np.int64)
        for i in self._layers:
            if len(rows):
                keys[i] = np.concatenate([keys[i], self.device.download(self.keys[i][slot])[:, rows]], axis=1)
                values[i] = np.concatenate([values[i], self.device.download(self.values[i][slot])[:, rows]], axis=1)
        hkv, n = keys[0].shape[:2]
        positions = tuple(np.broadcast_to(np.arange(n, dtype=np.int64), (hkv, n)).copy() for _ in self._layers)
        return KeptCache(np.array(token_ids, np.int64), tuple(keys), tuple(values), positions, 0)

    def forget(self, slot: int) -> None:
        """Drop what the slot's sequence held for `keep` (it ended without being kept)."""
        for held in (self._full_prompts, self._summaries, self._dropped):
            held.pop(slot, None)

    def move_slot(self, source: int, target: int, rows: int) -> None:
        """Copy the first `rows` cache rows of slot `source` into slot `target` (the engine moves a
        sequence to a lower slot so that its steps run on a smaller decode graph)."""
        for cache in (*self.keys, *self.values):
            cache[target, :, :rows] = cache[source, :, :rows]
        for held in (self._full_prompts, self._summaries, self._dropped):
            if source in held:
                held[target] = held.pop(source)

    def kv_bytes_allocated(self) -> int:
        """Bytes of the slot caches (allocated once, independent of prompt lengths)."""
        return self.slots * self.manifest.kv_bytes_per_slot()


def _row_positions(plan: ResumePlan | None, prompt_len: int, filled: int, kv_heads: int,
                   layers: int) -> list[np.ndarray]:
    """Per layer [Hkv, filled] the position each prefilled row stands for: the row's own for a
    fresh prompt; for a resumed one the plan's kept rows' positions, then resume_at .. prompt_len-1."""
    if plan is None:
        return [np.broadcast_to(np.arange(filled), (kv_heads, filled)) for _ in range(layers)]
    new = np.broadcast_to(np.arange(plan.resume_at, prompt_len), (kv_heads, prompt_len - plan.resume_at))
    return [np.concatenate([positions[:, :plan.rows], new], axis=1) for positions in plan.kept.positions]


def _positions_of_rows(plan: ResumePlan, prompt_len: int, kept_rows: list[np.ndarray] | None,
                       kept: int) -> list[np.ndarray]:
    """Per layer [Hkv, kept] positions of the rows a resumed prefill kept (kept_rows as
    `_compress_into_slot` returns them)."""
    hkv = plan.kept.positions[0].shape[0]
    tables = _row_positions(plan, prompt_len, plan.rows + prompt_len - plan.resume_at, hkv, len(plan.kept.positions))
    return [table[:, :kept].copy() if kept_rows is None else np.take_along_axis(table, kept_rows[i], axis=1)
            for i, table in enumerate(tables)]
