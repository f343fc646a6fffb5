"""Each pass: a positive case, a must-not-match case, and numeric checks against the reference."""
import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime as ort
import pytest
import torch

from snapcompile.artifact.onnx_io import GraphSet
from snapcompile.config import ExportConfig, PolicyConfig
from snapcompile.errors import SnapcompileError
from snapcompile.export import build_dense_graphs
from snapcompile.graphs.builder import GraphBuilder
from snapcompile.graphs.select import SelectionWriter
from snapcompile.models.spec import ModelSpec
from snapcompile.passes.compress_decode import compress_decode
from snapcompile.passes.match import MatchFailure, find_attention_blocks
from snapcompile.passes.pipeline import compress_graphs
from snapcompile.passes.snapkv_prefill import add_window_queries
from snapcompile.reference.policy import snapkv_select

EXPORT = ExportConfig(slots=2, max_context=128, chunk=32)


@pytest.fixture(scope="module")
def dense_graphs(tiny_llama):
    return build_dense_graphs(tiny_llama, EXPORT)[0]


@pytest.mark.parametrize("kind", ["static", "ort"])
def test_matches_every_layer(dense_graphs, kind):
    for name in ("prefill", "decode"):
        blocks = find_attention_blocks(gs.import_onnx(getattr(dense_graphs, kind)[name]), 2, name)
        assert len(blocks) == 2
        assert [b.k_cache.name for b in blocks] == ["past_key.0", "past_key.1"]
        assert blocks[0].scale == pytest.approx(16 ** -0.5)
        assert all(b.joined == (name == "prefill") for b in blocks)


def test_the_passes_rewrite_the_family_graphs_keeping_their_size_symbolic(dense_graphs, tiny_llama):
    """ONNX Runtime's graph of the decode family: the ring cache and write_index sized by "slots";
    its prefill family's window queries, its rows still symbolic."""
    model, report = compress_decode(dense_graphs.ort["decode"], 2, 48)
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    assert dims["past_key.1"] == ["slots", 2, 48, 16] and dims["write_index"] == ["slots"]
    prefill, _ = add_window_queries(dense_graphs.ort["prefill"], tiny_llama.spec, window=8)
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in prefill.graph.input}
    outputs = {o.name: [d.dim_value for d in o.type.tensor_type.shape.dim] for o in prefill.graph.output}
    assert dims["past_key.0"] == [1, 2, "rows", 16] and outputs["window_query.0"] == [1, 4, 8, 16]


def test_decode_passes_refuse_the_joined_prefill_form(dense_graphs):
    with pytest.raises(MatchFailure, match="joined .prefill. attention block, not the split form"):
        compress_decode(dense_graphs.static["prefill"], 2, 32)


def _break_layer(model: onnx.ModelProto, layer: int) -> onnx.ModelProto:
    """Drop the key transpose of one layer's cache scores (a structure the pass must refuse)."""
    broken = onnx.ModelProto()
    broken.CopyFrom(model)
    graph = gs.import_onnx(broken)
    cache_key = [t for t in graph.inputs if t.name == f"past_key.{layer}"][0]
    cache_key.outputs[0].attrs["perm"] = [0, 1, 2, 3]
    return gs.export_onnx(graph)


def test_unmatched_block_is_an_error_naming_it(dense_graphs):
    broken = _break_layer(dense_graphs.static["decode"], 1)
    with pytest.raises(MatchFailure, match=r"matched 1 attention blocks but the model has 2 layers.*Softmax node"):
        compress_decode(broken, 2, 32)


def test_plain_softmax_is_not_attention():
    b = GraphBuilder("plain")
    x = b.input("x", np.float32, [2, 8])
    b.output(b.op("Softmax", x, axis=-1), "y", np.float32, [2, 8])
    with pytest.raises(MatchFailure, match="expected Concat"):
        find_attention_blocks(gs.import_onnx(b.model()), 1, "plain")


def test_compress_decode_reshapes_caches_and_adds_write_index(dense_graphs):
    model, report = compress_decode(dense_graphs.static["decode"], 2, 48)
    assert report == {"pass": "compress_decode", "graph": "decode", "blocks_rewritten": 2, "budget": 48}
    inputs = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    assert inputs["past_key.1"] == [2, 2, 48, 16] and inputs["write_index"] == [2]
    onnx.checker.check_model(model)


def test_ring_mask_hides_the_row_being_overwritten(dense_graphs):
    """Run the rewritten decode graph: a slot's output must not depend on its write row's content."""
    model, _ = compress_decode(dense_graphs.static["decode"], 2, 16)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feeds = {"input_ids": np.array([[5], [9]]), "position": np.array([40, 41]),
             "cache_len": np.array([16, 10]), "write_index": np.array([12, 10])}
    for i in range(2):
        feeds[f"past_key.{i}"] = rng.normal(size=(2, 2, 16, 16)).astype(np.float32)
        feeds[f"past_value.{i}"] = rng.normal(size=(2, 2, 16, 16)).astype(np.float32)
    base = session.run(["logits"], feeds)[0]
    for i in range(2):       # scribble over slot 0's write row and slot 1's unused rows
        feeds[f"past_key.{i}"][0, :, 12] = 50.0
        feeds[f"past_value.{i}"][1, :, 10:] = -50.0
    np.testing.assert_allclose(session.run(["logits"], feeds)[0], base, atol=1e-6)


@pytest.mark.parametrize("biased", [False, True])
def test_attention_a_kv_head_at_a_time_gives_the_batched_blocks_outputs_bit_for_bit(dense_graphs, tiny_llama,
                                                                                     biased):
    """The per-head rewrite of a prefill graph (with the summary rows' per-head bias or without): one
    Softmax a layer and KV head, the heads chained in order, the same logits and K/V bit for bit."""
    from snapcompile.passes.attention_heads import attention_per_head
    from snapcompile.passes.cache_bias import add_cache_bias
    spec, model = tiny_llama.spec, dense_graphs.static["prefill"]
    if biased:
        model, _ = add_cache_bias(model, spec)
    heads, report = attention_per_head(model, spec, "prefill", layers=spec.num_layers)
    assert report["blocks_rewritten"] == spec.num_layers
    assert sum(node.op_type == "Softmax" for node in heads.graph.node) == spec.num_layers * spec.num_kv_heads
    rng = np.random.default_rng(7)
    dims = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    rows, chunk = dims["past_key.0"][2], dims["input_ids"][1]
    feeds = {"input_ids": rng.integers(0, 250, (1, chunk)), "start": np.array([rows // 2]),
             "position": np.array([rows // 2]), "chunk_len": np.array([chunk - 3])}
    for i in range(spec.num_layers):
        for kind in ("key", "value"):
            feeds[f"past_{kind}.{i}"] = rng.normal(size=(1, 2, rows, 16)).astype(np.float32)
        if biased:
            feeds[f"cache_bias.{i}"] = rng.normal(size=(1, 2, rows)).astype(np.float32)
    outputs = [[o.name for o in model.graph.output]] * 2
    ours, theirs = (ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(names, feeds)
                    for m, names in zip((heads, model), outputs))
    for mine, other, name in zip(ours, theirs, outputs[0]):
        assert np.array_equal(mine, other), name


def test_window_query_outputs(dense_graphs, tiny_llama):
    model, report = add_window_queries(dense_graphs.static["prefill"], tiny_llama.spec, window=8)
    assert report["blocks_rewritten"] == 2
    outputs = {o.name: [d.dim_value for d in o.type.tensor_type.shape.dim] for o in model.graph.output}
    assert outputs["window_query.0"] == [1, 4, 8, 16]


def test_compressing_twice_is_refused(dense_graphs, tiny_llama):
    from snapcompile.export import new_manifest
    manifest = new_manifest(tiny_llama, EXPORT, PolicyConfig(policy="dense"))
    policy = PolicyConfig(budget=48, window=8, kernel=5)
    graphs = compress_graphs(GraphSet(dict(dense_graphs.static), dict(dense_graphs.ort)), manifest, policy)
    assert set(graphs.static) == {"prefill", "prefill_64", "prefill_tail", "decode", "decode_1", "select", "select_64"}
    layer_major = {"prefill_embed", "prefill_layer_0", "prefill_layer_1", "prefill_head", "prefill_scores",
                   "select_layer"}
    assert set(graphs.ort) == {"prefill", "prefill_tail", "decode", "select"} | layer_major
    layer = {o.name for o in graphs.ort["prefill_layer_1"].graph.output}
    assert layer == {"key.0", "value.0", "hidden_out", "window_query.0"}
    assert [p["pass"] for p in manifest.passes] == ["compress_decode", "compress_decode", *["add_window_queries"] * 3,
                                                   "snapkv_select", "snapkv_select"]
    assert {p["graph"] for p in manifest.passes if p["pass"] == "compress_decode"} == {"decode", "decode_1"}
    select_64 = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim]
                 for i in graphs.static["select_64"].graph.input}
    assert select_64["key.0"][2] == 64 and graphs.static["select_64"].graph.name == "select_64"
    with pytest.raises(SnapcompileError, match="already compressed"):
        compress_graphs(graphs, manifest, policy)


SPEC = ModelSpec("LlamaForCausalLM", 10, 8, 8, 1, 4, 2, 8, 256, 1e-5, False, False)


def _run_select(policy, query, keys, length, max_context=64):
    model = SelectionWriter(SPEC, policy, max_context).build()
    onnx.checker.check_model(model)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    padded = np.zeros((1, 2, max_context, 8), np.float32)
    padded[0, :, :length] = keys.numpy()
    values = padded * 2
    out = session.run(None, {"prompt_len": np.array([length]), "window_query.0": query.numpy()[None],
                             "key.0": padded, "value.0": values})
    return out    # selected_key, selected_value, selected_index


@pytest.mark.parametrize("pooling, scope", [("max", "head"), ("avg", "head"), ("max", "layer"), ("avg", "layer")])
@pytest.mark.parametrize("length", [30, 47, 64])
def test_selection_graph_equals_reference(pooling, scope, length):
    policy = PolicyConfig(budget=24, sinks=2, window=4, kernel=5, pooling=pooling, scope=scope)
    gen = torch.Generator().manual_seed(length)
    query, keys = torch.randn(4, 4, 8, generator=gen), torch.randn(2, length, 8, generator=gen)
    sel_k, sel_v, index = _run_select(policy, query, keys, length)
    expected = snapkv_select(query, keys, policy, 8 ** -0.5).indices.numpy()
    np.testing.assert_array_equal(index[0], expected)
    np.testing.assert_array_equal(sel_k[0], np.take_along_axis(keys.numpy(), expected[:, :, None], 1))
    np.testing.assert_array_equal(sel_v[0], sel_k[0] * 2)


def test_selection_graph_breaks_ties_to_the_lower_position():
    """All keys equal: every candidate ties, so both sides keep the lowest candidates."""
    policy = PolicyConfig(budget=24, sinks=2, window=4, kernel=1)
    query, keys = torch.ones(4, 4, 8), torch.ones(2, 50, 8)
    index = _run_select(policy, query, keys, 50)[2][0]
    expected = snapkv_select(query, keys, policy, 8 ** -0.5).indices.numpy()
    np.testing.assert_array_equal(index, expected)
    assert index[0].tolist() == list(range(14)) + list(range(46, 50))   # P = 18: 2 sinks, 12 chosen, 4 window


def test_compress_reaches_no_torch():
    """`compress` is a pure ONNX transformation: its modules must not import torch."""
    import subprocess
    import sys
    code = ("import sys, snapcompile.passes.pipeline, snapcompile.graphs.checks, snapcompile.cli; "
            "print('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


@pytest.mark.parametrize("lowering", ["standard", "plugin"])
def test_the_same_convert_twice_gives_byte_identical_files(tmp_path, lowering):
    """Node names are counted per graph, never per process: what was built before changes nothing."""
    from tests.cli_helpers import invoke
    args = ["tiny-llama", "--budget", 64, "--window", 8, "--kernel", 5, "--max-context", 256, "--chunk", 64,
            "--slots", 2, "--lower", lowering]
    for name in ("first", "second"):
        assert invoke("convert", *args, "-o", tmp_path / name).exit_code == 0
    first, second = sorted((tmp_path / "first").iterdir()), sorted((tmp_path / "second").iterdir())
    assert [p.name for p in first] == [p.name for p in second]
    for a, b in zip(first, second):
        assert a.read_bytes() == b.read_bytes(), a.name
