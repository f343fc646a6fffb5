"""Backends that execute an artifact's graphs."""
from __future__ import annotations

from pathlib import Path

from snapcompile.errors import SnapcompileError

BACKENDS = ("ort", "trt")
PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider",   # ONNX Runtime's, by our name
             "tensorrt": "TensorrtExecutionProvider"}


def open_backend(folder: Path, backend: str = "ort", provider: str = "cpu", threads: int | None = None,
                 exact_matmul: bool = False, prefill_order: str | None = None):
    """ONNX Runtime on an artifact folder, or TensorRT on an engine folder from `snapcompile build`.
    exact_matmul (ONNX Runtime): quantized weights multiplied in float32, not its int8 kernels.
    prefill_order (ONNX Runtime): "chunks" prefills a layer-by-layer artifact chunk by chunk (SlotBackend)."""
    if backend == "ort":
        from snapcompile.runtime.ort_backend import OrtBackend
        return OrtBackend(folder, provider=provider, threads=threads, exact_matmul=exact_matmul,
                          prefill_order=prefill_order)
    if backend == "trt":
        from snapcompile.runtime.trt_backend import TrtBackend
        return TrtBackend(folder)
    raise SnapcompileError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
