"""The slot backend: the only runtime code that touches tensors.

It owns the N static cache slots ([N, Hkv, rows_per_slot, D] per layer, allocated once and bound to
every decode graph once by address: a graph of k slots sees the first k) and, through its
PrefillRunner (runtime/prefill.py), the prefill graphs and a prefill scratch cache for one sequence.
A decode step runs on the smallest decode graph holding its active slots and moves only the new
tokens' K/V into the slots; nothing copies a whole cache. Where the tensors live and how a graph
runs is the Device's business (runtime/device.py); small per-step inputs are prepared in numpy and
uploaded. What a finished sequence leaves for later turns is the session keeper's business
(sessions/keepers.py): the backend hands out rows, it keeps none.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from snapcompile.artifact.footprint import RELEASE_EVERY_STEPS, check_memory
from snapcompile.artifact.manifest import Manifest, read_manifest
from snapcompile.artifact.naming import decode_graph_size, graph_name
from snapcompile.errors import PromptError, SnapcompileError
from snapcompile.layout import DecodeStep, SlotLayout
from snapcompile.runtime.device import Device, LazyGraph, PrefillResult, chunk_starts, drain
from snapcompile.runtime.prefill import PrefillRunner
from snapcompile.sessions.keepers import ResumeRows
from snapcompile.sessions.kept import KeptCache, ResumePlan

__all__ = ["PrefillResult", "SlotBackend", "chunk_starts", "drain"]


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
        self.prefills = PrefillRunner(self.folder, m, device, self.keys, self.values)
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
        return self.device.zeros((batch, self.manifest.spec.num_kv_heads, rows, self.manifest.spec.head_dim), "float32")

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

    def prefill_chunks(self, slot: int, token_ids: list[int]):
        """Generator form of `prefill`: yields the tokens of each chunk once it ran (so an
        engine can interleave decode steps) and returns the PrefillResult."""
        self.check_prompt(token_ids)
        return (yield from self.prefills.chunks(slot, token_ids, None, None))

    def resume_chunks(self, slot: int, plan: ResumePlan, token_ids: list[int], extra: ResumeRows | None = None):
        """Generator form of a resumed prefill (`sessions/kept.py`): the plan's kept rows go into the
        prompt's cache, tokens [resume_at, T) are prefilled against them at their own positions (and
        over `extra`, the session keeper's `resume_rows(plan)`), and the cache is compressed back
        into the slot as a prompt of T positions (snapstream re-selects with the new tokens' window).
        A conversation may pass max_context this way; the rows prefilled against (the entry's
        dropped rows included) may not."""
        rows = plan.rows + plan.dropped_rows + len(token_ids) - plan.resume_at
        if rows > self.max_resume_rows() or not 0 < plan.resume_at < len(token_ids):
            raise SnapcompileError(f"cannot resume {len(token_ids)} tokens at token {plan.resume_at} from "
                                   f"{plan.rows} kept rows and {plan.dropped_rows} dropped ones: {rows} rows, "
                                   f"the artifact's resumed prefill takes {self.max_resume_rows()}")
        tail_rows = extra.count if extra is not None and extra.tail_only else 0
        if plan.dropped_rows != tail_rows:
            raise SnapcompileError(f"the plan attends over {plan.dropped_rows} dropped rows but {tail_rows} were "
                                   "given (the quantized keeper's resume_rows)")
        if tail_rows and self.tail_graph is None:
            raise SnapcompileError("a resumed prefill over dropped rows runs on the tail graph: call "
                                   "load_tail_graph first")
        return (yield from self.prefills.chunks(slot, token_ids, plan, extra))

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
        for i in self._layers:
            self.keys[i][slots, :, writes] = self.d_new_k[i][slots, :, 0]
            self.values[i][slots, :, writes] = self.d_new_v[i][slots, :, 0]
        return self.device.download(self.d_logits)

    # ---------------------------------------------------------------- slots
    def slot_cache(self, slot: int, layout: SlotLayout, kept_positions: list[np.ndarray] | None, fed: int,
                   token_ids: list[int]) -> KeptCache:
        """The cache of a finished sequence in `slot` as host arrays in position order (float32): its
        kept prompt rows (`kept_positions`, as PrefillResult gives them) and the `fed` decode tokens
        the slot still holds. token_ids: the prompt and the fed output tokens (len = positions covered)."""
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
                         layout.prompt_len if layout.compressed else 0)

    def move_slot(self, source: int, target: int, rows: int) -> None:
        """Copy the first `rows` cache rows of slot `source` into slot `target` (the engine moves a
        sequence to a lower slot so that its steps run on a smaller decode graph)."""
        for cache in (*self.keys, *self.values):
            cache[target, :, :rows] = cache[source, :, :rows]

    def kv_bytes_allocated(self) -> int:
        """Bytes of the slot caches (allocated once, independent of prompt lengths)."""
        return self.slots * self.manifest.kv_bytes_per_slot()
