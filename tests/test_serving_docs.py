"""docs/serving.md is true field by field: every request field the server reads, and every field it
refuses, is named there; each refused field given a value other than its neutral one is a 400 naming
it on both endpoints, never dropped; each neutral value is accepted."""
from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from snapcompile.serve.protocol import UNSUPPORTED, ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from tests.server_process import ServerProcess

DOC = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text()
READ_FROM_EXTRAS = {"response_format"}          # read from a request's extra fields (protocol.json_schema)


def _documented(field: str) -> bool:
    """Named in backquotes: `field`, `field: ...`, `field.sub` or as a JSON key ("field") inside them."""
    return re.search(rf"`{re.escape(field)}[`\s:=.]|`[^`]*\"{re.escape(field)}\"[^`]*`", DOC) is not None


@pytest.mark.parametrize("model", [ChatRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest])
def test_every_field_the_server_reads_is_documented(model):
    missing = [field for field in set(model.model_fields) | READ_FROM_EXTRAS if not _documented(field)]
    assert not missing, f"{model.__name__}: {missing} not in docs/serving.md"


def test_every_refused_field_is_documented():
    missing = [field for field in UNSUPPORTED if not _documented(field)]
    assert not missing, f"refused but not named in docs/serving.md: {missing}"


@pytest.fixture(scope="module")
def server(tiny_dense_dir, tmp_path_factory):
    process = ServerProcess(tiny_dense_dir, log=tmp_path_factory.mktemp("docs") / "server.log").wait_ready()
    yield process
    assert process.stop() == 0


def _other_than(neutral):
    """A value other than a refused field's neutral one (of its type)."""
    if isinstance(neutral, bool):
        return not neutral
    if isinstance(neutral, (int, float)):
        return neutral + 2
    return "x"


@pytest.mark.parametrize("endpoint, body", [
    ("/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 2}),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
])
def test_each_refused_field_is_a_400_naming_it_and_its_neutral_value_is_accepted(server, endpoint, body):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for field, neutral in UNSUPPORTED.items():
            response = client.post(endpoint, json={**body, field: _other_than(neutral)})
            assert response.status_code == 400, (field, response.text)
            assert response.json()["error"]["param"] == field, (field, response.text)
        neutral = {field: value for field, value in UNSUPPORTED.items() if value is not None}
        assert client.post(endpoint, json={**body, **neutral}).status_code == 200
