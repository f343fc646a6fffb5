"""One ONNX Runtime graph for a family of an artifact's graphs that differ in one dimension only.

An artifact's bucket graphs are static (TensorRT and dataflow consumers need that): "prefill" and
its buckets "prefill_<R>" differ only in the cache rows R, "select" and "select_<R>" likewise, and
"decode" and "decode_<k>" only in the slots k. On ONNX Runtime each graph was a session of its own,
and a session holds ~3 KB for every node it keeps (docs/results/memory.md): ~11 MiB a graph at
SmolLM2's ~2700 nodes, whatever the weights. `symbolic_form` writes one graph for a family whose
size is a symbolic dimension, so one session serves every member.

It is derived from the members themselves, never assumed: their nodes must correspond one to one
(same operator, attributes and wiring), and every small constant that differs between them must be
`a * size + b` element by element (a reshape's target shape, an expand's shape) or, where its length
follows the size, the arithmetic sequence `start(size) + step * j` (`arange(R)`, `R - arange(R)`).
Each such constant becomes a few nodes computing it from the size read off an input's shape. A
formula is fitted on two members and checked on every member, and the form only ever runs at the
members' sizes, where it reproduces each member's constants exactly: at size s it is member s.
Anything else fails with a `FamilyError` naming the node (the runtime then keeps one session a
graph).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


class FamilyError(ValueError):
    """The members of a family differ in a way a symbolic size cannot express."""


@dataclass(frozen=True)
class _SizeAxis:
    """Where the size is read from at run time: dimension `axis` of graph input `name`."""

    name: str
    axis: int


def symbolic_form(models: dict[int, onnx.ModelProto], dim: str) -> onnx.ModelProto:
    """One model equal, at each size s of `models` (size -> member, at least two), to models[s],
    with the varying dimension of its inputs and outputs named `dim`. Members are loaded without
    their external data (weights are compared by reference). Raises FamilyError naming what differs."""
    if len(models) < 2:
        raise FamilyError("a family needs two members")
    sizes = sorted(models)
    template = onnx.ModelProto.FromString(models[sizes[-1]].SerializeToString())
    graph = template.graph
    axis = _check_io(graph, {s: models[s].graph for s in sizes}, dim)
    _check_wiring(graph, [models[s].graph for s in sizes])
    _replace_varying_constants(graph, {s: models[s].graph for s in sizes}, _Expressions(graph, axis))
    used = {name for node in graph.node for name in node.input}
    kept = [tensor for tensor in graph.initializer if tensor.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    del graph.value_info[:]          # static shapes inferred at one size; ONNX Runtime infers its own
    return template


def _replace_varying_constants(graph: onnx.GraphProto, members: dict[int, onnx.GraphProto],
                               expressions: _Expressions) -> None:
    """Each node input of `graph` (the largest member's copy) that is a constant differing between
    members reads instead the expression computing it from the size; those nodes go first."""
    constants = {s: _small_constants(g) for s, g in members.items()}
    largest = max(members)
    for index, node in enumerate(graph.node):
        for slot, name in enumerate(node.input):
            if name not in constants[largest]:
                continue
            values = {s: constants[s][g.node[index].input[slot]] for s, g in members.items()}
            mine = values[largest]
            if any(v.dtype != mine.dtype or not np.array_equal(v, mine) for v in values.values()):
                node.input[slot] = expressions.of(values, node)
    nodes = expressions.nodes + list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes)


def _check_io(graph: onnx.GraphProto, members: dict[int, onnx.GraphProto], dim: str) -> _SizeAxis:
    """Inputs and outputs with the same names and types in every member, each dimension either
    fixed or equal to the member's size (made `dim` in `graph`); where the size is read."""
    source = None
    for kind in ("input", "output"):
        mine = getattr(graph, kind)
        if any(len(getattr(g, kind)) != len(mine) for g in members.values()):
            raise FamilyError(f"members have different numbers of {kind}s")
        for position, value in enumerate(mine):
            theirs = {s: getattr(g, kind)[position] for s, g in members.items()}
            dims = {s: [d.dim_value for d in v.type.tensor_type.shape.dim] for s, v in theirs.items()}
            if {(v.name, v.type.tensor_type.elem_type, len(dims[s])) for s, v in theirs.items()} != \
                    {(value.name, value.type.tensor_type.elem_type, len(dims[max(dims)]))}:
                raise FamilyError(f"{kind} {value.name}: members differ in name, type or rank")
            for axis, dimension in enumerate(value.type.tensor_type.shape.dim):
                seen = {s: d[axis] for s, d in dims.items()}
                if len(set(seen.values())) == 1:
                    continue
                if any(d != s for s, d in seen.items()):
                    raise FamilyError(f"{kind} {value.name}: dimension {axis} is {seen} across sizes, not the size")
                dimension.ClearField("dim_value")
                dimension.dim_param = dim
                if kind == "input" and source is None:
                    source = _SizeAxis(value.name, axis)
    if source is None:
        raise FamilyError("no input's shape follows the size")
    return source


def _check_wiring(graph: onnx.GraphProto, members: list[onnx.GraphProto]) -> None:
    """Every member has the template's nodes in order: same operator, domain and attributes, each
    input coming from the same node output, graph input or (any) initializer."""
    reference = _wiring(graph)
    for member in members:
        if len(member.node) != len(graph.node):
            raise FamilyError(f"members have {len(member.node)} and {len(graph.node)} nodes")
        for mine, theirs, (node, other) in zip(reference, _wiring(member), zip(graph.node, member.node)):
            same = (node.op_type, node.domain, list(node.attribute)) == (other.op_type, other.domain,
                                                                        list(other.attribute))
            if not same or mine != theirs:
                raise FamilyError(f"node {node.name} ({node.op_type}) differs between members: "
                                  f"{other.name} ({other.op_type})")


def _wiring(graph: onnx.GraphProto) -> list[tuple]:
    """Per node, where each input comes from, by position rather than by name (names are counters)."""
    produced = {out: (index, slot) for index, node in enumerate(graph.node) for slot, out in enumerate(node.output)}
    inputs = {value.name for value in graph.input}
    initializers = {tensor.name for tensor in graph.initializer}
    return [tuple(produced.get(name) or (name if name in inputs else "init" if name in initializers else name)
                  for name in node.input) for node in graph.node]


def _small_constants(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    """name -> value of the initializers the graph holds itself, and a stand-in for each weight (its
    external data reference, so that the same weight compares equal)."""
    constants = {}
    for tensor in graph.initializer:
        if tensor.data_location == TensorProto.EXTERNAL:
            reference = "|".join(f"{e.key}={e.value}" for e in tensor.external_data)
            constants[tensor.name] = np.array([reference, str(tensor.data_type), str(list(tensor.dims))])
        else:
            constants[tensor.name] = numpy_helper.to_array(tensor)
    return constants


class _Expressions:
    """The nodes computing each varying constant from the size, made once per distinct formula."""

    def __init__(self, graph: onnx.GraphProto, source: _SizeAxis):
        self.graph, self.nodes, self._made = graph, [], {}
        vector = self._node("Shape", [source.name], start=source.axis, end=source.axis + 1)
        self.size = self._node("Squeeze", [vector, self._const(np.array([0]))])       # int64 scalar

    def of(self, values: dict[int, np.ndarray], node: onnx.NodeProto) -> str:
        """The tensor equal to values[s] at size s, for every s; FamilyError names `node` if none."""
        sizes = sorted(values)
        shapes = {v.shape for v in values.values()}
        dtype = values[sizes[-1]].dtype
        if dtype.kind not in "iuf" or any(v.dtype != dtype for v in values.values()):
            raise FamilyError(f"node {node.name} ({node.op_type}): a {dtype} constant differs between members")
        if len(shapes) == 1:
            return self._affine(values, node)
        return self._sequence(values, node)

    def _affine(self, values: dict[int, np.ndarray], node: onnx.NodeProto) -> str:
        """values[s] == a * s + b element by element."""
        (s0, v0), (s1, v1) = sorted(values.items())[:2]
        slope = (v1.astype(np.float64) - v0) / (s1 - s0)
        a = np.round(slope).astype(np.int64)
        b = np.round(v0 - a * s0).astype(np.int64)
        self._check(values, lambda s: a * s + b, node)
        key = ("affine", a.tobytes(), b.tobytes(), a.shape, values[s0].dtype.str)
        if key not in self._made:
            scaled = self._node("Mul", [self.size, self._const(a)])
            self._made[key] = self._cast(self._node("Add", [scaled, self._const(b)]), values[s0].dtype)
        return self._made[key]

    def _sequence(self, values: dict[int, np.ndarray], node: onnx.NodeProto) -> str:
        """values[s] == start(s) + step * j for j < s + extra, laid out along one axis (any others of
        length 1): start(s) = a * s + b, step and extra fixed."""
        flat = {s: v.reshape(-1) for s, v in values.items()}
        shapes = {s: v.shape for s, v in values.items()}
        varying = [axis for axis in range(len(shapes[min(shapes)])) if len({sh[axis] for sh in shapes.values()}) > 1]
        if len({len(sh) for sh in shapes.values()}) != 1 or len(varying) != 1 or \
                any(np.prod(sh) != sh[varying[0]] for sh in shapes.values()):
            raise FamilyError(f"node {node.name} ({node.op_type}): a constant's shape changes with the size in a "
                              f"way no sequence describes ({sorted(set(shapes.values()))})")
        (s0, v0), (s1, v1) = sorted(flat.items())[:2]
        if len(v0) < 2:
            raise FamilyError(f"node {node.name} ({node.op_type}): a constant of one element changes length")
        step, extra = v0[1] - v0[0], len(v0) - s0
        a = (v1[0] - v0[0]) / (s1 - s0)
        b = v0[0] - a * s0
        expected = {s: (a * s + b + step * np.arange(s + extra)).reshape(shapes[s]) for s in values}
        self._check(values, expected.__getitem__, node)
        axis = varying[0]
        target = np.array([-1 if i == axis else 1 for i in range(len(shapes[s0]))])
        key = ("sequence", float(a), float(b), float(step), int(extra), target.tobytes(), v0.dtype.str)
        if key not in self._made:
            integral = all(float(x).is_integer() for x in (a, b, step))
            if not integral or step == 0:
                raise FamilyError(f"node {node.name} ({node.op_type}): a sequence with a fractional or zero step")
            start = self._node("Add", [self._node("Mul", [self.size, self._const(np.int64(a))]),
                                       self._const(np.int64(b))])
            count = self._node("Add", [self.size, self._const(np.int64(extra))])
            limit = self._node("Add", [start, self._node("Mul", [count, self._const(np.int64(step))])])
            sequence = self._node("Range", [start, limit, self._const(np.int64(step))])
            shaped = self._node("Reshape", [sequence, self._const(target)])
            self._made[key] = self._cast(shaped, v0.dtype)
        return self._made[key]

    @staticmethod
    def _check(values: dict[int, np.ndarray], formula, node: onnx.NodeProto) -> None:
        for s, v in values.items():
            expected = formula(s)
            if expected.shape != v.shape or not np.array_equal(np.asarray(expected, v.dtype), v) or \
                    not np.array_equal(np.asarray(expected, np.float64), v.astype(np.float64)):
                raise FamilyError(f"node {node.name} ({node.op_type}): a constant that differs between members is "
                                  f"not linear in the size (at size {s})")

    def _cast(self, name: str, dtype: np.dtype) -> str:
        if dtype == np.int64:
            return name
        return self._node("Cast", [name], to=helper.np_dtype_to_tensor_dtype(dtype))

    def _const(self, value: np.ndarray) -> str:
        name = f"family.const_{len(self.graph.initializer)}"
        self.graph.initializer.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def _node(self, op_type: str, inputs: list[str], **attrs) -> str:
        output = f"family.{op_type.lower()}_{len(self.nodes)}"
        self.nodes.append(helper.make_node(op_type, inputs, [output], name=output, **attrs))
        return output
