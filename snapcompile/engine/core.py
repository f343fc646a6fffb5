"""The engine core: continuous batching over the static decode graph, token ids in and token ids out.

`EngineCore.step()` admits waiting requests into free slots, advances the current prefill by up to
`prefill_tokens_per_step` prompt tokens (whole chunks), then runs one decode step for every
sequence that is decoding, and samples each one's next token. A sequence ends at EOS, its token
limit, the end of a dense cache or the model's positions, or when its grammar allows nothing more;
its slot is free in the same step. Text (detokenization, stop strings) and what a request records
is the output processor's (engine/output.py), which ends a request at a stop string with `stop`.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, replace

import numpy as np

from snapcompile.config import DEFAULT_SESSION_KEEP
from snapcompile.engine.request import Request, Sequence, Status
from snapcompile.engine.sampling import PromptLogprob, prompt_logprobs, sample, token_logprob, top_logprobs
from snapcompile.engine.scheduler import Scheduler
from snapcompile.errors import PromptError, SnapcompileError, first_line
from snapcompile.memory import available_host_memory
from snapcompile.sessions.keepers import keeper_for
from snapcompile.sessions.restore import kept_positions, prompt_reading, resumed_prefill, slot_entry
from snapcompile.sessions.store import SessionStore

log = logging.getLogger("snapcompile.engine")
STEP_TIMES_KEPT = 100_000      # decode step durations kept for percentiles (a server runs forever)


@dataclass(frozen=True)
class TokenStep:
    """One request's step in the core. token_id: the token sampled (None when it ended without one: an
    error, an abort, a stop). at: the core's clock when it happened. A request gives exactly one step
    with `finished` set, its last; `error` and `prompt_error` say why it failed when it did."""

    request_id: str
    token_id: int | None
    finished: bool
    at: float
    finish_reason: str | None = None
    logprob: float | None = None                          # of token_id, when the request asked
    top_logprobs: list[tuple[int, float]] | None = None   # the request's top_logprobs likeliest
    cached_tokens: int = 0                                # prompt tokens resumed from a kept cache
    prompt_logprobs: list[PromptLogprob] | None = None    # with the first token, when the request asked
    error: str | None = None
    prompt_error: PromptError | None = None


class EngineCore:
    """Serves requests on a backend (snapcompile.runtime.ort_backend.OrtBackend) in token ids."""

    def __init__(self, backend, eos_ids: Iterable[int], prefill_tokens_per_step: int | None = None,
                 clock=time.perf_counter, max_slots: int | None = None, session_cache_bytes: int | None = None,
                 session_keep: str = DEFAULT_SESSION_KEEP):
        """max_slots: use at most this many of the backend's static slots (the others stay idle).
        session_cache_bytes: keep finished sequences' caches up to this many bytes, so a request
        that begins with one resumes from it (0: off; None, the default as in `run` and `serve`: an eighth
        of the host memory available now).
        session_keep (compressed artifacts): "slot" keeps the slot's B rows; "full" keeps the
        whole prompt cache (every position, as a dense prefix cache does) plus the answer, so a
        resumed turn re-selects from the whole conversation; "quantized" keeps the slot's rows in 8
        bits and the rows its selections dropped in 4, which a resumed turn's new tokens attend over
        (docs/design.md, "Conversations that keep their cache")."""
        self.backend, self.eos_ids, self.clock = backend, set(eos_ids), clock
        if max_slots is not None and not 1 <= max_slots <= backend.slots:
            raise SnapcompileError(f"--slots must be in 1..{backend.slots} (the artifact's static slots)")
        self.scheduler = Scheduler(max_slots or backend.slots, max(prefill_tokens_per_step or backend.chunk, 1),
                                   backend.decode_sizes)
        self.max_positions = backend.manifest.spec.max_positions
        self.sequences: dict[str, Sequence] = {}
        self._rngs: dict[str, np.random.Generator] = {}
        self.decode_step_seconds: deque[float] = deque(maxlen=STEP_TIMES_KEPT)   # the latest steps
        self.decode_steps = 0
        self._ended: list[TokenStep] = []      # followers ended with their leader, for the next steps out
        policy = backend.manifest.policy
        if session_cache_bytes is None:
            session_cache_bytes = available_host_memory() // 8
        self.sessions = SessionStore(session_cache_bytes, policy.selection_window, backend.max_resume_rows(),
                                     backend.chunk, ring=backend.manifest.window_ring) if session_cache_bytes else None
        self.session_keep = session_keep
        keeper = keeper_for(backend.manifest, session_keep,       # checks the mode whether the store is on or not
                            session_cache_bytes or None)
        self.keeper = keeper if self.sessions is not None else None
        if self.keeper is not None and self.keeper.needs_tail:
            backend.load_tail_graph()

    # ------------------------------------------------------------------ requests
    @property
    def prompt_limit(self) -> int:
        """The longest prompt `check_prompt` accepts (tokens)."""
        if self.sessions is None or not self.backend.manifest.policy.compressed or self.session_keep == "full":
            return self.backend.max_prompt_len()
        return self.max_positions - 1

    def generation_limit(self, prompt_len: int) -> int:
        """The most tokens a request of `prompt_len` tokens can generate before `_end_reason` says
        "context": a dense slot's rows hold the prompt and every fed token (the last sampled one is
        never fed), and no fed token's position may reach the model's max_position_embeddings."""
        positions = self.max_positions - prompt_len + 1
        if self.backend.manifest.policy.compressed:      # a ring: rows are never the bound
            return positions
        return min(self.backend.rows_per_slot - prompt_len + 1, positions)

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
                                  "must fit it; --session-keep slot resumes one past it, at a loss)")
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
        if request.prompt_logprobs is not None and not self.backend.scores_prompts:
            raise SnapcompileError(f"request {request.request_id}: a prompt's log probabilities are computed by the "
                                   "layer-by-layer prefill, which runs on ONNX Runtime with the standard lowering")
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

    def abort(self, request_id: str) -> list[TokenStep]:
        """End a request that has not finished (finish reason "abort"); its slot is free at once.
        Its last step and its waiting followers' (none when it is unknown or already finished)."""
        return self._end(request_id, "abort")

    def stop(self, request_id: str) -> list[TokenStep]:
        """End a request whose text reached a stop string (finish reason "stop": its cache is kept
        like any finished answer's); its slot is free at once. Its last step (none when unknown or
        finished)."""
        return self._end(request_id, "stop")

    def fail(self, request_id: str, message: str) -> list[TokenStep]:
        """End an unfinished request with an error (finish reason "error"); its slot is free at once."""
        return self._end(request_id, "error", message)

    def _end(self, request_id: str, reason: str, error: str | None = None) -> list[TokenStep]:
        seq = self.sequences.get(request_id)
        if seq is None or seq.finished:
            return []
        seq.prefill = None
        self._finish(seq, reason, error=error)
        return [self._last_step(seq), *self._drain_ended()]

    def _drain_ended(self) -> list[TokenStep]:
        ended, self._ended = self._ended, []
        return ended

    def forget(self, request_id: str) -> None:
        """Drop a finished request's state (a long-running server calls it once it ended)."""
        seq = self.sequences.get(request_id)
        if seq is not None and seq.finished:
            del self.sequences[request_id]
            self._rngs.pop(request_id, None)

    def kv_bytes_allocated(self) -> int:
        """Bytes of the slot caches, allocated once whatever the load."""
        return self.backend.kv_bytes_allocated()

    # ------------------------------------------------------------------ step
    def step(self) -> list[TokenStep]:
        steps: list[TokenStep] = []
        for seq in self.scheduler.admit():
            seq.prefill = self._prefill_of(seq)
        self._advance_prefill(steps)
        if self.scheduler.decoding:
            self._decode(steps)
        return steps + self._drain_ended()

    def _prefill_of(self, seq: Sequence):
        """The prefill generator of an admitted sequence: resumed from the session store's best
        kept cache for its prompt, or the whole prompt."""
        ids, partition = seq.request.prompt_ids, seq.request.cache_partition
        scored = seq.request.prompt_logprobs is not None      # every position's logits: prefilled whole
        seq.plan = self.sessions.lookup(ids, partition) \
            if self.sessions is not None and partition is not None and not scored else None
        seq.reading = None
        if self.keeper is not None and partition is not None:
            seq.reading = prompt_reading(self.keeper, self.backend.manifest, seq.slot, seq.plan, ids)
        rows_to = seq.reading.layer if seq.reading is not None else None
        if seq.plan is None:
            return self.backend.prefill_chunks(seq.slot, ids, rows_to=rows_to,
                                               logits_to=self._prompt_scorer(seq) if scored else None)
        seq.cached_tokens = seq.plan.resume_at
        return resumed_prefill(self.backend, seq.slot, seq.plan, ids, self.keeper.resume_rows(seq.plan), rows_to)

    @staticmethod
    def _prompt_scorer(seq: Sequence):
        """The prefill's logits_to for `seq`: each prompt token's PromptLogprob into seq.prompt_logprobs."""
        ids, top = seq.request.prompt_ids, seq.request.prompt_logprobs
        seq.prompt_logprobs = []
        return lambda first, logits: seq.prompt_logprobs.extend(
            prompt_logprobs(logits, ids[first + 1:first + 1 + len(logits)], top))

    def _prefilled(self, seq: Sequence, result) -> None:
        """`seq`'s prefill ended with the runtime's `result`: its layout, the positions its slot
        holds, and what the keeper keeps of its selection at once."""
        seq.prefill, seq.layout = None, result.layout
        seq.kept_positions = kept_positions(seq.plan, len(seq.request.prompt_ids), result)
        reading, seq.reading = seq.reading, None
        early = reading.done() if reading is not None else None
        if early is not None:
            self.sessions.put(early, seq.request.cache_partition)
        elif reading is not None and reading.oversized:
            self.sessions.refuse()

    def _keep(self, seq: Sequence) -> None:
        """Put a finished sequence's cache into the session store (when its keeper keeps one at
        the end): it stands for the prompt and every output token but the last (never fed)."""
        fed = seq.output_ids[:-1]
        m = self.backend.manifest
        kept = self.keeper.keep(seq.slot, lambda: slot_entry(self.backend.slot_rows(seq.slot), seq.layout,
                                                            seq.kept_positions, len(fed),
                                                            list(seq.request.prompt_ids) + fed,
                                                            m.window_ring, m.spec.local_layers))
        if kept is not None:
            self.sessions.put(kept, seq.request.cache_partition)

    def _advance_prefill(self, steps: list[TokenStep]) -> None:
        tokens_left = self.scheduler.prefill_tokens_per_step
        while tokens_left > 0 and (seq := self.scheduler.prefill_turn()) is not None:
            try:
                tokens_left -= next(seq.prefill)
            except StopIteration as done:
                self._prefilled(seq, done.value)
                followers = self._start_followers(seq)
                steps.extend(self._emit(member, done.value.logits) for member in (seq, *followers))
            except Exception as err:   # this request cannot be served; the others go on
                seq.prefill = None
                steps.append(self._fail(seq, err))

    def _start_followers(self, leader: Sequence) -> list[Sequence]:
        """Mark `leader` prefilled and give each of its followers a copy of its slot's cache rows
        and layout: they decode from the same prefill, each with its own sampling."""
        followers = self.scheduler.take_followers(leader)
        self.scheduler.prefill_done(leader)
        rows = min(self.backend.rows_per_slot, len(leader.request.prompt_ids))
        for follower in followers:
            self.backend.move_slot(leader.slot, follower.slot, rows)
            follower.layout, follower.kept_positions = leader.layout, leader.kept_positions
            follower.prompt_logprobs = leader.prompt_logprobs
            self.scheduler.prefill_done(follower)
        return followers

    def _decode(self, steps: list[TokenStep]) -> None:
        for seq, left in self.scheduler.compact():
            rows = min(self.backend.rows_per_slot, len(seq.request.prompt_ids) + len(seq.output_ids))
            self.backend.move_slot(left, seq.slot, rows)
            if self.keeper is not None:
                self.keeper.move(left, seq.slot)
        running = dict(self.scheduler.decoding)
        tokens = {slot: seq.output_ids[-1] for slot, seq in running.items()}
        layout_steps = {slot: seq.layout.step(len(seq.output_ids) - 1) for slot, seq in running.items()}
        start = self.clock()
        try:
            logits = self.backend.decode(tokens, layout_steps)
        except Exception as err:     # a failed step fails the sequences in it, not the engine
            steps.extend(self._fail(seq, err) for seq in running.values())
            return
        self.decode_step_seconds.append(self.clock() - start)
        self.decode_steps += 1
        for slot, seq in running.items():
            steps.append(self._emit(seq, logits[slot]))

    def _emit(self, seq: Sequence, logits: np.ndarray) -> TokenStep:
        """The next token of `seq` from its logits [V]; a failure fails this request only."""
        try:
            return self._next_token(seq, logits)
        except Exception as err:
            return self._fail(seq, err)

    def _fail(self, seq: Sequence, err: Exception) -> TokenStep:
        if isinstance(err, PromptError):
            seq.prompt_error = err
        if isinstance(err, SnapcompileError):
            message = str(err)
        else:
            log.exception("request %s failed", seq.request.request_id)
            message = f"internal error: {type(err).__name__}: {first_line(err)}"
        self._finish(seq, "error", error=message)
        return self._last_step(seq)

    def _last_step(self, seq: Sequence) -> TokenStep:
        """The step that ends `seq` without a new token."""
        return TokenStep(seq.request.request_id, None, True, seq.finished_at, seq.finish_reason,
                         cached_tokens=seq.cached_tokens, error=seq.error, prompt_error=seq.prompt_error)

    def _next_token(self, seq: Sequence, logits: np.ndarray) -> TokenStep:
        request, constraint = seq.request, seq.request.constraint
        allowed = logits if constraint is None else constraint.mask(logits)
        token = sample(allowed, request.sampling, self._rngs[request.request_id], request.prompt_ids, seq.output_ids)
        if constraint is not None:
            constraint.consume(token)
        logprob = token_logprob(logits, token) if request.logprobs else None
        top = top_logprobs(logits, request.top_logprobs) if request.top_logprobs else None
        now = self.clock()
        if seq.first_token_at is None:
            seq.first_token_at = now
        seq.output_ids.append(token)
        reason = self._end_reason(seq, token)
        if reason:
            self._finish(seq, reason)
        return TokenStep(request.request_id, token, seq.finished, now, seq.finish_reason, logprob, top,
                         seq.cached_tokens, seq.prompt_logprobs if len(seq.output_ids) == 1 else None)

    def _end_reason(self, seq: Sequence, token: int) -> str | None:
        """Why `seq` ends with `token`, if it does (stop strings are the output processor's)."""
        request = seq.request
        if token in self.eos_ids and not request.ignore_eos:
            return "eos"
        if request.constraint is not None and request.constraint.finished:
            return "stop"             # the grammar allows nothing more: the answer is complete
        if len(seq.output_ids) >= request.max_new_tokens:
            return "length"
        next_input = len(seq.output_ids) - 1
        if not seq.layout.can_feed(next_input) or seq.layout.step(next_input).position >= self.max_positions:
            return "context"      # a dense cache is full, or RoPE would leave the model's trained range
        return None

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        """End `seq` (and the followers still waiting for its prefill, the same way: their last steps
        go out with the step, abort or stop that ended it)."""
        kept = self.sessions is not None and seq.request.cache_partition is not None \
            and seq.request.shares_prefill_of is None
        if kept and reason in ("eos", "stop", "length", "context") and seq.slot is not None and seq.layout is not None:
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
            self._ended.append(self._last_step(follower))
