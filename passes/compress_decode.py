"""Decode pass: dense-cache attention -> fixed-budget ring cache of R rows per slot (R = the policy's
`slot_rows`: the budget B less its summary rows, B itself without them).

Each block's cache inputs become [N, Hkv, R, D]; the shared validity mask becomes
`row < cache_len and row != write_index` (the ring row being overwritten this step is hidden;
the new token is attended through the block's new-token branch), with a new per-slot input
`write_index` [N] int64.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from snapcompile.graphs.attention import additive_mask
from snapcompile.graphs.builder import reshape_dims
from snapcompile.graphs.editor import GraphEditor, finalize
from snapcompile.passes.match import find_attention_blocks


def compress_decode(model: onnx.ModelProto, num_layers: int, slot_rows: int,
                    name: str = "decode", local_layers=()) -> tuple[onnx.ModelProto, dict]:
    """slot_rows: R, the cache rows of a slot. name: the decode graph's name ("decode", or
    "decode_<slots>"), for errors and the report (whose "budget" is R, as artifacts record it).
    The slots may be symbolic (ONNX Runtime's graph of the family). local_layers: the layers whose
    cache is their window ring already (Gemma 3's), left as they are."""
    graph = gs.import_onnx(model)
    blocks = find_attention_blocks(graph, num_layers, name, split_only=True)
    blocks = [block for i, block in enumerate(blocks) if i not in local_layers]
    edit = GraphEditor(graph, "compress_decode")
    slots = edit.input("cache_len").shape[0]
    mask = _ring_mask(edit, slots, slot_rows)
    for block in blocks:
        for cache in (block.k_cache, block.v_cache):
            if cache not in graph.inputs:
                raise ValueError("decode cache tensors must be graph inputs")
            cache.shape = [cache.shape[0], cache.shape[1], slot_rows, cache.shape[3]]
        block.cache_mask_add.inputs[1] = mask
        block.split.inputs[1] = edit.const([slot_rows, 1])
    return finalize(graph, name), {"pass": "compress_decode", "graph": name,
                                   "blocks_rewritten": len(blocks), "budget": slot_rows}


def _ring_mask(edit: GraphEditor, slots: int, rows: int) -> gs.Variable:
    write_index = gs.Variable("write_index", dtype=np.int64, shape=[slots])
    edit.graph.inputs.append(write_index)
    row = edit.const(np.arange(rows)[None, :])                                        # [1, R]
    cache_len_col = edit.op("Unsqueeze", edit.input("cache_len"), edit.const([1]))    # [N, 1]
    write_index_col = edit.op("Unsqueeze", write_index, edit.const([1]))              # [N, 1]
    filled = edit.op("Less", row, cache_len_col)
    not_written = edit.op("Not", edit.op("Equal", row, write_index_col))
    additive = additive_mask(edit, edit.op("And", filled, not_written))               # [N, R]
    return edit.op("Reshape", additive, edit.const(reshape_dims([slots, 1, 1, rows])), dtype=np.float32,
                   shape=[slots, 1, 1, rows])
