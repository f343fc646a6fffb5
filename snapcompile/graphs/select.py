"""The SnapKV selection graph: in standard ONNX ops (`SelectionWriter`, docs/design.md, "The cache
policy"), or as one SnapKVSelect node per layer for the plugin lowering (`plugin_select_graph`).

Inputs: prompt_len [1] int64 (P < T <= L); per layer window_query.{i} [1, H, W, D],
key.{i}, value.{i} [1, Hkv, L, D] (the prefilled dense cache, rows >= T ignored). L is the
artifact's max_context for the graph "select", a prefill bucket's rows for "select_<L>", symbolic
(a SymbolicSize) in ONNX Runtime's graph of the family.
Outputs per layer: selected_key.{i}, selected_value.{i} [1, Hkv, P, D] and
selected_index.{i} [1, Hkv, P] int64, positions ascending.
"""
from __future__ import annotations

import numpy as np
import onnx

from snapcompile.config import PolicyConfig
from snapcompile.graphs.attention import MASK_MIN, additive_mask
from snapcompile.graphs.builder import GraphBuilder, Size, SymbolicSize
from snapcompile.graphs.checks import check_graph
from snapcompile.models.spec import ModelSpec
from snapcompile.plugins.contracts import DOMAIN, SELECT


class SelectionWriter:
    """The selection of the `layers` layers, their inputs and outputs named by layer index (default:
    the model's global layers, every one but Gemma 3's local layers; [0] for the layer-by-layer prefill's
    select_layer, which selects one layer's rows as soon as they are prefilled)."""

    def __init__(self, spec: ModelSpec, policy: PolicyConfig, cache_rows: Size, name: str = "select",
                 layers: list[int] | None = None):
        self.spec, self.policy, self.length, self.name = spec, policy, cache_rows, name
        self.layers = spec.global_layers if layers is None else layers

    def build(self) -> onnx.ModelProto:
        s, p, L = self.spec, self.policy, self.length
        b = GraphBuilder(self.name)
        prompt_len = b.input("prompt_len", np.int64, [1])
        positions = b.arange(L)
        window_start = b.op("Sub", prompt_len, b.const([p.window]))
        prefix = b.op("Less", positions, window_start)                                    # [L]
        fixed = b.op("Or", b.op("Less", positions, b.const([p.sinks])),
                     b.op("And", b.op("Not", prefix), b.op("Less", positions, prompt_len)))
        candidate = b.op("And", prefix, b.op("GreaterOrEqual", positions, b.const([p.sinks])))
        for i in self.layers:
            q = b.input(f"window_query.{i}", np.float32, [1, s.num_heads, p.window, s.head_dim])
            k = b.input(f"key.{i}", np.float32, [1, s.num_kv_heads, L, s.head_dim])
            v = b.input(f"value.{i}", np.float32, [1, s.num_kv_heads, L, s.head_dim])
            scores = self._window_scores(b, q, k, window_start)
            index = self._select(b, scores, prefix, candidate, fixed)
            self._gather_outputs(b, i, k, v, index)
        model = b.model()
        check_graph(model, self.name, symbolic=(L.name,) if isinstance(L, SymbolicSize) else ())
        return model

    def _window_scores(self, b: GraphBuilder, q: str, k: str, window_start: str) -> str:
        """[1, Hkv or 1, L] mean window attention per position (summed over heads for layer scope)."""
        s, p = self.spec, self.policy
        rows = s.group_size * p.window
        q = b.op("Reshape", q, b.const([1, s.num_kv_heads, rows, s.head_dim]))
        logits = b.op("Mul", b.op("MatMul", q, b.op("Transpose", k, perm=[0, 1, 3, 2])),
                      b.const(s.attention_scale, np.float32))                            # [1,Hkv,G*W,L]
        query_pos = b.op("Add", b.const((np.arange(rows) % p.window)[:, None]), window_start)
        visible = b.op("LessOrEqual", self._row_positions(b), query_pos)                   # [G*W, L]
        probs = b.op("Softmax", b.op("Add", logits, additive_mask(b, visible)), axis=-1)
        score = b.op("ReduceMean", probs, b.const([2]), keepdims=0)                       # [1,Hkv,L]
        if p.scope == "layer":
            score = b.op("ReduceSum", score, b.const([1]), keepdims=1)                    # [1,1,L]
        return score

    def _select(self, b: GraphBuilder, score: str, prefix: str, candidate: str, fixed: str) -> str:
        """Pool, pick the top P-S-W candidates, add sinks and window; [1, R, P] ascending."""
        p = self.policy
        pad = p.kernel // 2
        # pooled as 2-D over [.., 1, L] (kernel 1 x K): TensorRT pools 2-D or 3-D only
        attrs = dict(kernel_shape=[1, p.kernel], pads=[0, pad, 0, pad], strides=[1, 1])
        if p.pooling == "max":
            masked = b.op("Where", prefix, score, b.const(MASK_MIN, np.float32))
            pooled = b.op("MaxPool", b.op("Unsqueeze", masked, b.const([2])), **attrs)
        else:
            masked = b.op("Where", prefix, score, b.const(0.0, np.float32))
            pooled = b.op("AveragePool", b.op("Unsqueeze", masked, b.const([2])), count_include_pad=1, **attrs)
        pooled = b.op("Squeeze", pooled, b.const([2]))
        ranked = b.op("Where", candidate, pooled, b.const(MASK_MIN, np.float32))
        need = p.resolved_prompt_share - p.sinks - p.window
        _, top = b.op("TopK", ranked, b.const([need]), outputs=2, axis=-1, largest=1, sorted=1)
        chosen = b.op("ScatterElements", b.op("Mul", ranked, b.const(0.0, np.float32)), top,
                      b.op("Add", b.op("Cast", top, to=1), b.const(1.0, np.float32)), axis=-1)
        keep = b.op("Or", b.op("Greater", chosen, b.const(0.0, np.float32)), fixed)
        order_key = b.op("Where", keep, self._descending(b), b.const(-1.0, np.float32))
        _, index = b.op("TopK", order_key, b.const([p.resolved_prompt_share]), outputs=2, axis=-1,
                        largest=1, sorted=1)
        return index

    def _row_positions(self, b: GraphBuilder) -> str:
        """int64 [1, L]: each cache row's position."""
        L = self.length
        if isinstance(L, SymbolicSize):
            return b.op("Unsqueeze", b.arange(L), b.const([0]))
        return b.const(np.arange(L)[None, :])

    def _descending(self, b: GraphBuilder) -> str:
        """float32 [L]: L - position, so that TopK of the kept rows orders them by position."""
        L = self.length
        if isinstance(L, SymbolicSize):
            return b.op("Cast", b.op("Sub", b.size_vector(L), b.arange(L)), to=1)
        return b.const((L - np.arange(L)).astype(np.float32), np.float32)

    def _gather_outputs(self, b: GraphBuilder, i: int, k: str, v: str, index: str) -> None:
        s, share = self.spec, self.policy.resolved_prompt_share
        index = b.op("Expand", index, b.const([1, s.num_kv_heads, share]))               # [1,Hkv,P]
        wide = b.op("Expand", b.op("Unsqueeze", index, b.const([-1])),
                    b.const([1, s.num_kv_heads, share, s.head_dim]))
        shape = [1, s.num_kv_heads, share, s.head_dim]
        b.output(b.op("GatherElements", k, wide, axis=2), f"selected_key.{i}", np.float32, shape)
        b.output(b.op("GatherElements", v, wide, axis=2), f"selected_value.{i}", np.float32, shape)
        b.output(index, f"selected_index.{i}", np.int64, [1, s.num_kv_heads, share])


def plugin_select_graph(spec: ModelSpec, policy: PolicyConfig, cache_rows: int,
                        name: str = "select") -> onnx.ModelProto:
    """The select graph over `cache_rows` rows with one SnapKVSelect node per layer: the same I/O
    as `SelectionWriter`'s, for the plugin lowering."""
    b = GraphBuilder(name)
    prompt_len = b.input("prompt_len", np.int64, [1])
    share, hkv, d = policy.resolved_prompt_share, spec.num_kv_heads, spec.head_dim
    attrs = SELECT.node_attrs(sinks=policy.sinks, window=policy.window, kernel=policy.kernel, prompt_share=share,
                              pooling=policy.pooling, scope=policy.scope, scale=spec.attention_scale)
    for i in spec.global_layers:
        inputs = SELECT.node_inputs(
            window_query=b.input(f"window_query.{i}", np.float32, [1, spec.num_heads, policy.window, d]),
            key=b.input(f"key.{i}", np.float32, [1, hkv, cache_rows, d]),
            value=b.input(f"value.{i}", np.float32, [1, hkv, cache_rows, d]), prompt_len=prompt_len)
        sel_k, sel_v, index = b.op(SELECT.name, *inputs, outputs=3, domain=DOMAIN, **attrs)
        b.output(sel_k, f"selected_key.{i}", np.float32, [1, hkv, share, d])
        b.output(sel_v, f"selected_value.{i}", np.float32, [1, hkv, share, d])
        b.output(index, f"selected_index.{i}", np.int64, [1, hkv, share])
    model = b.model()
    model.opset_import.append(onnx.helper.make_opsetid(DOMAIN, 1))
    check_graph(model, name, strict=False)
    return model
