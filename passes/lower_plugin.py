"""Plugin lowering of the decode graph: every compressed attention block becomes one
SnapKVDecodeAttention node (plugins.contracts). The select graphs of a plugin artifact are
written with SnapKVSelect nodes directly (snapcompile.graphs.select.plugin_select_graph).
Nodes carry plugin_version / plugin_namespace for TensorRT's ONNX parser.
"""
from __future__ import annotations

import onnx
import onnx_graphsurgeon as gs

from snapcompile.graphs.editor import GraphEditor, finalize
from snapcompile.passes.match import find_attention_blocks
from snapcompile.plugins.contracts import DECODE_ATTENTION, DOMAIN


def lower_decode(model: onnx.ModelProto, num_layers: int, name: str = "decode") -> tuple[onnx.ModelProto, dict]:
    """name: the decode graph's name ("decode", or "decode_<slots>"), for errors and the report."""
    graph = gs.import_onnx(model)
    blocks = find_attention_blocks(graph, num_layers, name, split_only=True)
    edit = GraphEditor(graph, "lower_plugin")
    write_index, cache_len = edit.input("write_index"), edit.input("cache_len")
    for block in blocks:
        result = block.output.outputs[0]
        block.output.outputs = []
        inputs = DECODE_ATTENTION.node_inputs(query=block.q, key=block.k_new, value=block.v_new,
                                              key_cache=block.k_cache, value_cache=block.v_cache,
                                              write_index=write_index, cache_len=cache_len)
        edit.node(DECODE_ATTENTION.name, inputs, [result], domain=DOMAIN,
                  **DECODE_ATTENTION.node_attrs(scale=float(block.scale)))
    return finalize(graph, name, custom_domains=(DOMAIN,)), {"pass": "lower_plugin", "graph": name,
                                                             "blocks_rewritten": len(blocks)}
