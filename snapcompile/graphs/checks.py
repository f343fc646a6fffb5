"""The checks every written graph passes: the ONNX checker, strict shape inference, static outputs.

No torch here: `compress` reaches it without importing the exporter."""
from __future__ import annotations

import onnx


def check_graph(model: onnx.ModelProto, name: str, strict: bool = True, symbolic: tuple[str, ...] = ()) -> None:
    """onnx.checker (skipped for a graph whose weights are external data not yet saved beside it:
    `save_graphs` checks the saved file) and shape inference, strict unless `strict` is False
    (custom-domain ops); every graph output must have a static shape but for the dimensions named in
    `symbolic` (a family's size, graphs/builder.SymbolicSize). Raises RuntimeError naming the graph:
    a failure is a bug, not a user mistake."""
    try:
        external = any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer)
        if not external:
            onnx.checker.check_model(model)
        # data propagation reads constant values: not possible for data not loaded
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=strict, data_prop=strict and not external)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as err:
        raise RuntimeError(f"internal error: the {name} graph is invalid: {err}") from err
    for value in inferred.graph.output:
        dims = value.type.tensor_type.shape.dim
        if not value.type.tensor_type.HasField("shape"):
            raise RuntimeError(f"internal error: {name} output {value.name} has no shape")
        if not all(d.HasField("dim_value") or d.dim_param in symbolic for d in dims):
            raise RuntimeError(f"internal error: {name} output {value.name} has a symbolic shape")
