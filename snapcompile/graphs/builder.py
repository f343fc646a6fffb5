"""A small helper for writing ONNX graphs op by op (names are generated, never matched on)."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 21       # blocked DequantizeLinear (quantized weights) needs 21
IR_VERSION = 10  # INT4 initializers need IR 10
NP_TO_ONNX = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16,
              np.dtype(np.int64): TensorProto.INT64, np.dtype(np.bool_): TensorProto.BOOL}


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

    def tensor(self, name: str, make) -> str:
        """Add initializer `name`; make() builds its TensorProto, called only when the store has
        not written that name yet (each weight is serialized once per export, not once per graph)."""
        if self.store is None:
            self.initializers.append(make())
        else:
            self.initializers.append(self.store.reference(name) or self.store.add(make()))
        return name

    def input(self, name: str, dtype, shape) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, NP_TO_ONNX[np.dtype(dtype)], shape))
        return name

    def output(self, tensor: str, name: str, dtype, shape) -> str:
        self.nodes.append(helper.make_node("Identity", [tensor], [name], name=self.fresh("Output")))
        self.outputs.append(helper.make_tensor_value_info(name, NP_TO_ONNX[np.dtype(dtype)], shape))
        return name

    def model(self, metadata: dict[str, str] | None = None) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, self.initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                                  producer_name="snapcompile")
        model.ir_version = IR_VERSION
        if metadata:
            helper.set_model_props(model, metadata)
        return model
