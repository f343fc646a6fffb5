"""What an artifact costs in memory to run, from its manifest alone (before anything is allocated).

The figure is the resident memory (RSS) of a process running the artifact on ONNX Runtime's CPU
provider at its worst: every slot full, a prompt of max_context tokens. Its parts, in bytes:

- slot_caches, prefill_caches: the backend's cache arrays, float32 or float16 (`--kv-dtype`)
  (runtime/backend.py, prefill.py, prompt_cache.py; a layer-by-layer prefill's one layer of prompt
  rows and the prompt's hidden states, runtime/layer_prefill.py);
- packed_weights: the linear layers and the LM head in the layout ONNX Runtime's kernels pre-pack
  them to, once per process whatever the number of graphs (runtime/ort_capi.py). Measured on
  MatMulNBits at accuracy level 4 (`studies/open_memory.py`, docs/results/memory.md): bits/8 bytes
  a weight plus 12 bytes a block (the block's scale, its sum for the int8 path and the int8
  scale) and 0.027 bytes a weight (measured, not explained); a float32 MatMul packs a copy of the
  same size, float16 weights too (they are multiplied in float32, from the float32 form the export
  writes to ort_weights.bin);
- resident_weights: pages of weights.bin a running process holds (both weight files' pages are
  released as each session is made, and weights.bin's again after every prefill chunk and every 32
  decode steps): the embedding rows read since, each with the 64 KiB the kernel maps around a
  faulting page;
- opened_graphs: each weight-bearing session (kernels, execution plan), per layer: one for each of ONNX
  Runtime's graphs the process opens (naming.ort_graphs: a family of bucket graphs each, and the
  tail; layer by layer, one session a layer);
- work_space: the shared arena, set by the attention of a chunk over max_context rows (the full
  prefill graph runs a long prompt's last chunks): the joined key / value rows and the scores, about
  twice over, and twice that again because the arena grows in doubling steps (ONNX Runtime's
  kNextPowerOfTwo); measured 1.7x the tensors at 1B x 32768 (docs/results/memory.md). A compressed
  artifact's prefill graphs attend a KV head at a time (passes/attention_heads.py): one head's key and
  value slices and joined rows and three of its score tensors, twice (measured 0.91 GiB for 1.25
  predicted at the 8B shape and 131072 rows, docs/results/performance.md);
- tokenizer: the Rust tokenizer `tokenizers` builds from the artifact's tokenizer.json (what `run`
  and `serve` load, models/file_tokenizer.py), about ten times the file's bytes (measured: Gemma 3's
  262144-token vocabulary, a 31.8 MiB file, 295 MiB resident; SmolLM2's 3.4 MiB file, 37 MiB); 0
  until the manifest lists the file (convert's check of the shapes it is asked for);
- runtime: the interpreter and the libraries a `run` process has loaded before opening anything.
"""
from __future__ import annotations

from snapcompile.artifact.manifest import Manifest
from snapcompile.config import HEAD_BITS, QUANT_BITS
from snapcompile.memory import check_fits, gib

RUNTIME_BYTES = 96 * 2**20              # `snapcompile run` before the artifact opens (~75-90 MB measured)
TOKENIZER_RSS_PER_FILE_BYTE = 10        # tokenizers' resident bytes per byte of tokenizer.json (9.3 / 11 measured)
GRAPH_BYTES_PER_LAYER = 2**19         # a weight-bearing session: ~13-16 MiB at 30-32 layers
PACKED_BLOCK_BYTES = 12                 # MatMulNBits' pre-packed extra per block of weights
PACKED_WEIGHT_EXTRA = 0.027             # and per weight: the fit of int4 0.90 / 0.71 / 0.62 and 8-bit
                                        # 1.40 / 1.21 / 1.12 bytes a weight at blocks of 32 / 64 / 128
ARENA_GROWTH = 2                        # the arena extends by doubling: it may hold twice its high-water mark
FAULT_AROUND = 64 * 2**10              # what Linux maps around a file page fault (fault_around_bytes)
RELEASE_EVERY_STEPS = 32                # decode steps between releases of weights.bin's pages (SlotBackend.decode)


def memory_needed(manifest: Manifest) -> dict[str, int]:
    """Bytes of RSS a process running the artifact reaches at most, by purpose (module docstring).
    `convert`'s check uses the same figure from the manifest it is about to write."""
    m, export = manifest, manifest.export
    return {"slot_caches": export.slots * m.kv_bytes_per_slot(),
            "prefill_caches": _prefill_bytes(m),
            "packed_weights": _packed_weight_bytes(m),
            "resident_weights": _resident_weight_bytes(m),
            "opened_graphs": int(_opened_layers(m) * GRAPH_BYTES_PER_LAYER),
            "work_space": _work_space_bytes(m),
            "tokenizer": TOKENIZER_RSS_PER_FILE_BYTE * m.files.get("tokenizer.json", {}).get("bytes", 0),
            "runtime": RUNTIME_BYTES}


def _prefill_bytes(manifest: Manifest) -> int:
    """A prompt's caches while it is prefilled: layer by layer, one layer's rows of a max_context
    prompt and the prompt's hidden states (runtime/layer_prefill.py); chunk by chunk, every layer's
    rows of a compressed prompt (runtime/prompt_cache.py), and for a dense one (prefilled into its
    slot) a copy of the slot's first rows for the bucket graphs."""
    spec, export = manifest.spec, manifest.export
    if manifest.prefill_order == "layers":
        rows = export.max_context + export.chunk
        return export.max_context * manifest.kv_bytes_per_token // spec.num_layers + rows * spec.hidden_size * 4
    rows = export.max_context if manifest.policy.compressed else max(export.prefill_buckets(), default=0)
    return rows * manifest.kv_bytes_per_token * len(spec.global_layers) // spec.num_layers   # a local layer: its ring


def _opened_layers(manifest: Manifest) -> float:
    """Decoder layers of the weight-bearing sessions a process opens (each costs GRAPH_BYTES_PER_LAYER):
    the decode graph's and the prefill's (one session of every layer, or one a layer, and the
    embedding's and head's), the tail's; a select graph's (no weights) about a fifth of one."""
    layers, select = manifest.spec.num_layers, (1 / 5 if manifest.policy.policy == "snapstream" else 0)
    if manifest.prefill_order == "layers":
        return 2 * layers + 2 + select
    return layers * (2 + bool(manifest.export.tail) + select)


def _linear_and_head_weights(manifest: Manifest) -> tuple[int, int]:
    """Weights (elements) of every layer's linear maps, and of the LM head."""
    spec = manifest.spec
    h, q, kv = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    return spec.num_layers * (2 * h * q + 2 * h * kv + 3 * h * spec.intermediate_size), spec.vocab_size * h


def _packed_weight_bytes(manifest: Manifest) -> int:
    export = manifest.export
    linear, head = _linear_and_head_weights(manifest)
    if not export.quantized:            # float16 weights are multiplied as float32 (export/weights.py)
        return 4 * (linear + head)
    per_block = PACKED_BLOCK_BYTES / export.block_size + PACKED_WEIGHT_EXTRA
    return int(linear * (QUANT_BITS[export.weight_format] / 8 + per_block) + head * (HEAD_BITS / 8 + per_block))


def _resident_weight_bytes(manifest: Manifest) -> int:
    spec, export = manifest.spec, manifest.export
    embedding_row = spec.hidden_size * (4 if export.weight_format == "fp32" else 2)
    rows_between_releases = export.chunk + export.slots * RELEASE_EVERY_STEPS   # runtime/backend.py
    return min(spec.vocab_size * embedding_row, rows_between_releases * max(FAULT_AROUND, embedding_row))


def _work_space_bytes(manifest: Manifest) -> int:
    spec, export = manifest.spec, manifest.export
    rows = export.max_context + export.chunk
    if manifest.policy.compressed:      # a KV head at a time (passes/attention_heads.py): its key / value
        decoded = 4 * spec.head_dim * (export.kv_dtype != "float32")          # the slice read back in float32
        slices = 2 * rows * (export.kv_row_bytes(spec.head_dim) + decoded)
        head = slices + 4 * (2 * rows * spec.head_dim + 3 * spec.group_size * export.chunk * rows)  # joined
        return ARENA_GROWTH * head                                                 # rows, three scores
    joined = 2 * spec.num_kv_heads * rows * spec.head_dim
    scores = 2 * spec.num_heads * export.chunk * rows
    return ARENA_GROWTH * 2 * 4 * (joined + scores)


def check_memory(manifest: Manifest, available: int | None = None) -> None:
    """Refuse, before allocating anything, an artifact that needs more memory than is available
    (run and serve check the artifact they open; export checks the shapes it is asked for)."""
    needed = memory_needed(manifest)
    what = (f"the artifact ({gib(needed['slot_caches'])} of KV cache for {manifest.export.slots} slots x "
            f"{manifest.rows_per_slot} rows, {gib(needed['prefill_caches'])} of one prompt's prefill caches for "
            f"{manifest.export.max_context} positions, {gib(needed['packed_weights'] + needed['resident_weights'])} "
            f"of weights as the runtime holds them, {gib(needed['opened_graphs'] + needed['work_space'])} of opened "
            f"graphs and work space, {gib(needed['tokenizer'])} of tokenizer)")
    check_fits(sum(needed.values()), what, "convert with fewer --slots (or --no-slot-buckets) or a smaller "
               "--budget / --max-context", available)
