"""Graphs in and out of an artifact folder: one shared weights.bin as ONNX external data, the
manifest's fingerprint in every graph's metadata, and the checks that a loaded graph belongs to
its manifest and reads no data from outside the artifact."""
from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import onnx
from onnx import TensorProto, external_data_helper, numpy_helper

from snapcompile.artifact.files import record_files
from snapcompile.artifact.manifest import MANIFEST, METADATA_KEY, WEIGHTS, Manifest
from snapcompile.artifact.static_sizes import check_static_sizes
from snapcompile.atomic import write_json_atomic
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
    loaded without their data; the export writes it while building, `WeightsFile`); it is copied
    unless it is the folder's own, instead of rewritten.
    """
    folder = Path(folder)
    if weights_source is None:
        _externalize_shared(graphs.values(), folder / WEIGHTS)
    elif Path(weights_source).resolve() != (folder / WEIGHTS).resolve():
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
    check_static_sizes(model, path, manifest)
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
    with WeightsFile(weights_path) as store:
        for model in models:
            for tensor in model.graph.initializer:
                if not tensor.HasField("raw_data") and tensor.data_location != TensorProto.EXTERNAL:
                    # graphsurgeon writes INT4 tensors as int32_data; raw bytes are packed
                    tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor), tensor.name))
                reference = store.add(tensor)
                if reference is not tensor:
                    tensor.CopyFrom(reference)


class WeightsFile:
    """An artifact's weights.bin being written, one tensor at a time, so that graphs hold only
    references (ONNX external data) and an export never keeps more than one tensor's bytes
    outside the model's own weights.

    `add` writes a tensor of >= 1 KiB once (by name and content) at a 64-byte aligned offset
    (aligned offsets allow memory mapping) and returns it as a reference without data; smaller
    tensors are returned unchanged. `reference(name)` is the reference to a tensor already
    written under that name (the export's weights have one value per name), or None."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._handle = open(self.path, "wb")
        self._offsets: dict[tuple[str, bytes], tuple[int, int]] = {}
        self._by_name: dict[str, TensorProto] = {}

    def add(self, tensor: TensorProto) -> TensorProto:
        if not tensor.HasField("raw_data") or len(tensor.raw_data) < EXTERNAL_MIN_BYTES:
            return tensor
        key = (tensor.name, hashlib.sha1(tensor.raw_data).digest())
        if key not in self._offsets:
            self._handle.write(b"\0" * ((-self._handle.tell()) % 64))
            self._offsets[key] = (self._handle.tell(), len(tensor.raw_data))
            self._handle.write(tensor.raw_data)
        offset, length = self._offsets[key]
        reference = TensorProto(name=tensor.name, data_type=tensor.data_type, dims=tensor.dims,
                                raw_data=b"\0")   # set_external_data wants the field present
        external_data_helper.set_external_data(reference, WEIGHTS, offset=offset, length=length)
        reference.data_location = TensorProto.EXTERNAL
        reference.ClearField("raw_data")
        self._by_name[tensor.name] = reference
        return self.reference(tensor.name)

    def reference(self, name: str) -> TensorProto | None:
        written = self._by_name.get(name)
        if written is None:
            return None
        copy = TensorProto()
        copy.CopyFrom(written)
        return copy

    def close(self) -> None:
        self._handle.close()

    def __enter__(self) -> WeightsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
