"""A compressed prompt prefilled one decoder layer at a time (manifest.prefill_order "layers").

SnapKV's selection of layer l reads only layer l's keys and values and the observation window's
queries of layer l, so the whole prompt goes through layer 0 (chunk by chunk, on prefill_layer_0),
layer 0's kept rows move into the slot, and layer 1 starts on the same cache buffer. What is held is
the prompt's hidden states [T + C, hidden] float32 and one layer's prompt rows (a one-layer
PromptCache of max_context rows), not every layer's: at the 8B shape and 131072 tokens 2 GiB and
1 GiB where the chunk-by-chunk prefill (runtime/prefill.py) holds 32 GiB.

Each chunk runs the same computation as in the chunk-by-chunk prefill: the same chunk spans
(device.chunk_spans, the last chunk overlapping the one before), on a graph over the same cache rows
(the smallest bucket holding the rows filled so far), with the same nodes. A token of an
overlapped span has two chains of hidden states there, its first chunk's and the last chunk's; only
the last chunk's is read afterwards (the rows it writes replace the first's, and no later row of the
first chunk attends to them), so a chunk writes back the hidden states of its tokens before the next
chunk's first only, and the last chunk all of its own.

A resumed prompt loads each layer's kept rows (and extra rows, with their logit bias) as that layer
starts; the extra rows a tail sees are attended by the last export.tail new tokens, which run in
chunks of C here (the tail graph is the chunk-by-chunk prefill's way to it). The rows a keeper reads
(`rows_to`) are handed over a layer at a time, right after its selection.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from snapcompile.artifact.manifest import Manifest
from snapcompile.artifact.naming import (
    PREFILL_EMBED,
    PREFILL_HEAD,
    PREFILL_SCORES,
    SELECT_LAYER,
    graph_name,
    prefill_layer,
    select_rows,
)
from snapcompile.errors import SnapcompileError
from snapcompile.layout import SlotLayout
from snapcompile.runtime.device import (
    Device,
    LazyGraph,
    LogitsTo,
    PrefillResult,
    ResumeFrom,
    RowsTo,
    bucket_holding,
    chunk_spans,
)
from snapcompile.runtime.layer_rows import load_resumed_rows, load_ring, move_rows_down, ring_rows, streaming_rows
from snapcompile.runtime.prompt_cache import PromptCache


class LayerPrefill:
    """Owns the layer-by-layer prefill's graphs (embeddings, one family a layer over the prefill
    buckets' rows, head, one layer's selection) and their buffers; writes into the backend's slot
    caches `keys` / `values` (per layer [N, Hkv, rows_per_slot, D]). One prefill runs at a time."""

    tail_graph = None        # resumed turns' tails run on the layer graphs (module docstring)

    def __init__(self, folder: Path, manifest: Manifest, device: Device, keys: list, values: list):
        """A dense artifact's prompts are prefilled chunk by chunk into their slots; one built for it
        serves the prompts whose every position's logits are asked for (`chunks`' logits_to): its
        kept rows are all of them."""
        m = manifest
        self.folder, self.manifest, self.device, self.keys, self.values = folder, m, device, keys, values
        self.num_layers, self.chunk, self.max_context = m.spec.num_layers, m.export.chunk, m.export.max_context
        self.ring, self._local = m.window_ring, m.spec.local_layers     # local layers: their slot's window ring
        self.buckets = sorted(m.export.prefill_buckets())
        self.last_seconds = {"chunks": 0.0, "select": 0.0}
        self.layers_done = 0         # of the prefill under way (or the latest), for progress and studies
        rows = [*self.buckets, self.max_context]
        self.embed_graph, self.head_graph = LazyGraph(device, PREFILL_EMBED, m), LazyGraph(device, PREFILL_HEAD, m)
        self.scores_graph = LazyGraph(device, PREFILL_SCORES, m)     # made, and its buffers, at the first scoring
        self.layer_graphs = [{r: LazyGraph(device, graph_name(prefill_layer(i), r, self.max_context), m) for r in rows}
                             for i in range(self.num_layers)]                  # layer -> rows -> graph
        self.select_graphs = {r: LazyGraph(device, graph_name(SELECT_LAYER, r, self.max_context), m)
                              for r in select_rows(m.export, m.policy)} if m.policy.policy == "snapstream" else {}
        self._init_buffers()

    def graphs(self) -> list[LazyGraph]:
        """Every graph this runner may run."""
        return [self.embed_graph, *(g for layer in self.layer_graphs for g in layer.values()), self.head_graph,
                *self.select_graphs.values()]

    def load_tail_graph(self) -> None:
        """Nothing to load: a resumed turn's tail runs on the layer graphs. Raises SnapcompileError
        for an artifact without a tail (--tail 0), as PrefillRunner.load_tail_graph does."""
        if not self.manifest.export.tail:
            raise SnapcompileError(f"{self.folder}: --session-keep quantized runs a resumed turn's last tokens over "
                                   "the rows it dropped, and this artifact was converted with --tail 0; convert it "
                                   "again")

    def prefill_rows(self, prompt_len: int) -> int:
        """The smallest bucket that holds `prompt_len` cache rows, else max_context (as
        PrefillRunner.prefill_rows)."""
        return bucket_holding(prompt_len, self.buckets, self.max_context)

    def chunk_rows(self, start: int) -> int:
        """Cache rows the chunk starting at `start` attends over (PrefillRunner.chunk_rows)."""
        return self.prefill_rows(start)

    # ---------------------------------------------------------------- buffers
    def _init_buffers(self) -> None:
        m, zeros, c = self.manifest, self.device.zeros, self.chunk
        s = m.spec
        self.ids = zeros((1, c), "int64")
        self.start, self.position, self.chunk_len = (zeros((1,), "int64") for _ in range(3))
        self.hidden = zeros((self.max_context + c, s.hidden_size), "float32")   # a chunk of slack for padding
        self.embedded = zeros((1, c, s.hidden_size), "float32")
        self.hidden_out = zeros((1, c, s.hidden_size), "float32")
        self.new_k, self.new_v = self._kv(c), self._kv(c)
        self.window_q = zeros((1, s.num_heads, m.policy.window, s.head_dim), "float32")
        self.last_hidden = zeros((1, s.hidden_size), "float32")
        self.logits = zeros((1, s.vocab_size), "float32")
        self.score_hidden = self.score_logits = None       # prefill_scores' buffers, made at the first scoring
        self.prompt = PromptCache(self.device, 1, s.num_kv_heads, m.kv_row_width, self.max_context, m.export.kv_dtype)
        self.embed_graph.bind("input_ids", self.ids)
        self.embed_graph.bind("hidden", self.embedded, output=True)
        self.head_graph.bind("hidden", self.last_hidden)
        self.head_graph.bind("logits", self.logits, output=True)
        self.bias = {rows: zeros((1, s.num_kv_heads, rows), "float32") for rows in self.layer_graphs[0]} \
            if m.policy.summaries else {}
        self._bias_set = False
        for layer, graphs in enumerate(self.layer_graphs):
            for rows, g in graphs.items():
                self._bind_layer_graph(g, rows, layer in self._local)
        if self.select_graphs:
            self._init_select()

    def _kv(self, rows: int):
        s = self.manifest.spec
        return self.device.zeros((1, s.num_kv_heads, rows, self.manifest.kv_row_width), self.manifest.export.kv_dtype)

    def _bind_layer_graph(self, g: LazyGraph, rows: int, local: bool) -> None:
        """A layer graph's buffers; a local layer's past rows are its slot's window ring, bound as a
        prompt starts (`_run_ring_layer`), and it has no window queries or bias."""
        for name, array in (("start", self.start), ("position", self.position), ("chunk_len", self.chunk_len)):
            g.bind(name, array)
        for name, array in (("key.0", self.new_k), ("value.0", self.new_v), ("hidden_out", self.hidden_out)):
            g.bind(name, array, output=True)
        if local:
            return
        keys, values = self.prompt.view(rows)
        g.bind("past_key.0", keys[0])
        g.bind("past_value.0", values[0])
        if self.select_graphs:
            g.bind("window_query.0", self.window_q, output=True)
        if self.bias:
            g.bind("cache_bias.0", self.bias[rows])

    def _init_select(self) -> None:
        share = self.manifest.policy.resolved_prompt_share
        self.sel_k, self.sel_v = self._kv(share), self._kv(share)
        self.sel_idx = self.device.zeros((1, self.manifest.spec.num_kv_heads, share), "int64")
        self.sel_len = self.device.zeros((1,), "int64")
        for rows, g in self.select_graphs.items():
            keys, values = self.prompt.view(rows)
            for name, array in (("prompt_len", self.sel_len), ("window_query.0", self.window_q),
                                ("key.0", keys[0]), ("value.0", values[0])):
                g.bind(name, array)
            for name, array in (("selected_key.0", self.sel_k), ("selected_value.0", self.sel_v),
                                ("selected_index.0", self.sel_idx)):
                g.bind(name, array, output=True)

    # ---------------------------------------------------------------- the prefill
    def chunks(self, slot: int, token_ids: list[int], resume: ResumeFrom | None, rows_to: RowsTo | None = None,
               logits_to: LogitsTo | None = None):
        """Prefill `token_ids` for `slot` (from the rows `resume` loads, or whole) a layer at a time: a
        generator that yields each chunk's share of its tokens (count / layers: a chunk of one layer
        is that share of a chunk through the model) and returns the PrefillResult. rows_to(layer,
        keys, values, kept): each layer's filled rows and the rows its selection kept, right after it
        (a compressed prompt's). logits_to(first, logits): the logits [R, V] float32 of every new token
        but the last (whose are the result's), a chunk of positions at a time, in order, once the last
        layer ran: the head over those positions' hidden states, run only when asked."""
        if self._bias_set:               # a resumed prefill abandoned mid-way (its request cancelled)
            self._clear_cache_bias()
        base, first_position = (resume.rows, resume.position) if resume else (0, 0)
        new = token_ids[first_position:]
        extra_rows = resume.extra_count if resume else 0
        tail_only = bool(extra_rows and resume.extra_tail_only)
        if tail_only and not self.manifest.export.tail:
            raise SnapcompileError("a resumed prefill over rows only its last tokens see needs an artifact converted "
                                   "with --tail above 0")
        early = max(len(new) - self.manifest.export.tail, 0) if tail_only else 0
        spans = list(chunk_spans(len(new), early, self.chunk, self.chunk))
        filled = base + len(new)
        layout = self._layout(len(token_ids), filled)
        began, selecting = time.perf_counter(), 0.0
        self._embed(new, spans)
        kept_rows, self.layers_done = [], 0
        for layer in range(self.num_layers):
            if layer in self._local:
                if resume:
                    load_ring(self.device, self.keys[layer][slot], self.values[layer][slot], resume, layer)
                for count in self._run_ring_layer(slot, layer, spans, first_position):
                    yield count / self.num_layers
                kept_rows.append(None)
                if rows_to is not None and self.manifest.policy.compressed:
                    rows_to(layer, *ring_rows(self.device, self.keys[layer][slot], self.values[layer][slot],
                                              self.ring, len(token_ids)), None)
                self.layers_done = layer + 1
                continue
            self.prompt.reset()
            if resume:
                self._load_rows(layer, resume, base + early)
            for count in self._run_layer(layer, spans, base, first_position, early, extra_rows):
                yield count / self.num_layers
            if extra_rows:
                self._drop_extra_rows(base + early, extra_rows, len(new) - early)
            selected = time.perf_counter()
            kept_rows.append(self._into_slot(slot, layer, layout, filled))
            selecting += time.perf_counter() - selected
            if rows_to is not None and self.manifest.policy.compressed:
                keys, values = self.prompt.keys[0][0, :, :filled], self.prompt.values[0][0, :, :filled]
                rows_to(layer, self.device.download(keys), self.device.download(values), kept_rows[-1])
            self.layers_done = layer + 1
        if logits_to is not None:
            self._score(len(new) - 1, logits_to)
        logits = self._head(len(new) - 1)
        self.device.release_pages()
        self.last_seconds = {"chunks": time.perf_counter() - began - selecting, "select": selecting}
        return PrefillResult(logits, layout, None if layout.kept == filled else kept_rows, filled,
                             compressed=self.manifest.policy.compressed)

    def _layout(self, prompt_len: int, filled: int) -> SlotLayout:
        policy = self.manifest.policy
        return SlotLayout.for_rows(prompt_len, filled, self.manifest.rows_per_slot,
                                   policy.resolved_prompt_share if policy.compressed else None)

    def _embed(self, new: list[int], spans) -> None:
        """Every new token's embedding into `hidden` (a chunk's padding, token id 0, with the last)."""
        for offset, count in spans:
            self._set_ids(new[offset:offset + count])
            self.embed_graph.run()
            self.hidden[offset:offset + self.chunk] = self.embedded[0]
        self.device.release_pages()

    def _run_layer(self, layer: int, spans, base: int, first_position: int, early: int, extra_rows: int):
        """The new tokens' chunks through decoder `layer`, from cache row `base` (RoPE position
        `first_position`), past the `extra_rows` loaded after the first `early`: each chunk's K/V
        into the prompt's cache, its hidden states back into `hidden` (module docstring). Yields
        each chunk's token count once it ran."""
        for n, (offset, count) in enumerate(spans):
            start = base + offset + (extra_rows if offset >= early else 0)
            rows = self.chunk_rows(max(start, self.prompt.live))
            self.prompt.lay_out(rows)
            self._run_span(self.layer_graphs[layer][rows], offset, count, start, first_position + offset)
            if start + count > self.prompt.rows:
                self.prompt.lay_out(self.prefill_rows(start + count))
            self.prompt.keys[0][:, :, start:start + count] = self.new_k[:, :, :count]
            self.prompt.values[0][:, :, start:start + count] = self.new_v[:, :, :count]
            self.prompt.filled_to(start + count)
            self._keep_hidden(spans, n)
            yield count

    def _run_ring_layer(self, slot: int, layer: int, spans, first_position: int):
        """A local layer's chunks (`_run_layer`'s): over the slot's window ring (a resumed prompt's loaded
        into it first), each chunk's K/V written into its positions' ring rows (layout.WindowRing).
        Yields each chunk's token count once it ran."""
        graph = self.layer_graphs[layer][self.max_context]        # every member reads the ring's rows
        keys, values = self.keys[layer][slot], self.values[layer][slot]           # [Hkv, Rw, D]
        graph.bind("past_key.0", keys[None])
        graph.bind("past_value.0", values[None])
        for n, (offset, count) in enumerate(spans):
            position = first_position + offset
            self._run_span(graph, offset, count, position, position)
            rows = self.device.indices(np.arange(position, position + count) % self.ring.rows)
            keys[:, rows] = self.new_k[0, :, :count]
            values[:, rows] = self.new_v[0, :, :count]
            self._keep_hidden(spans, n)
            yield count

    def _run_span(self, graph: LazyGraph, offset: int, count: int, start: int, position: int) -> None:
        """Run a layer graph on the `count` new tokens from `offset` on (their hidden states), the first at
        cache row `start` and RoPE position `position`: its outputs in new_k, new_v and hidden_out."""
        graph.bind("hidden", self.hidden[offset:offset + self.chunk][None])
        for array, value in ((self.start, start), (self.position, position), (self.chunk_len, count)):
            self.device.upload(array, np.array([value], np.int64))
        graph.run()

    def _keep_hidden(self, spans, n: int) -> None:
        """Span n's layer output back into `hidden`: up to the next span's first token (the rest of an
        overlapped span is the next one's to write), the last span all of its chunk."""
        offset = spans[n][0]
        written = spans[n + 1][0] - offset if n + 1 < len(spans) else self.chunk
        self.hidden[offset:offset + written] = self.hidden_out[0, :written]

    def _set_ids(self, tokens: list[int]) -> None:
        host = np.zeros(self.ids.shape, np.int64)
        host[0, :len(tokens)] = tokens
        self.device.upload(self.ids, host)

    def _score(self, positions: int, logits_to: LogitsTo) -> None:
        """The logits of new tokens [0, positions) to logits_to, a chunk of positions a run."""
        if self.score_logits is None:
            s = self.manifest.spec
            self.score_hidden = self.device.zeros((self.chunk, s.hidden_size), "float32")
            self.score_logits = self.device.zeros((self.chunk, s.vocab_size), "float32")
            self.scores_graph.bind("hidden", self.score_hidden)
            self.scores_graph.bind("logits", self.score_logits, output=True)
        for first in range(0, positions, self.chunk):
            count = min(self.chunk, positions - first)
            self.score_hidden[:count] = self.hidden[first:first + count]
            self.scores_graph.run()
            logits_to(first, self.device.download(self.score_logits)[:count])

    def _head(self, position: int) -> np.ndarray:
        """logits [V] of new token `position` (its hidden states after the last layer)."""
        self.last_hidden[0] = self.hidden[position]
        self.head_graph.run()
        return self.device.download(self.logits)[0].copy()

    # ---------------------------------------------------------------- a resumed prompt's rows
    def _load_rows(self, layer: int, resume: ResumeFrom, extra_at: int) -> None:
        """`layer`'s rows that `resume` loads into rows [0, resume.rows) of the prompt's cache, and its
        extra rows from row `extra_at` on, each piece's logit bias in the layer graphs' cache_bias."""
        self.prompt.filled_to(load_resumed_rows(self.device, self.prompt.keys[0], self.prompt.values[0], resume,
                                                layer, extra_at, self._set_cache_bias))

    def _set_cache_bias(self, rows: slice, bias: np.ndarray) -> None:
        if not self.bias:
            raise SnapcompileError("rows with a logit bias need an artifact converted with --summaries")
        for graph_rows, array in self.bias.items():
            if rows.stop <= graph_rows:
                self.device.upload(array[0, :, rows], bias)
        self._bias_set = True

    def _clear_cache_bias(self) -> None:
        for array in self.bias.values():
            self.device.upload(array, np.zeros(array.shape, np.float32))
        self._bias_set = False

    def _drop_extra_rows(self, first: int, count: int, new: int) -> None:
        """The `new` tokens' rows move from `first + count` down to `first`, over the extra rows."""
        move_rows_down(self.device, (self.prompt.keys[0], self.prompt.values[0]), first, count, new)
        self.prompt.truncate(first + new)
        self._clear_cache_bias()

    # ---------------------------------------------------------------- into the slot
    def _into_slot(self, slot: int, layer: int, layout: SlotLayout, filled: int) -> np.ndarray | None:
        """Move `layer`'s kept rows of the `filled` prompt rows into the slot; returns [Hkv, kept] the
        rows kept, ascending (None: rows [0, kept), all of them). Selected on the select graph of
        the rows the prompt was prefilled on, where there is one (PrefillRunner._compress_into_slot)."""
        kept, keys, values = layout.kept, self.prompt.keys[0], self.prompt.values[0]
        if kept == filled:
            self.keys[layer][slot, :, :kept] = keys[0, :, :kept]
            self.values[layer][slot, :, :kept] = values[0, :, :kept]
            return None
        if not self.select_graphs:
            positions, rows = streaming_rows(self.device, self.manifest.policy, filled)
            self.keys[layer][slot, :, :kept] = keys[0][:, rows]
            self.values[layer][slot, :, :kept] = values[0][:, rows]
            return np.broadcast_to(positions, (self.manifest.spec.num_kv_heads, kept)).copy()
        rows = self.prefill_rows(filled)
        rows = rows if rows in self.select_graphs else self.max_context
        self.device.upload(self.sel_len, np.array([filled], np.int64))
        self.prompt.lay_out(rows)
        self.select_graphs[rows].run()
        self.keys[layer][slot, :, :kept] = self.sel_k[0]
        self.values[layer][slot, :, :kept] = self.sel_v[0]
        return self.device.download(self.sel_idx)[0].copy()
