"""Continuous batching over the static decode graph.

`Engine.step()` admits waiting requests into free slots, advances the current prefill by up to
`prefill_tokens_per_step` prompt tokens (whole chunks), then runs one decode step for every
sequence that is decoding. A finished sequence frees its slot in the same step.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

import numpy as np

from snapcompile.config import DEFAULT_SESSION_KEEP
from snapcompile.engine.request import Request, Sequence, Status
from snapcompile.engine.sampling import sample, token_logprob, top_logprobs
from snapcompile.engine.scheduler import Scheduler
from snapcompile.errors import PromptError, SnapcompileError, first_line
from snapcompile.memory import available_host_memory
from snapcompile.sessions.keepers import keeper_for
from snapcompile.sessions.store import SessionStore

log = logging.getLogger("snapcompile.engine")
STEP_TIMES_KEPT = 100_000      # decode step durations kept for percentiles (a server runs forever)
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

    @property
    def failed(self) -> bool:
        """Failed or aborted: no complete answer to give."""
        return self.error is not None or self.finish_reason in ("error", "abort")

    @property
    def outcome(self) -> str:
        """How it ended, in OpenAI's terms where it has an answer: "stop" (EOS or a stop string),
        "length" (the token limit or a full dense context), else "error" or "abort"."""
        return "error" if self.error is not None else OUTCOMES.get(self.finish_reason, self.finish_reason)


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


class Engine:
    """Serves requests on a backend (see snapcompile.runtime.ort_backend.OrtBackend)."""

    def __init__(self, backend, tokenizer, eos_ids: Iterable[int], prefill_tokens_per_step: int | None = None,
                 clock=time.perf_counter, max_slots: int | None = None, session_cache_bytes: int | None = None,
                 session_keep: str = DEFAULT_SESSION_KEEP):
        """max_slots: use at most this many of the backend's static slots (the others stay idle).
        session_cache_bytes: keep finished sequences' caches up to this many bytes, so a request
        that begins with one resumes from it (0: off; None, the default as in `run` and `serve`: an eighth
        of the host memory available now).
        session_keep (compressed artifacts): "compressed" keeps the slot's B rows; "full" keeps the
        whole prompt cache (every position, as a dense prefix cache does) plus the answer, so a
        resumed turn re-selects from the whole conversation; "quantized" keeps the slot's rows in 8
        bits and the rows its selections dropped in 4, which a resumed turn's new tokens attend over
        (docs/design.md, "Conversations that keep their cache")."""
        self.backend, self.tokenizer, self.eos_ids = backend, tokenizer, set(eos_ids)
        self.clock = clock
        if max_slots is not None and not 1 <= max_slots <= backend.slots:
            raise SnapcompileError(f"--slots must be in 1..{backend.slots} (the artifact's static slots)")
        self.scheduler = Scheduler(max_slots or backend.slots, max(prefill_tokens_per_step or backend.chunk, 1),
                                   backend.decode_sizes)
        self.max_positions = backend.manifest.spec.max_positions
        self.sequences: dict[str, Sequence] = {}
        self._rngs: dict[str, np.random.Generator] = {}
        self.decode_step_seconds: deque[float] = deque(maxlen=STEP_TIMES_KEPT)   # the latest steps
        self.decode_steps = 0
        policy = backend.manifest.policy
        if session_cache_bytes is None:
            session_cache_bytes = available_host_memory() // 8
        self.sessions = SessionStore(session_cache_bytes, policy.selection_window, backend.max_resume_rows(),
                                     backend.chunk) if session_cache_bytes else None
        self.session_keep = session_keep
        keeper = keeper_for(backend.manifest, session_keep)      # checks the mode whether the store is on or not
        self.keeper = keeper if self.sessions is not None else None
        if self.keeper is not None and self.keeper.needs_tail:
            backend.load_tail_graph()

    @classmethod
    def from_artifact(cls, folder, provider: str = "cpu", threads: int | None = None,
                      prefill_tokens_per_step: int | None = None, backend: str = "ort",
                      max_slots: int | None = None, session_cache_bytes: int | None = None,
                      session_keep: str = DEFAULT_SESSION_KEEP) -> Engine:
        """An engine on an artifact folder (backend "ort") or a TensorRT engine folder ("trt")."""
        from snapcompile.artifact.files import artifact_tokenizer
        from snapcompile.runtime import open_backend
        backend = open_backend(folder, backend, provider=provider, threads=threads)
        tokenizer = artifact_tokenizer(folder, backend.manifest)
        return cls(backend, tokenizer, backend.manifest.eos_token_ids, prefill_tokens_per_step,
                   max_slots=max_slots, session_cache_bytes=session_cache_bytes, session_keep=session_keep)

    # ------------------------------------------------------------------ API
    def encode(self, text: str, chat: bool | None = None) -> list[int]:
        """Token ids of `text`; chat template applied by default for instruct models."""
        from snapcompile.prompts import encode
        return encode(self.tokenizer, text, self.backend.manifest.chat if chat is None else chat)

    @property
    def prompt_limit(self) -> int:
        """The longest prompt `check_prompt` accepts (tokens)."""
        if self.sessions is None or not self.backend.manifest.policy.compressed or self.session_keep == "full":
            return self.backend.max_prompt_len()
        return self.max_positions - 1

    def check_prompt(self, prompt_ids: list[int]) -> None:
        """Raise PromptError (reason "empty" or "too_long") for a prompt this artifact cannot take.
        Reads only the artifact's shapes: safe to call from any thread. A submitted request whose
        prompt breaks it fails alone, at its prefill. With a session store on a compressed artifact a
        prompt may be as long as the model's positions allow: past max_context it must resume from a
        kept conversation (checked at admission)."""
        if self.prompt_limit == self.backend.max_prompt_len():
            if self.keeper is not None and self.backend.manifest.policy.compressed \
                    and len(prompt_ids) > self.prompt_limit:
                raise PromptError("too_long", len(prompt_ids), self.prompt_limit,
                                  "the artifact's --max-context (a conversation kept whole, --session-keep full, "
                                  "must fit it; --session-keep compressed resumes one past it, at a loss)")
            self.backend.check_prompt(prompt_ids)
        elif not prompt_ids or len(prompt_ids) > self.prompt_limit:
            raise PromptError("empty" if not prompt_ids else "too_long", len(prompt_ids), self.prompt_limit,
                              "the model's max_position_embeddings (positions keep growing across turns)")

    def submit(self, request: Request) -> Sequence:
        if request.request_id in self.sequences:
            raise SnapcompileError(f"duplicate request id {request.request_id!r}")
        vocab = self.backend.manifest.spec.vocab_size
        if any(not 0 <= token < vocab for token in request.prompt_ids):
            raise SnapcompileError(f"request {request.request_id}: token ids must be in [0, {vocab})")
        if any(token >= vocab for token, _ in request.sampling.logit_bias):
            raise SnapcompileError(f"request {request.request_id}: logit_bias token ids must be in [0, {vocab})")
        request = self._with_leader(request)
        seq = Sequence(request, submitted_at=self.clock())
        self.sequences[request.request_id] = seq
        self._rngs[request.request_id] = np.random.default_rng(request.sampling.seed)
        self.scheduler.add(seq)
        return seq

    def _with_leader(self, request: Request) -> Request:
        """`request`, or a copy of it that prefills on its own when the request it would share a
        prefill with is no longer waiting with the same prompt, or the group would not fit the slots
        (it is admitted all at once)."""
        if request.shares_prefill_of is None:
            return request
        leader = self.sequences.get(request.shares_prefill_of)
        shares = (leader is not None and leader.status is Status.WAITING
                  and leader.request.prompt_ids == request.prompt_ids
                  and 2 + len(self.scheduler.waiting_followers(leader)) <= self.scheduler.pool.num_slots)
        return request if shares else replace(request, shares_prefill_of=None)

    def stream(self, requests: Iterable[Request] = ()) -> Iterator[TokenEvent]:
        """Submit `requests`, then yield token events until every submitted request finished."""
        for request in requests:
            self.submit(request)
        while not self.scheduler.idle:
            yield from self.step()

    def generate(self, requests: Iterable[Request]) -> list[Result]:
        requests = list(requests)
        for _ in self.stream(requests):
            pass
        return [self.result(r.request_id) for r in requests]

    def result(self, request_id: str) -> Result:
        seq = self.sequences[request_id]
        if not seq.finished:
            raise ValueError(f"{request_id} has not finished")
        ttft = seq.first_token_at - seq.submitted_at if seq.first_token_at is not None else None
        return Result(request_id, len(seq.request.prompt_ids), list(seq.output_ids), seq.text,
                      seq.finish_reason, seq.error, ttft, seq.finished_at - seq.submitted_at,
                      list(seq.top_logprobs), list(seq.token_logprobs), seq.cached_tokens, seq.prompt_error)

    def abort(self, request_id: str) -> bool:
        """Stop a request that has not finished (finish reason "abort"); its slot is free at once.
        False when it is unknown or already finished."""
        seq = self.sequences.get(request_id)
        if seq is None or seq.finished:
            return False
        seq.prefill = None
        self._finish(seq, "abort")
        return True

    def fail(self, request_id: str, message: str) -> bool:
        """Finish an unfinished request with an error (finish reason "error"); its slot is free at
        once. False when it is unknown or already finished."""
        seq = self.sequences.get(request_id)
        if seq is None or seq.finished:
            return False
        seq.prefill = None
        self._finish(seq, "error", error=message)
        return True

    def forget(self, request_id: str) -> None:
        """Drop a finished request's state (a long-running server calls it after reading the result)."""
        seq = self.sequences.get(request_id)
        if seq is not None and seq.finished:
            del self.sequences[request_id]
            self._rngs.pop(request_id, None)

    def kv_bytes_allocated(self) -> int:
        """Bytes of the slot caches, allocated once whatever the load."""
        return self.backend.kv_bytes_allocated()

    # ------------------------------------------------------------------ step
    def step(self) -> list[TokenEvent]:
        events: list[TokenEvent] = []
        for seq in self.scheduler.admit():
            seq.prefill = self._prefill_of(seq)
        self._advance_prefill(events)
        if self.scheduler.decoding:
            self._decode(events)
        return events

    def _prefill_of(self, seq: Sequence):
        """The prefill generator of an admitted sequence: resumed from the session store's best
        kept cache for its prompt, or the whole prompt."""
        ids, scope = seq.request.prompt_ids, seq.request.cache_scope
        plan = self.sessions.lookup(ids, scope) if self.sessions is not None and scope is not None else None
        if plan is None:
            return self.backend.prefill_chunks(seq.slot, ids)
        seq.cached_tokens = plan.resume_at
        return self.backend.resume_chunks(seq.slot, plan, ids, self.keeper.resume_rows(plan))

    def _keep(self, seq: Sequence) -> None:
        """Put a finished sequence's cache into the session store (when its keeper keeps one at
        the end): it stands for the prompt and every output token but the last (never fed)."""
        fed = seq.output_ids[:-1]
        kept = self.keeper.keep(seq.slot, seq.layout, seq.kept_positions, len(fed), list(seq.request.prompt_ids) + fed,
                                self.backend)
        if kept is not None:
            self.sessions.put(kept, seq.request.cache_scope)

    def _advance_prefill(self, events: list[TokenEvent]) -> None:
        tokens_left = self.scheduler.prefill_tokens_per_step
        while tokens_left > 0 and (seq := self.scheduler.prefill_turn()) is not None:
            try:
                tokens_left -= next(seq.prefill)
            except StopIteration as done:
                seq.prefill, seq.layout, seq.kept_positions = None, done.value.layout, done.value.kept_positions
                if self.keeper is not None and done.value.rows is not None and seq.request.cache_scope is not None:
                    early = self.keeper.selected(done.value.rows)
                    if early is not None:
                        self.sessions.put(early, seq.request.cache_scope)
                followers = self._start_followers(seq)
                events.extend(self._emit(member, done.value.logits) for member in (seq, *followers))
            except Exception as err:   # this request cannot be served; the others go on
                seq.prefill = None
                events.append(self._fail(seq, err))

    def _start_followers(self, leader: Sequence) -> list[Sequence]:
        """Mark `leader` prefilled and give each of its followers a copy of its slot's cache rows
        and layout: they decode from the same prefill, each with its own sampling."""
        followers = self.scheduler.take_followers(leader)
        self.scheduler.prefill_done(leader)
        rows = min(self.backend.rows_per_slot, len(leader.request.prompt_ids))
        for follower in followers:
            self.backend.move_slot(leader.slot, follower.slot, rows)
            follower.layout, follower.kept_positions = leader.layout, leader.kept_positions
            self.scheduler.prefill_done(follower)
        return followers

    def _decode(self, events: list[TokenEvent]) -> None:
        for seq, left in self.scheduler.compact():
            rows = min(self.backend.rows_per_slot, len(seq.request.prompt_ids) + len(seq.output_ids))
            self.backend.move_slot(left, seq.slot, rows)
            if self.keeper is not None:
                self.keeper.move(left, seq.slot)
        running = dict(self.scheduler.decoding)
        tokens = {slot: seq.output_ids[-1] for slot, seq in running.items()}
        steps = {slot: seq.layout.step(len(seq.output_ids) - 1) for slot, seq in running.items()}
        start = self.clock()
        try:
            logits = self.backend.decode(tokens, steps)
        except Exception as err:     # a failed step fails the sequences in it, not the engine
            events.extend(self._fail(seq, err) for seq in running.values())
            return
        self.decode_step_seconds.append(self.clock() - start)
        self.decode_steps += 1
        for slot, seq in running.items():
            events.append(self._emit(seq, logits[slot]))

    def _emit(self, seq: Sequence, logits: np.ndarray) -> TokenEvent:
        """The next token of `seq` from its logits [V]; a failure fails this request only."""
        try:
            return self._next_token(seq, logits)
        except Exception as err:
            return self._fail(seq, err)

    def _fail(self, seq: Sequence, err: Exception) -> TokenEvent:
        if isinstance(err, PromptError):
            seq.prompt_error = err
        if isinstance(err, SnapcompileError):
            message = str(err)
        else:
            log.exception("request %s failed", seq.request.request_id)
            message = f"internal error: {type(err).__name__}: {first_line(err)}"
        self._finish(seq, "error", error=message)
        return TokenEvent(seq.request.request_id, None, "", True, "error")

    def _next_token(self, seq: Sequence, logits: np.ndarray) -> TokenEvent:
        request, constraint = seq.request, seq.request.constraint
        allowed = logits if constraint is None else constraint.mask(logits)
        token = sample(allowed, request.sampling, self._rngs[request.request_id], request.prompt_ids, seq.output_ids)
        if constraint is not None:
            constraint.consume(token)
        logprob, top = self._record_logprobs(seq, logits, token)
        if seq.first_token_at is None:
            seq.first_token_at = self.clock()
        seq.output_ids.append(token)
        if token in self.eos_ids and not request.ignore_eos:
            reason = "eos"
        else:
            seq.text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=True)
            reason = self._stop_reason(seq)
        if reason:
            self._finish(seq, reason)
        return TokenEvent(request.request_id, token, self._final_text(seq), seq.finished, seq.finish_reason,
                          logprob, top)

    @staticmethod
    def _record_logprobs(seq: Sequence, logits: np.ndarray, token: int):
        request, logprob, top = seq.request, None, None
        if request.top_logprobs:
            top = top_logprobs(logits, request.top_logprobs)
            seq.top_logprobs.append(top)
        if request.logprobs:
            logprob = token_logprob(logits, token)
            seq.token_logprobs.append(logprob)
        return logprob, top

    @staticmethod
    def _final_text(seq: Sequence) -> str:
        """The text of `seq` that became final since the last event. Until the request finishes,
        a trailing incomplete UTF-8 character and a tail that could begin a stop string wait."""
        end = len(seq.text)
        if not seq.finished:
            end = len(seq.text.rstrip("\ufffd"))
            end -= max((stop_prefix_overlap(seq.text[max(0, end - len(stop) + 1):end], stop)
                        for stop in seq.request.stop), default=0)
        new = seq.text[seq.emitted:end] if end > seq.emitted else ""
        seq.emitted = max(seq.emitted, end)
        return new

    def _stop_reason(self, seq: Sequence) -> str | None:
        if seq.request.constraint is not None and seq.request.constraint.finished:
            return "stop"             # the grammar allows nothing more: the answer is complete
        hits = [seq.text.find(s, max(0, len(seq.text) - 64 - len(s))) for s in seq.request.stop]
        hits = [h for h in hits if h >= 0]
        if hits:
            seq.text = seq.text[: min(hits)]
            return "stop"
        if len(seq.output_ids) >= seq.request.max_new_tokens:
            return "length"
        next_input = len(seq.output_ids) - 1
        if not seq.layout.can_feed(next_input) or seq.layout.step(next_input).position >= self.max_positions:
            return "context"      # a dense cache is full, or RoPE would leave the model's trained range
        return None

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        """End `seq` (and the followers still waiting for its prefill, the same way)."""
        kept = self.sessions is not None and seq.request.cache_scope is not None \
            and seq.request.shares_prefill_of is None
        if kept and reason in OUTCOMES and seq.slot is not None and seq.layout is not None:
            try:
                self._keep(seq)
            except Exception:        # the answer stands; only its reuse is lost
                log.exception("request %s: its cache could not be kept", seq.request.request_id)
        if seq.slot is not None and self.keeper is not None:
            self.keeper.forget(seq.slot)
        seq.finish(reason, self.clock(), error)
        self.scheduler.release(seq)
        for follower in self.scheduler.take_followers(seq):
            self._finish(follower, reason, error)
