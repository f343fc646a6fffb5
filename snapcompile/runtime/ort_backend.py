"""The ONNX Runtime device: host (numpy) arrays bound to sessions by pointer, no copies."""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from snapcompile.artifact.files import check_files
from snapcompile.artifact.manifest import Manifest
from snapcompile.artifact.naming import family_members, family_of, is_prefill_graph
from snapcompile.artifact.onnx_io import load_graph
from snapcompile.config import cache_root
from snapcompile.errors import SnapcompileError
from snapcompile.memory import available_host_memory
from snapcompile.runtime import PROVIDERS
from snapcompile.runtime.backend import SlotBackend
from snapcompile.runtime.ort_capi import CSession, SharedSessions
from snapcompile.runtime.ort_form import WeightArrays, ort_form
from snapcompile.runtime.shape_family import FamilyError, symbolic_form

log = logging.getLogger("snapcompile.runtime")


class OrtGraph:
    """An InferenceSession plus an IOBinding whose inputs/outputs point into numpy buffers."""

    def __init__(self, path: Path, providers: list[str], threads: int | None, custom_ops: bool,
                 quantized_matmul: str | None = None):
        """A session of its own (plugin-lowered graphs, GPU providers; CPU graphs use CSession).
        quantized_matmul (graphs with int8/int4 weights): "int8" lets ORT fuse each DequantizeLinear
        + MatMul into its MatMulNBits kernel computing with int8 activations (accuracy level 4);
        "fp32" fuses it too, multiplying in float32 (level 1)."""
        import onnxruntime as ort
        options = ort.SessionOptions()
        disabled = []
        if quantized_matmul:
            level = {"int8": "4", "fp32": "1"}[quantized_matmul]
            options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", level)
            # MatMul + residual Add -> Gemm runs first and would keep the o / down projections
            # from becoming MatMulNBits (186 ms instead of 15.7 ms a SmolLM2 int4 decode step, docs/results/weights.md)
            disabled = ["MatMulAddFusion"]
        if custom_ops:
            from snapcompile.plugins import ort_ops
            ort_ops.add_to(options)
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.log_severity_level = 4  # failures are reported as SnapcompileError
        if threads:
            options.intra_op_num_threads = threads
        try:
            self.session = ort.InferenceSession(str(path), options, providers=providers,
                                                disabled_optimizers=disabled)
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


class OrtDevice:
    def __init__(self, folder: Path, provider: str = "cpu", threads: int | None = None, exact_matmul: bool = False,
                 family_sessions: bool = True):
        """family_sessions: one session for each family of graphs that differ in one size only
        (runtime/shape_family.py: the prefill buckets, the select buckets, the decode slot
        buckets); False makes a session a graph (for measuring what it saves)."""
        self.folder, self.threads, self.exact_matmul = Path(folder), threads, exact_matmul
        self.providers = _providers(provider)
        self.weights = WeightArrays(self.folder, spill_folder()) if provider == "cpu" else None
        self.sessions = SharedSessions() if provider == "cpu" else None
        self.models = {}                      # graph name -> ModelProto without weights, from check()
        self.family_sessions = family_sessions
        self.families: dict[str, CSession | None] = {}   # family -> its one session (None: a session a graph)

    def check(self, folder: Path, manifest: Manifest) -> None:
        """Every file's size and sha256, then fingerprint and I/O checks of every graph
        (SlotBackend calls it before `graph`)."""
        check_files(folder, manifest)
        self.models = {name: load_graph(folder, manifest, name) for name in manifest.graphs}

    def available_bytes(self) -> int:
        """Memory this process can still allocate without swapping (Linux MemAvailable)."""
        return available_host_memory()

    def zeros(self, shape, dtype: str) -> np.ndarray:
        return np.zeros(shape, np.dtype(dtype))

    def graph(self, name: str, manifest: Manifest) -> OrtGraph | CSession:
        """On the CPU every graph's session shares the process's weights and their pre-packed
        copies (runtime/ort_form.py, ort_capi.py); plugin-lowered graphs (custom ops, for
        validation) and other providers get a session of their own."""
        custom_ops = manifest.lowering == "plugin" and not is_prefill_graph(name)
        quantized = manifest.export.quantized
        if self.sessions is None or custom_ops:
            matmul = None if not quantized else "fp32" if self.exact_matmul else "int8"
            return OrtGraph(self.folder / manifest.graphs[name]["file"], self.providers, self.threads,
                            custom_ops=custom_ops, quantized_matmul=matmul)
        family = family_of(name) if self.family_sessions else None
        if family is not None and self._family_session(family, manifest) is not None:
            return self.families[family].another_binding(name)
        # the checked graph is dropped once its session is made (~1.5 MB a graph as Python objects)
        return self._session(self.models.pop(name, None) or load_graph(self.folder, manifest, name), name)

    def _session(self, source, name: str) -> CSession:
        """A session of `source` (a graph loaded without its weights) sharing the process's weights."""
        model, arrays = ort_form(source, self.weights, accuracy_level=1 if self.exact_matmul else 4)
        config = {"session.model_external_initializers_file_folder_path": str(self.folder)}
        with self.weights.pages_released_while():
            return self.sessions.session(model.SerializeToString(), arrays, config, self.threads, name)

    def _family_session(self, family: str, manifest: Manifest) -> CSession | None:
        """The one session of `family`'s graphs, made at the first call; None where the family has
        one member or its members cannot share a graph (then each gets a session of its own)."""
        if family not in self.families:
            members = family_members(family, manifest.graphs, manifest.export)
            self.families[family] = None
            if len(members) > 1:
                models = {size: self.models.get(name) or load_graph(self.folder, manifest, name)
                          for size, name in members.items()}
                try:
                    form = symbolic_form(models, "slots" if family == "decode" else "rows")
                except FamilyError as err:
                    log.warning("%s: the %s graphs get a session each: %s", self.folder, family, err)
                    return None
                for name in members.values():
                    self.models.pop(name, None)
                self.families[family] = self._session(form, family)
        return self.families[family]

    def kernels(self, manifest: Manifest) -> str:
        """What multiplies the linear layers, for run summaries (MLAS picks its AVX2 / AVX-512 /
        VNNI code path itself at run time from the CPU's features)."""
        if manifest.export.quantized:
            activations = "float32 (accuracy level 1)" if self.exact_matmul else "int8 (accuracy level 4)"
            return f"ONNX Runtime MatMulNBits, {manifest.export.weight_format} weights, {activations} activations"
        multiply = "float16 MatMul" if manifest.export.weight_format == "fp16" else "MLAS float32 GEMM"
        return f"ONNX Runtime {multiply}"

    def upload(self, target: np.ndarray, host: np.ndarray) -> None:
        target[...] = host

    def download(self, array: np.ndarray) -> np.ndarray:
        return array

    def indices(self, host: np.ndarray) -> np.ndarray:
        return host

    def release_pages(self) -> None:
        """Drop weights.bin's pages the runs mapped: the embedding rows a Gather read, each with
        the ~64 KiB around it that the kernel maps on a fault (a few thousand random tokens mapped
        ~0.45 GiB of the 1B shape's float16 embedding: docs/results/memory.md). A row read again
        comes from the page cache."""
        if self.weights is not None:
            self.weights.drop_file_pages()


class OrtBackend(SlotBackend):
    """SlotBackend on ONNX Runtime (CPUExecutionProvider by default)."""

    def __init__(self, folder: Path, provider: str = "cpu", threads: int | None = None, exact_matmul: bool = False,
                 family_sessions: bool = True):
        super().__init__(folder, OrtDevice(folder, provider, threads, exact_matmul, family_sessions))


def spill_folder() -> Path:
    """Where a process writes the quantized weights it converts (runtime/ort_form.py): the cache
    root's ort/ (on disk where the cache is; $SNAPCOMPILE_CACHE moves it)."""
    return cache_root() / "ort"


def _providers(provider: str) -> list[str]:
    """ONNX Runtime's providers for our name of one. The CPU provider is in every build, and its
    sessions are made through the C API (ort_capi.py): the onnxruntime Python module, ~23 MiB of
    RSS beside the library, is imported only to ask for another."""
    if provider not in PROVIDERS:
        raise SnapcompileError(f"unknown provider {provider!r}; choose one of {', '.join(PROVIDERS)}")
    wanted = PROVIDERS[provider]
    if wanted == "CPUExecutionProvider":
        return [wanted]
    import onnxruntime as ort
    available = ort.get_available_providers()
    if wanted not in available:
        raise SnapcompileError(f'ONNX Runtime here has no {wanted} (pip install "snapcompile[gpu]"); '
                               f"available: {', '.join(available)}")
    return [wanted, "CPUExecutionProvider"]
