"""Find cached-attention blocks by graph structure (never by tensor name).

The two forms of snapcompile.graphs.attention:

    split (decode):
    s_cache = Add(Mul(MatMul(q, Transpose(k_cache)), scale), cache_mask)
    s_new   = Mul(MatMul(q, Transpose(k_new)), scale)
    p_cache, p_new = Split(Softmax(Concat(s_cache, s_new)))
    out     = Add(MatMul(p_cache, v_cache), MatMul(p_new, v_new))

    joined (prefill):
    keys    = Unsqueeze(Concat(k_cache, k_new)); values = Unsqueeze(Concat(v_cache, v_new))
    out     = MatMul(Softmax(Add(Mul(MatMul(q, Transpose(keys)), scale), mask)), values)

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
    cache_mask_add: gs.Node      # split: Add(cache scores, cache_mask); joined: Add(scores, mask)
    split: gs.Node | None        # split form only
    output: gs.Node              # split: Add of the two value products; joined: the value MatMul
    scale: float

    @property
    def joined(self) -> bool:
        return self.split is None


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
    perm = list(transpose.attrs.get("perm", []))
    if len(perm) < 2 or perm != [*range(len(perm) - 2), len(perm) - 1, len(perm) - 2]:
        raise MatchFailure(f"{where}: keys are not transposed on their last two axes")
    return matmul.inputs[0], transpose.inputs[0], float(scale.values.reshape(-1)[0])


def _joined_rows(tensor: gs.Tensor, what: str, where: str) -> tuple[gs.Tensor, gs.Tensor]:
    """Unsqueeze(Concat(cache, new)) -> (cache, new)."""
    concat = _producer(_producer(tensor, "Unsqueeze", where).inputs[0], "Concat", where)
    if len(concat.inputs) != 2:
        raise MatchFailure(f"{where}: {what} are not Concat(cache, new tokens)")
    return concat.inputs[0], concat.inputs[1]


def match_block(softmax: gs.Node) -> AttentionBlock:
    """The block around `softmax`, in the form its producer shows (Add: joined, else split)."""
    where = f"Softmax node {softmax.name!r}"
    if softmax.inputs[0].inputs and softmax.inputs[0].inputs[0].op == "Add":
        return _match_joined(softmax, where)
    concat = _producer(softmax.inputs[0], "Concat", where)
    if len(concat.inputs) != 2:
        raise MatchFailure(f"{where}: scores are not Concat(cache scores, new-token scores)")
    mask_add = _producer(concat.inputs[0], "Add", where)
    q, k_cache, scale = _scaled_scores(mask_add.inputs[0], where)
    q_new, k_new, _ = _scaled_scores(concat.inputs[1], where)
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


def _match_joined(softmax: gs.Node, where: str) -> AttentionBlock:
    mask_add = softmax.inputs[0].inputs[0]
    q, keys, scale = _scaled_scores(mask_add.inputs[0], where)
    k_cache, k_new = _joined_rows(keys, "keys", where)
    pv = _only_consumer(softmax.outputs[0], "MatMul", where)
    v_cache, v_new = _joined_rows(pv.inputs[1], "values", where)
    return AttentionBlock(softmax, q, k_cache, v_cache, k_new, v_new, mask_add, None, pv, scale)


def find_attention_blocks(graph: gs.Graph, expected: int, graph_name: str,
                          split_only: bool = False) -> list[AttentionBlock]:
    """All attention blocks in topological order; fewer than `expected` is an error naming why.
    split_only: a joined block is not a match (the decode passes rewrite the split form)."""
    graph.toposort()
    blocks, failures = [], []
    for node in graph.nodes:
        if node.op != "Softmax":
            continue
        try:
            block = match_block(node)
            if split_only and block.joined:
                raise MatchFailure(f"Softmax node {node.name!r}: a joined (prefill) attention block, "
                                   f"not the split form this pass rewrites")
            blocks.append(block)
        except MatchFailure as failure:
            failures.append(str(failure))
    if len(blocks) != expected:
        detail = failures[0] if failures else "no further Softmax nodes were found"
        raise MatchFailure(f"{graph_name}: matched {len(blocks)} attention blocks but the model has "
                           f"{expected} layers; first unmatched: {detail}")
    return blocks
