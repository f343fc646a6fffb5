"""Request and per-sequence state (no tensors)."""
from __future__ import annotations

import itertools
import math
import numbers
from dataclasses import dataclass, field
from enum import Enum

from snapcompile.errors import SnapcompileError, check_text

_ids = itertools.count()
MAX_STOP_STRINGS = 16       # per request (OpenAI allows 4)
MAX_STOP_CHARS = 256        # per stop string: the hold-back check costs O(this) per token and stop


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy. top_k 0 and top_p 1.0 disable those filters. seed: per request."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if not _real(self.temperature) or self.temperature < 0:
            raise SnapcompileError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _integer(self.top_k) or self.top_k < 0:
            raise SnapcompileError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not _real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise SnapcompileError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not _integer(self.seed) or not 0 <= self.seed < 2**64):
            raise SnapcompileError(f"seed must be an integer in [0, 2**64), got {self.seed!r}")


def check_stop_strings(stop) -> None:
    """At most MAX_STOP_STRINGS non-empty strings of at most MAX_STOP_CHARS characters each."""
    if not isinstance(stop, (tuple, list)) or not all(isinstance(s, str) and s for s in stop):
        raise SnapcompileError("stop strings must not be empty (give a list of non-empty strings)")
    if len(stop) > MAX_STOP_STRINGS:
        raise SnapcompileError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stop)}")
    for text in stop:
        check_text(text, "a stop string")
    longest = max(map(len, stop), default=0)
    if longest > MAX_STOP_CHARS:
        raise SnapcompileError(f"a stop string may have at most {MAX_STOP_CHARS} characters, got {longest}")


def _integer(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class Request:
    prompt_ids: list[int]
    max_new_tokens: int = 64
    stop: tuple[str, ...] = ()
    sampling: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = ""
    top_logprobs: int = 0          # record this many most likely tokens per generated token
    logprobs: bool = False         # record the log probability of each generated token
    ignore_eos: bool = False       # generate past EOS until max_new_tokens (fixed-length benchmarks)
    # the session store's scope: resumed only from, and kept only for, requests of the same scope
    # (None: neither resumed nor kept). `serve` derives it from the API key and cache_salt.
    cache_scope: str | None = ""

    def __post_init__(self):
        if not self.request_id:
            self.request_id = f"req-{next(_ids)}"
        if not _integer(self.max_new_tokens) or self.max_new_tokens < 1:
            raise SnapcompileError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not _integer(self.top_logprobs) or self.top_logprobs < 0:
            raise SnapcompileError(f"top_logprobs must be an integer >= 0, got {self.top_logprobs!r}")
        check_stop_strings(self.stop)
        if not isinstance(self.logprobs, bool) or not isinstance(self.ignore_eos, bool):
            raise SnapcompileError("logprobs and ignore_eos must be true or false")
        if not isinstance(self.sampling, SamplingParams):
            raise SnapcompileError("sampling must be a SamplingParams")
        if self.cache_scope is not None and (not isinstance(self.cache_scope, str) or len(self.cache_scope) > 256):
            raise SnapcompileError("cache_scope must be None or a string of at most 256 characters")
        if not all(_integer(t) for t in self.prompt_ids):
            raise SnapcompileError("prompt_ids must be a list of integer token ids")


class Status(Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"


@dataclass
class Sequence:
    """A request's progress. finish_reason: "eos" | "length" | "stop" | "context" | "error" | "abort"."""

    request: Request
    status: Status = Status.WAITING
    slot: int | None = None
    output_ids: list[int] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    text: str = ""
    emitted: int = 0               # characters of `text` already handed out in events
    finish_reason: str | None = None
    error: str | None = None
    submitted_at: float = 0.0
    first_token_at: float | None = None
    finished_at: float | None = None
    layout: object = None          # SlotLayout once prefilled
    kept_positions: object = None  # PrefillResult.kept_positions once prefilled
    cached_tokens: int = 0         # prompt tokens resumed from a kept cache
    prompt_error: object = None    # the PromptError it failed with (a prompt longer than a fresh prefill takes)
    prefill: object = None         # the backend's prefill generator while PREFILLING

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def finish(self, reason: str, now: float, error: str | None = None) -> None:
        self.status, self.finish_reason, self.error, self.finished_at = Status.FINISHED, reason, error, now
