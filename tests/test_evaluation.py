"""Accuracy evaluation: generated tasks, resumable runs through artifacts, reports."""
import json

import pytest
from click.testing import CliRunner

from snapcompile.cli import main
from snapcompile.errors import SnapcompileError
from snapcompile.evaluation import report
from snapcompile.evaluation.runner import EvalConfig, run_eval
from snapcompile.evaluation.tasks import fidelity_text, make_cases
from snapcompile.models import load_model
from snapcompile.prompts import encode


@pytest.fixture(scope="module")
def tokenizer():
    return load_model("tiny-llama").tokenizer


@pytest.mark.parametrize("task", ["passkey", "multikey"])
def test_cases_are_reproducible_and_fit_their_length(tokenizer, task):
    cases = make_cases(task, tokenizer, [900, 2000], [0.1, 0.9], 2, seed=3, chat=False)
    again = make_cases(task, tokenizer, [900, 2000], [0.1, 0.9], 2, seed=3, chat=False)
    other = make_cases(task, tokenizer, [900, 2000], [0.1, 0.9], 2, seed=4, chat=False)
    assert [c.prompt for c in cases] == [c.prompt for c in again]
    assert [c.answer for c in cases] != [c.answer for c in other]
    for case in cases:
        tokens = len(encode(tokenizer, case.prompt, chat=False))
        assert case.length - 100 < tokens <= case.length     # one filler repeat is 89 byte tokens
        assert case.answer in case.prompt and case.prompt.count(case.answer) >= 1
    assert len(cases) == 2 * 2 * 2


def test_needle_depth_moves_the_needle(tokenizer):
    shallow, deep = make_cases("passkey", tokenizer, [3000], [0.1, 0.9], 1, seed=0, chat=False)
    assert shallow.prompt.index(shallow.answer) < len(shallow.prompt) * 0.3
    assert deep.prompt.index(deep.answer) > len(deep.prompt) * 0.7


def test_too_short_length_is_an_error(tokenizer):
    with pytest.raises(SnapcompileError, match="too short"):
        make_cases("multikey", tokenizer, [300], [0.5], 1, seed=0, chat=False)


def test_fidelity_text_is_long_natural_text():
    text = fidelity_text()
    assert len(text.split()) > 10000 and "Return" in text


def test_summary_and_markdown_by_hand():
    records = [
        {"policy": "dense", "budget": None, "length": 100, "depth": 0.5, "correct": True},
        {"policy": "dense", "budget": None, "length": 100, "depth": 0.5, "correct": True},
        {"policy": "snapstream", "budget": 32, "length": 100, "depth": 0.5, "correct": True},
        {"policy": "snapstream", "budget": 32, "length": 100, "depth": 0.5, "correct": False},
        {"policy": "dense", "budget": None, "length": 200, "depth": 0.5, "correct": False},
    ]
    rows = report.summarize(records, "passkey")
    snap = [r for r in rows if r["policy"] == "snapstream"][0]
    assert snap["accuracy"] == 0.5 and snap["retained_vs_dense"] == 0.5
    assert [r for r in rows if r["length"] == 200][0]["retained_vs_dense"] is None
    table = report.markdown(rows, "passkey")
    assert "| snapstream B=32 | 50% (2) | — |" in table and "| dense | 100% (2) | 0% (1) |" in table


def test_run_is_resumable_and_reproducible(tmp_path):
    config = EvalConfig("tiny-llama", "passkey", ("dense", "snapstream"), (128,), (400,), (0.5,), 2, seed=1)
    out = tmp_path / "r.json"
    first = run_eval(config, out, tmp_path / "cache", log=lambda m: None)
    assert len(first) == 4
    partial = out.with_name("r.json.partial.jsonl")
    assert len(partial.read_text().splitlines()) == 5
    second = run_eval(config, out, tmp_path / "cache", log=lambda m: None)
    assert len(partial.read_text().splitlines()) == 5, "nothing re-run"
    assert sorted(r["id"] for r in first) == sorted(r["id"] for r in second)
    fresh = run_eval(config, tmp_path / "again.json", tmp_path / "cache", log=lambda m: None)
    assert sorted((r["id"], r["text"]) for r in fresh) == sorted((r["id"], r["text"]) for r in first)
    other = EvalConfig("tiny-llama", "passkey", ("dense",), (128,), (400,), (0.5,), 1, seed=1)
    with pytest.raises(SnapcompileError, match="another configuration"):
        run_eval(other, out, tmp_path / "cache", log=lambda m: None)


def test_eval_cli_writes_json_markdown_and_plots(tmp_path):
    out = tmp_path / "fid.json"
    result = CliRunner().invoke(main, ["eval", "tiny-llama", "--task", "fidelity", "--policies", "snapstream",
                                       "--budgets", "128", "--lengths", "300", "--samples", "1",
                                       "--cache-dir", str(tmp_path / "c"), "-o", str(out)])
    assert result.exit_code == 0, result.output
    payload = json.loads(out.read_text())
    dense = [r for r in payload["summary"] if r["policy"] == "dense"][0]
    assert dense["agreement"] == 1.0 and dense["kl"] == pytest.approx(0.0, abs=1e-9)
    snap = [r for r in payload["summary"] if r["policy"] == "snapstream"][0]
    assert 0.0 <= snap["agreement"] <= 1.0 and snap["kl"] >= 0.0
    assert (tmp_path / "fid.md").is_file() and (tmp_path / "fid-budget.png").stat().st_size > 1000


@pytest.mark.parametrize("args, message", [
    (["--task", "passkey", "--lengths", "10"], "--lengths"),
    (["--policies", "dense,h2o"], "unknown policies"),
    (["--depths", "1.5"], "--depths"),
])
def test_eval_bad_input(tmp_path, args, message):
    result = CliRunner().invoke(main, ["eval", "tiny-llama", "-o", str(tmp_path / "x.json"), *args])
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output


def test_results_written_before_a_new_field_still_resume(tmp_path):
    import json as _json
    from dataclasses import asdict

    from snapcompile.evaluation.runner import ResultStore
    config = EvalConfig("tiny-llama", "passkey", ("dense",), (128,), (400,), (0.5,), 1, seed=1)
    old = asdict(config)
    del old["scope"]                                   # as written before --scope existed
    path = tmp_path / "r.json.partial.jsonl"
    path.write_text(_json.dumps(old) + "\n" + _json.dumps({"id": "x", "policy": "dense"}) + "\n")
    assert list(ResultStore(path, config).records) == ["x"]
    layer = EvalConfig("tiny-llama", "passkey", ("dense",), (128,), (400,), (0.5,), 1, seed=1, scope="layer")
    with pytest.raises(SnapcompileError, match="another configuration"):
        ResultStore(path, layer)
