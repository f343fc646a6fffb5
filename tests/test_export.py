import json
import time

import numpy as np
import onnx
import onnx.external_data_helper
import pytest
from hypothesis import given
from hypothesis import strategies as st

from snapcompile.artifact.manifest import MANIFEST, read_manifest
from snapcompile.config import ExportConfig
from snapcompile.errors import SnapcompileError
from snapcompile.export import export_model


def _static_dims(model):
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    values = list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output)
    return [(v.name, d) for v in values for d in v.type.tensor_type.shape.dim]


def test_artifact_layout_and_manifest(tiny_dense_dir):
    names = {p.name for p in tiny_dense_dir.iterdir()}
    assert {"prefill.onnx", "decode.onnx", "weights.bin", MANIFEST, "tokenizer.json"} <= names
    manifest = json.loads((tiny_dense_dir / MANIFEST).read_text())
    assert manifest["export"] == {"slots": 3, "max_context": 512, "chunk": 64, "weight_format": "fp32",
                                  "block_size": 32, "slot_buckets": True, "tail": 32}
    assert manifest["weights_report"]["format"] == "fp32" and manifest["weights_file"] == "weights.bin"
    assert manifest["policy"]["policy"] == "dense"
    assert {"onnx", "onnxruntime", "torch", "transformers"} <= set(manifest["versions"])
    decode_inputs = {i["name"]: i["shape"] for i in manifest["graphs"]["decode"]["inputs"]}
    assert decode_inputs["input_ids"] == [3, 1]
    assert decode_inputs["past_key.0"] == [3, 2, 512, 16]
    assert decode_inputs["position"] == [3] and decode_inputs["cache_len"] == [3]


def test_decode_graph_has_no_symbolic_dimension(tiny_dense_dir):
    model = onnx.load(str(tiny_dense_dir / "decode.onnx"))
    onnx.checker.check_model(str(tiny_dense_dir / "decode.onnx"))
    dims = _static_dims(model)
    assert dims, "shape inference produced shapes"
    assert all(d.HasField("dim_value") for _, d in dims), [n for n, d in dims if not d.HasField("dim_value")]


def test_weights_are_stored_once(tiny_dense_dir, tiny_llama):
    sizes = [p.numel() * 4 for p in tiny_llama.model.parameters()]
    external = sum(size for size in sizes if size >= 1024)     # smaller tensors stay in the graphs
    size = (tiny_dense_dir / "weights.bin").stat().st_size
    assert external <= size < sum(sizes) * 1.1
    for graph in ("prefill.onnx", "prefill_128.onnx", "prefill_256.onnx", "decode.onnx"):
        assert (tiny_dense_dir / graph).stat().st_size < 100_000


@given(chunk=st.integers(1, 512), max_context=st.integers(2, 40_000))
def test_prefill_buckets_hold_whole_chunks_and_leave_no_gap_wider_than_a_step(chunk, max_context):
    if chunk > max_context:
        return
    buckets = ExportConfig(chunk=chunk, max_context=max_context, tail=0).prefill_buckets()
    step = max(2 * chunk, -(-max_context // (8 * chunk)) * chunk)
    assert buckets == sorted(set(buckets)) and all(b % chunk == 0 and 2 * chunk <= b < max_context for b in buckets)
    for below, above in zip([0, *buckets], [*buckets, max_context]):
        assert above - below <= max(below, 2 * chunk, step + step // 2), (below, above)
    assert len(buckets) <= 8 + max(0, (step // 2 // chunk).bit_length())


def test_prefill_buckets_double_then_step_by_an_eighth_of_max_context(tiny_dense_dir):
    assert ExportConfig(max_context=8224, chunk=256).prefill_buckets() == [512, 1280, 2560, 3840, 5120, 6400]
    assert ExportConfig(max_context=4320, chunk=64).prefill_buckets() == [128, 256, 576, 1152, 1728, 2304,
                                                                          2880, 3456, 4032]
    assert ExportConfig(max_context=512, chunk=256).prefill_buckets() == []
    from snapcompile.artifact.naming import bucket_rows, is_prefill_graph
    assert [bucket_rows(n) for n in ("prefill_128", "prefill", "decode", "select")] == [128, None, None, None]
    assert [is_prefill_graph(n) for n in ("prefill", "prefill_128", "prefill_tail", "decode")] == [True, True,
                                                                                                 True, False]
    manifest = read_manifest(tiny_dense_dir)
    assert sorted(manifest.graphs) == ["decode", "decode_1", "decode_2", "prefill", "prefill_128", "prefill_256",
                                       "prefill_384", "prefill_tail"]
    inputs = {name: {i["name"]: i["shape"] for i in manifest.graphs[name]["inputs"]} for name in manifest.graphs}
    assert inputs["prefill_128"]["past_key.0"] == [1, 2, 128, 16]
    assert inputs["prefill_tail"]["past_key.0"] == [1, 2, 512, 16] and inputs["prefill_tail"]["input_ids"] == [1, 32]


def test_each_chunk_runs_on_the_smallest_bucket_that_holds_the_rows_filled_so_far(tiny_dense_dir):
    """Chunks follow the causal triangle in bucket steps; the result equals the full graph's."""
    from snapcompile.runtime.backend import chunk_starts
    from snapcompile.runtime.ort_backend import OrtBackend
    from tests.conftest import random_prompts
    backend = OrtBackend(tiny_dense_dir)
    assert [backend.prefill_rows(n) for n in (1, 128, 129, 256, 257, 385, 511)] == [128, 128, 256, 256, 384, 512, 512]
    assert [backend.chunk_rows(s) for s in chunk_starts(500, 64)] == [128, 128, 128, 256, 256, 384, 384, 512]
    full_only = OrtBackend(tiny_dense_dir)
    full_only.prefills.bucket_graphs = {}                      # as an artifact exported without buckets
    for length in (200, 500):                           # ends on a bucket; crosses both into the full graph
        prompt = random_prompts([length], seed=length)[0]
        on_buckets, on_full = backend.prefill(0, prompt).logits, full_only.prefill(0, prompt).logits
        np.testing.assert_allclose(on_buckets, on_full, atol=1e-5)
        for i in (0, 1):
            np.testing.assert_allclose(backend.keys[i][0, :, :length], full_only.keys[i][0, :, :length], atol=1e-5)
            np.testing.assert_allclose(backend.values[i][0, :, :length], full_only.values[i][0, :, :length],
                                       atol=1e-5)


def test_existing_output_needs_force(tiny_llama, tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(SnapcompileError, match="already exists"):
        export_model(tiny_llama, ExportConfig(max_context=128, chunk=32), tmp_path / "out")


def test_failed_export_leaves_nothing(tiny_llama, tmp_path):
    def explode(graphs, manifest):
        raise RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        export_model(tiny_llama, ExportConfig(max_context=128, chunk=32), tmp_path / "out", transform=explode)
    assert list(tmp_path.iterdir()) == []


def test_force_replaces_atomically(tiny_llama, tmp_path):
    out = tmp_path / "out"
    export_model(tiny_llama, ExportConfig(max_context=128, chunk=32), out)
    export_model(tiny_llama, ExportConfig(max_context=256, chunk=32), out, force=True)
    assert read_manifest(out).export.max_context == 256
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_context_beyond_model_positions_is_rejected(tiny_llama, tmp_path):
    with pytest.raises(SnapcompileError, match="exceeds the model's 4096 positions"):
        export_model(tiny_llama, ExportConfig(max_context=8192, chunk=32), tmp_path / "out")


def test_prefill_logits_are_for_the_last_valid_token(tiny_dense_dir, tiny_llama):
    import torch

    from snapcompile.runtime.ort_backend import OrtBackend
    backend = OrtBackend(tiny_dense_dir)
    prompt = list(range(40, 50))                          # 10 tokens in a 64-token chunk: padding follows
    logits = backend.prefill(0, prompt).logits
    assert logits.shape == (read_manifest(tiny_dense_dir).spec.vocab_size,)
    with torch.no_grad():
        expected = tiny_llama.model(torch.tensor([prompt])).logits[0].numpy()
    np.testing.assert_allclose(logits, expected[-1], atol=1e-4)
    assert np.abs(logits - expected[-2]).max() > 0.1, "not another position's logits"


def test_graphs_with_same_named_constants_keep_their_own_data(tmp_path):
    """Generated constant names repeat across graphs; only identical tensors may share bytes."""
    from snapcompile.artifact.manifest import Manifest
    from snapcompile.artifact.onnx_io import GraphSet, save_graphs
    from snapcompile.config import PolicyConfig
    from snapcompile.graphs.builder import GraphBuilder
    from snapcompile.models.spec import ModelSpec

    def graph(fill):
        b = GraphBuilder("g")
        x = b.input("x", np.float32, [512])
        b.output(b.op("Add", x, b.const(np.full(512, fill, np.float32), np.float32)), "y", np.float32, [512])
        return b.model()
    spec = ModelSpec("LlamaForCausalLM", 10, 8, 8, 1, 1, 1, 8, 64, 1e-5, False, False)
    manifest = Manifest("m", spec, ExportConfig(max_context=64, chunk=8), PolicyConfig(policy="dense"))
    save_graphs(tmp_path, GraphSet({"a": graph(1.0), "b": graph(2.0)}), manifest)
    import onnxruntime as ort
    for name, fill in (("a", 1.0), ("b", 2.0)):
        session = ort.InferenceSession(str(tmp_path / f"{name}.onnx"), providers=["CPUExecutionProvider"])
        np.testing.assert_array_equal(session.run(None, {"x": np.zeros(512, np.float32)})[0], fill)


PEAK_RSS_SCRIPT = """
import resource, sys
from snapcompile.cli import main
try:
    main(sys.argv[1:], standalone_mode=False)
finally:
    print("PEAK_KIB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def _convert_peak_rss(model_dir, out, *args) -> int:
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", PEAK_RSS_SCRIPT, "convert", str(model_dir), "-o", str(out),
                           "--chunk", "64", "--budget", "64", *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout.split("PEAK_KIB")[-1]) * 1024


def test_convert_memory_does_not_grow_with_slots_and_context(tmp_path):
    """The weights go to weights.bin while each graph is built: 8x the slots and 16x the context
    (8 more bucket graphs) cost well under one copy of the weights (each graph used to hold one)."""
    folder, weight_bytes = _bigger_hf_folder(tmp_path, 512, 2048)                  # ~35 MB
    small = _convert_peak_rss(folder, tmp_path / "small", "--slots", "1", "--max-context", "256")
    large = _convert_peak_rss(folder, tmp_path / "large", "--slots", "8", "--max-context", "4096")
    assert large - small < weight_bytes, (small, large, weight_bytes)


def test_export_memory_does_not_grow_with_the_model(tmp_path):
    """Tensors are read, converted and written one at a time: a model 4x deeper (12 more layers, bf16 in
    the file, +190 MB in float32) costs a few tensors more to convert, not the model (which export
    used to load whole in float32, then hold in graph layout: growth > 2 x 190 MB)."""
    args = ("--weights", "int4", "--slots", "1", "--max-context", "256")
    shallow, shallow_bytes = _bigger_hf_folder(tmp_path, 512, 2048, layers=4, dtype="bfloat16", name="shallow")
    deep, deep_bytes = _bigger_hf_folder(tmp_path, 512, 2048, layers=16, dtype="bfloat16", name="deep")
    small = _convert_peak_rss(shallow, tmp_path / "a", *args)
    large = _convert_peak_rss(deep, tmp_path / "b", *args)
    added = deep_bytes - shallow_bytes
    assert large - small < added / 4, (small, large, added)


OPEN_RSS_SCRIPT = """
import sys
from snapcompile.bench.machine import rss_bytes
from snapcompile.runtime.ort_capi import c_api
from snapcompile.runtime.ort_backend import OrtBackend
c_api()
before = rss_bytes()
backend = OrtBackend(sys.argv[1])
print("GROWTH", rss_bytes() - before, len(backend.manifest.graphs))
"""


def _bigger_hf_folder(tmp_path, hidden: int, intermediate: int, layers: int = 2, dtype: str = "float32",
                      name: str = "hf"):
    """tiny-llama's layers at a larger width (random weights, `dtype` in the file), written as a Hugging
    Face folder; returns the folder and the model's float32 bytes."""
    import json

    import torch
    from safetensors.torch import save_file

    from snapcompile.models.loader import _tiny_config
    from snapcompile.models.tensors import RandomSource, expected_shapes
    from snapcompile.models.tokenizer import byte_tokenizer
    config = _tiny_config("tiny-llama")
    config.hidden_size, config.intermediate_size, config.head_dim = hidden, intermediate, 128
    config.num_hidden_layers = layers
    source = RandomSource(expected_shapes(config), seed=7, std=0.05)
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config.to_dict() | {"architectures": ["LlamaForCausalLM"]}))
    tensors = {n: torch.from_numpy(source.read(n)).to(getattr(torch, dtype)) for n in source.shapes}
    save_file(tensors, str(folder / "model.safetensors"))
    byte_tokenizer().save_pretrained(folder)
    return folder, 4 * sum(t.numel() for t in tensors.values())


@pytest.mark.parametrize("weights, copies", [("int4", 2), ("fp16", 3)])
def test_opening_many_graphs_costs_one_copy_of_the_weights(tmp_path, weights, copies):
    """An artifact with 29 graphs (decode slot buckets, prefill and select buckets, tail): all its
    sessions share one pre-packed copy of the weights, so opening it costs about the weights
    twice (weights.bin's view and the packed copy; fp16: the packed copy is float32, twice the
    file) plus a few MiB a session, not a copy a graph (before: int4 0.56 GiB growth for 18 MiB of
    weights, ~19 MiB a graph; fp16 folded a float32 copy into every session, ~2x the file each)."""
    import subprocess
    import sys
    folder, _ = _bigger_hf_folder(tmp_path, 1024, 4096)
    out = tmp_path / weights
    _convert_peak_rss(folder, out, "--weights", weights, "--slots", "8", "--max-context", "4096")
    done = subprocess.run([sys.executable, "-c", OPEN_RSS_SCRIPT, str(out)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    growth, graphs = map(int, done.stdout.split("GROWTH")[-1].split())
    weight_bytes = (out / "weights.bin").stat().st_size
    assert graphs >= 25
    assert growth < copies * weight_bytes + graphs * 6 * 2**20, (growth, weight_bytes, graphs)


@pytest.mark.parametrize("filled", [0, 5, 40])
def test_joined_attention_is_causal_gqa_over_the_filled_rows_and_the_chunk(filled):
    """The prefill form (cache and chunk K/V concatenated) equals attention computed in numpy: query
    head kv * G + g of chunk token t reads the first `filled` cache rows and chunk tokens <= t."""
    import onnxruntime as ort

    from snapcompile.graphs.attention import emit_joined_attention, joined_mask
    from snapcompile.graphs.builder import GraphBuilder
    hkv, g, c, rows, d = 2, 3, 8, 48, 16
    rng = np.random.default_rng(filled)
    q = rng.standard_normal((1, hkv, g, c, d), dtype=np.float32)
    kn, vn = (rng.standard_normal((1, hkv, c, d), dtype=np.float32) for _ in range(2))
    kc, vc = (rng.standard_normal((1, hkv, rows, d), dtype=np.float32) for _ in range(2))
    b = GraphBuilder("attention")
    inputs = {name: b.input(name, np.float32, list(value.shape))
              for name, value in (("q", q), ("kn", kn), ("vn", vn), ("kc", kc), ("vc", vc))}
    visible = b.op("Less", b.const(np.arange(rows)), b.input("start", np.int64, [1]))
    out = emit_joined_attention(b, *inputs.values(), joined_mask(b, visible, rows, c), d ** -0.5)
    b.output(out, "out", np.float32, [1, hkv, g, c, d])
    session = ort.InferenceSession(b.model().SerializeToString(), providers=["CPUExecutionProvider"])
    ours = session.run(None, {"q": q, "kn": kn, "vn": vn, "kc": kc, "vc": vc,
                              "start": np.array([filled], np.int64)})[0]
    keys, values = np.concatenate([kc[:, :, :filled], kn], 2), np.concatenate([vc[:, :, :filled], vn], 2)
    scores = np.einsum("bhgtd,bhsd->bhgts", q, keys) * d ** -0.5
    scores[..., filled:] += np.where(np.arange(c)[None, :] <= np.arange(c)[:, None], 0.0, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    np.testing.assert_allclose(ours, np.einsum("bhgts,bhsd->bhgtd", probs, values), atol=1e-5)


def test_weight_pages_read_while_a_session_is_made_leave_memory_during_it(tmp_path):
    """A session pre-packs every weight it is given, reading all of them: the pages it has read are
    dropped while it is still being made, not only after (the 8B shape's opening peak)."""
    from snapcompile.memory import process_status_kib
    from snapcompile.runtime.weight_maps import WeightArrays
    size = 96 * 2**20
    (tmp_path / "weights.bin").write_bytes(np.random.default_rng(0).integers(0, 255, size, np.uint8).tobytes())
    weights = WeightArrays(tmp_path)
    tensor = onnx.TensorProto(name="w", data_type=onnx.TensorProto.UINT8, dims=[size], raw_data=b"")
    onnx.external_data_helper.set_external_data(tensor, "weights.bin", 0, size)
    tensor.data_location = onnx.TensorProto.EXTERNAL
    blob = weights.array(tensor)
    before = process_status_kib("RssFile")
    with weights.pages_released_while(interval_s=0.01):
        total = int(blob.sum(dtype=np.uint64))          # every page read, as a pre-pack reads them
        time.sleep(0.1)
        during = process_status_kib("RssFile")
    assert total == int(np.fromfile(tmp_path / "weights.bin", np.uint8).sum(dtype=np.uint64))
    assert during - before < size // 1024 // 4, (before, during)
    assert process_status_kib("RssFile") - before < size // 1024 // 4
