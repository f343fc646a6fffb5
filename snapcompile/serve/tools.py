"""OpenAI function calling on any chat template, the way llama.cpp's generic format does it (a
template that renders tools itself answers tool_choice "auto" in its family's format instead:
serve/tool_formats.py).

With `tools` (and `tool_choice` other than "none") the chat gets a system message listing the tools
and the answer format, and the answer is constrained (engine.constraints) to one JSON object:
`{"tool_call": {"name": ..., "arguments": {...}}}` (arguments valid under the tool's parameter
schema) or, with tool_choice "auto", `{"response": "..."}`. The object is then returned as
OpenAI's `tool_calls` (finish_reason "tool_calls") or as the message content; streamed, as OpenAI's
deltas while it is generated (`AnswerStream`: the content as it decodes, or the call's name, then its
arguments' text piece by piece). Earlier calls and
tool results in the history are rendered as that format and as user turns, so every template
takes them.
"""
from __future__ import annotations

import json
import secrets

from snapcompile.serve.protocol import ApiError, ChatRequest, TokenizeRequest

TOOLS_PROMPT = ("You can call tools. To call one, answer with only this JSON: "
                '{{"tool_call": {{"name": "<tool name>", "arguments": {{<its arguments>}}}}}}.{direct}\n'
                "The tools, as JSON:\n{tools}")
DIRECT = ' To answer the user yourself, answer with only this JSON: {"response": "<your answer>"}.'


def active(request) -> bool:
    """Whether `request` (a chat, or /tokenize's messages) offers tools the answer may call."""
    return bool(getattr(request, "tools", None)) and request.tool_choice != "none"


def template_messages(request: ChatRequest | TokenizeRequest) -> list[dict]:
    """The chat as the template's {"role", "content"} messages: the tools' system message first
    (merged into a leading system message) when tools are active; assistant tool calls as the JSON
    the model answers with; tool results as user turns naming their call."""
    messages = []
    for message in request.messages:
        if message.role == "tool":
            messages.append({"role": "user", "content": f"Result of tool call {message.tool_call_id or ''}: "
                                                        f"{message.text()}"})
        elif message.role == "assistant" and message.tool_calls:
            calls = [{"tool_call": {"name": call.function.name, "arguments": arguments_json(call.function.arguments)}}
                     for call in message.tool_calls]
            messages.append({"role": "assistant", "content": " ".join(json.dumps(call) for call in calls)})
        else:
            messages.append({"role": message.role, "content": message.text()})
    if active(request):
        prompt = TOOLS_PROMPT.format(direct=DIRECT if tool_choice_of(request) == "auto" else "",
                                     tools=json.dumps([tool.model_dump(exclude_none=True) for tool in request.tools]))
        if messages and messages[0]["role"] in ("system", "developer"):
            messages[0] = {"role": messages[0]["role"], "content": messages[0]["content"] + "\n\n" + prompt}
        else:
            messages.insert(0, {"role": "system", "content": prompt})
    return messages


def answer_schema(request: ChatRequest) -> dict | None:
    """The JSON schema the answer must follow when tools are active, else None."""
    if not active(request):
        return None
    choice = tool_choice_of(request)
    tools = request.tools if choice in ("auto", "required") else [t for t in request.tools if t.function.name == choice]
    if not tools:
        raise ApiError(400, f"tool_choice names {choice!r}, which is not among the tools", param="tool_choice")
    options = [_call_schema(tool.function.name, tool.function.parameters) for tool in tools]
    if choice == "auto":
        options.append(_object({"response": {"type": "string"}}))
    return options[0] if len(options) == 1 else {"anyOf": options}


CALL_PREFIX = '{"tool_call": {"name": "'       # the constrained answer's two beginnings (compact JSON,
RESPONSE_PREFIX = '{"response": "'               # properties in the schema's order: engine.constraints)
ARGUMENTS_PREFIX = '", "arguments": '


def parse_answer(text: str, finish_reason: str) -> tuple[str | None, list[dict] | None, str]:
    """(content, tool_calls, finish_reason) of a constrained answer, read as AnswerStream streams it
    (so a whole answer and a streamed one agree, the arguments' text as generated). An answer cut
    short (not "stop") is content: the text of a cut {"response": ...} so far, None for a cut tool
    call (its arguments are incomplete), never the JSON wrapper."""
    answer = AnswerStream()
    deltas = answer.feed(text)
    if answer.kind != "call":
        return "".join(delta["content"] for delta in deltas), None, finish_reason
    if finish_reason != "stop":
        return None, None, finish_reason
    pieces = [call["function"] for delta in deltas for call in delta["tool_calls"]]
    function = {"name": pieces[0]["name"], "arguments": "".join(piece["arguments"] for piece in pieces)}
    return None, [{"id": answer.call_id, "type": "function", "function": function}], "tool_calls"


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


class AnswerStream:
    """A constrained answer's text, fed piece by piece as it is generated, as OpenAI's streamed
    deltas: the response's content as it decodes ({"content": ...}), or the tool call's id and name
    once the name is complete, then its arguments' JSON text as it comes ({"tool_calls": [{"index":
    0, ...}]}), as OpenAI streams them. Each piece costs its own length."""

    def __init__(self):
        self.kind: str | None = None          # "content" | "call", once the beginning tells
        self.call_id = new_call_id()
        self._head = ""                       # the beginning, until it tells the kind; then the name
        self._name: str | None = None
        self._separator = len(ARGUMENTS_PREFIX) - 1     # characters between the name's quote and the arguments
        self._body = _StringBody()            # the response's text
        self._scan = _ObjectEnd()             # the arguments object

    @property
    def called(self) -> bool:
        """The answer is a call (its deltas began going out)."""
        return self.kind == "call"

    def finish(self) -> list[dict]:
        """Nothing is held back at the end (the grammar made the answer complete, or it was cut)."""
        return []

    def feed(self, piece: str) -> list[dict]:
        """The deltas `piece` (the answer's next text) completes."""
        if self.kind is None:
            self._head += piece
            for kind, prefix in (("content", RESPONSE_PREFIX), ("call", CALL_PREFIX)):
                if self._head.startswith(prefix):
                    self.kind, piece, self._head = kind, self._head[len(prefix):], ""
            if self.kind is None:
                return []
        if self.kind == "content":
            new = self._body.feed(piece)
            return [{"content": new}] if new else []
        return self._call(piece)

    def _call(self, piece: str) -> list[dict]:
        deltas = []
        if self._name is None:
            self._head += piece
            name_end = self._head.find('"')
            if name_end < 0:
                return deltas
            self._name, piece = self._head[:name_end], self._head[name_end + 1:]
            deltas.append({"tool_calls": [{"index": 0, "id": self.call_id, "type": "function",
                                           "function": {"name": self._name, "arguments": ""}}]})
        skipped = min(self._separator, len(piece))
        self._separator -= skipped
        new = self._scan.feed(piece[skipped:])
        if new:
            deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": new}}]})
        return deltas


class _ObjectEnd:
    """A JSON object that a text begins with, fed piece by piece: feed(piece) -> the part of the
    piece that belongs to the object (nothing once it closed)."""

    def __init__(self):
        self.depth, self.in_string, self.escaped, self.closed = 0, False, False, False

    def feed(self, piece: str) -> str:
        for i, char in enumerate(piece):
            if self.closed:
                return piece[:i]
            if self.in_string:
                self.escaped, self.in_string = (False, True) if self.escaped else (char == "\\", char != '"')
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                self.closed = self.depth == 0
        return piece


class _StringBody:
    """A JSON string's body (the text after its opening quote), fed piece by piece: feed(piece) ->
    the characters it adds, up to the closing quote, holding back an escape sequence not yet
    complete (and the first half of a surrogate pair)."""

    def __init__(self):
        self.pending, self.escaped, self.closed = "", False, False

    def feed(self, piece: str) -> str:
        if self.closed:
            return ""
        for i, char in enumerate(piece):
            if self.escaped:
                self.escaped = False
            elif char == "\\":
                self.escaped = True
            elif char == '"':
                self.closed, piece = True, piece[:i]
                break
        self.pending += piece
        for cut in range(len(self.pending), max(len(self.pending) - 12, -1), -1):
            try:
                text = json.loads(f'"{self.pending[:cut]}"')
            except ValueError:
                continue
            if text and "\ud800" <= text[-1] <= "\udbff" and not self.closed:
                continue                         # a high surrogate whose pair has not come
            self.pending = self.pending[cut:]
            return text
        return ""


def tool_choice_of(request: ChatRequest | TokenizeRequest) -> str:
    """"auto", "required", or the one tool's name tool_choice names."""
    choice = request.tool_choice or "auto"
    if isinstance(choice, dict):
        function = choice.get("function") if choice.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise ApiError(400, 'tool_choice must be "none", "auto", "required" or {"type": "function", '
                                '"function": {"name": ...}}', param="tool_choice")
        return name
    return choice


def _call_schema(name: str, parameters: dict | None) -> dict:
    arguments = parameters if parameters else {"type": "object"}
    return _object({"tool_call": _object({"name": {"const": name}, "arguments": arguments})})


def _object(properties: dict) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


def arguments_json(text: str):
    """An earlier call's arguments as JSON (its text when it is not JSON)."""
    try:
        return json.loads(text)
    except ValueError:
        return text
