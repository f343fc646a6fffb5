"""Graphs made at their first run (runtime/device.LazyGraph): opening an artifact makes only the
smallest decode graph (every weight converted and pre-packed there), a request makes only the graphs
it runs, `make_graphs` makes the rest with the same bindings, and `run` says what making them took."""
import json

import numpy as np
import pytest

from snapcompile.artifact.files import artifact_tokenizer
from snapcompile.engine.engine import Engine
from snapcompile.engine.request import Request
from snapcompile.runtime.device import LazyGraph
from snapcompile.runtime.ort_backend import OrtBackend
from tests.conftest import random_prompts


class RecordingGraph:
    def __init__(self):
        self.binds, self.runs = [], 0

    def bind(self, name, array, output=False):
        self.binds.append((name, array, output))

    def run(self):
        self.runs += 1


class RecordingDevice:
    def __init__(self):
        self.made = []

    def graph(self, name, manifest):
        self.made.append(RecordingGraph())
        return self.made[-1]


def test_binds_before_the_graph_exists_are_made_on_it_the_latest_for_each_name():
    device = RecordingDevice()
    graph = LazyGraph(device, "prefill_128", manifest=None)
    first, second, out = np.zeros(2), np.ones(2), np.zeros(3)
    graph.bind("input_ids", first)
    graph.bind("logits", out, output=True)
    graph.bind("input_ids", second)                     # rebound before the graph exists
    assert device.made == []
    graph.run()
    graph.run()
    [made] = device.made
    assert [(name, array is second or array is out, output) for name, array, output in made.binds] == [
        ("logits", True, True), ("input_ids", True, False)]
    assert made.runs == 2
    graph.bind("position", first)                       # after: straight onto the graph
    assert made.binds[-1] == ("position", first, False) and len(device.made) == 1


def _made(backend) -> set[str]:
    graphs = [*backend.decode_graphs.values(), *backend.prefills.graphs()]
    return {g.name for g in graphs if g.graph is not None}


def _generate(backend, prompts):
    m = backend.manifest
    engine = Engine(backend, artifact_tokenizer(backend.folder, m), m.eos_token_ids, session_cache_bytes=0)
    done = engine.generate([Request(p, max_new_tokens=6, ignore_eos=True) for p in prompts])
    return [r.output_ids for r in done]


def _layers(rows: int) -> set[str]:
    return {f"prefill_layer_0_{rows}", f"prefill_layer_1_{rows}"}


SHORT_PROMPT_GRAPHS = {"layers": {"prefill_embed", *_layers(128), "prefill_head"}, "chunks": {"prefill_128"}}
LONG_PROMPT_GRAPHS = {"layers": SHORT_PROMPT_GRAPHS["layers"] | _layers(256) | {"select_layer_256", "select_layer_384"},
                      "chunks": {"prefill_128", "prefill_256", "select_256", "select_384"}}


@pytest.mark.parametrize("order", ["layers", "chunks"])
def test_opening_makes_one_graph_and_a_short_prompt_makes_only_those_it_runs(tiny_snap_dir, order):
    """tiny_snap_dir: 3 slots, max_context 512, buckets of 128..384 rows, budget 64."""
    lazy = OrtBackend(tiny_snap_dir, prefill_order=order)
    assert _made(lazy) == {"decode_1"} and lazy.graphs_made_on_use() == (0, 0)
    prompt = random_prompts([20], seed=3)
    short = _generate(lazy, prompt)
    assert _made(lazy) == SHORT_PROMPT_GRAPHS[order] | {"decode_1"}
    count, seconds = lazy.graphs_made_on_use()
    assert count == len(SHORT_PROMPT_GRAPHS[order]) and seconds > 0
    eager = OrtBackend(tiny_snap_dir, prefill_order=order)
    eager.make_graphs()
    assert _made(eager) == {g.name for g in eager.prefills.graphs()} | {"decode_1", "decode_2", "decode"}
    if order == "chunks":
        assert _made(eager) == set(eager.manifest.graphs) - {"prefill_tail"}
    assert _generate(eager, prompt) == short
    long = random_prompts([300, 200], seed=4)     # compressed: chunks over up to 256 rows, selections over 384, 256
    assert _generate(lazy, long) == _generate(eager, long)
    assert _made(lazy) == LONG_PROMPT_GRAPHS[order] | {"decode_1", "decode_2"}


def test_run_reports_the_graphs_made_at_first_use(tiny_snap_dir):
    """Their making is part of the TTFT and step times `run` prints, so it says so."""
    from click.testing import CliRunner

    from snapcompile.cli import main
    args = ["run", str(tiny_snap_dir), "--prompt", "hi", "--max-new-tokens", "3"]
    summary = json.loads(CliRunner().invoke(main, [*args, "--json"]).output.strip().splitlines()[-1])["summary"]
    made = len(SHORT_PROMPT_GRAPHS["layers"])          # a layer-by-layer artifact's prefill of a short prompt
    assert summary["graphs_made_on_use"] == made and summary["graphs_made_on_use_s"] > 0
    assert f"| {made} graphs made at first use in " in CliRunner().invoke(main, args).output
