"""The prefill side of the slot backend: a prompt's chunks through the prefill graphs, and a
compressed prompt's rows selected into its slot.

Each chunk runs on the smallest bucket graph that holds the rows filled before it (or the full
graph), so no chunk pays attention over more rows than it needs. A dense prompt is prefilled
straight into its slot (a bucket graph reads a copy of the slot's first rows); a compressed one into
a PromptCache of max_context rows whose buffers every prefill and select graph reads in its own
layout (runtime/prompt_cache.py), from which the select graph (or the StreamingLLM rule) moves the
kept rows into the slot once per request.
"""
from __future__ import annotations

import time
from functools import partial
from pathlib import Path

import numpy as np

from snapcompile.artifact.manifest import Manifest
from snapcompile.artifact.naming import TAIL_GRAPH, bucket_rows
from snapcompile.errors import SnapcompileError
from snapcompile.layout import SlotLayout
from snapcompile.runtime.device import (
    Device,
    LazyGraph,
    PrefillResult,
    ResumeFrom,
    RowsTo,
    bucket_holding,
    chunk_spans,
)
from snapcompile.runtime.layer_rows import load_resumed_rows, load_ring, move_rows_down, ring_rows, streaming_rows
from snapcompile.runtime.prompt_cache import PromptCache


class PrefillRunner:
    """Owns the prefill graphs (full, buckets, select, tail) and their buffers; writes into the
    backend's slot caches `keys` / `values` (per layer [N, Hkv, rows_per_slot, D]). One prefill
    runs at a time."""

    def __init__(self, folder: Path, manifest: Manifest, device: Device, keys: list, values: list):
        self.folder, self.manifest, self.device, self.keys, self.values = folder, manifest, device, keys, values
        m = manifest
        self.num_layers, self.chunk, self.rows_per_slot = m.spec.num_layers, m.export.chunk, m.rows_per_slot
        self._layers = range(self.num_layers)
        self.ring, self._local = m.window_ring, m.spec.local_layers     # local layers: their slot's window ring
        self._global = m.spec.global_layers          # the layers whose rows the prompt caches and selections hold
        self.prefill_graph = LazyGraph(device, "prefill", m)
        self.bucket_graphs = {bucket_rows(name): LazyGraph(device, name, m)           # rows -> graph
                              for name in m.graphs if bucket_rows(name) is not None}
        self.select_graph = LazyGraph(device, "select", m) if "select" in m.graphs else None
        self.select_buckets = {bucket_rows(name, "select"): LazyGraph(device, name, m)  # rows -> graph
                               for name in m.graphs if bucket_rows(name, "select") is not None}
        self.tail_graph: LazyGraph | None = None      # loaded by load_tail_graph
        self.last_seconds = {"chunks": 0.0, "select": 0.0}   # of the latest prefill, for benchmarks
        self._init_buffers()

    def _kv(self, batch: int, rows: int):
        return self.device.zeros((batch, self.manifest.spec.num_kv_heads, rows, self.manifest.kv_row_width),
                                 self.manifest.export.kv_dtype)

    def _init_buffers(self) -> None:
        m, zeros = self.manifest, self.device.zeros
        self.p_ids = zeros((1, self.chunk), "int64")
        self.p_start, self.p_pos, self.p_len = (zeros((1,), "int64") for _ in range(3))
        self.p_logits = zeros((1, m.spec.vocab_size), "float32")
        self.p_new_k = [self._kv(1, self.chunk) for _ in self._layers]
        self.p_new_v = [self._kv(1, self.chunk) for _ in self._layers]
        self.prompt: PromptCache | None = None
        if m.policy.compressed:    # the full prompt lives here until it is compressed into a slot
            self.prompt = PromptCache(self.device, self.num_layers, m.spec.num_kv_heads, m.kv_row_width,
                                      m.export.max_context, m.export.kv_dtype, skipped=self._local)
            self.scratch_k, self.scratch_v = self.prompt.view(m.export.max_context)
            for i in self._global:     # the full graph reads the prompt's rows laid out as max_context rows
                self.prefill_graph.bind(f"past_key.{i}", self.scratch_k[i])
                self.prefill_graph.bind(f"past_value.{i}", self.scratch_v[i])
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

    def _all_prefill_graphs(self) -> list[LazyGraph]:
        return [self.prefill_graph, *self.bucket_graphs.values()]

    def graphs(self) -> list[LazyGraph]:
        """Every graph this runner may run (the tail once loaded)."""
        selects = [self.select_graph, *self.select_buckets.values()] if self.select_graph is not None else []
        return [*self._all_prefill_graphs(), *selects, *([self.tail_graph] if self.tail_graph is not None else [])]

    def _init_buckets(self) -> None:
        """Each bucket graph sees its past rows as [1, Hkv, rows, D]: views of the PromptCache for
        a compressed policy, else of a cache as large as the largest bucket that holds a copy of
        the slot's first rows (one prefill runs at a time)."""
        self.bucket_k, self.bucket_v = {}, {}
        if not self.bucket_graphs:
            return
        spec = self.manifest.spec
        views = self.prompt or PromptCache(self.device, self.num_layers, spec.num_kv_heads, self.manifest.kv_row_width,
                                           max(self.bucket_graphs), self.manifest.export.kv_dtype, self._local)
        for rows, g in self.bucket_graphs.items():
            self.bucket_k[rows], self.bucket_v[rows] = views.view(rows)
            for i in self._global:
                g.bind(f"past_key.{i}", self.bucket_k[rows][i])
                g.bind(f"past_value.{i}", self.bucket_v[rows][i])

    def prefill_rows(self, prompt_len: int) -> int:
        """The smallest bucket that holds `prompt_len` cache rows, else max_context (the full
        prefill graph): the cache a whole prompt of that length is selected from."""
        return bucket_holding(prompt_len, self.bucket_graphs, self.manifest.export.max_context)

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
            for i in self._global:
                s.bind(f"window_query.{i}", self.window_q[i])
                s.bind(f"key.{i}", keys[i])
                s.bind(f"value.{i}", values[i])
                s.bind(f"selected_key.{i}", self.sel_k[i], output=True)
                s.bind(f"selected_value.{i}", self.sel_v[i], output=True)
                s.bind(f"selected_index.{i}", self.sel_idx[i], output=True)
        for g in self._all_prefill_graphs():
            for i in self._global:
                g.bind(f"window_query.{i}", self.window_q[i], output=True)

    def load_tail_graph(self) -> None:
        """Load the tail graph (for a session keeper with `needs_tail`), which runs a resumed turn's
        last T (export.tail) tokens over rows only they see, bound to the scratch cache. Raises
        SnapcompileError for an artifact without it."""
        m, zeros = self.manifest, self.device.zeros
        if TAIL_GRAPH not in m.graphs:
            raise SnapcompileError(f"{self.folder}: --session-keep quantized runs a resumed turn's last tokens on the "
                                   f"graph {TAIL_GRAPH}, which this artifact lacks (converted before it, or with "
                                   "--tail 0); convert it again")
        g = self.tail_graph = LazyGraph(self.device, TAIL_GRAPH, m)
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

    def chunk_rows(self, start: int) -> int:
        """Cache rows the chunk starting at `start` attends over: those of the smallest bucket that
        holds the `start` rows already filled (`prefill_rows`, the same rule). So a prompt's chunks
        follow the causal triangle in bucket steps instead of all paying the whole prompt's bucket."""
        return self.prefill_rows(start)

    def chunks(self, slot: int, token_ids: list[int], resume: ResumeFrom | None, rows_to: RowsTo | None = None):
        """Prefill `token_ids` for `slot` (from the rows `resume` loads, or whole): a generator that
        yields each chunk's token count and returns the PrefillResult. rows_to: given every layer's
        rows of a compressed prompt once they are selected (device.RowsTo).

        Every chunk's K/V goes to the targets: the slot (a bucket's own cache is a copy of its
        first rows, filled when a chunk moves to that bucket; the buckets share one buffer, so one
        holds this prompt at a time), or for a compressed prompt the PromptCache, laid out for the
        graph each chunk runs on. A resumed prefill's extra rows (ResumeFrom) are moved down over
        before the selection."""
        targets = self._prefill_targets(slot)
        self._bind_rings(slot)
        if self.prompt is not None:
            self.prompt.reset()
        if self._bias_set:               # a resumed prefill abandoned mid-way (its request cancelled)
            self._clear_cache_bias()
        base, first_position = (resume.rows, resume.position) if resume else (0, 0)
        new = token_ids[first_position:]
        extra_rows = resume.extra_count if resume else 0
        tail = self.manifest.export.tail if extra_rows and resume.extra_tail_only else 0
        if tail and self.tail_graph is None:
            raise SnapcompileError("a resumed prefill over rows only its last tokens see runs on the tail graph: "
                                   "call load_tail_graph first")
        early = max(len(new) - tail, 0) if tail else 0
        if resume:
            self._load_rows(targets, resume, base + early)
            self._load_rings(slot, resume)
        began = time.perf_counter()
        yield from self._run_chunks(targets, new, base, first_position, early, tail, extra_rows)
        chunks_done = time.perf_counter()
        if extra_rows:
            self._drop_extra_rows(targets, base + early, extra_rows, len(new) - early)
        result = self._select(slot, targets, len(token_ids), base + len(new))
        if rows_to is not None and result.compressed:
            self._hand_rows(rows_to, result, slot, len(token_ids))
        self.last_seconds = {"chunks": chunks_done - began, "select": time.perf_counter() - chunks_done}
        return result

    def _run_chunks(self, targets, new: list[int], base: int, first_position: int, early: int, tail: int,
                    extra_rows: int):
        """Prefill the `new` tokens from cache row `base` (RoPE position `first_position`): those
        before `early` in chunks on the bucket graphs, the rest on the tail graph when `tail`, past
        the `extra_rows` loaded after the earlier ones. Yields each chunk's token count."""
        synced = None                    # a dense prompt: the bucket whose cache holds the rows filled so far
        for offset, count in chunk_spans(len(new), early, self.chunk, tail or self.chunk):
            start = base + offset + (extra_rows if offset >= early else 0)
            tokens = new[offset:offset + count]
            if tail and offset >= early:
                self.prompt.lay_out(self.manifest.export.max_context)   # the tail graph reads every row
                self._run_chunk(self.tail_graph, self.t_ids, tokens, start, first_position + offset)
                self._write_new_rows(targets, start, count, first_position + offset, (self.t_new_k, self.t_new_v))
                yield count
                continue
            if self.prompt is not None:
                graph = self._prompt_chunk_graph(start)
            else:
                rows = self.chunk_rows(start)
                if rows != synced:
                    synced = self._prepare_chunk_graph(rows, targets, start)
                graph = self.bucket_graphs.get(rows) or self.prefill_graph
            self._run_chunk(graph, self.p_ids, tokens, start, first_position + offset)
            self._write_new_rows(targets, start, count, first_position + offset)
            if synced is not None:
                if start + count <= synced:
                    self._write_chunk(self._bucket_cache(synced), start, count)
                else:
                    synced = None        # the bucket has no room for these rows
            yield count

    def _prompt_chunk_graph(self, start: int) -> LazyGraph:
        """The graph a compressed prompt's chunk from row `start` runs on, the PromptCache laid out
        for it: the smallest that holds the rows filled so far (and a resumed turn's extra rows
        past `start`, which a smaller layout would drop)."""
        rows = self.chunk_rows(max(start, self.prompt.live))
        self.prompt.lay_out(rows)
        return self.bucket_graphs.get(rows) or self.prefill_graph

    def _write_new_rows(self, targets, start: int, count: int, position: int, outputs=None) -> None:
        """A chunk's new K/V (of tokens at `position` on) into rows [start, start + count) of the targets
        (`_write_chunk`), the PromptCache first laid out for the smallest graph that holds them, and a
        local layer's into its ring rows in the slot (`_write_rings`)."""
        if self.prompt is not None:
            if start + count > self.prompt.rows:
                self.prompt.lay_out(self.prefill_rows(start + count))
            self.prompt.filled_to(start + count)
        self._write_chunk(targets, start, count, outputs)
        self._write_rings(position, count, outputs)

    def _bind_rings(self, slot: int) -> None:
        """Every prefill graph reads a local layer's past rows from `slot`'s window ring, where the
        chunks write them: no prompt cache, bucket copy or selection for those layers."""
        self._ring_slot = slot
        graphs = [*self._all_prefill_graphs(), *([self.tail_graph] if self.tail_graph is not None else [])]
        for i in self._local:
            for g in graphs:
                g.bind(f"past_key.{i}", self.keys[i][slot:slot + 1])
                g.bind(f"past_value.{i}", self.values[i][slot:slot + 1])

    def _write_rings(self, position: int, count: int, outputs=None) -> None:
        """The local layers' K/V of a chunk's `count` tokens from `position` on into their ring rows
        (position % rows, wrapping) of the slot being prefilled."""
        if not self._local:
            return
        new_keys, new_values = outputs or (self.p_new_k, self.p_new_v)
        rows = self.device.indices(np.arange(position, position + count) % self.ring.rows)
        for i in self._local:
            self.keys[i][self._ring_slot][:, rows] = new_keys[i][0, :, :count]
            self.values[i][self._ring_slot][:, rows] = new_values[i][0, :, :count]

    def _select(self, slot: int, targets, prompt_len: int, filled: int) -> PrefillResult:
        """The prefill's result once its `filled` rows are in the targets: a compressed prompt's
        rows selected into the slot."""
        policy = self.manifest.policy
        layout = SlotLayout.for_rows(prompt_len, filled, self.rows_per_slot,
                                     policy.resolved_prompt_share if policy.compressed else None)
        logits = self.device.download(self.p_logits)[0].copy()
        if not policy.compressed:
            return PrefillResult(logits, layout, None, filled)
        kept_rows = self._compress_into_slot(slot, layout, filled, self.prefill_rows(filled))
        return PrefillResult(logits, layout, kept_rows, filled, compressed=True)

    def _hand_rows(self, rows_to: RowsTo, result: PrefillResult, slot: int, positions: int) -> None:
        """Every global layer's filled rows of the PromptCache to rows_to, with the rows its selection
        kept; a local layer's ring rows in `slot` after the prompt's `positions` (device.RowsTo)."""
        for i in self._layers:
            if i in self._local:
                rows_to(i, *ring_rows(self.device, self.keys[i][slot], self.values[i][slot], self.ring, positions),
                        None)
                continue
            keys, values = (self.device.download(cache[i][0, :, :result.filled])
                            for cache in (self.prompt.keys, self.prompt.values))
            rows_to(i, keys, values, None if result.kept_rows is None else result.kept_rows[i])

    def _load_rings(self, slot: int, resume: ResumeFrom) -> None:
        """Each local layer's window ring that `resume` loads, whole, into `slot`'s ring."""
        for i in self._local:
            load_ring(self.device, self.keys[i][slot], self.values[i][slot], resume, i)

    def _load_rows(self, targets, resume: ResumeFrom, extra_at: int) -> None:
        """The rows `resume` loads into rows [0, resume.rows) of the prompt's cache, and its extra
        rows from row `extra_at` on, each piece's logit bias, where it has one, in every prefill
        graph's cache_bias input."""
        filled = resume.rows
        for i in self._global:
            filled = load_resumed_rows(self.device, targets[0][i], targets[1][i], resume, i, extra_at,
                                       partial(self._set_cache_bias, i))
        if self.prompt is not None:
            self.prompt.filled_to(filled)

    def _set_cache_bias(self, layer: int, rows: slice, bias: np.ndarray) -> None:
        if not self.p_bias:
            raise SnapcompileError("rows with a logit bias need an artifact converted with --summaries")
        for graph_rows, layers in self.p_bias.items():
            if rows.stop <= graph_rows:
                self.device.upload(layers[layer][0, :, rows], bias)
        self._bias_set = True

    def _drop_extra_rows(self, targets, first: int, count: int, new: int) -> None:
        """After a resumed prefill: the `new` tokens' rows move from `first + count` down to `first`
        (over the extra rows) and every cache bias is zero again."""
        move_rows_down(self.device, [cache[i] for cache in targets for i in self._global], first, count, new)
        if self.prompt is not None:
            self.prompt.truncate(first + new)
        self._clear_cache_bias()

    def _clear_cache_bias(self) -> None:
        for layers in self.p_bias.values():
            for bias in layers:
                self.device.upload(bias, np.zeros(bias.shape, np.float32))
        self._bias_set = False

    def _prepare_chunk_graph(self, rows: int, targets, filled: int) -> int | None:
        """A dense prompt: make the prefill graph over `rows` cache rows see the `filled` rows of the slot:
        copy them into the bucket's cache (returns rows, the bucket now in sync), or bind the
        full graph to the targets themselves (returns None)."""
        if rows in self.bucket_graphs:
            self._copy_rows(targets, self._bucket_cache(rows), filled)
            return rows
        for i in self._global:
            self.prefill_graph.bind(f"past_key.{i}", targets[0][i])
            self.prefill_graph.bind(f"past_value.{i}", targets[1][i])
        return None

    def _bucket_cache(self, rows: int):
        return self.bucket_k[rows], self.bucket_v[rows]

    def _copy_rows(self, source, target, count: int) -> None:
        """Rows [0, count) of every global layer's K and V from the caches `source` to `target`."""
        for i in self._global:
            target[0][i][:, :, :count] = source[0][i][:, :, :count]
            target[1][i][:, :, :count] = source[1][i][:, :, :count]

    def _run_chunk(self, graph: LazyGraph, ids, tokens: list[int], start: int, position: int) -> None:
        """Run a prefill graph whose input_ids are `ids` ([1, chunk]) on `tokens` (at most a chunk),
        the first of them at cache row `start` and RoPE position `position`."""
        host = np.zeros(ids.shape, np.int64)
        host[0, :len(tokens)] = tokens
        self.device.upload(ids, host)
        for array, value in ((self.p_start, start), (self.p_pos, position), (self.p_len, len(tokens))):
            self.device.upload(array, np.array([value], np.int64))
        graph.run()
        self.device.release_pages()

    def _write_chunk(self, caches, start: int, count: int, outputs=None) -> None:
        """The chunk's new K/V (`outputs`, per layer [1, Hkv, chunk, D]: the prefill graphs' by
        default) into rows [start, start + count) of every global layer."""
        keys, values = caches
        new_keys, new_values = outputs or (self.p_new_k, self.p_new_v)
        for i in self._global:
            keys[i][:, :, start:start + count] = new_keys[i][:, :, :count]
            values[i][:, :, start:start + count] = new_values[i][:, :, :count]

    def _prefill_targets(self, slot: int):
        if self.prompt is not None:
            return self.prompt.keys, self.prompt.values
        return [k[slot:slot + 1] for k in self.keys], [v[slot:slot + 1] for v in self.values]

    def _compress_into_slot(self, slot: int, layout: SlotLayout, filled: int, rows: int) -> list[np.ndarray] | None:
        """Move the kept prompt rows from the `filled` rows of the PromptCache into the slot (once
        per request); returns per layer [Hkv, kept] the prompt rows kept, ascending (None: rows
        [0, kept), all of them). rows: the cache rows the prompt was prefilled on; a select graph of
        that bucket, where the artifact has one, selects from the cache laid out as those rows
        instead of scoring max_context rows."""
        kept, prompt = layout.kept, self.prompt
        if kept == filled:
            for i in self._global:
                self.keys[i][slot, :, :kept] = prompt.keys[i][0, :, :kept]
                self.values[i][slot, :, :kept] = prompt.values[i][0, :, :kept]
            return None
        if self.select_graph is None:
            return self._streaming_into_slot(slot, filled, kept)
        self.device.upload(self.sel_len, np.array([filled], np.int64))
        prompt.lay_out(rows if rows in self.select_buckets else self.manifest.export.max_context)
        self.select_buckets.get(rows, self.select_graph).run()
        for i in self._global:
            self.keys[i][slot, :, :kept] = self.sel_k[i][0]
            self.values[i][slot, :, :kept] = self.sel_v[i][0]
        return [None if i in self._local else self.device.download(self.sel_idx[i])[0].copy() for i in self._layers]

    def _streaming_into_slot(self, slot: int, filled: int, kept: int) -> list[np.ndarray]:
        positions, rows = streaming_rows(self.device, self.manifest.policy, filled)
        for i in self._global:
            self.keys[i][slot, :, :kept] = self.prompt.keys[i][0][:, rows]
            self.values[i][slot, :, :kept] = self.prompt.values[i][0][:, rows]
        hkv = self.manifest.spec.num_kv_heads
        return [None if i in self._local else np.broadcast_to(positions, (hkv, kept)).copy() for i in self._layers]
