"""A small helper for writing ONNX graphs op by op (names are generated, never matched on), and the
sizes a graph may leave symbolic."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 21       # blocked DequantizeLinear (quantized weights) needs 21
MICROSOFT = "com.microsoft"     # ONNX Runtime's contrib operators (MatMulNBits in the graphs it opens)
IR_VERSION = 10  # INT4 initializers need IR 10
NP_TO_ONNX = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16,
              np.dtype(np.int64): TensorProto.INT64, np.dtype(np.bool_): TensorProto.BOOL}


@dataclass(frozen=True)
class SymbolicSize:
    """A dimension a graph leaves symbolic, so that one graph serves every member of a family of static
    graphs that differ in that size only (ONNX Runtime runs it at any of them; TensorRT and dataflow
    consumers take the static members).

    name: its dim_param on every graph input and output it sizes ("rows", "slots"). The graph reads its
    value from dimension `axis` of input `source` with one Shape node whose output is named
    `size_output(name)` (the form `artifact/static_sizes.py` recognises when it bounds the graph at each
    member's size). largest: the largest size the graph is run at; a constant that follows the size
    (arange) is sliced from one of that length, so no operator sizes its output from a value."""

    name: str
    source: str
    axis: int
    largest: int


Size = int | SymbolicSize


def size_output(name: str) -> str:
    """The tensor holding a symbolic size's value (int64 [1])."""
    return f"size.{name}"


def dim(size: Size) -> int | str:
    """A shape entry: the number, or the symbolic size's dim_param."""
    return size.name if isinstance(size, SymbolicSize) else size


def reshape_dims(dims) -> list[int]:
    """A Reshape target whose one symbolic entry (a SymbolicSize or a dim_param) becomes -1."""
    out = [-1 if isinstance(d, (SymbolicSize, str)) else d for d in dims]
    if out.count(-1) > 1:
        raise ValueError(f"a reshape target with more than one unknown dimension: {dims}")
    return out


class GraphBuilder:
    """Accumulates nodes, constants, inputs and outputs; `op` returns output tensor names."""

    def __init__(self, name: str, store=None):
        """store: a WeightsFile that weights go to as they are added (the graph then holds
        references only); None keeps them in the graph."""
        self.name, self.store = name, store
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self._counter = 0
        self._const_cache: dict[tuple, str] = {}
        self._sizes: set[str] = set()

    def fresh(self, hint: str) -> str:
        self._counter += 1
        return f"{hint}_{self._counter}"

    def op(self, op_type: str, *inputs: str, outputs: int = 1, name: str | None = None,
           domain: str = "", **attrs):
        """Add a node; returns its output name (or a list when outputs > 1)."""
        out_names = [self.fresh(op_type.lower()) for _ in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), out_names,
                                           name=name or self.fresh(op_type), domain=domain, **attrs))
        return out_names[0] if outputs == 1 else out_names

    def const(self, value, dtype=np.int64) -> str:
        """A small constant tensor (shapes, indices, scalars), deduplicated."""
        array = np.asarray(value, dtype=dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self._const_cache:
            name = self.fresh("const")
            self.initializers.append(numpy_helper.from_array(array, name))
            self._const_cache[key] = name
        return self._const_cache[key]

    def shape(self, dims) -> str:
        """A Reshape target (`reshape_dims`): a symbolic entry becomes -1, read from the input."""
        return self.const(reshape_dims(dims))

    def size_vector(self, size: Size) -> str:
        """int64 [1] holding `size`: a constant, or a symbolic size's value read off its input's shape."""
        if not isinstance(size, SymbolicSize):
            return self.const([size])
        name = size_output(size.name)
        if name not in self._sizes:
            self.nodes.append(helper.make_node("Shape", [size.source], [name], name=f"Shape_{name}",
                                               start=size.axis, end=size.axis + 1))
            self._sizes.add(name)
        return name

    def arange(self, size: Size) -> str:
        """int64 [size]: 0, 1, ..., size - 1 (a symbolic size slices a constant of its largest length)."""
        if not isinstance(size, SymbolicSize):
            return self.const(np.arange(size))
        return self.op("Slice", self.const(np.arange(size.largest)), self.const([0]), self.size_vector(size))

    def tensor(self, name: str, make) -> str:
        """Add initializer `name`; make() builds its TensorProto, called only when the store has
        not written that name yet (each weight is serialized once per export, not once per graph)."""
        if self.store is None:
            self.initializers.append(make())
        else:
            self.initializers.append(self.store.reference(name) or self.store.add(make()))
        return name

    def input(self, name: str, dtype, shape) -> str:
        """A graph input; `shape` entries are numbers or SymbolicSizes."""
        shape = [dim(d) for d in shape]
        self.inputs.append(helper.make_tensor_value_info(name, NP_TO_ONNX[np.dtype(dtype)], shape))
        return name

    def output(self, tensor: str, name: str, dtype, shape) -> str:
        self.nodes.append(helper.make_node("Identity", [tensor], [name], name=self.fresh("Output")))
        shape = [dim(d) for d in shape]
        self.outputs.append(helper.make_tensor_value_info(name, NP_TO_ONNX[np.dtype(dtype)], shape))
        return name

    def model(self, metadata: dict[str, str] | None = None, used_only: bool = False) -> onnx.ModelProto:
        """The graph as a model; used_only: without the initializers no node reads."""
        initializers = self.initializers
        if used_only:
            read = {name for node in self.nodes for name in node.input}
            initializers = [tensor for tensor in initializers if tensor.name in read]
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, initializers)
        domains = [helper.make_opsetid(MICROSOFT, 1)] if any(n.domain == MICROSOFT for n in self.nodes) else []
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), *domains],
                                  producer_name="snapcompile")
        model.ir_version = IR_VERSION
        if metadata:
            helper.set_model_props(model, metadata)
        return model
