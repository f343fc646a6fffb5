"""How far `validate` lets the artifact's logits and selections be from the oracle's, by weight format
and KV dtype (no torch here: the command line reads them for its help)."""
from __future__ import annotations

from snapcompile.config import ExportConfig

DEFAULT_TOLERANCE = 1e-3    # validate: largest |logit difference| from the PyTorch oracle
# fp16 graphs round the logits to float16: one step of float16 at |logit| 32..64 is 0.03; measured on
# SmolLM2 up to 0.107 where near-tied selections differ from the oracle's (docs/design.md)
FP16_TOLERANCE = 0.125
DEFAULT_TIE_GAP = 1e-6      # validate: selection score gaps below this are near-ties
FP16_TIE_GAP = 1e-4         # fp16 keys move window scores by a few 1e-6 (measured on SmolLM2)


def tolerance(export: ExportConfig) -> float:
    """validate's default bound on |logit difference| for these weights and KV cache."""
    return FP16_TOLERANCE if _half(export) else DEFAULT_TOLERANCE


def tie_gap(export: ExportConfig) -> float:
    """validate's default near-tie gap of selection scores for these weights and KV cache."""
    return FP16_TIE_GAP if _half(export) else DEFAULT_TIE_GAP


def _half(export: ExportConfig) -> bool:
    """float16 weights, or a float16 KV cache (keys and values rounded once where stored)."""
    return export.weight_format == "fp16" or export.kv_dtype == "float16"
