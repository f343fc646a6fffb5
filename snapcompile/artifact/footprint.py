"""What an artifact costs in memory to run, from its manifest alone (before anything is allocated)."""
from __future__ import annotations

from snapcompile.artifact.manifest import Manifest
from snapcompile.artifact.naming import expected_graphs, is_decode_graph, is_prefill_graph
from snapcompile.memory import check_fits, gib


def packed_weight_copies(manifest: Manifest) -> int:
    """Graphs whose ONNX Runtime CPU session keeps a pre-packed copy of the weights: every decode
    graph, and every prefill graph of a quantized artifact (float prefill sessions share the
    memory-mapped weights.bin; `OrtDevice.graph`)."""
    names = expected_graphs(manifest.export, manifest.policy)
    prefill = sum(map(is_prefill_graph, names)) if manifest.export.quantized else 0
    return sum(map(is_decode_graph, names)) + prefill


def memory_needed(manifest: Manifest, weight_bytes: int | None = None) -> dict[str, int]:
    """Bytes the backend allocates for an artifact, by purpose (an estimate that leaves out the
    runtime's own work space): the slot caches, the one-prompt prefill caches, the weights
    (weight_bytes, or the artifact's weights.bin) and the sessions' pre-packed copies of them."""
    m, per_token = manifest, manifest.spec.kv_bytes_per_token
    prefill_rows = m.export.max_context if m.policy.compressed else 0
    prefill_rows += max(m.export.prefill_buckets(), default=0)
    weights = m.files.get("weights.bin", {}).get("bytes", 0) if weight_bytes is None else weight_bytes
    return {"slot_caches": m.export.slots * m.rows_per_slot * per_token,
            "prefill_caches": prefill_rows * per_token, "weights": weights,
            "packed_weights": packed_weight_copies(m) * weights}


def check_memory(manifest: Manifest, available: int | None = None, weight_bytes: int | None = None) -> None:
    """Refuse, before allocating anything, an artifact that needs more memory than is available
    (run and serve check the artifact they open; export checks the shapes it is asked for)."""
    needed = memory_needed(manifest, weight_bytes)
    what = (f"the artifact ({gib(needed['slot_caches'])} of KV cache for {manifest.export.slots} slots x "
            f"{manifest.rows_per_slot} rows, {gib(needed['weights'] + needed['packed_weights'])} of weights with "
            "the sessions' packed copies)")
    check_fits(sum(needed.values()), what, "convert with fewer --slots (or --no-slot-buckets) or a smaller "
               "--budget / --max-context", available)
