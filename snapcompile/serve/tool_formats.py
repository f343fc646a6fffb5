"""Each model family's own tool-call format, chosen from the chat template, for tool_choice "auto".

A template that renders `tools` itself gets them that way (and the history's calls and results as
its own messages), the answer is generated unconstrained, and the family's syntax is read from it,
as vLLM's tool parsers read it:

- "hermes" (Hermes, Qwen2.5, Qwen3: the template writes <tool_call>): each call a
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` block, text around them content;
- "llama3" (Llama 3.1-3.3: <|python_tag|>, or tools with Llama 3's headers): an answer that is one or
  more `{"name": ..., "parameters": {...}}` objects (separated by ";"), else content;
- "mistral" ([TOOL_CALLS]): an answer that is `[TOOL_CALLS]` (a control token the text may have
  lost) and a JSON list of `{"name": ..., "arguments": {...}}`, else content.

Any other template, and tool_choice "required" or a named function on any template, use the generic
constrained format (serve/tools.py), as vLLM constrains those with a JSON schema. Streamed
(`FamilyAnswer`), content goes out as it comes, holding back only what may begin a call; a hermes
call goes out as soon as its block closes, a llama3 or mistral answer that may be a call once it
ends. Text that does not parse as the family's call stays content: nothing is dropped.
"""
from __future__ import annotations

import json

from snapcompile.engine.output import stop_prefix_overlap
from snapcompile.serve.tools import arguments_json, new_call_id

FORMATS = ("hermes", "llama3", "mistral")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_MARK = "[TOOL_CALLS]"
WHOLE_OPENERS = {"llama3": ("{", "<|python_tag|>"), "mistral": ("[",)}    # what a whole-answer call begins with


def format_of(template: str | None) -> str:
    """The tool format a chat template writes: one of FORMATS, or "generic"."""
    if not template or "tools" not in template:
        return "generic"
    if HERMES_OPEN in template:
        return "hermes"
    if MISTRAL_MARK in template:
        return "mistral"
    if "<|python_tag|>" in template or "<|start_header_id|>" in template:
        return "llama3"
    return "generic"


def native_messages(request) -> tuple[list[dict], list[dict]]:
    """(messages, tools) as a template that renders tools takes them: assistant messages with their
    `tool_calls` (arguments as objects), `tool` messages with their call's id."""
    messages = []
    for message in request.messages:
        entry = {"role": message.role, "content": message.text()}
        if message.role == "assistant" and message.tool_calls:
            entry["tool_calls"] = [{"id": call.id, "type": "function",
                                    "function": {"name": call.function.name,
                                                 "arguments": arguments_json(call.function.arguments)}}
                                   for call in message.tool_calls]
        if message.role == "tool":
            entry["tool_call_id"] = message.tool_call_id or ""
        messages.append(entry)
    return messages, [tool.model_dump(exclude_none=True) for tool in request.tools]


def _call_delta(index: int, name: str, arguments) -> dict:
    return {"tool_calls": [{"index": index, "id": new_call_id(), "type": "function",
                            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}]}


def _calls_of(objects, arguments_key: str) -> list[tuple[str, object]] | None:
    """(name, arguments) of each object when every one is a call ({"name": str, key: object}), else None."""
    calls = []
    for value in objects:
        if not (isinstance(value, dict) and isinstance(value.get("name"), str)
                and isinstance(value.get(arguments_key, {}), dict)):
            return None
        calls.append((value["name"], value.get(arguments_key, {})))
    return calls or None


def _json_values(text: str, separator: str = ";") -> list | None:
    """The JSON values `text` holds one after another (separated by `separator` and whitespace), or None."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and (text[at].isspace() or (values and text[at] == separator)):
            at += 1
        if at == len(text):
            return values
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        values.append(value)


class FamilyAnswer:
    """One answer in a family's format, fed piece by piece: feed(piece) and, at the end, finish()
    give OpenAI deltas ({"content": ...} or {"tool_calls": [...]}, each call whole with its index);
    `called` once a call went out."""

    def __init__(self, family: str):
        if family not in FORMATS:
            raise ValueError(f"unknown tool format {family!r}")
        self.family, self.held, self.calls = family, "", 0
        self.state = "start"         # "start" | "content" | "call" (a hermes block) | "whole" (all held to the end)

    @property
    def called(self) -> bool:
        return self.calls > 0

    def feed(self, piece: str) -> list[dict]:
        self.held += piece
        deltas: list[dict] = []
        while True:
            if self.state == "start":
                begun = self.held.lstrip()
                if not begun:
                    return deltas
                openers = WHOLE_OPENERS.get(self.family, ())
                if begun.startswith(openers):
                    self.state = "whole"
                elif any(opener.startswith(begun) for opener in openers):
                    return deltas                   # may still become one
                else:
                    self.state = "content"
                continue
            if self.state == "whole":
                return deltas
            if self.state == "content":
                at = self.held.find(HERMES_OPEN) if self.family == "hermes" else -1
                keep = 0 if self.family != "hermes" else \
                    stop_prefix_overlap(self.held[-(len(HERMES_OPEN) - 1):], HERMES_OPEN)
                text = self.held[:at] if at >= 0 else self.held[:len(self.held) - keep]
                if text:
                    deltas.append({"content": text})
                if at < 0:
                    self.held = self.held[len(self.held) - keep:]
                    return deltas
                self.held, self.state = self.held[at:], "call"
                continue
            end = self.held.find(HERMES_CLOSE)
            if end < 0:
                return deltas
            deltas += self._hermes_block(self.held[:end + len(HERMES_CLOSE)])
            self.held, self.state = self.held[end + len(HERMES_CLOSE):], "content"

    def finish(self) -> list[dict]:
        """The deltas of what was held back once the answer ended (a cut hermes block is content)."""
        rest, self.held = self.held, ""
        if self.state == "whole":
            return self._whole(rest)
        return [{"content": rest}] if rest else []

    def _hermes_block(self, block: str) -> list[dict]:
        values = _json_values(block[len(HERMES_OPEN):-len(HERMES_CLOSE)])
        calls = _calls_of(values, "arguments") if values is not None and len(values) == 1 else None
        if calls is None:
            return [{"content": block}]
        self.calls += 1
        return [_call_delta(self.calls - 1, *calls[0])]

    def _whole(self, text: str) -> list[dict]:
        """A llama3 or mistral answer that began like a call: its calls, or all of it as content."""
        body = text.strip()
        if self.family == "llama3":
            values = _json_values(body.removeprefix("<|python_tag|>")) or []
            calls = _calls_of(values, "parameters") or _calls_of(values, "arguments")
        else:
            values = _json_values(body.removeprefix(MISTRAL_MARK))
            calls = _calls_of(values[0], "arguments") if values and len(values) == 1 and isinstance(values[0], list) \
                else None
        if calls is None:
            return [{"content": text}] if text else []
        deltas = [_call_delta(self.calls + i, name, arguments) for i, (name, arguments) in enumerate(calls)]
        self.calls += len(calls)
        return deltas


def parse_family_answer(family: str, text: str) -> tuple[str | None, list[dict] | None]:
    """(content, tool_calls) of a whole answer in `family`'s format, as FamilyAnswer streams it."""
    answer = FamilyAnswer(family)
    deltas = answer.feed(text) + answer.finish()
    content = "".join(delta.get("content", "") for delta in deltas)
    calls = [{key: value for key, value in call.items() if key != "index"}
             for delta in deltas for call in delta.get("tool_calls", ())]
    return content or (None if calls else content), calls or None
