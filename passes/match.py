"""Find cached-attention blocks by graph structure (never by tensor name).

The pattern (see snapcompile.graphs.attention.emit_cached_attention):

    s_cache = Add(Mul(MatMul(q, Transpose(k_cache)), scale), cache_mask)
    s_new   = Mul(MatMul(q, Transpose(k_new)), scale) [+ new_mask]
    p_cache, p_new = Split(Softmax(Concat(s_cache, s_new)))
    out     = Add(MatMul(p_cache, v_cache), MatMul(p_new, v_new))

Every Softmax in the graph is a candidate; one that does not fit says why.
"""
from __future__ import annotations

from dataclasses import dataclass

import onnx_graphsurgeon as gs


class MatchFailure(Exception):
    """Why one candidate is not an attention block (names the node)."""


@dataclass
class AttentionBlock:
    softmax: gs.Node
    q: gs.Variable
    k_cache: gs.Tensor
    v_cache: gs.Tensor
    k_new: gs.Tensor
    v_new: gs.Tensor
    cache_mask_add: gs.Node      # Add(scores, cache_mask); its input 1 is the mask
    split: gs.Node
    output_add: gs.Node
    scale: float


def _producer(tensor: gs.Tensor, op: str, where: str) -> gs.Node:
    if not tensor.inputs or tensor.inputs[0].op != op:
        found = tensor.inputs[0].op if tensor.inputs else "a graph input or constant"
        raise MatchFailure(f"{where}: expected {op}, found {found}")
    return tensor.inputs[0]


def _only_consumer(tensor: gs.Tensor, op: str, where: str) -> gs.Node:
    if len(tensor.outputs) != 1 or tensor.outputs[0].op != op:
        raise MatchFailure(f"{where}: expected one {op} consumer")
    return tensor.outputs[0]


def _scaled_scores(tensor: gs.Tensor, where: str) -> tuple[gs.Tensor, gs.Tensor, float]:
    """Mul(MatMul(q, Transpose(k)), scale) -> (q, k, scale)."""
    mul = _producer(tensor, "Mul", where)
    scale = mul.inputs[1]
    if not isinstance(scale, gs.Constant) or scale.values.size != 1:
        raise MatchFailure(f"{where}: the score scale is not a constant scalar")
    matmul = _producer(mul.inputs[0], "MatMul", where)
    transpose = _producer(matmul.inputs[1], "Transpose", where)
    if list(transpose.attrs.get("perm", [])) != [0, 1, 3, 2]:
        raise MatchFailure(f"{where}: keys are not transposed on their last two axes")
    return matmul.inputs[0], transpose.inputs[0], float(scale.values.reshape(-1)[0])


def match_block(softmax: gs.Node) -> AttentionBlock:
    where = f"Softmax node {softmax.name!r}"
    concat = _producer(softmax.inputs[0], "Concat", where)
    if len(concat.inputs) != 2:
        raise MatchFailure(f"{where}: scores are not Concat(cache scores, new-token scores)")
    mask_add = _producer(concat.inputs[0], "Add", where)
    q, k_cache, scale = _scaled_scores(mask_add.inputs[0], where)
    new_scores = concat.inputs[1]
    if new_scores.inputs and new_scores.inputs[0].op == "Add":
        new_scores = new_scores.inputs[0].inputs[0]
    q_new, k_new, _ = _scaled_scores(new_scores, where)
    if q_new is not q:
        raise MatchFailure(f"{where}: cache and new-token scores use different queries")
    split = _only_consumer(softmax.outputs[0], "Split", where)
    if len(split.outputs) != 2:
        raise MatchFailure(f"{where}: probabilities are not split in two")
    pv_cache = _only_consumer(split.outputs[0], "MatMul", where)
    pv_new = _only_consumer(split.outputs[1], "MatMul", where)
    out_add = _only_consumer(pv_cache.outputs[0], "Add", where)
    if pv_new.outputs[0] not in out_add.inputs:
        raise MatchFailure(f"{where}: the two value products are not summed")
    return AttentionBlock(softmax, q, k_cache, pv_cache.inputs[1], k_new, pv_new.inputs[1],
                          mask_add, split, out_add, scale)


def find_attention_blocks(graph: gs.Graph, expected: int, graph_name: str) -> list[AttentionBlock]:
    """All attention blocks in topological order; fewer than `expected` is an error naming why."""
    graph.toposort()
    blocks, failures = [], []
    for node in graph.nodes:
        if node.op != "Softmax":
            continue
        try:
            blocks.append(match_block(node))
        except MatchFailure as failure:
            failures.append(str(failure))
    if len(blocks) != expected:
        detail = failures[0] if failures else "no further Softmax nodes were found"
        raise MatchFailure(f"{graph_name}: matched {len(blocks)} attention blocks but the model has "
                           f"{expected} layers; first unmatched: {detail}")
    return blocks
