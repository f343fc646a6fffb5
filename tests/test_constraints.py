"""engine.constraints: structured output as a token mask (llguidance), on the tiny random model."""
import json

import pytest

from snapcompile import Engine, Request, SamplingParams
from snapcompile.engine.constraints import GrammarTokenizer
from snapcompile.errors import SnapcompileError

SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["colour", "ok", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine(tiny_snap_dir):
    return Engine.from_artifact(tiny_snap_dir, session_cache_bytes=0)


@pytest.fixture(scope="module")
def grammars(engine):
    return GrammarTokenizer(engine.tokenizer, engine.backend.manifest.spec.vocab_size)


def test_a_random_model_under_a_schema_answers_valid_json_and_stops(engine, grammars):
    """Whatever the (random) model prefers, every sample is JSON that the schema accepts, reported
    finished ("stop") only when complete."""
    grammar = grammars.json_schema(SCHEMA)
    requests = [Request(engine.encode(f"answer {i}", chat=False), max_new_tokens=64,
                        sampling=SamplingParams(temperature=1.0, seed=i), constraint=grammar.constraint())
                for i in range(6)]
    for result in engine.generate(requests):
        assert result.outcome == "stop", result
        answer = json.loads(result.text)
        assert set(answer) == {"colour", "ok", "n"} and answer["colour"] in ("red", "green", "blue")
        assert isinstance(answer["ok"], bool) and 0 <= answer["n"] <= 9


def test_an_answer_cut_by_max_tokens_is_length_not_stop(engine, grammars):
    result = engine.generate([Request(engine.encode("x", chat=False), max_new_tokens=3,
                                      constraint=grammars.json_schema(SCHEMA).constraint())])[0]
    assert result.outcome == "length" and len(result.output_ids) == 3


@pytest.mark.parametrize("schema, fragment", [
    ({"type": "nonsense"}, "cannot be used"), ({"enum": ["x" * 70_000]}, "characters; at most"),
    ({"$ref": "#"}, "no JSON value satisfies this schema"),
    ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
     "no JSON value satisfies this schema"),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "Unsatisfiable schema")])
def test_a_schema_that_cannot_be_used_is_one_error(grammars, schema, fragment):
    with pytest.raises(SnapcompileError, match=fragment):
        grammars.json_schema(schema)


def test_a_schema_whose_values_never_end_is_never_reported_complete(engine, grammars):
    """An object that must hold itself has no finite value: the answer is cut ("length"), or, where
    the grammar gives up (llguidance's item limit, which the tiny model's byte-sized tokens reach),
    failed; never "stop"."""
    endless = {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}
    result = engine.generate([Request(engine.encode("x", chat=False), max_new_tokens=40,
                                      constraint=grammars.json_schema(endless).constraint())])[0]
    assert result.outcome in ("length", "error"), result
