"""What an evaluation runs: the task, the (policy, budget) grid, the case lengths and the artifact shapes."""
from __future__ import annotations

from dataclasses import dataclass, replace

from snapcompile.config import ExportConfig, PolicyConfig
from snapcompile.errors import SnapcompileError
from snapcompile.evaluation.tasks import TASKS, Case

ANSWER_TOKENS = 16          # generated per retrieval case
FIDELITY_TOKENS = 64        # greedy tokens compared per fidelity case (the default of --generate)
RECALL_CUE, RECALL_TOKENS = 16, 32   # the recall probe: the generation's first 16 tokens quoted, the next 32 scored
TOP_LOGPROBS = 2            # per answer token: enough for the margin between the two likeliest


@dataclass(frozen=True)
class EvalConfig:
    source: str                      # model name/path, or a dense artifact folder
    task: str
    policies: tuple[str, ...]
    budgets: tuple[int, ...]
    lengths: tuple[int, ...]
    depths: tuple[float, ...]
    samples: int
    seed: int
    slots: int = 4
    chunk: int = ExportConfig.chunk          # the product's own shapes (convert's default)
    scope: str = "head"              # SnapStream selection scope (head | layer)
    kernel: int = PolicyConfig.kernel  # SnapStream's pooling kernel K
    ratios: tuple[int, ...] = ()     # compression ratios: budget = length // ratio, per length
    weight_format: str = "fp32"      # --weights of every artifact (fidelity's reference stays fp32 dense)
    block_size: int = ExportConfig.block_size  # inputs per int8/int4 quantization block
    kv_dtype: str = ExportConfig.kv_dtype      # --kv-dtype of every artifact (fidelity's reference: float32)
    generate: int = FIDELITY_TOKENS  # fidelity: greedy tokens generated and compared per case

    def __post_init__(self):
        if self.task not in TASKS:
            raise SnapcompileError(f"unknown task {self.task!r}; choose one of {', '.join(TASKS)}")
        if not self.lengths or min(self.lengths) < 64:
            raise SnapcompileError("--lengths must be token counts >= 64")
        if any(not 0.0 <= d <= 1.0 for d in self.depths):
            raise SnapcompileError("--depths must lie in [0, 1]")
        PolicyConfig(kernel=self.kernel)      # raises on a kernel the policy refuses
        ExportConfig(block_size=self.block_size, kv_dtype=self.kv_dtype)   # raises on what the export refuses
        if self.generate < RECALL_CUE + RECALL_TOKENS:
            raise SnapcompileError(f"--generate must be >= {RECALL_CUE + RECALL_TOKENS} tokens")
        if self.samples < 1:
            raise SnapcompileError("--samples must be >= 1")
        if any(r < 2 for r in self.ratios):
            raise SnapcompileError("--ratios must be integers >= 2 (budget = length // ratio)")
        if not self.budgets and not self.ratios and set(self.policies) != {"dense"}:
            raise SnapcompileError("give --budgets or --ratios for the compressed policies")

    @property
    def max_context(self) -> int:
        extra = self.generate + RECALL_CUE + RECALL_TOKENS if self.task == "fidelity" else ANSWER_TOKENS
        return max(self.lengths) + extra + 8

    @property
    def export(self) -> ExportConfig:
        """The shapes of every artifact this evaluation runs."""
        return ExportConfig(slots=self.slots, max_context=self.max_context, chunk=self.chunk,
                            weight_format=self.weight_format, block_size=self.block_size, kv_dtype=self.kv_dtype)

    @property
    def reference_export(self) -> ExportConfig:
        """Fidelity's reference: the dense artifact with fp32 weights and a float32 cache."""
        return replace(self.export, weight_format="fp32", block_size=ExportConfig.block_size, kv_dtype="float32")

    def budgets_for(self, length: int) -> list[int]:
        """Budgets evaluated at `length`: the fixed budgets below it (a budget >= the prompt
        compresses nothing) and length // ratio for each ratio."""
        return sorted({b for b in self.budgets if b < length} | {length // r for r in self.ratios})

    def runs(self) -> list[tuple[str, int | None]]:
        """(policy, budget) pairs; dense has no budget and runs first."""
        pairs = [("dense", None)] if "dense" in self.policies or self.task == "fidelity" else []
        budgets = sorted({b for length in self.lengths for b in self.budgets_for(length)})
        return pairs + [(p, b) for p in self.policies if p != "dense" for b in budgets]

    def applies(self, policy: str, budget: int | None, case: Case) -> bool:
        """Whether the (policy, budget) cell is evaluated on `case`."""
        return policy == "dense" or budget in self.budgets_for(case.length)


def policy_for(name: str, budget: int | None, scope: str = "head", kernel: int = PolicyConfig.kernel,
               prompt_share: int | None = None, summaries: int = 0,
               summary_segment: int = PolicyConfig.summary_segment) -> PolicyConfig:
    """The policy of one cell of the grid (the selection scope and kernel apply to snapstream only;
    prompt_share None: B minus a ring of B/4, less the summary rows)."""
    if name == "dense":
        return PolicyConfig(policy="dense")
    snapstream = name == "snapstream"
    return PolicyConfig(policy=name, budget=budget, scope=scope if snapstream else "head",
                        kernel=kernel if snapstream else PolicyConfig.kernel, prompt_share=prompt_share,
                        summaries=summaries, summary_segment=summary_segment)
