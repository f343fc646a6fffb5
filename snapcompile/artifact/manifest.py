"""An artifact's manifest.json: the model, the static shapes, the cache policy, every graph's I/O
and every file's checksum; read back with one-line errors for every way it can be wrong.

Each graph also carries the manifest's fingerprint in its ONNX metadata (snapcompile.artifact.onnx_io),
so a runner detects a graph paired with the wrong manifest before it runs anything.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from snapcompile import __version__
from snapcompile.artifact.naming import expected_graphs, layer_major, ort_file, ort_graphs, ort_size
from snapcompile.config import ExportConfig, PolicyConfig
from snapcompile.errors import SnapcompileError, parse_json
from snapcompile.layout import WindowRing
from snapcompile.models.spec import ModelSpec

MANIFEST = "manifest.json"
WEIGHTS = "weights.bin"
ORT_WEIGHTS = "ort_weights.bin"    # the weights in the forms ONNX Runtime's graphs read (export/weights.py)
FORMAT_VERSION = 9      # 2: every file's size and sha256 in the manifest; 3: export.weight_format;
                        # 4: prefill graphs take `position` apart from `start` (resumed conversations);
                        # 5: prefill buckets step by L/8 above the doubling ones (another set of graphs);
                        # 6: the graphs ONNX Runtime opens (ort_graphs) and their weights;
                        # 7: the layer-by-layer prefill's graphs, prefill_order;
                        # 8: every node's size known at load (per-head prefill attention by Gather);
                        # 9: prefill_scores (the head over a chunk of positions: a prompt's log probabilities)
GRAPHS_REVISION = 13    # bumped whenever the artifacts change (2: prefill buckets, 3: select buckets, 4: checksums,
                        # 5: opset 21, --weights, 6: deterministic node names, 7: decode slot buckets,
                        # 8: joined prefill attention, finer prefill buckets, 9: ONNX Runtime's graphs,
                        # 10: the layer-by-layer prefill, 11: per-head attention by Gather, 12: prefill_scores,
                        # 13: the int8 cache's folded products, the float16 pass's names)
METADATA_KEY = "snapcompile.config"


@dataclass
class Manifest:
    model_name: str
    spec: ModelSpec
    export: ExportConfig
    policy: PolicyConfig
    graphs: dict[str, dict] = field(default_factory=dict)   # name -> {"file", "inputs", "outputs"}
    # ONNX Runtime graph name -> {"file", "members": {static name: size}, "size": {name, source, axis} or
    # None, "inputs", "outputs"} (naming.ort_graphs)
    ort_graphs: dict[str, dict] = field(default_factory=dict)
    chat: bool = False
    eos_token_ids: list[int] = field(default_factory=list)
    passes: list[dict] = field(default_factory=list)
    lowering: str = "standard"
    source: str = ""          # what `export` loaded: a built-in name or an absolute path
    files: dict[str, dict] = field(default_factory=dict)    # file name -> {"bytes", "sha256"}
    weights_report: dict = field(default_factory=dict)  # {"format", "weight_bytes", ...} + quantization

    def fingerprint(self) -> str:
        """What every graph of the artifact must agree on (stored in each graph's metadata)."""
        return json.dumps({"model": self.model_name, "spec": self.spec.to_dict(),
                           "export": self.export.to_dict(), "policy": self.policy.to_dict(),
                           "lowering": self.lowering}, sort_keys=True)

    @property
    def rows_per_slot(self) -> int:
        """Rows per slot in the decode cache: the budget B less its summary rows, or max_context L
        when dense."""
        return self.policy.slot_rows if self.policy.compressed else self.export.max_context

    @property
    def prefill_order(self) -> str:
        """"layers": ONNX Runtime prefills a prompt one decoder layer at a time, holding one layer's prompt
        KV (naming.layer_major); "chunks": chunk by chunk through the whole model, every layer's KV held."""
        return "layers" if layer_major(self.lowering, self.policy.compressed) else "chunks"

    @property
    def window_ring(self) -> WindowRing | None:
        """The cache of the model's local (sliding-window) layers (Gemma 3's), None where it has none:
        their rows whatever the policy; the policy's rows_per_slot are the other layers'."""
        return self.spec.window_ring(self.export.chunk)

    def layer_rows(self, layer: int) -> int:
        """Cache rows a slot holds for `layer`: its window ring's for a local layer, else rows_per_slot."""
        return self.window_ring.rows if layer in self.spec.local_layers else self.rows_per_slot

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V bytes one token's rows take across all layers, in the artifact's kv_dtype."""
        spec = self.spec
        return 2 * spec.num_layers * spec.num_kv_heads * self.export.kv_row_bytes(spec.head_dim)

    @property
    def kv_row_width(self) -> int:
        """Elements of one head's stored key or value row (head_dim, and int8's scale: kv_int8.py)."""
        return self.export.kv_row_width(self.spec.head_dim)

    def kv_bytes_per_slot(self) -> int:
        return self._slot_bytes(self.rows_per_slot)

    def dense_kv_bytes_per_slot(self) -> int:
        return self._slot_bytes(self.export.max_context)

    def kv_bytes_by_layer_kind(self, rows: int | None = None) -> dict[str, int]:
        """A slot's K and V bytes of its global layers (every layer of most models), holding `rows` rows
        (default: rows_per_slot), and of its local ones (their window rings)."""
        local = len(self.spec.local_layers)
        per_layer = self.kv_bytes_per_token // self.spec.num_layers
        return {"global": (self.spec.num_layers - local) * (rows or self.rows_per_slot) * per_layer,
                "local": local * self.window_ring.rows * per_layer if local else 0}

    def _slot_bytes(self, rows: int) -> int:
        """A slot's K and V bytes when its global layers hold `rows` rows (its local layers their ring)."""
        return sum(self.kv_bytes_by_layer_kind(rows).values())

    def to_dict(self) -> dict:
        return {"format_version": FORMAT_VERSION, "snapcompile_version": __version__,
                "model": {"name": self.model_name, "source": self.source, **self.spec.to_dict()},
                "export": self.export.to_dict(), "policy": self.policy.to_dict(),
                "lowering": self.lowering, "prefill_order": self.prefill_order, "chat": self.chat,
                "eos_token_ids": self.eos_token_ids,
                "graphs": self.graphs, "ort_graphs": self.ort_graphs, "weights_file": WEIGHTS, "passes": self.passes,
                "files": self.files,
                "weights_report": self.weights_report,
                "versions": {name: _version(name) for name in ("onnx", "onnxruntime", "torch", "transformers")}}

    @classmethod
    def from_dict(cls, d: dict) -> Manifest:
        model = dict(d["model"])
        name = model.pop("name")
        source = model.pop("source", name)
        return cls(model_name=name, spec=ModelSpec.from_dict(model), export=ExportConfig.from_dict(d["export"]),
                   policy=PolicyConfig.from_dict(d["policy"]), graphs=d["graphs"], chat=d["chat"],
                   eos_token_ids=d["eos_token_ids"], passes=d.get("passes", []),
                   lowering=d.get("lowering", "standard"), source=source, files=d["files"],
                   weights_report=d["weights_report"], ort_graphs=d["ort_graphs"])

    def support_files(self) -> list[str]:
        """The files other than graphs and weights (the tokenizer's)."""
        return sorted(name for name in self.files if name not in (WEIGHTS, ORT_WEIGHTS) and not name.endswith(".onnx"))

    def ort_graph_of(self, name: str) -> str | None:
        """The ONNX Runtime graph static graph `name` runs on, None for one that runs on its own file."""
        return next((ort for ort, entry in self.ort_graphs.items() if name in entry["members"]), None)


def _version(package: str) -> str | None:
    try:
        return metadata.version(package).split("+")[0]
    except metadata.PackageNotFoundError:
        return None


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
        text = path.read_bytes()
    except FileNotFoundError:
        raise SnapcompileError(f"{folder} has no {MANIFEST}: not a snapcompile artifact") from None
    raw = parse_json(text, f"{path} (corrupt)")
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
    if raw.get("prefill_order") != manifest.prefill_order:
        raise SnapcompileError(f"{path}: prefill_order {raw.get('prefill_order')!r} does not match its policy and "
                               f"lowering ({manifest.prefill_order!r}); convert it again")
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
    _check_ort_graphs(manifest, path)
    if WEIGHTS not in files:
        raise SnapcompileError(f"{path}: {WEIGHTS} is not listed in the files table")


def _check_ort_graphs(manifest: Manifest, path: Path) -> None:
    """The ONNX Runtime graphs are exactly those of the shapes, policy and lowering (naming.ort_graphs),
    each in its listed file, with its members and the size they differ in."""
    expected = ort_graphs(manifest.export, manifest.policy, manifest.lowering, manifest.spec.num_layers)
    if not isinstance(manifest.ort_graphs, dict) or set(manifest.ort_graphs) != set(expected):
        raise SnapcompileError(f"{path}: the ONNX Runtime graphs of this artifact are {', '.join(sorted(expected))}; "
                               "convert it again")
    for name, members in expected.items():
        entry = manifest.ort_graphs[name]
        size = ort_size(name, manifest.spec.local_layers)
        wanted = {"file": ort_file(name), "members": members,
                  "size": None if size is None else {"name": size.name, "source": size.source, "axis": size.axis}}
        if not isinstance(entry, dict) or {key: entry.get(key) for key in wanted} != wanted \
                or entry["file"] not in manifest.files:
            raise SnapcompileError(f"{path}: ONNX Runtime graph {name} must be the listed file {ort_file(name)} "
                                   "serving its family's graphs; refused")


def _plain_file_name(name) -> bool:
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
            and "\0" not in name and name != MANIFEST)
