"""The ONNX Runtime device: host (numpy) arrays bound to sessions by pointer, no copies."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from snapcompile.artifact.files import check_files
from snapcompile.artifact.manifest import Manifest
from snapcompile.artifact.naming import is_prefill_graph
from snapcompile.artifact.onnx_io import load_graph, load_ort_graph
from snapcompile.errors import SnapcompileError
from snapcompile.memory import available_host_memory
from snapcompile.runtime import PROVIDERS
from snapcompile.runtime.backend import SlotBackend
from snapcompile.runtime.ort_capi import BoundGraph, OrtEnvironment
from snapcompile.runtime.weight_maps import WeightArrays


class OrtGraph:
    """An InferenceSession plus an IOBinding whose inputs/outputs point into numpy buffers."""

    def __init__(self, path: Path, providers: list[str], threads: int | None, custom_ops: bool,
                 quantized_matmul: str | None = None):
        """A session of its own (plugin-lowered graphs, GPU providers; CPU graphs use BoundGraph).
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
            self.ort_session = ort.InferenceSession(str(path), options, providers=providers,
                                                disabled_optimizers=disabled)
        except Exception as err:  # ORT raises its own exception types for bad or missing data
            raise SnapcompileError(f"ONNX Runtime cannot load {path}: {str(err).splitlines()[0]}") from None
        self.binding = self.ort_session.io_binding()

    def bind(self, name: str, array: np.ndarray, output: bool = False) -> None:
        """Bind a C-contiguous numpy array by pointer (no copy; it must outlive the binding)."""
        if not array.flags.c_contiguous:
            raise ValueError(f"{name}: binding needs a contiguous array")
        bind = self.binding.bind_output if output else self.binding.bind_input
        bind(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)

    def run(self) -> None:
        self.ort_session.run_with_iobinding(self.binding)


class OrtDevice:
    def __init__(self, folder: Path, provider: str = "cpu", threads: int | None = None, exact_matmul: bool = False):
        """On the CPU the graphs run are ONNX Runtime's (naming.ort_graphs): one session for each
        family of static graphs, every session sharing the process's weights; other providers and
        the plugin lowering's custom-op graphs run the static files, a session each."""
        self.folder, self.threads, self.exact_matmul = Path(folder), threads, exact_matmul
        self.providers = _providers(provider)
        self.weights = WeightArrays(self.folder) if provider == "cpu" else None
        self.environment = OrtEnvironment(threads) if provider == "cpu" else None
        self.models: dict[str, onnx.ModelProto] = {}    # ONNX Runtime graph -> its model, checked, until made
        self.opened: dict[str, BoundGraph] = {}             # ONNX Runtime graph -> its opened graph

    @property
    def runs_ort_graphs(self) -> bool:
        return self.environment is not None

    def check(self, folder: Path, manifest: Manifest) -> None:
        """Every file's size and sha256, then fingerprint, I/O and allocation checks of every graph
        this device runs (SlotBackend calls it before `graph`)."""
        check_files(folder, manifest)
        if self.environment is None:
            for name in manifest.graphs:
                load_graph(folder, manifest, name)
            return
        self.models = {name: load_ort_graph(folder, manifest, name) for name in manifest.ort_graphs}
        for name in manifest.graphs:
            if manifest.ort_graph_of(name) is None:
                load_graph(folder, manifest, name)

    def available_bytes(self) -> int:
        """Memory this process can still allocate without swapping (Linux MemAvailable)."""
        return available_host_memory()

    def zeros(self, shape, dtype: str) -> np.ndarray:
        return np.zeros(shape, np.dtype(dtype))

    def graph(self, name: str, manifest: Manifest) -> OrtGraph | BoundGraph:
        """Static graph `name` bound to buffers of its own: on the CPU a binding of its ONNX Runtime
        graph's session (made at the first of its members), sharing the process's weights and their
        pre-packed copies (ort_capi.py); the plugin lowering's custom-op graphs and other providers
        get a session of their own on the static file."""
        ort = manifest.ort_graph_of(name) if self.environment is not None else None
        if ort is None:
            quantized = manifest.export.quantized
            matmul = None if not quantized else "fp32" if self.exact_matmul else "int8"
            return OrtGraph(self.folder / manifest.graphs[name]["file"], self.providers, self.threads,
                            custom_ops=manifest.lowering == "plugin" and not is_prefill_graph(name),
                            quantized_matmul=matmul)
        if ort in self.opened:
            return self.opened[ort].another_binding(name)
        model = self.models.pop(ort, None) or load_ort_graph(self.folder, manifest, ort)
        self.opened[ort] = self._open(model, ort)
        return self.opened[ort]

    def _open(self, model: onnx.ModelProto, name: str) -> BoundGraph:
        """A session of ONNX Runtime graph `model` (loaded without its weights) given every external
        initializer as the process's shared array."""
        if self.exact_matmul:
            model = with_accuracy_level(model, EXACT_ACCURACY_LEVEL)
        arrays = {tensor.name: self.weights.array(tensor) for tensor in model.graph.initializer
                  if tensor.data_location == onnx.TensorProto.EXTERNAL}
        config = {"session.model_external_initializers_file_folder_path": str(self.folder)}
        with self.weights.pages_released_while():
            return self.environment.open_graph(model.SerializeToString(), arrays, config, name)

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
                 prefill_order: str | None = None):
        super().__init__(folder, OrtDevice(folder, provider, threads, exact_matmul), prefill_order)


EXACT_ACCURACY_LEVEL = 1     # MatMulNBits multiplying in float32: the graph's exact arithmetic (validate)


def with_accuracy_level(model: onnx.ModelProto, level: int) -> onnx.ModelProto:
    """A copy of `model` whose MatMulNBits nodes compute at accuracy `level`: the kernel's arithmetic,
    which ONNX Runtime reads from the node (the artifact's graphs hold its fast int8 path, level 4)."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            for attribute in node.attribute:
                if attribute.name == "accuracy_level":
                    attribute.i = level
    return model


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
