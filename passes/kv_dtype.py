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

    def fold(self, stored: gs.Variable, readers: list[gs.Node], d: int) -> bool:
        """Rewrite `readers` to read `stored` without a decoded copy: True if done (Int8Rows)."""
        return False

    def decode(self, stored: gs.Variable, wide: gs.Variable, d: int) -> None:
        """Write float32 `wide` [..., d] from `stored`."""
        self.edit.node("Cast", [stored], [wide], to=FLOAT)

    def encode(self, wide: gs.Variable, stored: gs.Variable, d: int) -> None:
        """Write `stored` from float32 `wide` [..., d]."""
        self.edit.node("Cast", [wide], [stored], to=onnx.TensorProto.FLOAT16)

    def stored_shape(self, shape):
        if shape is None or not self.extra:
            return shape
        return [*shape[:-1], shape[-1] + self.extra]


class Int8Rows(StoredForm):
    """kv_int8's format: q [..., D], then e and m (the row's scale 2**(e - 8) * (384 + m)).

    The scale's arithmetic runs on [...] tensors (a row's bytes squeezed off the last axis): ONNX
    Runtime broadcasts a [..., 1] operand one element at a time (0.31 ms against 0.008 for the same
    Mul on [4, 8, 1024]), and only the final products broadcast a row's scale over its D values."""

    dtype = np.int8
    extra = kv_int8.SCALE_BYTES

    def decode(self, stored: gs.Variable, wide: gs.Variable, d: int) -> None:
        op = self.edit.op
        q, e, m = (gs.Variable(self.edit.fresh(name)) for name in ("q", "e", "m"))
        self.edit.node("Split", [stored, self.edit.const([d, 1, 1])], [q, e, m], axis=-1)
        e, m = (op("Cast", op("Squeeze", t, self.edit.const([-1])), to=FLOAT) for t in (e, m))
        self.edit.node("Mul", [op("Cast", q, to=FLOAT), self._unsqueeze(self._scale(e, m))], [wide])

    def encode(self, wide: gs.Variable, stored: gs.Variable, d: int) -> None:
        op, f32 = self.edit.op, self._f32
        amax = op("ReduceMax", op("Abs", wide), self.edit.const([-1]), keepdims=0)
        needed = op("Div", op("Max", amax, f32(kv_int8.TINY)), f32(kv_int8.LIMIT))
        e = op("Floor", op("Div", op("Log", needed), f32(math.log(2))))
        ratio = op("Div", needed, op("Pow", f32(2.0), e))
        e = op("Sub", op("Add", e, op("Cast", op("GreaterOrEqual", ratio, f32(2.0)), to=FLOAT)),
               op("Cast", op("Less", ratio, f32(1.0)), to=FLOAT))       # log's last bit, either way
        step = op("Pow", f32(2.0), op("Sub", e, f32(8.0)))                # 2**(e - 8): m's unit, once
        m = op("Clip", op("Sub", op("Ceil", op("Div", needed, step)), f32(kv_int8.MANTISSA_BIAS)),
               f32(-128.0), f32(127.0))
        scale = op("Mul", step, op("Add", m, f32(kv_int8.MANTISSA_BIAS)))
        q = op("Div", wide, self._unsqueeze(scale))
        q = op("Clip", op("Round", q), f32(-kv_int8.LIMIT), f32(kv_int8.LIMIT))
        self.edit.node("Cast", [op("Concat", q, self._unsqueeze(e), self._unsqueeze(m), axis=-1)], [stored],
                       to=onnx.TensorProto.INT8)

    def widen_indices(self, node: gs.Node) -> None:
        """A GatherElements' indices [..., D] (equal along the last axis) widened to the stored row."""
        indices, edit = node.inputs[1], self.edit
        head = edit.op("Slice", indices, edit.const([0]), edit.const([self.extra]), edit.const([-1]))
        node.inputs[1] = edit.op("Concat", indices, head, axis=-1)

    def fold(self, stored: gs.Variable, readers: list[gs.Node], d: int) -> bool:
        """Read a cache that only feeds attention's two products without decoding it: True if done.

        The decode graphs read a slot's whole cache each step, keys as Transpose -> MatMul(q, K^T)
        and values as MatMul(p, V). Each row's scale is a factor of its column of q K^T and of its
        column of p, so the products run on the stored rows cast to float32 whole (the two scale
        bytes included: q gets two zero columns, and p V's two extra columns are cut off) and the
        scales multiply the [.., G, rows] scores and probabilities: one pass over the cache where
        decoding it takes three (split, cast, scale), measured 2x slower a decode step at 4 slots.
        The power of two is Exp's here (within 1e-7 of exact; ONNX Runtime's Pow takes 14x as long):
        nothing is encoded from it."""
        if len(readers) != 1:
            return False
        node = readers[0]
        if node.op == "Transpose" and list(node.attrs.get("perm", [])) == [0, 1, 3, 2]:
            product = node.outputs[0].outputs
            if len(product) != 1 or product[0].op != "MatMul" or product[0].inputs[1] is not node.outputs[0]:
                return False
            self._fold_keys(stored, node, product[0])
            return True
        if node.op == "MatMul" and node.inputs[1] is stored and node.inputs[0] is not stored:
            self._fold_values(stored, node, d)
            return True
        return False

    def _fold_keys(self, stored: gs.Variable, transpose: gs.Node, product: gs.Node) -> None:
        op = self.edit.op
        transpose.inputs[0] = op("Cast", stored, to=FLOAT)
        product.inputs[0] = op("Pad", product.inputs[0], self.edit.const([0] * 7 + [self.extra]))
        scores = product.outputs[0]
        product.outputs[0] = gs.Variable(self.edit.fresh("unscaled"))
        self.edit.node("Mul", [product.outputs[0], self._row_scales(stored)], [scores])

    def _fold_values(self, stored: gs.Variable, product: gs.Node, d: int) -> None:
        op = self.edit.op
        product.inputs[0] = op("Mul", product.inputs[0], self._row_scales(stored))
        product.inputs[1] = op("Cast", stored, to=FLOAT)
        out = product.outputs[0]
        product.outputs[0] = gs.Variable(self.edit.fresh("wide_rows"))
        self.edit.node("Slice", [product.outputs[0], self.edit.const([0]), self.edit.const([d]),
                                 self.edit.const([-1])], [out])

    def _row_scales(self, stored: gs.Variable) -> gs.Variable:
        """float32 [.., 1, rows]: each row's scale, laid along the last axis."""
        op, edit = self.edit.op, self.edit
        pair = op("Slice", stored, edit.const([-self.extra]), edit.const([2 ** 62]), edit.const([-1]))
        pair = op("Transpose", op("Cast", pair, to=FLOAT), perm=[0, 1, 3, 2])
        e, m = gs.Variable(edit.fresh("e")), gs.Variable(edit.fresh("m"))
        edit.node("Split", [pair, edit.const([1, 1])], [e, m], axis=-2)
        power = op("Exp", op("Mul", op("Sub", e, self._f32(8.0)), self._f32(math.log(2))))   # Pow: 14x slower
        return op("Mul", power, op("Add", m, self._f32(kv_int8.MANTISSA_BIAS)))

    def _scale(self, e: gs.Variable, m: gs.Variable) -> gs.Variable:
        """2**(e - 8) * (384 + m): exact in float32 (a power of two times a 9-bit integer)."""
        op, f32 = self.edit.op, self._f32
        return op("Mul", op("Pow", f32(2.0), op("Sub", e, f32(8.0))), op("Add", m, f32(kv_int8.MANTISSA_BIAS)))

    def _unsqueeze(self, tensor: gs.Variable) -> gs.Variable:
        return self.edit.op("Unsqueeze", tensor, self.edit.const([-1]))

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
    if len(tensor.shape or ()) == 4 and form.fold(tensor, readers, wide_shape[-1]):
        return
    if readers and all(_moves_rows(node, tensor) for node in readers):
        for node in readers:
            wide = node.outputs[0]
            node.outputs[0] = gs.Variable(edit.fresh("stored"), dtype=form.dtype, shape=form.stored_shape(wide.shape))
            if node.op == "GatherElements" and form.extra:
                form.widen_indices(node)
            form.decode(node.outputs[0], wide, wide_shape[-1])
            decoded[wide.name] = node.outputs[0]
        return
    wide = gs.Variable(edit.fresh("wide"), dtype=np.float32, shape=wide_shape)
    form.decode(tensor, wide, wide_shape[-1])
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
        form.encode(wide, tensor, wide.shape[-1])


def _replace_input(node: gs.Node, old: gs.Variable, new: gs.Variable) -> None:
    for i, tensor in enumerate(node.inputs):
        if tensor is old:
            node.inputs[i] = new
