"""ONNX Runtime implementations of the custom ops (float32), via onnxruntime-extensions.

Importing this module registers the ops; `add_to(session_options)` makes a session able to run
plugin-lowered graphs. They call the PyTorch references, so they are for CPU validation of the
plugin lowering, not for speed.
"""
from __future__ import annotations

import numpy as np
import torch
from onnxruntime_extensions import PyCustomOpDef, get_library_path, onnx_op

from . import torch_ops
from .contracts import DECODE_ATTENTION, SELECT

_F, _I, _S = PyCustomOpDef.dt_float, PyCustomOpDef.dt_int64, PyCustomOpDef.dt_string


@onnx_op(op_type=DECODE_ATTENTION.name, inputs=[_F] * 5 + [_I] * 2, outputs=[_F], attrs={"scale": _F})
def _decode_attention(query, key, value, key_cache, value_cache, write_index, cache_len, **attrs):
    tensors = [torch.from_numpy(np.asarray(a)) for a in (query, key, value, key_cache, value_cache,
                                                         write_index, cache_len)]
    return torch_ops.decode_attention(*tensors, scale=float(attrs["scale"])).numpy()


@onnx_op(op_type=SELECT.name, inputs=[_F, _F, _F, _I], outputs=[_F, _F, _I],
         attrs={"sinks": _I, "window": _I, "kernel": _I, "prompt_share": _I, "scale": _F,
                "pooling": _S, "scope": _S})
def _select(window_query, key, value, prompt_len, **attrs):
    policy = torch_ops.policy_from_attrs(int(attrs["sinks"]), int(attrs["window"]), int(attrs["kernel"]),
                                         int(attrs["prompt_share"]), str(attrs["pooling"]), str(attrs["scope"]))
    picked = torch_ops.select(torch.from_numpy(np.asarray(window_query)), torch.from_numpy(np.asarray(key)),
                              torch.from_numpy(np.asarray(value)), int(np.asarray(prompt_len)[0]), policy,
                              float(attrs["scale"]))
    return tuple(t.numpy() for t in picked)


def add_to(options) -> None:
    """Register the custom-op library on an onnxruntime.SessionOptions."""
    options.register_custom_ops_library(get_library_path())
