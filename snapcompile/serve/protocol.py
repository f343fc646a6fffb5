"""The OpenAI wire format: request bodies (validated), error bodies and response builders.

Fields that do not change the result (user, metadata, store, ...) are accepted and ignored (the
models allow extra fields); the fields read are typed strictly ("stream": "yes" or "max_tokens":
true are 400s, not coerced); fields that would change the result but are not implemented here
(n > 1, tools, OpenAI's and vLLM's and llama.cpp's other sampling fields: UNSUPPORTED) are refused
with a 400 naming the field, never dropped.
"""
from __future__ import annotations

import re
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from snapcompile.engine.request import SamplingParams, check_stop_strings, logit_bias_pairs
from snapcompile.engine.sampling_bounds import (
    LogitBias,
    MinP,
    Penalty,
    RepetitionPenalty,
    Seed,
    Temperature,
    TopK,
    TopP,
)
from snapcompile.errors import SnapcompileError
from snapcompile.prompts import TemplateOptions
from snapcompile.serve.partitions import MAX_SALT_CHARS

MAX_TOP_LOGPROBS = 20
MAX_N = 16                 # samples per prompt (each needs a slot of its own at once)
# fields some OpenAI-compatible server honours that would change the answer and are not implemented
# here: refused by name when given (a value equal to the field's neutral one is accepted)
UNSUPPORTED = {"functions": None, "suffix": None, "best_of": 1, "typical_p": 1.0, "top_a": 0.0,
               "min_tokens": 0, "use_beam_search": False, "length_penalty": 1.0, "stop_token_ids": None,
               "bad_words": None, "guided_json": None, "guided_regex": None, "guided_choice": None,
               "guided_grammar": None, "structured_outputs": None, "truncate_prompt_tokens": None,
               "repeat_penalty": 1.0, "repeat_last_n": None, "penalty_last_n": None, "mirostat": 0, "tfs_z": 1.0,
               "dry_multiplier": 0.0, "xtc_probability": 0.0,
               "grammar": None, "json_schema": None, "samplers": None, "dynatemp_range": 0.0,
               "chat_template": None}
MAX_TEMPLATE_VARIABLES = 16        # chat_template_kwargs entries
MAX_TEMPLATE_VALUE_CHARS = 4096
# what the renderer itself passes the template: a chat_template_kwargs entry may not replace it
RESERVED_TEMPLATE_NAMES = {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
                           "tokenize", "chat_template"}


class ApiError(Exception):
    """An error response in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    @property
    def kind(self) -> str:
        return {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
                415: "invalid_request_error", 429: "rate_limit_error",
                503: "service_unavailable"}.get(self.status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: bool = False


class _Sampling(BaseModel):
    """Parameters shared by both endpoints, with OpenAI's ranges."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Temperature = 1.0                  # every range: engine/sampling_bounds.py
    top_p: TopP = 1.0
    top_k: TopK | Literal[-1] = 0                   # vLLM's: 0 or -1 keeps every token
    min_p: MinP = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: dict[str, LogitBias] | None = None   # token id (as a string, OpenAI's form) -> bias
    seed: Seed | None = None
    stop: str | list[str] | None = Field(None, validate_default=True)
    n: int = Field(1, ge=1, le=MAX_N)         # samples of each prompt, sharing its prefill
    ignore_eos: bool = False               # vLLM's extension, for fixed-length benchmarks
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_SALT_CHARS)   # vLLM's: who shares kept caches
    # vLLM's: each prompt token's log probability with this many likeliest tokens at its position
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else (value or [])
        try:
            check_stop_strings(stops)
        except SnapcompileError as err:
            raise ValueError(str(err)) from None
        return stops

    def unsupported(self) -> None:
        """Refuse what this server does not implement, naming the field."""
        extra = self.model_extra or {}
        for name, neutral in UNSUPPORTED.items():
            if extra.get(name) not in (None, neutral) and not (neutral is None and extra.get(name) in ([], {}, "")):
                raise ApiError(400, f"{name} is not supported by this server", param=name)

    def json_schema(self) -> dict | None:
        """The JSON schema `response_format` asks the answer to follow (json_object: any object;
        json_schema: its `schema`), or None for text."""
        response_format = (self.model_extra or {}).get("response_format")
        if response_format is None:
            return None
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            return {"type": "object"}
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise ApiError(400, "response_format json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": "
                                    "{...}}}", param="response_format")
            return schema
        raise ApiError(400, "response_format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                            "{\"type\": \"json_schema\", ...}", param="response_format")

    def sampling(self) -> SamplingParams:
        """The engine's SamplingParams of these fields (a 400 naming the field when they do not fit)."""
        try:
            return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=max(self.top_k, 0),
                                  seed=self.seed, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                                  presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                                  logit_bias=logit_bias_pairs(self.logit_bias or {}))
        except SnapcompileError as err:            # each message begins with the field's name
            raise ApiError(400, str(err), param=str(err).split()[0]) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = Field(None, max_length=4096)
    parameters: dict | None = None           # a JSON schema of the arguments (none: any object)


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["function"]
    function: FunctionDef


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    name: str
    arguments: str                           # JSON text, as OpenAI sends it back


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = Field(None, max_length=64)     # an assistant's earlier calls
    tool_call_id: str | None = Field(None, max_length=256)             # a tool message's call

    def text(self) -> str:
        if isinstance(self.content, list):
            if any(part.type != "text" or part.text is None for part in self.content):
                raise ApiError(400, "only text content parts are supported", param="messages")
            return "".join(part.text for part in self.content)
        return self.content or ""


# A chat prompt's tools: /v1/chat/completions and /tokenize take the same fields, so that both make
# the same prompt (serve.tools.template_messages reads them from either).
Tools = Annotated[list[ToolDef] | None, Field(max_length=128)]
ToolChoice = Literal["none", "auto", "required"] | dict | None
TemplateValue = Annotated[str, Field(max_length=MAX_TEMPLATE_VALUE_CHARS)] | bool | int | float | None


class _ChatTemplate(BaseModel):
    """How the chat template renders a chat (/v1/chat/completions and /tokenize alike), as vLLM takes it."""

    model_config = ConfigDict(extra="allow", strict=True)
    messages: list[Message] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, TemplateValue] | None = Field(None, max_length=MAX_TEMPLATE_VARIABLES)

    def template_options(self) -> TemplateOptions:
        """TemplateOptions of these fields (a 400 naming the field when they do not fit)."""
        variables = self.chat_template_kwargs or {}
        for name in variables:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,63}", name) or name in RESERVED_TEMPLATE_NAMES:
                raise ApiError(400, f"chat_template_kwargs: {name[:64]!r} is not a template variable one may set "
                                    f"(a name of letters, digits and _, not one of "
                                    f"{', '.join(sorted(RESERVED_TEMPLATE_NAMES))})", param="chat_template_kwargs")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ApiError(400, "continue_final_message continues the final message, which must be the assistant's",
                           param="continue_final_message")
        try:
            return TemplateOptions(self.add_generation_prompt, self.continue_final_message,
                                   tuple(sorted(variables.items())))
        except SnapcompileError as err:
            raise ApiError(400, str(err), param="continue_final_message") from None


class ChatRequest(_Sampling, _ChatTemplate):
    tools: Tools = None
    tool_choice: ToolChoice = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    def max_new_tokens(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default

    def logprob_counts(self) -> tuple[bool, int]:
        """(record each token's log probability, how many likeliest tokens per position)."""
        if self.top_logprobs and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs to be true", param="top_logprobs")
        return self.logprobs, (self.top_logprobs or 0) if self.logprobs else 0

    def prompt_logprob_count(self) -> int | None:
        """How many likeliest tokens to record at each prompt position (None: no prompt log probabilities)."""
        if self.prompt_logprobs is not None and self.stream:
            raise ApiError(400, "prompt_logprobs is not streamed on /v1/chat/completions: ask without stream",
                           param="prompt_logprobs")
        return self.prompt_logprobs


PromptItem = str | list[int]       # one prompt: text, or token ids


class CompletionRequest(_Sampling):
    """/v1/completions. `prompt` takes OpenAI's four forms: a string, a list of strings, a list of
    token ids, or a list of token-id lists; each prompt is one choice of the response (`index` in
    the order given)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False

    def prompts(self, max_prompts: int) -> list[PromptItem]:
        """The prompts, one per choice; at most `max_prompts` of them (a 400 beyond)."""
        prompt = self.prompt
        one = isinstance(prompt, str) or (prompt and all(isinstance(token, int) for token in prompt))
        items = [prompt] if one else list(prompt)
        if not items:
            raise ApiError(400, "the prompt list is empty", param="prompt")
        if len(items) > max_prompts:
            raise ApiError(400, f"{len(items)} prompts in one request; this server takes at most {max_prompts} "
                                "(--max-prompts-per-request)", param="prompt")
        return items

    def max_new_tokens(self, default: int) -> int:
        return self.max_tokens or default

    def logprob_counts(self) -> tuple[bool, int]:
        return self.logprobs is not None, self.logprobs or 0

    def prompt_logprob_count(self) -> int | None:
        """How many likeliest tokens to record at each prompt position: echo with logprobs gives the
        prompt's in the logprobs block, prompt_logprobs vLLM's list (None: neither asked)."""
        echoed = self.logprobs if self.echo else None
        counts = [count for count in (echoed, self.prompt_logprobs) if count is not None]
        return max(counts) if counts else None


class TokenizeRequest(_ChatTemplate):
    """/tokenize, in vLLM's form (`prompt`, or chat `messages` through the template, with `tools`,
    `tool_choice` and the template fields as a chat completion takes them) or llama-server's
    (`content`): exactly one of the three."""

    model: str | None = None
    prompt: str | None = None
    content: str | None = None
    messages: list[Message] | None = Field(None, min_length=1)
    tools: Tools = None
    tool_choice: ToolChoice = None
    add_special_tokens: bool | None = None
    add_special: bool | None = None

    def check(self) -> None:
        if sum(value is not None for value in (self.prompt, self.content, self.messages)) != 1:
            raise ApiError(400, "give exactly one of prompt, content (text) or messages (a chat)", param="prompt")
        if self.messages is None and (self.tools is not None or self.tool_choice is not None):
            raise ApiError(400, "tools and tool_choice belong to a chat: give them with messages", param="tools")
        template = {"add_generation_prompt": not self.add_generation_prompt, "continue_final_message":
                    self.continue_final_message, "chat_template_kwargs": self.chat_template_kwargs is not None}
        for name, given in template.items():
            if self.messages is None and given:
                raise ApiError(400, f"{name} shapes a chat's rendering: give it with messages", param=name)
        fed = self.messages is None     # a text prompt is fed with the special tokens its tokenizer adds
        for name in ("add_special_tokens", "add_special"):
            if getattr(self, name) is not None and getattr(self, name) != fed:
                how = ("a text prompt with the special tokens its tokenizer adds (a BOS)" if fed else
                       "a chat with the special tokens its template writes, none added")
                raise ApiError(400, f"{name}: {str(not fed).lower()} is not supported: the ids are those the "
                                    f"completion endpoints feed the model, {how}", param=name)


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    tokens: list[int]


def parse(model: type[BaseModel], body: Any) -> BaseModel:
    """Validate a JSON body; the first problem becomes a 400 naming its field."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as err:
        first = err.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise ApiError(400, f"{param}: {first['msg']}" if param else first["msg"], param=param) from None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage block; cached_tokens: prompt tokens resumed from a kept cache, not prefilled."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}
