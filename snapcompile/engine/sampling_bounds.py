"""The one home of every sampling value's range (OpenAI's where it states one, vLLM's otherwise):
pydantic's constrained types, which serve's wire format (serve/protocol.py) declares its fields
with, and which `SamplingParams` (engine/request.py) checks each value against, so the API, the
command line, prompts files and Triton accept exactly the same values.
"""
from __future__ import annotations

import math
import numbers
from typing import Annotated

import annotated_types
from pydantic import Field

from snapcompile.errors import SnapcompileError

Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
TopK = Annotated[int, Field(ge=0)]                  # 0 keeps every token (vLLM's -1 is mapped to it by serve)
MinP = Annotated[float, Field(ge=0.0, le=1.0)]
RepetitionPenalty = Annotated[float, Field(gt=0.0, le=100.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]   # presence_penalty, frequency_penalty
Seed = Annotated[int, Field(ge=0, lt=2**63)]
LogitBias = Annotated[float, Field(ge=-100.0, le=100.0)]

BOUNDS = {"temperature": Temperature, "top_p": TopP, "top_k": TopK, "min_p": MinP,
          "repetition_penalty": RepetitionPenalty, "presence_penalty": Penalty, "frequency_penalty": Penalty,
          "seed": Seed}


def check(name: str, value, bound=None) -> None:
    """Raise SnapcompileError (one line naming `name` and its range) unless `value` is a number of
    the bound's kind (an int for integers, no bool; a finite one for floats) within its range."""
    bound = bound or BOUNDS[name]
    kind, limits = _parts(bound)
    ok = isinstance(value, numbers.Integral) if kind is int else isinstance(value, (int, float))
    ok = ok and not isinstance(value, bool) and (kind is int or math.isfinite(value))
    if not ok or not all(_within(value, limit) for limit in limits):
        raise SnapcompileError(f"{name} must be {describe(bound)}, got {value!r}")


def describe(bound) -> str:
    """'an integer in [0, 2**63)', 'a finite number in (0, 1]', 'an integer >= 0', ..."""
    kind, limits = _parts(bound)
    what = "an integer" if kind is int else "a finite number"
    low = next((limit for limit in limits if isinstance(limit, (annotated_types.Ge, annotated_types.Gt))), None)
    high = next((limit for limit in limits if isinstance(limit, (annotated_types.Le, annotated_types.Lt))), None)
    if high is None:
        return f"{what} {'>=' if isinstance(low, annotated_types.Ge) else '>'} {_number(_value(low))}"
    return (f"{what} in {'[' if isinstance(low, annotated_types.Ge) else '('}{_number(_value(low))}, "
            f"{_number(_value(high))}{']' if isinstance(high, annotated_types.Le) else ')'}")


def _parts(bound) -> tuple[type, list]:
    """(int or float, the annotated_types limits) of an Annotated[kind, Field(...)]."""
    return bound.__origin__, [limit for field in bound.__metadata__ for limit in field.metadata]


def _value(limit):
    return next(getattr(limit, name) for name in ("ge", "gt", "le", "lt") if hasattr(limit, name))


def _within(value, limit) -> bool:
    bound = _value(limit)
    return {annotated_types.Ge: value >= bound, annotated_types.Gt: value > bound,
            annotated_types.Le: value <= bound, annotated_types.Lt: value < bound}[type(limit)]


def _number(value) -> str:
    if isinstance(value, int) and value >= 2**32 and (value & (value - 1)) == 0:
        return f"2**{value.bit_length() - 1}"
    return f"{value:g}" if isinstance(value, float) else str(value)
