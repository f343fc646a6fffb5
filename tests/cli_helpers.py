"""Helpers of the CLI and hardening tests: invoking the CLI in-process, asserting one-line errors,
editing an artifact's manifest as a careless (or hostile) user would."""
import json
import shutil
from pathlib import Path

from click.testing import CliRunner

from snapcompile.artifact.files import file_sha256
from snapcompile.artifact.manifest import MANIFEST
from snapcompile.cli import main


def invoke(*args, input=None):
    return CliRunner().invoke(main, [str(a) for a in args], input=input, catch_exceptions=False)


def assert_one_line_error(result, fragment=""):
    """Exit code 2, exactly one `error:` line holding `fragment`, no traceback, no usage text."""
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


def edit_manifest(folder, change):
    raw = json.loads((folder / MANIFEST).read_text())
    change(raw)
    (folder / MANIFEST).write_text(json.dumps(raw))


def rerecord_checksums(folder):
    """Make the manifest's files table match the folder again (as a careless edit would)."""
    raw = json.loads((folder / MANIFEST).read_text())
    raw["files"] = {item.name: {"bytes": item.stat().st_size, "sha256": file_sha256(item)}
                    for item in sorted(folder.iterdir()) if item.is_file() and item.name != MANIFEST}
    (folder / MANIFEST).write_text(json.dumps(raw))


# A chat template whose work the first message's content chooses: a loop (writing nothing, so that
# only the deadline stops it: output growing ~250 MB/s met the memory bound first on a fast core), a
# 3 GB string, a 30-million-character rendering, or ChatML.
HOSTILE_TEMPLATE = (
    "{% set c = messages[0]['content'] %}"
    "{% if c == 'loop' %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    "{% elif c == 'huge' %}{{ 'a' * 3000000000 }}"
    "{% elif c == 'long' %}{{ 'a' * 30000000 }}"
    "{% else %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n{% endif %}")


def hostile_copy(artifact: Path, folder: Path) -> Path:
    r"""A resealed copy of `artifact` with HOSTILE_TEMPLATE, a pre-tokenizer regex that is quadratic
    in the text (`\w*\s` over letters without a space: 1.3 s for 20,000, ~30 s for 100,000), and a
    2000-character vocabulary entry (a prompt may then hold 2000 characters a token)."""
    shutil.copytree(artifact, folder)
    (folder / "chat_template.jinja").write_text(HOSTILE_TEMPLATE)
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    tokenizer["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": r"\w*\s"}, "behavior": "Isolated", "invert": False},
        tokenizer["pre_tokenizer"]]}
    added = tokenizer["added_tokens"]
    added.append({**added[-1], "id": max(token["id"] for token in added) + 1, "content": "x" * 2000,
                  "special": False})
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    rerecord_checksums(folder)
    return folder
