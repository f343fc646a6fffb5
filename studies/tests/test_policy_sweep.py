"""studies/policy_sweep.py: policy variants against the oracle on generated cases."""
import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.study


def test_policy_sweep_script(tmp_path):
    out = tmp_path / "sweep.json"
    done = subprocess.run([sys.executable, "studies/policy_sweep.py", "--model", "tiny-llama", "--task", "passkey",
                           "--lengths", "400", "--depths", "0.2,0.8", "--samples", "1",
                           "--variant", "fits=ratio:0.5", "--variant", "quarter=scope:layer,window:8",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    payload = json.loads(out.read_text())
    assert [r["depth"] for r in payload["records"]] == [0.2, 0.8]
    for record in payload["records"]:
        answers = record["answers"]
        assert answers["fits"]["text"] == answers["dense"]["text"], "a budget above the prompt is exact"
        assert record["answers"]["fits"]["dense_margin"] is None
    assert payload["summary"]["quarter"]["400"]["cases"] == 2
    bad = subprocess.run([sys.executable, "studies/policy_sweep.py", "--variant", "x=colour:red"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown field 'colour'" in bad.stderr and "Traceback" not in bad.stderr


def test_dense_margin_is_read_where_answers_first_differ():
    import importlib.util

    import torch
    spec = importlib.util.spec_from_file_location("policy_sweep", "studies/policy_sweep.py")
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    logits = [torch.tensor([5.0, 0.0, 0.0]), torch.log(torch.tensor([0.5, 0.2, 0.3]))]
    assert sweep.dense_margin([0, 0], logits, [0, 2]) == pytest.approx(0.5 - 0.3)
    assert sweep.dense_margin([0, 0], logits, [0, 0]) is None
    expected = ("x", {"scope": "layer", "kernel": 31, "ratio": 8.0})
    assert sweep.parse_variant("x=scope:layer,kernel:31,ratio:8") == expected
