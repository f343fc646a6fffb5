"""studies/graph_runtimes.py and studies/gqa_attention_bench.py."""
import json
import subprocess
import sys

import pytest

from snapcompile.artifact.naming import PREFILL_EMBED, PREFILL_HEAD, SELECT_LAYER, prefill_layer

pytestmark = pytest.mark.study
# a compressed artifact prefills a layer at a time: the tiny models have two layers
LAYER_GRAPHS = {PREFILL_EMBED, prefill_layer(0), prefill_layer(1), PREFILL_HEAD, SELECT_LAYER}


def _study(script: str, *args, timeout: int = 120) -> subprocess.CompletedProcess:
    """Run studies/`script` with `args` in this interpreter."""
    return subprocess.run([sys.executable, f"studies/{script}", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


def test_graph_runtimes_script_times_a_prefill_chunk(tiny_dense_dir):
    """studies/graph_runtimes.py, the ONNX Runtime half (OpenVINO lives in the peers' venv)."""
    done = _study("graph_runtimes.py", tiny_dense_dir, "--graph", "prefill", "--start", 64, "--repeats", 2,
                  "--runtime", "ort")
    assert done.returncode == 0, done.stderr
    row = json.loads(done.stdout)
    assert (row["runtime"], row["graph"], row["start"], row["repeats"]) == ("ort", "prefill", 64, 2)
    assert row["chunk_ms"] > 0 and row["compile_s"] >= 0
    missing = _study("graph_runtimes.py", tiny_dense_dir, timeout=60)
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


def test_artifact_point_reports_prefill_and_decode(tiny_snap_dir):
    """studies/artifact_point.py: the ov_bench.py figures for an artifact."""
    done = _study("artifact_point.py", tiny_snap_dir, "--context", 200, "--slots", "1,2", "--steps", 4, "--repeats", 2)
    assert done.returncode == 0, done.stderr
    row = json.loads(done.stdout)
    assert len(row["prefill_s"]) == 2 and all(s > 0 for s in row["prefill_s"])
    assert set(row["decode"]) == {"1", "2"}
    assert row["decode"]["2"]["tok_s"] == pytest.approx(2 / row["decode"]["2"]["step_median_s"])


def test_random_folder_writes_the_weights_snapcompile_reads(tmp_path, tiny_llama):
    """studies/random_folder.py: a peer's folder of a built-in model holds its weights (in bf16)."""
    import numpy as np
    import torch

    from snapcompile.models import load_model
    tokenizer = tmp_path / "tok"
    tiny_llama.tokenizer.save_pretrained(tokenizer)
    done = _study("random_folder.py", "tiny-llama", tmp_path / "hf", "--tokenizer", tokenizer)
    assert done.returncode == 0, done.stderr
    written = load_model(str(tmp_path / "hf"))
    assert written.tensors.shapes == tiny_llama.tensors.shapes
    for name in written.tensors.shapes:
        bf16 = torch.from_numpy(tiny_llama.tensors.read(name)).to(torch.bfloat16).float().numpy()
        np.testing.assert_array_equal(written.tensors.read(name), bf16)


def test_random_folder_in_float32_keeps_every_value_and_the_model_s_own_tokenizer(tmp_path, tiny_llama):
    import numpy as np

    from snapcompile.models import load_model
    done = _study("random_folder.py", "tiny-llama", tmp_path / "hf", "--dtype", "float32")
    assert done.returncode == 0, done.stderr
    written = load_model(str(tmp_path / "hf"))
    for name in written.tensors.shapes:
        np.testing.assert_array_equal(written.tensors.read(name), tiny_llama.tensors.read(name))
    text = "the pass key is 12345"
    assert written.tokenizer(text)["input_ids"] == tiny_llama.tokenizer(text)["input_ids"]


def test_n_samples_bench_compares_a_shared_prefill_with_separate_requests(tiny_snap_dir):
    """studies/n_samples_bench.py: both runs draw the same samples; the summary line has both times."""
    done = _study("n_samples_bench.py", tiny_snap_dir, "--n", 3, "--prompt-tokens", 200, "--new-tokens", 4,
                  "--rounds", 1)
    assert done.returncode == 0, done.stderr
    assert "3 samples of" in done.stdout and "shared prefill" in done.stdout


def test_prefill_kernels_times_each_kernel_and_a_chunk_by_op(tiny_snap_dir):
    """studies/prefill_kernels.py: every kernel at every weight shape and M, the prompt's projected
    linear-layer seconds, and one chunk's time by op type."""
    done = _study("prefill_kernels.py", tiny_snap_dir, "--graph", "prefill", "--start", 64, "--rows", "8,16",
                  "--blocks", "32", "--prompt-tokens", 64, "--repeats", 2)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    products = [line for line in lines if "kernel" in line]
    assert {line["kernel"] for line in products} == {"nbits4_b32", "qgemm_int8", "sgemm_fp32"}
    assert len(products) == 3 * 4 * 2 and all(line["ms"] > 0 and line["gops"] >= 0 for line in products)
    linear, = [line["linear_s"] for line in lines if "linear_s" in line]
    assert set(linear) == {f"{k} M={m}" for k in ("nbits4_b32", "qgemm_int8", "sgemm_fp32") for m in (8, 16)}
    ops, = [line["chunk_ops"] for line in lines if "chunk_ops" in line]
    assert "Softmax" in ops and all(ms >= 0 for ms in ops.values())


def test_session_cost_reports_every_graph_and_the_synthetic_chains(tiny_snap_dir):
    """studies/graph_cost.py: one line for opening, one per other graph with its node counts, and
    the synthetic chains, where kept nodes cost more than nodes the optimizer removes."""
    done = _study("graph_cost.py", tiny_snap_dir, "--synthetic", "2000")
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [line["graph"] for line in lines if "graph" in line][0] == "open"
    graphs = [line for line in lines if "graph" in line and line["graph"] != "open"]
    assert {line["graph"] for line in graphs} == LAYER_GRAPHS       # decode: made at open
    assert all(line["nodes"] >= line["nodes_optimized"] > 0 for line in graphs)
    chains = {line["synthetic"]: line["added_mib"] for line in lines if "synthetic" in line}
    assert chains["Add"] > chains["Identity"] >= 0


def test_page_release_compares_released_and_kept_pages(tiny_snap_dir):
    """studies/page_release.py: with the release no page of weights.bin stays; without, some do."""
    done = _study("page_release.py", tiny_snap_dir, "--context", 200, "--rounds", 2)
    assert done.returncode == 0, done.stderr
    row = json.loads(done.stdout)
    assert row["weights_rss_kib"]["released"] == [0, 0] and min(row["weights_rss_kib"]["kept"]) > 0
    assert all(len(v) == 2 and min(v) > 0 for v in row["prefill_s"].values()) and row["release_ms"] >= 0


def test_open_phases_times_each_phase_of_opening_in_fresh_processes(tiny_snap_dir):
    """studies/open_phases.py: files, graph checks and sessions (one per ONNX Runtime graph) within the
    whole, for each repeat."""
    done = _study("open_phases.py", tiny_snap_dir, "--repeats", 2)
    assert done.returncode == 0, done.stderr
    row = json.loads(done.stdout)
    assert len(row["runs"]) == 2 and row["files_s"] > 0 and row["sessions_s"] > 0
    assert row["files_s"] + row["graph_checks_s"] + row["sessions_s"] <= row["every_graph_s"]
    assert set(row["runs"][0]["session_s"]) == LAYER_GRAPHS | {"decode"}
