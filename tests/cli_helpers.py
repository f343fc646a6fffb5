"""Helpers of the CLI and hardening tests: invoking the CLI in-process, asserting one-line errors,
editing an artifact's manifest as a careless (or hostile) user would."""
import json
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
