"""Pass (every graph, last): the KV cache crosses a graph's boundary in 16 or 8 bits (`--kv-dtype`).

Every input and output that carries cache rows (KV_TENSOR: a slot's rows, a prompt's rows, a
chunk's or a step's new rows, the rows a selection keeps) is declared in the stored form; inside,
the graph computes in float32 as before. So the only change to the numbers is that each cached key
and value is rounded once, where it is stored, and the caches the runtime allocates (slots and a
prompt's rows while it is prefilled) take fewer bytes. Two stored forms (`StoredForm`):

- float16: each element cast;
- int8: each head's row of D elements as D + 2 int8 bytes, D values and the row's own scale
  (snapcompile/kv_int8.py holds the format and the same arithmetic in numpy).

A Shape node goes on reading the input itself (a family's size is read there:
artifact/static_sizes.py; it reads the rows, never the row's width). An input otherwise read only
by data-movement nodes (Slice, Gather, GatherElements along any axis but the last: the per-head
slices of passes/attention_heads.py, a selection's gather of the kept rows) is decoded after each of
them, so the float32 copy is of the slice, not of the whole cache: at the 8B shape one layer's
131072 prompt rows are 512 MiB in float32. An output that is such a decoding of a stored tensor is
written from the stored tensor itself, with no round trip.
"""
from __future__ import annotations

import math
import re

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from snapcompile import kv_int8
from snapcompile.graphs.editor import GraphEditor, finalize

KV_TENSOR = re.compile(r"(past_|selected_)?(key|value)\.\d+")
DATA_MOVEMENT = ("Slice", "Gather", "GatherElements")   # stored form in, the same values out
FLOAT = onnx.TensorProto.FLOAT


class StoredForm:
    """How cache rows are stored: `dtype`, `extra` elements a row (after its D values), and the
    nodes that decode a stored tensor to float32 and encode a float32 one."""

    dtype: type = np.float16
    extra = 0

    def __init__(self, edit: GraphEditor):
        self.edit = edit

    def decode(self, stored: gs.Variable, wide: gs.Variable) -> None:
        self.edit.node("Cast", [stored], [wide], to=FLOAT)

    def encode(self, wide: gs.Variable, stored: gs.Variable) -> None:
        self.edit.node("Cast", [wide], [stored], to=onnx.TensorProto.FLOAT16)

    def stored_shape(self, shape):
        if shape is None or not self.extra:
            return shape
        return [*shape[:-1], shape[-1] + self.extra]


class Int8Rows(StoredForm):
    """kv_int8's format: q [..., D], then e and m (the row's scale 2**e * (384 + m) / 256)."""

    dtype = np.int8
    extra = kv_int8.SCALE_BYTES

    def decode(self, stored: gs.Variable, wide: gs.Variable) -> None:
        e, m = (self._column(stored, i) for i in (-2, -1))
        q = self.edit.op("Cast", self._slice(stored, 0, -kv_int8.SCALE_BYTES), to=FLOAT)
        self.edit.node("Mul", [q, self._scale(e, m)], [wide])

    def encode(self, wide: gs.Variable, stored: gs.Variable) -> None:
        op, f32 = self.edit.op, self._f32
        amax = op("ReduceMax", op("Abs", wide), self.edit.const([-1]), keepdims=1)
        needed = op("Div", op("Max", amax, f32(kv_int8.TINY)), f32(kv_int8.LIMIT))
        e = op("Floor", op("Div", op("Log", needed), f32(math.log(2))))
        ratio = op("Div", needed, op("Pow", f32(2.0), e))
        e = op("Sub", op("Add", e, op("Cast", op("GreaterOrEqual", ratio, f32(2.0)), to=FLOAT)),
               op("Cast", op("Less", ratio, f32(1.0)), to=FLOAT))       # log's last bit, either way
        m = op("Clip", op("Sub", op("Ceil", op("Mul", op("Div", needed, op("Pow", f32(2.0), e)), f32(256.0))),
                          f32(kv_int8.MANTISSA_BIAS)), f32(-128.0), f32(127.0))
        q = op("Clip", op("Round", op("Div", wide, self._scale(e, m))), f32(-kv_int8.LIMIT), f32(kv_int8.LIMIT))
        self.edit.node("Cast", [op("Concat", q, e, m, axis=-1)], [stored], to=onnx.TensorProto.INT8)

    def widen_indices(self, node: gs.Node) -> None:
        """A GatherElements' indices [..., D] (equal along the last axis) widened to the stored row."""
        indices = node.inputs[1]
        node.inputs[1] = self.edit.op("Concat", indices, self._slice(indices, 0, self.extra), axis=-1)

    def _scale(self, e: gs.Variable, m: gs.Variable) -> gs.Variable:
        op, f32 = self.edit.op, self._f32
        return op("Mul", op("Pow", f32(2.0), e), op("Div", op("Add", m, f32(kv_int8.MANTISSA_BIAS)), f32(256.0)))

    def _column(self, stored: gs.Variable, i: int) -> gs.Variable:
        return self.edit.op("Cast", self._slice(stored, i, i + 1 if i != -1 else 2 ** 62), to=FLOAT)

    def _slice(self, tensor: gs.Variable, start: int, end: int) -> gs.Variable:
        return self.edit.op("Slice", tensor, self.edit.const([start]), self.edit.const([end]), self.edit.const([-1]))

    def _f32(self, value: float) -> gs.Constant:
        return self.edit.const(value, np.float32)


FORMS = {"float16": StoredForm, "int8": Int8Rows}


def store_kv_as(model: onnx.ModelProto, name: str, kv_dtype: str) -> onnx.ModelProto:
    """Graph `name` with its cache inputs and outputs in `kv_dtype` (module docstring)."""
    graph = gs.import_onnx(model)
    edit = GraphEditor(graph, f"kv_{kv_dtype}")
    form, decoded = FORMS[kv_dtype](edit), {}
    for tensor in [t for t in graph.inputs if KV_TENSOR.fullmatch(t.name) and t.dtype == np.float32]:
        _read_as_float32(form, tensor, decoded)
    for tensor in [t for t in graph.outputs if KV_TENSOR.fullmatch(t.name) and t.dtype == np.float32]:
        _write_stored(form, tensor, decoded)
    return finalize(graph, name)


def _read_as_float32(form: StoredForm, tensor: gs.Variable, decoded: dict) -> None:
    """Declare input `tensor` stored and decode what its readers see back to float32 (`decoded`:
    each decoded tensor's name -> the stored one it was read from)."""
    wide_shape, edit = tensor.shape, form.edit
    tensor.dtype, tensor.shape = form.dtype, form.stored_shape(tensor.shape)
    readers = [node for node in tensor.outputs if node.op != "Shape"]     # a Shape reads either as well
    if readers and all(_moves_rows(node, tensor) for node in readers):
        for node in readers:
            wide = node.outputs[0]
            node.outputs[0] = gs.Variable(edit.fresh("stored"), dtype=form.dtype, shape=form.stored_shape(wide.shape))
            if node.op == "GatherElements" and form.extra:
                form.widen_indices(node)
            form.decode(node.outputs[0], wide)
            decoded[wide.name] = node.outputs[0]
        return
    wide = gs.Variable(edit.fresh("wide"), dtype=np.float32, shape=wide_shape)
    form.decode(tensor, wide)
    for node in readers:
        _replace_input(node, tensor, wide)


def _moves_rows(node: gs.Node, tensor: gs.Variable) -> bool:
    """`node` only moves whole rows of `tensor`: a data-movement node reading it as its data, along
    an axis other than the last (a Slice's axes are constants: passes/attention_heads.py)."""
    if node.op not in DATA_MOVEMENT or node.inputs[0] is not tensor or any(t is tensor for t in node.inputs[1:]):
        return False
    if node.op == "Slice":
        axes = node.inputs[3] if len(node.inputs) > 3 else None
        return isinstance(axes, gs.Constant) and all(a not in (-1, len(tensor.shape or ()) - 1)
                                                      for a in np.ravel(axes.values))
    return node.attrs.get("axis", 0) not in (-1, len(tensor.shape or ()) - 1)


def _write_stored(form: StoredForm, tensor: gs.Variable, decoded: dict) -> None:
    """Declare output `tensor` stored, written from the stored tensor its producer decoded, or
    encoded from what its producer made."""
    producer, edit = tensor.inputs[0], form.edit
    wide = gs.Variable(edit.fresh("wide"), dtype=np.float32, shape=tensor.shape)
    producer.outputs[producer.outputs.index(tensor)] = wide
    for node in list(tensor.outputs):           # a reader inside the graph reads the float32 value
        _replace_input(node, tensor, wide)
    tensor.dtype, tensor.shape = form.dtype, form.stored_shape(tensor.shape)
    source = decoded.get(tensor.name)       # the output is a decoding written by _read_as_float32
    if source is not None:
        edit.node("Identity", [source], [tensor])           # the stored values themselves
    else:
        form.encode(wide, tensor)


def _replace_input(node: gs.Node, old: gs.Variable, new: gs.Variable) -> None:
    for i, tensor in enumerate(node.inputs):
        if tensor is old:
            node.inputs[i] = new
