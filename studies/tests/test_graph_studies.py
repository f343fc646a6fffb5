"""studies/graph_runtimes.py and studies/gqa_attention_bench.py."""
import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.study


def test_graph_runtimes_script_times_a_prefill_chunk(tiny_dense_dir):
    """studies/graph_runtimes.py, the ONNX Runtime half (OpenVINO lives in the peers' venv)."""
    done = subprocess.run([sys.executable, "studies/graph_runtimes.py", str(tiny_dense_dir), "--graph", "prefill",
                           "--start", "64", "--repeats", "2", "--runtime", "ort"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    row = json.loads(done.stdout)
    assert (row["runtime"], row["graph"], row["start"], row["repeats"]) == ("ort", "prefill", 64, 2)
    assert row["chunk_ms"] > 0 and row["compile_s"] >= 0
    missing = subprocess.run([sys.executable, "studies/graph_runtimes.py", str(tiny_dense_dir)], capture_output=True,
                             text=True, timeout=60)
    assert missing.returncode == 2 and "--ov-python is required" in missing.stderr


def test_gqa_attention_bench_compares_equal_outputs():
    """studies/gqa_attention_bench.py: both attentions give the same output (it prints the gap)."""
    import importlib.util

    import numpy as np
    spec = importlib.util.spec_from_file_location("gqa_attention_bench", "studies/gqa_attention_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    line = module.measure(256, 192, np.random.default_rng(0))
    assert line.startswith("rows 256, filled 192: standard ") and float(line.rsplit(" ", 1)[1]) < 1e-5
