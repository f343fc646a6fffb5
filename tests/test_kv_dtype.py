"""`--kv-dtype float16` (passes/kv_dtype.py): every cache input and output of every graph in float16,
the runtime's caches in float16 (half the bytes, in the memory figure too), each key and value
rounded once where it is stored, and every keep mode working on them."""
from __future__ import annotations

import json
from dataclasses import asdict, replace

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper
from transformers import AutoTokenizer

from snapcompile.artifact.footprint import memory_needed
from snapcompile.artifact.manifest import read_manifest
from snapcompile.cli import main
from snapcompile.config import ExportConfig
from snapcompile.engine.engine import Engine
from snapcompile.engine.request import Request
from snapcompile.errors import SnapcompileError
from snapcompile.passes.kv_dtype import KV_TENSOR, store_kv_in_float16
from snapcompile.runtime.device import drain
from snapcompile.runtime.ort_backend import OrtBackend
from tests.conftest import TINY_EXPORT, TINY_SNAPSTREAM, TINY_SUMMARIES, build_artifact, random_prompts

HALF = replace(TINY_EXPORT, kv_dtype="float16")


@pytest.fixture(scope="module")
def half_snap_dir(tiny_llama, tmp_path_factory):
    return build_artifact(tiny_llama, tmp_path_factory.mktemp("kv16") / "snap", HALF, TINY_SNAPSTREAM)


@pytest.fixture(scope="module")
def half_summary_dir(tiny_llama, tmp_path_factory):
    return build_artifact(tiny_llama, tmp_path_factory.mktemp("kv16") / "summaries", HALF, TINY_SUMMARIES)


def _graph(nodes, inputs, outputs) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def test_the_pass_casts_slices_not_the_whole_input_and_writes_half_outputs_directly():
    """past_key.0 read by two Slices: each slice is cast (not the input); key.0 a Slice of a float16
    input: written without a round trip; value.0 computed: cast. The numbers: the float32 graph's
    on the float16 inputs, rounded once on the way out."""
    f32 = TensorProto.FLOAT
    starts, ends, axes = (helper.make_tensor(n, TensorProto.INT64, [1], [v]) for n, v in
                          (("s", 0), ("e", 2), ("a", 2)))
    model = _graph([helper.make_node("Slice", ["past_key.0", "s", "e", "a"], ["head0"]),
                    helper.make_node("Slice", ["past_key.0", "e", "e2", "a"], ["head1"]),
                    helper.make_node("Mul", ["head0", "head1"], ["value.0"]),
                    helper.make_node("Slice", ["past_key.0", "s", "e", "a"], ["key.0"])],
                   [helper.make_tensor_value_info("past_key.0", f32, [1, 2, 4, 3])],
                   [helper.make_tensor_value_info(n, f32, [1, 2, 2, 3]) for n in ("key.0", "value.0")])
    model.graph.initializer.extend([starts, ends, axes, helper.make_tensor("e2", TensorProto.INT64, [1], [4])])
    half = store_kv_in_float16(model, "toy")
    assert [v.type.tensor_type.elem_type for v in (*half.graph.input, *half.graph.output)] == [TensorProto.FLOAT16] * 3
    ops = [n.op_type for n in half.graph.node]
    assert ops.count("Cast") == 3 and ops.count("Identity") == 1         # two slices, value.0's output
    cache = np.random.default_rng(0).standard_normal((1, 2, 4, 3)).astype(np.float16)
    key, value = ort.InferenceSession(half.SerializeToString()).run(["key.0", "value.0"], {"past_key.0": cache})
    wide = cache.astype(np.float32)
    assert key.dtype == np.float16 and np.array_equal(key, cache[:, :, :2])
    assert np.array_equal(value, (wide[:, :, :2] * wide[:, :, 2:]).astype(np.float16))


def test_every_cache_tensor_of_the_artifact_is_half_and_the_memory_figure_follows(half_snap_dir, tiny_snap_dir):
    half, full = read_manifest(half_snap_dir), read_manifest(tiny_snap_dir)
    assert half.export.kv_dtype == "float16" and "kv_dtype" not in full.export.to_dict()
    cache_io = [(name, io["dtype"]) for entries in (half.graphs, half.ort_graphs) for graph in entries.values()
                for io in (*graph["inputs"], *graph["outputs"]) if KV_TENSOR.fullmatch(name := io["name"])]
    assert cache_io and {dtype for _, dtype in cache_io} == {"float16"}
    assert half.kv_bytes_per_slot() * 2 == full.kv_bytes_per_slot()
    ours, theirs = memory_needed(half), memory_needed(full)
    assert ours["slot_caches"] * 2 == theirs["slot_caches"] and ours["prefill_caches"] < theirs["prefill_caches"]
    backend = OrtBackend(half_snap_dir)
    assert backend.keys[0].dtype == np.float16 and backend.kv_bytes_allocated() == half.kv_bytes_per_slot() * 3


def test_a_prompts_rows_are_the_float32_artifacts_rounded_once(half_snap_dir, tiny_snap_dir):
    """Layer 0's rows depend on the embeddings alone: float16 is the float32 artifact's rows rounded;
    later layers see rounded rows before them, so they are close; the logits close, the selection the
    same here."""
    prompt, = random_prompts([300], seed=16)
    handed = {}
    for name, folder in (("half", half_snap_dir), ("full", tiny_snap_dir)):
        seen = handed[name] = []
        result = drain(OrtBackend(folder).prefill_chunks(0, prompt, rows_to=lambda i, k, v, kept, seen=seen:
                                                         seen.append((k.copy(), v.copy(), kept.copy()))))
        handed[name].append(result.logits)
    (k0, v0, kept0), (f0, g0, fkept0) = handed["half"][0], handed["full"][0]
    assert k0.dtype == np.float16 and np.array_equal(k0, f0.astype(np.float16))
    assert np.array_equal(v0, g0.astype(np.float16)) and np.array_equal(kept0, fkept0)
    for (k, v, _), (f, g, _) in zip(handed["half"][1:-1], handed["full"][1:-1]):
        assert np.allclose(k, f, atol=2e-2, rtol=1e-2) and np.allclose(v, g, atol=2e-2, rtol=1e-2)
    assert np.abs(handed["half"][-1] - handed["full"][-1]).max() < 0.05


def _engine(folder, **kwargs) -> Engine:
    backend = OrtBackend(folder)
    return Engine(backend, AutoTokenizer.from_pretrained(str(folder)), backend.manifest.eos_token_ids, **kwargs)


@pytest.mark.parametrize("fixture, keep", [("half_snap_dir", "full"), ("half_snap_dir", "slot"),
                                           ("half_snap_dir", "quantized"), ("half_summary_dir", "slot")])
def test_every_keep_mode_resumes_a_conversation_from_half_rows(fixture, keep, request):
    """Turn two resumes from the store in each mode; its first token is the one a fresh prefill of the
    whole conversation gives on the float16 artifact (the conversation is short of the budget's
    selection boundary in no mode: the resumed and the fresh turn may differ later, not in kind)."""
    folder = request.getfixturevalue(fixture)
    document, question = random_prompts([300, 20], seed=9)
    engine = _engine(folder, session_cache_bytes=2**26, session_keep=keep)
    first, = engine.generate([Request(document, max_new_tokens=6, ignore_eos=True, cache_partition="u")])
    second, = engine.generate([Request(document + first.output_ids + question, max_new_tokens=6,
                                       ignore_eos=True, cache_partition="u")])
    assert second.cached_tokens > 0 and len(second.output_ids) == 6
    if keep == "full":          # the whole prompt's rows, selected as if prefilled whole: the same tokens
        fresh, = _engine(folder).generate([Request(document + first.output_ids + question, max_new_tokens=6,
                                                   ignore_eos=True)])
        assert second.output_ids == fresh.output_ids


def test_a_full_keep_entry_counts_half_the_bytes(half_snap_dir):
    """An entry larger than the store is refused by its size in the cache's dtype."""
    document, = random_prompts([300], seed=2)
    spec = read_manifest(half_snap_dir).spec
    rows_bytes = 300 * spec.num_layers * spec.num_kv_heads * (2 * spec.head_dim * 2 + 8) + 300 * 8
    for store, kept in ((rows_bytes + 4096, True), (rows_bytes - 4096, False)):
        engine = _engine(half_snap_dir, session_cache_bytes=store, session_keep="full")
        engine.generate([Request(document, max_new_tokens=1, cache_partition="u")])
        assert (engine.sessions.newest() is not None) == kept


def test_the_plugin_lowering_and_compressing_a_half_export_are_refused(tiny_llama, tmp_path):
    with pytest.raises(SnapcompileError, match="needs --lower standard"):
        from snapcompile.compiler.route import compile_artifact
        compile_artifact(tiny_llama, HALF, TINY_SNAPSTREAM, tmp_path / "plugin", lowering="plugin")
    dense = build_artifact(tiny_llama, tmp_path / "dense", HALF)
    done = CliRunner().invoke(main, ["compress", str(dense), "-o", str(tmp_path / "out")])
    assert done.exit_code != 0 and "convert the model with --kv-dtype instead" in done.output
    done = CliRunner().invoke(main, ["convert", "tiny-llama", "--kv-dtype", "int8", "-o", str(tmp_path / "x")])
    assert done.exit_code == 2 and "--kv-dtype" in done.output


def test_a_dense_half_artifact_runs_close_to_the_float32_one(tiny_llama, tmp_path):
    """The dense graphs' caches (slots and bucket copies) in float16 too."""
    prompt, = random_prompts([200], seed=5)
    logits = {}
    for name, export in (("half", HALF), ("full", TINY_EXPORT)):
        backend = OrtBackend(build_artifact(tiny_llama, tmp_path / name, export))
        logits[name] = backend.prefill(0, prompt).logits
    assert np.abs(logits["half"] - logits["full"]).max() < 0.05


def test_the_config_rejects_an_unknown_kv_dtype():
    with pytest.raises(SnapcompileError, match="unknown --kv-dtype 'bfloat16'"):
        ExportConfig(kv_dtype="bfloat16")


def test_eval_builds_half_artifacts_against_a_float32_reference():
    """`eval --kv-dtype float16`: every artifact evaluated stores float16, fidelity's dense reference
    float32, the report's heading says which, and results of the two never mix."""
    from snapcompile.evaluation.config import EvalConfig
    from snapcompile.evaluation.partial_results import _differing_fields
    from snapcompile.evaluation.report import heading
    config = EvalConfig("tiny-llama", "fidelity", ("dense", "snapstream"), (300,), (1000,), (0.5,), 1, seed=0,
                        kv_dtype="float16")
    assert config.export.kv_dtype == "float16" and config.reference_export.kv_dtype == "float32"
    assert "float16 KV cache" in heading(config) and "KV cache" not in heading(replace(config, kv_dtype="float32"))
    older = json.loads(json.dumps(asdict(replace(config, kv_dtype="float32"))))
    assert _differing_fields(older, config) == ["kv_dtype"]
    del older["kv_dtype"]                       # records written before --kv-dtype: float32
    assert _differing_fields(older, replace(config, kv_dtype="float32")) == []
