"""studies/compare_weights.py (paired retention of the same cases under two weight formats) and
studies/block_error.py."""
import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.study


def _results(path, weights, block_size, correct):
    records = [{"id": f"snapstream@250/multikey/L1000/s{i}", "policy": "snapstream", "budget": 250, "length": 1000,
                "correct": right} for i, right in enumerate(correct)]
    path.write_text(json.dumps({"config": {"weight_format": weights, "block_size": block_size}, "records": records}))
    return path


def test_retention_is_paired_on_the_reference_s_right_answers_and_labelled_by_block_size(tmp_path):
    reference = _results(tmp_path / "b32.json", "int4", 32, [True, True, False, True])
    other = _results(tmp_path / "b64.json", "int4", 64, [True, False, True, True])
    done = subprocess.run([sys.executable, "studies/compare_weights.py", reference, other], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    header, _, row = done.stdout.splitlines()
    assert header == "| policy, budget, length | int4 b64 right / retained of int4 b32 (lost) | int4 b32 right |"
    assert row == "| snapstream, 250, 1000 | 3/4 / 67% (1) | 3/4 |"


def test_block_error_grows_with_the_block_and_skips_sizes_that_do_not_divide():
    """studies/block_error.py on tiny-llama (inputs 64, down_proj 128): relative requantization error
    per role, larger for larger blocks; None where the block does not divide the inputs."""
    done = subprocess.run([sys.executable, "studies/block_error.py", "tiny-llama", "--block-sizes", "16,32,128"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    errors = json.loads(done.stdout.splitlines()[0])["relative_error"]
    assert errors["self_attn.q_proj"]["128"] is None and errors["mlp.down_proj"]["128"] is not None
    for role, by_size in errors.items():
        assert 0 < by_size["16"] < by_size["32"] < 0.2, role
    assert "| mlp.down_proj |" in done.stdout and "| — |" in done.stdout
