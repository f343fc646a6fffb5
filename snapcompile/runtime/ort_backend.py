"""The ONNX Runtime device: host (numpy) arrays bound to sessions by pointer, no copies."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from snapcompile.artifact.files import check_files
from snapcompile.artifact.manifest import Manifest
from snapcompile.artifact.naming import is_prefill_graph
from snapcompile.artifact.onnx_io import load_graph
from snapcompile.config import cache_root
from snapcompile.errors import SnapcompileError
from snapcompile.memory import available_host_memory
from snapcompile.runtime import PROVIDERS
from snapcompile.runtime.backend import SlotBackend
from snapcompile.runtime.ort_capi import CSession, SharedSessions
from snapcompile.runtime.ort_form import WeightArrays, ort_form


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
    def __init__(self, folder: Path, provider: str = "cpu", threads: int | None = None, exact_matmul: bool = False):
        import onnxruntime as ort
        self.folder, self.threads, self.exact_matmul = Path(folder), threads, exact_matmul
        self.providers = _providers(provider, ort.get_available_providers())
        self.weights = WeightArrays(self.folder, spill_folder()) if provider == "cpu" else None
        self.sessions = SharedSessions() if provider == "cpu" else None
        self.models = {}                      # graph name -> ModelProto without weights, from check()

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
        # the checked graph is dropped once its session is made (~1.5 MB a graph as Python objects)
        source = self.models.pop(name, None) or load_graph(self.folder, manifest, name)
        model, arrays = ort_form(source, self.weights, accuracy_level=1 if self.exact_matmul else 4)
        config = {"session.model_external_initializers_file_folder_path": str(self.folder)}
        with self.weights.pages_released_while():
            return self.sessions.session(model.SerializeToString(), arrays, config, self.threads, name)

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


class OrtBackend(SlotBackend):
    """SlotBackend on ONNX Runtime (CPUExecutionProvider by default)."""

    def __init__(self, folder: Path, provider: str = "cpu", threads: int | None = None, exact_matmul: bool = False):
        super().__init__(folder, OrtDevice(folder, provider, threads, exact_matmul))


def spill_folder() -> Path:
    """Where a process writes the quantized weights it converts (runtime/ort_form.py): the cache
    root's ort/ (on disk where the cache is; $SNAPCOMPILE_CACHE moves it)."""
    return cache_root() / "ort"


def _providers(provider: str, available: list[str]) -> list[str]:
    if provider not in PROVIDERS:
        raise SnapcompileError(f"unknown provider {provider!r}; choose one of {', '.join(PROVIDERS)}")
    wanted = PROVIDERS[provider]
    if wanted not in available:
        extra = ' (pip install "snapcompile[gpu]")' if provider != "cpu" else ""
        raise SnapcompileError(f"ONNX Runtime here has no {wanted}{extra}; available: {', '.join(available)}")
    return [wanted, "CPUExecutionProvider"] if wanted != "CPUExecutionProvider" else [wanted]
