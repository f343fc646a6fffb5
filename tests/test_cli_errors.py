"""Every user mistake is one `error:` line with exit code 2, checked before any work starts."""
import json
from pathlib import Path

import pytest

from tests.cli_helpers import assert_one_line_error, edit_manifest, invoke, rerecord_checksums

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("args, fragment", [
    (("--seed", -1, "--temperature", 0.7), "seed must be an integer in [0, 2**63), got -1"),
    (("--temperature", "nan"), "temperature must be a finite number in [0, 2], got nan"),
    (("--temperature", "inf"), "temperature must be a finite number"),
    (("--top-p", 0), "top_p must be a finite number in (0, 1]"),
    (("--max-new-tokens", 0), "0 is not in the range x>=1"),
    (("--stop", ""), "stop strings must not be empty"),
    (("--stop", "\udcff"), "a stop string is not valid UTF-8 text"),
    (("--prompt", "\udcff\udcfe"), "--prompt 2 is not valid UTF-8 text"),     # bytes ff fe in argv
])
def test_bad_sampling_flags_are_refused_up_front(artifact, args, fragment):
    assert_one_line_error(invoke("run", artifact, "--prompt", "hi", *args), fragment)


@pytest.mark.parametrize("line, fragment", [
    ('{"prompt": "x", "stop": [1, 2]}', "line 3: stop strings must not be empty"),
    ('{"prompt": "x", "stop": 7}', "line 3: stop must be a string or a list of strings, got 7"),
    ('{"prompt": "x", "max_new_tokens": 0}', "line 3: max_new_tokens must be an integer >= 1"),
    ('{"prompt": "x", "seed": -1, "temperature": 0.7}', "line 3: seed must be an integer"),
    ('{"prompt": "x", "top_k": 1.5}', "line 3: top_k must be an integer >= 0"),
    ('{"prompt": "x", "temperature": true}', "line 3: temperature must be a finite number"),
    ('{"prompt": "x", "id": "a"}', "line 3: id 'a' is used by an earlier prompt"),
    ('["prompt"]', 'line 3: each line must be an object with a "prompt" string'),
    ('{"prompt": "a\\ud800b"}', "line 3: the prompt is not valid UTF-8 text"),
    ('{"prompt": "x", "stop": ["\\udfff"]}', "line 3: a stop string is not valid UTF-8 text"),
    ("[" * 100000 + "]" * 100000, "line 3 nests too deeply"),
    ('{"prompt": "x", "seed": ' + "9" * 5000 + "}", "line 3 is not valid JSON"),
])
def test_prompts_file_errors_name_the_line(artifact, tmp_path, line, fragment):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "ok", "id": "a"}\n\n' + line + "\n")
    assert_one_line_error(invoke("run", artifact, "--prompts", prompts), f"p.jsonl {fragment}")


def test_a_prompt_holding_a_raw_line_separator_is_one_prompt(artifact, tmp_path):
    """JSON allows U+2028, U+2029 and U+0085 raw inside a string; JSON Lines splits on newlines only
    (Windows' \r\n too)."""
    from snapcompile.prompts_file import read_prompts_file
    prompts = tmp_path / "p.jsonl"
    texts = ["one\u2028two", "three\u2029four\u0085five", "six"]
    prompts.write_bytes("\r\n".join(json.dumps({"prompt": t}, ensure_ascii=False) for t in texts).encode() + b"\n")
    assert [record.prompt for record in read_prompts_file(prompts)] == texts
    result = invoke("run", artifact, "--prompts", prompts, "--max-new-tokens", 2, "--json")
    assert result.exit_code == 0, result.output
    assert [r["prompt"] for r in json.loads(result.output.strip().splitlines()[-1])["results"]] == texts


def test_non_utf8_prompts_file(artifact, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(b'{"prompt": "caf\xe9"}\n')
    assert_one_line_error(invoke("run", artifact, "--prompts", prompts), "is not UTF-8 text")


BAD_INPUTS = [
    (("bogus",), "No such command 'bogus'"),
    (("export",), "Missing argument 'MODEL'"),
    (("export", "tiny-llama"), "Missing option '-o'"),
    (("export", "tiny-llama", "-o", "{tmp}/o", "--slots", 0), "--slots must be >= 1"),
    (("export", "tiny-llama", "-o", "{tmp}/o", "--max-context", "abc"), "'abc' is not a valid integer"),
    (("export", "tiny-llama", "-o", "{tmp}/o", "--slots", 100000000), "of KV cache for 100000000 slots"),
    (("convert", "tiny-llama", "-o", "{tmp}/o", "--slots", 100000000, "--max-context", 8192), "needs about"),
    (("export", "tiny-llama", "-o", "{tmp}/o", "--bogus"), "No such option '--bogus'"),
    (("export", "{tmp}/nope", "-o", "{tmp}/o"), "neither a built-in name"),
    (("convert", "HuggingFaceTB/SmolLM2-135M", "-o", "{tmp}/o"), "snapcompile downloads nothing"),
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
    (("run", "{dense}", "--prompts", "/dev/zero"), "prompts file /dev/zero is not a regular file"),
    (("run", "{dense}", "--prompts", "/dev/urandom"), "is not a regular file"),
    (("run", "{dense}", "--prompts", "{tmp}"), "is not a regular file"),
    (("eval-turns", "tiny-llama", "--modes", "resume", "--reference", "/dev/zero", "-o", "{tmp}/t.json"),
     "results file /dev/zero is not a regular file"),
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
    (("serve", "{dense}", "--drain-timeout", "nan"), "'nan' is not a finite number"),
    (("serve", "{dense}", "--head-timeout", "inf"), "'inf' is not a finite number"),
    (("validate", "{dense}", "--tolerance", "nan"), "'nan' is not a finite number"),
    (("serve", "{dense}", "--session-cache-bytes", "\u00b2"), "expected 'auto', 0 or a size"),
    (("serve", "{dense}", "--api-key", " padded"), "printable ASCII without spaces"),
    (("serve", "{dense}", "--api-key", "cl\u00e9"), "printable ASCII without spaces"),
]


@pytest.mark.parametrize("args, fragment", BAD_INPUTS, ids=[" ".join(map(str, a))[:60] for a, _ in BAD_INPUTS])
def test_every_command_answers_bad_input_with_one_error_line(args, fragment, tiny_dense_dir, tiny_snap_dir, tmp_path):
    values = {"tmp": tmp_path, "dense": tiny_dense_dir, "snap": tiny_snap_dir}
    filled = [str(a).format(**values) for a in args]
    assert_one_line_error(invoke(*filled), fragment)


def _with_tokenizer_change(artifact, change):
    path = artifact / "tokenizer.json"
    spec = json.loads(path.read_text())
    change(spec)
    path.write_text(json.dumps(spec))
    rerecord_checksums(artifact)


@pytest.mark.parametrize("template, fragment", [
    ("{% for %}", "the chat template failed: TemplateSyntaxError"),
    ("{{ raise_exception('no system role') }}", "the chat template failed: TemplateError: no system role"),
    ("{{ messages.__class__.__mro__ }}", "the chat template failed: SecurityError"),
    ("{{ undefined_thing.attribute }}", "the chat template failed: UndefinedError"),
])
def test_chat_template_errors_are_one_error_line(artifact, template, fragment):
    (artifact / "chat_template.jinja").write_text(template)
    rerecord_checksums(artifact)
    edit_manifest(artifact, lambda raw: raw.update(chat=True))
    assert_one_line_error(invoke("run", artifact, "--prompt", "hi", "--max-new-tokens", 1), fragment)


def test_a_tokenizer_regex_past_its_backtracking_limit_is_one_error_line(artifact):
    """A crafted pre-tokenizer pattern: the Rust regex engine panics; the user gets one line."""
    _with_tokenizer_change(artifact, lambda spec: spec.update(pre_tokenizer={
        "type": "Split", "pattern": {"Regex": "(a|aa)+$"}, "behavior": "Isolated", "invert": False}))
    result = invoke("run", artifact, "--prompt", "a" * 50000 + "b", "--max-new-tokens", 1, "--raw")
    assert_one_line_error(result, "the tokenizer failed on this prompt")


def test_user_files_are_read_only_when_regular_and_bounded(tmp_path):
    import os

    from snapcompile.errors import SnapcompileError
    from snapcompile.userfiles import read_user_file
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)                                     # opening it would wait for a writer forever
    with pytest.raises(SnapcompileError, match="is not a regular file"):
        read_user_file(fifo, "prompts file")
    big = tmp_path / "big.jsonl"
    big.write_bytes(b"x" * 101)
    with pytest.raises(SnapcompileError, match="has 101 bytes; at most 100 are read"):
        read_user_file(big, "prompts file", max_bytes=100)
    assert read_user_file(big, "prompts file", max_bytes=101) == b"x" * 101


def test_a_prompt_id_that_collides_with_a_conversation_turn_is_refused_before_any_work(artifact, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"turns": ["hello", "and then?"], "id": "c"}\n{"prompt": "x", "id": "c/2"}\n')
    assert_one_line_error(invoke("run", artifact, "--prompts", prompts),
                          "line 2: id 'c/2' is used by an earlier prompt")
