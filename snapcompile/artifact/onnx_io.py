"""Graphs in and out of an artifact folder: one shared weights.bin as ONNX external data (and
ort_weights.bin, the weights in ONNX Runtime's forms), the manifest's fingerprint in every graph's
metadata, and the checks that a loaded graph belongs to its manifest and reads no data from outside
the artifact."""
from __future__ import annotations

import hashlib
import json
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, external_data_helper, helper, numpy_helper

from snapcompile import __version__
from snapcompile.artifact.files import record_files
from snapcompile.artifact.manifest import MANIFEST, METADATA_KEY, ORT_WEIGHTS, WEIGHTS, Manifest
from snapcompile.artifact.naming import ort_file, ort_graphs, ort_size
from snapcompile.artifact.static_sizes import RULES, check_family_sizes, check_static_sizes, max_elements
from snapcompile.atomic import write_json_atomic
from snapcompile.errors import SnapcompileError, first_line
from snapcompile.paths import cache_root

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


@dataclass
class GraphSet:
    """An artifact's graphs by name. `static`: every graph with static shapes, each member of each
    family (what TensorRT and dataflow consumers build; naming.expected_graphs). `ort`: what ONNX
    Runtime opens on the CPU (naming.ort_graphs): one graph a family, its size symbolic, and the tail,
    in ONNX Runtime's form (export/llama_graph.py). Graph kinds are named alike in both."""

    static: dict[str, onnx.ModelProto]
    ort: dict[str, onnx.ModelProto] = field(default_factory=dict)

    def both(self) -> tuple[dict[str, onnx.ModelProto], dict[str, onnx.ModelProto]]:
        return self.static, self.ort


def save_graphs(folder: Path, graphs: GraphSet, manifest: Manifest, weights_source: Path | None = None,
                ort_weights_source: Path | None = None) -> None:
    """Write graphs (their large initializers into one shared weights.bin) and the manifest.

    weights_source: an existing weights.bin the graphs already reference (passes re-save graphs
    loaded without their data; the export writes it while building, `WeightsFile`); it is copied
    unless it is the folder's own, instead of rewritten. ort_weights_source: likewise for
    ort_weights.bin (None: the graphs hold no reference to one).
    """
    folder = Path(folder)
    if weights_source is None:
        _externalize_shared([*graphs.static.values(), *graphs.ort.values()], folder / WEIGHTS)
    else:
        _copy_unless_own(weights_source, folder / WEIGHTS)
    if ort_weights_source is not None:
        _copy_unless_own(ort_weights_source, folder / ORT_WEIGHTS)
    fingerprint = manifest.fingerprint()
    for name, model in graphs.static.items():
        _save(model, folder / f"{name}.onnx", fingerprint)
        manifest.graphs[name] = {"file": f"{name}.onnx", **graph_io(model)}
    members = ort_graphs(manifest.export, manifest.policy, manifest.lowering, manifest.spec.num_layers)
    for name, model in graphs.ort.items():
        _save(model, folder / ort_file(name), fingerprint)
        size = ort_size(name, manifest.spec.local_layers)
        manifest.ort_graphs[name] = {"file": ort_file(name), "members": members[name],
                                     "size": None if size is None else vars(size).copy(), **graph_io(model)}
    record_files(folder, manifest)
    write_json_atomic(folder / MANIFEST, manifest.to_dict())


def _copy_unless_own(source: Path, target: Path) -> None:
    if Path(source).resolve() != target.resolve():
        shutil.copyfile(source, target)  # onnx.checker rejects hard links


def _save(model: onnx.ModelProto, path: Path, fingerprint: str) -> None:
    _set_metadata(model, METADATA_KEY, fingerprint)
    onnx.save_model(model, str(path))
    onnx.checker.check_model(str(path))


def load_graph(folder: Path, manifest: Manifest, name: str, with_weights: bool = False) -> onnx.ModelProto:
    """Load one static graph of an artifact and check it belongs to `manifest` (its weights, when
    asked, read only once every reference is checked to lie inside weights.bin)."""
    entry = manifest.graphs.get(name)
    if entry is None:
        raise SnapcompileError(f"artifact {folder} has no {name} graph")
    path = Path(folder) / entry["file"]
    model, digest = _read(path)
    check_graph_matches(model, path, manifest, entry)
    _once(digest, manifest, None, lambda: check_static_sizes(model, path, manifest))
    _check_external_data(model, path, (WEIGHTS,))
    if with_weights:
        try:
            external_data_helper.load_external_data_for_model(model, str(path.parent))
        except Exception as err:  # a file changed since the check, or unreadable
            raise SnapcompileError(f"{path}: its weights cannot be read: {first_line(err)}") from None
    return model


def load_ort_graph(folder: Path, manifest: Manifest, name: str) -> onnx.ModelProto:
    """Load ONNX Runtime graph `name` of an artifact (without its weights) and check it belongs to
    `manifest`: a family's graph is bounded at every member's size (`check_family_sizes`)."""
    entry = manifest.ort_graphs.get(name)
    if entry is None:
        raise SnapcompileError(f"artifact {folder} has no ONNX Runtime graph {name}")
    path = Path(folder) / entry["file"]
    model, digest = _read(path)
    check_graph_matches(model, path, manifest, entry)
    if entry["size"] is None:
        _once(digest, manifest, None, lambda: check_static_sizes(model, path, manifest))
    else:
        sizes = sorted(entry["members"].values())
        _once(digest, manifest, [entry["size"], sizes],
              lambda: check_family_sizes(model, path, manifest, entry["size"], sizes))
    _check_external_data(model, path, (WEIGHTS, ORT_WEIGHTS))
    return model


def _read(path: Path) -> tuple[onnx.ModelProto, str]:
    """The graph at `path` (without its external data) and the sha256 of the bytes it was parsed from."""
    try:
        data = path.read_bytes()
        model = onnx.load_model_from_string(data)
    except FileNotFoundError:
        raise SnapcompileError(f"{path} is missing") from None
    except Exception as err:  # protobuf raises DecodeError and friends for a corrupt file
        raise SnapcompileError(f"{path} is not a valid ONNX file: {first_line(err)}") from None
    return model, hashlib.sha256(data).hexdigest()


def _once(digest: str, manifest: Manifest, detail, check) -> None:
    """Run `check` (the allocation bound of a graph) unless it passed before on these very bytes
    (`digest`) under the same bound: a record under $SNAPCOMPILE_CACHE/checked/ (shape inference at
    every member's size takes ~0.5 s for a 1B shape's graphs; a file is hashed at every load)."""
    key = hashlib.sha256(json.dumps([digest, max_elements(manifest), detail, __version__, RULES]).encode()).hexdigest()
    record = cache_root() / "checked" / key
    if record.exists():
        return
    check()
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        record.touch()
    except OSError:           # a cache that cannot be written only means checking again next time
        pass


def _check_external_data(model: onnx.ModelProto, path: Path, allowed: tuple[str, ...]) -> None:
    """Every initializer with external data reads exactly its values' bytes from inside one of the
    artifact's `allowed` weight files."""
    for tensor in model.graph.initializer:
        if tensor.data_location == TensorProto.EXTERNAL:
            external_span(tensor, path.parent, allowed, path)


def external_span(tensor: TensorProto, folder: Path, allowed: tuple[str, ...] = (WEIGHTS, ORT_WEIGHTS),
                  source: Path | None = None) -> tuple[str, int, int]:
    """(file name, offset, bytes) of an external initializer, checked: the file one of `allowed`, the
    length the bytes its dtype and dims take, the span inside the file. source: what to name in errors."""
    source = source or folder
    fields = {entry.key: entry.value for entry in tensor.external_data}
    location = fields.get("location")
    if location not in allowed:
        raise SnapcompileError(f"{source}: initializer {tensor.name} reads external data from {location!r}, "
                               f"not the artifact's {' or '.join(allowed)}; refused")
    size = tensor_bytes(tensor)
    try:
        offset, length = int(fields.get("offset", 0)), int(fields.get("length", -1))
        file_bytes = (Path(folder) / location).stat().st_size
    except (ValueError, OSError) as err:
        raise SnapcompileError(f"{source}: initializer {tensor.name}'s external data cannot be read: "
                               f"{first_line(err)}") from None
    if size is None or length != size or not 0 <= offset <= file_bytes - size:
        raise SnapcompileError(f"{source}: initializer {tensor.name} declares {length} bytes at offset {offset} of "
                               f"{location} ({file_bytes} bytes) for {size} bytes of values; refused")
    return location, offset, size


def tensor_bytes(tensor: TensorProto) -> int | None:
    """The bytes a tensor's values take (4-bit types packed two a byte), or None for dims or a dtype
    no weight has (negative, string, undefined)."""
    if any(dim < 0 for dim in tensor.dims):
        return None
    count = math.prod(tensor.dims)
    if tensor.data_type in (TensorProto.INT4, TensorProto.UINT4):
        return (count + 1) // 2
    try:
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type))
    except (KeyError, TypeError, ValueError):
        return None
    return None if dtype.kind in "OUS" else dtype.itemsize * count


def check_graph_matches(model: onnx.ModelProto, path: Path, manifest: Manifest, expected: dict) -> None:
    """The graph carries the manifest's fingerprint and the inputs and outputs its entry lists."""
    meta = {p.key: p.value for p in model.metadata_props}
    if meta.get(METADATA_KEY) != manifest.fingerprint():
        raise SnapcompileError(
            f"{path} was not produced with this manifest's configuration (model, shapes or cache "
            "policy differ): re-export the artifact instead of mixing files")
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
        """path: the file (its name is the location every reference names: weights.bin, ort_weights.bin)."""
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
        external_data_helper.set_external_data(reference, self.path.name, offset=offset, length=length)
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


class WeightStores:
    """The weights files of one export seen as one store by a graph builder: `reference(name)` is the
    tensor already written to any of them; `add` writes to the first."""

    def __init__(self, *stores: WeightsFile):
        self.stores = stores

    def reference(self, name: str) -> TensorProto | None:
        return next((found for store in self.stores if (found := store.reference(name)) is not None), None)

    def add(self, tensor: TensorProto) -> TensorProto:
        return self.stores[0].add(tensor)
