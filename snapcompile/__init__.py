"""snapcompile: SnapStream fixed-budget KV-cache compression for ONNX / TensorRT."""
__version__ = "0.1.0"
