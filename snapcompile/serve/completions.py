"""The two completion endpoints: an OpenAI request -> an engine request -> OpenAI responses.

`OpenAIServing` holds no HTTP code: it turns a validated body into an engine `Request`, and the
engine's updates into response bodies or server-sent-event chunks.
"""
from __future__ import annotations

import asyncio
import copy
import json
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from snapcompile.engine.engine import Result, TokenEvent
from snapcompile.engine.request import Request, SamplingParams
from snapcompile.errors import PromptError, SnapcompileError
from snapcompile.prompts import RENDER_TIMEOUT_S, encode_messages, encode_text, max_prompt_chars
from snapcompile.serve.engine_loop import EngineLoop, Update
from snapcompile.serve.protocol import ApiError, ChatRequest, CompletionRequest, new_id, now, usage

DISCONNECT_POLL_S = 0.1     # how often a non-streamed request checks that its client is still there


@dataclass(frozen=True)
class Call:
    """One accepted request: what it asked for and how to answer it."""

    kind: str                    # "chat" | "completion"
    params: ChatRequest | CompletionRequest
    request: Request
    response_id: str
    model: str


class OpenAIServing:
    def __init__(self, engine_loop: EngineLoop, tokenizer, model_name: str, max_context: int,
                 render_timeout_s: float = RENDER_TIMEOUT_S):
        self.engine_loop, self.tokenizer, self.model_name = engine_loop, tokenizer, model_name
        self.max_context, self.render_timeout_s = max_context, render_timeout_s
        self.max_prompt_chars = max_prompt_chars(tokenizer, engine_loop.engine.backend.max_prompt_len())
        self._per_thread = threading.local()

    def _thread_tokenizer(self):
        """This worker thread's own copy of the tokenizer: a fast tokenizer's encode borrows its Rust
        state mutably, so concurrent calls on one object can fail ("Already borrowed")."""
        tokenizer = getattr(self._per_thread, "tokenizer", None)
        if tokenizer is None:
            tokenizer = self._per_thread.tokenizer = copy.deepcopy(self.tokenizer)
        return tokenizer

    # ------------------------------------------------------------------ requests
    async def accept(self, kind: str, params: ChatRequest | CompletionRequest) -> Call:
        """Check `params` against this model and build the engine request (400s name the field).
        The prompt is tokenized (and the chat template rendered) on a worker thread, within a time
        limit, after its size was checked: the event loop never waits on it."""
        params.unsupported()
        if params.model != self.model_name:
            raise ApiError(404, f"the model {params.model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")
        param = "messages" if kind == "chat" else "prompt"
        render = self._chat_prompt if kind == "chat" else self._raw_prompt
        try:
            prompt = await asyncio.to_thread(render, params)
        except SnapcompileError as err:
            raise ApiError(400, str(err), param=param) from None
        self._check_prompt(prompt, param=param)
        logprobs, top = params.logprob_counts()
        try:
            sampling = SamplingParams(temperature=params.temperature, top_p=params.top_p, seed=params.seed)
            request = Request(prompt, max_new_tokens=params.max_new_tokens(max(1, self.max_context - len(prompt))),
                              stop=tuple(params.stop), sampling=sampling, request_id=new_id("req"),
                              top_logprobs=top, logprobs=logprobs, ignore_eos=params.ignore_eos)
        except SnapcompileError as err:
            raise ApiError(400, str(err)) from None
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        return Call(kind, params, request, new_id(prefix), self.model_name)

    def _check_prompt(self, prompt: list[int], param: str) -> None:
        """Engine.check_prompt in OpenAI's words (400; context_length_exceeded for a long one)."""
        try:
            self.engine_loop.engine.check_prompt(prompt)
        except PromptError as err:
            if err.reason == "empty":
                raise ApiError(400, "the prompt is empty", param=param) from None
            raise ApiError(400, f"the prompt has {err.tokens} tokens; this model's context allows at most "
                                f"{err.limit} prompt tokens", param=param, code="context_length_exceeded") from None

    def _check_size(self, chars: int, param: str) -> None:
        if chars > self.max_prompt_chars:
            raise ApiError(400, f"the prompt has {chars} characters: more than this model's context can hold "
                                f"({self.max_prompt_chars} at the most)", param=param, code="context_length_exceeded")

    def _chat_prompt(self, params: ChatRequest) -> list[int]:
        if self.tokenizer.chat_template is None:
            raise ApiError(400, "this model has no chat template; use /v1/completions", param="messages")
        messages = [{"role": m.role, "content": m.text()} for m in params.messages]
        self._check_size(sum(len(m["content"]) + len(m["role"]) for m in messages), "messages")
        return encode_messages(self._thread_tokenizer(), messages, self.render_timeout_s)

    def _raw_prompt(self, params: CompletionRequest) -> list[int]:
        text = params.prompt_text()
        self._check_size(len(text), "prompt")
        return encode_text(self._thread_tokenizer(), text)

    # ------------------------------------------------------------------ responses
    def _submit(self, request: Request) -> asyncio.Queue:
        """Submit to the engine thread; the updates arrive on the returned queue of this event loop."""
        updates: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self.engine_loop.submit(request, lambda update: loop.call_soon_threadsafe(updates.put_nowait, update))
        return updates

    async def complete(self, call: Call, disconnected) -> dict:
        """Run `call` to its end and return the response body; abort it if the client leaves."""
        updates = self._submit(call.request)
        tokens: list[TokenEvent] = []
        loop = asyncio.get_running_loop()
        checked = loop.time()
        try:
            while True:
                try:
                    update: Update = await asyncio.wait_for(updates.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    update = None
                if loop.time() - checked >= DISCONNECT_POLL_S:     # tokens may arrive faster than the poll
                    checked = loop.time()
                    if await disconnected():
                        self.engine_loop.abort(call.request.request_id)
                        raise ApiError(499, "the client closed the connection") from None
                if update is None:
                    continue
                if update.event.token_id is not None:
                    tokens.append(update.event)
                if update.result is not None:
                    return self._final_body(call, update.result, tokens)
        except asyncio.CancelledError:
            self.engine_loop.abort(call.request.request_id)
            raise

    async def stream(self, call: Call) -> AsyncIterator[str]:
        """Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`; the request is
        aborted when the client goes away (the generator is closed or cancelled)."""
        updates = self._submit(call.request)
        finished = False
        try:
            if call.kind == "chat":
                yield _sse(self._chunk(call, {"role": "assistant", "content": ""}, None))
            while not finished:
                update: Update = await updates.get()
                finished = update.result is not None
                if finished and update.result.failed:
                    yield _sse(_generation_error(update.result).body())
                    break
                chunk = self._event_chunk(call, update)
                if chunk is not None:
                    yield _sse(chunk)
                if finished and call.params.include_usage:
                    yield _sse(self._usage_chunk(call, update.result))
            yield "data: [DONE]\n\n"
        finally:
            if not finished:
                self.engine_loop.abort(call.request.request_id)

    def _final_body(self, call: Call, result: Result, tokens: list[TokenEvent]) -> dict:
        if result.failed:
            raise _generation_error(result)
        reason = result.outcome
        logprobs = self._logprobs(call, tokens)
        if call.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": result.text},
                      "logprobs": logprobs, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": result.text, "logprobs": logprobs, "finish_reason": reason}
        return {"id": call.response_id, "object": _object(call, chunk=False), "created": now(), "model": call.model,
                "choices": [choice], "usage": usage(result.prompt_tokens, len(result.output_ids))}

    def _event_chunk(self, call: Call, update: Update) -> dict | None:
        event = update.event
        reason = update.result.outcome if update.result is not None else None
        tokens = [event] if event.token_id is not None else []
        if not event.text and reason is None and not (tokens and call.request.logprobs):
            return None
        delta = {"content": event.text} if event.text else {}
        return self._chunk(call, delta if call.kind == "chat" else event.text, reason, self._logprobs(call, tokens))

    def _chunk(self, call: Call, delta, reason: str | None, logprobs=None) -> dict:
        choice = {"index": 0, "logprobs": logprobs, "finish_reason": reason}
        choice.update({"delta": delta} if call.kind == "chat" else {"text": delta})
        return {"id": call.response_id, "object": _object(call, chunk=True), "created": now(), "model": call.model,
                "choices": [choice]}

    def _usage_chunk(self, call: Call, result: Result) -> dict:
        return {"id": call.response_id, "object": _object(call, chunk=True), "created": now(), "model": call.model,
                "choices": [], "usage": usage(result.prompt_tokens, len(result.output_ids))}

    def _logprobs(self, call: Call, tokens: list[TokenEvent]) -> dict | None:
        if not call.request.logprobs:
            return None
        if call.kind == "chat":
            return {"content": [self._chat_logprob(event) for event in tokens]}
        return {"tokens": [self._token_text(e.token_id) for e in tokens],
                "token_logprobs": [e.logprob for e in tokens],
                "top_logprobs": [{self._token_text(i): lp for i, lp in (e.top_logprobs or [])} for e in tokens]}

    def _chat_logprob(self, event: TokenEvent) -> dict:
        entry = self._token_entry(event.token_id, event.logprob)
        entry["top_logprobs"] = [self._token_entry(i, lp) for i, lp in (event.top_logprobs or [])]
        return entry

    def _token_entry(self, token_id: int, logprob: float) -> dict:
        text = self._token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


def _object(call: Call, chunk: bool) -> str:
    if call.kind == "chat":
        return "chat.completion.chunk" if chunk else "chat.completion"
    return "text_completion"


def _generation_error(result: Result) -> ApiError:
    return ApiError(500, f"the request failed while generating: {result.error or result.finish_reason}")


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
