"""serve.tools: function calling on any chat template (llama.cpp's generic format)."""
import json
import random

import pytest

from snapcompile.serve.protocol import ApiError, ChatRequest
from snapcompile.serve.tools import AnswerStream, answer_schema, parse_answer, template_messages

TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
    "a": {"type": "integer"}}, "required": ["a"]}}}
OTHER = {"type": "function", "function": {"name": "noop"}}


def _chat(**fields) -> ChatRequest:
    return ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})


def test_the_tools_system_message_and_the_history_as_the_template_sees_them():
    request = ChatRequest.model_validate({"model": "m", "tools": [TOOL], "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "2"}]})
    messages = template_messages(request)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"].startswith("Be brief.\n\nYou can call tools.") and '"add"' in messages[0]["content"]
    assert json.loads(messages[2]["content"]) == {"tool_call": {"name": "add", "arguments": {"a": 1}}}
    assert messages[3]["content"] == "Result of tool call call_1: 2"
    assert template_messages(_chat(tools=[TOOL], tool_choice="none")) == [{"role": "user", "content": "hi"}]


def test_the_answer_schema_follows_tool_choice():
    auto = answer_schema(_chat(tools=[TOOL, OTHER]))
    assert len(auto["anyOf"]) == 3 and auto["anyOf"][2]["properties"] == {"response": {"type": "string"}}
    named = answer_schema(_chat(tools=[TOOL, OTHER], tool_choice={"type": "function", "function": {"name": "noop"}}))
    assert named["properties"]["tool_call"]["properties"]["name"] == {"const": "noop"}
    assert answer_schema(_chat(tools=[TOOL], tool_choice="none")) is None and answer_schema(_chat()) is None
    with pytest.raises(ApiError, match="tool_choice must be"):
        answer_schema(_chat(tools=[TOOL], tool_choice={"type": "function"}))


def test_answers_become_tool_calls_or_content():
    content, calls, reason = parse_answer('{"tool_call": {"name": "add", "arguments": {"a": 2}}}', "stop")
    assert content is None and reason == "tool_calls" and json.loads(calls[0]["function"]["arguments"]) == {"a": 2}
    assert parse_answer('{"response": "four"}', "stop") == ("four", None, "stop")
    assert parse_answer('{"tool_call": {"na', "length") == ("", None, "length")       # the wrapper never comes out
    assert parse_answer('{"tool_call": {"name": "add", "arguments": {"a": ', "length") == (None, None, "length")
    assert parse_answer('{"response": "Paris is a c\\u00e9l\\', "length") == ("Paris is a cél", None, "length")


ANSWERS = ['{"tool_call": {"name": "get_weather", "arguments": {"city": "S\\u00e3o \\"Paulo\\"", '
           '"days": [1, {"x": "}"}]}}}',
           '{"response": "line\\none \\ud83d\\ude00 and \\\\ then \\"quoted\\" caf\\u00e9"}',
           '{"response": ""}']


@pytest.mark.parametrize("answer", ANSWERS)
def test_a_streamed_answer_gives_the_whole_answers_message_in_any_pieces(answer):
    """AnswerStream fed in pieces of 1..7 characters: the content decodes as json.loads decodes it
    (escapes and a surrogate pair split anywhere), or the call's id and name come first and its
    arguments' text adds up to the raw arguments; parse_answer of the whole text says the same."""
    content, calls, reason = parse_answer(answer, "stop")
    rng = random.Random(len(answer))
    for _ in range(30):
        stream, deltas, at = AnswerStream(), [], 0
        while at < len(answer):
            step = rng.randint(1, 7)
            deltas += stream.feed(answer[at:at + step])
            at += step
        if calls is None:
            assert "".join(d["content"] for d in deltas) == content == json.loads(answer)["response"]
            continue
        first = deltas[0]["tool_calls"][0]
        assert first["id"] == stream.call_id and first["function"] == {"name": "get_weather", "arguments": ""}
        arguments = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas)
        assert arguments == calls[0]["function"]["arguments"]
        assert json.loads(arguments) == json.loads(answer)["tool_call"]["arguments"]
