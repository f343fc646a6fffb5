"""Untrusted inputs and faults: no code from a model folder runs, no output is lost, no artifact
runs wrong, and every user mistake is one `error:` line with exit code 2."""
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from snapcompile.artifact.atomic import atomic_directory
from snapcompile.artifact.manifest import MANIFEST, WEIGHTS
from snapcompile.cli import main
from snapcompile.errors import SnapcompileError
from tests.conftest import FAULT_SEED
from tests.test_cli import rerecord_checksums

REPO = Path(__file__).resolve().parents[1]


def invoke(*args, input=None):
    return CliRunner().invoke(main, [str(a) for a in args], input=input, catch_exceptions=False)


def assert_one_line_error(result, fragment=""):
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and fragment in errors[0], lines
    assert "Traceback" not in result.output and "Usage:" not in result.output, result.output


class Marker:
    """Unpickling this touches a file: proof that a pickle was (or was not) loaded."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


@pytest.fixture
def hf_copy(tiny_hf_dir, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_hf_dir, folder)
    return folder


@pytest.fixture
def artifact(tiny_dense_dir, tmp_path):
    copy = tmp_path / "artifact"
    shutil.copytree(tiny_dense_dir, copy)
    return copy


@pytest.fixture
def snap_artifact(tiny_snap_dir, tmp_path):
    copy = tmp_path / "snap"
    shutil.copytree(tiny_snap_dir, copy)
    return copy


def edit_manifest(folder, change):
    raw = json.loads((folder / MANIFEST).read_text())
    change(raw)
    (folder / MANIFEST).write_text(json.dumps(raw))


# ---------------------------------------------------------------- code execution
def test_weights_load_from_safetensors_whatever_the_index_says(hf_copy, tmp_path):
    marker = tmp_path / "pickle-ran"
    with open(hf_copy / "pytorch_model.bin", "wb") as handle:
        pickle.dump(Marker(marker), handle)
    index = {"metadata": {}, "weight_map": {"lm_head.weight": "pytorch_model.bin"}}
    (hf_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    result = invoke("export", hf_copy, "-o", tmp_path / "out", "--max-context", 256, "--chunk", 64)
    assert result.exit_code == 0, result.output
    assert not marker.exists()
    (hf_copy / "model.safetensors").unlink()               # only the pickle is left
    assert_one_line_error(invoke("export", hf_copy, "-o", tmp_path / "o2"), "no *.safetensors")
    shutil.copy(hf_copy / "pytorch_model.bin", hf_copy / "model.safetensors")   # a pickle by another name
    assert_one_line_error(invoke("export", hf_copy, "-o", tmp_path / "o2"), "is not a valid safetensors file")
    assert not marker.exists() and not (tmp_path / "o2").exists()


@pytest.mark.parametrize("config_file", ["config.json", "tokenizer_config.json"])
def test_remote_code_is_refused_even_when_the_user_says_yes(hf_copy, tmp_path, config_file):
    marker = tmp_path / "code-ran"
    (hf_copy / "evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    edit_manifest_like = json.loads((hf_copy / config_file).read_text())
    edit_manifest_like["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoTokenizer": ["evil.EvilTokenizer", None],
                                      "AutoModelForCausalLM": "evil.EvilModel"}
    (hf_copy / config_file).write_text(json.dumps(edit_manifest_like))
    result = invoke("convert", hf_copy, "-o", tmp_path / "out", "--budget", 64, "--window", 8, input="y\ny\ny\n")
    assert_one_line_error(result, "never executes code from a model folder")
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_artifact_asking_for_remote_code_is_refused(artifact, tmp_path):
    marker = tmp_path / "code-ran"
    (artifact / "evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    config = json.loads((artifact / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": ["evil.EvilTokenizer", None]}
    (artifact / "tokenizer_config.json").write_text(json.dumps(config))
    rerecord_checksums(artifact)
    for command in ("run", "validate"):
        assert_one_line_error(invoke(command, artifact, "--prompt", "hi", input="y\n"), "never executes code")
    assert not marker.exists()


def test_convert_copies_no_file_of_the_model_folder_but_its_tokenizer(hf_copy, tmp_path):
    (hf_copy / "helper.py").write_text("raise SystemExit('ran')\n")
    assert invoke("export", hf_copy, "-o", tmp_path / "dense", "--max-context", 256, "--chunk", 64).exit_code == 0
    assert invoke("compress", tmp_path / "dense", "-o", tmp_path / "snap", "--budget", 64, "--window", 8).exit_code == 0
    for folder in (tmp_path / "dense", tmp_path / "snap"):
        names = {p.name for p in folder.iterdir()}
        assert "helper.py" not in names and not any(n.endswith(".py") for n in names)
        assert names - {MANIFEST} == set(json.loads((folder / MANIFEST).read_text())["files"])


@pytest.mark.parametrize("file", ["../other/decode.onnx", "/etc/hostname", "prefill.onnx"])
def test_manifest_graph_paths_are_confined(artifact, file):
    edit_manifest(artifact, lambda raw: raw["graphs"]["decode"].update(file=file))
    assert_one_line_error(invoke("run", artifact, "--prompt", "hi"), "must be the listed file decode.onnx")
    assert_one_line_error(invoke("inspect", artifact), "must be the listed file decode.onnx")


@pytest.mark.parametrize("name", ["../weights.bin", "/etc/passwd", ".."])
def test_manifest_file_table_is_confined(artifact, name):
    edit_manifest(artifact, lambda raw: raw["files"].update({name: {"bytes": 1, "sha256": "0"}}))
    assert_one_line_error(invoke("inspect", artifact), "outside the artifact folder")


def test_symlinked_file_is_refused(artifact, tmp_path):
    outside = tmp_path / "outside.bin"
    shutil.copy(artifact / WEIGHTS, outside)
    (artifact / WEIGHTS).unlink()
    (artifact / WEIGHTS).symlink_to(outside)
    assert_one_line_error(invoke("run", artifact, "--prompt", "hi"), "links are not followed")


def test_external_data_outside_the_weights_file_is_refused(artifact, tmp_path):
    import onnx
    model = onnx.load(str(artifact / "prefill.onnx"), load_external_data=False)
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = "../secret.bin"
    onnx.save_model(model, str(artifact / "prefill.onnx"))
    rerecord_checksums(artifact)
    assert_one_line_error(invoke("compress", artifact, "-o", tmp_path / "snap", "--budget", 64, "--window", 8),
                          "reads external data from '../secret.bin'")
    assert_one_line_error(invoke("run", artifact, "--prompt", "hi"), "reads external data")


# ---------------------------------------------------------------- outputs
def test_output_appearing_while_staging_is_left_alone(tmp_path):
    target = tmp_path / "out"
    with pytest.raises(SnapcompileError, match="appeared while it was being written"):
        with atomic_directory(target) as staging:
            (staging / "new.txt").write_text("new")
            target.mkdir()
            (target / "theirs.txt").write_text("theirs")
    assert sorted(p.name for p in target.iterdir()) == ["theirs.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_force_replaces_only_snapcompile_folders(tmp_path, monkeypatch):
    mydata = tmp_path / "mydata"
    mydata.mkdir()
    (mydata / "precious.txt").write_text("keep me")
    assert_one_line_error(invoke("export", "tiny-llama", "-o", mydata, "--force"), "--force only replaces folders")
    assert (mydata / "precious.txt").read_text() == "keep me"
    a_file = tmp_path / "file.txt"
    a_file.write_text("keep me too")
    assert_one_line_error(invoke("export", "tiny-llama", "-o", a_file, "--force"), "is not a folder")
    assert a_file.read_text() == "keep me too"
    monkeypatch.chdir(mydata)
    for target in (".", "..", mydata):
        assert_one_line_error(invoke("export", "tiny-llama", "-o", target, "--force"), "current folder")
    assert sorted(p.name for p in mydata.iterdir()) == ["precious.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt", "mydata"]


def test_force_swaps_in_the_new_folder_in_one_step(tmp_path):
    target = tmp_path / "out"
    with atomic_directory(target) as staging:
        (staging / MANIFEST).write_text("old")
    with atomic_directory(target, force=True) as staging:
        (staging / MANIFEST).write_text("new")
        assert (target / MANIFEST).read_text() == "old"        # the old output stays until the swap
    assert (target / MANIFEST).read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def _convert_in_subprocess(output: Path) -> subprocess.Popen:
    args = [sys.executable, "-m", "snapcompile.cli", "convert", "tiny-llama", "-o", str(output), "--budget", "64",
            "--window", "8", "--max-context", "4096", "--chunk", "64"]
    # a shell's background job (nohup ... &) ignores SIGINT, and so would the child: restore the default
    return subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _staging_folders(output: Path) -> list[str]:
    return sorted(p.name for p in output.parent.iterdir() if p.name.startswith(f".{output.name}."))


def _wait_for_staging(process: subprocess.Popen, output: Path) -> None:
    deadline = time.monotonic() + 120
    while not _staging_folders(output):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.05)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signals_during_convert_remove_the_staging_folder(tmp_path, sig):
    output = tmp_path / "out"
    process = _convert_in_subprocess(output)
    _wait_for_staging(process, output)
    process.send_signal(sig)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130 and "error: interrupted" in stderr and "Traceback" not in stderr
    assert list(tmp_path.iterdir()) == []


def test_staging_of_a_killed_convert_is_removed_by_the_next(tmp_path):
    output = tmp_path / "out"
    process = _convert_in_subprocess(output)
    _wait_for_staging(process, output)
    process.kill()
    process.communicate(timeout=60)
    assert _staging_folders(output) and not output.exists()
    result = invoke("convert", "tiny-llama", "-o", output, "--budget", 64, "--window", 8, "--max-context", 256,
                    "--chunk", 64)
    assert result.exit_code == 0, result.output
    assert _staging_folders(output) == [] and (output / MANIFEST).is_file()


def test_run_output_is_checked_before_anything_runs(artifact, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    a_file = tmp_path / "file.txt"
    a_file.write_text("mine")
    assert_one_line_error(invoke("run", artifact, "--prompt", "hi", "-o", tmp_path), "is a folder")
    assert_one_line_error(invoke("run", artifact, "--prompt", "hi", "-o", a_file / "out.jsonl"), "cannot write")
    assert_one_line_error(invoke("run", artifact, "--prompt", "hi", "-o", a_file), "already exists (use --force")
    assert_one_line_error(invoke("run", artifact, "--prompts", prompts, "-o", prompts, "--force"), "also an input")
    assert a_file.read_text() == "mine" and prompts.read_text() == '{"prompt": "hi"}\n'
    result = invoke("run", artifact, "--prompt", "hi", "-o", a_file, "--force", "--max-new-tokens", 2)
    assert result.exit_code == 0, result.output
    assert json.loads(a_file.read_text())["prompt"] == "hi"


# ---------------------------------------------------------------- artifacts that would run wrong
def test_snapstream_manifest_without_its_select_graph_is_refused(snap_artifact):
    edit_manifest(snap_artifact, lambda raw: raw["graphs"].pop("select"))
    assert_one_line_error(invoke("run", snap_artifact, "--prompt", "hi"), "missing: select")


def test_streamingllm_manifest_with_a_select_graph_is_refused(snap_artifact):
    edit_manifest(snap_artifact, lambda raw: raw["policy"].update(policy="streamingllm"))
    assert_one_line_error(invoke("run", snap_artifact, "--prompt", "hi"), "unexpected: select")


def test_flipped_byte_in_the_weights_is_detected(artifact):
    with open(artifact / WEIGHTS, "r+b") as handle:
        handle.seek(5000)
        byte = handle.read(1)
        handle.seek(5000)
        handle.write(bytes([byte[0] ^ 0x10]))
    assert_one_line_error(invoke("run", artifact, "--prompt", "hi"), "does not match its sha256")
    assert_one_line_error(invoke("inspect", artifact), "does not match its sha256")
    assert invoke("inspect", artifact, "--no-verify").exit_code == 0      # sizes only, on request


@pytest.mark.parametrize("damage, fragment", [
    (lambda a: (a / WEIGHTS).unlink(), "weights.bin is missing"),
    (lambda a: (a / WEIGHTS).write_bytes(b""), "the artifact is truncated"),
    (lambda a: os.truncate(a / WEIGHTS, 1000), "the artifact is truncated"),
    (lambda a: (a / "tokenizer.json").unlink(), "tokenizer.json is missing"),
    (lambda a: edit_manifest(a, lambda raw: raw["graphs"].update(step=raw["graphs"].pop("decode"))), "missing: decode"),
    (lambda a: edit_manifest(a, lambda raw: raw["graphs"]["decode"].update(file="prefill.onnx")),
     "must be the listed file decode.onnx"),
    (lambda a: edit_manifest(a, lambda raw: raw.update(format_version=1)), "written by an older snapcompile"),
    (lambda a: edit_manifest(a, lambda raw: raw.pop("files")), "malformed field 'files'"),
    (lambda a: (a / MANIFEST).write_text("[1, 2]"), "not a JSON object"),
], ids=["weights-deleted", "weights-empty", "weights-truncated", "no-tokenizer", "decode-renamed", "wrong-file",
        "old-format", "no-files-table", "manifest-a-list"])
def test_damaged_artifacts_are_one_error_line(artifact, damage, fragment):
    damage(artifact)
    for command in (("run", artifact, "--prompt", "hi"), ("inspect", artifact)):
        assert_one_line_error(invoke(*command), fragment)


def test_artifact_too_large_for_this_machine_is_refused_before_allocating(tmp_path):
    out = tmp_path / "huge"
    assert invoke("export", "tiny-llama", "-o", out, "--slots", 10_000_000, "--max-context", 256,
                  "--chunk", 64).exit_code == 0
    result = invoke("run", out, "--prompt", "hi")
    assert_one_line_error(result, "the artifact needs about 1220.7 GiB")
    assert "10000000 slots x 256 rows" in result.output and "available here" in result.output


# ---------------------------------------------------------------- bad request values
@pytest.mark.parametrize("args, fragment", [
    (("--seed", -1, "--temperature", 0.7), "seed must be an integer in [0, 2**64), got -1"),
    (("--temperature", "nan"), "temperature must be a finite number >= 0, got nan"),
    (("--temperature", "inf"), "temperature must be a finite number"),
    (("--top-p", 0), "top_p must be a number in (0, 1]"),
    (("--max-new-tokens", 0), "0 is not in the range x>=1"),
    (("--stop", ""), "stop must be a list of non-empty strings"),
])
def test_bad_sampling_flags_are_refused_up_front(artifact, args, fragment):
    assert_one_line_error(invoke("run", artifact, "--prompt", "hi", *args), fragment)


@pytest.mark.parametrize("line, fragment", [
    ('{"prompt": "x", "stop": [1, 2]}', "line 3: stop must be a list of non-empty strings"),
    ('{"prompt": "x", "stop": 7}', "line 3: stop must be a string or a list of strings, got 7"),
    ('{"prompt": "x", "max_new_tokens": 0}', "line 3: max_new_tokens must be an integer >= 1"),
    ('{"prompt": "x", "seed": -1, "temperature": 0.7}', "line 3: seed must be an integer"),
    ('{"prompt": "x", "top_k": 1.5}', "line 3: top_k must be an integer >= 0"),
    ('{"prompt": "x", "temperature": true}', "line 3: temperature must be a finite number"),
    ('{"prompt": "x", "id": "a"}', "line 3: id 'a' is used by an earlier prompt"),
    ('["prompt"]', 'line 3: each line must be an object with a "prompt" string'),
])
def test_prompts_file_errors_name_the_line(artifact, tmp_path, line, fragment):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "ok", "id": "a"}\n\n' + line + "\n")
    assert_one_line_error(invoke("run", artifact, "--prompts", prompts), f"p.jsonl {fragment}")


def test_non_utf8_prompts_file(artifact, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(b'{"prompt": "caf\xe9"}\n')
    assert_one_line_error(invoke("run", artifact, "--prompts", prompts), "is not UTF-8 text")


def test_a_request_failing_inside_the_engine_fails_alone(artifact, faulty_sampling):
    from snapcompile import Engine, Request, SamplingParams
    engine = Engine.from_artifact(artifact)
    requests = [Request(engine.encode("one"), max_new_tokens=3),
                Request(engine.encode("two"), max_new_tokens=3, sampling=SamplingParams(seed=FAULT_SEED)),
                Request(engine.encode("three"), max_new_tokens=3)]
    results = engine.generate(requests)
    assert [r.error is None for r in results] == [True, False, True]
    assert "internal error: RuntimeError: injected fault" in results[1].error
    assert all(len(r.output_ids) == 3 for r in (results[0], results[2]))


# ---------------------------------------------------------------- bad model files
@pytest.mark.parametrize("damage, fragment", [
    (lambda m: os.truncate(m / "model.safetensors", 5000), "is not a valid safetensors file"),
    (lambda m: (m / "config.json").write_text("[1, 2]"), "config.json must hold a JSON object, not list"),
    (lambda m: _patch_config(m, num_attention_heads=0), "num_attention_heads must be a positive integer, got 0"),
    (lambda m: _patch_config(m, hidden_size="64"), "hidden_size must be a positive integer, got '64'"),
    (lambda m: _patch_config(m, num_hidden_layers=3), "the checkpoint lacks model.layers.2"),
    (lambda m: _patch_config(m, intermediate_size=96),
     "down_proj.weight has shape [64, 128], the config needs [64, 96]"),
    (lambda m: (m / "config.json").write_bytes(b"\xff\xfe"), "config.json is not valid JSON"),
], ids=["truncated-safetensors", "config-list", "zero-heads", "string-size", "missing-layer", "wrong-shape",
        "config-binary"])
def test_bad_model_files_are_one_error_line(hf_copy, tmp_path, damage, fragment):
    damage(hf_copy)
    assert_one_line_error(invoke("export", hf_copy, "-o", tmp_path / "out"), fragment)
    assert not (tmp_path / "out").exists()


def _patch_config(folder, **values):
    config = json.loads((folder / "config.json").read_text())
    config.update(values)
    (folder / "config.json").write_text(json.dumps(config))


# ---------------------------------------------------------------- every command, bad input
BAD_INPUTS = [
    (("bogus",), "No such command 'bogus'"),
    (("export",), "Missing argument 'MODEL'"),
    (("export", "tiny-llama"), "Missing option '-o'"),
    (("export", "tiny-llama", "-o", "{tmp}/o", "--slots", 0), "--slots must be >= 1"),
    (("export", "tiny-llama", "-o", "{tmp}/o", "--max-context", "abc"), "'abc' is not a valid integer"),
    (("export", "tiny-llama", "-o", "{tmp}/o", "--bogus"), "No such option '--bogus'"),
    (("export", "{tmp}/nope", "-o", "{tmp}/o"), "neither a built-in name"),
    (("convert", "tiny-llama", "-o", "{tmp}/o", "--policy", "nope"), "'nope' is not one of"),
    (("convert", "tiny-llama", "-o", "{tmp}/o", "--lower", "nope"), "'nope' is not one of"),
    (("convert", "tiny-llama", "-o", "{tmp}/o", "--budget", 30, "--window", 32), "must exceed sinks + window"),
    (("compress", "{tmp}/nope", "-o", "{tmp}/o"), "artifact folder not found"),
    (("compress", "{dense}", "-o", "{dense}", "--force"), "the output folder is the input artifact"),
    (("compress", "{snap}", "-o", "{tmp}/o"), "already compressed"),
    (("inspect", "{tmp}/nope"), "artifact folder not found"),
    (("inspect", "{dense}/weights.bin"), "artifact folder not found"),
    (("run", "{dense}"), "give exactly one of"),
    (("run", "{dense}", "--prompt", "hi", "--slots", 0), "0 is not in the range x>=1"),
    (("run", "{dense}", "--prompt", "hi", "--slots", 99), "--slots must be in 1..3"),
    (("run", "{dense}", "--prompt", "hi", "--prefill-tokens-per-step", 0), "0 is not in the range x>=1"),
    (("run", "{dense}", "--prompt", "hi", "--backend", "nope"), "'nope' is not one of"),
    (("run", "{dense}", "--prompt", "hi", "--top-logprobs", -1), "top_logprobs must be an integer >= 0"),
    (("run", "{dense}", "--prompts", "{tmp}/missing.jsonl"), "cannot read prompts file"),
    (("validate", "{dense}", "--steps", -5), "-5 is not in the range x>=1"),
    (("validate", "{dense}", "--min-agreement", 2), "2.0 is not in the range 0<=x<=1"),
    (("validate", "{dense}", "--prompt", "x" * 600), "leaves no room"),
    (("build", "{tmp}/nope", "-o", "{tmp}/o"), "artifact folder not found"),
    (("build", "{dense}", "-o", "{tmp}/o"), "TensorRT"),
    (("eval", "tiny-llama", "--task", "nope"), "'nope' is not one of"),
    (("eval", "tiny-llama", "--lengths", "abc"), "expected comma-separated int values"),
    (("eval", "tiny-llama", "--samples", 0), "--samples must be >= 1"),
    (("eval", "tiny-llama", "--policies", "dense,bogus"), "unknown policies: bogus"),
    (("eval", "tiny-llama", "--ratios", 1), "--ratios must be integers >= 2"),
    (("eval", "tiny-llama", "-o", "{tmp}"), "is a folder"),
    (("bench", "tiny-llama", "--contexts", 10), "--contexts must be >= 64"),
    (("bench", "tiny-llama", "--repeats", 0), "--repeats must be >= 1"),
    (("bench", "tiny-llama", "-o", "{dense}/manifest.json"), "already exists (use --force"),
]


@pytest.mark.parametrize("args, fragment", BAD_INPUTS, ids=[" ".join(map(str, a))[:60] for a, _ in BAD_INPUTS])
def test_every_command_answers_bad_input_with_one_error_line(args, fragment, tiny_dense_dir, tiny_snap_dir, tmp_path):
    values = {"tmp": tmp_path, "dense": tiny_dense_dir, "snap": tiny_snap_dir}
    filled = [str(a).format(**values) for a in args]
    assert_one_line_error(invoke(*filled), fragment)
