"""The weights a graph holds: float arrays, or block-quantized linear layers (`--weights`).

Names in the graphs (a contract `graph_weights` reads back, for the oracle):
  embed_tokens [V, hidden] (float16 unless the weights are fp32: TensorRT's Gather takes no
  integer table), norm, l{i}.input_norm, l{i}.post_norm (the norm before the MLP), Gemma 3's
  l{i}.attn_out_norm and l{i}.mlp_out_norm (of the attention's and the MLP's outputs),
  l{i}.{q,k,v,o,gate,up,down}.bias, l{i}.{q_norm,k_norm} [D] (Qwen3's and Gemma 3's per-head query
  and key norms); every norm as the graphs multiply by it (Gemma's 1 + w: `Weights._add_norm`);
  a float linear layer "l{i}.q" is l{i}.q.wT [K, N] (float32, or float16 for --weights fp16,
  multiplied in float16 between two Casts); a quantized one is l{i}.q.qweight
  (INT4/INT8 [K, N]), l{i}.q.qscale [K/bs, N] and, for kept GGUF Q4_1 blocks, l{i}.q.qoffset.
  The LM head is the same with prefix "lm_head" (or embed_tokens itself when tied and float).

The graphs ONNX Runtime opens read some weights in another form, written once beside them (the
artifact's ort_weights.bin): a quantized layer as l{i}.q.nbits / l{i}.q.nbits_scales (MatMulNBits'
layout, `quantize.emit_nbits_matmul`), and a float16 weight a product reads as "<name>.float32" (its
values exactly: ONNX Runtime's CPU provider multiplies float16 in float32, and would otherwise fold a
float32 copy into every session).
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import torch
from onnx import TensorProto, numpy_helper

from snapcompile.config import HEAD_BITS, QUANT_BITS, ExportConfig
from snapcompile.export.quantize import BlockQuantized, QuantizedLayout, quantize
from snapcompile.models.spec import ModelSpec
from snapcompile.models.tensors import TensorSource, rope_frequencies

LINEARS = (("q", "self_attn.q_proj"), ("k", "self_attn.k_proj"), ("v", "self_attn.v_proj"),
           ("o", "self_attn.o_proj"), ("gate", "mlp.gate_proj"), ("up", "mlp.up_proj"), ("down", "mlp.down_proj"))
QK_NORMS = ("q_norm", "k_norm")     # self_attn.{q_norm,k_norm}.weight [D], where the model has them
# each layer's RMSNorms: graph role -> (graph name, Hugging Face name); "post_norm" is the norm before the MLP
NORMS = {"in_norm": ("input_norm", "input_layernorm"), "post_norm": ("post_norm", "post_attention_layernorm")}
SANDWICH_NORMS = {"in_norm": ("input_norm", "input_layernorm"), "attn_out_norm": ("attn_out_norm",
                  "post_attention_layernorm"), "post_norm": ("post_norm", "pre_feedforward_layernorm"),
                  "mlp_out_norm": ("mlp_out_norm", "post_feedforward_layernorm")}     # Gemma 3


def layer_norms(spec: ModelSpec) -> dict[str, tuple[str, str]]:
    """A layer's norms (role -> graph name, Hugging Face name) in `spec`'s family."""
    return SANDWICH_NORMS if spec.sandwich_norms else NORMS


class Quantizer:
    """Chooses each linear weight's stored form for `export.weight_format`: the GGUF file's own blocks
    where they are kept exactly (same block size, enough bits, verified values), else block
    quantization of the float weight here. Counts blocks of each kind, and for a GGUF tensor that
    was quantized in the file and is quantized again here (a K-quant, or blocks that cannot be kept)
    measures what the second rounding costs: its relative error against the file's own values."""

    def __init__(self, export: ExportConfig, gguf_blocks: dict | None = None, gguf_types: dict | None = None):
        """gguf_blocks: HF name -> the file's blocks that may be kept (GGUFBlocks); gguf_types: HF name
        -> the quantized type of the file's tensor (GGUFBlocks.quantized_types)."""
        self.bits = QUANT_BITS[export.weight_format]
        self.block_size = export.block_size
        self.gguf = gguf_blocks or {}
        self.gguf_types = gguf_types or {}
        self.exact = self.requantized = self.tensors = 0
        self.gguf_errors: dict[str, tuple[str, float]] = {}    # requantized GGUF tensor -> (its type, error)

    def __call__(self, hf_name: str, weight: np.ndarray, head: bool = False) -> BlockQuantized:
        from snapcompile.export.gguf_blocks import GGUF_BLOCK, kept_blocks
        bits = HEAD_BITS if head else self.bits
        matrix = None
        if hf_name in self.gguf and self.block_size == GGUF_BLOCK:
            matrix = kept_blocks(self.gguf[hf_name], weight, bits)
        if matrix is None:
            matrix = quantize(weight, bits, self.block_size, hf_name)
            if hf_name in self.gguf_types:
                self.gguf_errors[hf_name] = (self.gguf_types[hf_name], matrix.relative_error(weight))
        self.tensors += 1
        self.exact += matrix.exact_blocks
        self.requantized += matrix.requantized_blocks
        return matrix

    def report(self) -> dict:
        report = {"tensors": self.tensors, "block_size": self.block_size, "bits": self.bits, "head_bits": HEAD_BITS,
                  "exact_blocks": self.exact, "requantized_blocks": self.requantized,
                  "gguf_source": bool(self.gguf_types), "gguf_tensors_requantized": len(self.gguf_errors)}
        if self.gguf_errors:
            errors = {name: error for name, (_, error) in self.gguf_errors.items()}
            worst = max(errors, key=errors.get)
            report["gguf_requantized_types"] = dict(sorted(Counter(kind for kind, _ in self.gguf_errors.values())
                                                           .items()))
            report["gguf_requantized_error"] = {"median": float(np.median(list(errors.values()))),
                                                "max": errors[worst], "worst": worst}
            report["gguf_tensor_errors"] = {name: [kind, error] for name, (kind, error) in self.gguf_errors.items()}
        return report


class Weights:
    """The model's weights arranged for the graphs, read from a TensorSource one tensor at a time and
    converted (transposed, cast or quantized) as they are read.

    With a `store` (the artifact's weights.bin) each converted tensor is written as soon as it is made
    and only its layout is kept, so the export never holds more than one source tensor and its
    converted form (plus the small ones a graph keeps inline); without one the TensorProtos are kept
    here (in-memory graphs, tests). Graph writers read `dtype` (float initializers by name),
    `quantized` (QuantizedLayout by linear name), the layer dicts (roles -> names) and `tensor(name)`."""

    def __init__(self, tensors: TensorSource, spec: ModelSpec, config, quantizer: Quantizer | None = None,
                 half: bool = False, store=None, progress=None, ort_store=None):
        """half: linear weights (and the embedding) in float16 (--weights fp16). progress(name, done,
        total), when given, is called as each source tensor is read. ort_store: where the weights in
        ONNX Runtime's forms go (the artifact's ort_weights.bin; None: with `store`'s rule, in memory)."""
        self.source, self.quantizer, self.store, self.progress = tensors, quantizer, store, progress
        self.spec = spec
        self.ort_store = ort_store
        self.linear_dtype = np.float16 if half else np.float32
        self.dtype: dict[str, np.dtype] = {}
        self.quantized: dict[str, QuantizedLayout] = {}
        self._protos: dict[str, TensorProto] = {}
        self.written_bytes = self.read_count = self.ort_bytes = 0
        embed_dtype = np.float16 if quantizer or half else np.float32
        tied = spec.tie_word_embeddings or "lm_head.weight" not in tensors.shapes
        self.reads = len(tensors.shapes) + (1 if quantizer and tied else 0)   # a tied quantized head: twice
        self.embed = self._add("embed_tokens", self._read("model.embed_tokens.weight").astype(embed_dtype),
                               product=half and tied)
        self.embed_bytes = self.written_bytes
        self.lm_head = self.embed
        if not tied and not quantizer:      # [V, hidden] as stored: the graph's Gemm reads it transposed
            self.lm_head = self._add("lm_head", self._read("lm_head.weight").astype(self.linear_dtype), product=True)
        self.final_norm = self._add_norm("norm", "model.norm.weight")
        if quantizer is None:
            self.layers = [self._layer(i) for i in range(spec.num_layers)]
        else:   # every float tensor, then the linears, then the head: the order the graphs first wrote them in
            self.layers = [self._layer(i, linears=False) for i in range(spec.num_layers)]
            for i, names in enumerate(self.layers):
                names.update((short, self._linear_weight(f"l{i}.{short}", f"model.layers.{i}.{key}.weight"))
                             for short, key in LINEARS)
            self.lm_head = self._linear_weight("lm_head", "model.embed_tokens.weight" if tied else "lm_head.weight",
                                               head=True)
        self.inv_freq, self.attention_scaling = rope_frequencies(config)   # HF scales cos and sin by the latter
        # the local (sliding-window) layers' own (inv_freq, attention_scaling), where they have them
        self.local_rope = rope_frequencies(config, "sliding_attention") if spec.local_layers else None

    def _read(self, hf_name: str) -> np.ndarray:
        array = self.source.read(hf_name)
        self.read_count += 1
        if self.progress is not None:
            self.progress(hf_name, self.read_count, self.reads)
        return array

    def _keep(self, proto: TensorProto, ort: bool = False) -> None:
        """Write `proto` to weights.bin (ort: to ort_weights.bin, not counted in the weight bytes)."""
        store = self.ort_store if ort else self.store
        if ort:
            self.ort_bytes += len(proto.raw_data)
        else:
            self.written_bytes += len(proto.raw_data)
        kept = proto if store is None else store.add(proto)
        if kept is proto:          # in memory, or too small for the store: the graphs hold it
            self._protos[proto.name] = proto

    def _add(self, name: str, array: np.ndarray, product: bool = False) -> str:
        """A float initializer; `product`: a MatMul / Gemm reads it (a float16 one gets its float32
        form for ONNX Runtime)."""
        self.dtype[name] = array.dtype
        self._keep(numpy_helper.from_array(np.ascontiguousarray(array), name))
        if product and array.dtype == np.float16:
            self._keep(numpy_helper.from_array(array.astype(np.float32), float32_name(name)), ort=True)
        return name

    def _add_norm(self, name: str, hf_name: str) -> str:
        """An RMSNorm's weight as the graphs multiply by it: plus the family's norm offset (Gemma's 1 + w,
        computed in float32 as Hugging Face's model does)."""
        weight = self._read(hf_name)
        if self.spec.norm_offset:
            weight = np.float32(self.spec.norm_offset) + weight
        return self._add(name, weight)

    def _linear_weight(self, name: str, hf_name: str, head: bool = False) -> str:
        """The source's weight [N, K] (HF layout) stored as `name`: quantized, or transposed for MatMul."""
        if self.quantizer is None:
            return self._add(f"{name}.wT", self._read(hf_name).T.astype(self.linear_dtype), product=True)
        matrix = self.quantizer(hf_name, self._read(hf_name), head)
        self.quantized[name] = matrix.layout()
        for proto in matrix.initializers(name):
            self._keep(proto)
        for proto in matrix.nbits_initializers(name):
            self._keep(proto, ort=True)
        return name

    def _layer(self, i: int, linears: bool = True) -> dict[str, str]:
        """Layer i's role -> name dict: norms, biases and (when `linears`) the linear weights."""
        p = f"model.layers.{i}."
        names = {role: self._add_norm(f"l{i}.{name}", f"{p}{hf}.weight")
                 for role, (name, hf) in layer_norms(self.spec).items()}
        for short, key in LINEARS:
            if linears:
                names[short] = self._linear_weight(f"l{i}.{short}", p + key + ".weight")
            if p + key + ".bias" in self.source.shapes:
                names[short + "_bias"] = self._add(f"l{i}.{short}.bias", self._read(p + key + ".bias"))
        for short in QK_NORMS:
            if f"{p}self_attn.{short}.weight" in self.source.shapes:
                names[short] = self._add_norm(f"l{i}.{short}", f"{p}self_attn.{short}.weight")
        return names

    def float_names(self) -> list[str]:
        """The float initializers every graph attaches (norms, biases, embedding, float linears)."""
        return list(self.dtype)

    def tensor(self, name: str) -> TensorProto:
        """The TensorProto of initializer `name`, for a graph built without a store (or one too small
        for it); a tensor already written to the store is only referenced, never asked for."""
        proto = self._protos.get(name)
        if proto is None:
            raise KeyError(f"weight {name} was written to weights.bin and is not held in memory")
        return proto

    def nbytes(self) -> int:
        """Bytes of weights the graphs hold (each tensor once)."""
        return self.written_bytes

    def step_nbytes(self) -> int:
        """Bytes a decode step reads: all but the embedding table when the head is stored apart
        (a step gathers one row of it)."""
        return self.written_bytes - (self.embed_bytes if self.lm_head != self.embed else 0)


def float32_name(name: str) -> str:
    """The float32 form of float16 weight `name` that ONNX Runtime's graphs multiply by."""
    return f"{name}.float32"


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

    def norm(name: str) -> np.ndarray:     # the weight as stored in the model, its family's offset taken off
        return array(name) - np.float32(spec.norm_offset) if spec.norm_offset else array(name)

    out = {"model.embed_tokens.weight": array("embed_tokens"), "model.norm.weight": norm("norm")}
    head = linear("lm_head")
    out["lm_head.weight"] = head if head is not None else array("lm_head" if "lm_head" in init else "embed_tokens")
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        for name, hf in layer_norms(spec).values():
            out[f"{p}{hf}.weight"] = norm(f"l{i}.{name}")
        for short, key in LINEARS:
            out[p + key + ".weight"] = linear(f"l{i}.{short}")
            if f"l{i}.{short}.bias" in init:
                out[p + key + ".bias"] = array(f"l{i}.{short}.bias")
        for short in QK_NORMS:
            if f"l{i}.{short}" in init:
                out[f"{p}self_attn.{short}.weight"] = norm(f"l{i}.{short}")
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
