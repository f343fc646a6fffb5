"""Contracts of the two custom ops that the plugin lowering emits: the one place their inputs,
outputs and attributes are listed (the lowering, the ONNX Runtime ops and the TensorRT plugin
all read them from here).

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
  not write the caches: the runner stores the new K/V at write_index after the step, so caches
  stay bound once and are never copied.

SnapKVSelect -- SnapKV prompt selection of one layer, run once per request after prefill
  inputs   window_query [1, H, W, D]    float32 | float16   queries of prompt positions T-W..T-1
           key, value   [1, Hkv, L, D]  same dtype           prefilled dense cache (rows >= T ignored)
           prompt_len   [1] int64                            T (> prompt_share)
  attrs    sinks, window, kernel, prompt_share (int); pooling ("max" | "avg"); scope
           ("head" | "layer"); scale (float)
  outputs  selected_key,
           selected_value [1, Hkv, P, D] same dtype          kept rows in position order
           selected_index [1, Hkv, P] int64                  their positions
  Selection rule: snapcompile.reference.policy.snapkv_select (docs/design.md, "The cache policy");
  its window scores also have a Triton kernel (plugins/triton_kernels.window_scores).
"""
from __future__ import annotations

from dataclasses import dataclass

DOMAIN = "ai.onnx.contrib"
PLUGIN_NAMESPACE = "snapcompile"
PLUGIN_VERSION = "1"
PLUGIN_ATTRS = {"plugin_version": PLUGIN_VERSION, "plugin_namespace": PLUGIN_NAMESPACE}


@dataclass(frozen=True)
class OpContract:
    """An op's tensors as (name, "float" | "int64") and attributes as (name, "int" | "float" | "string"),
    in node order."""

    name: str
    inputs: tuple[tuple[str, str], ...]
    outputs: tuple[tuple[str, str], ...]
    attrs: tuple[tuple[str, str], ...]

    @property
    def plugin_id(self) -> str:
        return f"{PLUGIN_NAMESPACE}::{self.name}"

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.inputs)

    @property
    def attr_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.attrs)

    def node_inputs(self, **tensors) -> list:
        """The tensors in the op's input order; every input named once, no other."""
        if set(tensors) != set(self.input_names):
            raise ValueError(f"{self.name} takes the inputs {', '.join(self.input_names)}, got {', '.join(tensors)}")
        return [tensors[name] for name in self.input_names]

    def node_attrs(self, **values) -> dict:
        """The node's attributes: exactly the contract's, plus the plugin's version and namespace."""
        if set(values) != set(self.attr_names):
            raise ValueError(f"{self.name} has the attributes {', '.join(self.attr_names)}, got {', '.join(values)}")
        return {**values, **PLUGIN_ATTRS}


DECODE_ATTENTION = OpContract(
    "SnapKVDecodeAttention",
    inputs=(("query", "float"), ("key", "float"), ("value", "float"), ("key_cache", "float"),
            ("value_cache", "float"), ("write_index", "int64"), ("cache_len", "int64")),
    outputs=(("attention", "float"),),
    attrs=(("scale", "float"),))

SELECT = OpContract(
    "SnapKVSelect",
    inputs=(("window_query", "float"), ("key", "float"), ("value", "float"), ("prompt_len", "int64")),
    outputs=(("selected_key", "float"), ("selected_value", "float"), ("selected_index", "int64")),
    attrs=(("sinks", "int"), ("window", "int"), ("kernel", "int"), ("prompt_share", "int"),
           ("pooling", "string"), ("scope", "string"), ("scale", "float")))
