"""Contracts of the two custom ops that the plugin lowering emits.

Op type = TensorRT plugin name; nodes carry `plugin_version` and `plugin_namespace`, which
TensorRT's ONNX parser uses to find the plugin creator (namespace "snapcompile", version "1").
The ONNX domain is "ai.onnx.contrib", where onnxruntime-extensions registers the ONNX Runtime
implementations of the same ops (plugins/ort_ops.py).

SnapKVDecodeAttention -- fused decode attention over a fixed-budget ring cache
  inputs   query        [N, Hkv, G, D]  float32 | float16   post-RoPE queries, G = heads per KV head
           key, value   [N, Hkv, 1, D]  same dtype           the new token's post-RoPE K/V
           key_cache,
           value_cache  [N, Hkv, B, D]  same dtype           the slots' caches
           write_index  [N] int64                            ring row the new token goes to
           cache_len    [N] int64                            rows [0, cache_len) valid before the write
  attrs    scale (float): score scale, usually D ** -0.5
  outputs  attention    [N, Hkv, G, D]  same dtype
  Each query attends to rows r < cache_len, r != write_index, and to the new token. The op does
  not write the caches through its ONNX interface: the runner stores the new K/V at write_index
  after the step, so caches stay bound once and are never copied. The Triton kernel can also
  do that store itself (write_cache=True) for backends that alias the caches in place.

SnapKVSelect -- SnapKV prompt selection of one layer, run once per request after prefill
  inputs   window_query [1, H, W, D]    float32 | float16   queries of prompt positions T-W..T-1
           key, value   [1, Hkv, L, D]  same dtype           prefilled dense cache (rows >= T ignored)
           prompt_len   [1] int64                            T (> prompt_share)
  attrs    sinks, window, kernel, prompt_share (int); pooling ("max" | "avg"); scope
           ("head" | "layer"); scale (float)
  outputs  selected_key,
           selected_value [1, Hkv, P, D] same dtype          kept rows in position order
           selected_index [1, Hkv, P] int64                  their positions
  Selection rule: snapcompile.policy_torch.snapkv_select (docs/design.md, "The cache policy"); its window scores
  also have a Triton kernel (plugins/triton_kernels.window_scores).
"""
from __future__ import annotations

from dataclasses import dataclass

DOMAIN = "ai.onnx.contrib"
PLUGIN_NAMESPACE = "snapcompile"
PLUGIN_VERSION = "1"


@dataclass(frozen=True)
class OpContract:
    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    int_attrs: tuple[str, ...] = ()
    float_attrs: tuple[str, ...] = ()
    string_attrs: tuple[str, ...] = ()

    @property
    def plugin_id(self) -> str:
        return f"{PLUGIN_NAMESPACE}::{self.name}"


DECODE_ATTENTION = OpContract(
    "SnapKVDecodeAttention",
    inputs=("query", "key", "value", "key_cache", "value_cache", "write_index", "cache_len"),
    outputs=("attention",), float_attrs=("scale",))

SELECT = OpContract(
    "SnapKVSelect",
    inputs=("window_query", "key", "value", "prompt_len"),
    outputs=("selected_key", "selected_value", "selected_index"),
    int_attrs=("sinks", "window", "kernel", "prompt_share"), float_attrs=("scale",),
    string_attrs=("pooling", "scope"))
