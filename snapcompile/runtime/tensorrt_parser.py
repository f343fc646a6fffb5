"""A static check that a graph stays within what TensorRT 10's ONNX parser imports.

It stands in for the TensorRT build where TensorRT cannot be installed (CI), and runs first in
`snapcompile build`. The table is the operator support matrix of onnx-tensorrt's
docs/operators.md for TensorRT 10.15 (opsets 9 to 24), restricted to the operators that are
supported there; the types are the ones listed for each operator, checked on the node's inputs
(outputs follow from them). Quantized types (INT8, INT4) are legal only as the input of a
DequantizeLinear, UINT8 only as a graph input or output. The plugin lowering's custom nodes are
legal when they are the ops of plugins.contracts (served by the snapcompile TensorRT plugin).
"""
from __future__ import annotations

from collections.abc import Callable

import onnx
from onnx import TensorProto

from snapcompile.plugins.contracts import DECODE_ATTENTION, DOMAIN, SELECT

MATRIX_VERSION = "10.15"
OPSETS = range(9, 25)
TOPK_MAX = 3840          # TensorRT's largest TopK k (ITopKLayer: "maximum of K is 3840")


def topk_fits(k: int) -> bool:
    """Whether TensorRT's TopK takes this k: the one statement of the limit."""
    return k <= TOPK_MAX

_F = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16}
_I = {TensorProto.INT32, TensorProto.INT64}
_B = {TensorProto.BOOL}
_Q = {TensorProto.INT8, TensorProto.INT4, TensorProto.FLOAT8E4M3FN}
# operator -> types its inputs may have (TensorRT 10.15 matrix); only the ops snapcompile's graphs
# use or plausibly could, each as listed there
SUPPORTED: dict[str, set[int]] = {
    **dict.fromkeys(("Add", "Sub", "Mul", "Div", "Max", "Min", "Neg", "Abs", "Pow", "Sum", "Mod",
                     "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "ArgMax", "ArgMin",
                     "ReduceMax", "ReduceMin", "ReduceMean", "ReduceSum", "ReduceProd", "ReduceSumSquare",
                     "ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "Relu", "Sign",
                     "TopK", "ScatterElements", "ScatterND", "Range", "Pad"), _F | _I),
    **dict.fromkeys(("Concat", "Expand", "Flatten", "Gather", "GatherElements", "GatherND", "Identity",
                     "Reshape", "Shape", "Size", "Slice", "Split", "Squeeze", "Unsqueeze", "Tile",
                     "Transpose", "Trilu", "Where", "If", "Loop"), _F | _I | _B),
    **dict.fromkeys(("Cast", "CastLike"), _F | _I | _B | {TensorProto.UINT8}),
    **dict.fromkeys(("MatMul", "Gemm", "Softmax", "LogSoftmax", "Sqrt", "Reciprocal", "Exp", "Log", "Erf",
                     "Sigmoid", "Tanh", "Sin", "Cos", "Floor", "Ceil", "Round", "Clip", "CumSum",
                     "MaxPool", "AveragePool", "LayerNormalization", "RMSNormalization", "Einsum",
                     "Softplus", "HardSigmoid", "LeakyRelu", "Elu", "Selu", "Mish", "Gelu"), set(_F)),
    **dict.fromkeys(("And", "Or", "Xor", "Not"), set(_B)),
    "ConstantOfShape": _F | _I | _B,
    "Constant": _F | _I | _B | {TensorProto.INT4},
    "DequantizeLinear": _Q | _F,
    "QuantizeLinear": set(_F),
    "IsNaN": _F | _I,
    "IsInf": set(_F),
}
PLUGIN_OPS = {DECODE_ATTENTION.name, SELECT.name}
_AXES_INPUT = {"ReduceMax": 1, "ReduceMin": 1, "ReduceMean": 1, "ReduceSum": 1, "ReduceProd": 1,
               "ReduceSumSquare": 1, "ReduceL1": 1, "ReduceL2": 1, "ReduceLogSum": 1, "ReduceLogSumExp": 1,
               "Squeeze": 1, "Unsqueeze": 1, "CumSum": 1, "TopK": 1}


class Violation(Exception):
    """A node TensorRT's ONNX parser would reject (the message names it)."""


def parser_problems(model: onnx.ModelProto, graph_name: str) -> list[str]:
    """Every way `model` (weights need not be loaded) leaves TensorRT 10's parser support, one
    line each naming the node; empty when it fits."""
    problems = []
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if opset not in OPSETS:
        problems.append(f"{graph_name}: opset {opset} is outside TensorRT {MATRIX_VERSION}'s "
                        f"{OPSETS.start}-{OPSETS.stop - 1}")
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    types = _tensor_types(inferred)
    constants = {t.name: t for t in model.graph.initializer}
    io_names = {v.name for v in (*model.graph.input, *model.graph.output)}
    for node in model.graph.node:
        where = f"{graph_name}: node {node.name!r} ({node.op_type})"
        try:
            _check_node(node, types, constants, io_names)
        except Violation as violation:
            problems.append(f"{where}: {violation}")
    return problems


def _tensor_types(model: onnx.ModelProto) -> dict[str, int]:
    values = (*model.graph.input, *model.graph.output, *model.graph.value_info)
    types = {v.name: v.type.tensor_type.elem_type for v in values if v.type.HasField("tensor_type")}
    types.update({t.name: t.data_type for t in model.graph.initializer})
    return types


def _check_node(node, types: dict[str, int], constants: dict, io_names: set[str]) -> None:
    if node.domain == DOMAIN:
        if node.op_type not in PLUGIN_OPS:
            raise Violation(f"custom op {node.op_type} is not one of the snapcompile plugin's "
                            f"({', '.join(sorted(PLUGIN_OPS))})")
        return
    if node.domain not in ("", "ai.onnx"):
        raise Violation(f"operator domain {node.domain!r} is not ONNX's (TensorRT imports no contrib ops)")
    allowed = SUPPORTED.get(node.op_type)
    if allowed is None:
        raise Violation(f"{node.op_type} is not supported by TensorRT {MATRIX_VERSION}'s ONNX parser")
    for name in filter(None, node.input):
        kind = types.get(name)
        if kind is None:
            continue
        if kind in _Q and node.op_type != "DequantizeLinear":
            raise Violation(f"input {name!r} is {_type_name(kind)}, which TensorRT only takes into DequantizeLinear")
        if kind == TensorProto.UINT8 and name not in io_names:
            raise Violation(f"input {name!r} is UINT8, which TensorRT takes only as a graph input or output")
        if kind not in allowed and not (kind == TensorProto.UINT8 and name in io_names):
            raise Violation(f"input {name!r} is {_type_name(kind)}; TensorRT's {node.op_type} takes "
                            f"{', '.join(sorted(_type_name(t) for t in allowed))}")
    RESTRICTIONS.get(node.op_type, _no_restriction)(node, constants)
    if node.op_type in _AXES_INPUT and len(node.input) > _AXES_INPUT[node.op_type]:
        source = node.input[_AXES_INPUT[node.op_type]]
        if source and source not in constants:
            raise Violation(f"input {source!r} must be an initializer")


def _no_restriction(node, constants) -> None:
    return None


def _dequantize(node, constants) -> None:
    if node.input[0] not in constants:
        raise Violation("its quantized input must be an initializer (weight-only quantization)")
    if len(node.input) > 2 and node.input[2]:
        zero = constants.get(node.input[2])
        if zero is None or onnx.numpy_helper.to_array(zero).any():
            raise Violation("x_zero_point must be zero")


def _topk(node, constants) -> None:
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    if attrs.get("sorted", 1) != 1:
        raise Violation("sorted must be 1")
    k = constants.get(node.input[1])
    if k is not None and not topk_fits(int(onnx.numpy_helper.to_array(k).reshape(-1)[0])):
        raise Violation(f"K must be at most {TOPK_MAX} (use the plugin lowering for larger budgets)")


def _scatter_nd(node, constants) -> None:
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    if attrs.get("reduction", b"none") not in (b"none", "none"):
        raise Violation("reduction other than none is not supported")


def _pool(node, constants) -> None:
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    if len(attrs.get("kernel_shape", [])) not in (2, 3):
        raise Violation("2D or 3D pooling only")
    if any(d != 1 for d in attrs.get("dilations", [])):
        raise Violation("dilations must be empty or all ones")


def _cast(node, constants) -> None:
    target = next((a.i for a in node.attribute if a.name == "to"), None)
    if target not in SUPPORTED["Cast"]:
        raise Violation(f"cast to {_type_name(target)} is not supported")


RESTRICTIONS: dict[str, Callable] = {"DequantizeLinear": _dequantize, "TopK": _topk, "ScatterND": _scatter_nd,
                                     "Cast": _cast, "MaxPool": _pool, "AveragePool": _pool}


def _type_name(kind: int | None) -> str:
    return TensorProto.DataType.Name(kind) if kind is not None else "unknown"


def artifact_parser_problems(graphs: dict[str, onnx.ModelProto]) -> list[str]:
    """parser_problems over an artifact's graphs, every problem of every graph."""
    return [line for name, model in sorted(graphs.items()) for line in parser_problems(model, name)]
