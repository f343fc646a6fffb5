"""The architecture facts the exporter needs, read from a Hugging Face config."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from snapcompile.errors import SnapcompileError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_ARCHITECTURE_OF_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                         "qwen3": "Qwen3ForCausalLM"}
QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM",)   # an RMSNorm over each head's queries and keys, before RoPE
_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim", "max_position_embeddings")


def architecture_of(architectures, model_type) -> str:
    """The supported architecture a config names (its first `architectures` entry, else its
    model_type), or a one-line error naming what it is and what is supported."""
    arch = architectures[0] if isinstance(architectures, list) and architectures else None
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
    architecture_of(raw.get("architectures"), raw.get("model_type"))
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
    qk_norm: bool = False         # RMSNorm (rms_norm_eps) of each head's queries and keys before RoPE (Qwen3)

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
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return 4 * (self.vocab_size * h + self.num_layers * layer + h + head)

    @property
    def kv_bytes_per_token(self) -> int:
        """fp32 K and V bytes one token occupies across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4

    def to_dict(self) -> dict:
        """The fields; qk_norm only where set (manifests of the other families read as before)."""
        fields = asdict(self)
        if not self.qk_norm:
            del fields["qk_norm"]
        return fields

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
        if getattr(config, "hidden_act", "silu") != "silu":
            raise SnapcompileError(f"unsupported activation {config.hidden_act!r}; only silu is supported")
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
        )


def hf_head_dim(config) -> int:
    """A Hugging Face config's head dimension: `head_dim` where set, else hidden / heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _sliding_window(arch: str, config) -> int | None:
    """Width of sliding-window attention, None where every layer attends to all positions."""
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not getattr(config, "use_sliding_window", False):
        return None
    return getattr(config, "sliding_window", None) if arch != "LlamaForCausalLM" else None
