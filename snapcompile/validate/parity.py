"""Parity of an artifact against the PyTorch oracle (the HF model with the same cache policy).

Both sides are teacher-forced with the oracle's greedy tokens, so logits stay comparable step
by step. For compressed artifacts the selected prompt positions are compared too; a position
set that differs only by near-tied scores (gap below `tie_gap`) is reported, not failed, and
the oracle then continues with the backend's selection.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from snapcompile.config import PolicyConfig
from snapcompile.errors import SnapcompileError
from snapcompile.reference.oracle import ReferenceSequence
from snapcompile.runtime import open_backend
from snapcompile.runtime.backend import drain
from snapcompile.sessions.keepers import keeper_for
from snapcompile.sessions.kept import plan_resume
from snapcompile.sessions.restore import kept_positions, prompt_reading, resumed_prefill, slot_entry
from snapcompile.validate.tolerances import DEFAULT_TIE_GAP


@dataclass
class PromptReport:
    prompt_tokens: int
    compressed: bool
    step_max_diff: list[float] = field(default_factory=list)
    agreements: list[bool] = field(default_factory=list)
    near_ties: list[dict] = field(default_factory=list)
    selection_mismatches: list[dict] = field(default_factory=list)
    dense_max_diff: float | None = None      # vs dense attention, where everything fits the budget
    turn: int = 1                            # the conversation's turn (validate --turns); 2.. resumed
    resumed_tokens: int = 0                  # tokens of this turn taken from the kept cache


def oracle_model(folder, manifest):
    """The HF model the artifact was exported from, holding exactly the artifact's weights: for
    fp16 / int8 / int4 artifacts the (dequantized) values its graphs hold, read back from the decode
    graph; for fp16 its linear layers also round their input and product to float16 as the graph does."""
    from snapcompile.artifact.onnx_io import load_graph
    from snapcompile.export.weights import graph_weights, load_graph_weights, round_linears_to_half
    from snapcompile.models import load_model
    model = load_model(manifest.source or manifest.model_name).model
    if manifest.export.weight_format != "fp32":
        decode = load_graph(folder, manifest, "decode", with_weights=True)
        load_graph_weights(model, graph_weights(decode, manifest.spec))
    if manifest.export.weight_format == "fp16":
        round_linears_to_half(model)
    return model


def compare_selection(backend_kept: list[np.ndarray], reference, tie_gap: float) -> tuple[list, list]:
    """Per layer/head: positions kept by only one side; near-ties when the score gap < tie_gap."""
    ties, mismatches = [], []
    for layer, (ours, theirs) in enumerate(zip(backend_kept, reference)):
        if theirs is None or ours is None:   # nothing selected (all fit, or a local layer's window ring)
            continue
        theirs_idx = theirs.indices.numpy()
        for head in range(ours.shape[0]):
            only_ours = sorted(set(ours[head].tolist()) - set(theirs_idx[head].tolist()))
            only_theirs = sorted(set(theirs_idx[head].tolist()) - set(ours[head].tolist()))
            if not only_ours and not only_theirs:
                continue
            entry = {"layer": layer, "head": head, "kept_by_backend": only_ours,
                     "kept_by_reference": only_theirs}
            if theirs.scores is None:
                mismatches.append(entry)
                continue
            scores = theirs.scores[head].double()
            gap = float((scores[only_theirs].max() - scores[only_ours].min()).abs()) \
                if only_ours and only_theirs else float("inf")
            entry["score_gap"] = gap
            (ties if gap < tie_gap else mismatches).append(entry)
    return ties, mismatches


def _no_progress(units: int, what: str) -> None: ...


class Validator:
    def __init__(self, folder, model, provider: str = "cpu", tie_gap: float = DEFAULT_TIE_GAP,
                 backend: str = "ort", exact_matmul: bool = True):
        self.backend = open_backend(folder, backend, provider=provider, exact_matmul=exact_matmul)
        self.manifest = self.backend.manifest
        self.model, self.tie_gap = model, tie_gap
        self._progress = _no_progress          # the running validation's progress(units, what)

    def work(self, prompts: int, steps: int, turns: int = 1) -> int:
        """The units `run` (turns 1) or `run_turns` reports to its progress: a prompt's (or a turn's)
        prefill on both sides is one, a decode step of a batch (of a conversation) one."""
        if turns > 1:
            return prompts * turns * (1 + steps)
        return prompts + -(-prompts // self.backend.slots) * steps

    def run(self, prompts: list[list[int]], steps: int, progress=None) -> list[PromptReport]:
        """prompts: token ids. Runs them N slots at a time; `progress(n, what)` after each unit of
        `work` (what: the unit just done, in words)."""
        reports = []
        slots = self.backend.slots
        self._progress = progress or _no_progress
        for first in range(0, len(prompts), slots):
            reports += self._run_batch(prompts[first:first + slots], steps)
        return reports

    def _reference(self, prompt_len: int, steps: int, forced=None) -> ReferenceSequence:
        policy = self.manifest.policy
        rows_per_slot = self.backend.rows_per_slot if policy.compressed else prompt_len + steps + 1
        return ReferenceSequence(self.model, policy, rows_per_slot, forced)

    def _run_batch(self, prompts: list[list[int]], steps: int) -> list[PromptReport]:
        refs, reports, layouts, ref_logits, our_logits = [], [], [], [], []
        for slot, ids in enumerate(prompts):
            result = self.backend.prefill(slot, ids)
            report = PromptReport(len(ids), result.layout.compressed)
            ref = self._reference(len(ids), steps)
            logits = ref.feed(ids)
            if result.kept_rows is not None:           # a fresh prompt: its rows are its positions
                report.near_ties, report.selection_mismatches = compare_selection(
                    result.kept_rows, ref.selections(), self.tie_gap)
                if report.near_ties and not report.selection_mismatches:
                    forced = [None if k is None else torch.from_numpy(k) for k in result.kept_rows]
                    ref = self._reference(len(ids), steps, forced)
                    logits = ref.feed(ids)
            refs.append(ref)
            reports.append(report)
            layouts.append(result.layout)
            ref_logits.append(logits.numpy())
            our_logits.append(result.logits)
            self._progress(1, f"prefilled a {len(ids)}-token prompt")
        dense = self._dense_references(prompts, steps)
        dense_logits = [d.feed(ids).numpy() if d else None for d, ids in zip(dense, prompts)]
        for g in range(steps + 1):
            tokens = {}
            for i, report in enumerate(reports):
                report.step_max_diff.append(float(np.abs(our_logits[i] - ref_logits[i]).max()))
                report.agreements.append(int(np.argmax(our_logits[i])) == int(np.argmax(ref_logits[i])))
                if dense_logits[i] is not None:
                    diff = float(np.abs(our_logits[i] - dense_logits[i]).max())
                    report.dense_max_diff = max(report.dense_max_diff or 0.0, diff)
                tokens[i] = int(np.argmax(ref_logits[i]))
            if g == steps:
                break
            logits = self.backend.decode(tokens, {i: layouts[i].step(g) for i in tokens})
            for i in tokens:
                our_logits[i] = logits[i].copy()
                ref_logits[i] = refs[i].feed([tokens[i]]).numpy()
                if dense[i] is not None:
                    dense_logits[i] = dense[i].feed([tokens[i]]).numpy()
            self._progress(1, f"decode step {g + 1} of {steps}")
        return reports

    def run_turns(self, prompts: list[list[int]], steps: int, turns: int, follow_up: list[int],
                  progress=None) -> list[PromptReport]:
        """Conversations of `turns` turns (docs/design.md, "Conversations that keep their cache"):
        turn 1 is the prompt; each later turn is everything so far (prompt, the `steps + 1` greedy
        tokens of each turn) plus `follow_up`, resumed from the previous turn's kept cache on both
        sides. Every turn is compared step by step; one report per prompt and turn. `progress(n, what)`
        after each unit of `work`."""
        reports = []
        self._progress = progress or _no_progress
        window = self.manifest.policy.selection_window
        for ids in prompts:
            total = len(ids) + turns * (steps + 1 + len(follow_up))
            ref = self._reference(total, 0)
            keeper = keeper_for(self.manifest, "slot")
            reading = prompt_reading(keeper, self.manifest, 0, None, ids)
            result = drain(self.backend.prefill_chunks(0, ids, rows_to=reading.layer if reading else None))
            logits, resumed, plan = ref.feed(ids), 0, None
            for turn in range(1, turns + 1):
                self._progress(1, f"turn {turn}: prefilled {len(ids) - resumed} tokens")
                report = PromptReport(len(ids), result.layout.compressed, turn=turn, resumed_tokens=resumed)
                positions = kept_positions(plan, len(ids), result)
                if positions is not None:
                    report.near_ties, report.selection_mismatches = compare_selection(
                        positions, ref.selections(), self.tie_gap)
                fed = self._follow(result.layout, ref, report, result.logits, logits.numpy(), steps)
                reports.append(report)
                if turn == turns:
                    break
                if reading is not None:
                    reading.done()
                m = self.manifest
                entry = slot_entry(self.backend.slot_rows(0), result.layout, positions, steps, ids + fed[:-1],
                                   m.window_ring, m.spec.local_layers)
                kept = keeper.keep(0, lambda entry=entry: entry)
                ids = ids + fed + follow_up
                plan = plan_resume(kept, ids, window, self.backend.max_resume_rows(), ring=m.window_ring)
                if plan is None:
                    raise SnapcompileError(f"turn {turn + 1} cannot resume from the kept cache: it adds "
                                           f"{len(fed) + len(follow_up)} tokens and must add at least the "
                                           f"observation window ({window}); give more --steps or a longer "
                                           "--follow-up")
                reading = prompt_reading(keeper, self.manifest, 0, plan, ids)
                result = drain(resumed_prefill(self.backend, 0, plan, ids, keeper.resume_rows(plan),
                                               reading.layer if reading else None))
                logits, resumed = ref.resume(ids, plan.resume_at), plan.resume_at
        return reports

    def _follow(self, layout, ref, report: PromptReport, ours: np.ndarray, theirs: np.ndarray,
                steps: int) -> list[int]:
        """`steps` decode steps of slot 0, both sides teacher-forced on the oracle's greedy tokens;
        returns the steps + 1 greedy tokens (the last one not fed)."""
        tokens = []
        for g in range(steps + 1):
            report.step_max_diff.append(float(np.abs(ours - theirs).max()))
            report.agreements.append(int(np.argmax(ours)) == int(np.argmax(theirs)))
            tokens.append(int(np.argmax(theirs)))
            if g < steps:
                ours = self.backend.decode({0: tokens[-1]}, {0: layout.step(g)})[0].copy()
                theirs = ref.feed([tokens[-1]]).numpy()
                self._progress(1, f"decode step {g + 1} of {steps}")
        return tokens

    def _dense_references(self, prompts, steps) -> list[ReferenceSequence | None]:
        """Dense oracles for compressed artifacts where prompt + generated fit the budget."""
        if not self.manifest.policy.compressed:
            return [None] * len(prompts)
        dense = PolicyConfig(policy="dense")
        return [ReferenceSequence(self.model, dense, len(ids) + steps + 1)
                if len(ids) + steps + 1 <= self.backend.rows_per_slot else None for ids in prompts]


def summarize(reports: list[PromptReport], steps: int) -> dict:
    diffs = [d for r in reports for d in r.step_max_diff]
    agree = [a for r in reports for a in r.agreements]
    dense = [r.dense_max_diff for r in reports if r.dense_max_diff is not None]
    return {
        "max_abs_logit_diff": max(diffs),
        "greedy_agreement": sum(agree) / len(agree),
        "steps": steps,
        "prompts": len(reports),
        "prompt_tokens": [r.prompt_tokens for r in reports],
        "compressed_prompts": sum(r.compressed for r in reports),
        "per_step_max_abs_logit_diff": [max(r.step_max_diff[g] for r in reports) for g in range(steps + 1)],
        "near_ties": [dict(t, prompt=i) for i, r in enumerate(reports) for t in r.near_ties],
        "selection_mismatches": [dict(m, prompt=i) for i, r in enumerate(reports) for m in r.selection_mismatches],
        "dense_max_abs_logit_diff": max(dense) if dense else None,
        "per_turn_max_abs_logit_diff": {turn: max(max(r.step_max_diff) for r in reports if r.turn == turn)
                                        for turn in sorted({r.turn for r in reports})},
        "resumed_tokens": [r.resumed_tokens for r in reports],
    }
