"""The two completion endpoints: an OpenAI request -> an engine request -> OpenAI responses.

`OpenAIServing` holds no HTTP code: it turns a validated body into an engine `Request`, and the
engine's updates into response bodies or server-sent-event chunks.
"""
from __future__ import annotations

import asyncio
import copy
import json
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from snapcompile.engine.constraints import GrammarTokenizer, JsonGrammar
from snapcompile.engine.loop import EngineLoop, Update
from snapcompile.engine.output import Result, TokenEvent
from snapcompile.engine.request import Request, SamplingParams
from snapcompile.engine.sampling import PromptLogprob
from snapcompile.errors import PromptError, SnapcompileError
from snapcompile.prompts import max_prompt_chars
from snapcompile.serve import protocol, tool_formats, tools
from snapcompile.serve.logprob_format import LogprobFormat
from snapcompile.serve.protocol import ApiError, ChatRequest, CompletionRequest, PromptItem, new_id, now, usage
from snapcompile.serve.reasoning import ReasoningSplit, split_reasoning
from snapcompile.serve.tokenizer_pool import TokenizerPool

DISCONNECT_POLL_S = 0.1     # how often a non-streamed request checks that its client is still there
MAX_PROMPT_LOGPROB_ENTRIES = 1_000_000     # prompt tokens x (k + 1) x n a request's prompt log probabilities make
log = logging.getLogger("snapcompile.serve")


@dataclass(frozen=True)
class Call:
    """One accepted request: what it asked for and how to answer it. A completion may carry several
    prompts: one engine request each, answered as choice `index` in their order."""

    kind: str                    # "chat" | "completion"
    params: ChatRequest | CompletionRequest
    requests: tuple[Request, ...]
    response_id: str
    model: str
    echoes: tuple[str, ...] = ()     # per choice, the prompt's text (completions with echo)
    tool_format: str | None = None   # a chat answered in its family's tool format (serve.tool_formats)


def check_model(model: str | None, names: tuple[str, ...]) -> None:
    """A 404 (model_not_found) for a `model` this server does not serve (None: the request named none)."""
    if model is not None and model not in names:
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {', '.join(map(repr, names))}",
                       param="model", code="model_not_found")


class OpenAIServing:
    def __init__(self, engine_loop: EngineLoop, tokenizer, model_names: tuple[str, ...], max_context: int,
                 tokenizers: TokenizerPool, max_prompts: int = 32, reasoning_parser: str | None = None):
        """`tokenizer` decodes (echoes); `tokenizers` renders chat templates and tokenizes prompts in
        worker processes, each job bounded in time and memory; `model_names`: the names clients may
        send (a response gives the one its request sent, else the first); `reasoning_parser`: how a
        chat answer's thinking is told from its content (serve.reasoning; None: it is not)."""
        self.reasoning_parser = reasoning_parser
        self.tool_format = tool_formats.format_of(tokenizer.chat_template)     # its tool calls' own syntax
        self.engine_loop, self.tokenizer, self.model_names = engine_loop, tokenizer, tuple(model_names)
        self.logprob_format = LogprobFormat(tokenizer)
        self.max_context, self.tokenizers, self.max_prompts = max_context, tokenizers, max_prompts
        self.max_prompt_chars = max_prompt_chars(tokenizer, engine_loop.engine.prompt_limit)
        self._per_thread = threading.local()
        self._grammars: GrammarTokenizer | None = None        # built at the first structured request
        self._grammars_lock = threading.Lock()

    def _thread_tokenizer(self):
        """This worker thread's own copy of the tokenizer: a fast tokenizer borrows its Rust state
        mutably, so concurrent calls on one object can fail ("Already borrowed")."""
        tokenizer = getattr(self._per_thread, "tokenizer", None)
        if tokenizer is None:
            tokenizer = self._per_thread.tokenizer = copy.deepcopy(self.tokenizer)
        return tokenizer

    # ------------------------------------------------------------------ requests
    async def accept(self, kind: str, params: ChatRequest | CompletionRequest, partition: str | None = None) -> Call:
        """Check `params` against this model and build the engine request (400s name the field),
        in the session store's `partition` (`partition_of`).
        The prompt is tokenized (and the chat template rendered) in a worker process, within a time
        and memory bound, after its size was checked: the event loop never waits on it."""
        params.unsupported()
        self._check_model(params.model)
        param = "messages" if kind == "chat" else "prompt"
        try:
            if kind == "chat":
                prompts = [await asyncio.to_thread(self._chat_prompt, params)]
            else:
                prompts = [await asyncio.to_thread(self._raw_prompt, item) for item in params.prompts(self.max_prompts)]
        except SnapcompileError as err:
            raise ApiError(400, str(err), param=param) from None
        requests = await asyncio.to_thread(self._engine_requests, params, prompts, param, partition)
        echo = kind == "completion" and params.echo
        echoes = await asyncio.to_thread(self._echoes, [request.prompt_ids for request in requests]) if echo else ()
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        return Call(kind, params, requests, new_id(prefix), params.model or self.model_names[0], echoes,
                    self._family(params) if kind == "chat" else None)

    def _echoes(self, prompts: list[list[int]]) -> tuple[str, ...]:
        return tuple(self._thread_tokenizer().decode(prompt) for prompt in prompts)

    def _engine_requests(self, params: ChatRequest | CompletionRequest, prompts: list[list[int]], param: str,
                         partition: str | None) -> tuple[Request, ...]:
        """The prompts checked and made engine requests, on a worker thread (client-sized work)."""
        for prompt in prompts:
            self._check_prompt(prompt, param=param)
        sampling = params.sampling()
        vocab = self.engine_loop.engine.backend.manifest.spec.vocab_size
        if any(token >= vocab for token, _ in sampling.logit_bias):
            raise ApiError(400, f"logit_bias token ids must lie in [0, {vocab})", param="logit_bias")
        self._check_prompt_logprobs(params, prompts)
        slots = self.engine_loop.engine.scheduler.pool.num_slots
        if params.n > slots:
            raise ApiError(400, f"n={params.n}: the samples of a prompt share its prefill in slots of their own, and "
                                f"this server has {slots}", param="n")
        grammar = self._grammar(params)
        try:
            return tuple(request for prompt in prompts
                         for request in self._samples(params, sampling, grammar, prompt, partition))
        except SnapcompileError as err:
            raise ApiError(400, str(err)) from None

    def _check_prompt_logprobs(self, params: ChatRequest | CompletionRequest, prompts: list[list[int]]) -> None:
        """Prompt log probabilities only where the backend computes them, and no more entries (a
        prompt token's and its top k, in every choice) than MAX_PROMPT_LOGPROB_ENTRIES: a response's
        size is bounded whatever n, k and the prompts' lengths."""
        top = params.prompt_logprob_count()
        if top is None:
            return
        param = "prompt_logprobs" if params.prompt_logprobs is not None else "echo"
        if not self.engine_loop.engine.backend.scores_prompts:
            raise ApiError(400, "prompt log probabilities (echo with logprobs, prompt_logprobs) are computed by the "
                                "layer-by-layer prefill, which this backend does not run (ONNX Runtime with the "
                                "standard lowering does)", param=param)
        entries = sum(len(prompt) for prompt in prompts) * (top + 1) * params.n
        if entries > MAX_PROMPT_LOGPROB_ENTRIES:
            raise ApiError(400, f"the prompt log probabilities asked for make {entries} entries (prompt tokens x "
                                f"(k + 1) x n); at most {MAX_PROMPT_LOGPROB_ENTRIES} a request: ask for fewer",
                           param=param)

    def _samples(self, params: ChatRequest | CompletionRequest, sampling: SamplingParams, grammar: JsonGrammar | None,
                 prompt: list[int], partition: str | None) -> list[Request]:
        """The n engine requests of one prompt: the first prefills it, the others start from a copy
        of its prefilled cache (never kept), each drawing with its own seed (seed + j when given)."""
        first = self._engine_request(params, sampling, grammar, prompt, partition)
        rest = [replace(self._engine_request(params, replace(sampling, seed=None if sampling.seed is None
                                                             else (sampling.seed + j) % 2**63), grammar, prompt,
                                             None), shares_prefill_of=first.request_id) for j in range(1, params.n)]
        return [first, *rest]

    def _grammar(self, params: ChatRequest | CompletionRequest) -> JsonGrammar | None:
        """The grammar of active tools or of `response_format` (checked once per HTTP request; each
        engine request gets its own constraint from it), or None."""
        tool_schema = tools.answer_schema(params) if isinstance(params, ChatRequest) and not self._family(params) \
            else None
        format_schema = params.json_schema()
        if tool_schema is not None and format_schema is not None:
            raise ApiError(400, "give tools or a JSON response_format, not both", param="response_format")
        schema = tool_schema or format_schema
        if schema is None:
            return None
        if params.stop:
            raise ApiError(400, "stop strings cannot be combined with tools or a JSON response_format: a stop "
                                "could cut the answer short and report it complete", param="stop")
        with self._grammars_lock:
            if self._grammars is None:
                vocab = self.engine_loop.engine.backend.manifest.spec.vocab_size
                self._grammars = GrammarTokenizer(self.tokenizer, vocab)
        try:
            return self._grammars.json_schema(schema)
        except SnapcompileError as err:
            raise ApiError(400, str(err), param="response_format") from None

    def _engine_request(self, params: ChatRequest | CompletionRequest, sampling: SamplingParams,
                        grammar: JsonGrammar | None, prompt: list[int], partition: str | None) -> Request:
        logprobs, top = params.logprob_counts()
        return Request(prompt, max_new_tokens=self._max_new_tokens(params, len(prompt)),
                       stop=tuple(params.stop), sampling=sampling, request_id=new_id("req"),
                       top_logprobs=top, logprobs=logprobs, ignore_eos=params.ignore_eos, cache_partition=partition,
                       constraint=grammar.constraint() if grammar is not None else None,
                       prompt_logprobs=params.prompt_logprob_count())

    def _max_new_tokens(self, params: ChatRequest | CompletionRequest, prompt_len: int) -> int:
        """The request's max_tokens (default: up to the artifact's context), refused with the counts
        (vLLM's 400) when more than the engine can generate after this prompt: never capped silently."""
        limit = self.engine_loop.engine.generation_limit(prompt_len)
        wanted = params.max_new_tokens(max(1, min(self.max_context - prompt_len, limit)))
        if wanted > limit:
            param = "max_completion_tokens" if getattr(params, "max_completion_tokens", None) else "max_tokens"
            raise ApiError(400, f"{param}={wanted}, but after this {prompt_len}-token prompt the model can generate at "
                                f"most {limit} tokens: reduce the prompt or the completion", param=param,
                           code="context_length_exceeded")
        return wanted

    def _check_prompt(self, prompt: list[int], param: str) -> None:
        """Engine.check_prompt in OpenAI's words (400; context_length_exceeded for a long one), and
        token ids (given by the client) within the vocabulary."""
        vocab = self.engine_loop.engine.backend.manifest.spec.vocab_size
        if any(not 0 <= token < vocab for token in prompt):
            raise ApiError(400, f"prompt token ids must lie in [0, {vocab})", param=param)
        try:
            self.engine_loop.engine.check_prompt(prompt)
        except PromptError as err:
            raise _prompt_error(err, param) from None

    def _check_size(self, chars: int, param: str) -> None:
        if chars > self.max_prompt_chars:
            raise ApiError(400, f"the prompt has {chars} characters: more than this model's context can hold "
                                f"({self.max_prompt_chars} at the most)", param=param, code="context_length_exceeded")

    # ------------------------------------------------------------------ tokenizer endpoints
    async def tokenize(self, params: protocol.TokenizeRequest) -> dict:
        """/tokenize: the token ids the completion endpoints would feed the model, vLLM's and
        llama-server's response keys together."""
        self._check_model(params.model)
        params.check()
        try:
            if params.messages is not None:
                ids = await asyncio.to_thread(self._chat_prompt, params)
            else:
                ids = await asyncio.to_thread(self._raw_prompt, params.prompt if params.content is None
                                              else params.content)
        except SnapcompileError as err:
            raise ApiError(400, str(err), param="messages" if params.messages else "prompt") from None
        max_model_len = self.engine_loop.engine.backend.manifest.export.max_context     # a fresh request's
        return {"tokens": ids, "count": len(ids), "max_model_len": max_model_len}

    async def detokenize(self, params: protocol.DetokenizeRequest) -> dict:
        """/detokenize: the text of `tokens` (special tokens kept), as `prompt` (vLLM) and `content`
        (llama-server)."""
        self._check_model(params.model)
        vocab = self.engine_loop.engine.backend.manifest.spec.vocab_size
        if len(params.tokens) > self.max_context or any(not 0 <= token < vocab for token in params.tokens):
            raise ApiError(400, f"tokens must be at most {self.max_context} ids in [0, {vocab})", param="tokens")
        text = await asyncio.to_thread(lambda: self._thread_tokenizer().decode(params.tokens))
        return {"prompt": text, "content": text}

    def _check_model(self, model: str | None) -> None:
        check_model(model, self.model_names)

    def _chat_prompt(self, params: ChatRequest | protocol.TokenizeRequest) -> list[int]:
        """A chat's token ids through the template (with the tools' system message when it has
        active tools, serve.tools)."""
        if self.tokenizer.chat_template is None:
            raise ApiError(400, "this model has no chat template; use /v1/completions", param="messages")
        options = params.template_options()
        if options.continue_final_message and (tools.active(params) or isinstance(params, ChatRequest)
                                               and params.json_schema() is not None):
            raise ApiError(400, "continue_final_message cannot be combined with tools or a JSON response_format: the "
                                "answer's grammar starts where the message it continues does not",
                           param="continue_final_message")
        if self._family(params):
            messages, tool_list = tool_formats.native_messages(params)
            options = replace(options, tools=tuple(tool_list))
        else:
            messages = tools.template_messages(params)
        self._check_size(sum(len(m["content"]) + len(m["role"]) for m in messages), "messages")
        return self.tokenizers.chat(messages, self.max_prompt_chars, options)

    def _family(self, params) -> str | None:
        """The family tool format this chat is answered in: its template's own (serve.tool_formats) when
        it offers tools with tool_choice "auto"; None for the generic constrained format, or no tools."""
        if self.tool_format == "generic" or not tools.active(params) or tools.tool_choice_of(params) != "auto":
            return None
        return self.tool_format

    def _raw_prompt(self, prompt: PromptItem) -> list[int]:
        """A completion prompt's token ids: given as they are, or those of its text."""
        if not isinstance(prompt, str):
            return prompt
        self._check_size(len(prompt), "prompt")
        return self.tokenizers.text(prompt)

    # ------------------------------------------------------------------ responses
    def _submit(self, requests: tuple[Request, ...]) -> asyncio.Queue:
        """Submit to the engine thread; (choice index, update) pairs arrive on the returned queue
        of this event loop."""
        updates: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        def deliver_to(index: int):
            return lambda update: loop.call_soon_threadsafe(updates.put_nowait, (index, update))
        self.engine_loop.submit_all([(request, deliver_to(index)) for index, request in enumerate(requests)])
        return updates

    def _abort(self, call: Call, results: list) -> None:
        for request, result in zip(call.requests, results):
            if result is None:
                self.engine_loop.abort(request.request_id)

    async def complete(self, call: Call, disconnected) -> dict:
        """Run `call` to its end and return the response body; abort it if the client leaves."""
        updates = self._submit(call.requests)
        tokens: list[list[TokenEvent]] = [[] for _ in call.requests]
        results: list[Result | None] = [None] * len(call.requests)
        loop = asyncio.get_running_loop()
        checked = loop.time()
        try:
            while None in results:
                try:
                    index, update = await asyncio.wait_for(updates.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    update = None
                if loop.time() - checked >= DISCONNECT_POLL_S:     # tokens may arrive faster than the poll
                    checked = loop.time()
                    if await disconnected():
                        self._abort(call, results)
                        raise ApiError(499, "the client closed the connection") from None
                if update is None:
                    continue
                if update.event.token_id is not None:
                    tokens[index].append(update.event)
                if update.result is not None:
                    results[index] = update.result
                    if update.result.failed:
                        self._abort(call, results)
                        raise _generation_error(call, update.result)
            return self._final_body(call, results, tokens)
        except asyncio.CancelledError:
            self._abort(call, results)
            raise
        finally:
            log_request(call, results)

    async def stream(self, call: Call) -> AsyncIterator[str]:
        """Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`; the request is
        aborted when the client goes away (the generator is closed or cancelled)."""
        updates = self._submit(call.requests)
        results: list[Result | None] = [None] * len(call.requests)
        try:
            if call.kind == "chat":
                for index in range(len(call.requests)):
                    yield _sse(self._chunk(call, index, {"role": "assistant", "content": ""}, None))
            scored = call.kind == "completion" and call.requests[0].prompt_logprobs is not None
            for index, echo in enumerate(call.echoes if not scored else ()):   # scored: with the first token
                yield _sse(self._chunk(call, index, echo, None))
            answers = [tool_formats.FamilyAnswer(call.tool_format) if call.tool_format else tools.AnswerStream()
                       for _ in call.requests] if tools.active(call.params) else None
            pending: list[list[TokenEvent]] = [[] for _ in call.requests]     # tokens not yet in a chunk
            splits = [self._reasoning_split(call) for _ in call.requests]
            while None in results:
                index, update = await updates.get()
                results[index] = update.result
                if update.result is not None and update.result.failed:
                    yield _sse(_generation_error(call, update.result).body())
                    break
                if scored and update.event.prompt_logprobs is not None:
                    yield _sse(self._prompt_chunk(call, index, update.event.prompt_logprobs))
                chunks = [self._event_chunk(call, index, update, splits[index])] if answers is None else \
                    self._answer_chunks(call, index, update, answers[index], pending[index], splits[index])
                for chunk in chunks:
                    if chunk is not None:
                        yield _sse(chunk)
            else:
                if call.params.include_usage:
                    yield _sse(self._usage_chunk(call, results))
            yield "data: [DONE]\n\n"
        finally:
            self._abort(call, results)
            log_request(call, results)

    def _final_body(self, call: Call, results: list[Result], tokens: list[list[TokenEvent]]) -> dict:
        choices = []
        for index, (result, events) in enumerate(zip(results, tokens)):
            logprobs = self._logprobs(call, events)
            if call.kind == "chat":
                content, calls, reason, thinking = result.text, None, result.outcome, None
                if self._thinks(call):
                    thinking, content = split_reasoning(result.text, self.reasoning_parser)
                if call.tool_format and not result.failed:
                    content, calls = tool_formats.parse_family_answer(call.tool_format, content or "")
                    content = content or (None if thinking or calls else content)     # all thinking: no content
                    reason = "tool_calls" if calls and result.outcome == "stop" else result.outcome
                elif tools.active(call.params) and not result.failed:
                    content, calls, reason = tools.parse_answer(result.text, result.outcome)
                message = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {}),
                           **({"reasoning_content": thinking} if self.reasoning_parser else {})}
                choices.append({"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason})
            else:
                text = (call.echoes[index] if call.echoes else "") + result.text
                choices.append({"index": index, "text": text, "finish_reason": result.outcome,
                                **self._prompt_fields(call, index, result.prompt_logprobs, logprobs)})
        body = {"id": call.response_id, "object": _object(call, chunk=False), "created": now(), "model": call.model,
                "choices": choices, "usage": _usage(call, results)}
        if call.kind == "chat" and call.params.prompt_logprobs is not None:        # vLLM's place: one prompt
            body["prompt_logprobs"] = self.logprob_format.vllm_prompt(results[0].prompt_logprobs,
                                                                       call.params.prompt_logprobs)
        return body

    # ------------------------------------------------------------------ a prompt's log probabilities
    def _prompt_fields(self, call: Call, index: int, scores: list[PromptLogprob] | None,
                       generated: dict | None) -> dict:
        """A completion choice's `logprobs` (with echo and logprobs: the prompt's tokens first, then
        `generated`'s) and, when asked, vLLM's `prompt_logprobs`."""
        params, prompt = call.params, call.requests[index].prompt_ids
        fields = {"logprobs": generated}
        if call.echoes and params.logprobs is not None and scores is not None:
            echoed = self.logprob_format.legacy_prompt(prompt, scores, params.logprobs)
            fields["logprobs"] = {key: echoed[key] + (generated or {}).get(key, []) for key in echoed}
        if params.prompt_logprobs is not None:
            fields["prompt_logprobs"] = self.logprob_format.vllm_prompt(scores, params.prompt_logprobs)
        return fields

    def _prompt_chunk(self, call: Call, index: int, scores: list[PromptLogprob]) -> dict:
        """A streamed completion choice's first chunk when the prompt is scored: the echo (if asked)
        with the prompt's log probabilities, sent once the prefill computed them."""
        fields = self._prompt_fields(call, index, scores, None)
        chunk = self._chunk(call, index, call.echoes[index] if call.echoes else "", None, fields.pop("logprobs"))
        chunk["choices"][0].update(fields)
        return chunk

    def _event_chunk(self, call: Call, index: int, update: Update, split: ReasoningSplit | None) -> dict | None:
        """A streamed token's chunk: its text (a chat's split into reasoning_content and content by
        the reasoning parser, when the server has one), the finish reason at the end."""
        event = update.event
        reason = update.result.outcome if update.result is not None else None
        tokens = [event] if event.token_id is not None else []
        if split is None:
            delta = {"content": event.text} if event.text else {}
        else:
            parts = split.feed(event.text)
            if reason is not None:
                parts = tuple(a + b for a, b in zip(parts, split.finish()))
            delta = {key: text for key, text in zip(("reasoning_content", "content"), parts) if text}
        if not delta and reason is None and not (tokens and call.requests[index].logprobs):
            return None
        return self._chunk(call, index, delta if call.kind == "chat" else event.text, reason,
                           self._logprobs(call, tokens))

    def _thinks(self, call: Call) -> bool:
        """Whether a chat answer's thinking is split off: the server has a parser and the answer is not
        constrained (the generic tool format or a JSON response_format leave no room for thinking; a
        family's own tool format does: its calls are read from the content after the thinking)."""
        constrained = (tools.active(call.params) and not call.tool_format) or call.params.json_schema() is not None
        return self.reasoning_parser is not None and call.kind == "chat" and not constrained

    def _reasoning_split(self, call: Call) -> ReasoningSplit | None:
        return ReasoningSplit(self.reasoning_parser) if self._thinks(call) else None

    def _answer_chunks(self, call: Call, index: int, update: Update,
                       answer: tools.AnswerStream | tool_formats.FamilyAnswer, pending: list[TokenEvent],
                       split: ReasoningSplit | None) -> list[dict]:
        """A chat answer with active tools, streamed as it is generated: each delta its text completes
        (its thinking first when a reasoning parser splits it; then content or tool calls:
        serve.tools.AnswerStream for the generic format, serve.tool_formats.FamilyAnswer for a
        family's own) with the log probabilities of the tokens since the last chunk; at the end what
        was held back, and an empty delta with the finish reason ("tool_calls" for a complete call)."""
        if update.event.token_id is not None:
            pending.append(update.event)
        chunks, deltas, text = [], [], update.event.text
        if split is not None:
            thinking, text = split.feed(text)
            if update.result is not None:
                thinking, text = (a + b for a, b in zip((thinking, text), split.finish()))
            deltas += [{"reasoning_content": thinking}] if thinking else []
        deltas += answer.feed(text) if text else []
        if update.result is not None:
            deltas += answer.finish()
        for delta in deltas:
            chunks.append(self._chunk(call, index, delta, None, self._logprobs(call, pending)))
            pending.clear()
        if update.result is not None:
            outcome = update.result.outcome
            reason = "tool_calls" if answer.called and outcome == "stop" else outcome
            chunks.append(self._chunk(call, index, {}, reason, self._logprobs(call, pending)))
            pending.clear()
        return chunks

    def _chunk(self, call: Call, index: int, delta, reason: str | None, logprobs=None) -> dict:
        choice = {"index": index, "logprobs": logprobs, "finish_reason": reason}
        choice.update({"delta": delta} if call.kind == "chat" else {"text": delta})
        return {"id": call.response_id, "object": _object(call, chunk=True), "created": now(), "model": call.model,
                "choices": [choice]}

    def _usage_chunk(self, call: Call, results: list[Result]) -> dict:
        return {"id": call.response_id, "object": _object(call, chunk=True), "created": now(), "model": call.model,
                "choices": [], "usage": _usage(call, results)}

    def _logprobs(self, call: Call, tokens: list[TokenEvent]) -> dict | None:
        """The generated tokens' log probabilities in the endpoint's shape, when the request asked."""
        if not call.requests[0].logprobs:
            return None
        return self.logprob_format.chat(tokens) if call.kind == "chat" else self.logprob_format.legacy(tokens)



def log_request(call: Call, results: list[Result | None]) -> None:
    """The request's line at --log-level info: its id (the response's), choices, prompt tokens (and
    those resumed from a kept cache), generated tokens, time to the first token, time in all and how
    each choice ended ("abort" for one the client left before it ended)."""
    if not log.isEnabledFor(logging.INFO):
        return
    ended = [r for r in results if r is not None]
    prompts = [r for request, r in zip(call.requests, results) if r is not None and request.shares_prefill_of is None]
    firsts = [r.ttft_s for r in ended if r.ttft_s is not None]
    outcomes = ",".join(r.outcome for r in ended) + ",abort" * (len(results) - len(ended))
    log.info("request %s: %d choice%s, %d prompt tokens (%d cached), %d generated, first token %s, %.2f s in all, %s",
             call.response_id, len(results), "s" * (len(results) != 1), sum(r.prompt_tokens for r in prompts),
             sum(r.cached_tokens for r in prompts), sum(len(r.output_ids) for r in ended),
             f"{min(firsts):.2f} s" if firsts else "none", max((r.latency_s for r in ended), default=0.0),
             outcomes.lstrip(","))


def _usage(call: Call, results: list[Result]) -> dict:
    """The usage block of a response: the sums over its choices, each prompt counted once (its
    other samples share its prefill)."""
    prompts = [r for request, r in zip(call.requests, results) if request.shares_prefill_of is None]
    return usage(sum(r.prompt_tokens for r in prompts), sum(len(r.output_ids) for r in results),
                 sum(r.cached_tokens for r in prompts))


def _object(call: Call, chunk: bool) -> str:
    if call.kind == "chat":
        return "chat.completion.chunk" if chunk else "chat.completion"
    return "text_completion"


def _prompt_error(err: PromptError, param: str) -> ApiError:
    """A prompt the engine cannot take, in OpenAI's words (400; context_length_exceeded for a long one)."""
    if err.reason == "empty":
        return ApiError(400, "the prompt is empty", param=param)
    return ApiError(400, f"the prompt has {err.tokens} tokens; this model's context allows at most "
                         f"{err.limit} prompt tokens", param=param, code="context_length_exceeded")


def _generation_error(call: Call, result: Result) -> ApiError:
    """A request that failed in the engine: a prompt longer than a fresh prefill takes that no kept
    conversation resumes is the client's 400; anything else is a 500."""
    if result.prompt_error is not None:
        return _prompt_error(result.prompt_error, "messages" if call.kind == "chat" else "prompt")
    return ApiError(500, f"the request failed while generating: {result.error or result.finish_reason}")


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
