"""Which graphs an artifact holds and what they are called: "prefill", "decode", "select", the
buckets "<kind>_<rows>" over fewer cache rows, the decode graphs "decode_<slots>" for fewer
slots, and "prefill_tail" (a prefill of export.tail tokens): the static graphs. Beside them the
graphs ONNX Runtime opens (`ort_graphs`): one a family, its size symbolic, and the tail. Pure
functions of the export shapes, the policy and the lowering."""
from __future__ import annotations

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


def ort_graphs(export: ExportConfig, policy: PolicyConfig, lowering: str = "standard") -> dict[str, dict]:
    """ONNX Runtime graph name -> {static member name: its size} (None: the graph is its one member's, not
    symbolic). A family's members run on its one graph; the plugin lowering's decode and select graphs
    (custom ops) are not among them and run on their own static files."""
    static = expected_graphs(export, policy)
    families = ["prefill"] + (["decode"] if lowering == "standard" else [])
    if policy.policy == "snapstream" and lowering == "standard":
        families.append("select")
    graphs = {family: {name: size for size, name in family_members(family, static, export).items()}
              for family in families}
    if TAIL_GRAPH in static:
        graphs[TAIL_GRAPH] = {TAIL_GRAPH: None}
    return graphs


def ort_file(name: str) -> str:
    """The file of ONNX Runtime graph `name`."""
    return f"ort_{name}.onnx"
