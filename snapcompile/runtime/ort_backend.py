"""The ONNX Runtime backend: the only runtime code that touches tensors.

It owns the N static cache slots ([N, Hkv, capacity, D] per layer, allocated once and bound to
the decode graph once by pointer) and a prefill scratch cache for one sequence. A decode step
moves only the new tokens' K/V into the slots; nothing copies a whole cache.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from snapcompile.artifact import Manifest, load_graph, read_manifest
from snapcompile.errors import SnapcompileError
from snapcompile.layout import DecodeStep, SlotLayout

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider",
             "tensorrt": "TensorrtExecutionProvider"}


@dataclass
class PrefillResult:
    """logits: [V] float32 for the prompt's last token. kept_positions: per layer [Hkv, kept]
    prompt positions now in the slot (None when the whole prompt was kept)."""

    logits: np.ndarray
    layout: SlotLayout
    kept_positions: list[np.ndarray] | None


def chunk_starts(prompt_len: int, chunk: int) -> list[int]:
    """Chunk start positions; the last chunk ends exactly at the prompt's end (it may overlap
    the previous one) so the observation window always lies inside one chunk."""
    starts = list(range(0, max(prompt_len - chunk, 0), chunk))
    starts.append(max(prompt_len - chunk, 0))
    return starts


class _Session:
    """An InferenceSession plus an IOBinding whose inputs/outputs point into numpy buffers."""

    def __init__(self, path: Path, providers: list[str], threads: int | None):
        import onnxruntime as ort
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.log_severity_level = 4  # failures are reported as SnapcompileError
        if threads:
            options.intra_op_num_threads = threads
        try:
            self.session = ort.InferenceSession(str(path), options, providers=providers)
        except Exception as err:  # ORT raises its own exception types for bad or missing data
            raise SnapcompileError(f"ONNX Runtime cannot load {path}: {str(err).splitlines()[0]}") from None
        self.binding = self.session.io_binding()

    def bind(self, name: str, array: np.ndarray, output: bool = False) -> None:
        """Bind a C-contiguous numpy array by pointer (no copy; it must outlive the binding)."""
        if not array.flags.c_contiguous:
            raise ValueError(f"{name}: binding needs a contiguous array")
        bind = self.binding.bind_output if output else self.binding.bind_input
        bind(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)

    def run(self) -> None:
        self.session.run_with_iobinding(self.binding)


class OrtBackend:
    """Runs an artifact's graphs. Slot state (layouts, positions) belongs to the caller."""

    def __init__(self, folder: Path, provider: str = "cpu", threads: int | None = None):
        import onnxruntime as ort
        self.folder = Path(folder)
        self.manifest: Manifest = read_manifest(self.folder)
        providers = _providers(provider, ort.get_available_providers())
        for name in self.manifest.graphs:
            load_graph(self.folder, self.manifest, name)     # fingerprint and I/O checks
        m = self.manifest
        self.num_layers, self.slots = m.spec.num_layers, m.export.slots
        self.capacity = m.cache_capacity
        kv_shape = (m.spec.num_kv_heads, m.spec.head_dim)
        self.keys = [np.zeros((self.slots, kv_shape[0], self.capacity, kv_shape[1]), np.float32)
                     for _ in range(self.num_layers)]
        self.values = [np.zeros_like(k) for k in self.keys]
        self.prefill_session = _Session(self.folder / m.graphs["prefill"]["file"], providers, threads)
        self.decode_session = _Session(self.folder / m.graphs["decode"]["file"], providers, threads)
        self.select_session = (_Session(self.folder / m.graphs["select"]["file"], providers, threads)
                               if "select" in m.graphs else None)
        self._init_prefill_buffers(kv_shape)
        self._init_decode_buffers(kv_shape)

    # ---------------------------------------------------------------- buffers
    def _init_prefill_buffers(self, kv_shape) -> None:
        m, chunk = self.manifest, self.manifest.export.chunk
        self.chunk = chunk
        self.p_ids = np.zeros((1, chunk), np.int64)
        self.p_start = np.zeros(1, np.int64)
        self.p_len = np.zeros(1, np.int64)
        self.p_logits = np.zeros((1, m.spec.vocab_size), np.float32)
        self.p_new_k = [np.zeros((1, kv_shape[0], chunk, kv_shape[1]), np.float32) for _ in range(self.num_layers)]
        self.p_new_v = [np.zeros_like(k) for k in self.p_new_k]
        self.p_window_q = None
        if m.policy.compressed:    # the full prompt lives here until it is compressed into a slot
            shape = (1, kv_shape[0], m.export.max_context, kv_shape[1])
            self.scratch_k = [np.zeros(shape, np.float32) for _ in range(self.num_layers)]
            self.scratch_v = [np.zeros(shape, np.float32) for _ in range(self.num_layers)]
        s = self.prefill_session
        s.bind("input_ids", self.p_ids)
        s.bind("start", self.p_start)
        s.bind("chunk_len", self.p_len)
        s.bind("logits", self.p_logits, output=True)
        for i in range(self.num_layers):
            s.bind(f"key.{i}", self.p_new_k[i], output=True)
            s.bind(f"value.{i}", self.p_new_v[i], output=True)
        if self.select_session is not None:
            self._init_select_buffers()

    def _init_select_buffers(self) -> None:
        m = self.manifest
        heads, window, d = m.spec.num_heads, m.policy.window, m.spec.head_dim
        share, hkv = m.policy.resolved_prompt_share, m.spec.num_kv_heads
        self.p_window_q = [np.zeros((1, heads, window, d), np.float32) for _ in range(self.num_layers)]
        self.sel_k = [np.zeros((1, hkv, share, d), np.float32) for _ in range(self.num_layers)]
        self.sel_v = [np.zeros_like(k) for k in self.sel_k]
        self.sel_idx = [np.zeros((1, hkv, share), np.int64) for _ in range(self.num_layers)]
        self.sel_len = np.zeros(1, np.int64)
        s = self.select_session
        s.bind("prompt_len", self.sel_len)
        for i in range(self.num_layers):
            self.prefill_session.bind(f"window_query.{i}", self.p_window_q[i], output=True)
            s.bind(f"window_query.{i}", self.p_window_q[i])
            s.bind(f"key.{i}", self.scratch_k[i])
            s.bind(f"value.{i}", self.scratch_v[i])
            s.bind(f"selected_key.{i}", self.sel_k[i], output=True)
            s.bind(f"selected_value.{i}", self.sel_v[i], output=True)
            s.bind(f"selected_index.{i}", self.sel_idx[i], output=True)

    def _init_decode_buffers(self, kv_shape) -> None:
        n, m = self.slots, self.manifest
        self.d_ids = np.zeros((n, 1), np.int64)
        self.d_position = np.zeros(n, np.int64)
        self.d_cache_len = np.zeros(n, np.int64)
        self.d_write = np.zeros(n, np.int64)
        self.d_logits = np.zeros((n, m.spec.vocab_size), np.float32)
        self.d_new_k = [np.zeros((n, kv_shape[0], 1, kv_shape[1]), np.float32) for _ in range(self.num_layers)]
        self.d_new_v = [np.zeros_like(k) for k in self.d_new_k]
        s = self.decode_session
        s.bind("input_ids", self.d_ids)
        s.bind("position", self.d_position)
        s.bind("cache_len", self.d_cache_len)
        if m.policy.compressed:
            s.bind("write_index", self.d_write)
        s.bind("logits", self.d_logits, output=True)
        for i in range(self.num_layers):
            s.bind(f"past_key.{i}", self.keys[i])
            s.bind(f"past_value.{i}", self.values[i])
            s.bind(f"key.{i}", self.d_new_k[i], output=True)
            s.bind(f"value.{i}", self.d_new_v[i], output=True)

    # ---------------------------------------------------------------- prefill
    def max_prompt_len(self) -> int:
        return self.manifest.export.max_context - (0 if self.manifest.policy.compressed else 1)

    def prefill_chunks(self, slot: int, token_ids: list[int]):
        """Generator form of `prefill`: yields after each chunk (so an engine can interleave
        decode steps) and returns the PrefillResult as the generator's value."""
        length = len(token_ids)
        if not 0 < length <= self.max_prompt_len():
            raise SnapcompileError(f"prompt of {length} tokens does not fit: the artifact's "
                                   f"--max-context allows 1..{self.max_prompt_len()} prompt tokens")
        targets_k, targets_v = self._prefill_targets(slot)
        s = self.prefill_session
        for i in range(self.num_layers):
            s.bind(f"past_key.{i}", targets_k[i])
            s.bind(f"past_value.{i}", targets_v[i])
        for start in chunk_starts(length, self.chunk):
            count = min(self.chunk, length - start)
            self.p_ids[0, :count] = token_ids[start:start + count]
            self.p_ids[0, count:] = 0
            self.p_start[0], self.p_len[0] = start, count
            s.run()
            for i in range(self.num_layers):
                targets_k[i][:, :, start:start + count] = self.p_new_k[i][:, :, :count]
                targets_v[i][:, :, start:start + count] = self.p_new_v[i][:, :, :count]
            yield count
        layout = SlotLayout.for_prompt(length, self.capacity, self.manifest.policy.resolved_prompt_share
                                       if self.manifest.policy.compressed else None)
        kept = self._compress_into_slot(slot, layout) if self.manifest.policy.compressed else None
        return PrefillResult(self.p_logits[0].copy(), layout, kept)

    def prefill(self, slot: int, token_ids: list[int]) -> PrefillResult:
        gen = self.prefill_chunks(slot, token_ids)
        while True:
            try:
                next(gen)
            except StopIteration as stop:
                return stop.value

    def _prefill_targets(self, slot: int):
        if self.manifest.policy.compressed:
            return self.scratch_k, self.scratch_v
        return ([k[slot:slot + 1] for k in self.keys], [v[slot:slot + 1] for v in self.values])

    def _compress_into_slot(self, slot: int, layout: SlotLayout) -> list[np.ndarray] | None:
        """Move the kept prompt rows from the scratch cache into the slot (once per request)."""
        kept = layout.kept
        if not layout.compressed:
            for i in range(self.num_layers):
                self.keys[i][slot, :, :kept] = self.scratch_k[i][0, :, :kept]
                self.values[i][slot, :, :kept] = self.scratch_v[i][0, :, :kept]
            return None
        if self.select_session is not None:
            self.sel_len[0] = layout.prompt_len
            self.select_session.run()
            for i in range(self.num_layers):
                self.keys[i][slot, :, :kept] = self.sel_k[i][0]
                self.values[i][slot, :, :kept] = self.sel_v[i][0]
            return [idx[0].copy() for idx in self.sel_idx]
        return self._streaming_into_slot(slot, layout)

    def _streaming_into_slot(self, slot: int, layout: SlotLayout) -> list[np.ndarray]:
        sinks = self.manifest.policy.sinks
        positions = np.concatenate([np.arange(sinks),
                                    np.arange(layout.prompt_len - (layout.kept - sinks), layout.prompt_len)])
        for i in range(self.num_layers):
            self.keys[i][slot, :, :layout.kept] = self.scratch_k[i][0][:, positions]
            self.values[i][slot, :, :layout.kept] = self.scratch_v[i][0][:, positions]
        hkv = self.manifest.spec.num_kv_heads
        return [np.broadcast_to(positions, (hkv, layout.kept)).copy() for _ in range(self.num_layers)]

    # ---------------------------------------------------------------- decode
    def decode(self, tokens: dict[int, int], steps: dict[int, DecodeStep]) -> np.ndarray:
        """One decode step for the active slots (keys of `tokens`); idle slots are masked.

        Returns logits [N, V] (rows of idle slots are meaningless). The new K/V of each active
        slot is written at its step's write_index.
        """
        self.d_ids.fill(0)
        self.d_position.fill(0)
        self.d_cache_len.fill(0)
        self.d_write.fill(0)
        for slot, token in tokens.items():
            step = steps[slot]
            self.d_ids[slot, 0] = token
            self.d_position[slot] = step.position
            self.d_cache_len[slot] = step.cache_len
            self.d_write[slot] = step.write_index
        self.decode_session.run()
        active = np.fromiter(tokens.keys(), np.int64, len(tokens))
        writes = self.d_write[active] if self.manifest.policy.compressed else self.d_position[active]
        for i in range(self.num_layers):
            self.keys[i][active, :, writes] = self.d_new_k[i][active, :, 0]
            self.values[i][active, :, writes] = self.d_new_v[i][active, :, 0]
        return self.d_logits

    def kv_bytes_in_use(self) -> int:
        """Bytes of the slot caches (allocated once, independent of prompt lengths)."""
        return sum(k.nbytes + v.nbytes for k, v in zip(self.keys, self.values))


def _providers(provider: str, available: list[str]) -> list[str]:
    if provider not in PROVIDERS:
        raise SnapcompileError(f"unknown provider {provider!r}; choose one of {', '.join(PROVIDERS)}")
    wanted = PROVIDERS[provider]
    if wanted not in available:
        extra = ' (pip install "snapcompile[gpu]")' if provider != "cpu" else ""
        raise SnapcompileError(f"ONNX Runtime here has no {wanted}{extra}; available: {', '.join(available)}")
    return [wanted, "CPUExecutionProvider"] if wanted != "CPUExecutionProvider" else [wanted]
