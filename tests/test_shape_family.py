"""One ONNX Runtime session a family of bucket graphs (runtime/shape_family.py): the symbolic form
computes, at every member's size, exactly what the member computes; members it cannot express are
refused with the node named; an opened artifact makes one session a family."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from snapcompile.artifact.manifest import Manifest, read_manifest
from snapcompile.artifact.naming import FAMILIES, family_members, family_of
from snapcompile.config import ExportConfig
from snapcompile.runtime.ort_backend import OrtDevice
from snapcompile.runtime.shape_family import FamilyError, symbolic_form


def random_feeds(entry: dict, rng) -> dict[str, np.ndarray]:
    """Inputs of a graph's manifest entry: small positive integers (token ids, lengths, positions
    all valid at the tiny shapes), normal floats."""
    feeds = {}
    for value in entry["inputs"]:
        if value["dtype"] == "float":
            feeds[value["name"]] = rng.standard_normal(value["shape"]).astype(np.float32)
        else:
            feeds[value["name"]] = rng.integers(1, 8, value["shape"]).astype(np.int64)
    return feeds


def run_graph(device: OrtDevice, manifest: Manifest, name: str, feeds: dict) -> dict[str, np.ndarray]:
    graph = device.graph(name, manifest)
    for key, array in feeds.items():
        graph.bind(key, array)
    outputs = {o["name"]: np.zeros(o["shape"], np.float32 if o["dtype"] == "float" else np.int64)
               for o in manifest.graphs[name]["outputs"]}
    for key, array in outputs.items():
        graph.bind(key, array, output=True)
    graph.run()
    return outputs


@pytest.mark.parametrize("fixture", ["tiny_dense_dir", "tiny_snap_dir", "tiny_summary_dir"])
def test_each_member_run_on_its_family_session_gives_the_members_own_outputs_bit_for_bit(fixture, request):
    folder = request.getfixturevalue(fixture)
    manifest = read_manifest(folder)
    shared, alone = OrtDevice(folder), OrtDevice(folder, family_sessions=False)
    checked = 0
    for family in FAMILIES:
        for size, name in family_members(family, manifest.graphs, manifest.export).items():
            feeds = random_feeds(manifest.graphs[name], np.random.default_rng(size))
            ours, theirs = run_graph(shared, manifest, name, feeds), run_graph(alone, manifest, name, feeds)
            for key in theirs:
                np.testing.assert_array_equal(ours[key], theirs[key], err_msg=f"{name}: {key}")
            checked += 1
    assert set(shared.families) == {f for f in FAMILIES if f in manifest.graphs}
    assert all(session is not None for session in shared.families.values())
    assert checked == sum(family_of(name) is not None for name in manifest.graphs)


def test_an_opened_artifact_makes_one_session_a_family(tiny_snap_dir, monkeypatch):
    from snapcompile.runtime.ort_backend import OrtBackend
    made = []
    original = OrtDevice._session
    monkeypatch.setattr(OrtDevice, "_session", lambda self, source, name: made.append(name) or original(self, source,
                                                                                                          name))
    backend = OrtBackend(tiny_snap_dir)
    backend.make_graphs()
    graphs = read_manifest(tiny_snap_dir).graphs
    assert sum(family_of(name) is not None for name in graphs) > 3 * 2       # several members a family
    assert sorted(made) == ["decode", "prefill", "select"]                     # the tail is loaded on demand


def test_family_names():
    assert [family_of(n) for n in ("prefill", "prefill_128", "prefill_tail", "decode_2", "select_384", "other")] == \
        ["prefill", "prefill", None, "decode", "select", None]
    assert family_members("decode", ["decode", "decode_1", "decode_2", "prefill"], ExportConfig(slots=3)) == \
        {3: "decode", 1: "decode_1", 2: "decode_2"}


def reshape_model(size: int, shape, scale: float = 1.0) -> onnx.ModelProto:
    """x [size, 4] -> Reshape(x, shape) * scale: a two-node member of a toy family."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [size, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["r"], name="reshape"),
             helper.make_node("Mul", ["r", "scale"], ["y"], name="scale_it")]
    inits = [numpy_helper.from_array(np.array(shape, np.int64), "shape"),
             numpy_helper.from_array(np.array(scale, np.float32), "scale")]
    return helper.make_model(helper.make_graph(nodes, "toy", [x], [y], inits))


def test_a_shape_constant_linear_in_the_size_becomes_symbolic():
    import onnxruntime as ort
    form = symbolic_form({s: reshape_model(s, [2, s * 2]) for s in (2, 4, 6)}, "rows")
    assert form.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "rows"
    session = ort.InferenceSession(form.SerializeToString())
    for size in (2, 4, 6):
        x = np.arange(size * 4, dtype=np.float32).reshape(size, 4)
        np.testing.assert_array_equal(session.run(None, {"x": x})[0], x.reshape(2, size * 2))


@pytest.mark.parametrize(("members", "named"), [
    ({s: reshape_model(s, [s * s, 4 // s]) for s in (1, 2, 4)}, "reshape"),          # not linear in the size
    ({s: reshape_model(s, [s, 4], scale=float(s) / 3) for s in (1, 2)}, "scale_it"),  # a float differs, not integral
])
def test_members_no_formula_describes_are_refused_naming_the_node(members, named):
    with pytest.raises(FamilyError, match=named):
        symbolic_form(members, "rows")


def test_members_wired_differently_are_refused():
    other = reshape_model(2, [2, 4])
    other.graph.node[1].op_type = "Add"
    with pytest.raises(FamilyError, match="scale_it"):
        symbolic_form({1: reshape_model(1, [1, 4]), 2: other}, "rows")


def test_a_prefill_and_decode_leave_no_page_of_the_weights_file_in_memory(tiny_snap_dir):
    """The embedding rows a Gather reads map the file pages around them; they are released after
    every prefill chunk and every RELEASE_EVERY_STEPS decode steps (Device.release_pages)."""
    from snapcompile.artifact.footprint import RELEASE_EVERY_STEPS
    from snapcompile.artifact.manifest import WEIGHTS
    from snapcompile.bench.machine import file_rss_kib
    from snapcompile.layout import SlotLayout
    from snapcompile.runtime.ort_backend import OrtBackend
    backend = OrtBackend(tiny_snap_dir)
    backend.make_graphs()
    backend.prefill(0, [int(t) for t in np.random.default_rng(0).integers(0, 250, 300)])
    assert file_rss_kib(tiny_snap_dir / WEIGHTS) == 0
    layout = SlotLayout.for_prompt(300, backend.rows_per_slot, backend.manifest.policy.resolved_prompt_share)
    mapped = []
    for generated in range(RELEASE_EVERY_STEPS):
        backend.decode({0: 5 + generated}, {0: layout.step(generated)})
        mapped.append(file_rss_kib(tiny_snap_dir / WEIGHTS))
    assert mapped[0] > 0 and mapped[-1] == 0            # mapped by the steps, released at the 32nd
