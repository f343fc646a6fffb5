"""Prefill pass: expose each block's observation-window queries for SnapKV selection.

Adds outputs window_query.{i} [1, H, W, D]: the post-RoPE queries of the chunk's last W valid
tokens (rows chunk_len-W .. chunk_len-1; the runner reads them from the final chunk, which
always ends at the prompt's last token). The selection itself is the `select` graph
(snapcompile/graphs/select.py), run once per request on the prefilled cache.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from snapcompile.graphs.editor import GraphEditor, finalize
from snapcompile.models.spec import ModelSpec
from snapcompile.passes.match import find_attention_blocks


def add_window_queries(model: onnx.ModelProto, spec: ModelSpec, window: int, name: str = "prefill",
                       layers: int | None = None) -> tuple[onnx.ModelProto, dict]:
    """Rewrite the prefill graph `name` (the full one or a bucket; of `layers` decoder layers, default
    every one: 1 for a layer of the layer-by-layer prefill, a global one). A local layer (Gemma 3's)
    keeps its window ring and is not selected from: it gets no output."""
    graph = gs.import_onnx(model)
    whole = layers in (None, spec.num_layers)        # the whole model's graph: its blocks are its layers
    blocks = find_attention_blocks(graph, layers or spec.num_layers, name)
    if whole:
        blocks = [block for i, block in enumerate(blocks) if i not in spec.local_layers]
    edit = GraphEditor(graph, "add_window_queries")
    chunk = edit.chunk()
    first = edit.op("Sub", edit.input("chunk_len"), edit.const([window]))
    rows = edit.op("Max", edit.op("Add", first, edit.const(np.arange(window))), edit.const([0]))
    shape = [1, spec.num_heads, window, spec.head_dim]
    indices = spec.global_layers if whole else range(len(blocks))
    for i, block in zip(indices, blocks):
        per_head = edit.op("Reshape", block.q, edit.const([1, spec.num_heads, chunk, spec.head_dim]))
        out = edit.op("Gather", per_head, rows, axis=2, dtype=np.float32, shape=shape)
        named = gs.Variable(f"window_query.{i}", dtype=np.float32, shape=shape)
        edit.node("Identity", [out], [named])
        graph.outputs.append(named)
    return finalize(graph, name), {"pass": "add_window_queries", "graph": name,
                                   "blocks_rewritten": len(blocks), "window": window}
