"""What an artifact costs in memory to run, from its manifest alone (before anything is allocated)."""
from __future__ import annotations

from snapcompile.artifact.manifest import Manifest
from snapcompile.memory import check_fits, gib


def memory_needed(manifest: Manifest, weight_bytes: int | None = None) -> dict[str, int]:
    """Bytes the backend allocates for an artifact, by purpose (an estimate that leaves out the
    runtime's own work space): the slot caches, the one-prompt prefill caches, the weights
    (weight_bytes, or the artifact's weights.bin) and one pre-packed copy of them, which every
    ONNX Runtime session of the process shares whatever the number of graphs (runtime/ort_capi.py;
    weights.bin's own pages are released as each session is made)."""
    m, per_token = manifest, manifest.spec.kv_bytes_per_token
    prefill_rows = m.export.max_context if m.policy.compressed else 0
    prefill_rows += max(m.export.prefill_buckets(), default=0)
    weights = m.files.get("weights.bin", {}).get("bytes", 0) if weight_bytes is None else weight_bytes
    return {"slot_caches": m.export.slots * m.rows_per_slot * per_token,
            "prefill_caches": prefill_rows * per_token, "weights": weights,
            "packed_weights": weights}


def check_memory(manifest: Manifest, available: int | None = None, weight_bytes: int | None = None) -> None:
    """Refuse, before allocating anything, an artifact that needs more memory than is available
    (run and serve check the artifact they open; export checks the shapes it is asked for)."""
    needed = memory_needed(manifest, weight_bytes)
    what = (f"the artifact ({gib(needed['slot_caches'])} of KV cache for {manifest.export.slots} slots x "
            f"{manifest.rows_per_slot} rows, {gib(needed['prefill_caches'])} of one prompt's prefill caches for "
            f"{manifest.export.max_context} positions, {gib(needed['weights'] + needed['packed_weights'])} of "
            "weights with their pre-packed copy)")
    check_fits(sum(needed.values()), what, "convert with fewer --slots (or --no-slot-buckets) or a smaller "
               "--budget / --max-context", available)
