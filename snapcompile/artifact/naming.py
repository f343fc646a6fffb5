"""Which graphs an artifact holds and what they are called: "prefill", "decode", "select", the
buckets "<kind>_<rows>" over fewer cache rows, the decode graphs "decode_<slots>" for fewer
slots, and "prefill_tail" (a prefill of export.tail tokens): the static graphs. Beside them the
graphs ONNX Runtime opens (`ort_graphs`): one a family, its size symbolic, and the tail. Pure
functions of the export shapes, the policy and the lowering."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from snapcompile.config import ExportConfig, PolicyConfig

TAIL_GRAPH = "prefill_tail"


def graph_name(kind: str, size: int, full_size: int) -> str:
    """The name of a "prefill" or "select" graph over `size` cache rows (full_size: max_context),
    or of a "decode" graph of `size` slots (full_size: N): `kind` itself for the full size,
    "<kind>_<size>" for a bucket."""
    return kind if size == full_size else f"{kind}_{size}"


def expected_graphs(export: ExportConfig, policy: PolicyConfig) -> set[str]:
    """The graphs an artifact of these shapes and this policy consists of: prefill (with its
    buckets) and decode, plus for snapstream select and one select bucket per prefill bucket of
    more rows than the prompt share (a prompt that fits in P is never selected from); the tail
    prefill graph where export.tail is set."""
    buckets = export.prefill_buckets()
    names = {"prefill", *(graph_name("prefill", rows, export.max_context) for rows in buckets)}
    names |= {TAIL_GRAPH} if export.tail else set()
    names |= {graph_name("decode", slots, export.slots) for slots in export.decode_sizes()}
    if policy.policy == "snapstream":
        names |= {graph_name("select", rows, export.max_context) for rows in select_rows(export, policy)}
    return names


def select_rows(export: ExportConfig, policy: PolicyConfig) -> list[int]:
    """Cache rows of the select graphs: each prefill bucket's rows above the prompt share P, and
    max_context. A prompt prefilled on a bucket is selected from that bucket's cache."""
    share = policy.resolved_prompt_share
    return [*(rows for rows in export.prefill_buckets() if rows > share), export.max_context]


def is_prefill_graph(name: str) -> bool:
    return name in ("prefill", TAIL_GRAPH) or bucket_rows(name) is not None


def is_decode_graph(name: str) -> bool:
    return name == "decode" or bucket_rows(name, "decode") is not None


def decode_graph_size(sizes: list[int], highest_slot: int) -> int:
    """The slots of the decode graph a step runs on whose highest active slot is `highest_slot`:
    the smallest of `sizes` (ExportConfig.decode_sizes) above it."""
    return min((k for k in sizes if k > highest_slot), default=max(sizes))


def bucket_rows(name: str, kind: str = "prefill") -> int | None:
    """The cache rows of a bucket graph "<kind>_<rows>" (the slots of a "decode_<slots>"); None
    for any other graph."""
    prefix, _, rows = name.partition("_")
    return int(rows) if prefix == kind and rows.isdigit() else None


FAMILIES = ("prefill", "select", "decode")    # graphs that differ in one size only: rows, or slots for decode


def family_of(name: str) -> str | None:
    """The family of an artifact graph ("prefill", "select" or "decode"), None for the tail graph
    (its chunk differs too) and anything else."""
    if name == TAIL_GRAPH:
        return None
    kind = name.partition("_")[0]
    return kind if kind in FAMILIES and (name == kind or bucket_rows(name, kind) is not None) else None


def family_members(family: str, names, export: ExportConfig) -> dict[int, str]:
    """size -> graph name of the family's members among `names`: cache rows, slots for decode (the
    graph named `family` itself has max_context rows, or the artifact's slots)."""
    full_size = export.slots if family == "decode" else export.max_context
    members = {}
    for name in names:
        if family_of(name) == family:
            members[full_size if name == family else bucket_rows(name, family)] = name
    return members


@dataclass(frozen=True)
class FamilySize:
    """The size a family's members differ in, as its ONNX Runtime graph leaves it symbolic: `name` (its
    dim_param), read from dimension `axis` of input `source`."""

    name: str
    source: str
    axis: int


FAMILY_SIZES = {"prefill": FamilySize("rows", "past_key.0", 2), "select": FamilySize("rows", "key.0", 2),
                "decode": FamilySize("slots", "cache_len", 0)}
PREFILL_EMBED, PREFILL_HEAD, SELECT_LAYER = "prefill_embed", "prefill_head", "select_layer"
PREFILL_SCORES = "prefill_scores"      # the head over a chunk of positions (a prompt's log probabilities)


def prefill_layer(layer: int) -> str:
    """The ONNX Runtime graph of decoder layer `layer` of the layer-major prefill."""
    return f"prefill_layer_{layer}"


def ort_size(name: str, local_layers=()) -> FamilySize | None:
    """The symbolic size of ONNX Runtime graph `name` (None: a graph of static shapes) of a model whose
    `local_layers` (Gemma 3's sliding-window layers) hold a window ring of fixed rows: the whole model's
    graphs read the size off the first other layer's cache, and a local layer's own graph has none."""
    if name == SELECT_LAYER:
        return FAMILY_SIZES["select"]
    if name.startswith("prefill_layer_"):
        return None if int(name.rpartition("_")[2]) in local_layers else FAMILY_SIZES["prefill"]
    size = FAMILY_SIZES.get(name)
    if size is None or name == "decode" or not local_layers:
        return size
    first = next(i for i in itertools.count() if i not in local_layers)
    return FamilySize(size.name, size.source.replace(".0", f".{first}"), size.axis)


def layer_major(lowering: str, compressed: bool) -> bool:
    """Whether ONNX Runtime prefills a compressed prompt a layer at a time (every layer's graph of its
    own; one layer's prompt KV held at once): with the standard lowering. The plugin lowering's
    select graphs are one custom-op graph for every layer, and a dense prompt is prefilled into its
    slot, so those prefill chunk by chunk through the whole model."""
    return lowering == "standard" and compressed


def ort_graphs(export: ExportConfig, policy: PolicyConfig, lowering: str, layers: int) -> dict[str, dict]:
    """ONNX Runtime graph name -> {member name: its size} (None: the graph is its one member's, not
    symbolic). A family's members (static graphs, or for the layer graphs the names "<graph>_<rows>"
    of the prefill buckets and max_context) run on its one graph; the plugin lowering's decode and
    select graphs (custom ops) are not among them and run on their own static files.

    The chunk-by-chunk prefill: the prefill family, the tail, and for snapstream the select family.
    With the standard lowering also the layer-by-layer one (`layer_major`): prefill_embed, one
    prefill_layer_<i> for each of the `layers` decoder layers, prefill_head, prefill_scores (the head
    over a chunk of positions, run only for a prompt's log probabilities), and for snapstream
    select_layer (one layer's selection). A dense artifact, the passes' input, holds the layer graphs
    too: the lowering is chosen when it is compressed."""
    static = expected_graphs(export, policy)
    graphs = {"prefill": _members("prefill", static, export)}
    if TAIL_GRAPH in static:
        graphs[TAIL_GRAPH] = {TAIL_GRAPH: None}
    if lowering != "standard":
        return graphs
    graphs["decode"] = _members("decode", static, export)
    if policy.policy == "snapstream":
        graphs["select"] = _members("select", static, export)
    rows = [*export.prefill_buckets(), export.max_context]
    graphs[PREFILL_EMBED], graphs[PREFILL_HEAD] = {PREFILL_EMBED: None}, {PREFILL_HEAD: None}
    graphs[PREFILL_SCORES] = {PREFILL_SCORES: None}
    for layer in range(layers):
        graphs[prefill_layer(layer)] = {graph_name(prefill_layer(layer), r, export.max_context): r for r in rows}
    if policy.policy == "snapstream":
        graphs[SELECT_LAYER] = {graph_name(SELECT_LAYER, r, export.max_context): r for r in select_rows(export, policy)}
    return graphs


def _members(family: str, static, export: ExportConfig) -> dict[str, int]:
    return {name: size for size, name in family_members(family, static, export).items()}


def ort_file(name: str) -> str:
    """The file of ONNX Runtime graph `name`."""
    return f"ort_{name}.onnx"
