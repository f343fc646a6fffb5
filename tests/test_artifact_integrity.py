"""Artifacts that would run wrong are refused: paths confined to the folder, checksums, graph lists
that follow from the policy, memory checked before allocating."""
import json
import os
import shutil
from pathlib import Path

import pytest

from snapcompile.artifact.manifest import MANIFEST, WEIGHTS
from snapcompile.errors import SnapcompileError
from tests.cli_helpers import assert_one_line_error, edit_manifest, invoke, rerecord_checksums

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("file", ["../other/decode.onnx", "/etc/hostname", "prefill.onnx"])
def test_manifest_graph_paths_are_confined(artifact, file):
    edit_manifest(artifact, lambda raw: raw["graphs"]["decode"].update(file=file))
    assert_one_line_error(invoke("run", artifact, "--prompt", "hi"), "must be the listed file decode.onnx")
    assert_one_line_error(invoke("inspect", artifact), "must be the listed file decode.onnx")


@pytest.mark.parametrize("name", ["../weights.bin", "/etc/passwd", ".."])
def test_manifest_file_table_is_confined(artifact, name):
    edit_manifest(artifact, lambda raw: raw["files"].update({name: {"bytes": 1, "sha256": "0"}}))
    assert_one_line_error(invoke("inspect", artifact), "outside the artifact folder")


def test_symlinked_file_is_refused(artifact, tmp_path):
    outside = tmp_path / "outside.bin"
    shutil.copy(artifact / WEIGHTS, outside)
    (artifact / WEIGHTS).unlink()
    (artifact / WEIGHTS).symlink_to(outside)
    assert_one_line_error(invoke("run", artifact, "--prompt", "hi"), "links are not followed")


def test_external_data_outside_the_weights_file_is_refused(artifact, tmp_path):
    """In the static graphs (compress reads them) and in ONNX Runtime's (run opens them)."""
    import onnx
    for name in ("prefill.onnx", "ort_prefill.onnx"):
        model = onnx.load(str(artifact / name), load_external_data=False)
        for tensor in model.graph.initializer:
            for entry in tensor.external_data:
                if entry.key == "location":
                    entry.value = "../secret.bin"
        onnx.save_model(model, str(artifact / name))
    rerecord_checksums(artifact)
    assert_one_line_error(invoke("compress", artifact, "-o", tmp_path / "snap", "--budget", 64, "--window", 8),
                          "reads external data from '../secret.bin'")
    assert_one_line_error(invoke("run", artifact, "--prompt", "hi"), "reads external data")


def test_snapstream_manifest_without_its_select_graph_is_refused(snap_artifact):
    edit_manifest(snap_artifact, lambda raw: raw["graphs"].pop("select"))
    assert_one_line_error(invoke("run", snap_artifact, "--prompt", "hi"), "missing: select")


def test_streamingllm_manifest_with_a_select_graph_is_refused(snap_artifact):
    edit_manifest(snap_artifact, lambda raw: raw["policy"].update(policy="streamingllm"))
    assert_one_line_error(invoke("run", snap_artifact, "--prompt", "hi"), "unexpected: select")


def test_flipped_byte_in_the_weights_is_detected(artifact):
    with open(artifact / WEIGHTS, "r+b") as handle:
        handle.seek(5000)
        byte = handle.read(1)
        handle.seek(5000)
        handle.write(bytes([byte[0] ^ 0x10]))
    assert_one_line_error(invoke("run", artifact, "--prompt", "hi"), "does not match its sha256")
    assert_one_line_error(invoke("inspect", artifact), "does not match its sha256")
    assert invoke("inspect", artifact, "--no-verify").exit_code == 0      # sizes only, on request


def test_a_verified_large_file_is_hashed_again_only_once_it_changes(artifact, monkeypatch, tmp_path):
    """The record of a verified sha256 (files.remember_sha256) stands while the file's inode, size and
    times are the same; a same-size edit is hashed again and refused; inspect hashes every file."""
    from snapcompile.artifact import files
    from snapcompile.artifact.manifest import read_manifest
    monkeypatch.setattr(files, "REMEMBERED_BYTES", 0)
    monkeypatch.setenv("SNAPCOMPILE_CACHE", str(tmp_path / "cache"))
    hashed, real = [], files.file_sha256
    monkeypatch.setattr(files, "file_sha256", lambda path: hashed.append(Path(path).name) or real(path))
    manifest = read_manifest(artifact)
    files.check_files(artifact, manifest)
    assert sorted(hashed) == sorted(manifest.files)
    hashed.clear()
    files.check_files(artifact, manifest)
    assert hashed == []
    files.check_files(artifact, manifest, remembered=False)
    assert sorted(hashed) == sorted(manifest.files)
    with open(artifact / WEIGHTS, "r+b") as handle:
        byte = handle.read(1)
        handle.seek(0)
        handle.write(bytes([byte[0] ^ 0x10]))
    hashed.clear()
    with pytest.raises(SnapcompileError, match="does not match its sha256"):
        files.check_files(artifact, manifest)
    assert hashed == [WEIGHTS]


@pytest.mark.parametrize("damage, fragment", [
    (lambda a: (a / WEIGHTS).unlink(), "weights.bin is missing"),
    (lambda a: (a / WEIGHTS).write_bytes(b""), "the artifact is truncated"),
    (lambda a: os.truncate(a / WEIGHTS, 1000), "the artifact is truncated"),
    (lambda a: (a / "tokenizer.json").unlink(), "tokenizer.json is missing"),
    (lambda a: edit_manifest(a, lambda raw: raw["graphs"].update(step=raw["graphs"].pop("decode"))), "missing: decode"),
    (lambda a: edit_manifest(a, lambda raw: raw["graphs"]["decode"].update(file="prefill.onnx")),
     "must be the listed file decode.onnx"),
    (lambda a: edit_manifest(a, lambda raw: raw.update(format_version=1)), "written by an older snapcompile"),
    (lambda a: edit_manifest(a, lambda raw: raw.pop("files")), "malformed field 'files'"),
    (lambda a: (a / MANIFEST).write_text("[1, 2]"), "not a JSON object"),
], ids=["weights-deleted", "weights-empty", "weights-truncated", "no-tokenizer", "decode-renamed", "wrong-file",
        "old-format", "no-files-table", "manifest-a-list"])
def test_damaged_artifacts_are_one_error_line(artifact, damage, fragment):
    damage(artifact)
    for command in (("run", artifact, "--prompt", "hi"), ("inspect", artifact)):
        assert_one_line_error(invoke(*command), fragment)


def test_artifact_too_large_for_this_machine_is_refused_before_allocating(tmp_path, monkeypatch):
    out, args = tmp_path / "huge", ("--slots", 10_000_000, "--max-context", 256, "--chunk", 64)
    assert_one_line_error(invoke("export", "tiny-llama", "-o", out, *args), "needs about 1220.8 GiB")
    assert not out.exists()
    with monkeypatch.context() as patched:        # written where memory seems plenty, run here
        patched.setattr("snapcompile.memory.available_host_memory", lambda: 2**50)
        assert invoke("export", "tiny-llama", "-o", out, *args).exit_code == 0
    result = invoke("run", out, "--prompt", "hi")
    assert_one_line_error(result, "needs about 1220.8 GiB")
    assert "10000000 slots x 256 rows" in result.output and "available here" in result.output


def test_a_convert_refused_for_memory_draws_no_progress_bar(tmp_path):
    result = invoke("convert", "tiny-llama", "-o", tmp_path / "huge", "--slots", 10_000_000, "--max-context", 256,
                    "--chunk", 64, "--budget", 128)
    assert_one_line_error(result, "needs about")
    assert [line for line in result.output.splitlines() if line.strip()] == [result.output.strip()]


@pytest.mark.parametrize("text, fragment", [("[" * 100000 + "]" * 100000, "nests too deeply"),
                                            ('{"format_version": ' + "9" * 5000 + "}", "is not valid JSON")])
def test_a_hostile_manifest_is_one_error_line(artifact, text, fragment):
    (artifact / MANIFEST).write_text(text)
    assert_one_line_error(invoke("inspect", artifact), fragment)


def test_files_the_manifest_does_not_list_change_nothing(artifact):
    """An added_tokens.json or an extra chat template dropped beside the listed files is not read."""
    from snapcompile.engine.engine import Engine
    before = Engine.from_artifact(artifact, session_cache_bytes=0).encode("zzz hello", chat=False)
    (artifact / "added_tokens.json").write_text(json.dumps({"zzz": 258}))
    (artifact / "additional_chat_templates").mkdir()
    (artifact / "additional_chat_templates" / "default.jinja").write_text("HIJACKED {{ messages }}")
    engine = Engine.from_artifact(artifact, session_cache_bytes=0)
    assert engine.encode("zzz hello", chat=False) == before
    assert "HIJACKED" not in engine.tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)


def _running_nodes(source: str):
    """Nodes writing `flat` ([slots] int64) and `count` (a scalar) from a graph input's values: sizes
    known only while running."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper
    zero = numpy_helper.from_array(np.array([0], dtype=np.int64))
    return [helper.make_node("Cast", [source], ["as_int"], to=TensorProto.INT64),
            helper.make_node("Constant", [], ["zero"], value=zero),
            helper.make_node("Constant", [], ["flat_shape"], value=numpy_helper.from_array(np.array([-1], np.int64))),
            helper.make_node("Gather", ["as_int", "zero"], ["dims"], axis=-1),
            helper.make_node("Reshape", ["dims", "flat_shape"], ["flat"]),
            helper.make_node("ReduceMax", ["flat"], ["count"], keepdims=0)]


def _huge_node(model, kind: str):
    """Nodes a hostile edit adds to a graph: each asks for a tensor of ~2^40 elements, or one whose
    size only a value known while running sets (whatever the operator), or control flow."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper
    source = model.graph.input[0].name
    huge = numpy_helper.from_array(np.array([1 << 20, 1 << 20], dtype=np.int64), "huge_shape")
    running = _running_nodes(source)
    nodes = {
        "ConstantOfShape": [helper.make_node("Constant", [], ["huge_shape"], value=huge),
                            helper.make_node("ConstantOfShape", ["huge_shape"], ["huge"], name="hostile")],
        "Expand": [helper.make_node("Constant", [], ["huge_shape"], value=huge),
                   helper.make_node("Cast", [source], ["as_float"], to=TensorProto.FLOAT),
                   helper.make_node("ReduceMax", ["as_float"], ["one"], keepdims=0),
                   helper.make_node("Expand", ["one", "huge_shape"], ["huge"], name="hostile")],
        "Tile": [helper.make_node("Constant", [], ["huge_shape"], value=huge),
                 helper.make_node("Constant", [], ["block"], value=numpy_helper.from_array(
                     np.ones((4, 4), dtype=np.float32))),
                 helper.make_node("Tile", ["block", "huge_shape"], ["huge"], name="hostile")],
        "running value": [*running, helper.make_node("ConstantOfShape", ["flat"], ["huge"], name="hostile")],
        "window generator": [*running, helper.make_node("HannWindow", ["count"], ["huge"], name="hostile")],
        "spectral op": [*running, helper.make_node("Constant", [], ["signal"], value=numpy_helper.from_array(
                            np.ones((1, 8, 1), dtype=np.float32))),
                        helper.make_node("DFT", ["signal", "count"], ["huge"], name="hostile")],
        "computed Reshape into MatMul": [
            *running, helper.make_node("Constant", [], ["rows"], value=numpy_helper.from_array(
                np.ones(4096, dtype=np.float32))),
            helper.make_node("Constant", [], ["minus_one"], value=numpy_helper.from_array(np.array([-1], np.int64))),
            helper.make_node("ReduceMax", ["flat"], ["first"], keepdims=1),
            helper.make_node("Concat", ["first", "minus_one"], ["computed_shape"], axis=0),
            helper.make_node("Reshape", ["rows", "computed_shape"], ["matrix"], name="hostile"),
            helper.make_node("Transpose", ["matrix"], ["transposed"]),
            helper.make_node("MatMul", ["matrix", "transposed"], ["huge"], name="hostile_product")],
        "If": [helper.make_node("Constant", [], ["flag"], value=numpy_helper.from_array(np.array(True))),
               helper.make_node("If", ["flag"], ["branch"], name="hostile", **{
                   branch: helper.make_graph([helper.make_node("Constant", [], [f"{branch}_out"],
                                                               value=numpy_helper.from_array(np.zeros(1, np.float32)))],
                                             branch, [], [helper.make_tensor_value_info(f"{branch}_out",
                                                                                        TensorProto.FLOAT, [1])])
                   for branch in ("then_branch", "else_branch")})],
    }[kind]
    model.graph.node.extend(nodes)


HOSTILE_NODES = [("ConstantOfShape", "would allocate 1,099,511,627,776 elements"), ("Expand", "would allocate"),
                 ("Tile", "would allocate"), ("running value", "cannot be known at load"),
                 ("window generator", "cannot be known at load"), ("spectral op", "cannot be known at load"),
                 ("computed Reshape into MatMul", "cannot be known at load"), ("If", "no control flow")]


@pytest.mark.parametrize("kind, fragment", HOSTILE_NODES)
def test_a_graph_that_would_allocate_past_its_shapes_is_refused_at_load(artifact, kind, fragment):
    """In the static graphs (inspect checks them) and in ONNX Runtime's (run opens them)."""
    import onnx
    for name in ("decode.onnx", "ort_decode.onnx"):
        model = onnx.load(str(artifact / name), load_external_data=False)
        _huge_node(model, kind)
        onnx.save_model(model, str(artifact / name))
    rerecord_checksums(artifact)
    assert_one_line_error(invoke("run", artifact, "--prompt", "hi"), fragment)
    assert_one_line_error(invoke("inspect", artifact), "hostile")


def test_shapes_a_graph_declares_for_its_values_are_not_believed(artifact):
    """A value_info saying [1] for a tensor sized while running does not make it bounded."""
    import onnx
    from onnx import TensorProto, helper
    for name in ("decode.onnx", "ort_decode.onnx"):
        model = onnx.load(str(artifact / name), load_external_data=False)
        _huge_node(model, "running value")
        model.graph.value_info.append(helper.make_tensor_value_info("huge", TensorProto.FLOAT, [1]))
        onnx.save_model(model, str(artifact / name))
    rerecord_checksums(artifact)
    assert_one_line_error(invoke("run", artifact, "--prompt", "hi"), "cannot be known at load")


@pytest.mark.parametrize("graph", ["prefill.onnx", "ort_decode.onnx"])
@pytest.mark.parametrize("field, value, fragment", [
    ("offset", str(10 ** 12), "at offset 1000000000000 of weights.bin"), ("length", "7", "declares 7 bytes"),
    ("offset", "nine", "external data cannot be read")])
def test_an_initializer_reading_past_its_weights_file_is_refused(artifact, tmp_path, graph, field, value, fragment):
    """Static graphs (inspect, compress, validate read them) and ONNX Runtime's (run maps them)."""
    import onnx
    model = onnx.load(str(artifact / graph), load_external_data=False)
    external = next(t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL)
    next(entry for entry in external.external_data if entry.key == field).value = value
    onnx.save_model(model, str(artifact / graph))
    rerecord_checksums(artifact)
    command = ("run", artifact, "--prompt", "hi") if graph.startswith("ort_") else ("inspect", artifact)
    assert_one_line_error(invoke(*command), fragment)
    if not graph.startswith("ort_"):
        assert_one_line_error(invoke("compress", artifact, "-o", tmp_path / "c", "--budget", 64, "--window", 8),
                              fragment)
