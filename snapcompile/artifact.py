"""An artifact folder: ONNX graphs sharing one weights file, tokenizer files and manifest.json.

The manifest records the model, the static shapes, the cache policy and every graph's I/O; each
graph also carries the policy in its ONNX metadata, so a runner can detect a graph paired with
the wrong manifest (a different budget, a different model) before it runs anything.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import onnx
from onnx import TensorProto, external_data_helper

from snapcompile import __version__
from snapcompile.atomic import write_json_atomic
from snapcompile.config import ExportConfig, PolicyConfig
from snapcompile.errors import SnapcompileError
from snapcompile.models.spec import ModelSpec

MANIFEST = "manifest.json"
WEIGHTS = "weights.bin"
FORMAT_VERSION = 1
GRAPHS_REVISION = 3     # bumped whenever the exported graphs change (2: prefill buckets, 3: select buckets)
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
        import onnxruntime
        import torch
        import transformers
        return {"format_version": FORMAT_VERSION, "snapcompile_version": __version__,
                "model": {"name": self.model_name, "source": self.source, **self.spec.to_dict()},
                "export": self.export.to_dict(), "policy": self.policy.to_dict(),
                "lowering": self.lowering, "chat": self.chat, "eos_token_ids": self.eos_token_ids,
                "graphs": self.graphs, "weights": WEIGHTS, "passes": self.passes,
                "versions": {"onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__,
                             "torch": torch.__version__.split("+")[0],
                             "transformers": transformers.__version__}}

    @classmethod
    def from_dict(cls, d: dict) -> "Manifest":
        model = dict(d["model"])
        name = model.pop("name")
        source = model.pop("source", name)
        return cls(model_name=name, spec=ModelSpec(**model), export=ExportConfig(**d["export"]),
                   policy=PolicyConfig.from_dict(d["policy"]), graphs=d["graphs"], chat=d["chat"],
                   eos_token_ids=d["eos_token_ids"], passes=d.get("passes", []),
                   lowering=d.get("lowering", "standard"), source=source)


def graph_name(kind: str, cache_rows: int, max_context: int) -> str:
    """The name of a "prefill" or "select" graph over `cache_rows` cache rows: `kind` itself for
    max_context rows, "<kind>_<rows>" for a bucket."""
    return kind if cache_rows == max_context else f"{kind}_{cache_rows}"


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
    if raw.get("format_version") != FORMAT_VERSION:
        raise SnapcompileError(f"{path}: unsupported format_version {raw.get('format_version')!r}")
    try:
        return Manifest.from_dict(raw)
    except (KeyError, TypeError) as err:
        raise SnapcompileError(f"{path} is missing or has malformed field {err}") from None


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
        raise SnapcompileError(f"{path} is not a valid ONNX file: {str(err).splitlines()[0] if str(err) else type(err).__name__}") from None
    check_graph_matches(model, path, manifest)
    return model


def check_graph_matches(model: onnx.ModelProto, path: Path, manifest: Manifest) -> None:
    meta = {p.key: p.value for p in model.metadata_props}
    if meta.get(METADATA_KEY) != manifest.fingerprint():
        raise SnapcompileError(
            f"{path} was not produced with this manifest's configuration (model, shapes or cache "
            "policy differ): re-export the artifact instead of mixing files")
    expected = manifest.graphs[Path(path).stem]
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
