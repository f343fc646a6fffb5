"""ONNX Runtime implementations of the custom ops (float32), via onnxruntime-extensions.

Importing this module registers the ops with the types of plugins.contracts; `add_to(session_options)`
makes a session able to run plugin-lowered graphs. They call the PyTorch references, so they are
for CPU validation of the plugin lowering, not for speed.
"""
from __future__ import annotations

import numpy as np
import torch
from onnxruntime_extensions import PyCustomOpDef, get_library_path, onnx_op

from . import torch_ops
from .contracts import DECODE_ATTENTION, SELECT, OpContract

_TYPES = {"float": PyCustomOpDef.dt_float, "int64": PyCustomOpDef.dt_int64, "int": PyCustomOpDef.dt_int64,
          "string": PyCustomOpDef.dt_string}
_CASTS = {"float": float, "int": int, "string": str}


def _register(contract: OpContract):
    """onnx_op with the contract's types; the function gets torch tensors and typed attributes."""
    def decorate(func):
        def call(*arrays, **attrs):
            tensors = [torch.from_numpy(np.asarray(a)) for a in arrays]
            typed = {name: _CASTS[kind](attrs[name]) for name, kind in contract.attrs}
            out = func(*tensors, **typed)
            return tuple(t.numpy() for t in out) if isinstance(out, tuple) else out.numpy()
        return onnx_op(op_type=contract.name, inputs=[_TYPES[t] for _, t in contract.inputs],
                       outputs=[_TYPES[t] for _, t in contract.outputs],
                       attrs={name: _TYPES[kind] for name, kind in contract.attrs})(call)
    return decorate


@_register(DECODE_ATTENTION)
def _decode_attention(query, key, value, key_cache, value_cache, write_index, cache_len, scale):
    return torch_ops.decode_attention(query, key, value, key_cache, value_cache, write_index, cache_len, scale=scale)


@_register(SELECT)
def _select(window_query, key, value, prompt_len, sinks, window, kernel, prompt_share, pooling, scope, scale):
    policy = torch_ops.policy_from_attrs(sinks, window, kernel, prompt_share, pooling, scope)
    return torch_ops.select(window_query, key, value, int(prompt_len[0]), policy, scale)


def add_to(options) -> None:
    """Register the custom-op library on an onnxruntime.SessionOptions."""
    options.register_custom_ops_library(get_library_path())
