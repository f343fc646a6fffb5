"""Prefill pass (ONNX Runtime's layer graphs): a joined attention block computed one KV head at a time.

The joined block's scores of a chunk over R cache rows are [1, Hkv, G, C, R + C] float32, and the
Mul, Add and Softmax after the MatMul each write another tensor of that size: at the 8B shape and
R = 131072, 1 GiB each, where the rest of a layer's work space is tens of MiB. Rewritten as a chain
of the KV heads' blocks, run one after the other (below), a chunk holds one head's: Hkv times less.
Each head's MatMuls, mask and Softmax are the batched block's for that head (the same shapes, each
batch of a batched MatMul multiplied on its own), so the outputs are the same bit for bit
(tests/test_passes.py).

Each head: Gather head h of q [1, Hkv, G, C, D], of the cache and new keys / values and, where it
has one (the summary rows' bias, passes/cache_bias.py), of the mask [1, Hkv, 1, C, R + C]; the
block's nodes on them; the heads' outputs [1, 1, G, C, D] concatenated. The heads run one after the
other: head h + 1's index reads head h's output (h + 1 plus the ArgMax of one of its elements,
always 0), a dependency ONNX Runtime cannot fold away, so its executor (which frees each tensor after
its last reader) holds one head's scores at a time. A Gather of a one-element index (not a Slice
from a running start) keeps every shape known at load, and there is no control flow: the load
checks (artifact/static_sizes.py) bound every node.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from snapcompile.graphs.editor import GraphEditor, finalize
from snapcompile.models.spec import ModelSpec
from snapcompile.passes.match import AttentionBlock, find_attention_blocks


def attention_per_head(model: onnx.ModelProto, spec: ModelSpec, name: str,
                       layers: int = 1) -> tuple[onnx.ModelProto, dict]:
    """Rewrite every joined attention block of the prefill graph `name` (of `layers` decoder layers)."""
    graph = gs.import_onnx(model)
    blocks = find_attention_blocks(graph, layers, name)
    edit = GraphEditor(graph, "attention_per_head")
    biased = any(tensor.name.startswith("cache_bias.") for tensor in graph.inputs)
    for block in blocks:
        _per_head(edit, block, spec, biased)
    return finalize(graph, name), {"pass": "attention_per_head", "graph": name, "blocks_rewritten": len(blocks)}


def _per_head(edit: GraphEditor, block: AttentionBlock, spec: ModelSpec, biased: bool) -> None:
    """biased: the mask carries the summary rows' bias, a KV-head axis ([1, Hkv, 1, C, R + C]); else
    it is one [C, R + C] for every head."""
    mask, outputs, after = block.cache_mask_add.inputs[1], [], edit.const([0])
    for h in range(spec.num_kv_heads):
        index = edit.op("Add", after, edit.const([h]))

        def head(tensor: gs.Tensor, index=index) -> gs.Variable:
            return edit.op("Gather", tensor, index, axis=1)
        keys = edit.op("Unsqueeze", edit.op("Concat", head(block.k_cache), head(block.k_new), axis=2), edit.const([2]))
        values = edit.op("Unsqueeze", edit.op("Concat", head(block.v_cache), head(block.v_new), axis=2),
                         edit.const([2]))
        scores = edit.op("Mul", edit.op("MatMul", head(block.q), edit.op("Transpose", keys, perm=[0, 1, 2, 4, 3])),
                         gs.Constant(edit.fresh("scale"), np.array(block.scale, np.float32)))
        probs = edit.op("Softmax", edit.op("Add", scores, head(mask) if biased else mask), axis=-1)
        outputs.append(edit.op("MatMul", probs, values))
        first = edit.op("Slice", outputs[-1], edit.const([0] * 5), edit.const([1] * 5))    # [1, 1, 1, 1, 1]
        after = edit.op("ArgMax", edit.op("Reshape", first, edit.const([1])), axis=0, keepdims=1)   # always [0]
    out = block.output.outputs[0]
    block.output.outputs = []
    edit.node("Concat", outputs, [out], axis=1)
