"""The weights a graph holds: float arrays, or block-quantized linear layers (`--weights`).

Names in the graphs (a contract `graph_weights` reads back, for the oracle):
  embed_tokens [V, hidden] (float16 unless the weights are fp32: TensorRT's Gather takes no
  integer table), norm, l{i}.input_norm, l{i}.post_norm, l{i}.{q,k,v,o,gate,up,down}.bias;
  a float linear layer "l{i}.q" is l{i}.q.wT [K, N] (float32, or float16 for --weights fp16,
  multiplied in float16 between two Casts); a quantized one is l{i}.q.qweight
  (INT4/INT8 [K, N]), l{i}.q.qscale [K/bs, N] and, for kept GGUF Q4_1 blocks, l{i}.q.qoffset.
  The LM head is the same with prefix "lm_head" (or embed_tokens itself when tied and float).
"""
from __future__ import annotations

import numpy as np
import torch
from onnx import numpy_helper

from snapcompile.config import ExportConfig
from snapcompile.export.quantize import QUANT_BITS, BlockQuantized, quantize
from snapcompile.models.spec import ModelSpec

LINEARS = (("q", "self_attn.q_proj"), ("k", "self_attn.k_proj"), ("v", "self_attn.v_proj"),
           ("o", "self_attn.o_proj"), ("gate", "mlp.gate_proj"), ("up", "mlp.up_proj"), ("down", "mlp.down_proj"))
HEAD_BITS = 8   # the LM head stays 8-bit under int4, as llama.cpp's 4-bit files keep it


class Quantizer:
    """Chooses each linear weight's stored form for `export.weight_format`: the GGUF file's own blocks
    where they are kept exactly (same block size, enough bits, verified values), else block
    quantization of the float weight here. Counts blocks of each kind."""

    def __init__(self, export: ExportConfig, gguf_blocks: dict | None = None):
        self.bits = QUANT_BITS[export.weight_format]
        self.block_size = export.block_size
        self.gguf = gguf_blocks or {}
        self.exact = self.requantized = self.tensors = 0

    def __call__(self, hf_name: str, weight: np.ndarray, head: bool = False) -> BlockQuantized:
        from snapcompile.export.gguf_blocks import GGUF_BLOCK, kept_blocks
        bits = HEAD_BITS if head else self.bits
        matrix = None
        if hf_name in self.gguf and self.block_size == GGUF_BLOCK:
            matrix = kept_blocks(self.gguf[hf_name], weight, bits)
        if matrix is None:
            matrix = quantize(weight, bits, self.block_size, hf_name)
        self.tensors += 1
        self.exact += matrix.exact_blocks
        self.requantized += matrix.requantized_blocks
        return matrix

    def report(self) -> dict:
        return {"tensors": self.tensors, "block_size": self.block_size, "bits": self.bits, "head_bits": HEAD_BITS,
                "exact_blocks": self.exact, "requantized_blocks": self.requantized,
                "gguf_source": bool(self.gguf)}


class Weights:
    """The model's weights arranged for the graphs: `arrays` (float initializers by name) and
    `quantized` (BlockQuantized by linear name); layer dicts map roles to those names."""

    def __init__(self, model, spec: ModelSpec, quantizer: Quantizer | None = None, half: bool = False):
        """half: linear weights (and the embedding) in float16 (--weights fp16)."""
        state = {k: v.detach().to(torch.float32).numpy() for k, v in model.state_dict().items()}
        self.arrays: dict[str, np.ndarray] = {}
        self.quantized: dict[str, BlockQuantized] = {}
        self.quantizer = quantizer
        self.linear_dtype = np.float16 if half else np.float32
        embed = state["model.embed_tokens.weight"]
        self.embed = self._add("embed_tokens", embed.astype(np.float16) if quantizer or half else embed)
        head = state.get("lm_head.weight")
        tied = spec.tie_word_embeddings or head is None
        if quantizer:
            self.lm_head = self._linear_weight("lm_head", "lm_head.weight" if not tied else "model.embed_tokens.weight",
                                               embed if tied else head, head=True)
        else:
            self.lm_head = self.embed if tied else self._add("lm_head", head.astype(self.linear_dtype))
        self.final_norm = self._add("norm", state["model.norm.weight"])
        self.layers = [self._layer(state, i) for i in range(spec.num_layers)]
        rotary = model.model.rotary_emb
        self.inv_freq = rotary.inv_freq.detach().to(torch.float32).numpy()
        self.attention_scaling = float(getattr(rotary, "attention_scaling", 1.0))   # HF scales cos and sin by it

    def _add(self, name: str, array: np.ndarray) -> str:
        self.arrays[name] = np.ascontiguousarray(array)
        return name

    def _linear_weight(self, name: str, hf_name: str, weight: np.ndarray, head: bool = False) -> str:
        """weight [N, K] (HF layout) stored as `name`: quantized, or transposed for MatMul."""
        if self.quantizer is None:
            return self._add(f"{name}.wT", weight.T.astype(self.linear_dtype))
        self.quantized[name] = self.quantizer(hf_name, weight, head)
        return name

    def _layer(self, state: dict, i: int) -> dict[str, str]:
        p = f"model.layers.{i}."
        names = {"in_norm": self._add(f"l{i}.input_norm", state[p + "input_layernorm.weight"]),
                 "post_norm": self._add(f"l{i}.post_norm", state[p + "post_attention_layernorm.weight"])}
        for short, key in LINEARS:
            names[short] = self._linear_weight(f"l{i}.{short}", p + key + ".weight", state[p + key + ".weight"])
            if p + key + ".bias" in state:
                names[short + "_bias"] = self._add(f"l{i}.{short}.bias", state[p + key + ".bias"])
        return names

    def nbytes(self) -> int:
        """Bytes of weights the graphs hold (each tensor once)."""
        return sum(a.nbytes for a in self.arrays.values()) + sum(q.nbytes() for q in self.quantized.values())

    def step_nbytes(self) -> int:
        """Bytes a decode step reads: all but the embedding table when the head is stored apart
        (a step gathers one row of it)."""
        return self.nbytes() - (self.arrays[self.embed].nbytes if self.lm_head != self.embed else 0)


def graph_weights(model, spec: ModelSpec) -> dict[str, np.ndarray]:
    """HF parameter name -> float32 array: the weights a decode graph (loaded with its data)
    holds, dequantized exactly as its DequantizeLinear nodes define them."""
    init = {t.name: t for t in model.graph.initializer}
    array = lambda name: numpy_helper.to_array(init[name]).astype(np.float32)   # noqa: E731

    def linear(name: str) -> np.ndarray | None:
        if f"{name}.wT" in init:
            return array(f"{name}.wT").T
        if f"{name}.qweight" not in init:
            return None
        values = numpy_helper.to_array(init[f"{name}.qweight"]).astype(np.int8).T      # [N, K]
        scales = array(f"{name}.qscale").T
        offsets = array(f"{name}.qoffset").T if f"{name}.qoffset" in init else None
        block = values.shape[1] // scales.shape[1]
        return BlockQuantized(values, scales, offsets, 8, block).dequantize()

    out = {"model.embed_tokens.weight": array("embed_tokens"), "model.norm.weight": array("norm")}
    head = linear("lm_head")
    out["lm_head.weight"] = head if head is not None else array("lm_head" if "lm_head" in init else "embed_tokens")
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = array(f"l{i}.input_norm")
        out[p + "post_attention_layernorm.weight"] = array(f"l{i}.post_norm")
        for short, key in LINEARS:
            out[p + key + ".weight"] = linear(f"l{i}.{short}")
            if f"l{i}.{short}.bias" in init:
                out[p + key + ".bias"] = array(f"l{i}.{short}.bias")
    return out


def round_linears_to_half(model) -> None:
    """Make the HF model's linear layers (and head) compute as a --weights fp16 graph does: input
    rounded to float16, product rounded to float16 (weights are float16 values already)."""
    def to_half(tensor):
        return tensor.to(torch.float16).to(torch.float32)
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(lambda mod, args: (to_half(args[0]), *args[1:]))
            module.register_forward_hook(     # the graph adds a bias after rounding the product
                lambda mod, args, out: to_half(out) if mod.bias is None else to_half(out - mod.bias) + mod.bias)


def load_graph_weights(model, weights: dict[str, np.ndarray]) -> None:
    """Put `weights` (graph_weights) into the HF model, untying the LM head from the embedding
    where the graph holds them apart (quantized head, float16 embedding)."""
    with torch.no_grad():
        if model.lm_head.weight is model.model.embed_tokens.weight:
            model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
        params = dict(model.named_parameters())
        for name, value in weights.items():
            params[name].copy_(torch.from_numpy(np.ascontiguousarray(value)))
