"""Plugin lowering: compressed-KV attention -> custom op nodes served by a TensorRT plugin.

decode: every matched attention block becomes one SnapKVDecodeAttention node.
select: every layer's standard-op selection becomes one SnapKVSelect node.
Nodes carry plugin_version / plugin_namespace for TensorRT's ONNX parser (plugins.contracts).
"""
from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from snapcompile.config import PolicyConfig
from snapcompile.export.onnx_builder import GraphBuilder
from snapcompile.models.spec import ModelSpec
from snapcompile.passes.graph_utils import finalize, fresh, graph_input
from snapcompile.passes.match import find_attention_blocks
from snapcompile.plugins.contracts import DECODE_ATTENTION, DOMAIN, PLUGIN_NAMESPACE, PLUGIN_VERSION, SELECT

PLUGIN_ATTRS = {"plugin_version": PLUGIN_VERSION, "plugin_namespace": PLUGIN_NAMESPACE}


def lower_decode(model: onnx.ModelProto, num_layers: int) -> tuple[onnx.ModelProto, dict]:
    graph = gs.import_onnx(model)
    blocks = find_attention_blocks(graph, num_layers, "decode")
    write_index, cache_len = graph_input(graph, "write_index"), graph_input(graph, "cache_len")
    for block in blocks:
        result = block.output_add.outputs[0]
        block.output_add.outputs = []
        graph.nodes.append(gs.Node(
            DECODE_ATTENTION.name, fresh(DECODE_ATTENTION.name), domain=DOMAIN,
            attrs={"scale": float(block.scale), **PLUGIN_ATTRS},
            inputs=[block.q, block.k_new, block.v_new, block.k_cache, block.v_cache, write_index, cache_len],
            outputs=[result]))
    return finalize(graph, "decode", custom_domains=(DOMAIN,)), {"pass": "lower_plugin", "graph": "decode",
                                                                 "blocks_rewritten": len(blocks)}


def plugin_select_graph(spec: ModelSpec, policy: PolicyConfig, cache_rows: int,
                        name: str = "select") -> onnx.ModelProto:
    """A select graph over `cache_rows` rows with one SnapKVSelect node per layer (same I/O as the
    standard one)."""
    b = GraphBuilder(name)
    prompt_len = b.input("prompt_len", np.int64, [1])
    share, hkv, d = policy.resolved_prompt_share, spec.num_kv_heads, spec.head_dim
    attrs = dict(sinks=policy.sinks, window=policy.window, kernel=policy.kernel, prompt_share=share,
                 pooling=policy.pooling, scope=policy.scope, scale=spec.head_dim ** -0.5, **PLUGIN_ATTRS)
    for i in range(spec.num_layers):
        q = b.input(f"window_query.{i}", np.float32, [1, spec.num_heads, policy.window, d])
        k = b.input(f"key.{i}", np.float32, [1, hkv, cache_rows, d])
        v = b.input(f"value.{i}", np.float32, [1, hkv, cache_rows, d])
        sel_k, sel_v, index = b.op(SELECT.name, q, k, v, prompt_len, outputs=3, domain=DOMAIN, **attrs)
        b.output(sel_k, f"selected_key.{i}", np.float32, [1, hkv, share, d])
        b.output(sel_v, f"selected_value.{i}", np.float32, [1, hkv, share, d])
        b.output(index, f"selected_index.{i}", np.int64, [1, hkv, share])
    model = b.model()
    model.opset_import.append(onnx.helper.make_opsetid(DOMAIN, 1))
    onnx.checker.check_model(model)
    return model
