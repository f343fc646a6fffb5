"""Plugin lowering: node contracts, ONNX Runtime execution through the custom ops, TensorRT errors."""
import importlib.util

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from snapcompile.artifact.manifest import read_manifest
from snapcompile.cli import main
from snapcompile.config import PolicyConfig
from snapcompile.errors import SnapcompileError
from snapcompile.passes.pipeline import compress_artifact
from snapcompile.plugins.contracts import DECODE_ATTENTION, DOMAIN, SELECT
from snapcompile.runtime.ort_backend import OrtBackend
from snapcompile.runtime.trt_backend import check_trt_limits
from snapcompile.validate.parity import Validator, summarize
from tests.conftest import TINY_SNAPSTREAM, TINY_SUMMARIES, random_prompts

HAVE_TRT = importlib.util.find_spec("tensorrt") is not None


@pytest.fixture(scope="module")
def plugin_dir(tiny_dense_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("plug") / "snap-plugin"
    compress_artifact(tiny_dense_dir, folder, TINY_SNAPSTREAM, lowering="plugin")
    return folder


def _ops(path):
    return [n for n in onnx.load(str(path), load_external_data=False).graph.node]


def test_plugin_nodes_carry_what_tensorrt_parser_needs(plugin_dir):
    decode = _ops(plugin_dir / "decode.onnx")
    plugin_nodes = [n for n in decode if n.op_type == DECODE_ATTENTION.name]
    assert len(plugin_nodes) == 2 and not [n for n in decode if n.op_type == "Softmax"]
    for node in plugin_nodes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert node.domain == DOMAIN
        assert attrs["plugin_version"] == b"1" and attrs["plugin_namespace"] == b"snapcompile"
        assert attrs["scale"] == pytest.approx(0.25)
        assert list(node.input)[-2:] == ["write_index", "cache_len"]
    for name in ("select", "select_128", "select_256", "select_384"):      # the full graph and one per bucket
        select = [n for n in _ops(plugin_dir / f"{name}.onnx") if n.op_type == SELECT.name]
        assert len(select) == 2 and len(select[0].output) == 3, name
    assert read_manifest(plugin_dir).lowering == "plugin"


def test_plugin_lowering_equals_standard_lowering(plugin_dir, tiny_snap_dir):
    prompts = random_prompts([300, 20], seed=8)
    outputs = []
    for folder in (tiny_snap_dir, plugin_dir):
        backend = OrtBackend(folder)
        results = [backend.prefill(i, p) for i, p in enumerate(prompts)]
        tokens = {i: int(np.argmax(r.logits)) for i, r in enumerate(results)}
        logits = [backend.decode(tokens, {i: results[i].layout.step(0) for i in tokens}).copy()]
        outputs.append((results, logits))
    (std, std_logits), (plug, plug_logits) = outputs
    np.testing.assert_array_equal(std[0].kept_rows[1], plug[0].kept_rows[1])
    np.testing.assert_allclose(std_logits[0][:2], plug_logits[0][:2], atol=1e-4)


@pytest.mark.parametrize("policy", [TINY_SNAPSTREAM, PolicyConfig(policy="streamingllm", budget=64, sinks=4, window=8)],
                         ids=["snapstream", "streamingllm"])
def test_plugin_artifact_parity_with_pytorch(tiny_dense_dir, tiny_llama, tmp_path, policy):
    folder = tmp_path / "plug"
    compress_artifact(tiny_dense_dir, folder, policy, lowering="plugin")
    prompts = random_prompts([192, 500, 30], seed=6)
    summary = summarize(Validator(folder, tiny_llama.model).run(prompts, 64), 64)
    assert not summary["selection_mismatches"]
    assert summary["max_abs_logit_diff"] <= 1e-4 and summary["greedy_agreement"] == 1.0


def test_plugin_lowering_needs_a_compressed_policy(tiny_dense_dir, tmp_path):
    with pytest.raises(SnapcompileError, match="needs a compressed policy"):
        compress_artifact(tiny_dense_dir, tmp_path / "x", PolicyConfig(policy="dense"), lowering="plugin")
    assert not (tmp_path / "x").exists()


def test_tensorrt_topk_limit_is_checked(tiny_snap_dir):
    manifest = read_manifest(tiny_snap_dir)
    check_trt_limits(manifest)
    manifest.policy = PolicyConfig(budget=8192, window=32)
    with pytest.raises(SnapcompileError, match="TopK limit of 3840"):
        check_trt_limits(manifest)
    manifest.lowering = "plugin"
    check_trt_limits(manifest)


@pytest.mark.skipif(HAVE_TRT, reason="TensorRT is installed here")
def test_missing_tensorrt_names_the_extra(plugin_dir, tmp_path):
    for args in (["build", plugin_dir, "-o", tmp_path / "e"], ["run", plugin_dir, "--backend", "trt", "--prompt", "x"]):
        result = CliRunner().invoke(main, [str(a) for a in args])
        assert result.exit_code == 2
        assert 'pip install "snapcompile[trt]"' in result.output and "Traceback" not in result.output
    assert not (tmp_path / "e").exists()


class _StandInPluginAPI:
    """Records what trt_plugin registers, in place of tensorrt.plugin (not installable here)."""

    TensorDesc = Tensor = ShapeExprs = object

    def __init__(self):
        self.registered, self.impls = {}, {}

    def register(self, plugin_id):
        return lambda func: self.registered.setdefault(plugin_id, func)

    def impl(self, plugin_id):
        return lambda func: self.impls.setdefault(plugin_id, func)


def test_tensorrt_plugin_signatures_are_the_contracts():
    """TensorRT's QDP API reads the plugin's inputs and attributes from the Python signatures."""
    import inspect

    from snapcompile.plugins import trt_plugin
    api = _StandInPluginAPI()
    trt_plugin._register_decode(api)
    trt_plugin._register_select(api, trt=None)
    for contract in (DECODE_ATTENTION, SELECT):
        expected = [*contract.input_names, *contract.attr_names]
        assert list(inspect.signature(api.registered[contract.plugin_id]).parameters) == expected
        assert list(inspect.signature(api.impls[contract.plugin_id]).parameters) == [*expected, "outputs", "stream"]
        annotations = inspect.signature(api.registered[contract.plugin_id]).parameters
        assert all(not isinstance(p.annotation, str) for p in annotations.values())   # objects, not strings


def test_contract_refuses_inputs_and_attributes_it_does_not_list():
    with pytest.raises(ValueError, match="takes the inputs"):
        SELECT.node_inputs(window_query=1, key=2, value=3)
    with pytest.raises(ValueError, match="has the attributes"):
        DECODE_ATTENTION.node_attrs(scale=1.0, budget=4)


@pytest.mark.parametrize("summaries", [False, True])
def test_plugin_artifact_resumes_turns_as_the_oracle_does(plugin_dir, tiny_dense_dir, tiny_llama, tmp_path, summaries):
    """The SnapKVSelect node re-selects a resumed cache as the standard graph does: over its rows
    (with summaries too: their bias is in the prefill graphs, standard ops in both lowerings)."""
    folder = plugin_dir
    if summaries:
        folder = tmp_path / "summaries-plugin"
        compress_artifact(tiny_dense_dir, folder, TINY_SUMMARIES, lowering="plugin")
    prompts = random_prompts([300], seed=7)
    reports = Validator(folder, tiny_llama.model).run_turns(prompts, 24, 3, random_prompts([20], seed=8)[0])
    summary = summarize(reports, 24)
    assert summary["resumed_tokens"][0] == 0 and min(summary["resumed_tokens"][1:]) > 300
    assert not summary["selection_mismatches"]
    assert summary["max_abs_logit_diff"] <= 1e-4 and summary["greedy_agreement"] == 1.0


@pytest.mark.parametrize("op, attr, value, fragment", [
    (SELECT.name, "prompt_share", 1 << 30, "not with its contract's inputs and attributes"),
    (SELECT.name, "kernel", 1 << 30, "not with its contract's inputs and attributes"),
    (DECODE_ATTENTION.name, "scale", float("nan"), "not with its contract's inputs and attributes"),
    ("SnapKVUnknown", None, None, "this artifact's lowering does not write")])
def test_a_custom_op_node_off_its_contract_is_refused_at_load(plugin_dir, tmp_path, op, attr, value, fragment):
    """The load check bounds custom-op outputs by their contracts: an attribute that would size the
    op's work past what the manifest's policy declares, or an op no lowering writes, is refused."""
    import shutil

    from tests.cli_helpers import assert_one_line_error, invoke, rerecord_checksums
    folder = tmp_path / "edited"
    shutil.copytree(plugin_dir, folder)
    graph = "decode.onnx" if op != SELECT.name else "select.onnx"
    model = onnx.load(str(folder / graph), load_external_data=False)
    node = next(n for n in model.graph.node if n.domain == DOMAIN)
    if attr is None:
        node.op_type = op
    else:
        kept = [a for a in node.attribute if a.name != attr]
        del node.attribute[:]
        node.attribute.extend([*kept, onnx.helper.make_attribute(attr, value)])
    onnx.save_model(model, str(folder / graph))
    rerecord_checksums(folder)
    assert_one_line_error(invoke("inspect", folder), fragment)
