"""studies/passkey_selection.py: whether a pass key's tokens are among SnapKV's kept rows, and the
answers of the policy variants."""
import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.study


def test_passkey_selection_reports_the_global_layers_and_every_policys_answers(tmp_path):
    done = subprocess.run([sys.executable, "studies/passkey_selection.py", "tiny-gemma3", "--case", "400,0.5,0",
                           "--ratio", "4", "--variant", "kernel=3", "--work", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    report = lines[0]
    assert report["budget"] == 100 and report["tokens"] > 100
    assert [row["layer"] for row in report["selection"]] == [1]       # layer 0 is local: its window ring
    row = report["selection"][0]
    assert row["needle"] and len(row["needle_kept"]) == len(row["needle_ranks"]) == len(row["needle"])
    assert [line["policy"] for line in lines[1:]] == ["dense", "snapstream", "kernel=3"]
    assert all(set(line) >= {"eval", "completion", "answer"} for line in lines[1:])
