"""Every tensor a graph can allocate, bounded at load by the artifact's own declared shapes.

A graph is a file: edited and resealed, it can hold a ConstantOfShape, Expand or Tile whose static
shape asks for terabytes, and ONNX Runtime would try the allocation on every step. ONNX shape
inference (with constant propagation) gives every node's output shape without running anything;
each static one must stay within `max_elements(manifest)`, a generous multiple of the largest tensor
the declared shapes allow. An operator whose output size is set by a value (VALUE_SIZED) must have a
static inferred shape, and control flow (If, Loop, Scan) is refused: snapcompile's graphs hold none.

A graph ONNX Runtime opens for a whole family (its size symbolic: naming.FAMILY_SIZES) is checked at
each member's size: the one Shape node that reads the size (graphs/builder.SymbolicSize) is replaced
by that size as a constant, so shape inference sees exactly what the member's run computes. Its
MatMulNBits nodes (ONNX Runtime's, which ONNX shape inference does not know) are bounded as the
MatMul of their declared [K, N] weight, once that weight's declared shape is checked to be [K, N]'s.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper, shape_inference

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
        inferred = shape_inference.infer_shapes(_standard_products(model, path), data_prop=True)
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


def check_family_sizes(model: onnx.ModelProto, path: Path, manifest: Manifest, size: dict,
                       sizes: list[int]) -> None:
    """check_static_sizes of a family's graph at each member's size. size: {"name", "source", "axis"}
    (the manifest's record of the symbolic size; the graph must read it with exactly one
    Shape(source, start=axis, end=axis + 1) node writing `size.<name>`)."""
    output = f"size.{size['name']}"
    readers = [node for node in model.graph.node if output in node.output]
    if len(readers) > 1 or readers and not _reads_shape(readers[0], size):
        raise SnapcompileError(f"{path}: {output} must be read by one Shape node of {size['source']} "
                               f"(axis {size['axis']}); refused")
    for value in sizes:
        check_static_sizes(_at_size(model, size["name"], value, readers[0] if readers else None), path, manifest)


def _reads_shape(node: onnx.NodeProto, size: dict) -> bool:
    """Whether `node` is Shape(source, start=axis, end=axis + 1) of the recorded size."""
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    return node.op_type == "Shape" and node.domain in ("", "ai.onnx") and list(node.input) == [size["source"]] \
        and attributes == {"start": size["axis"], "end": size["axis"] + 1}


def _at_size(model: onnx.ModelProto, name: str, value: int, reader: onnx.NodeProto | None) -> onnx.ModelProto:
    """A copy of `model` with dim_param `name` fixed at `value` and its reader (if any: a graph whose
    constants do not follow the size has none) replaced by [value]."""
    fixed = onnx.ModelProto.FromString(model.SerializeToString())
    graph = fixed.graph
    for tensor in (*graph.input, *graph.output):
        for dimension in tensor.type.tensor_type.shape.dim:
            if dimension.dim_param == name:
                dimension.dim_value = value
    if reader is not None:
        kept = [node for node in graph.node if list(node.output) != list(reader.output)]
        del graph.node[:]
        graph.node.extend(kept)
        graph.initializer.append(numpy_helper.from_array(np.array([value], np.int64), reader.output[0]))
    return fixed


def _standard_products(model: onnx.ModelProto, path: Path) -> onnx.ModelProto:
    """`model` with each MatMulNBits (com.microsoft) replaced by a MatMul of a declared [K, N] float
    weight (its output's shape, for shape inference only); any other non-standard operator is refused
    unless it is a custom op of the plugin lowering (ai.onnx.contrib, run through onnxruntime-extensions)."""
    nodes = [node for node in model.graph.node if node.domain not in ("", "ai.onnx")]
    if not any(node.domain == "com.microsoft" for node in nodes):
        return model
    standard = onnx.ModelProto.FromString(model.SerializeToString())
    declared = {tensor.name: list(tensor.dims) for tensor in standard.graph.initializer}
    for node in standard.graph.node:
        if node.domain != "com.microsoft":
            continue
        if node.op_type != "MatMulNBits":
            raise SnapcompileError(f"{path}: node {node.name!r} is a {node.domain} {node.op_type}; refused")
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        k, n, bits, block = (attrs.get(key) for key in ("K", "N", "bits", "block_size"))
        if not all(isinstance(v, int) and v > 0 for v in (k, n, bits, block)) or bits not in (4, 8) or \
                declared.get(node.input[1]) != [n, -(-k // block), block * bits // 8]:
            raise SnapcompileError(f"{path}: MatMulNBits node {node.name!r}'s weight is not of its K x N; refused")
        stand_in = TensorProto(name=f"{node.input[1]}.standin", data_type=TensorProto.FLOAT, dims=[k, n])
        standard.graph.initializer.append(stand_in)
        node.CopyFrom(helper.make_node("MatMul", [node.input[0], stand_in.name], list(node.output), name=node.name))
    return standard
