"""Benchmark plumbing on tiny-llama (figures are measured, so only their structure is asserted)."""
import gc
import json

import numpy as np
import pytest
from click.testing import CliRunner

from snapcompile.bench import machine
from snapcompile.bench.report import markdown
from snapcompile.bench.runner import BenchConfig, run_bench
from snapcompile.cli import main
from snapcompile.errors import SnapcompileError
from tests.cli_helpers import assert_one_line_error, invoke


def test_rss_counts_touched_memory_and_the_peak_outlives_it():
    gc.collect()              # else a collection inside the window may free an earlier test's arrays
    before = machine.rss_bytes()
    machine.reset_peak_rss()
    block = np.ones(256 * 2**20 // 8)                 # 256 MiB, every page touched
    grown = machine.rss_bytes() - before
    del block
    assert 240 * 2**20 <= grown <= 300 * 2**20
    assert machine.peak_rss_bytes() - machine.rss_bytes() >= 240 * 2**20, "the peak keeps the freed block"


class FakeClock:
    """perf_counter advancing `step` seconds per call: each timed call lasts exactly `step`."""

    def __init__(self, step):
        self.now, self.step = 0.0, step

    def __call__(self):
        self.now += self.step
        return self.now


def test_bandwidth_and_flops_are_bytes_and_flops_per_second(monkeypatch):
    monkeypatch.setattr(machine.time, "perf_counter", FakeClock(0.01))
    assert machine.memory_bandwidth(megabytes=8, repeats=2) == pytest.approx(2 * 8 * 2**20 / 0.01)  # read + written
    assert machine.memory_read_bandwidth(megabytes=8, repeats=2) == pytest.approx(8 * 2**20 / 0.01)  # read only
    assert machine.matmul_flops(size=64, repeats=2) == pytest.approx(2 * 64**3 / 0.01)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    config = BenchConfig("tiny-llama", contexts=(256, 512), slots=(1, 3), budget=128, new_tokens=4, repeats=2)
    return run_bench(config, tmp_path_factory.mktemp("bench"), log=lambda m: None)


def test_every_point_measures_three_systems(result):
    assert [(p["context"], p["slots"]) for p in result["points"]] == [(256, 1), (512, 1), (256, 3), (512, 3)]
    for point in result["points"]:
        assert set(point["systems"]) == {"snapstream", "dense", "eager"}
        for figures in point["systems"].values():
            stats = figures["tokens_per_s"]
            assert 0 < stats["min"] <= stats["median"] <= stats["max"]
            assert figures["bytes_per_step"] > result["weight_bytes"]
            assert figures["bound_ms"] == max(figures["memory_bound_ms"], figures["compute_bound_ms"])
            assert figures["bound"] in ("memory", "compute") and 0 < figures["fraction_of_bound"]
        rates = {name: point["systems"][name]["tokens_per_s"]["median"] for name in ("snapstream", "dense")}
        assert point["ratios"]["snapstream_vs_dense"] == pytest.approx(rates["snapstream"] / rates["dense"])
        assert 0.0 <= point["prefill"]["snapstream"]["selection_share"] < 1.0


def test_kv_bytes_per_slot_is_budget_over_context(result):
    per_token = result["kv_bytes_per_token"]
    for point in result["points"]:
        assert point["systems"]["snapstream"]["kv_bytes_per_slot"] == 128 * per_token
        assert point["systems"]["dense"]["kv_bytes_per_slot"] == (point["context"] + 4 + 1) * per_token


def test_memory_fit_favours_the_budget(result):
    for row in result["fits"]:
        assert row["snapstream_max_slots"] == pytest.approx(row["dense_max_slots"] * row["context"] / 128, rel=0.01)


def test_markdown_table(result):
    table = markdown(result)
    assert table.count("\n| 256 |") == 2 and "snap/eager" in table and "GB/s" in table
    cpu = result["cpu"]          # every figure names the CPU it was measured on
    assert cpu["cores"] >= 1 and isinstance(cpu["isa"], list) and len(cpu["load"]) == 3
    assert f"CPU: {cpu['model']}" in table and " ".join(cpu["isa"]) in table


def test_one_quantized_format_alone_is_the_reference(tmp_path):
    """bench --weights int4: no fp32 artifact is built; the table and ratios are int4's own."""
    config = BenchConfig("tiny-llama", contexts=(128,), slots=(2,), budget=64, new_tokens=4, repeats=1,
                         eager=False, weight_formats=("int4",))
    result = run_bench(config, tmp_path, log=lambda m: None)
    point = result["points"][0]
    assert set(point["systems"]) == {"snapstream-int4", "dense-int4"}
    assert point["ratios"]["snapstream_vs_dense"] == pytest.approx(
        point["systems"]["snapstream-int4"]["tokens_per_s"]["median"]
        / point["systems"]["dense-int4"]["tokens_per_s"]["median"])
    assert point["systems"]["snapstream-int4"]["fraction_of_bound"] > 0
    assert "| snapstream-int4 tok/s | dense-int4 tok/s |" in markdown(result)
    assert result["read_bandwidth_bytes_per_s"] > 0


def test_bench_cli_and_bad_input(tmp_path):
    out = tmp_path / "b.json"
    ok = CliRunner().invoke(main, ["bench", "tiny-llama", "--contexts", "128", "--slots", "2", "--budget", "64",
                                   "--new-tokens", "3", "--repeats", "1", "--no-eager", "--cache-dir",
                                   str(tmp_path / "c"), "-o", str(out)])
    assert ok.exit_code == 0, ok.output
    payload = json.loads(out.read_text())
    assert "eager" not in payload["points"][0]["systems"] and payload["resumed_points"] == 0
    assert not (tmp_path / "b.json.partial.jsonl").exists(), "the points are in the results file now"
    assert (tmp_path / "b-decode.png").is_file() and (tmp_path / "b-memory.png").is_file()
    bad = CliRunner().invoke(main, ["bench", "tiny-llama", "--contexts", "10", "-o", str(out)])
    assert bad.exit_code == 2 and "--contexts" in bad.output
    with pytest.raises(SnapcompileError):
        BenchConfig("tiny-llama", budget=8)


def test_eager_points_over_the_memory_limit_are_skipped(tmp_path):
    config = BenchConfig("tiny-llama", contexts=(256,), slots=(2,), budget=128, new_tokens=3, repeats=1,
                         eager_kv_limit_gib=1e-6, prefill_repeats=1)
    messages = []
    result = run_bench(config, tmp_path, log=messages.append)
    point = result["points"][0]
    assert "eager" not in point["systems"] and point["ratios"]["snapstream_vs_eager"] is None
    assert any("eager skipped" in m for m in messages)
    assert "skipped (memory)" in markdown(result)


def test_contexts_beyond_the_models_positions_are_refused(tmp_path):
    config = BenchConfig("tiny-llama", contexts=(4090,), slots=(1,), budget=128, new_tokens=8, repeats=1)
    with pytest.raises(SnapcompileError, match="exceeds the model's 4096 positions"):
        run_bench(config, tmp_path, log=lambda m: None)


def test_weight_formats_and_onnx_runtime_genai_peers(tiny_hf_dir, tmp_path):
    """bench --weights fp32,int4 --peers int4: every system at every point, ratios against fp32
    snapstream and the peer, the peer built once by ONNX Runtime GenAI's builder and cached."""
    config = BenchConfig(str(tiny_hf_dir), contexts=(128,), slots=(1, 2), budget=64, new_tokens=4, repeats=1,
                         eager=False, weight_formats=("fp32", "int4"), peers=("int4",))
    result = run_bench(config, tmp_path, log=lambda m: None)
    for point in result["points"]:
        assert set(point["systems"]) == {"snapstream", "dense", "snapstream-int4", "dense-int4", "ortgenai-int4"}
        assert point["systems"]["ortgenai-int4"]["tokens_per_s"]["median"] > 0
        assert {"snapstream-int4_vs_snapstream", "snapstream-int4_vs_ortgenai-int4"} <= set(point["ratios"])
        assert "fraction_of_bound" in point["systems"]["snapstream-int4"]
    assert result["step_weight_bytes"]["snapstream-int4"] < result["step_weight_bytes"]["snapstream"]
    assert "snapstream-int4 / ortgenai-int4" in markdown(result)
    assert len(list((tmp_path / "peers").glob("ortgenai-int4-*"))) == 1
    with pytest.raises(SnapcompileError, match="unknown --peers precision 'int2'"):
        BenchConfig("tiny-llama", peers=("int2",))
    with pytest.raises(SnapcompileError, match="--peers needs a model loaded from a Hugging Face folder"):
        run_bench(BenchConfig("tiny-llama", contexts=(128,), slots=(1,), budget=64, peers=("int4",)), tmp_path)


def test_a_killed_bench_resumes_from_its_finished_points(tmp_path):
    from snapcompile.bench.partial_points import PointStore, partial_path
    config = BenchConfig("tiny-llama", contexts=(128, 256), slots=(2,), budget=64, new_tokens=4, repeats=1,
                         eager=False)
    output = tmp_path / "bench.json"

    class Killed(Exception):
        pass

    def kill_after_first(advance):
        raise Killed
    with pytest.raises(Killed):
        run_bench(config, tmp_path / "cache", progress=kill_after_first, log=lambda m: None,
                  store=PointStore(output, config))
    with open(partial_path(output), "a") as handle:
        handle.write('{"kind": "point", "slo')            # the line being written when it was killed
    result = run_bench(config, tmp_path / "cache", log=lambda m: None, store=PointStore(output, config))
    assert result["resumed_points"] == 1 and [p["context"] for p in result["points"]] == [128, 256]
    first = PointStore(output, config).points[(2, 128)]["point"]
    assert result["points"][0]["systems"]["snapstream"]["step_ms"] == first["systems"]["snapstream"]["step_ms"]
    assert all("prefill" in point and "ratios" in point for point in result["points"])
    other = BenchConfig("tiny-llama", contexts=(128, 256), slots=(2,), budget=96, new_tokens=4, repeats=1,
                        eager=False)
    with pytest.raises(SnapcompileError, match="another bench configuration"):
        PointStore(output, other)




def test_bench_measures_the_backend_s_choice_of_graphs_on_an_artifact(tiny_snap_dir):
    """--measure decode-slots: the bucket graph the backend picks against the N-slot graph per active
    count; --measure prefill-schedules: the causal chunk schedule against the prompt's own bucket."""
    decode = invoke("bench", tiny_snap_dir, "--measure", "decode-slots", "--slots", "1,2,3,9", "--contexts", 100,
                    "--new-tokens", 2, "--repeats", 1, "--json")
    rows = json.loads(decode.output)["rows"]
    assert [(r["active"], r["graph_slots"], r["full_slots"]) for r in rows] == [(1, 1, 3), (2, 2, 3), (3, 3, 3)]
    assert all(r["bucket_ms"] > 0 and r["full_ms"] > 0 for r in rows)
    prefill = invoke("bench", tiny_snap_dir, "--measure", "prefill-schedules", "--contexts", 300, "--repeats", 2,
                     "--json")
    rows = json.loads(prefill.output)["rows"]
    assert [r["schedule"] for r in rows] == ["causal", "whole-prompt"]
    assert all(0 < r["min_s"] <= r["median_s"] <= r["max_s"] and r["length"] == 300 for r in rows)
    assert_one_line_error(invoke("bench", "tiny-llama", "--measure", "decode-slots"), "runs on an artifact folder")
    assert_one_line_error(invoke("bench", tiny_snap_dir, "--measure", "prefill-schedules", "--contexts", 600),
                          "does not fit")


def test_the_whole_prompt_schedule_runs_every_chunk_on_the_prompt_s_bucket(tiny_dense_dir):
    from snapcompile.bench.graph_choice import _whole_prompt
    from snapcompile.runtime.ort_backend import OrtBackend
    backend = OrtBackend(tiny_dense_dir)
    with _whole_prompt(backend, 300):
        assert {backend.chunk_rows(start) for start in (0, 64, 256)} == {backend.prefill_rows(300)}
    assert backend.chunk_rows(0) < backend.prefill_rows(300)


def test_a_one_point_log_plot_gets_labelled_y_values():
    """bench's plots with one context (or values within a decade) label the y axis at the values:
    matplotlib puts no labelled tick on a log axis narrower than a decade."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from snapcompile.bench.report import label_narrow_log_axis
    fig, (one, many, wide) = plt.subplots(1, 3)
    for ax, values in ((one, [57.3]), (many, list(range(20, 31))), (wide, [1.0, 500.0])):
        ax.plot(range(len(values)), values)
        ax.set(yscale="log")
        label_narrow_log_axis(ax, values)
    fig.canvas.draw()
    assert [t.get_text() for t in one.get_yticklabels()] == ["57.3"]
    assert len(many.get_yticks()) == 6 and many.get_yticklabels()[0].get_text() == "20"
    assert "57.3" not in [t.get_text() for t in wide.get_yticklabels()]      # a wide axis keeps its own ticks
    plt.close(fig)
