"""Pass (every graph, last): the KV cache crosses a graph's boundary in float16 (`--kv-dtype float16`).

Every input and output that carries cache rows (KV_TENSOR: a slot's rows, a prompt's rows, a
chunk's or a step's new rows, the rows a selection keeps) is declared float16; inside, the graph
computes in float32 as before. So the only change to the numbers is that each cached key and value
is rounded to float16 once, where it is stored, and the caches the runtime allocates (slots and a
prompt's rows while it is prefilled) take half the bytes.

A Shape node goes on reading the input itself (a family's size is read there:
artifact/static_sizes.py). An input otherwise read only by data-movement nodes (Slice, Gather,
GatherElements: the per-head slices of passes/attention_heads.py, a selection's gather of the
kept rows) is cast after each of them, so
the float32 copy is of the slice, not of the whole cache: at the 8B shape one layer's 131072 prompt
rows are 512 MiB in float32. An output that is such a cast of a float16 tensor is written from the
float16 tensor itself, with no round trip.
"""
from __future__ import annotations

import re

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from snapcompile.graphs.editor import GraphEditor, finalize

KV_TENSOR = re.compile(r"(past_|selected_)?(key|value)\.\d+")
DATA_MOVEMENT = ("Slice", "Gather", "GatherElements")   # float16 in, the same values out
FLOAT = onnx.TensorProto.FLOAT


def store_kv_in_float16(model: onnx.ModelProto, name: str) -> onnx.ModelProto:
    """Graph `name` with its cache inputs and outputs in float16 (module docstring)."""
    graph = gs.import_onnx(model)
    edit = GraphEditor(graph, "kv_float16")
    for tensor in [t for t in graph.inputs if KV_TENSOR.fullmatch(t.name) and t.dtype == np.float32]:
        _read_as_float32(edit, tensor)
    for tensor in [t for t in graph.outputs if KV_TENSOR.fullmatch(t.name) and t.dtype == np.float32]:
        _write_as_float16(edit, tensor)
    return finalize(graph, name)


def _read_as_float32(edit: GraphEditor, tensor: gs.Variable) -> None:
    """Declare input `tensor` float16 and cast what its readers see back to float32."""
    tensor.dtype = np.float16
    readers = [node for node in tensor.outputs if node.op != "Shape"]     # a Shape reads either as well
    if readers and all(node.op in DATA_MOVEMENT and node.inputs[0] is tensor and
                       all(other is not tensor for other in node.inputs[1:]) for node in readers):
        for node in readers:
            wide = node.outputs[0]
            node.outputs[0] = gs.Variable(edit.fresh("half"), dtype=np.float16)
            edit.node("Cast", [node.outputs[0]], [wide], to=FLOAT)
        return
    wide = edit.op("Cast", tensor, to=FLOAT, dtype=np.float32, shape=tensor.shape)
    for node in readers:
        _replace_input(node, tensor, wide)


def _write_as_float16(edit: GraphEditor, tensor: gs.Variable) -> None:
    """Declare output `tensor` float16, written by a cast of what its producer made."""
    producer = tensor.inputs[0]
    wide = gs.Variable(edit.fresh("wide"), dtype=np.float32, shape=tensor.shape)
    producer.outputs[producer.outputs.index(tensor)] = wide
    for node in list(tensor.outputs):           # a reader inside the graph reads the float32 value
        _replace_input(node, tensor, wide)
    tensor.dtype = np.float16
    source = producer.inputs[0] if producer.op == "Cast" else None
    if source is not None and source.dtype == np.float16 and producer.attrs.get("to") == FLOAT:
        edit.node("Identity", [source], [tensor])           # the float16 values themselves
    else:
        edit.node("Cast", [wide], [tensor], to=onnx.TensorProto.FLOAT16)


def _replace_input(node: gs.Node, old: gs.Variable, new: gs.Variable) -> None:
    for i, tensor in enumerate(node.inputs):
        if tensor is old:
            node.inputs[i] = new
