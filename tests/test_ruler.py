"""eval-ruler: RULER through lm-evaluation-harness against a real `serve` (tiny model with SmolLM2's
tokenizer: RULER sizes its prompts with a real tokenizer), its grid, store and report."""
from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from snapcompile.cli import main
from snapcompile.errors import SnapcompileError
from snapcompile.evaluation import ruler_report
from snapcompile.evaluation.ruler_run import RulerConfig, budget_of, parse_cell
from tests.cli_helpers import rerecord_checksums

TASK_ANSWER_TOKENS = {"niah_single_1": 128, "niah_multikey_2": 128, "niah_multikey_3": 128, "ruler_vt": 30,
                      "ruler_cwe": 120, "ruler_fwe": 50}


def test_cells_and_config_are_checked():
    assert parse_cell("dense") == ("dense", None) and parse_cell("snapstream/8") == ("snapstream", 8)
    assert budget_of("streamingllm/4", 4096) == 1024 and budget_of("dense", 4096) is None
    for cell in ("dense/4", "snapstream", "snapstream/1", "magic/4", "snapstream/x"):
        with pytest.raises(SnapcompileError, match="cell"):
            parse_cell(cell)
    with pytest.raises(SnapcompileError, match="unknown RULER tasks: qa_squad"):
        RulerConfig("m", tasks=("qa_squad",))
    with pytest.raises(SnapcompileError, match="--lengths"):
        RulerConfig("m", lengths=(256,))
    with pytest.raises(SnapcompileError, match="ruler_vt needs --lengths >= 1024"):
        RulerConfig("m", lengths=(512, 4096))
    assert RulerConfig("m", tasks=("niah_single_1",), lengths=(512,)).lengths == (512,)
    with pytest.raises(SnapcompileError, match="--weights"):
        RulerConfig("m", weights=("fp8",))
    with pytest.raises(SnapcompileError, match="--kernel must be a positive odd number"):
        RulerConfig("m", kernel=30)
    units = RulerConfig("m", cells=("snapstream/4", "dense"), lengths=(1024, 2048), weights=("fp32", "int4")).units()
    assert units[:2] == [("fp32", "dense", 1024), ("fp32", "dense", 2048)] and len(units) == 8
    assert RulerConfig("m", lengths=(1024, 4096)).export("int4").max_context == 4096 + 64
    assert RulerConfig("m", kv_dtype="float16").export("fp32").kv_dtype == "float16"
    assert RulerConfig("m", kv_dtype="int8").export("fp32").kv_dtype == "int8"
    with pytest.raises(SnapcompileError, match="--kv-dtype"):
        RulerConfig("m", kv_dtype="int4")


def _unit(cell, scores, predictions=None, weights="fp32", length=1024):
    policy, ratio = parse_cell(cell)
    samples = [{"task": task, "doc_id": doc, "score": score, "prediction": (predictions or {}).get((task, doc), "p"),
                "target": ["t"], "input_sha": f"{task}{doc}"} for (task, doc), score in scores.items()]
    return {"id": f"{weights}|{cell}|{length}", "weights": weights, "cell": cell, "policy": policy, "ratio": ratio,
            "budget": budget_of(cell, length), "length": length, "samples": samples}


def test_report_retention_kept_solved_and_lost_samples():
    dense = _unit("dense", {("a", 0): 1.0, ("a", 1): 1.0, ("b", 0): 0.5, ("b", 1): 0.0})
    snap = _unit("snapstream/4", {("a", 0): 1.0, ("a", 1): 0.0, ("b", 0): 0.5, ("b", 1): 1.0},
                 {("a", 1): "wrong"})
    rows = {(r["task"], r["cell"]): r for r in ruler_report.summarize([dense, snap])}
    assert rows[("a", "snapstream/4")]["score"] == 0.5 and rows[("a", "snapstream/4")]["retention"] == 0.5
    assert rows[("a", "snapstream/4")]["kept_solved"] == 0.5
    assert rows[("b", "snapstream/4")]["retention"] == 3.0 and rows[("b", "snapstream/4")]["kept_solved"] is None
    assert rows[("mean", "snapstream/4")]["score"] == 0.625 and rows[("mean", "dense")]["score"] == 0.625
    assert rows[("mean", "snapstream/4")]["kept_solved"] == 0.5 and rows[("mean", "dense")]["n"] == 4
    lost = ruler_report.lost_samples([dense, snap])
    assert [(x["task"], x["doc_id"], x["prediction"]) for x in lost] == [("a", 1, "wrong")]
    table = ruler_report.markdown(list(rows.values()), ("dense", "snapstream/4"))
    assert "| fp32 | 1024 | a | 1.00 | 0.50 (50%; 50%) |" in table
    assert "wrong" in ruler_report.lost_markdown(lost)


def test_unit_store_resumes_a_killed_run_and_refuses_another_configuration(tmp_path):
    from snapcompile.evaluation.ruler_run import UnitStore
    out, config = tmp_path / "ruler.json", RulerConfig("m", lengths=(1024,))
    store = UnitStore(out, config)
    store.add(_unit("dense", {("a", 0): 1.0}))
    store.add(_unit("snapstream/4", {("a", 0): 0.0}))
    partial = tmp_path / "ruler.json.partial.jsonl"
    partial.write_text(partial.read_text() + '{"id": "fp32|snapstream/8|10')       # the line a kill cut short
    assert sorted(UnitStore(out, config).units) == ["fp32|dense|1024", "fp32|snapstream/4|1024"]
    assert partial.read_text().endswith("}\n"), "the cut line is dropped"
    with pytest.raises(SnapcompileError, match="another RULER configuration"):
        UnitStore(out, RulerConfig("m", lengths=(2048,)))
    with pytest.raises(SnapcompileError, match="another RULER configuration"):      # a float16 cache's are apart
        UnitStore(out, RulerConfig("m", lengths=(1024,), kv_dtype="float16"))


def test_an_lm_eval_failure_is_one_error_line_naming_the_logs(tmp_path):
    from snapcompile.evaluation import ruler_run
    from snapcompile.serve.process import free_port

    class Gone:
        url, log_path = f"http://127.0.0.1:{free_port()}", tmp_path / "serve.log"

    class NoTasks:
        tokenizer, log = tmp_path, tmp_path / "lm-eval.log"

        def at(self, length):
            return []
    with pytest.raises(SnapcompileError, match=r"lm-eval failed at 1024 tokens on art: .*lm-eval.log"):
        ruler_run._run_unit(RulerConfig("m", lengths=(1024,)), Gone(), NoTasks(), "art", "fp32", 1024, tmp_path)


def test_offline_nltk_satisfies_the_lookup_and_a_sentence_split_fails_loudly(tmp_path):
    import nltk

    from snapcompile.evaluation.ruler import offline_nltk
    root = offline_nltk(tmp_path)
    try:
        assert nltk.data.find("tokenizers/punkt_tab").startswith(str(root))
        with pytest.raises(LookupError):
            nltk.sent_tokenize("One sentence. Another one.")
    finally:
        nltk.data.path.remove(str(root))


def test_tokenizer_folder_holds_the_tokenizer_only_and_refuses_remote_code(artifact, tmp_path):
    """lm-eval loads tokenizers with trust_remote_code on: the folder it gets has no Python file and
    no config asking for one."""
    from snapcompile.evaluation.ruler import tokenizer_folder
    (artifact / "evil.py").write_text("raise SystemExit('ran')\n")
    folder = tokenizer_folder(artifact, tmp_path)
    assert sorted(p.name for p in folder.iterdir()) == sorted(_support_files(artifact))
    config = artifact / "tokenizer_config.json"
    raw = json.loads(config.read_text())
    raw["auto_map"] = {"AutoTokenizer": ["evil.Tokenizer", None]}
    config.write_text(json.dumps(raw))
    with pytest.raises(SnapcompileError, match="tokenizer_config.json"):      # its size no longer matches
        tokenizer_folder(artifact, tmp_path)
    rerecord_checksums(artifact)
    with pytest.raises(SnapcompileError, match="never executes code"):
        tokenizer_folder(artifact, tmp_path)


def _support_files(artifact):
    from snapcompile.artifact.manifest import read_manifest
    return read_manifest(artifact).support_files()


def test_eval_ruler_errors_are_one_line(tmp_path):
    for args, fragment in ((["--cells", "dense,snapstream"], "cell 'snapstream'"),
                           (["--tasks", "qa_hotpot"], "unknown RULER tasks: qa_hotpot"),
                           (["--lengths", "100"], "--lengths must be"),
                           (["--lengths", "512"], "ruler_vt needs --lengths >= 1024")):
        result = CliRunner().invoke(main, ["eval-ruler", "tiny-llama", *args, "-o", str(tmp_path / "r.json")])
        assert result.exit_code != 0 and fragment in result.output and "Traceback" not in result.output


def test_a_data_generator_that_never_ends_stops_the_process_in_one_line(tmp_path):
    """lm-eval's RULER generators retry in `while True` under a bare `except:` (printing a line per
    try): the deadline stops the process with one error line naming the last line printed, on the
    terminal although eval-ruler sends lm-eval's output to lm-eval.log (which keeps it too), and the
    printed lines are kept bounded."""
    import subprocess
    import sys
    log = tmp_path / "lm-eval.log"
    script = ("import contextlib, sys, time\n"
              "from snapcompile.evaluation.ruler import _LastLines, _finished_within\n"
              "from snapcompile.evaluation.ruler_run import lm_eval_output\n"
              "printed = _LastLines(keep=3)\n"
              "with lm_eval_output(sys.argv[1]), contextlib.redirect_stdout(printed), \\\n"
              "        _finished_within(1.0, printed, 'the spinning data'):\n"
              "    while True:\n"
              "        try:\n"
              "            print('reduces chain length for not enough noises')\n"
              "            time.sleep(0.001)\n"
              "            raise AssertionError\n"
              "        except:  # noqa: E722\n"
              "            pass\n")
    result = subprocess.run([sys.executable, "-c", script, str(log)], capture_output=True, text=True, timeout=60)
    line = ("error: the spinning data did not finish within 1 s (its last line: 'reduces chain length for not enough "
            "noises'); stopped")
    assert result.returncode == 2 and result.stdout == "", result.stderr
    assert result.stderr.strip().splitlines() == [line]
    assert log.read_text().strip().splitlines()[-1] == line


@pytest.fixture(scope="module")
def tiny_smol_tokenizer_model(tmp_path_factory):
    """A tiny random Llama with SmolLM2's tokenizer (and vocabulary), as a Hugging Face folder."""
    import torch
    from safetensors.torch import save_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from snapcompile.models.loader import _smollm2_folder
    source = _smollm2_folder()
    folder = tmp_path_factory.mktemp("tinysmol") / "model"
    folder.mkdir()
    smol = json.loads((source / "config.json").read_text())
    fields = {k: v for k, v in smol.items() if not k.startswith(("_", "transformers"))}
    fields.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16)
    config = AutoConfig.for_model(**fields)
    torch.manual_seed(0)
    save_model(AutoModelForCausalLM.from_config(config), str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({**config.to_dict(), "architectures": ["LlamaForCausalLM"]}))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copyfile(source / name, folder / name)
    return folder


@pytest.mark.slow
def test_eval_ruler_runs_lm_eval_against_serve_and_resumes(tiny_smol_tokenizer_model, tmp_path):
    """Every task's samples through lm-eval and a real server, the same prompts for every cell, the
    answers those of the artifact itself; a second run reuses the results file."""
    out, cache = tmp_path / "ruler.json", tmp_path / "cache"
    args = ["eval-ruler", str(tiny_smol_tokenizer_model), "--lengths", "1024", "--cells", "dense,snapstream/4",
            "--limit", "2", "--slots", "2", "--cache-dir", str(cache), "-o", str(out), "--json"]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    payload = json.loads(out.read_text())
    dense, snap = payload["units"]
    assert (dense["cell"], snap["cell"], snap["budget"]) == ("dense", "snapstream/4", 256)
    for unit in (dense, snap):
        assert sorted((s["task"], s["doc_id"]) for s in unit["samples"]) == sorted(
            (task, doc) for task in TASK_ANSWER_TOKENS for doc in (0, 1))
        assert all(0.0 <= s["score"] <= 1.0 for s in unit["samples"])
    assert [s["input_sha"] for s in dense["samples"]] == [s["input_sha"] for s in snap["samples"]]
    assert all(item["margin"]["replayed"] for item in payload["lost"]), "every lost sample's dense margin measured"
    _check_the_samples_are_drawn_again(cache, dense)
    assert (out.with_suffix(".md")).is_file() and (tmp_path / "ruler-fp32.png").is_file()
    assert not (tmp_path / "ruler.json.partial.jsonl").exists()
    _check_answers_are_the_artifacts(cache)

    assert json.loads(result.stdout)["summary"] == payload["summary"], "--json: stdout is one JSON line"
    assert "Requesting API" in (cache / "ruler-work" / "lm-eval.log").read_text()
    again = CliRunner().invoke(main, args, catch_exceptions=False)
    assert again.exit_code == 0 and json.loads(out.read_text())["units"] == payload["units"]
    assert json.loads(again.stdout)["seconds_this_run"] < 5
    other = CliRunner().invoke(main, [*args, "--limit", "3"])
    assert other.exit_code != 0 and "holds RULER results of another configuration" in other.output


def _check_the_samples_are_drawn_again(cache, unit):
    """A task built alone, in a random state the run has moved on, gets the samples it got in the run."""
    import hashlib
    import random

    from snapcompile.evaluation.ruler import build_tasks
    random.seed()
    task, = build_tasks(("ruler_vt",), cache / "ruler-work" / "tokenizer", 1024)
    again = [hashlib.sha256((d["input"] + d.get("gen_prefix", "")).encode()).hexdigest()[:16]
             for d in list(task.eval_docs)[:2]]
    ran = sorted((s["doc_id"], s["input_sha"]) for s in unit["samples"] if s["task"] == "ruler_vt")
    assert again == [sha for _, sha in ran]


def _check_answers_are_the_artifacts(cache):
    """Each answer lm-eval recorded is the artifact's own greedy continuation of the prompt lm-eval sent."""
    from snapcompile import Engine, Request
    from snapcompile.prompts import encode_text
    for log in sorted((cache / "ruler-work" / "samples").glob("*/*.jsonl")):
        folder = cache / log.stem.rsplit("-", 1)[0]
        engine = Engine.from_artifact(folder, session_cache_bytes=0)
        entries = [json.loads(line) for line in log.read_text().splitlines()]
        firsts = {entry["task"]: entry for entry in entries if entry["doc_id"] == 0}
        assert set(firsts) == set(TASK_ANSWER_TOKENS)
        assert all(entry["gen_kwargs"]["max_gen_toks"] == TASK_ANSWER_TOKENS[task] for task, entry in firsts.items())
        requests = [Request(encode_text(engine.tokenizer, entry["context"]), max_new_tokens=TASK_ANSWER_TOKENS[task])
                    for task, entry in sorted(firsts.items())]
        for (task, entry), result in zip(sorted(firsts.items()), engine.generate(requests)):
            assert entry["answer"] == result.text, (log.name, task)


def test_parting_char_and_the_step_that_writes_it(tiny_dense_dir):
    from snapcompile import Engine
    from snapcompile.evaluation.ruler_margin import parting_char, step_at
    assert parting_char("12345", "12945") == 2 and parting_char("123", "12345") == 3 and parting_char("", "x") == 0
    tokenizer = Engine.from_artifact(tiny_dense_dir, session_cache_bytes=0).tokenizer
    ids = tokenizer.encode("hello world again", add_special_tokens=False)
    text = tokenizer.decode(ids)
    for char in (0, 5, len(text) - 1):
        step = step_at(tokenizer, ids, char)
        assert len(tokenizer.decode(ids[:step + 1])) > char >= len(tokenizer.decode(ids[:step]))
    assert step_at(tokenizer, ids, len(text)) is None


def _greedy(engine, context, tokens):
    from snapcompile import Request
    from snapcompile.prompts import encode_text
    return engine.generate([Request(encode_text(engine.tokenizer, context), max_new_tokens=tokens, top_logprobs=2)])[0]


def test_dense_margin_is_read_where_the_lost_answer_parts_from_dense(tiny_dense_dir):
    """The margin is dense's p1 - p2 at the step that writes the first character the cell got
    otherwise; a recorded dense answer the artifact does not write gets no margin."""
    import math

    from snapcompile import Engine
    from snapcompile.evaluation.ruler_margin import margin_id, measure, step_at
    engine = Engine.from_artifact(tiny_dense_dir, session_cache_bytes=0)
    context = "alpha beta gamma delta " * 6
    reference = _greedy(engine, context, 12)
    char = len(engine.tokenizer.decode(reference.output_ids[:3], skip_special_tokens=True))
    assert 0 < char < len(reference.text)
    entry = {"task": "t", "context": context, "gen_kwargs": {"max_gen_toks": 12}, "input_sha": "h"}
    dense_log = {("t", 0): {**entry, "doc_id": 0, "answer": reference.text},
                 ("t", 1): {**entry, "doc_id": 1, "answer": "not what dense writes"},
                 ("t", 2): {**entry, "doc_id": 2, "answer": reference.text, "input_sha": "another run's prompt"}}
    cell_log = {("t", 0): {"answer": reference.text[:char] + "\u2603", "input_sha": "h"},
                ("t", 1): {"answer": "not what I wrote", "input_sha": "h"},
                ("t", 2): {"answer": "x", "input_sha": "h"}}
    lost = [{"weights": "fp32", "cell": "snapstream/4", "length": 1024, "task": "t", "doc_id": d, "input_sha": "h"}
            for d in (0, 1, 2)]
    margins = measure(engine, dense_log, lost, {"snapstream/4": cell_log})
    first = margins[margin_id(lost[0])]
    step = step_at(engine.tokenizer, reference.output_ids, char)
    (_, lp1), (_, lp2) = reference.top_logprobs[step][:2]
    assert first["parting_step"] == step == 3 and first["replayed"]
    assert abs(first["dense_margin"] - (math.exp(lp1) - math.exp(lp2))) < 1e-6
    assert len(first["dense_choices"]) == 2
    other = margins[margin_id(lost[1])]
    assert other["dense_margin"] is None and other["replayed"] is False
    assert margin_id(lost[2]) not in margins, "a log entry of another prompt is not replayed"


def test_dense_margin_at_an_eos_that_ended_dense_first():
    """Dense stopped (EOS) where the cell wrote on: the margin is read at the EOS step."""
    import math

    from snapcompile.engine.engine import Result
    from snapcompile.evaluation.ruler_margin import margin_at

    class Letters:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(i) for i in ids if not (skip_special_tokens and i == 0))
    ids, top = [ord("4"), ord("2"), 0], [[(52, -0.1), (53, -3.0)], [(50, -0.2), (51, -2.0)], [(0, -0.9), (49, -1.0)]]
    result = Result("r", 5, ids, "42", "eos", None, 0.1, 0.2, top)
    margin = margin_at(Letters(), result, "42", 2)
    assert margin["parting_step"] == 2 and abs(margin["dense_margin"] - (math.exp(-0.9) - math.exp(-1.0))) < 1e-9
    assert margin["dense_choices"] == ["", "1"]


def test_margins_resume_from_the_partial_file_and_the_results_file(tmp_path):
    from snapcompile.evaluation.ruler_run import UnitStore
    out, config = tmp_path / "ruler.json", RulerConfig("m", lengths=(1024,))
    dense = _unit("dense", {("a", 0): 1.0})
    snap = _unit("snapstream/4", {("a", 0): 0.0}, {("a", 0): "wrong"})
    store = UnitStore(out, config)
    store.add(dense)
    store.add(snap)
    margin = {"dense_margin": 0.04, "parting_step": 2, "replayed": True, "dense_choices": ["7", "9"]}
    store.add_margin("margin|fp32|snapstream/4|1024|a|0", margin)
    again = UnitStore(out, config)
    assert sorted(again.units) == ["fp32|dense|1024", "fp32|snapstream/4|1024"] and len(again.margins) == 1
    lost = ruler_report.lost_samples([dense, snap], again.margins)
    assert lost[0]["margin"] == margin
    assert "| 0.04 (step 2: '7' / '9') |" in ruler_report.lost_markdown(lost)
    (tmp_path / "ruler.json.partial.jsonl").unlink()
    out.write_text(json.dumps({"config": json.loads(store.config_json), "units": [dense, snap], "lost": lost}))
    assert UnitStore(out, config).margins == again.margins
    assert "| ? |" in ruler_report.lost_markdown(ruler_report.lost_samples([dense, snap]))
