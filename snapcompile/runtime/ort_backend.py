"""The ONNX Runtime device: host (numpy) arrays bound to sessions by pointer, no copies."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from snapcompile.artifact import Manifest, load_graph
from snapcompile.errors import SnapcompileError
from snapcompile.runtime.backend import SlotBackend

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider",
             "tensorrt": "TensorrtExecutionProvider"}


class OrtGraph:
    """An InferenceSession plus an IOBinding whose inputs/outputs point into numpy buffers."""

    def __init__(self, path: Path, providers: list[str], threads: int | None, custom_ops: bool):
        import onnxruntime as ort
        options = ort.SessionOptions()
        if custom_ops:
            from snapcompile.plugins import ort_ops
            ort_ops.add_to(options)
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


class OrtDevice:
    def __init__(self, folder: Path, provider: str = "cpu", threads: int | None = None):
        import onnxruntime as ort
        self.folder, self.threads = Path(folder), threads
        self.providers = _providers(provider, ort.get_available_providers())

    def check(self, folder: Path, manifest: Manifest) -> None:
        for name in manifest.graphs:
            load_graph(folder, manifest, name)   # fingerprint and I/O checks

    def zeros(self, shape, dtype: str) -> np.ndarray:
        return np.zeros(shape, np.dtype(dtype))

    def graph(self, name: str, manifest: Manifest) -> OrtGraph:
        return OrtGraph(self.folder / manifest.graphs[name]["file"], self.providers, self.threads,
                        custom_ops=manifest.lowering == "plugin" and name != "prefill")

    def upload(self, target: np.ndarray, host: np.ndarray) -> None:
        target[...] = host

    def download(self, array: np.ndarray) -> np.ndarray:
        return array

    def indices(self, host: np.ndarray) -> np.ndarray:
        return host


class OrtBackend(SlotBackend):
    """SlotBackend on ONNX Runtime (CPUExecutionProvider by default)."""

    def __init__(self, folder: Path, provider: str = "cpu", threads: int | None = None):
        super().__init__(folder, OrtDevice(folder, provider, threads))


def _providers(provider: str, available: list[str]) -> list[str]:
    if provider not in PROVIDERS:
        raise SnapcompileError(f"unknown provider {provider!r}; choose one of {', '.join(PROVIDERS)}")
    wanted = PROVIDERS[provider]
    if wanted not in available:
        extra = ' (pip install "snapcompile[gpu]")' if provider != "cpu" else ""
        raise SnapcompileError(f"ONNX Runtime here has no {wanted}{extra}; available: {', '.join(available)}")
    return [wanted, "CPUExecutionProvider"] if wanted != "CPUExecutionProvider" else [wanted]
