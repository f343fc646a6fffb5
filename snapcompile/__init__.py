"""snapcompile: SnapStream fixed-budget KV-cache compression for ONNX / TensorRT."""
__version__ = "0.1.0"

__all__ = ["Engine", "Request", "SamplingParams"]


def __getattr__(name):  # lazy: `import snapcompile` stays light
    if name == "Engine":
        from snapcompile.engine.engine import Engine
        return Engine
    if name in ("Request", "SamplingParams"):
        from snapcompile.engine import request
        return getattr(request, name)
    raise AttributeError(name)
