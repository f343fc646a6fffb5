"""Request and per-sequence state (no tensors)."""
from __future__ import annotations

import itertools
import math
import numbers
from dataclasses import dataclass, field
from enum import Enum

from snapcompile.engine.sampling_bounds import BOUNDS, LogitBias, check
from snapcompile.errors import SnapcompileError, check_text

_ids = itertools.count()
MAX_STOP_STRINGS = 16       # per request (OpenAI allows 4)
MAX_STOP_CHARS = 256        # per stop string: the hold-back check costs O(this) per token and stop


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen, with vLLM's and OpenAI's semantics (docs/serving.md,
    "Sampling"), applied in this order: `logit_bias` ((token id, bias) pairs added to the logits),
    `repetition_penalty` (each token seen in the prompt or output: a positive logit divided by it, a
    negative one multiplied), `frequency_penalty` (minus it times the token's count in the output)
    and `presence_penalty` (minus it once for a token in the output); then greedy when temperature is
    0, else temperature, `top_k`, `top_p` and `min_p` (tokens below min_p x the likeliest one's
    probability dropped). 0 / 1.0 / 0 / 1.0 / 0 / 0 / () disable top_k, top_p, min_p,
    repetition_penalty and the penalties and bias. seed: per request."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self):
        for name in BOUNDS:
            if name != "seed" or self.seed is not None:
                check(name, getattr(self, name))
        _check_logit_bias(self.logit_bias)

    @property
    def penalized(self) -> bool:
        """Whether the logits depend on the tokens so far (penalties) or on a bias."""
        return bool(self.logit_bias) or self.repetition_penalty != 1.0 or bool(self.presence_penalty) \
            or bool(self.frequency_penalty)


MAX_LOGIT_BIAS = 1024        # entries (OpenAI: 300)


def logit_bias_pairs(mapping) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias` object ({"token id": bias}, ids as decimal strings) as SamplingParams'
    pairs (the biases are checked there)."""
    if not isinstance(mapping, dict) or not all(isinstance(key, str) and key.isascii() and key.isdigit()
                                                and len(key) <= 12 for key in mapping):
        raise SnapcompileError('logit_bias must be an object of {"token id": bias}, each id a decimal string')
    return tuple((int(key), bias) for key, bias in mapping.items())


def _check_logit_bias(pairs) -> None:
    """(token id >= 0, bias in [-100, 100]) pairs, at most MAX_LOGIT_BIAS, each id once; the ids
    are checked against the model's vocabulary when the request is submitted."""
    if not isinstance(pairs, tuple) or len(pairs) > MAX_LOGIT_BIAS:
        raise SnapcompileError(f"logit_bias must hold at most {MAX_LOGIT_BIAS} (token id, bias) pairs")
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2 and _integer(pair[0]) and pair[0] >= 0):
            raise SnapcompileError(f"logit_bias entries must be a token id >= 0 and a bias, got {pair!r}")
        check("a logit_bias bias", pair[1], LogitBias)
    if len({token for token, _ in pairs}) != len(pairs):
        raise SnapcompileError("logit_bias names a token id twice")


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
    # record each prompt token's log probability (and this many likeliest tokens at each prompt
    # position): the prompt is then prefilled whole, never resumed (None: not asked)
    prompt_logprobs: int | None = None
    # the session store's partition: resumed only from, and kept only for, requests of the same partition
    # (None: neither resumed nor kept). `serve` derives it from the API key and cache_salt.
    cache_partition: str | None = ""
    # the id of a request submitted before this one with the same prompt: this one is not prefilled
    # but starts from a copy of that one's prefilled cache, admitted with it (one request's n samples).
    # It is never kept in the session store.
    shares_prefill_of: str | None = None
    # a token constraint (engine.constraints.GrammarConstraint: structured output), this request's own
    constraint: object = None

    def __post_init__(self):
        if not self.request_id:
            self.request_id = f"req-{next(_ids)}"
        if not _integer(self.max_new_tokens) or self.max_new_tokens < 1:
            raise SnapcompileError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not _integer(self.top_logprobs) or self.top_logprobs < 0:
            raise SnapcompileError(f"top_logprobs must be an integer >= 0, got {self.top_logprobs!r}")
        if self.prompt_logprobs is not None and (not _integer(self.prompt_logprobs) or self.prompt_logprobs < 0):
            raise SnapcompileError(f"prompt_logprobs must be None or an integer >= 0, got {self.prompt_logprobs!r}")
        check_stop_strings(self.stop)
        if not isinstance(self.logprobs, bool) or not isinstance(self.ignore_eos, bool):
            raise SnapcompileError("logprobs and ignore_eos must be true or false")
        if not isinstance(self.sampling, SamplingParams):
            raise SnapcompileError("sampling must be a SamplingParams")
        partition = self.cache_partition
        if partition is not None and (not isinstance(partition, str) or len(partition) > 256):
            raise SnapcompileError("cache_partition must be None or a string of at most 256 characters")
        if not all(_integer(t) for t in self.prompt_ids):
            raise SnapcompileError("prompt_ids must be a list of integer token ids")
        if self.shares_prefill_of is not None and not isinstance(self.shares_prefill_of, str):
            raise SnapcompileError("shares_prefill_of must be None or a request id")


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
    kept_positions: object = None  # per layer the prompt positions its slot holds (restore.kept_positions)
    plan: object = None            # the ResumePlan it resumed from (None: prefilled whole)
    reading: object = None         # while it prefills: the keeper's reading of its rows (restore.prompt_reading)
    cached_tokens: int = 0         # prompt tokens resumed from a kept cache
    prompt_logprobs: list | None = None   # PromptLogprob of prompt tokens 1.. (when the request asked)
    prompt_error: object = None    # the PromptError it failed with (a prompt longer than a fresh prefill takes)
    prefill: object = None         # the backend's prefill generator while PREFILLING

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def finish(self, reason: str, now: float, error: str | None = None) -> None:
        self.status, self.finish_reason, self.error, self.finished_at = Status.FINISHED, reason, error, now
