"""Graphs in and out of an artifact folder: one shared weights.bin as ONNX external data, the
manifest's fingerprint in every graph's metadata, and the checks that a loaded graph belongs to
its manifest and reads no data from outside the artifact."""
from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import onnx
from onnx import TensorProto, external_data_helper, numpy_helper

from snapcompile.artifact.atomic import write_json_atomic
from snapcompile.artifact.files import record_files
from snapcompile.artifact.manifest import MANIFEST, METADATA_KEY, WEIGHTS, Manifest
from snapcompile.errors import SnapcompileError, first_line

EXTERNAL_MIN_BYTES = 1024


def graph_io(model: onnx.ModelProto) -> dict:
    """{"inputs": [{"name", "dtype", "shape"}], "outputs": [...]} of a graph."""
    def describe(values):
        out = []
        for v in values:
            t = v.type.tensor_type
            shape = [d.dim_value if d.HasField("dim_value") else d.dim_param for d in t.shape.dim]
            out.append({"name": v.name, "dtype": TensorProto.DataType.Name(t.elem_type).lower(),
                        "shape": shape})
        return out
    return {"inputs": describe(model.graph.input), "outputs": describe(model.graph.output)}


def save_graphs(folder: Path, graphs: dict[str, onnx.ModelProto], manifest: Manifest,
                weights_source: Path | None = None) -> None:
    """Write graphs (their large initializers into one shared weights.bin) and the manifest.

    weights_source: an existing weights.bin the graphs already reference (passes re-save graphs
    loaded without their data); it is copied instead of rewritten.
    """
    folder = Path(folder)
    if weights_source is None:
        _externalize_shared(graphs.values(), folder / WEIGHTS)
    else:
        shutil.copyfile(weights_source, folder / WEIGHTS)  # onnx.checker rejects hard links
    fingerprint = manifest.fingerprint()
    for name, model in graphs.items():
        _set_metadata(model, METADATA_KEY, fingerprint)
        onnx.save_model(model, str(folder / f"{name}.onnx"))
        onnx.checker.check_model(str(folder / f"{name}.onnx"))
        manifest.graphs[name] = {"file": f"{name}.onnx", **graph_io(model)}
    record_files(folder, manifest)
    write_json_atomic(folder / MANIFEST, manifest.to_dict())


def load_graph(folder: Path, manifest: Manifest, name: str, with_weights: bool = False) -> onnx.ModelProto:
    """Load one graph of an artifact and check it belongs to `manifest`."""
    entry = manifest.graphs.get(name)
    if entry is None:
        raise SnapcompileError(f"artifact {folder} has no {name} graph")
    path = Path(folder) / entry["file"]
    try:
        model = onnx.load(str(path), load_external_data=with_weights)
    except FileNotFoundError:
        raise SnapcompileError(f"{path} is missing") from None
    except Exception as err:  # protobuf raises DecodeError and friends for a corrupt file
        raise SnapcompileError(f"{path} is not a valid ONNX file: {first_line(err)}") from None
    check_graph_matches(model, path, manifest)
    for tensor in model.graph.initializer:
        location = next((e.value for e in tensor.external_data if e.key == "location"), None)
        if tensor.data_location == TensorProto.EXTERNAL and location != WEIGHTS:
            raise SnapcompileError(f"{path}: initializer {tensor.name} reads external data from {location!r}, "
                                   f"not the artifact's {WEIGHTS}; refused")
    return model


def check_graph_matches(model: onnx.ModelProto, path: Path, manifest: Manifest) -> None:
    meta = {p.key: p.value for p in model.metadata_props}
    if meta.get(METADATA_KEY) != manifest.fingerprint():
        raise SnapcompileError(
            f"{path} was not produced with this manifest's configuration (model, shapes or cache "
            "policy differ): re-export the artifact instead of mixing files")
    expected = manifest.graphs.get(Path(path).stem)
    if expected is None:
        raise SnapcompileError(f"{path} is not a graph of {MANIFEST}")
    actual = graph_io(model)
    if actual["inputs"] != expected["inputs"] or actual["outputs"] != expected["outputs"]:
        raise SnapcompileError(f"{path}: graph inputs/outputs differ from {MANIFEST}")


def _set_metadata(model: onnx.ModelProto, key: str, value: str) -> None:
    for prop in model.metadata_props:
        if prop.key == key:
            prop.value = value
            return
    model.metadata_props.add(key=key, value=value)


def _externalize_shared(models, weights_path: Path) -> None:
    """Move every initializer of >= 1 KiB into weights_path; identical tensors (the weights both
    graphs use) are written once."""
    offsets: dict[tuple[str, bytes], tuple[int, int]] = {}
    with open(weights_path, "wb") as handle:
        for model in models:
            for tensor in model.graph.initializer:
                if not tensor.HasField("raw_data") and tensor.data_location != TensorProto.EXTERNAL:
                    # graphsurgeon writes INT4 tensors as int32_data; raw bytes are packed
                    tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor), tensor.name))
                if not tensor.HasField("raw_data") or len(tensor.raw_data) < EXTERNAL_MIN_BYTES:
                    continue
                key = (tensor.name, hashlib.sha1(tensor.raw_data).digest())
                if key not in offsets:
                    pad = (-handle.tell()) % 64        # aligned offsets allow memory mapping
                    handle.write(b"\0" * pad)
                    offsets[key] = (handle.tell(), len(tensor.raw_data))
                    handle.write(tensor.raw_data)
                offset, length = offsets[key]
                external_data_helper.set_external_data(tensor, WEIGHTS, offset=offset, length=length)
                tensor.data_location = TensorProto.EXTERNAL
                tensor.ClearField("raw_data")
