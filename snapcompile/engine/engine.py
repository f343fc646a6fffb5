"""The engine as a library and the command line use it: the core (engine/core.py: scheduling,
prefill, decode, sampling, in token ids) and the output processor (engine/output.py: text, stop
strings, log probabilities, results) on one thread, each step's output processed right after it.
A server runs the same two apart, the core on a thread of its own (engine/loop.py).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

from snapcompile.config import DEFAULT_SESSION_KEEP
from snapcompile.engine.core import EngineCore, TokenStep
from snapcompile.engine.output import OutputProcessor, Result, TokenEvent
from snapcompile.engine.request import Request, Sequence
from snapcompile.errors import PromptError

__all__ = ["Engine", "PromptError", "Result", "TokenEvent"]


class Engine:
    """Serves requests on a backend (see snapcompile.runtime.ort_backend.OrtBackend): `step()` runs
    one core step and returns its token events; `generate` and `stream` run steps until the
    requests they were given ended."""

    def __init__(self, backend, tokenizer, eos_ids: Iterable[int], prefill_tokens_per_step: int | None = None,
                 clock=None, max_slots: int | None = None, session_cache_bytes: int | None = None,
                 session_keep: str = DEFAULT_SESSION_KEEP):
        """The core's arguments (EngineCore) and the artifact's tokenizer."""
        extra = {} if clock is None else {"clock": clock}
        self.core = EngineCore(backend, eos_ids, prefill_tokens_per_step, max_slots=max_slots,
                               session_cache_bytes=session_cache_bytes, session_keep=session_keep, **extra)
        self.tokenizer = tokenizer
        self.output = OutputProcessor(tokenizer)
        self._results: dict[str, Result] = {}

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

    # ------------------------------------------------------------------ the core's parts
    @property
    def backend(self):
        return self.core.backend

    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def sessions(self):
        """The store of kept conversations (None: off)."""
        return self.core.sessions

    @property
    def clock(self):
        """The core's clock (times of tokens, TTFT)."""
        return self.core.clock

    @property
    def eos_ids(self) -> set[int]:
        return self.core.eos_ids

    @property
    def session_keep(self) -> str:
        return self.core.session_keep

    @property
    def prompt_limit(self) -> int:
        return self.core.prompt_limit

    @property
    def decode_step_seconds(self):
        return self.core.decode_step_seconds

    @property
    def decode_steps(self) -> int:
        return self.core.decode_steps

    def check_prompt(self, prompt_ids: list[int]) -> None:
        self.core.check_prompt(prompt_ids)

    def generation_limit(self, prompt_len: int) -> int:
        return self.core.generation_limit(prompt_len)

    def kv_bytes_allocated(self) -> int:
        return self.core.kv_bytes_allocated()

    # ------------------------------------------------------------------ API
    def encode(self, text: str, chat: bool | None = None) -> list[int]:
        """Token ids of `text`; chat template applied by default for instruct models."""
        from snapcompile.prompts import encode
        return encode(self.tokenizer, text, self.backend.manifest.chat if chat is None else chat)

    def submit(self, request: Request) -> Sequence:
        seq = self.core.submit(request)
        self.output.add(seq.request, seq.submitted_at)
        return seq

    def step(self) -> list[TokenEvent]:
        """One core step; its tokens' events (a request whose text reached a stop string is stopped
        in the core at once, so its slot is free for the next step)."""
        return self._events(self.core.step())

    def _events(self, steps: list[TokenStep]) -> list[TokenEvent]:
        events = []
        while steps:
            step = steps.pop(0)
            processed = self.output.process(step)
            if processed is None:
                continue
            events.append(processed.event)
            if processed.result is not None:
                self._results[step.request_id] = processed.result
            if processed.stop:
                steps.extend(self.core.stop(step.request_id))
        return events

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
        if request_id not in self._results:
            raise ValueError(f"{request_id} has not finished")
        return self._results[request_id]

    def abort(self, request_id: str) -> bool:
        """Stop a request that has not finished (finish reason "abort"); its slot is free at once.
        False when it is unknown or already finished."""
        return bool(self._events(self.core.abort(request_id)))

    def fail(self, request_id: str, message: str) -> bool:
        """Finish an unfinished request with an error (finish reason "error"); its slot is free at
        once. False when it is unknown or already finished."""
        return bool(self._events(self.core.fail(request_id, message)))

    def forget(self, request_id: str) -> None:
        """Drop a finished request's state (a long-running caller calls it after reading the result)."""
        if request_id in self._results:
            del self._results[request_id]
            self.core.forget(request_id)
