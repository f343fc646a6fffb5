"""TensorRT plugins for the two custom ops, via TensorRT 10's `tensorrt.plugin` Python API (QDP).

`register()` registers "snapcompile::SnapKVDecodeAttention" (its impl launches the Triton kernel
of plugins/triton_kernels.py on TensorRT's stream) and "snapcompile::SnapKVSelect" (window
scores by the Triton kernel, pooling / top-k / gather by PyTorch ops on the GPU; selection runs
once per request). TensorRT's ONNX parser maps
the plugin-lowered nodes to them by op type, plugin_version and plugin_namespace.

Written against the documented API (tensorrt.plugin.register / impl, TensorDesc.like,
shape_expr); it has not been run here: no TensorRT on CI machines (see docs/design.md). No
`from __future__ import annotations`: tensorrt.plugin reads the functions' annotations as
objects (trtp.TensorDesc, ...), which string annotations would not be. The parameter names are
the contracts' (plugins.contracts), checked by the tests with a stand-in for tensorrt.plugin.
"""
from snapcompile.errors import SnapcompileError

from .contracts import DECODE_ATTENTION, SELECT

TRT_EXTRA_HINT = 'pip install "snapcompile[trt]" (TensorRT 10.8+ with an NVIDIA GPU and CUDA)'
_registered = False


def require_tensorrt():
    """Import tensorrt or fail with the extra to install."""
    try:
        import tensorrt
    except ImportError:
        raise SnapcompileError(f"TensorRT is not installed here: {TRT_EXTRA_HINT}") from None
    return tensorrt


def register() -> None:
    """Register both plugins with TensorRT (idempotent)."""
    global _registered
    if _registered:
        return
    trt = require_tensorrt()
    try:
        import tensorrt.plugin as trtp
    except ImportError:
        raise SnapcompileError(f"this TensorRT has no tensorrt.plugin API: {TRT_EXTRA_HINT}") from None
    _register_decode(trtp)
    _register_select(trtp, trt)
    _registered = True


def _torch_views(*tensors):
    import torch
    return [torch.as_tensor(t, device="cuda") for t in tensors]


def _register_decode(trtp) -> None:
    @trtp.register(DECODE_ATTENTION.plugin_id)
    def _describe(query: trtp.TensorDesc, key: trtp.TensorDesc, value: trtp.TensorDesc,
                  key_cache: trtp.TensorDesc, value_cache: trtp.TensorDesc, write_index: trtp.TensorDesc,
                  cache_len: trtp.TensorDesc, scale: float) -> trtp.TensorDesc:
        return query.like()

    @trtp.impl(DECODE_ATTENTION.plugin_id)
    def _run(query: trtp.Tensor, key: trtp.Tensor, value: trtp.Tensor, key_cache: trtp.Tensor,
             value_cache: trtp.Tensor, write_index: trtp.Tensor, cache_len: trtp.Tensor, scale: float,
             outputs: tuple[trtp.Tensor], stream: int) -> None:
        import torch

        from .triton_kernels import decode_attention
        q, k, v, kc, vc, w, n, out = _torch_views(query, key, value, key_cache, value_cache, write_index,
                                                  cache_len, outputs[0])
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            decode_attention(q, k, v, kc, vc, w, n, scale, out=out)


def _register_select(trtp, trt) -> None:
    @trtp.register(SELECT.plugin_id)
    def _describe(window_query: trtp.TensorDesc, key: trtp.TensorDesc, value: trtp.TensorDesc,
                  prompt_len: trtp.TensorDesc, sinks: int, window: int, kernel: int, prompt_share: int,
                  pooling: str, scope: str, scale: float) -> tuple[trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc]:
        batch, heads, dim = key.shape_expr[0], key.shape_expr[1], key.shape_expr[3]
        rows = trtp.ShapeExprs.from_tuple((batch, heads, prompt_share, dim))
        selected_key = trtp.from_shape_expr(rows, dtype=key.dtype)
        selected_index = trtp.from_shape_expr(trtp.ShapeExprs.from_tuple((batch, heads, prompt_share)),
                                              dtype=trt.int64)
        return selected_key, trtp.from_shape_expr(rows, dtype=key.dtype), selected_index

    @trtp.impl(SELECT.plugin_id)
    def _run(window_query: trtp.Tensor, key: trtp.Tensor, value: trtp.Tensor, prompt_len: trtp.Tensor,
             sinks: int, window: int, kernel: int, prompt_share: int, pooling: str, scope: str, scale: float,
             outputs: tuple[trtp.Tensor, trtp.Tensor, trtp.Tensor], stream: int) -> None:
        import torch

        from . import torch_ops, triton_kernels
        policy = torch_ops.policy_from_attrs(sinks, window, kernel, prompt_share, pooling, scope)
        q, k, v, length, out_k, out_v, out_i = _torch_views(window_query, key, value, prompt_len, *outputs)
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            picked_k, picked_v, index = torch_ops.select(q, k, v, int(length[0].item()), policy, scale,
                                                         scorer=triton_kernels.window_scores)
            out_k.copy_(picked_k)
            out_v.copy_(picked_v)
            out_i.copy_(index)
