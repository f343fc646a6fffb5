"""Prefill pass: a per-row logit bias on the cache, for the summary rows of a resumed turn.

Adds per layer the input cache_bias.{i} [1, Hkv, R] float32 (R: the graph's cache rows, symbolic in
ONNX Runtime's graph of the family), added to
every query's logit of cache row r of KV head h: 0 for an ordinary row, log(n) for a row that
stands for n dropped rows (their mean key and value, `sessions/summaries.py`), MASK_MIN for an
empty one. Layer i's mask (the joined attention's, shared by every layer before) becomes
Add(mask [C, R + C], Concat(cache_bias.{i}, zeros [C]) as [1, Hkv, 1, 1, R + C]); the block keeps
the form `passes/match.py` finds (Add(scores, mask)), so the window-query pass runs after this one.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from snapcompile.graphs.builder import reshape_dims
from snapcompile.graphs.editor import GraphEditor, finalize
from snapcompile.models.spec import ModelSpec
from snapcompile.passes.match import MatchFailure, find_attention_blocks

INPUT = "cache_bias.{}"


def add_cache_bias(model: onnx.ModelProto, spec: ModelSpec, name: str = "prefill",
                   layers: int | None = None) -> tuple[onnx.ModelProto, dict]:
    """Rewrite the prefill graph `name` (the full one or a bucket; of `layers` decoder layers, default
    every one: 1 for a layer of the layer-by-layer prefill)."""
    graph = gs.import_onnx(model)
    blocks = find_attention_blocks(graph, layers or spec.num_layers, name)
    edit = GraphEditor(graph, "add_cache_bias")
    rows, chunk, hkv = edit.input("past_key.0").shape[2], edit.chunk(), spec.num_kv_heads
    zeros = edit.const(np.zeros((1, hkv, 1, 1, chunk)), np.float32)
    for i, block in enumerate(blocks):
        if not block.joined:
            raise MatchFailure(f"{name}: Softmax node {block.softmax.name!r} is not a joined (prefill) block")
        bias = gs.Variable(INPUT.format(i), dtype=np.float32, shape=[1, hkv, rows])
        graph.inputs.append(bias)
        per_row = edit.op("Reshape", bias, edit.const(reshape_dims([1, hkv, 1, 1, rows])))
        padded = edit.op("Concat", per_row, zeros, axis=-1)
        block.cache_mask_add.inputs[1] = edit.op("Add", block.cache_mask_add.inputs[1], padded)
    return finalize(graph, name), {"pass": "add_cache_bias", "graph": name, "blocks_rewritten": len(blocks)}
