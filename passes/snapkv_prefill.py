"""Prefill pass: expose each block's observation-window queries for SnapKV selection.

Adds outputs window_query.{i} [1, H, W, D]: the post-RoPE queries of the chunk's last W valid
tokens (rows chunk_len-W .. chunk_len-1; the runner reads them from the final chunk, which
always ends at the prompt's last token). The selection itself is the `select` graph
(passes/snapkv_select.py), run once per request on the prefilled cache.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from snapcompile.models.spec import ModelSpec
from snapcompile.passes.graph_utils import add_node, constant, finalize, graph_input
from snapcompile.passes.match import find_attention_blocks


def add_window_queries(model: onnx.ModelProto, spec: ModelSpec, window: int,
                       name: str = "prefill") -> tuple[onnx.ModelProto, dict]:
    """Rewrite the prefill graph `name` (the full one or a bucket)."""
    graph = gs.import_onnx(model)
    blocks = find_attention_blocks(graph, spec.num_layers, name)
    chunk = graph_input(graph, "input_ids").shape[1]
    chunk_len = graph_input(graph, "chunk_len")
    first = add_node(graph, "Sub", [chunk_len, constant([window])])
    rows = add_node(graph, "Max", [add_node(graph, "Add", [first, constant(np.arange(window))]), constant([0])])
    for i, block in enumerate(blocks):
        per_head = add_node(graph, "Reshape", [block.q, constant([1, spec.num_heads, chunk, spec.head_dim])])
        out = add_node(graph, "Gather", [per_head, rows], attrs={"axis": 2}, dtype=np.float32,
                       shape=[1, spec.num_heads, window, spec.head_dim])
        named = gs.Variable(f"window_query.{i}", dtype=np.float32, shape=out.shape)
        graph.nodes.append(gs.Node("Identity", f"WindowQuery{i}", inputs=[out], outputs=[named]))
        graph.outputs.append(named)
    return finalize(graph, name), {"pass": "add_window_queries", "graph": name,
                                   "blocks_rewritten": len(blocks), "window": window}
