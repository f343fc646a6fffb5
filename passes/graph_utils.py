"""Shared helpers for passes: graph input lookup, constants, and the closing checks."""
from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from snapcompile.export.onnx_builder import IR_VERSION, OPSET

_counter = iter(range(1, 1 << 62))


def fresh(prefix: str) -> str:
    """A name no exporter-generated tensor uses (those are "<op>_<n>")."""
    return f"pass.{prefix}.{next(_counter)}"


def graph_input(graph: gs.Graph, name: str) -> gs.Variable:
    """A graph input of the documented artifact contract (see snapcompile.export.llama_graph)."""
    for tensor in graph.inputs:
        if tensor.name == name:
            return tensor
    raise ValueError(f"graph {graph.name!r} has no input {name!r}")


def constant(values, dtype=np.int64) -> gs.Constant:
    return gs.Constant(fresh("const"), np.asarray(values, dtype=dtype))


def add_node(graph: gs.Graph, op: str, inputs: list, attrs: dict | None = None,
             dtype=None, shape=None) -> gs.Variable:
    out = gs.Variable(fresh(op.lower()), dtype=dtype, shape=shape)
    graph.nodes.append(gs.Node(op, fresh(op), attrs=attrs or {}, inputs=inputs, outputs=[out]))
    return out


def finalize(graph: gs.Graph, name: str, custom_domains: tuple[str, ...] = ()) -> onnx.ModelProto:
    """cleanup, toposort, export, onnx.checker and shape inference (every pass ends here).

    A graph whose weights live in an external file is checked by the checker once saved beside
    that file (snapcompile.artifact.save_graphs). Shape inference is strict unless the graph has
    custom-domain ops, whose shapes it cannot know.
    """
    graph.cleanup(remove_unused_graph_inputs=False).toposort()
    model = gs.export_onnx(graph, do_type_check=True)
    model.ir_version = IR_VERSION
    del model.opset_import[:]
    model.opset_import.append(onnx.helper.make_opsetid("", OPSET))
    for domain in custom_domains:
        model.opset_import.append(onnx.helper.make_opsetid(domain, 1))
    model.graph.ClearField("value_info")
    if not any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer):
        onnx.checker.check_model(model)
    onnx.shape_inference.infer_shapes(model, strict_mode=not custom_domains)
    return model
