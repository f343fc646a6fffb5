"""Rewriting an imported graph in place (onnx-graphsurgeon), with the closing checks every pass ends with.

`GraphEditor` offers the `op` / `const` interface of `GraphBuilder`, so subgraph writers such as
`attention.additive_mask` serve both the exporter and the passes. Names are counted per editor:
the same rewrite of the same graph names its nodes the same way in every process.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from snapcompile.graphs.builder import IR_VERSION, MICROSOFT, OPSET
from snapcompile.graphs.checks import check_graph


class GraphEditor:
    """Adds nodes to `graph`. Names are "<prefix>.<hint>_<n>": never an exporter name ("<hint>_<n>")."""

    def __init__(self, graph: gs.Graph, prefix: str):
        self.graph, self.prefix = graph, prefix
        self._counter = 0

    def fresh(self, hint: str) -> str:
        self._counter += 1
        return f"{self.prefix}.{hint}_{self._counter}"

    def input(self, name: str) -> gs.Variable:
        """A graph input of the documented artifact contract (see snapcompile.export.llama_graph)."""
        for tensor in self.graph.inputs:
            if tensor.name == name:
                return tensor
        raise ValueError(f"graph {self.graph.name!r} has no input {name!r}")

    def chunk(self) -> int:
        """C, the tokens a prefill graph runs on: input_ids [1, C] (the whole model's), or hidden
        [1, C, hidden] (one layer's, the layer-by-layer prefill)."""
        names = {tensor.name for tensor in self.graph.inputs}
        return self.input("hidden" if "hidden" in names else "input_ids").shape[1]

    def const(self, value, dtype=np.int64) -> gs.Constant:
        return gs.Constant(self.fresh("const"), np.asarray(value, dtype=dtype))

    def op(self, op_type: str, *inputs, dtype=None, shape=None, **attrs) -> gs.Variable:
        """Append a node of one output; returns that output (give dtype and shape where the
        output becomes a graph output or must be known before shape inference)."""
        out = gs.Variable(self.fresh(op_type.lower()), dtype=dtype, shape=shape)
        self.node(op_type, list(inputs), [out], **attrs)
        return out

    def node(self, op_type: str, inputs: list, outputs: list, domain: str | None = None, **attrs) -> gs.Node:
        """Append a node writing existing `outputs` (a replacement takes over a subgraph's result)."""
        node = gs.Node(op_type, self.fresh(op_type), attrs=attrs, inputs=inputs, outputs=outputs, domain=domain)
        self.graph.nodes.append(node)
        return node


def finalize(graph: gs.Graph, name: str, custom_domains: tuple[str, ...] = ()) -> onnx.ModelProto:
    """cleanup, toposort, export, and `check_graph` (every pass ends here). A graph with
    custom-domain nodes (`custom_domains`, and ONNX Runtime's own: the MatMulNBits of the graphs it
    opens) is checked without strict shape inference, which cannot know their output shapes; its
    outputs must still declare static shapes, but for the symbolic size its inputs declare."""
    graph.cleanup(remove_unused_graph_inputs=False).toposort()
    model = gs.export_onnx(graph, do_type_check=True)
    model.ir_version = IR_VERSION
    domains = tuple(dict.fromkeys([*custom_domains, *(n.domain for n in model.graph.node if n.domain == MICROSOFT)]))
    del model.opset_import[:]
    model.opset_import.append(onnx.helper.make_opsetid("", OPSET))
    for domain in domains:
        model.opset_import.append(onnx.helper.make_opsetid(domain, 1))
    model.graph.ClearField("value_info")
    check_graph(model, name, strict=not domains, symbolic=input_dim_params(model))
    return model


def input_dim_params(model: onnx.ModelProto) -> tuple[str, ...]:
    """The symbolic dimensions a graph's inputs declare (a family's size)."""
    return tuple(sorted({d.dim_param for value in model.graph.input for d in value.type.tensor_type.shape.dim
                         if d.dim_param}))
