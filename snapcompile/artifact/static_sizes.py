"""Every tensor a graph can allocate, bounded at load by the artifact's own declared shapes.

A graph is a file: edited and resealed, it can ask for terabytes, and ONNX Runtime would try the
allocation on every step. ONNX shape inference (with constant propagation) gives every node's output
shape without running anything. The rule holds for every node, whatever its operator: each output's
inferred shape must be static and within `max_elements(manifest)`, a generous multiple of the largest
tensor the declared shapes allow; an output whose size inference cannot know at load (set by a value
computed while running, or by an operator inference does not know) is refused, naming the node.
Shapes the file declares for intermediate values (value_info) and its outputs' shapes are not believed:
they are cleared before inference, and each output's inferred shape must equal its declared one.
Control flow (If, Loop, Scan) is refused: snapcompile's graphs hold none.

A graph ONNX Runtime opens for a whole family (its size symbolic: naming.FAMILY_SIZES) is checked at
each member's size: the one Shape node that reads the size (graphs/builder.SymbolicSize) is replaced
by that size as a constant, so shape inference sees exactly what the member's run computes. Its
MatMulNBits nodes (ONNX Runtime's, which ONNX shape inference does not know) are bounded as the
MatMul of their declared [K, N] weight, once that weight's declared shape is checked to be [K, N]'s;
the plugin lowering's custom ops (plugins/contracts.py) get the shapes their contracts compute from
their inputs and attributes.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper, shape_inference

from snapcompile.artifact.manifest import Manifest
from snapcompile.errors import SnapcompileError, first_line
from snapcompile.plugins.contracts import DECODE_ATTENTION, DOMAIN, SELECT

SLACK = 4
RULES = 2       # raised whenever the checks below change, so that no earlier pass is reused (onnx_io._once)
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
    """Refuse (SnapcompileError naming the node) a graph that could allocate past max_elements, or
    whose sizes cannot all be known at load."""
    limit = max_elements(manifest)
    for node in model.graph.node:
        if node.op_type in CONTROL_FLOW:
            raise SnapcompileError(f"{path}: node {node.name!r} is an {node.op_type}: snapcompile's graphs hold "
                                   "no control flow; refused")
    try:
        inferred = shape_inference.infer_shapes(_for_inference(model, path, manifest), data_prop=True)
    except Exception as err:  # onnx raises InferenceError, ValidationError and plain RuntimeErrors
        raise SnapcompileError(f"{path}: ONNX shape inference fails on this graph: {first_line(err)}") from None
    shapes = {value.name: value.type.tensor_type.shape if value.type.tensor_type.HasField("shape") else None
              for value in list(inferred.graph.value_info) + list(inferred.graph.output)}
    for node in inferred.graph.node:
        for output in filter(None, node.output):     # "": an optional output left out, nothing allocated
            elements = _static_elements(shapes.get(output))
            if elements is None:
                raise SnapcompileError(f"{path}: the size of node {node.name!r} ({node.op_type}) output {output!r} "
                                       "cannot be known at load; refused")
            if elements > limit:
                raise SnapcompileError(
                    f"{path}: node {node.name!r} ({node.op_type}) would allocate {elements:,} elements for "
                    f"{output!r}, more than this artifact's shapes allow ({limit:,}); refused")
    declared = {value.name: _dims(value.type.tensor_type.shape) for value in model.graph.output}
    for value in inferred.graph.output:
        if _dims(value.type.tensor_type.shape) != declared[value.name]:
            raise SnapcompileError(f"{path}: output {value.name!r} is declared {declared[value.name]} but its "
                                   f"nodes compute {_dims(value.type.tensor_type.shape)}; refused")


def _static_elements(shape) -> int | None:
    """The element count of a fully static inferred shape, else None."""
    if shape is None or not all(dim.HasField("dim_value") for dim in shape.dim):
        return None
    return math.prod(dim.dim_value for dim in shape.dim)


def _dims(shape) -> list:
    return [dim.dim_value if dim.HasField("dim_value") else dim.dim_param or None for dim in shape.dim]


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


def _for_inference(model: onnx.ModelProto, path: Path, manifest: Manifest) -> onnx.ModelProto:
    """A copy of `model` for shape inference: no declared value_info, outputs without shapes, and each
    non-standard node replaced by standard ones that compute its output shapes (`_stand_ins`); any
    other non-standard operator is refused."""
    copy = onnx.ModelProto.FromString(model.SerializeToString())
    graph = copy.graph
    del graph.value_info[:]
    for value in graph.output:
        value.type.tensor_type.ClearField("shape")
    declared = {tensor.name: list(tensor.dims) for tensor in graph.initializer}
    nodes = []
    for node in graph.node:
        if node.domain in ("", "ai.onnx"):
            nodes.append(node)
        else:
            nodes.extend(_stand_ins(node, declared, graph, path, manifest))
    del graph.node[:]
    graph.node.extend(nodes)
    return copy


def _stand_ins(node: onnx.NodeProto, declared: dict, graph: onnx.GraphProto, path: Path,
               manifest: Manifest) -> list[onnx.NodeProto]:
    """Standard nodes whose outputs have the shapes `node` (MatMulNBits, or a custom op of the plugin
    lowering) computes, for shape inference only."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if node.domain == "com.microsoft" and node.op_type == "MatMulNBits":
        k, n, bits, block = (attrs.get(key) for key in ("K", "N", "bits", "block_size"))
        if not all(isinstance(v, int) and v > 0 for v in (k, n, bits, block)) or bits not in (4, 8) or \
                len(node.input) < 2 or declared.get(node.input[1]) != [n, -(-k // block), block * bits // 8]:
            raise SnapcompileError(f"{path}: MatMulNBits node {node.name!r}'s weight is not of its K x N; refused")
        stand_in = TensorProto(name=f"{node.input[1]}.standin", data_type=TensorProto.FLOAT, dims=[k, n])
        graph.initializer.append(stand_in)
        return [helper.make_node("MatMul", [node.input[0], stand_in.name], list(node.output), name=node.name)]
    if node.domain == DOMAIN and node.op_type == DECODE_ATTENTION.name and len(node.input) == 7 \
            and len(node.output) == 1 and _finite_scale(attrs):
        return [helper.make_node("Identity", [node.input[0]], list(node.output), name=node.name)]
    if node.domain == DOMAIN and node.op_type == SELECT.name and len(node.input) == 4 and len(node.output) == 3 \
            and _finite_scale(attrs) and _select_attrs(attrs) == _select_attrs(_policy_attrs(manifest)):
        share, (key, value), (k_out, v_out, index_out) = attrs["prompt_share"], node.input[1:3], node.output
        slice_inputs = [f"{node.name}.{part}" for part in ("starts", "ends", "axes")]
        graph.initializer.extend(numpy_helper.from_array(np.array([v], np.int64), name)
                                 for name, v in zip(slice_inputs, (0, share, 2)))
        zero = numpy_helper.from_array(np.array(0, np.int64), f"{node.name}.zero")
        graph.initializer.append(zero)
        return [helper.make_node("Slice", [key, *slice_inputs], [k_out], name=node.name),
                helper.make_node("Slice", [value, *slice_inputs], [v_out], name=f"{node.name}.value"),
                helper.make_node("Gather", [k_out, zero.name], [f"{index_out}.float"], axis=3,
                                 name=f"{node.name}.index"),
                helper.make_node("Cast", [f"{index_out}.float"], [index_out], to=TensorProto.INT64,
                                 name=f"{node.name}.cast")]
    raise SnapcompileError(f"{path}: node {node.name!r} is a {node.domain} {node.op_type} this artifact's "
                           "lowering does not write (or not with its contract's inputs and attributes); refused")


def _finite_scale(attrs: dict) -> bool:
    return isinstance(attrs.get("scale"), float) and math.isfinite(attrs["scale"])


def _select_attrs(attrs: dict) -> dict:
    """The attributes of a SnapKVSelect node that set its sizes and work (bytes decoded)."""
    return {name: attrs.get(name).decode() if isinstance(attrs.get(name), bytes) else attrs.get(name)
            for name in ("sinks", "window", "kernel", "prompt_share", "pooling", "scope")}


def _policy_attrs(manifest: Manifest) -> dict:
    policy = manifest.policy
    return {"sinks": policy.sinks, "window": policy.window, "kernel": policy.kernel,
            "prompt_share": policy.resolved_prompt_share, "pooling": policy.pooling, "scope": policy.scope}
