"""Runs evaluation cases through the artifacts users deploy.

Artifacts are built once per configuration and cached (a dense export per model and shape set,
compressed ones derived from it). Retrieval cases run through the Engine with continuous
batching; fidelity cases run dense greedy continuations and teacher-force them through each
policy's backend to compare next-token distributions. Every finished case is appended to a
`.partial.jsonl` file beside the results, so an interrupted run resumes where it stopped.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np

from snapcompile.artifact.cache import ArtifactCache
from snapcompile.artifact.manifest import read_manifest
from snapcompile.config import ExportConfig, PolicyConfig
from snapcompile.errors import SnapcompileError
from snapcompile.evaluation.tasks import TASKS, Case, make_cases

ANSWER_TOKENS = 16
FIDELITY_TOKENS = 64
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
    chunk: int = 256
    scope: str = "head"              # SnapStream selection scope (head | layer)
    ratios: tuple[int, ...] = ()     # compression ratios: budget = length // ratio, per length
    weight_format: str = "fp32"      # --weights of every artifact (fidelity's reference stays fp32 dense)

    def __post_init__(self):
        if self.task not in TASKS:
            raise SnapcompileError(f"unknown task {self.task!r}; choose one of {', '.join(TASKS)}")
        if not self.lengths or min(self.lengths) < 64:
            raise SnapcompileError("--lengths must be token counts >= 64")
        if any(not 0.0 <= d <= 1.0 for d in self.depths):
            raise SnapcompileError("--depths must lie in [0, 1]")
        if self.samples < 1:
            raise SnapcompileError("--samples must be >= 1")
        if any(r < 2 for r in self.ratios):
            raise SnapcompileError("--ratios must be integers >= 2 (budget = length // ratio)")
        if not self.budgets and not self.ratios and set(self.policies) != {"dense"}:
            raise SnapcompileError("give --budgets or --ratios for the compressed policies")

    @property
    def max_context(self) -> int:
        extra = FIDELITY_TOKENS if self.task == "fidelity" else ANSWER_TOKENS
        return max(self.lengths) + extra + 8

    @property
    def export(self) -> ExportConfig:
        """The shapes of every artifact this evaluation runs."""
        return ExportConfig(slots=self.slots, max_context=self.max_context, chunk=self.chunk,
                            weight_format=self.weight_format)

    @property
    def reference_export(self) -> ExportConfig:
        """Fidelity's reference: the dense artifact with fp32 weights."""
        return replace(self.export, weight_format="fp32")

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


def policy_for(name: str, budget: int | None, scope: str = "head") -> PolicyConfig:
    if name == "dense":
        return PolicyConfig(policy="dense")
    return PolicyConfig(policy=name, budget=budget, scope=scope if name == "snapstream" else "head")


def partial_path(results_path: Path) -> Path:
    """Where an unfinished run keeps its records (removed once the results file is written)."""
    return Path(str(results_path) + ".partial.jsonl")


class ResultStore:
    """Finished case records: those of the results file of an earlier run, and those of an
    interrupted run, appended one JSON line each to the partial file (the resume point).

    A run may reuse the records of an earlier run that differs only in its grid (policies, budgets,
    ratios, depths, samples, lengths up to the same longest): a record depends only on its case,
    policy and budget, and on the fields in `_SAME_RESULTS`, which must match."""

    def __init__(self, results_path: Path, config: EvalConfig):
        self.path = partial_path(results_path)
        self.config_json = json.dumps(asdict(config), sort_keys=True)
        self.records: dict[str, dict] = {}
        self._load_results(Path(results_path), config)
        if self.path.is_file():
            lines = self.path.read_text().splitlines()
            self._check_config(json.loads(lines[0]) if lines else {}, config, self.path)
            for line in lines[1:]:
                if line.strip():
                    record = json.loads(line)
                    self.records[record["id"]] = record

    def _load_results(self, path: Path, config: EvalConfig) -> None:
        if not path.is_file():
            return
        try:
            payload = json.loads(path.read_text(encoding="utf-8"))
            stored, records = payload["config"], payload["records"]
        except (ValueError, TypeError, KeyError):
            raise SnapcompileError(f"{path} exists and is not a results file of `snapcompile eval`; "
                                   "choose another -o") from None
        self._check_config(stored, config, path)
        self.records.update((record["id"], record) for record in records)

    @staticmethod
    def _check_config(stored: dict, config: EvalConfig, path: Path) -> None:
        if not _same_results(stored, config):
            raise SnapcompileError(f"{path} holds results of another model, task, seed, scope or "
                                   "artifact shape: delete it or change -o")

    @staticmethod
    def record_id(case: Case, policy: str, budget: int | None) -> str:
        return f"{policy}@{budget or '-'}/{case.key}"

    def done(self, case: Case, policy: str, budget: int | None) -> bool:
        return self.record_id(case, policy, budget) in self.records

    def add(self, record: dict) -> None:
        self.records[record["id"]] = record
        if not self.path.is_file():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(self.config_json + "\n")
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record) + "\n")


_SAME_RESULTS = ("source", "task", "seed", "slots", "chunk", "scope", "weight_format")


def _same_results(stored: dict, config: EvalConfig) -> bool:
    """Whether records stored under configuration `stored` are valid for `config`: same fields of
    `_SAME_RESULTS` (those it predates count as their defaults) and the same artifact shape (its
    longest length)."""
    current = json.loads(json.dumps(asdict(config)))
    defaults = json.loads(json.dumps({f.name: f.default for f in fields(EvalConfig) if f.default is not MISSING}))
    same = all(stored.get(k, defaults.get(k)) == current[k] for k in _SAME_RESULTS)
    return same and max(stored.get("lengths") or [0]) == max(config.lengths)


def run_eval(config: EvalConfig, results_path: Path, cache_dir: Path, progress=None,
             log: Callable[[str], None] = print) -> list[dict]:
    """Run every pending case; returns all records (finished earlier or now)."""
    from snapcompile.models.tokenizer import load_tokenizer
    export = config.export
    cache = ArtifactCache(config.source, cache_dir, log)
    dense_dir = cache.dense(export)
    chat = read_manifest(dense_dir).chat and config.task != "fidelity"
    tokenizer = load_tokenizer(dense_dir)
    cases = make_cases(config.task, tokenizer, config.lengths, config.depths, config.samples, config.seed, chat)
    store = ResultStore(results_path, config)
    cells = {(p, b): [c for c in cases if config.applies(p, b, c)] for p, b in config.runs()}
    pending = {(p, b): [c for c in applied if not store.done(c, p, b)] for (p, b), applied in cells.items()}
    if progress:
        progress(sum(map(len, cells.values())) - sum(map(len, pending.values())), sum(map(len, cells.values())))
    if config.task == "fidelity":
        _run_fidelity(config, cases, pending, cache, store, tokenizer, progress)
    else:
        for (policy, budget), todo in pending.items():
            if todo:
                folder = cache.get(export, policy_for(policy, budget, config.scope))
                _run_retrieval(folder, todo, policy, budget, chat, store, progress)
    ids = [store.record_id(c, p, b) for (p, b), applied in cells.items() for c in applied]
    return [store.records[i] for i in ids if i in store.records]


def _run_retrieval(folder: Path, cases: list[Case], policy: str, budget: int | None, chat: bool,
                   store: ResultStore, progress) -> None:
    from snapcompile.engine.engine import Engine
    from snapcompile.engine.request import Request
    engine = Engine.from_artifact(folder)
    by_id = {}
    for case in cases:
        request = Request(engine.encode(case.prompt, chat), max_new_tokens=ANSWER_TOKENS,
                          request_id=store.record_id(case, policy, budget), top_logprobs=TOP_LOGPROBS)
        by_id[request.request_id] = (case, request)
    for event in engine.stream([r for _, r in by_id.values()]):
        if not event.finished:
            continue
        case, _ = by_id[event.request_id]
        result = engine.result(event.request_id)
        correct = result.error is None and case.answer in result.text
        store.add({"id": event.request_id, "policy": policy, "budget": budget, **case.to_dict(),
                   "prompt_tokens": result.prompt_tokens, "text": result.text, "error": result.error,
                   "correct": correct,
                   "answer_margin": answer_margin(engine.tokenizer, result, case.answer) if correct else None})
        if progress:
            progress(1, None)


def answer_margin(tokenizer, result, answer: str) -> float | None:
    """How firmly the answer was chosen: over the generated tokens that spell `answer` (its first
    occurrence in result.text), the least gap between the probabilities of the likeliest and the
    second likeliest token (0..1; near 0: a coin toss between two continuations). None when the
    answer is absent or the result carries no top_logprobs."""
    import math
    start = result.text.find(answer)
    if start < 0 or not answer or len(result.top_logprobs) < len(result.output_ids):
        return None
    end, gaps, emitted = start + len(answer), [], 0
    for step, top in enumerate(result.top_logprobs):
        text = tokenizer.decode(result.output_ids[:step + 1], skip_special_tokens=True)
        if emitted < end and len(text) > start and len(top) >= 2:
            gaps.append(math.exp(top[0][1]) - math.exp(top[1][1]))
        emitted = len(text)
        if emitted >= end:
            break
    return min(gaps) if gaps else None


def _run_fidelity(config: EvalConfig, cases: list[Case], pending: dict, cache: ArtifactCache, store: ResultStore,
                  tokenizer, progress) -> None:
    """pending: (policy, budget) -> the cases still to run for it."""
    from snapcompile.prompts import encode
    from snapcompile.runtime.ort_backend import OrtBackend
    if not any(pending.values()):
        return
    dense_backend = OrtBackend(cache.dense(config.reference_export))
    prompts = {c.key: encode(tokenizer, c.prompt, chat=False) for c in cases}
    dense = {c.key: _teacher_forced(dense_backend, prompts[c.key], None) for c in cases
             if any(c in todo for todo in pending.values())}
    del dense_backend
    for (policy, budget), todo in pending.items():
        if not todo:
            continue
        policy_config = policy_for(policy, budget, config.scope)
        quantized_dense = policy == "dense" and config.weight_format != "fp32"
        backend = OrtBackend(cache.get(config.export, policy_config)) if policy != "dense" or quantized_dense else None
        for case in todo:
            tokens, reference = dense[case.key]
            logits = reference if backend is None else _teacher_forced(backend, prompts[case.key], tokens)[1]
            store.add({"id": store.record_id(case, policy, budget), "policy": policy, "budget": budget,
                       **case.to_dict(), "prompt_tokens": len(prompts[case.key]),
                       "agreement": float(np.mean(np.argmax(logits, -1) == tokens)),
                       "kl": float(np.mean(_kl(reference, logits)))})
            if progress:
                progress(1, None)


def _teacher_forced(backend, prompt: list[int], tokens: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Greedy continuation (tokens None) or teacher-forced logits; returns (tokens, logits [S, V])."""
    result = backend.prefill(0, prompt)
    logits, chosen = [result.logits], []
    for g in range(FIDELITY_TOKENS):
        token = int(np.argmax(logits[-1])) if tokens is None else int(tokens[g])
        chosen.append(token)
        if g == FIDELITY_TOKENS - 1:
            break
        logits.append(backend.decode({0: token}, {0: result.layout.step(g)})[0].copy())
    return np.array(chosen), np.stack(logits)


def _kl(reference: np.ndarray, other: np.ndarray) -> np.ndarray:
    """KL(reference || other) per row of logits [S, V]."""
    def log_softmax(x):
        x = x.astype(np.float64)
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))
    p_log, q_log = log_softmax(reference), log_softmax(other)
    return (np.exp(p_log) * (p_log - q_log)).sum(-1)
