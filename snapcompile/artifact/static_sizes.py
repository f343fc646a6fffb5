"""Every tensor a graph can allocate, bounded at load by the artifact's own declared shapes.

A graph is a file: edited and resealed, it can hold a ConstantOfShape, Expand or Tile whose static
shape asks for terabytes, and ONNX Runtime would try the allocation on every step. ONNX shape
inference (with constant propagation) gives every node's output shape without running anything;
each static one must stay within `max_elements(manifest)`, a generous multiple of the largest tensor
the declared shapes allow. An operator whose output size is set by a value (VALUE_SIZED) must have a
static inferred shape, and control flow (If, Loop, Scan) is refused: snapcompile's graphs hold none.
"""
from __future__ import annotations

import math
from pathlib import Path

import onnx
from onnx import shape_inference

from snapcompile.artifact.manifest import Manifest
from snapcompile.errors import SnapcompileError, first_line

SLACK = 4
VALUE_SIZED = frozenset({"ConstantOfShape", "Expand", "Tile", "Range", "Resize", "Upsample", "Pad", "OneHot",
                         "RandomNormal", "RandomUniform", "ConvTranspose", "MaxUnpool", "CenterCropPad", "Col2Im"})
CONTROL_FLOW = frozenset({"If", "Loop", "Scan"})


def max_elements(manifest: Manifest) -> int:
    """SLACK x the largest of: a step's activations (slots x the longer of chunk and tail, times
    every head's attention row over max_context + chunk plus the vocabulary, MLP and hidden
    widths), every layer's key and value cache rows, and the largest weight matrix."""
    spec, export = manifest.spec, manifest.export
    rows = export.max_context + export.chunk
    per_token = spec.num_heads * rows + spec.vocab_size + spec.intermediate_size + spec.hidden_size
    activations = max(export.slots, 1) * max(export.chunk, export.tail, 1) * per_token
    cache = 2 * max(export.slots, 1) * spec.num_layers * spec.num_kv_heads * rows * spec.head_dim
    weights = max(spec.vocab_size, spec.intermediate_size) * spec.hidden_size
    return SLACK * max(activations, cache, weights)


def check_static_sizes(model: onnx.ModelProto, path: Path, manifest: Manifest) -> None:
    """Refuse (SnapcompileError naming the node) a graph that could allocate past max_elements."""
    limit = max_elements(manifest)
    try:
        inferred = shape_inference.infer_shapes(model, data_prop=True)
    except Exception as err:  # onnx raises InferenceError, ValidationError and plain RuntimeErrors
        raise SnapcompileError(f"{path}: ONNX shape inference fails on this graph: {first_line(err)}") from None
    shapes = {value.name: value.type.tensor_type.shape if value.type.tensor_type.HasField("shape") else None
              for value in list(inferred.graph.value_info) + list(inferred.graph.output)}
    for node in inferred.graph.node:
        if node.op_type in CONTROL_FLOW:
            raise SnapcompileError(f"{path}: node {node.name!r} is an {node.op_type}: snapcompile's graphs hold "
                                   "no control flow; refused")
        for output in node.output:
            elements = _static_elements(shapes.get(output))
            if elements is None and node.op_type in VALUE_SIZED:
                raise SnapcompileError(f"{path}: the size of node {node.name!r} ({node.op_type}) output {output!r} "
                                       "cannot be known at load; refused")
            if elements is not None and elements > limit:
                raise SnapcompileError(
                    f"{path}: node {node.name!r} ({node.op_type}) would allocate {elements:,} elements for "
                    f"{output!r}, more than this artifact's shapes allow ({limit:,}); refused")


def _static_elements(shape) -> int | None:
    """The element count of a fully static inferred shape, else None."""
    if shape is None or not all(dim.HasField("dim_value") for dim in shape.dim):
        return None
    return math.prod(dim.dim_value for dim in shape.dim)
