"""Accuracy evaluation: generated tasks, resumable runs through artifacts, reports."""
import json
from dataclasses import replace

import pytest
from click.testing import CliRunner

from snapcompile.cli import main
from snapcompile.config import ExportConfig
from snapcompile.errors import SnapcompileError
from snapcompile.evaluation import report
from snapcompile.evaluation.config import EvalConfig
from snapcompile.evaluation.runner import run_eval
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
        needles = {"passkey": 2, "multikey": 1}[task]       # the pass-key needle states its key twice
        assert case.prompt.count(case.answer) == needles, "the answer is in the prompt, once per mention"
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
    def rec(policy, budget, length, sample, correct):
        return {"policy": policy, "budget": budget, "length": length, "depth": 0.5, "sample": sample,
                "correct": correct}
    records = [
        rec("dense", None, 100, 0, True), rec("dense", None, 100, 1, True), rec("dense", None, 100, 2, False),
        rec("snapstream", 32, 100, 0, True), rec("snapstream", 32, 100, 1, False), rec("snapstream", 32, 100, 2, True),
        rec("dense", None, 200, 0, False),
        rec("snapstream", 50, 200, 0, True),
    ]
    rows = report.summarize(records, "passkey", ratios=(4,))
    snap = [r for r in rows if r["policy"] == "snapstream" and r["length"] == 100][0]
    assert snap["accuracy"] == pytest.approx(2 / 3) and snap["retained_vs_dense"] == pytest.approx(1.0)
    assert snap["kept_of_dense_correct"] == 0.5, "paired: sample 1 was right under dense, wrong here"
    assert snap["ratio"] is None
    at_quarter = [r for r in rows if r["length"] == 200 and r["policy"] == "snapstream"][0]
    assert at_quarter["ratio"] == 4
    assert at_quarter["retained_vs_dense"] is None and at_quarter["kept_of_dense_correct"] is None
    table = report.markdown(rows, "passkey")
    assert "| snapstream B=32 | 67% (3) | — |" in table and "| dense | 67% (3) | 0% (1) |" in table
    assert "| snapstream B=L/4 | — | 100% (1), B=50 |" in table
    assert "| snapstream B=32 | 100% / 50% | — |" in table and "Dense-sure" not in table, "no margins recorded"


def test_ratios_give_one_budget_per_length():
    config = EvalConfig("tiny-llama", "passkey", ("dense", "snapstream"), (300,), (1000, 2000), (0.5,), 1,
                        seed=0, ratios=(4,))
    assert config.budgets_for(1000) == [250, 300] and config.budgets_for(2000) == [300, 500]
    assert config.runs() == [("dense", None), ("snapstream", 250), ("snapstream", 300), ("snapstream", 500)]
    case_1000, case_2000 = make_cases("passkey", load_model("tiny-llama").tokenizer, [1000, 2000], [0.5], 1, 0,
                                      chat=False)
    assert config.applies("snapstream", 250, case_1000) and not config.applies("snapstream", 250, case_2000)
    assert config.applies("snapstream", 500, case_2000) and not config.applies("snapstream", 500, case_1000)
    with pytest.raises(SnapcompileError, match="--ratios"):
        EvalConfig("tiny-llama", "passkey", ("snapstream",), (), (1000,), (0.5,), 1, seed=0, ratios=(1,))
    with pytest.raises(SnapcompileError, match="--budgets or --ratios"):
        EvalConfig("tiny-llama", "passkey", ("snapstream",), (), (1000,), (0.5,), 1, seed=0)


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
    for record in first:
        margin = record["answer_margin"]
        assert (margin is None) != record["correct"] and (margin is None or 0.0 <= margin <= 1.0)
    more = EvalConfig("tiny-llama", "passkey", ("dense",), (128,), (400,), (0.5,), 3, seed=1)
    extended = run_eval(more, out, tmp_path / "cache", log=lambda m: None)
    assert len(partial.read_text().splitlines()) == 6, "a wider grid runs only its new cases"
    assert sorted(r["id"] for r in extended) == [f"dense@-/passkey/L400/d0.50/s{s}" for s in range(3)]
    other = EvalConfig("tiny-llama", "passkey", ("dense",), (128,), (400,), (0.5,), 1, seed=2)
    with pytest.raises(SnapcompileError, match="another model, task, seed"):
        run_eval(other, out, tmp_path / "cache", log=lambda m: None)


def test_eval_cli_writes_json_markdown_and_plots(tmp_path):
    out = tmp_path / "fid.json"
    result = CliRunner().invoke(main, ["eval", "tiny-llama", "--task", "fidelity", "--policies", "snapstream",
                                       "--ratios", "3", "--lengths", "300", "--samples", "1",
                                       "--cache-dir", str(tmp_path / "c"), "-o", str(out)])
    assert result.exit_code == 0, result.output
    payload = json.loads(out.read_text())
    dense = [r for r in payload["summary"] if r["policy"] == "dense"][0]
    assert dense["agreement"] == 1.0 and dense["kl"] == pytest.approx(0.0, abs=1e-9)
    snap = [r for r in payload["summary"] if r["policy"] == "snapstream"][0]
    assert 0.0 <= snap["agreement"] <= 1.0 and snap["kl"] >= 0.0
    assert (snap["budget"], snap["ratio"]) == (100, 3), "--ratios alone: budget = length // ratio"
    assert (tmp_path / "fid.md").read_text().startswith("fidelity on tiny-llama: fp32 weights, seed 0,")
    assert (tmp_path / "fid-budget.png").stat().st_size > 1000
    assert (tmp_path / "fid-length.png").stat().st_size > 1000, "--ratios rows get an accuracy-vs-length plot"
    assert not (tmp_path / "fid.json.partial.jsonl").exists(), "a finished run leaves only its results"
    from snapcompile.evaluation.config import EvalConfig
    from snapcompile.evaluation.partial_results import ResultStore
    wider = EvalConfig("tiny-llama", "fidelity", ("snapstream",), (), (300,), (0.1, 0.5, 0.9), 2, seed=0, ratios=(3,))
    reused = ResultStore(out, wider).records
    assert sorted(reused) == sorted(r["id"] for r in payload["records"]), "a wider run starts from OUTPUT's cases"


def test_long_generation_fidelity_measures_past_the_wrap(tmp_path):
    """--generate past the budget: agreement after the first B tokens, the first divergence of each
    policy's own greedy continuation (never before its teacher-forced agreement allows), recall."""
    out = tmp_path / "long.json"
    args = ["eval", "tiny-llama", "--task", "fidelity", "--policies", "snapstream,streamingllm", "--budgets", "64",
            "--lengths", "128", "--samples", "2", "--generate", "160", "--cache-dir", str(tmp_path / "c"),
            "-o", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    payload = json.loads(out.read_text())
    for record in payload["records"]:
        assert record["generated"] == 160 and 0.0 <= record["recall"] <= 1.0
        assert record["first_divergence"] <= round(record["agreement"] * 160), "identical until the first miss"
        if record["policy"] == "dense":
            assert record["first_divergence"] == 160 and record["recall"] == record["dense_recall"]
            assert record["agreement_past_budget"] is None
        else:
            assert 0.0 <= record["agreement_past_budget"] <= 1.0 and record["budget"] == 64
    table = (tmp_path / "long.md").read_text()
    assert "160 generated tokens: agreement past B / first divergence (median) / recall" in table
    snap = [r for r in payload["summary"] if r["policy"] == "snapstream"][0]
    assert snap["generated"] == 160 and snap["first_divergence"] is not None


@pytest.mark.parametrize("args, message", [
    (["--task", "fidelity", "--generate", "20"], "--generate"),
    (["--task", "passkey", "--lengths", "10"], "--lengths"),
    (["--policies", "dense,h2o"], "unknown policies"),
    (["--depths", "1.5"], "--depths"),
    (["--ratios", "1"], "--ratios"),
    (["--ratios", "four"], "comma-separated int"),
    (["--kernel", "4"], "--kernel must be a positive odd number"),
])
def test_eval_bad_input(tmp_path, args, message):
    result = CliRunner().invoke(main, ["eval", "tiny-llama", "-o", str(tmp_path / "x.json"), *args])
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output


def test_results_written_before_a_new_field_still_resume(tmp_path):
    import json as _json
    from dataclasses import asdict

    from snapcompile.evaluation.partial_results import ResultStore
    config = EvalConfig("tiny-llama", "passkey", ("dense",), (128,), (400,), (0.5,), 1, seed=1)
    old = asdict(config)
    del old["scope"], old["kernel"]                    # as written before --scope and --kernel existed
    results = tmp_path / "r.json"
    path = tmp_path / "r.json.partial.jsonl"
    path.write_text(_json.dumps(old) + "\n" + _json.dumps({"id": "x", "policy": "dense"}) + "\n")
    assert list(ResultStore(results, config).records) == ["x"]
    path = results
    layer = EvalConfig("tiny-llama", "passkey", ("dense",), (128,), (400,), (0.5,), 1, seed=1, scope="layer")
    with pytest.raises(SnapcompileError, match="another model"):
        ResultStore(path, layer)
    wider_kernel = EvalConfig("tiny-llama", "passkey", ("dense",), (128,), (400,), (0.5,), 1, seed=1, kernel=31)
    with pytest.raises(SnapcompileError, match="kernel"):
        ResultStore(path, wider_kernel)
    longer = EvalConfig("tiny-llama", "passkey", ("dense",), (128,), (400, 800), (0.5,), 1, seed=1)
    with pytest.raises(SnapcompileError, match="artifact shape"):
        ResultStore(path, longer)


def test_kernel_reaches_snapstream_cells_only():
    from snapcompile.evaluation.config import policy_for
    assert policy_for("snapstream", 256, "layer", 31).kernel == 31
    assert policy_for("streamingllm", 256, "layer", 31).kernel == policy_for("dense", None).kernel == 15
    assert policy_for("snapstream", 256).kernel == 15


def test_answer_margin_reads_the_tokens_that_spell_the_answer():
    import math

    from snapcompile.engine.engine import Result
    from snapcompile.evaluation.metrics import answer_margin

    class Chars:                      # token id i decodes to chr(i)
        def decode(self, ids, skip_special_tokens=True):
            return "".join(map(chr, ids))
    text = "n: 42."
    ids = [ord(c) for c in text]
    gaps = [0.9, 0.9, 0.9, 0.3, 0.2, 0.05]          # p1 - p2 at each token; "4" 0.3, "2" 0.2
    top = [[(i, math.log((1 + g) / 2)), (0, math.log((1 - g) / 2))] for i, g in zip(ids, gaps)]
    result = Result("r", 3, ids, text, "length", None, None, 0.0, top)
    assert answer_margin(Chars(), result, "42") == pytest.approx(0.2)
    assert answer_margin(Chars(), result, "7") is None
    assert answer_margin(Chars(), Result("r", 3, ids, text, "length", None, None, 0.0, []), "42") is None


def test_lost_cases_and_sure_retention_by_hand():
    def rec(policy, budget, sample, correct, margin=None, text=""):
        return {"id": f"{policy}@{budget or '-'}/passkey/L100/d0.50/s{sample}", "policy": policy, "budget": budget,
                "length": 100, "depth": 0.5, "sample": sample, "answer": "123", "correct": correct,
                "answer_margin": margin, "text": text}
    records = [rec("dense", None, 0, True, 0.9, "123"), rec("dense", None, 1, True, 0.03, "123"),
               rec("dense", None, 2, False),
               rec("snapstream", 25, 0, True, 0.8, "123"), rec("snapstream", 25, 1, False, None, "129|x"),
               rec("snapstream", 25, 2, True, 0.5, "123")]
    snap = [r for r in report.summarize(records, "passkey", ratios=(4,)) if r["policy"] == "snapstream"][0]
    assert snap["kept_of_dense_correct"] == 0.5 and (snap["dense_sure"], snap["kept_of_dense_sure"]) == (1, 1.0)
    lost = report.lost_cases(records)
    assert [(c["case"], c["dense_margin"], c["text"]) for c in lost] == [("passkey/L100/d0.50/s1", 0.03, "129|x")]
    table = report.markdown(report.summarize(records, "passkey", ratios=(4,)), "passkey")
    assert "| snapstream B=L/4 | 100% / 50% / 100% (1) |" in table
    assert "| snapstream B=25 | passkey/L100/d0.50/s1 | 123 | 123 (0.03) | 129\\|x |" in report.lost_markdown(lost)
    assert report.lost_markdown([]) == ""


def test_fidelity_text_is_shipped_data_not_this_interpreter_s_docstrings(tmp_path, monkeypatch):
    from snapcompile.evaluation import tasks
    text = tasks.fidelity_text()
    assert len(text) > 100_000 and "argparse" in text
    changed = tmp_path / "fidelity.txt"
    changed.write_text(text + "x", encoding="utf-8")
    monkeypatch.setattr(tasks, "FIDELITY_TEXT", changed)
    with pytest.raises(SnapcompileError, match="was modified"):
        tasks.fidelity_text()


def test_block_size_shapes_the_evaluated_artifacts_not_the_fp32_reference(tmp_path):
    from snapcompile.evaluation.partial_results import ResultStore
    config = EvalConfig("tiny-llama", "fidelity", ("snapstream",), (), (300,), (0.5,), 1, seed=0, ratios=(3,),
                        weight_format="int4", block_size=64)
    assert (config.export.weight_format, config.export.block_size) == ("int4", 64)
    assert config.reference_export == replace(config.export, weight_format="fp32",
                                              block_size=ExportConfig.block_size)
    path = tmp_path / "r.json"
    ResultStore(path, config).add({"id": "x", "policy": "dense"})
    assert list(ResultStore(path, config).records) == ["x"]
    assert report.heading(config).startswith("fidelity on tiny-llama: int4 weights in blocks of 64, seed 0")
    assert "blocks" not in report.heading(replace(config, weight_format="fp16")), "float weights have no blocks"
    with pytest.raises(SnapcompileError, match=r"\(block_size differ\)"):
        ResultStore(path, replace(config, block_size=32))


def test_a_dense_int4_source_of_other_blocks_is_refused(tiny_llama, tmp_path):
    from snapcompile.compiler.cache import ArtifactCache
    from tests.conftest import TINY_EXPORT, build_artifact
    int4 = replace(TINY_EXPORT, weight_format="int4", block_size=32)
    source = build_artifact(tiny_llama, tmp_path / "int4", export=int4)
    cache = ArtifactCache(str(source), tmp_path / "cache", log=lambda _: None)
    with pytest.raises(SnapcompileError, match="holds blocks of 32, not 64"):
        cache.dense(replace(int4, block_size=64))


def test_eval_refuses_a_block_size_the_export_refuses(tmp_path):
    result = CliRunner().invoke(main, ["eval", "tiny-llama", "--weights", "int4", "--block-size", "48",
                                       "-o", str(tmp_path / "x.json")])
    assert result.exit_code == 2 and "--block-size must be a power of two" in result.output
    assert "Traceback" not in result.output
