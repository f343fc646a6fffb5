"""The architecture facts the exporter needs, read from a Hugging Face config."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from types import SimpleNamespace

import numpy as np

from snapcompile.errors import SnapcompileError
from snapcompile.layout import WindowRing

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Gemma3ForCausalLM")
_ARCHITECTURE_OF_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                         "qwen3": "Qwen3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Gemma3ForCausalLM")   # an RMSNorm over each head's queries and keys
GEMMA_ARCHITECTURES = ("Gemma3ForCausalLM",)
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}     # Hugging Face's name -> the graphs'
_MULTIMODAL = {"gemma3": "Gemma 3's multimodal checkpoints (model_type gemma3); convert the text model "
                         "(Gemma3ForCausalLM, model_type gemma3_text) or its GGUF"}
_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim", "max_position_embeddings")


def architecture_of(architectures, model_type) -> str:
    """The supported architecture a config names (its first `architectures` entry, else its
    model_type), or a one-line error naming what it is and what is supported."""
    arch = architectures[0] if isinstance(architectures, list) and architectures else None
    if model_type in _MULTIMODAL and arch != "Gemma3ForCausalLM":
        raise SnapcompileError(f"unsupported architecture {arch or model_type!r}: snapcompile converts text models, "
                               f"not {_MULTIMODAL[model_type]}")
    if arch is None:
        arch = _ARCHITECTURE_OF_TYPE.get(model_type)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise SnapcompileError(f"unsupported architecture {arch or model_type or '?'!r}; "
                               f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return arch


def check_config_dict(raw, where: str) -> None:
    """A raw config.json: a JSON object of a supported architecture whose sizes, where given,
    are positive integers (checked before transformers sees it, so a bad file is one error line)."""
    if not isinstance(raw, dict):
        raise SnapcompileError(f"{where} must hold a JSON object, not {type(raw).__name__}")
    if architecture_of(raw.get("architectures"), raw.get("model_type")) in GEMMA_ARCHITECTURES:
        try:
            _check_gemma(SimpleNamespace(**{"query_pre_attn_scalar": 256, **raw}))   # transformers' default
        except SnapcompileError as err:
            raise SnapcompileError(f"{where}: {err}") from None
    for key in _SIZES:
        value = raw.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SnapcompileError(f"{where}: {key} must be a positive integer, got {value!r}")
    _check_values(raw, where)


_BOOLS = ("tie_word_embeddings", "attention_bias", "use_sliding_window", "mlp_bias")
_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


def _check_values(raw: dict, where: str) -> None:
    """The values the exported graphs depend on, typed and in range: a wrong one must fail here,
    not export a model that prints garbage."""
    eps = raw.get("rms_norm_eps", 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
        raise SnapcompileError(f"{where}: rms_norm_eps must be a number in (0, 1), got {eps!r}")
    theta = raw.get("rope_theta", 10000.0)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0 < theta < float("inf"):
        raise SnapcompileError(f"{where}: rope_theta must be a positive number, got {theta!r}")
    for key in _BOOLS:
        if key in raw and not isinstance(raw[key], bool):
            raise SnapcompileError(f"{where}: {key} must be true or false, got {raw[key]!r}")
    eos = raw.get("eos_token_id")
    eos_ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in eos_ids):
        raise SnapcompileError(f"{where}: eos_token_id must be a token id or a list of them, got {eos!r}")
    hidden, heads = raw.get("hidden_size"), raw.get("num_attention_heads")
    if hidden and heads and "head_dim" not in raw and hidden % heads:
        raise SnapcompileError(f"{where}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
    kv_heads = raw.get("num_key_value_heads")
    if heads and kv_heads and heads % kv_heads:
        raise SnapcompileError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads "
                               f"{kv_heads}")
    scaling = raw.get("rope_scaling")
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
        if kind not in _ROPE_TYPES:
            raise SnapcompileError(f"{where}: rope_scaling must name a rope_type of {', '.join(_ROPE_TYPES)}, "
                                   f"got {scaling!r}")


@dataclass(frozen=True)
class ModelSpec:
    """Static description of a Llama-family decoder (all sizes in elements)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_positions: int
    rms_norm_eps: float
    qkv_bias: bool
    tie_word_embeddings: bool
    sliding_window: int | None = None
    qk_norm: bool = False         # RMSNorm (rms_norm_eps) of each head's queries and keys before RoPE (Qwen3, Gemma 3)
    # Gemma 3 (the defaults are the Llama family's; to_dict leaves defaults out):
    activation: str = "silu"      # of the MLP's gate: "silu", or "gelu_tanh" (GELU, tanh approximation)
    embed_scale: float = 1.0      # the embeddings are multiplied by it (Gemma: sqrt(hidden_size))
    norm_offset: float = 0.0      # every RMSNorm multiplies by (offset + weight) (Gemma: 1)
    sandwich_norms: bool = False  # RMSNorms on the attention's and the MLP's outputs too (Gemma: 4 a layer)
    query_scale: float | None = None   # the attention's score scale (None: head_dim ** -0.5)
    local_layers: tuple[int, ...] = ()  # layers of sliding-window attention, with the local rope base

    def window_ring(self, chunk: int) -> WindowRing | None:
        """The cache of the local (sliding-window) layers for prefill chunks of `chunk` tokens, None where
        the model has none."""
        return WindowRing.for_export(self.sliding_window, chunk) if self.local_layers else None

    @property
    def global_layers(self) -> list[int]:
        """The layers attending to every position (all but the local ones): the layers a policy compresses."""
        return [i for i in range(self.num_layers) if i not in self.local_layers]

    @property
    def attention_scale(self) -> float:
        """The factor of every attention score q.k (Gemma 3: query_pre_attn_scalar ** -0.5)."""
        return self.query_scale if self.query_scale is not None else self.head_dim ** -0.5

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def weight_bytes(self) -> int:
        """float32 bytes of the model's parameters (embedding, every layer's projections and norms,
        the final norm, the LM head unless tied), computed from the sizes alone."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        layer = h * q + 2 * h * kv + q * h + 3 * h * self.intermediate_size + 2 * h
        layer += (q + 2 * kv) if self.qkv_bias else 0
        layer += 2 * self.head_dim if self.qk_norm else 0
        layer += 2 * h if self.sandwich_norms else 0
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return 4 * (self.vocab_size * h + self.num_layers * layer + h + head)

    @property
    def kv_bytes_per_token(self) -> int:
        """fp32 K and V bytes one token occupies across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4

    def to_dict(self) -> dict:
        """The fields; those added since format 8 only where they differ from their default (manifests of
        the other families read as before)."""
        fields = asdict(self)
        for name, default in _OPTIONAL_DEFAULTS.items():
            if fields[name] == default:
                del fields[name]
        if "local_layers" in fields:
            fields["local_layers"] = list(self.local_layers)
        return fields

    @classmethod
    def from_dict(cls, fields: dict) -> ModelSpec:
        """The spec a manifest records (`to_dict`)."""
        return cls(**{**fields, "local_layers": tuple(fields.get("local_layers", ()))})

    @classmethod
    def from_hf_config(cls, config) -> ModelSpec:
        arch = architecture_of(getattr(config, "architectures", None), getattr(config, "model_type", None))
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = hf_head_dim(config)
        if heads % kv_heads:
            raise SnapcompileError(f"{heads} query heads are not a multiple of {kv_heads} KV heads")
        eps = getattr(config, "rms_norm_eps", None)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
            raise SnapcompileError(f"rms_norm_eps must be a number in (0, 1), got {eps!r}")
        activation = _activation(config)
        gemma = arch in GEMMA_ARCHITECTURES
        if gemma:
            _check_gemma(config)
        return cls(
            architecture=arch,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            max_positions=config.max_position_embeddings,
            rms_norm_eps=float(config.rms_norm_eps),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(getattr(config, "attention_bias", False)),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            sliding_window=_sliding_window(arch, config),
            qk_norm=arch in QK_NORM_ARCHITECTURES,
            activation=activation,
            embed_scale=float(np.float32(config.hidden_size ** 0.5)) if gemma else 1.0,
            norm_offset=1.0 if gemma else 0.0,
            sandwich_norms=gemma,
            query_scale=float(config.query_pre_attn_scalar) ** -0.5 if gemma else None,
            local_layers=_local_layers(config) if gemma else (),
        )


def hf_head_dim(config) -> int:
    """A Hugging Face config's head dimension: `head_dim` where set, else hidden / heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


_OPTIONAL_DEFAULTS = {"qk_norm": False, "activation": "silu", "embed_scale": 1.0, "norm_offset": 0.0,
                      "sandwich_norms": False, "query_scale": None, "local_layers": ()}


def _activation(config) -> str:
    """The graphs' name of the MLP activation a config names (hidden_act, or Gemma's hidden_activation)."""
    name = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    if name not in _ACTIVATIONS:
        raise SnapcompileError(f"unsupported activation {name!r}; supported: {', '.join(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


def _check_gemma(config) -> None:
    """Refuse the Gemma options the graphs do not compute (none of Gemma 3's checkpoints sets them)."""
    for name in ("final_logit_softcapping", "attn_logit_softcapping"):
        if getattr(config, name, None) is not None:
            raise SnapcompileError(f"{name} is set ({getattr(config, name)}); snapcompile's graphs do not cap logits")
    if getattr(config, "use_bidirectional_attention", False):
        raise SnapcompileError("use_bidirectional_attention is set: that is an embedding model, not a causal LM")
    scalar = getattr(config, "query_pre_attn_scalar", None)
    if isinstance(scalar, bool) or not isinstance(scalar, (int, float)) or not 0 < scalar < float("inf"):
        raise SnapcompileError(f"query_pre_attn_scalar must be a positive number, got {scalar!r}")


def _local_layers(config) -> tuple[int, ...]:
    """The layers of sliding-window attention (Gemma 3's layer_types)."""
    kinds = list(getattr(config, "layer_types", None) or [])
    unknown = sorted(set(kinds) - {"sliding_attention", "full_attention"})
    if unknown or len(kinds) != config.num_hidden_layers:
        raise SnapcompileError(f"layer_types must give sliding_attention or full_attention for each of the "
                               f"{config.num_hidden_layers} layers, got {kinds!r}")
    return tuple(i for i, kind in enumerate(kinds) if kind == "sliding_attention")


def _sliding_window(arch: str, config) -> int | None:
    """Width of sliding-window attention, None where every layer attends to all positions."""
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not getattr(config, "use_sliding_window", False):
        return None
    return getattr(config, "sliding_window", None) if arch != "LlamaForCausalLM" else None
