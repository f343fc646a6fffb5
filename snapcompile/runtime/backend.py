"""The slot backend: the only runtime code that touches tensors.

It owns the N static cache slots ([N, Hkv, rows_per_slot, D] per layer, allocated once and bound to
every decode graph once by address: a graph of k slots sees the first k) and, through its
PrefillRunner (runtime/prefill.py), the prefill graphs and a prefill scratch cache for one sequence.
A decode step runs on the smallest decode graph holding its active slots and moves only the new
tokens' K/V into the slots; nothing copies a whole cache. Where the tensors live and how a graph
runs is the Device's business (runtime/device.py); small per-step inputs are prepared in numpy and
uploaded. What rows stand for in a conversation is the session store's business (sessions/): the
backend loads the rows a resumed prefill starts from (`ResumeFrom`) and hands out a slot's rows
(`slot_rows`); it keeps none and knows no kept conversation.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from snapcompile.artifact.footprint import RELEASE_EVERY_STEPS, check_memory
from snapcompile.artifact.manifest import Manifest, read_manifest
from snapcompile.artifact.naming import decode_graph_size, graph_name
from snapcompile.errors import PromptError, SnapcompileError
from snapcompile.layout import DecodeStep
from snapcompile.runtime.device import (
    Device,
    LazyGraph,
    LogitsTo,
    PrefillResult,
    ResumeFrom,
    RowsTo,
    chunk_starts,
    drain,
)
from snapcompile.runtime.layer_prefill import LayerPrefill
from snapcompile.runtime.prefill import PrefillRunner

__all__ = ["PrefillResult", "ResumeFrom", "SlotBackend", "chunk_starts", "drain"]


class SlotBackend:
    """Runs an artifact's graphs on a Device. Slot state (layouts, positions) is the caller's."""

    def __init__(self, folder: Path, device: Device, prefill_order: str | None = None):
        """prefill_order: "chunks" runs a layer-by-layer artifact's prefill chunk by chunk through the
        whole model (its other graphs; to compare the two); None: the artifact's own, where the
        device runs ONNX Runtime's graphs (`Device.runs_ort_graphs`)."""
        self.folder, self.device = Path(folder), device
        self.manifest: Manifest = read_manifest(self.folder)
        m = self.manifest
        device.check(self.folder, m)             # the graphs belong to this manifest
        check_memory(m, device.available_bytes())
        self.num_layers, self.slots, self.chunk = m.spec.num_layers, m.export.slots, m.export.chunk
        self.rows_per_slot = m.rows_per_slot
        self._layers = range(self.num_layers)
        self.ring = m.window_ring          # the local layers' cache (Gemma 3), None where the model has none
        self.keys = [self._kv(self.slots, m.layer_rows(i)) for i in self._layers]
        self.values = [self._kv(self.slots, m.layer_rows(i)) for i in self._layers]
        layers = m.prefill_order == "layers" and device.runs_ort_graphs and prefill_order != "chunks"
        self.prefills = (LayerPrefill if layers else PrefillRunner)(self.folder, m, device, self.keys, self.values)
        self._layer_scorer: LayerPrefill | None = None        # made at the first prompt scored (`_scorer`)
        self.decode_sizes = m.export.decode_sizes()
        self.decode_graphs = {k: LazyGraph(device, graph_name("decode", k, self.slots), m)   # slots -> graph
                              for k in self.decode_sizes}
        self._steps_run = 0
        self._init_decode()
        # made at open: its session converts and pre-packs every weight, which all graphs share
        self._opened_with = self.decode_graphs[min(self.decode_sizes)]
        self._opened_with.make()

    def make_graphs(self) -> None:
        """Make every graph now, as a server does before it says it is ready and a benchmark before
        it times: otherwise each is made at its first run (runtime/device.LazyGraph)."""
        for graph in self._graphs():
            graph.make()

    def graphs_made_on_use(self) -> tuple[int, float]:
        """How many graphs were made at their first run since the backend opened, and the seconds
        that took (part of the request times of whatever ran them)."""
        made = [g.make_seconds for g in self._graphs() if g.make_seconds is not None and g is not self._opened_with]
        return len(made), sum(made)

    def _graphs(self) -> list[LazyGraph]:
        return [*self.decode_graphs.values(), *self.prefills.graphs()]

    def _kv(self, batch: int, rows: int):
        return self.device.zeros((batch, self.manifest.spec.num_kv_heads, rows, self.manifest.kv_row_width),
                                 self.manifest.export.kv_dtype)

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
    @property
    def last_prefill_seconds(self) -> dict[str, float]:
        """Seconds of the latest prefill's chunks and of its selection (for benchmarks)."""
        return self.prefills.last_seconds

    @property
    def tail_graph(self):
        return self.prefills.tail_graph

    def load_tail_graph(self) -> None:
        """Load the tail graph for a session keeper that `needs_tail` (PrefillRunner.load_tail_graph)."""
        self.prefills.load_tail_graph()

    def prefill_rows(self, prompt_len: int) -> int:
        return self.prefills.prefill_rows(prompt_len)

    def chunk_rows(self, start: int) -> int:
        return self.prefills.chunk_rows(start)

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

    def prefill_chunks(self, slot: int, token_ids: list[int], resume: ResumeFrom | None = None,
                       rows_to: RowsTo | None = None, logits_to: LogitsTo | None = None):
        """Generator form of `prefill`: yields the tokens each run covered (a chunk's, or its share of
        one layer) so an engine can interleave decode steps, and returns the PrefillResult. With
        `resume` the prompt's first `resume.position` tokens are the rows it loads (sessions/restore.py
        checks they fit: `max_resume_rows`); without, the whole prompt is prefilled (`check_prompt`).
        rows_to: handed a compressed prompt's rows a layer at a time (device.RowsTo). logits_to: handed
        every prompt position's logits but the last (device.LogitsTo), by the layer-by-layer prefill
        (`scores_prompts`); the prompt is then prefilled whole."""
        if resume is None:
            self.check_prompt(token_ids)
        if logits_to is None:
            return (yield from self.prefills.chunks(slot, token_ids, resume, rows_to))
        if resume is not None:
            raise SnapcompileError("a prompt's logits at every position need the whole prompt prefilled, not resumed")
        return (yield from self._scorer().chunks(slot, token_ids, None, rows_to, logits_to))

    @property
    def scores_prompts(self) -> bool:
        """Whether a prefill can hand out every prompt position's logits: on ONNX Runtime's graphs of
        the standard lowering, which hold the layer-by-layer prefill's (its head runs on any position)."""
        return self.device.runs_ort_graphs and self.manifest.lowering == "standard"

    def _scorer(self) -> LayerPrefill:
        """The layer-by-layer prefill: the artifact's own, or for one prefilled chunk by chunk one made
        at the first prompt scored (its buffers: the prompt's hidden states and one layer's KV)."""
        if not self.scores_prompts:
            raise SnapcompileError("a prompt's log probabilities are computed by the layer-by-layer prefill, which "
                                   "runs on ONNX Runtime with the standard lowering; this backend runs "
                                   f"{self.manifest.lowering!r} graphs on {type(self.device).__name__}")
        if not isinstance(self.prefills, LayerPrefill):
            if self._layer_scorer is None:
                self._layer_scorer = LayerPrefill(self.folder, self.manifest, self.device, self.keys, self.values)
            return self._layer_scorer
        return self.prefills

    def prefill(self, slot: int, token_ids: list[int]) -> PrefillResult:
        return drain(self.prefill_chunks(slot, token_ids))

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
        self._steps_run += 1
        if self._steps_run % RELEASE_EVERY_STEPS == 0:
            self.device.release_pages()
        active = np.fromiter(tokens.keys(), np.int64, len(tokens))
        slots, writes = self.device.indices(active), self.device.indices(host["write_index"][active])
        if self.ring is not None:      # a local layer's token goes to its position's ring row
            ring_writes = self.device.indices(host["position"][active] % self.ring.rows)
        local = self.manifest.spec.local_layers
        for i in self._layers:
            rows = ring_writes if i in local else writes
            self.keys[i][slots, :, rows] = self.d_new_k[i][slots, :, 0]
            self.values[i][slots, :, rows] = self.d_new_v[i][slots, :, 0]
        return self.device.download(self.d_logits)

    # ---------------------------------------------------------------- slots
    def slot_rows(self, slot: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per layer the keys and values [Hkv, rows, D] (export.kv_dtype; rows_per_slot, a local layer's
        its window ring's) of `slot` on the host (views on ONNX Runtime: read them before the slot runs
        again)."""
        return [(self.device.download(self.keys[i][slot]), self.device.download(self.values[i][slot]))
                for i in self._layers]

    def move_slot(self, source: int, target: int, rows: int) -> None:
        """Copy the first `rows` cache rows of slot `source` into slot `target` (the engine moves a
        sequence to a lower slot so that its steps run on a smaller decode graph); a local layer's
        whole window ring."""
        for i in self._layers:
            count = self.ring.rows if i in self.manifest.spec.local_layers else rows
            for cache in (self.keys[i], self.values[i]):
                cache[target, :, :count] = cache[source, :, :count]

    def kv_bytes_allocated(self) -> int:
        """Bytes of the slot caches (allocated once, independent of prompt lengths)."""
        return self.slots * self.manifest.kv_bytes_per_slot()
