"""Decode pass: dense-cache attention -> fixed-budget ring cache of B rows per slot.

Each block's cache inputs become [N, Hkv, B, D]; the shared validity mask becomes
`row < cache_len and row != write_index` (the ring row being overwritten this step is hidden;
the new token is attended through the block's new-token branch), with a new per-slot input
`write_index` [N] int64.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from snapcompile.export.attention_graph import MASK_MIN
from snapcompile.passes.graph_utils import add_node, constant, finalize, graph_input
from snapcompile.passes.match import find_attention_blocks


def compress_decode(model: onnx.ModelProto, num_layers: int, budget: int) -> tuple[onnx.ModelProto, dict]:
    graph = gs.import_onnx(model)
    blocks = find_attention_blocks(graph, num_layers, "decode")
    slots = graph_input(graph, "cache_len").shape[0]
    mask = _ring_mask(graph, slots, budget)
    for block in blocks:
        for cache in (block.k_cache, block.v_cache):
            if cache not in graph.inputs:
                raise ValueError("decode cache tensors must be graph inputs")
            cache.shape = [cache.shape[0], cache.shape[1], budget, cache.shape[3]]
        block.cache_mask_add.inputs[1] = mask
        block.split.inputs[1] = constant([budget, 1])
    return finalize(graph, "decode"), {"pass": "compress_decode", "graph": "decode",
                                       "blocks_rewritten": len(blocks), "budget": budget}


def _ring_mask(graph: gs.Graph, slots: int, budget: int) -> gs.Variable:
    write_index = gs.Variable("write_index", dtype=np.int64, shape=[slots])
    graph.inputs.append(write_index)
    cache_len = graph_input(graph, "cache_len")
    rows = constant(np.arange(budget)[None, :])                                       # [1, B]
    cache_len_col = add_node(graph, "Unsqueeze", [cache_len, constant([1])])          # [N, 1]
    write_index_col = add_node(graph, "Unsqueeze", [write_index, constant([1])])      # [N, 1]
    filled = add_node(graph, "Less", [rows, cache_len_col])
    not_written = add_node(graph, "Not", [add_node(graph, "Equal", [rows, write_index_col])])
    visible = add_node(graph, "And", [filled, not_written])
    additive = add_node(graph, "Where", [visible, constant(0.0, np.float32), constant(MASK_MIN, np.float32)])
    return add_node(graph, "Reshape", [additive, constant([slots, 1, 1, budget])],
                    dtype=np.float32, shape=[slots, 1, 1, budget])
