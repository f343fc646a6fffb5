"""serve/tool_formats.py: each family's tool calls read from its own syntax, whole or streamed in any
pieces alike; text that is not a call stays content."""
from __future__ import annotations

import json
import random

import pytest

from snapcompile.serve.tool_formats import FamilyAnswer, format_of, parse_family_answer

CALL = {"name": "get_weather", "arguments": {"city": "São Paulo", "days": [1, 2]}}
CASES = [  # family, answer, content, [(name, arguments)]
    ("hermes", f"Let me check.\n<tool_call>\n{json.dumps(CALL)}\n</tool_call>", "Let me check.\n",
     [("get_weather", CALL["arguments"])]),
    ("hermes", f"<tool_call>{json.dumps(CALL)}</tool_call>\n<tool_call>{{\"name\": \"noop\"}}</tool_call>", "\n",
     [("get_weather", CALL["arguments"]), ("noop", {})]),
    ("hermes", "The sign < is not a <tool_ca", "The sign < is not a <tool_ca", []),
    ("hermes", "<tool_call>{not json}</tool_call> done", "<tool_call>{not json}</tool_call> done", []),
    ("hermes", "<tool_call>{\"name\": \"cut", "<tool_call>{\"name\": \"cut", []),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Oslo"}}', None, [("get_weather", {"city": "Oslo"})]),
    ("llama3", '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}', None,
     [("a", {}), ("b", {"x": 1})]),
    ("llama3", "{ is how a block starts in C", "{ is how a block starts in C", []),
    ("llama3", "Plain answer {with braces}.", "Plain answer {with braces}.", []),
    ("mistral", f"[TOOL_CALLS][{json.dumps(CALL)}]", None, [("get_weather", CALL["arguments"])]),
    ("mistral", f"[{json.dumps(CALL)}]", None, [("get_weather", CALL["arguments"])]),
    ("mistral", "[1] is a footnote.", "[1] is a footnote.", []),
]


@pytest.mark.parametrize("family, answer, content, calls", CASES)
def test_whole_and_streamed_answers_agree(family, answer, content, calls):
    whole_content, whole_calls = parse_family_answer(family, answer)
    assert whole_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole_calls or []] == calls
    rng = random.Random(answer)
    for _ in range(30):
        stream, deltas, at = FamilyAnswer(family), [], 0
        while at < len(answer):
            step = rng.randint(1, 6)
            deltas += stream.feed(answer[at:at + step])
            at += step
        deltas += stream.finish()
        assert "".join(d.get("content", "") for d in deltas) == (content or "")
        streamed = [c for d in deltas for c in d.get("tool_calls", ())]
        assert [c["index"] for c in streamed] == list(range(len(calls))) and stream.called == bool(calls)
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in streamed] == calls


def test_a_hermes_call_goes_out_when_its_block_closes_and_content_before_it():
    stream = FamilyAnswer("hermes")
    assert stream.feed("Checking <tool") == [{"content": "Checking "}]
    assert stream.feed(f"_call>{json.dumps(CALL)}") == []
    (delta,) = stream.feed("</tool_call>")
    call = delta["tool_calls"][0]
    assert call["function"]["name"] == "get_weather" and call["id"].startswith("call_")


@pytest.mark.parametrize("template, family", [
    ("{% for m in messages %}{{ m.content }}{% endfor %}", "generic"),
    ("{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}<tool_call>", "hermes"),
    ("{% if tools %}[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]", "mistral"),
    ("<|start_header_id|>{% if tools %}{{ tools }}{% endif %}<|python_tag|>", "llama3"),
    ("<tool_call> and no tool list", "generic"),
    (None, "generic"),
])
def test_the_format_is_read_from_the_template(template, family):
    assert format_of(template) == family
