"""Checks every written graph passes: the ONNX checker, strict shape inference, static outputs.

No torch here: `compress` reaches it without importing the exporter."""
from __future__ import annotations

import onnx


def verify_graph(model: onnx.ModelProto, name: str) -> None:
    """onnx.checker plus strict shape inference; every graph output must have a static shape."""
    try:
        onnx.checker.check_model(model)
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as err:
        raise RuntimeError(f"internal error: the {name} graph is invalid: {err}") from err
    for value in inferred.graph.output:
        dims = value.type.tensor_type.shape.dim
        if not all(d.HasField("dim_value") for d in dims):
            raise RuntimeError(f"internal error: {name} output {value.name} has a symbolic shape")
