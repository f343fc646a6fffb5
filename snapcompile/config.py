"""Frozen configuration records, validated at construction with user-readable errors."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from snapcompile import kv_int8
from snapcompile.errors import SnapcompileError

POLICIES = ("dense", "streamingllm", "snapstream")
POOLINGS = ("max", "avg")
SCOPES = ("head", "layer")
WEIGHT_FORMATS = ("fp32", "fp16", "int8", "int4")   # stored weights: float32, float16, int8 / int4 blocks
LOWERINGS = ("standard", "plugin")   # compressed attention in standard ONNX ops, or custom op nodes
KV_DTYPES = ("float32", "float16", "int8")   # how the KV cache is stored (computed in float32 either way)


@dataclass(frozen=True)
class ExportConfig:
    """Static shapes of the exported graphs.

    slots: N, decode batch slots. max_context: L, positions a sequence may use (prompt +
    generated). chunk: C, prefill chunk length (a prompt is processed C tokens at a time).
    weight_format: how linear layers are stored (WEIGHT_FORMATS); block_size: inputs per quantization
    block (int8 / int4). fp16 linear layers also multiply in float16; norms, attention and graph
    I/O are float32 in every format. kv_dtype: how the KV cache is stored (KV_DTYPES), in the slots
    and in a prompt's rows while it is prefilled; float16 rounds each key and value once, where it
    is stored (passes/kv_dtype.py), int8 each head's row to 8 bits of its own scale (kv_int8.py);
    attention still computes in float32. slot_buckets: decode graphs for fewer active slots too
    (`decode_sizes`).
    """

    slots: int = 4
    max_context: int = 2048
    chunk: int = 64          # a smaller chunk stalls running decodes less; a 4096-token int4 prefill takes
                             # 22.7 s at 64 and 24.7 s at 256 (fp32: 27.7 / 23.9; docs/results/performance.md)
    weight_format: str = "fp32"
    block_size: int = 32
    slot_buckets: bool = True
    tail: int = 32
    kv_dtype: str = "float32"

    def __post_init__(self):
        if self.slots < 1:
            raise SnapcompileError(f"--slots must be >= 1, got {self.slots}")
        if self.chunk < 1:
            raise SnapcompileError(f"--chunk must be >= 1, got {self.chunk}")
        if self.max_context < 2:
            raise SnapcompileError(f"--max-context must be >= 2, got {self.max_context}")
        if self.chunk > self.max_context:
            raise SnapcompileError(
                f"--chunk ({self.chunk}) cannot exceed --max-context ({self.max_context})")
        if not 0 <= self.tail <= self.max_context:
            raise SnapcompileError(f"--tail must be in 0..{self.max_context} (--max-context), got {self.tail}")
        if self.weight_format not in WEIGHT_FORMATS:
            raise SnapcompileError(f"unknown --weights {self.weight_format!r}; "
                                   f"choose one of {', '.join(WEIGHT_FORMATS)}")
        if self.kv_dtype not in KV_DTYPES:
            raise SnapcompileError(f"unknown --kv-dtype {self.kv_dtype!r}; choose one of {', '.join(KV_DTYPES)}")
        if not isinstance(self.block_size, int) or self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise SnapcompileError(f"--block-size must be a power of two >= 16, got {self.block_size}")

    def kv_row_width(self, head_dim: int) -> int:
        """Elements of one head's stored key or value row: head_dim, and int8's scale (kv_int8.py)."""
        return head_dim + (kv_int8.SCALE_BYTES if self.kv_dtype == "int8" else 0)

    def kv_row_bytes(self, head_dim: int) -> int:
        """Bytes of one head's stored key or value row."""
        return self.kv_row_width(head_dim) * np.dtype(self.kv_dtype).itemsize

    @property
    def quantized(self) -> bool:
        """int8 / int4 blocks (not fp32 or fp16)."""
        return self.weight_format in ("int8", "int4")

    def prefill_buckets(self) -> list[int]:
        """Cache rows of the bucket prefill graphs: 2C, 4C, ... while below half a step, then every
        step (L/8 rounded up to whole chunks, at least 2C) up to half a step below max_context
        (a bucket closer to max_context would save too little to be worth its graph).

        A prompt of T tokens runs on the smallest bucket >= T, and each chunk on the smallest
        bucket holding the rows filled before it, so a prompt's chunks follow the causal triangle
        within one step of rows: a 4096-token prompt at C = 64, L = 4320 attends over 1.11x the
        triangle's rows (doubling buckets: 1.37x; docs/results/performance.md)."""
        step = max(2 * self.chunk, -(-self.max_context // (8 * self.chunk)) * self.chunk)
        buckets, rows = [], 2 * self.chunk
        while rows <= step // 2:
            buckets.append(rows)
            rows *= 2
        rows = step
        while rows <= self.max_context - step // 2:
            buckets.append(rows)
            rows += step
        return buckets

    def decode_sizes(self) -> list[int]:
        """Slot counts of the decode graphs: 1, 2, 4, ... below N, and N (N alone without
        slot_buckets). A step whose active slots all lie below k runs on the graph of the
        smallest such k, so a lone request pays a 1-slot step, not an N-slot one."""
        sizes, size = [], 1
        while self.slot_buckets and size < self.slots:
            sizes.append(size)
            size *= 2
        return [*sizes, self.slots]

    def to_dict(self) -> dict:
        """The fields; tail only where it is set and kv_dtype only where it is not float32, so the
        records (and cache keys) of artifacts without them stay what they were before them."""
        d = asdict(self)
        if not self.tail:
            d.pop("tail")
        if self.kv_dtype == "float32":
            d.pop("kv_dtype")
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ExportConfig:
        """An artifact's export record; one written before the tail graph has none (tail 0)."""
        return cls(**{"tail": 0, **d})


QUANT_BITS = {"int8": 8, "int4": 4}   # bits a weight of each quantized --weights format
HEAD_BITS = 8   # the LM head stays 8-bit under int4, as llama.cpp's 4-bit files keep it


# What a session store keeps of a compressed sequence (Engine); the first is the default: `full` is the
# exact one (a resumed turn is selected as if prefilled whole), the others trade answers for memory
# (docs/serving.md, "Conversations").
SESSION_KEEP = ("full", "slot", "quantized")
DEFAULT_SESSION_KEEP = SESSION_KEEP[0]


@dataclass(frozen=True)
class PolicyConfig:
    """The SnapStream cache policy (docs/design.md, "The cache policy").

    budget: B, KV slots per sequence. sinks: S. window: W, observation window (last W prompt
    queries). kernel: K, pooling width (odd). pooling: "max" | "avg". prompt_share: P, slots
    reserved for the compressed prompt; None means B minus a ring of at least B/4.
    scope: "head" (each KV head selects its own positions) or "layer" (one set per layer).
    summaries: M, rows per layer and KV head that sum the rows each selection drops, one per
    summary_segment positions (the last also takes every later position), for a resumed turn's
    new tokens to attend over (docs/design.md, "Summaries of the dropped rows"); they count in
    B: a slot holds B - M rows (`slot_rows`) and the default prompt share is lowered by M.
    (S is the sinks alone.)
    For policy "dense" the budget is ignored (the cache holds max_context positions).
    """

    policy: str = "snapstream"
    budget: int = 512
    sinks: int = 4
    window: int = 32
    kernel: int = 15
    pooling: str = "max"
    prompt_share: int | None = None
    scope: str = "head"
    summaries: int = 0
    summary_segment: int = 128
    resolved_prompt_share: int = field(init=False, default=0)

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise SnapcompileError(f"unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if self.pooling not in POOLINGS:
            raise SnapcompileError(f"unknown pooling {self.pooling!r}; choose max or avg")
        if self.scope not in SCOPES:
            raise SnapcompileError(f"unknown selection scope {self.scope!r}; choose head or layer")
        if self.summaries < 0 or self.summary_segment < 1:
            raise SnapcompileError(f"--summaries must be >= 0 and --summary-segment >= 1 "
                                   f"(got {self.summaries}, {self.summary_segment})")
        if self.policy == "dense":
            if self.summaries:
                raise SnapcompileError("--summaries needs a compressed policy: dense drops no rows")
            object.__setattr__(self, "resolved_prompt_share", 0)
            return
        self._validate_budget()

    def _validate_budget(self):
        b, s, w, rows = self.budget, self.sinks, self.window, self.slot_rows
        if s < 0 or w < 1:
            raise SnapcompileError(f"sinks must be >= 0 and window >= 1 (got sinks={s}, window={w})")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise SnapcompileError(f"--kernel must be a positive odd number, got {self.kernel}")
        if b <= s + w:
            raise SnapcompileError(
                f"budget {b} must exceed sinks + window = {s + w} (nothing would be left to select)")
        ring = max(1, -(-b // 4))
        share = self.prompt_share if self.prompt_share is not None else b - ring - self.summaries
        if self.policy == "streamingllm":
            lowest = s + 1
        else:
            lowest = s + w + 1
        if self.prompt_share is None and share < lowest:
            smallest = next(n for n in range(b, 4 * b + 8 + self.summaries)
                            if n - max(1, -(-n // 4)) - self.summaries >= lowest)
            less = f" less {self.summaries} summary rows" if self.summaries else ""
            raise SnapcompileError(
                f"budget {b} is too small for sinks {s} + window {w}: its prompt share (B minus a ring of B/4{less}) "
                f"would be {share}, below the {lowest} the selection needs; use --budget >= {smallest}, or a smaller "
                "--window, or set --prompt-share")
        if not lowest <= share < rows:
            beside = f" ({b} less {self.summaries} summary rows)" if self.summaries else ""
            raise SnapcompileError(
                f"prompt share {share} must be in [{lowest}, {rows - 1}] for budget {b}{beside} "
                f"(sinks {s}, window {w}) so that at least one slot is selected and one is left for the ring")
        object.__setattr__(self, "resolved_prompt_share", share)

    @property
    def compressed(self) -> bool:
        return self.policy != "dense"

    @property
    def slot_rows(self) -> int:
        """Rows of a slot's cache: the budget less the summary rows (B - M)."""
        return self.budget - self.summaries

    def summary_index(self, positions):
        """The summary row (0 .. M-1) of each position: position // segment, the last for all later."""
        return (positions // self.summary_segment).clip(max=self.summaries - 1)

    @property
    def selection_window(self) -> int:
        """Tokens a resumed turn must prefill anew for its re-selection: the observation window W
        for snapstream, 0 for the policies that select without one."""
        return self.window if self.policy == "snapstream" else 0

    def streaming_positions(self, prompt_len: int) -> list[int]:
        """StreamingLLM's kept prompt positions, ascending: the first S and the most recent P - S."""
        share, sinks = self.resolved_prompt_share, self.sinks
        return [*range(sinks), *range(prompt_len - (share - sinks), prompt_len)]

    def check_against(self, export: ExportConfig) -> None:
        """Reject combinations that the static graphs cannot serve."""
        if not self.compressed:
            return
        if self.budget > export.max_context:
            raise SnapcompileError(
                f"budget {self.budget} exceeds --max-context {export.max_context}; use policy dense instead")
        if self.policy == "snapstream" and self.window > export.chunk:
            raise SnapcompileError(
                f"window {self.window} is longer than the prefill chunk {export.chunk}: "
                "the observation window must fit in one chunk")
        if self.policy == "snapstream" and 0 < export.tail < self.window:
            raise SnapcompileError(
                f"window {self.window} is longer than the tail graph's {export.tail} tokens: convert with "
                f"--tail {self.window} or more (or --tail 0: no tail graph, no --session-keep quantized)")
        if self.summaries and export.kv_dtype == "int8":
            raise SnapcompileError("--summaries sum the dropped rows as numbers, which an int8 KV cache stores with "
                                   "a scale a row (not built): use --kv-dtype float16 or float32")

    def to_dict(self) -> dict:
        """The fields (prompt_share resolved); the summary fields only where summaries are on, so
        the records of artifacts written before them stay what they were."""
        d = asdict(self)
        d["prompt_share"] = self.resolved_prompt_share if self.compressed else None
        d.pop("resolved_prompt_share")
        if not self.summaries:
            d.pop("summaries"), d.pop("summary_segment")
        return d

    @classmethod
    def from_dict(cls, d: dict) -> PolicyConfig:
        return cls(**d)
