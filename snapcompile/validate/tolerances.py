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
# an int8 cache rounds each row to about 1/254 of its largest element (kv_int8.py): on SmolLM2's demo
# prompts (32 steps, B = 512) the logits moved by up to 0.90, one greedy token in 99 flipped, and the
# window scores of near-tied selections by up to 3.9e-4 (docs/results/accuracy.md)
INT8_KV_TOLERANCE = 2.0
INT8_KV_TIE_GAP = 1e-3
INT8_KV_MIN_AGREEMENT = 0.95


def tolerance(export: ExportConfig) -> float:
    """validate's default bound on |logit difference| for these weights and KV cache."""
    if export.kv_dtype == "int8":
        return INT8_KV_TOLERANCE
    return FP16_TOLERANCE if _half(export) else DEFAULT_TOLERANCE


def tie_gap(export: ExportConfig) -> float:
    """validate's default near-tie gap of selection scores for these weights and KV cache."""
    if export.kv_dtype == "int8":
        return INT8_KV_TIE_GAP
    return FP16_TIE_GAP if _half(export) else DEFAULT_TIE_GAP


def min_agreement(export: ExportConfig) -> float:
    """validate's default least greedy agreement: every token, but with an int8 cache."""
    return INT8_KV_MIN_AGREEMENT if export.kv_dtype == "int8" else 1.0


def _half(export: ExportConfig) -> bool:
    """float16 weights, or a float16 KV cache (keys and values rounded once where stored)."""
    return export.weight_format == "fp16" or export.kv_dtype == "float16"
