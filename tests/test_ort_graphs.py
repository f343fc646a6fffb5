"""The graphs ONNX Runtime opens (naming.ort_graphs), written by the export beside the static ones:
each static member run on its family's graph gives the member's own outputs bit for bit, every
weight format; one session a family; what the load-time checks refuse; MatMulNBits' weight layout."""
import numpy as np
import onnx
import pytest

from snapcompile.artifact.manifest import ORT_WEIGHTS, WEIGHTS, Manifest, read_manifest
from snapcompile.artifact.naming import ort_graphs
from snapcompile.config import ExportConfig, PolicyConfig
from snapcompile.errors import SnapcompileError
from snapcompile.export.quantize import BlockQuantized
from snapcompile.runtime.ort_backend import OrtDevice, OrtGraph
from snapcompile.validate.tolerances import FP16_TOLERANCE
from tests.conftest import TINY_SNAPSTREAM, build_artifact


def random_feeds(entry: dict, rng) -> dict[str, np.ndarray]:
    """Inputs of a static graph's manifest entry: small positive integers (token ids, lengths,
    positions all valid at the tiny shapes), normal floats."""
    feeds = {}
    for value in entry["inputs"]:
        if value["dtype"] == "float":
            feeds[value["name"]] = rng.standard_normal(value["shape"]).astype(np.float32)
        else:
            feeds[value["name"]] = rng.integers(1, 8, value["shape"]).astype(np.int64)
    return feeds


def run_bound(graph, manifest: Manifest, name: str, feeds: dict) -> dict[str, np.ndarray]:
    for key, array in feeds.items():
        graph.bind(key, array)
    outputs = {o["name"]: np.zeros(o["shape"], np.float32 if o["dtype"] == "float" else np.int64)
               for o in manifest.graphs[name]["outputs"]}
    for key, array in outputs.items():
        graph.bind(key, array, output=True)
    graph.run()
    return outputs


def static_session(folder, manifest: Manifest, name: str) -> OrtGraph:
    """The static graph on an ONNX Runtime session of its own, which fuses a quantized layer's
    DequantizeLinear + MatMul into MatMulNBits itself (at the int8 level the artifact's graphs hold)."""
    return OrtGraph(folder / manifest.graphs[name]["file"], ["CPUExecutionProvider"], None, custom_ops=False,
                    quantized_matmul="int8" if manifest.export.quantized else None)


@pytest.fixture(scope="module")
def formats_dirs(tiny_llama, tmp_path_factory):
    """Snapstream artifacts of the tiny model in int4, int8 and fp16 weights."""
    root = tmp_path_factory.mktemp("formats")
    return {fmt: build_artifact(tiny_llama, root / fmt, ExportConfig(slots=3, max_context=512, weight_format=fmt),
                                TINY_SNAPSTREAM) for fmt in ("int4", "int8", "fp16")}


def assert_members_match(folder) -> int:
    """Every member's outputs on its family's graph against the static graph's own session: equal; for
    float16 weights the logits within validate's float16 tolerance (ONNX Runtime multiplies a static
    float16 MatMul its own way; the family graph multiplies the float16-rounded input by the float32
    form of the weight and rounds the product to float16, as the graph defines it: validate compares
    that with the oracle)."""
    manifest = read_manifest(folder)
    half = manifest.export.weight_format == "fp16"
    device, checked = OrtDevice(folder), 0
    device.check(folder, manifest)
    static = {ort: entry for ort, entry in manifest.ort_graphs.items()      # the layer-by-layer prefill's
              if set(entry["members"]) <= set(manifest.graphs)}             # graphs have none (test_layer_prefill)
    for ort, entry in static.items():
        for name, size in entry["members"].items():
            feeds = random_feeds(manifest.graphs[name], np.random.default_rng(size or 0))
            ours = run_bound(device.graph(name, manifest), manifest, name, feeds)
            theirs = run_bound(static_session(folder, manifest, name), manifest, name, feeds)
            for key in theirs:
                if half:
                    if key == "logits":
                        np.testing.assert_allclose(ours[key], theirs[key], rtol=0, atol=FP16_TOLERANCE,
                                                   err_msg=f"{ort}: {name}: {key}")
                else:
                    np.testing.assert_array_equal(ours[key], theirs[key], err_msg=f"{ort}: {name}: {key}")
            checked += 1
    assert set(device.opened) == set(static)            # one session each
    return checked


@pytest.mark.parametrize("fixture", ["tiny_dense_dir", "tiny_snap_dir", "tiny_summary_dir"])
def test_each_member_run_on_its_family_graph_gives_the_members_own_outputs_bit_for_bit(fixture, request):
    folder = request.getfixturevalue(fixture)
    manifest = read_manifest(folder)
    assert assert_members_match(folder) == len(manifest.graphs)    # every static graph has its family's
    assert any(len(entry["members"]) > 2 for entry in manifest.ort_graphs.values())


@pytest.mark.parametrize("fmt", ["int4", "int8", "fp16"])
def test_every_weight_format_runs_the_same_numbers_on_its_family_graphs(fmt, formats_dirs):
    """MatMulNBits on the export's own layout, and float16 products on the weights' float32 form, are
    what ONNX Runtime makes of the static graphs itself (its fusion, its casts)."""
    folder = formats_dirs[fmt]
    assert assert_members_match(folder) == len(read_manifest(folder).graphs)
    ops = {node.op_type for node in onnx.load(str(folder / "ort_decode.onnx"), load_external_data=False).graph.node}
    assert ("MatMulNBits" in ops) == (fmt != "fp16") and "DequantizeLinear" not in ops
    assert (folder / ORT_WEIGHTS).stat().st_size > 0


def test_ort_graphs_are_written_with_their_size_symbolic_and_name_their_members():
    export, policy = ExportConfig(slots=4, max_context=1024), PolicyConfig(budget=256)
    graphs = ort_graphs(export, policy, "standard", layers=2)
    layer_major = {"prefill_embed", "prefill_layer_0", "prefill_layer_1", "prefill_head", "prefill_scores"}
    assert set(graphs) == {"prefill", "decode", "select", "prefill_tail", "select_layer"} | layer_major
    assert graphs["decode"] == {"decode": 4, "decode_1": 1, "decode_2": 2}
    assert graphs["prefill"]["prefill"] == 1024 and graphs["prefill_tail"] == {"prefill_tail": None}
    assert graphs["prefill_layer_1"]["prefill_layer_1"] == 1024
    assert graphs["prefill_layer_1"]["prefill_layer_1_128"] == 128
    assert set(graphs["select_layer"].values()) == set(graphs["select"].values())
    assert set(ort_graphs(export, policy, "plugin", 2)) == {"prefill", "prefill_tail"}   # custom ops run static
    assert set(ort_graphs(export, PolicyConfig(policy="dense"), "standard", 2)) == \
        {"prefill", "decode", "prefill_tail"} | layer_major


def test_the_export_writes_symbolic_sizes_ort_reads_off_the_input_shape(tiny_snap_dir):
    manifest = read_manifest(tiny_snap_dir)
    decode = onnx.load(str(tiny_snap_dir / "ort_decode.onnx"), load_external_data=False)
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in decode.graph.input}
    assert dims["cache_len"] == ["slots"] and dims["past_key.0"][0] == "slots"
    assert manifest.ort_graphs["select"]["size"] == {"name": "rows", "source": "key.0", "axis": 2}


def test_one_session_is_made_for_each_ort_graph(tiny_snap_dir, monkeypatch):
    from snapcompile.runtime.ort_backend import OrtBackend
    made = []
    original = OrtDevice._open
    monkeypatch.setattr(OrtDevice, "_open", lambda self, model, name: made.append(name) or original(self, model,
                                                                                                        name))
    backend = OrtBackend(tiny_snap_dir)
    backend.make_graphs()
    manifest = read_manifest(tiny_snap_dir)
    assert len(manifest.graphs) > 3 * 2 and len(manifest.ort_graphs["prefill_layer_0"]["members"]) > 2
    layers = [f"prefill_layer_{i}" for i in range(manifest.spec.num_layers)]
    assert sorted(made) == sorted(["decode", "prefill_embed", "prefill_head", "select_layer", *layers])
    made.clear()
    OrtBackend(tiny_snap_dir, prefill_order="chunks").make_graphs()
    assert sorted(made) == ["decode", "prefill", "select"]          # the tail is loaded on demand


def tampered(folder, tmp_path, name: str, edit) -> object:
    """A copy of artifact `folder` whose ONNX Runtime graph `name` is edited by edit(model) and resealed
    (its sha256 recorded again in the manifest, as an attacker with write access would)."""
    import json
    import shutil

    from snapcompile.artifact.files import file_sha256
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    path = copy / f"ort_{name}.onnx"
    model = onnx.load(str(path), load_external_data=False)
    edit(model)
    onnx.save(model, str(path))
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["files"][path.name] = {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


def test_a_size_read_from_anything_but_its_input_shape_is_refused(tiny_snap_dir, tmp_path):
    def multiply(model):
        node = next(n for n in model.graph.node if "size.rows" in n.output)
        node.output[0] = "size.raw"
        model.graph.node.append(onnx.helper.make_node("Mul", ["size.raw", "size.raw"], ["size.rows"]))
    copy = tampered(tiny_snap_dir, tmp_path, "prefill", multiply)
    with pytest.raises(SnapcompileError, match="size.rows must be read by one Shape node"):
        OrtDevice(copy).check(copy, read_manifest(copy))


def test_a_family_graph_is_bounded_at_the_members_sizes(tiny_snap_dir, tmp_path):
    """An allocation that grows with the size: within the bound at the smallest member, past it at the
    largest (the check fixes the size at each member's, so the symbolic size hides nothing)."""
    manifest = read_manifest(tiny_snap_dir)
    sizes = sorted(manifest.ort_graphs["select"]["members"].values())
    from snapcompile.artifact.static_sizes import max_elements
    factor = max_elements(manifest) // sizes[-1] + 1
    assert factor * sizes[0] <= max_elements(manifest)

    def allocate(model):
        model.graph.initializer.append(onnx.numpy_helper.from_array(np.array([factor], np.int64), "factor"))
        model.graph.node.extend([onnx.helper.make_node("Mul", ["size.rows", "factor"], ["grown"]),
                                 onnx.helper.make_node("ConstantOfShape", ["grown"], ["blob"], name="blob")])
    copy = tampered(tiny_snap_dir, tmp_path, "select", allocate)
    with pytest.raises(SnapcompileError, match=f"node 'blob' .* would allocate {factor * sizes[-1]:,} elements"):
        OrtDevice(copy).check(copy, read_manifest(copy))


def test_a_matmulnbits_whose_weight_is_not_its_k_by_n_is_refused(formats_dirs, tmp_path):
    def widen(model):
        node = next(n for n in model.graph.node if n.op_type == "MatMulNBits")
        for attribute in node.attribute:
            if attribute.name == "N":
                attribute.i *= 1000
    copy = tampered(formats_dirs["int4"], tmp_path, "decode", widen)
    with pytest.raises(SnapcompileError, match="not of its K x N"):
        OrtDevice(copy).check(copy, read_manifest(copy))


def test_an_initializer_past_the_end_of_its_file_is_refused(formats_dirs, tmp_path):
    def shift(model):
        tensor = next(t for t in model.graph.initializer if t.name.endswith(".nbits"))
        for entry in tensor.external_data:
            if entry.key == "offset":
                entry.value = str(10**9)
    copy = tampered(formats_dirs["int4"], tmp_path, "decode", shift)
    with pytest.raises(SnapcompileError, match="offset 1000000000 of ort_weights.bin"):
        OrtDevice(copy).check(copy, read_manifest(copy))         # before any session maps the file


def test_ort_graphs_read_weights_only_from_the_artifacts_two_files(tiny_snap_dir, tmp_path):
    def elsewhere(model):
        tensor = next(t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL)
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = "../../etc/passwd"
    copy = tampered(tiny_snap_dir, tmp_path, "decode", elsewhere)
    with pytest.raises(SnapcompileError, match=f"not the artifact's {WEIGHTS} or {ORT_WEIGHTS}"):
        OrtDevice(copy).check(copy, read_manifest(copy))


def test_the_nbits_layout_puts_element_k_of_row_n_in_the_low_nibble_first():
    """MatMulNBits' contract, written out for one small weight: B[n, block, byte] holds elements
    2j and 2j + 1 of row n's block, unsigned (value + 8), the first in the low nibble."""
    values = np.array([[-8, 1, 0, -2], [7, -1, 3, 5]], np.int8)           # W [N=2, K=4]
    weight, scales = BlockQuantized(values, np.ones((2, 1), np.float32), None, 4, 4).nbits_initializers("w")
    layout = onnx.numpy_helper.to_array(weight)
    row0 = [(-8 + 8) | ((1 + 8) << 4), (0 + 8) | ((-2 + 8) << 4)]
    row1 = [(7 + 8) | ((-1 + 8) << 4), (3 + 8) | ((5 + 8) << 4)]
    assert weight.name == "w.nbits" and scales.name == "w.nbits_scales" and layout.shape == (2, 1, 2)
    np.testing.assert_array_equal(layout.reshape(2, 2), np.array([row0, row1], np.uint8))


def test_the_int8_layout_is_the_values_plus_128():
    values = np.array([[-128, 127, 0, 5]], np.int8)
    weight, _ = BlockQuantized(values, np.ones((1, 1), np.float32), None, 8, 4).nbits_initializers("w")
    np.testing.assert_array_equal(onnx.numpy_helper.to_array(weight).reshape(-1), [0, 255, 128, 133])
