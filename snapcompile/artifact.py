"""An artifact folder: ONNX graphs sharing one weights file, tokenizer files and manifest.json.

The manifest records the model, the static shapes, the cache policy and every graph's I/O; each
graph also carries the policy in its ONNX metadata, so a runner can detect a graph paired with
the wrong manifest (a different budget, a different model) before it runs anything.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import onnx
from onnx import TensorProto, external_data_helper, numpy_helper

from snapcompile import __version__
from snapcompile.atomic import write_json_atomic
from snapcompile.config import ExportConfig, PolicyConfig
from snapcompile.errors import SnapcompileError, first_line
from snapcompile.models.spec import ModelSpec

MANIFEST = "manifest.json"
WEIGHTS = "weights.bin"
FORMAT_VERSION = 2      # 2: every file's size and sha256 in the manifest
GRAPHS_REVISION = 5     # bumped whenever the artifacts change (2: prefill buckets, 3: select buckets, 4: checksums,
                        # 5: opset 21, --weights)
METADATA_KEY = "snapcompile.config"
EXTERNAL_MIN_BYTES = 1024


@dataclass
class Manifest:
    model_name: str
    spec: ModelSpec
    export: ExportConfig
    policy: PolicyConfig
    graphs: dict[str, dict] = field(default_factory=dict)   # name -> {"file", "inputs", "outputs"}
    chat: bool = False
    eos_token_ids: list[int] = field(default_factory=list)
    passes: list[dict] = field(default_factory=list)
    lowering: str = "standard"
    source: str = ""          # what `export` loaded: a built-in name or an absolute path
    files: dict[str, dict] = field(default_factory=dict)    # file name -> {"bytes", "sha256"}
    weights: dict = field(default_factory=dict)  # {"weights", "weight_bytes"} + the quantization report

    def fingerprint(self) -> str:
        """What every graph of the artifact must agree on (stored in each graph's metadata)."""
        return json.dumps({"model": self.model_name, "spec": self.spec.to_dict(),
                           "export": self.export.to_dict(), "policy": self.policy.to_dict(),
                           "lowering": self.lowering}, sort_keys=True)

    @property
    def cache_capacity(self) -> int:
        """Rows per slot in the decode cache: the budget B, or max_context L when dense."""
        return self.policy.budget if self.policy.compressed else self.export.max_context

    def kv_bytes_per_slot(self) -> int:
        return self.cache_capacity * self.spec.kv_bytes_per_token

    def dense_kv_bytes_per_slot(self) -> int:
        return self.export.max_context * self.spec.kv_bytes_per_token

    def to_dict(self) -> dict:
        return {"format_version": FORMAT_VERSION, "snapcompile_version": __version__,
                "model": {"name": self.model_name, "source": self.source, **self.spec.to_dict()},
                "export": self.export.to_dict(), "policy": self.policy.to_dict(),
                "lowering": self.lowering, "chat": self.chat, "eos_token_ids": self.eos_token_ids,
                "graphs": self.graphs, "weights": WEIGHTS, "passes": self.passes, "files": self.files,
                "weights_report": self.weights,
                "versions": {name: _version(name) for name in ("onnx", "onnxruntime", "torch", "transformers")}}

    @classmethod
    def from_dict(cls, d: dict) -> Manifest:
        model = dict(d["model"])
        name = model.pop("name")
        source = model.pop("source", name)
        return cls(model_name=name, spec=ModelSpec(**model), export=ExportConfig(**d["export"]),
                   policy=PolicyConfig.from_dict(d["policy"]), graphs=d["graphs"], chat=d["chat"],
                   eos_token_ids=d["eos_token_ids"], passes=d.get("passes", []),
                   lowering=d.get("lowering", "standard"), source=source, files=d["files"],
                   weights=d.get("weights_report", {}))

    def support_files(self) -> list[str]:
        """The files other than graphs and weights (the tokenizer's)."""
        return sorted(name for name in self.files if name != WEIGHTS and not name.endswith(".onnx"))


def _version(package: str) -> str | None:
    try:
        return metadata.version(package).split("+")[0]
    except metadata.PackageNotFoundError:
        return None


def graph_name(kind: str, cache_rows: int, max_context: int) -> str:
    """The name of a "prefill" or "select" graph over `cache_rows` cache rows: `kind` itself for
    max_context rows, "<kind>_<rows>" for a bucket."""
    return kind if cache_rows == max_context else f"{kind}_{cache_rows}"


def expected_graphs(export: ExportConfig, policy: PolicyConfig) -> set[str]:
    """The graphs an artifact of these shapes and this policy consists of: prefill (with its
    buckets) and decode, plus for snapstream select and one select bucket per prefill bucket of
    more rows than the prompt share (a prompt that fits in P is never selected from)."""
    buckets = export.prefill_buckets()
    names = {"prefill", "decode", *(graph_name("prefill", rows, export.max_context) for rows in buckets)}
    if policy.policy == "snapstream":
        names |= {graph_name("select", rows, export.max_context) for rows in select_rows(export, policy)}
    return names


def select_rows(export: ExportConfig, policy: PolicyConfig) -> list[int]:
    """Cache rows of the select graphs: each prefill bucket's rows above the prompt share P, and
    max_context. A prompt prefilled on a bucket is selected from that bucket's cache."""
    share = policy.resolved_prompt_share
    return [*(rows for rows in export.prefill_buckets() if rows > share), export.max_context]


def is_prefill_graph(name: str) -> bool:
    return name == "prefill" or bucket_rows(name) is not None


def bucket_rows(name: str, kind: str = "prefill") -> int | None:
    """The cache rows of a bucket graph "<kind>_<rows>"; None for any other graph."""
    prefix, _, rows = name.partition("_")
    return int(rows) if prefix == kind and rows.isdigit() else None


def artifact_key(source: str, export: ExportConfig, policy: PolicyConfig) -> str:
    """A folder name that changes whenever the model, the export shapes, the policy or the graphs
    this version writes change (eval and bench cache their built artifacts under it)."""
    blob = json.dumps([source, export.to_dict(), policy.to_dict(), GRAPHS_REVISION], sort_keys=True)
    return f"{policy.policy}-{hashlib.sha1(blob.encode()).hexdigest()[:12]}"


def read_manifest(folder: Path) -> Manifest:
    """Load and validate folder/manifest.json (one-line errors for every way it can be wrong)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise SnapcompileError(f"artifact folder not found: {folder}")
    path = folder / MANIFEST
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise SnapcompileError(f"{folder} has no {MANIFEST}: not a snapcompile artifact") from None
    except json.JSONDecodeError as err:
        raise SnapcompileError(f"{path} is corrupt: {err}") from None
    if not isinstance(raw, dict):
        raise SnapcompileError(f"{path} is not a snapcompile manifest (not a JSON object)")
    version = raw.get("format_version")
    if version != FORMAT_VERSION:
        older = isinstance(version, int) and version < FORMAT_VERSION
        raise SnapcompileError(f"{path}: unsupported format_version {version!r}"
                               + ("; it was written by an older snapcompile: convert the model again" if older else ""))
    try:
        manifest = Manifest.from_dict(raw)
    except (KeyError, TypeError, AttributeError) as err:
        raise SnapcompileError(f"{path} is missing or has malformed field {err}") from None
    _check_consistent(manifest, path)
    return manifest


def _check_consistent(manifest: Manifest, path: Path) -> None:
    """The manifest names only plain files of its own folder, and exactly the graphs its policy
    and shapes consist of, each in the file of its own name."""
    files = manifest.files
    if not isinstance(files, dict) or not all(isinstance(v, dict) for v in files.values()):
        raise SnapcompileError(f"{path}: malformed files table")
    for name in files:
        if not _plain_file_name(name):
            raise SnapcompileError(f"{path} names the file {name!r} outside the artifact folder; refused")
    expected = expected_graphs(manifest.export, manifest.policy)
    if set(manifest.graphs) != expected:
        missing, extra = sorted(expected - set(manifest.graphs)), sorted(set(manifest.graphs) - expected)
        raise SnapcompileError(
            f"{path}: a {manifest.policy.policy} artifact of these shapes has the graphs {', '.join(sorted(expected))}"
            f" (missing: {', '.join(missing) or '-'}; unexpected: {', '.join(extra) or '-'}); convert it again")
    for name, entry in manifest.graphs.items():
        if not isinstance(entry, dict) or entry.get("file") != f"{name}.onnx" or entry["file"] not in files:
            raise SnapcompileError(f"{path}: graph {name} must be the listed file {name}.onnx; refused")
    if WEIGHTS not in files:
        raise SnapcompileError(f"{path}: {WEIGHTS} is not listed in the files table")


def _plain_file_name(name) -> bool:
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
            and "\0" not in name and name != MANIFEST)


def verify_files(folder: Path, manifest: Manifest, names: list[str] | None = None, checksums: bool = True) -> None:
    """Check that each listed file (all of the manifest's by default) is a regular file of the
    folder with its recorded size and, when `checksums`, its recorded sha256."""
    folder = Path(folder)
    for name in manifest.files if names is None else names:
        record, path = manifest.files[name], folder / name
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            raise SnapcompileError(f"{path} is missing from the artifact") from None
        if not stat.S_ISREG(info.st_mode):
            raise SnapcompileError(f"{path} is not a regular file (links are not followed); refused")
        if info.st_size != record.get("bytes"):
            raise SnapcompileError(f"{path} has {info.st_size} bytes where the manifest records {record.get('bytes')}: "
                                   "the artifact is truncated or was modified; convert it again")
        if checksums and file_sha256(path) != record.get("sha256"):
            raise SnapcompileError(f"{path} does not match its sha256 in the manifest: the artifact is "
                                   "corrupt or was modified; convert it again")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def record_files(folder: Path, manifest: Manifest) -> None:
    """Set manifest.files to the size and sha256 of every file in `folder` but the manifest."""
    manifest.files = {item.name: {"bytes": item.stat().st_size, "sha256": file_sha256(item)}
                      for item in sorted(Path(folder).iterdir()) if item.is_file() and item.name != MANIFEST}


def copy_support_files(source: Path, manifest: Manifest, target: Path) -> None:
    """Copy an artifact's files other than graphs and weights (its tokenizer); the caller has
    verified them (`verify_files`)."""
    for name in manifest.support_files():
        shutil.copyfile(Path(source) / name, Path(target) / name)


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
