"""What a request's tokens become for its caller: text, stop strings, the log probabilities it asked
for, and its result. The engine core (engine/core.py) hands out token ids; `OutputProcessor` turns
each request's steps into events and a Result, off the core's step: a server runs it on a thread
of its own (engine/loop.py), `Engine` right after each step (engine/engine.py).

Text is decoded incrementally (`IncrementalText`: constant work a token, whatever the output's
length) and streamed only once it is final: a tail that may still become a stop string or an
incomplete UTF-8 character is held back, so the events' texts add up to the result's text exactly.
When the text reaches a stop string the request's answer ends there; the caller tells the core to
stop it (`Processed.stop`), and the steps the core made meanwhile are dropped.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from snapcompile.engine.core import TokenStep
from snapcompile.engine.request import Request
from snapcompile.engine.sampling import PromptLogprob
from snapcompile.errors import PromptError

OUTCOMES = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}   # OpenAI's finish_reason


@dataclass(frozen=True)
class TokenEvent:
    """One step of one request. `text` is the text that became final with this token: text that
    may still turn into a stop string or an incomplete UTF-8 character is held back until it
    cannot, so the events' texts add up to the result's text exactly."""

    request_id: str
    token_id: int | None     # None for an error or a finish without a new token
    text: str
    finished: bool
    finish_reason: str | None = None
    logprob: float | None = None                          # of token_id, when the request asked
    top_logprobs: list[tuple[int, float]] | None = None   # the request's top_logprobs likeliest
    prompt_logprobs: list[PromptLogprob] | None = None    # with the first token, when the request asked


@dataclass(frozen=True)
class Result:
    request_id: str
    prompt_tokens: int
    output_ids: list[int]
    text: str
    finish_reason: str
    error: str | None
    ttft_s: float | None
    latency_s: float
    top_logprobs: list[list[tuple[int, float]]]   # per output token; empty unless the request asked
    token_logprobs: list[float] = ()              # per output token, when the request asked (logprobs)
    cached_tokens: int = 0                        # prompt tokens resumed from a kept cache, not prefilled
    prompt_error: PromptError | None = None       # set when it failed because its prompt does not fit
    prompt_logprobs: list[PromptLogprob] | None = None   # prompt tokens 1.., when the request asked

    @property
    def failed(self) -> bool:
        """Failed or aborted: no complete answer to give."""
        return self.error is not None or self.finish_reason in ("error", "abort")

    @property
    def outcome(self) -> str:
        """How it ended, in OpenAI's terms where it has an answer: "stop" (EOS or a stop string),
        "length" (the token limit or a full dense context), else "error" or "abort"."""
        return "error" if self.error is not None else OUTCOMES.get(self.finish_reason, self.finish_reason)


def error_result(request_id: str, message: str) -> Result:
    """The result of a request that failed before or outside the engine."""
    return Result(request_id, 0, [], "", "error", message, None, 0.0, [])


@dataclass(frozen=True)
class Processed:
    """What one core step of a request gives its caller: the event, the result when it ended, and
    whether the core must stop the request (its text reached a stop string)."""

    event: TokenEvent
    result: Result | None = None
    stop: bool = False


def stop_prefix_overlap(text: str, stop: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `stop`: the text to
    hold back because it may still become `stop`. O(len(text) + len(stop)) (a KMP failure
    function over stop, then one scan of text); callers pass only the last len(stop) - 1 chars."""
    failure, k = [0] * len(stop), 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = failure[k - 1]
        k += stop[i] == stop[k]
        failure[i] = k
    matched = 0
    for char in text:
        while matched and (matched == len(stop) or char != stop[matched]):
            matched = failure[matched - 1]
        matched += char == stop[matched]
    return matched if matched < len(stop) else failure[matched - 1]


class IncrementalText:
    """A request's output ids -> its text, one token at a time, equal to the tokenizer's decode of
    all of them (special tokens skipped). A tokenizer read from tokenizer.json decodes through
    `tokenizers`' DecodeStream (which holds back an incomplete UTF-8 character itself); any other
    through its own `decode` over the tokens since the last complete text and the few before them
    (the window vLLM's detokenizer uses: a leading word's space depends on what precedes it).
    `rest()` is the text the held-back tokens make at the end (U+FFFD for bytes no character
    completes, as a whole decode gives them). At most MAX_HELD tokens are held back: past that their
    bytes are given as they decode (U+FFFD), so no output, however broken its bytes, costs more than
    a bounded window a token (a character split across the MAX_HELD-th token then reads as two
    U+FFFD where a whole decode would join it)."""

    CONTEXT = 5                 # tokens decoded before a window, for how its first word begins
    MAX_HELD = 16

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.stream = _decode_stream(tokenizer)
        self.ids: list[int] = []
        self._prefix = self._read = 0         # ids[:read] have given their text; the window starts at prefix

    def add(self, token_id: int) -> str:
        """The text `token_id` adds ("" while it ends an incomplete character)."""
        self.ids.append(token_id)
        if len(self.ids) - self._read >= self.MAX_HELD:
            return self._give_held()
        if self.stream is not None:
            new = self.stream.step(_core(self.tokenizer), token_id)
            if new is None:
                return ""
            self._read = len(self.ids)
            return new
        new = self._window_text()
        if not new or new.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return new

    def _give_held(self) -> str:
        """The held-back tokens' text as it stands (U+FFFD and all); decoding starts afresh after them."""
        held = self.rest()
        self._prefix = self._read = len(self.ids)
        if self.stream is not None:
            from tokenizers.decoders import DecodeStream
            self.stream = DecodeStream(ids=self.ids[-self.CONTEXT:], skip_special_tokens=True)
        return held

    def rest(self) -> str:
        """The text of the tokens whose text is still held back, as it ends the whole text."""
        if self._read == len(self.ids):
            return ""
        if self.stream is not None:
            self._prefix = max(0, self._read - self.CONTEXT)
        return self._window_text()

    def _window_text(self) -> str:
        """What ids[read:] add to the text after ids[prefix:read]."""
        decode = self.tokenizer.decode
        before = decode(self.ids[self._prefix:self._read], skip_special_tokens=True)
        after = decode(self.ids[self._prefix:], skip_special_tokens=True)
        return after[len(before):] if len(after) > len(before) and after.startswith(before) else ""


def _core(tokenizer):
    """The `tokenizers` Tokenizer under a FileTokenizer or a transformers fast tokenizer."""
    return getattr(tokenizer, "core", None) or getattr(tokenizer, "backend_tokenizer", None)


def _decode_stream(tokenizer):
    """A DecodeStream for `tokenizer` when its decode is its Rust tokenizer's alone (no cleanup of
    spaces after it), else None."""
    from tokenizers.decoders import DecodeStream
    if _core(tokenizer) is None or getattr(tokenizer, "_clean_up", False) \
            or getattr(tokenizer, "clean_up_tokenization_spaces", False) and not hasattr(tokenizer, "core"):
        return None
    return DecodeStream(skip_special_tokens=True)


@dataclass
class RequestOutput:
    """One request's output as its caller sees it. Its text is the pieces given out in events plus
    `held`: the end that may still become a stop string (never longer than the longest stop string
    less one and the newest token's text), so a token's text costs the same at any output length."""

    request: Request
    submitted_at: float
    text_of: IncrementalText
    ids: list[int] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)     # the text given out in events, in order
    held: str = ""
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    first_at: float | None = None
    cached_tokens: int = 0
    prompt_logprobs: list[PromptLogprob] | None = None

    def add(self, step: TokenStep) -> Processed:
        """This request's next step: its event, and its result when it ended (here or in the core)."""
        self.cached_tokens = step.cached_tokens
        if step.prompt_logprobs is not None:
            self.prompt_logprobs = step.prompt_logprobs
        reason = step.finish_reason if step.finished else None
        cut = False
        if step.token_id is not None:
            self._record(step)
            if reason != "eos":                          # an EOS token ends the text, never part of it
                self.held += self.text_of.add(step.token_id)
                cut = self._cut_at_stop()
        if cut:
            reason = "stop"
        elif reason is not None:
            self.held += self.text_of.rest()             # bytes no character completed: U+FFFD
        event = TokenEvent(self.request.request_id, step.token_id, self._give(finished=reason is not None),
                           reason is not None, reason, step.logprob, step.top_logprobs, step.prompt_logprobs)
        if reason is None:
            return Processed(event)
        return Processed(event, self._result(step, reason), stop=not step.finished)

    def _record(self, step: TokenStep) -> None:
        self.ids.append(step.token_id)
        if self.first_at is None:
            self.first_at = step.at
        if self.request.logprobs:
            self.token_logprobs.append(step.logprob)
        if self.request.top_logprobs:
            self.top_logprobs.append(step.top_logprobs)

    def _cut_at_stop(self) -> bool:
        """Whether a stop string now occurs, cutting the text before the first one. Only the held
        text is searched: text given out was never the beginning of a stop string (`_give`)."""
        hits = [found for stop in self.request.stop if (found := self.held.find(stop)) >= 0]
        if not hits:
            return False
        self.held = self.held[:min(hits)]
        return True

    def _give(self, finished: bool) -> str:
        """The held text that became final: all of it once finished, else all but its longest end
        that is the beginning of a stop string."""
        keep = 0 if finished else max((stop_prefix_overlap(self.held[-(len(stop) - 1):] if len(stop) > 1 else "",
                                                           stop) for stop in self.request.stop), default=0)
        given, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        if given:
            self.pieces.append(given)
        return given

    def _result(self, step: TokenStep, reason: str) -> Result:
        ttft = self.first_at - self.submitted_at if self.first_at is not None else None
        return Result(self.request.request_id, len(self.request.prompt_ids), list(self.ids), "".join(self.pieces),
                      reason, step.error, ttft, step.at - self.submitted_at, list(self.top_logprobs),
                      list(self.token_logprobs), self.cached_tokens, step.prompt_error, self.prompt_logprobs)


class OutputProcessor:
    """Every request's output, fed with the core's steps in the order the core made them."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestOutput] = {}
        self._ended: set[str] = set()      # ended here (a stop string) while the core still has them

    def add(self, request: Request, submitted_at: float) -> None:
        self.requests[request.request_id] = RequestOutput(request, submitted_at, IncrementalText(self.tokenizer))

    def process(self, step: TokenStep) -> Processed | None:
        """The caller's view of `step`; None for a step of a request that ended here already (the
        core's steps before it heard of the stop) or that is unknown."""
        if step.request_id in self._ended:
            if step.finished:
                self._ended.discard(step.request_id)
            return None
        output = self.requests.get(step.request_id)
        if output is None:
            return None
        processed = output.add(step)
        if processed.result is not None:
            del self.requests[step.request_id]
            if processed.stop:
                self._ended.add(step.request_id)
        return processed
