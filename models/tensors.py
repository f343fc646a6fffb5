"""Where a model's weights come from, read one tensor at a time: the export streams them (each read,
converted and written before the next), so no step holds the whole model.

A TensorSource knows, before reading anything, every Hugging Face parameter name it holds and its
shape, checked against the shapes the config needs (`expected_shapes`); `read(name)` returns that
one tensor as float32 in Hugging Face layout ([out, in] for linear weights). Sources: a folder's
*.safetensors files (bf16 / fp16 / fp32, plain reads at the header's offsets), a GGUF file (dequantized per tensor as
transformers' GGUF loader does), seeded random values of a real model's shape, and a model already
in memory (the tiny test models).
"""
from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np

from snapcompile.errors import SnapcompileError, first_line, parse_json
from snapcompile.models.spec import hf_head_dim

ROTARY_BUFFER = "rotary_emb.inv_freq"
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def expected_shapes(config) -> dict[str, tuple[int, ...]]:
    """Every parameter of the transformers model `config` describes -> its shape (built on the meta
    device: no memory). A tied LM head is left out (it is the embedding)."""
    import torch
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", trust_remote_code=False)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items() if not k.endswith(ROTARY_BUFFER)}
    if getattr(config, "tie_word_embeddings", False):
        shapes.pop(HEAD, None)
    return shapes


class TensorSource:
    """name -> float32 array, one at a time. `shapes`: every name the source holds, in reading order
    (equal to `expected_shapes` of its config, checked when the source is made)."""

    shapes: dict[str, tuple[int, ...]]

    def read(self, name: str) -> np.ndarray:
        raise NotImplementedError


def holds_every_index(held: set[int], count) -> bool:
    """Whether `held` is exactly {0, ..., count - 1}: decided from `held` alone, so a declared count of
    any size costs nothing."""
    return isinstance(count, int) and not isinstance(count, bool) and len(held) == count \
        and (not held or (min(held) == 0 and max(held) == count - 1))


def check_layer_count(declared: int, names, where: str) -> None:
    """Refuse a checkpoint whose model.layers.N tensors are not exactly the `declared` layers (checked
    from names alone, before anything is built from the config)."""
    held = {int(n.split(".")[2]) for n in names if n.startswith("model.layers.") and n.split(".")[2].isdigit()}
    if not holds_every_index(held, declared):
        what = f"{len(held)} (model.layers.{min(held)} .. model.layers.{max(held)})" if held else "none"
        raise SnapcompileError(f"the weights in {where} do not fit the config: it declares {declared} layers "
                               f"(num_hidden_layers), the checkpoint holds {what}")


def check_against(found: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]], where: str) -> None:
    """Refuse a checkpoint whose tensors are not exactly the ones the config needs, naming the first."""
    missing, unexpected = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    if missing or unexpected:
        what = f"lacks {missing[0]}" if missing else f"has {unexpected[0]}, which the model does not"
        raise SnapcompileError(f"the weights in {where} do not fit the config: the checkpoint {what} "
                               f"({len(missing)} missing, {len(unexpected)} unexpected tensors)")
    for name in sorted(expected):
        if tuple(found[name]) != tuple(expected[name]):
            raise SnapcompileError(f"the weights in {where} do not fit the config: {name} has shape "
                                   f"{list(found[name])}, the config needs {list(expected[name])}")


def _named_as_model(names: list[str], tied: bool) -> dict[str, str]:
    """Model parameter name -> the checkpoint's name for it: old files' rotary buffers are dropped, and
    a tied model's embedding may be stored as its LM head."""
    names = [n for n in names if not n.endswith(ROTARY_BUFFER)]
    mapping = {n: n for n in names}
    if tied:
        if EMBED not in mapping and HEAD in mapping:
            mapping[EMBED] = mapping.pop(HEAD)
        else:
            mapping.pop(HEAD, None)
    return mapping


_SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "BF16": np.uint16}


class SafetensorsSource(TensorSource):
    """The *.safetensors files of a folder, parsed as safetensors (never pickle; index files are not
    read). Each file is checked by the safetensors library when the source is made; a tensor's bytes
    are read from the file when asked (a plain read, not a memory map, so pages read once do not stay
    in the process's resident memory), bf16 / fp16 / fp32 / fp64 converted to float32."""

    def __init__(self, folder: Path):
        """Reads the files' headers: the names and shapes found (`found`); `check` matches them to a config."""
        self.folder = Path(folder)
        files = sorted(p for p in self.folder.glob("*.safetensors") if p.is_file())
        if not files:
            raise SnapcompileError(f"{folder} has no *.safetensors weights (pickle checkpoints are not loaded)")
        self._where: dict[str, tuple[Path, str, int, int]] = {}    # name -> file, dtype, offset, count
        self.found: dict[str, tuple[int, ...]] = {}
        for path in files:
            entries = _safetensors_entries(path)
            repeated = sorted(self.found.keys() & entries.keys())
            if repeated:
                raise SnapcompileError(f"{path} repeats the tensor {repeated[0]} of another *.safetensors file")
            for name, (dtype, shape, offset) in entries.items():
                self.found[name] = shape
                self._where[name] = (path, dtype, offset, int(np.prod(shape)))

    def check(self, expected: dict[str, tuple[int, ...]], tied: bool) -> None:
        """Require exactly the tensors `expected` (a tied LM head may be stored as the embedding), in a
        float dtype; then `shapes` is `expected`."""
        self._stored = _named_as_model(list(self.found), tied)
        check_against({n: self.found[s] for n, s in self._stored.items()}, expected, str(self.folder))
        for stored in self._stored.values():
            path, dtype = self._where[stored][:2]
            if dtype not in _SAFETENSORS_DTYPES:
                raise SnapcompileError(f"{path}: {stored} is stored as {dtype}; weights must be BF16, F16, F32 "
                                       "or F64")
        self.shapes = dict(expected)

    def read(self, name: str) -> np.ndarray:
        path, dtype, offset, count = self._where[self._stored[name]]
        values = np.fromfile(path, dtype=_SAFETENSORS_DTYPES[dtype], count=count, offset=offset)
        if dtype == "BF16":                  # the upper half of a float32
            values = (values.astype(np.uint32) << 16).view(np.float32)
        return values.astype(np.float32, copy=False).reshape(self.shapes[name])


def _safetensors_entries(path: Path) -> dict[str, tuple[str, tuple[int, ...], int]]:
    """name -> (dtype, shape, absolute byte offset) of a safetensors file, after the safetensors library
    has checked the file (header, offsets within the file)."""
    from safetensors import SafetensorError, safe_open
    try:
        with safe_open(str(path), framework="pt"):
            pass
        with open(path, "rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            text = handle.read(size)
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise SnapcompileError(f"{path} is not a valid safetensors file: {first_line(err)}") from None
    header = parse_json(text, str(path))
    header.pop("__metadata__", None)
    return {name: (info["dtype"], tuple(info["shape"]), 8 + size + info["data_offsets"][0])
            for name, info in header.items()}


_GGUF_LAYER = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
               "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
               "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
               "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
               "attn_v.bias": "self_attn.v_proj.bias", "ffn_gate.weight": "mlp.gate_proj.weight",
               "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight",
               "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
_GGUF_GEMMA_LAYER = {"ffn_norm.weight": "pre_feedforward_layernorm.weight",
                     "post_attention_norm.weight": "post_attention_layernorm.weight",
                     "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
_GGUF_TOP = {"token_embd.weight": EMBED, "output.weight": HEAD, "output_norm.weight": "model.norm.weight"}
GGUF_SKIPPED = ("rope_freqs.weight",)    # llama3 files carry the RoPE frequencies the config also gives


def gguf_hf_name(gguf_name: str, architecture: str = "llama") -> str | None:
    """"blk.3.attn_q.weight" -> "model.layers.3.self_attn.q_proj.weight" (and the embedding, head and
    norms) in a GGUF of `architecture` (general.architecture: a gemma3 file's ffn_norm is the norm
    before the MLP, a llama file's the norm after the attention); None for a name that is not a
    parameter of a supported family."""
    if gguf_name in _GGUF_TOP:
        return _GGUF_TOP[gguf_name]
    layer = {**_GGUF_LAYER, **_GGUF_GEMMA_LAYER} if architecture == "gemma3" else _GGUF_LAYER
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer:
        return f"model.layers.{parts[1]}.{layer[parts[2]]}"
    return None


def gguf_norm_offset(architecture: str) -> float:
    """What a GGUF of `architecture` adds to every RMSNorm weight (llama.cpp stores Gemma's as 1 + w;
    transformers' loader subtracts it, and so does GGUFSource)."""
    return 1.0 if architecture == "gemma3" else 0.0


def unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """The row order transformers' GGUF loader applies to a llama file's q_proj / k_proj (undoing
    llama.cpp's interleaved-RoPE permutation): row r of the result is row order[r] of the file."""
    index = np.arange(rows).reshape(heads, rows // heads // 2, 2)
    return index.swapaxes(1, 2).reshape(rows)


def gguf_row_order(hf_name: str, config) -> np.ndarray | None:
    """The row order of `hf_name` in a GGUF file of `config` (None: as stored). transformers unpermutes
    q_proj / k_proj for model_type llama only; this follows it exactly."""
    if getattr(config, "model_type", None) != "llama" or not hf_name.endswith(("q_proj.weight", "k_proj.weight")):
        return None
    heads = config.num_attention_heads if hf_name.endswith("q_proj.weight") else config.num_key_value_heads
    return unpermute_rows(heads * hf_head_dim(config), heads)


class GGUFTensors:
    """A GGUF file's tensors (memory-mapped by gguf's reader): `by_name`, Hugging Face name -> the
    reader's tensor; `unknown`, the names of those no Llama-family model has (GGUF_SKIPPED aside)."""

    def __init__(self, path: Path):
        import gguf
        self.reader = gguf.GGUFReader(str(path))
        field = self.reader.fields.get("general.architecture")
        self.architecture = str(field.contents()) if field is not None else "llama"
        self.norm_offset = np.float32(gguf_norm_offset(self.architecture))
        self.by_name, self.unknown = {}, []
        for tensor in self.reader.tensors:
            name = gguf_hf_name(tensor.name, self.architecture)
            if name is not None:
                self.by_name[name] = tensor
            elif tensor.name not in GGUF_SKIPPED:
                self.unknown.append(tensor.name)

    def release(self, tensor) -> None:
        """Drop the resident pages of `tensor`'s bytes from the memory map (read-only: they are read
        again from the file if touched), so a file read tensor by tensor never stays resident."""
        import mmap
        mapping = getattr(self.reader.data, "_mmap", None)
        if mapping is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = tensor.data_offset // mmap.PAGESIZE * mmap.PAGESIZE
        mapping.madvise(mmap.MADV_DONTNEED, start, tensor.data_offset + tensor.n_bytes - start)


def gguf_values(tensor) -> np.ndarray:
    """A GGUF tensor's values as float32 [rows, row length] (the file's dims reversed), dequantized
    as llama.cpp dequantizes its type (gguf's reader; the K-quants and Q5_0 checked value for value
    against a decoder written from llama.cpp's block layouts in tests/test_gguf_kquants.py)."""
    import gguf
    return gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)


class GGUFSource(TensorSource):
    """The tensors of a GGUF file, each dequantized when read."""

    def __init__(self, path: Path, config, expected: dict[str, tuple[int, ...]]):
        self.config = config
        self.file = GGUFTensors(path)
        if self.file.unknown:
            raise SnapcompileError(f"GGUF file {path} holds {self.file.unknown[0]}, which a "
                                   f"{self.file.architecture} model of the supported families does not")
        tied = bool(getattr(config, "tie_word_embeddings", False))
        self._stored = _named_as_model(list(self.file.by_name), tied)
        found = {n: tuple(int(d) for d in reversed(self.file.by_name[s].shape)) for n, s in self._stored.items()}
        check_against(found, expected, str(path))
        self.shapes = dict(expected)

    def read(self, name: str) -> np.ndarray:
        tensor = self.file.by_name[self._stored[name]]
        values = gguf_values(tensor).reshape(self.shapes[name])
        order = gguf_row_order(name, self.config)
        values = np.ascontiguousarray(values if order is None else values[order])
        if name.endswith("norm.weight") and self.file.norm_offset:
            values = values - self.file.norm_offset
        self.file.release(tensor)
        return values


class RandomSource(TensorSource):
    """Seeded random values of a real model's shape, generated per tensor when read (so a model of any
    size is never held whole): normal(0, 0.02) matrices as transformers initialises them, norms of
    ones, zero biases. The same name and seed always give the same values."""

    def __init__(self, expected: dict[str, tuple[int, ...]], seed: int, std: float = 0.02):
        self.shapes, self.seed, self.std = dict(expected), seed, std

    def read(self, name: str) -> np.ndarray:
        shape = self.shapes[name]
        if name.endswith("norm.weight"):
            return np.ones(shape, np.float32)
        if name.endswith(".bias"):
            return np.zeros(shape, np.float32)
        rng = np.random.default_rng([self.seed, zlib.crc32(name.encode())])
        values = rng.standard_normal(shape, dtype=np.float32)
        values *= np.float32(self.std)
        return values


class ModuleSource(TensorSource):
    """The parameters of a model already in memory (the tiny test models, built whole)."""

    def __init__(self, model):
        tied = bool(getattr(model.config, "tie_word_embeddings", False))
        self._params = {k: v for k, v in model.state_dict().items()
                        if not k.endswith(ROTARY_BUFFER) and not (tied and k == HEAD)}
        self.shapes = {k: tuple(v.shape) for k, v in self._params.items()}

    def read(self, name: str) -> np.ndarray:
        return self._params[name].detach().float().numpy()


def model_from_source(config, source: TensorSource):
    """The float32 transformers model of `config` with `source`'s weights, copied in one tensor at a
    time (the model itself is the only whole copy held)."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32,
                                             trust_remote_code=False)
    params = model.state_dict()
    with torch.no_grad():
        for name in source.shapes:
            params[name].copy_(torch.from_numpy(source.read(name)))
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    return model.eval()


def rope_frequencies(config, layer_type: str | None = None) -> tuple[np.ndarray, float]:
    """(inv_freq float32 [head_dim / 2], attention_scaling) of `config`'s RoPE, computed by the
    transformers model's own rotary module (every rope_type it knows), without building the model.
    layer_type: "sliding_attention" or "full_attention" of a model whose layer kinds have rope bases of
    their own (Gemma 3; None: its full-attention layers')."""
    import sys

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    module = sys.modules[MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].__module__]
    rotary_class = next(getattr(module, n) for n in dir(module) if n.endswith("RotaryEmbedding"))
    rotary = rotary_class(config)
    if layer_type is None and not hasattr(rotary, "inv_freq"):
        layer_type = "full_attention"
    prefix = f"{layer_type}_" if layer_type else ""
    return (getattr(rotary, prefix + "inv_freq").detach().float().numpy(),
            float(getattr(rotary, prefix + "attention_scaling", 1.0)))
