"""The CLI: happy paths on tiny-llama, and one-line errors (exit 2, no traceback) for bad input."""
import json
import shutil
from pathlib import Path

import pytest

from tests.cli_helpers import assert_one_line_error, invoke, rerecord_checksums


def test_convert_inspect_run_validate(tmp_path):
    out = tmp_path / "snap"
    result = invoke("convert", "tiny-llama", "-o", out, "--budget", 64, "--window", 8, "--kernel", 5,
                    "--max-context", 512, "--chunk", 64, "--slots", 2)
    assert result.exit_code == 0, result.output
    info = json.loads(invoke("inspect", out, "--json").output)
    assert info["blocks_rewritten"] == {"decode": 2, "decode_1": 2, "prefill": 2, "prefill_128": 2, "prefill_256": 2,
                                        "prefill_384": 2, "prefill_tail": 2, "select": 2, "select_128": 2,
                                        "select_256": 2, "select_384": 2}
    assert info["kv_bytes_per_slot"] * 8 == info["dense_kv_bytes_per_slot"]
    run = invoke("run", out, "--prompt", "hello " * 60, "--prompt", "hi", "--max-new-tokens", 5, "--json")
    assert run.exit_code == 0, run.output
    payload = json.loads(run.output.strip().splitlines()[-1])
    assert payload["summary"]["requests"] == 2 and len(payload["results"]) == 2
    assert payload["summary"]["kernels"] == "ONNX Runtime MLAS float32 GEMM" and "cores" in payload["summary"]["cpu"]
    assert all(r["output_tokens"] >= 1 for r in payload["results"])
    valid = invoke("validate", out, "--prompt", "abc " * 80, "--prompt", "x", "--steps", 8, "--json")
    assert valid.exit_code == 0, valid.output
    summary = json.loads(valid.output.strip().splitlines()[-1])
    assert summary["greedy_agreement"] == 1.0 and summary["max_abs_logit_diff"] <= 1e-4 and summary["steps"] == 8


def test_run_writes_jsonl(tiny_dense_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "one", "id": "a", "max_new_tokens": 3, "answer": "no such answer"}\n\n'
                       '{"prompt": "two", "stop": ["zz"]}\n')
    out = tmp_path / "out.jsonl"
    result = invoke("run", tiny_dense_dir, "--prompts", prompts, "-o", out, "--max-new-tokens", 4,
                    "--top-logprobs", 2)
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["a", "1"] and rows[0]["output_tokens"] <= 3
    assert rows[0]["correct"] is False and "correct" not in rows[1]
    assert "answers correct 0/2" in result.output
    for row in rows:
        assert len(row["top_logprobs"]) == row["output_tokens"]
        for first, second in row["top_logprobs"]:
            assert first["logprob"] >= second["logprob"] and isinstance(first["token"], str)
    assert_one_line_error(invoke("run", tiny_dense_dir, "--prompt", "hi", "--top-logprobs", -1),
                      "top_logprobs must be an integer >= 0")


def test_missing_model(tmp_path):
    assert_one_line_error(invoke("export", tmp_path / "nope", "-o", tmp_path / "o"), "neither a built-in name")


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    assert_one_line_error(invoke("export", bad, "-o", tmp_path / "o"), "cannot read GGUF file")
    assert not (tmp_path / "o").exists()


def test_a_tail_shorter_than_the_window_is_refused_before_anything_is_written(tmp_path):
    result = invoke("convert", "tiny-llama", "-o", tmp_path / "o", "--budget", 64, "--window", 8, "--kernel", 5,
                    "--max-context", 256, "--chunk", 64, "--tail", 4)
    assert_one_line_error(result, "window 8 is longer than the tail graph's 4 tokens: convert with --tail 8")
    assert not (tmp_path / "o").exists()


def test_unsupported_architecture(tmp_path):
    folder = tmp_path / "gpt2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    (folder / "model.safetensors").write_bytes(b"")
    result = invoke("export", folder, "-o", tmp_path / "o")
    assert_one_line_error(result, "unsupported architecture 'GPT2LMHeadModel'")
    assert "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM" in result.output


def test_pickle_only_folder_is_refused(tmp_path):
    folder = tmp_path / "pt"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    (folder / "pytorch_model.bin").write_bytes(b"")
    assert_one_line_error(invoke("export", folder, "-o", tmp_path / "o"), "no *.safetensors")


def test_existing_output_without_force(tmp_path):
    (tmp_path / "o").mkdir()
    assert_one_line_error(invoke("export", "tiny-llama", "-o", tmp_path / "o"), "already exists")


def test_invalid_policy_flags(tmp_path):
    result = invoke("convert", "tiny-llama", "-o", tmp_path / "o", "--budget", 30, "--window", 32)
    assert_one_line_error(result, "must exceed sinks + window")
    result = invoke("convert", "tiny-llama", "-o", tmp_path / "o", "--kernel", 4)
    assert_one_line_error(result, "odd")
    assert not (tmp_path / "o").exists()


def test_prompt_longer_than_context(tiny_dense_dir):
    result = invoke("validate", tiny_dense_dir, "--prompt", "x" * 600)
    assert_one_line_error(result, "--max-context 512")
    run = invoke("run", tiny_dense_dir, "--prompt", "x" * 600, "--prompt", "ok", "--max-new-tokens", 2, "--json")
    assert run.exit_code == 1
    payload = json.loads(run.output.strip().splitlines()[0])
    assert "does not fit" in payload["results"][0]["error"] and payload["results"][1]["error"] is None


def test_corrupt_onnx_file(artifact):
    (artifact / "ort_decode.onnx").write_bytes(b"\x00garbage")
    assert_one_line_error(invoke("run", artifact, "--prompt", "hi"), "the artifact is truncated or was modified")
    rerecord_checksums(artifact)
    assert_one_line_error(invoke("run", artifact, "--prompt", "hi"), "not a valid ONNX file")


def test_missing_manifest(artifact):
    (artifact / "manifest.json").unlink()
    assert_one_line_error(invoke("inspect", artifact), "not a snapcompile artifact")


def test_graph_from_another_artifact_is_refused(artifact, tiny_snap_dir):
    shutil.copy(tiny_snap_dir / "ort_decode.onnx", artifact / "ort_decode.onnx")
    assert_one_line_error(invoke("run", artifact, "--prompt", "hi"), "the artifact is truncated or was modified")
    rerecord_checksums(artifact)
    assert_one_line_error(invoke("run", artifact, "--prompt", "hi"), "was not produced with this manifest")


def test_no_prompt_source(tiny_dense_dir):
    assert_one_line_error(invoke("run", tiny_dense_dir), "give exactly one of")


def test_bad_prompts_file(tiny_dense_dir, tmp_path):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "ok"}\n{oops\n')
    assert_one_line_error(invoke("run", tiny_dense_dir, "--prompts", bad), "p.jsonl line 2 is not valid JSON")


def test_missing_execution_provider(tiny_dense_dir):
    assert_one_line_error(invoke("run", tiny_dense_dir, "--prompt", "hi", "--provider", "cuda"),
                      "no CUDAExecutionProvider")


def test_bad_field_in_prompts_file(tiny_dense_dir, tmp_path):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "ok", "max_new_tokens": "many"}\n')
    assert_one_line_error(invoke("run", tiny_dense_dir, "--prompts", bad),
                      "p.jsonl line 1: max_new_tokens must be an integer >= 1, got 'many'")
    bad.write_text('{"prompt": "ok", "temperature": -2}\n')
    assert_one_line_error(invoke("run", tiny_dense_dir, "--prompts", bad),
                          "temperature must be a finite number in [0, 2]")
    bad.write_text('{"prompt": "ok", "logit_bias": {"a": 1}}\n')
    assert_one_line_error(invoke("run", tiny_dense_dir, "--prompts", bad), "p.jsonl line 1: logit_bias must be")
    bad.write_text('{"prompt": "ok", "logit_bias": {"100000": 1}}\n')
    assert_one_line_error(invoke("run", tiny_dense_dir, "--prompts", bad), "logit_bias token ids must be in [0, 320)")
    assert_one_line_error(invoke("run", tiny_dense_dir, "--prompt", "ok", "--min-p", 3),
                          "min_p must be a finite number")


def test_run_takes_every_sampling_field(tiny_dense_dir, tmp_path):
    """The prompts file's and the command line's sampling fields reach the engine: the same texts
    as the Python API with the same SamplingParams."""
    from snapcompile import Engine, Request, SamplingParams
    prompts = tmp_path / "p.jsonl"
    fields = [{"logit_bias": {"65": 100}}, {"repetition_penalty": 50.0}, {"presence_penalty": -2.0},
              {"temperature": 1.0, "seed": 3, "min_p": 0.5}, {"frequency_penalty": -2.0, "top_k": 2,
                                                              "temperature": 1.0, "seed": 4}]
    text = "".join(map(chr, range(32, 127)))
    prompts.write_text("".join(json.dumps({"prompt": text, **f}) + "\n" for f in fields))
    result = invoke("run", tiny_dense_dir, "--prompts", prompts, "--max-new-tokens", 12, "--json")
    assert result.exit_code == 0, result.output
    texts = [row["text"] for row in json.loads(result.output)["results"]]
    engine = Engine.from_artifact(tiny_dense_dir, session_cache_bytes=0)
    for field, served in zip(fields, texts):
        bias = tuple((int(k), float(v)) for k, v in field.get("logit_bias", {}).items())
        sampling = SamplingParams(**{k: v for k, v in field.items() if k != "logit_bias"}, logit_bias=bias)
        request = Request(engine.encode(text, chat=False), max_new_tokens=12, sampling=sampling)
        assert engine.generate([request])[0].text == served, field
    result = invoke("run", tiny_dense_dir, "--prompt", text, "--max-new-tokens", 12, "--repetition-penalty", 50,
                    "--json")
    assert json.loads(result.output)["results"][0]["text"] == texts[1]


def test_validate_fits_its_built_in_prompts_to_a_small_artifact(tiny_dense_dir):
    """The demo's pass-key prompt (~1000 tokens) is longer than this 512-token artifact allows."""
    result = invoke("validate", tiny_dense_dir, "--steps", 4, "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output.strip().splitlines()[-1])
    assert summary["passed"] and max(summary["prompt_tokens"]) <= 512 - 4 - 1


@pytest.mark.parametrize("folder", ["tiny_dense_dir", "tiny_snap_dir", "tiny_summary_dir"])
def test_validate_turns_compares_resumed_turns(request, folder):
    folder = request.getfixturevalue(folder)
    result = invoke("validate", folder, "--prompt", "abc " * 60, "--steps", 20, "--turns", 3, "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output.strip().splitlines()[-1])
    assert summary["passed"] and summary["max_abs_logit_diff"] <= 1e-4
    assert list(summary["per_turn_max_abs_logit_diff"]) == ["1", "2", "3"]
    first, second, third = summary["resumed_tokens"]
    assert first == 0 and second > summary["prompt_tokens"][0] and third > second
    too_long = invoke("validate", folder, "--prompt", "abc " * 200, "--steps", 100, "--turns", 5)
    assert_one_line_error(too_long, "leaves no room for 5 turn(s)")


def test_run_takes_conversations_whose_turns_resume_the_kept_cache(tiny_snap_dir, tmp_path):
    from snapcompile import Engine, Request
    turns = ["the lazy dog " * 12, " and the quick brown fox " * 4, " then it rained " * 4]
    prompts = tmp_path / "conversations.jsonl"
    prompts.write_text(json.dumps({"id": "c", "turns": turns, "max_new_tokens": 6}) + "\n"
                       + json.dumps({"id": "solo", "prompt": "x y z", "max_new_tokens": 3}) + "\n")
    result = invoke("run", tiny_snap_dir, "--prompts", prompts, "--raw", "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.output.strip().splitlines()[-1])
    rows = out["results"]
    assert [(r["id"], r["turn"]) for r in rows] == [("c/1", 1), ("c/2", 2), ("c/3", 3), ("solo", 1)]
    engine, text = Engine.from_artifact(tiny_snap_dir, session_cache_bytes=2**26), ""
    for turn, row in zip(turns, rows):                  # each turn: the text so far, resumed from the one before
        text += turn
        expected, = engine.generate([Request(engine.encode(text, chat=False), max_new_tokens=6)])
        assert (row["text"], row["cached_tokens"]) == (expected.text, expected.cached_tokens)
        text += expected.text
    assert rows[0]["cached_tokens"] == 0 and rows[1]["cached_tokens"] >= 64 and rows[2]["cached_tokens"] > 64
    assert out["summary"]["cached_tokens"] == sum(r["cached_tokens"] for r in rows)
    off = json.loads(invoke("run", tiny_snap_dir, "--prompts", prompts, "--raw", "--json",
                            "--session-cache-bytes", "0").output.strip().splitlines()[-1])
    assert [r["cached_tokens"] for r in off["results"]] == [0, 0, 0, 0]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"turns": []}) + "\n")
    assert_one_line_error(invoke("run", tiny_snap_dir, "--prompts", bad), '"turns" must be a list of 1..64 strings')


def test_the_shipped_example_prompts_file_runs(tiny_snap_dir, tmp_path):
    """examples/prompts.jsonl, which the README's quick start uses: prompts with their own sampling
    and stop strings, and a two-turn conversation whose second turn resumes the first's kept cache."""
    examples = Path(__file__).resolve().parents[1] / "examples"
    result = invoke("run", tiny_snap_dir, "--prompts", examples / "prompts.jsonl",
                    "-o", tmp_path / "results.jsonl", "--json")
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [row["id"] for row in rows] == ["colours", "capital", "story", "trip/1", "trip/2"]
    assert rows[3]["cached_tokens"] == 0 and rows[4]["cached_tokens"] >= rows[3]["prompt_tokens"] - 32


def test_a_stopped_run_says_where_its_results_are_and_the_same_command_resumes(artifact, tmp_path):
    """SIGTERM mid-run: the error line names OUTPUT.partial and how to go on; the same command runs
    only the prompts it lacks, and the results file equals an uninterrupted run's (greedy)."""
    import signal
    import subprocess
    import sys
    import time
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"hello {i}"}) + "\n" for i in range(60)))
    out = tmp_path / "out.jsonl"
    args = ["run", str(artifact), "--prompts", str(prompts), "--max-new-tokens", "400", "--ignore-eos",
            "--slots", "1", "-o", str(out)]
    process = subprocess.Popen([sys.executable, "-m", "snapcompile.cli", *args], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    partial = tmp_path / "out.jsonl.partial"
    deadline = time.monotonic() + 120
    while not (partial.exists() and partial.read_text().count("\n") >= 4):
        assert time.monotonic() < deadline and process.poll() is None, "no result was written"
        time.sleep(0.1)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("error: interrupted; the ") and str(partial) in last and "same command again" in last
    finished = partial.read_text().count("\n") - 1
    assert 0 < finished < 60
    resumed = invoke(*args)
    assert resumed.exit_code == 0, resumed.output
    assert f"resuming: {finished} of 60 prompts finished" in resumed.output and not partial.exists()
    whole = invoke(*args[:-1], str(tmp_path / "whole.jsonl"))
    assert whole.exit_code == 0
    texts = [(r["id"], r["text"]) for r in map(json.loads, out.read_text().splitlines())]
    assert texts == [(r["id"], r["text"]) for r in map(json.loads, (tmp_path / "whole.jsonl").read_text().splitlines())]


def test_a_partial_file_keeps_whole_conversations_and_refuses_another_run(tmp_path):
    from snapcompile.cli.run_partial import open_partial
    from snapcompile.errors import SnapcompileError
    out, identity = tmp_path / "out.jsonl", json.dumps({"snapcompile run": "x"})
    turn_ids = [["a"], ["b/1", "b/2"], ["c/1", "c/2"], ["d"]]
    rows = [{"id": "a", "error": None}, {"id": "b/1", "error": None}, {"id": "c/1", "error": "boom"},
            {"id": "b/2", "error": None}]
    lines = [identity, *(json.dumps(r) for r in rows), '{"id": "d", "err']      # the last line cut mid-write
    (tmp_path / "out.jsonl.partial").write_text("\n".join(lines))
    resumed = open_partial(out, identity, turn_ids, force=False)
    assert [[r["id"] for r in kept] for kept in resumed.rows] == [["a"], ["b/1", "b/2"], ["c/1"], []]
    resumed.lines.append(json.dumps({"id": "d", "error": None}))
    resumed.lines.close()
    assert (tmp_path / "out.jsonl.partial").read_text().splitlines()[0] == identity
    with pytest.raises(SnapcompileError, match="holds results of another run"):
        open_partial(out, json.dumps({"snapcompile run": "y"}), turn_ids, force=False)
    assert open_partial(out, json.dumps({"snapcompile run": "y"}), turn_ids, force=True).finished == 0


@pytest.mark.parametrize("config, message", [
    ({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3"},
     "snapcompile converts text models, not Gemma 3's multimodal checkpoints"),
    ({"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "final_logit_softcapping": 30.0,
      "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
      "intermediate_size": 128, "vocab_size": 320}, "final_logit_softcapping is set (30.0)"),
], ids=["multimodal", "softcapping"])
def test_gemma_checkpoints_the_graphs_do_not_compute_are_refused(tmp_path, config, message):
    folder = tmp_path / "gemma"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(b"")
    result = invoke("export", folder, "-o", tmp_path / "o")
    assert_one_line_error(result, message)
