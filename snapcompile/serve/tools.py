"""OpenAI function calling on any chat template, the way llama.cpp's generic format does it.

With `tools` (and `tool_choice` other than "none") the chat gets a system message listing the tools
and the answer format, and the answer is constrained (engine.constraints) to one JSON object:
`{"tool_call": {"name": ..., "arguments": {...}}}` (arguments valid under the tool's parameter
schema) or, with tool_choice "auto", `{"response": "..."}`. The object is then returned as
OpenAI's `tool_calls` (finish_reason "tool_calls") or as the message content; streamed, as one
chunk once the answer is complete (the call is known only then). Earlier calls and
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
            calls = [{"tool_call": {"name": call.function.name, "arguments": _arguments(call.function.arguments)}}
                     for call in message.tool_calls]
            messages.append({"role": "assistant", "content": " ".join(json.dumps(call) for call in calls)})
        else:
            messages.append({"role": message.role, "content": message.text()})
    if active(request):
        prompt = TOOLS_PROMPT.format(direct=DIRECT if _choice(request) == "auto" else "",
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
    choice = _choice(request)
    tools = request.tools if choice in ("auto", "required") else [t for t in request.tools if t.function.name == choice]
    if not tools:
        raise ApiError(400, f"tool_choice names {choice!r}, which is not among the tools", param="tool_choice")
    options = [_call_schema(tool.function.name, tool.function.parameters) for tool in tools]
    if choice == "auto":
        options.append(_object({"response": {"type": "string"}}))
    return options[0] if len(options) == 1 else {"anyOf": options}


def parse_answer(text: str, finish_reason: str) -> tuple[str | None, list[dict] | None, str]:
    """(content, tool_calls, finish_reason) of a constrained answer; an answer cut short (not
    "stop") is returned as its text."""
    if finish_reason != "stop":
        return text, None, finish_reason
    answer = json.loads(text)
    if "tool_call" in answer:
        call = answer["tool_call"]
        return None, [{"id": f"call_{secrets.token_hex(12)}", "type": "function",
                       "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}}], "tool_calls"
    return answer["response"], None, "stop"


def _choice(request: ChatRequest | TokenizeRequest) -> str:
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


def _arguments(text: str):
    """An earlier call's arguments as JSON (its text when it is not JSON)."""
    try:
        return json.loads(text)
    except ValueError:
        return text
