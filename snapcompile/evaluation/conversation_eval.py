"""Multi-turn accuracy through the artifacts (`snapcompile eval-turns`) on generated conversations
(`conversations.py`: documents of facts of several kinds, five turns, follow-ups of 5 to 200
tokens, answers of different lengths; a tune part and a held-out part; docs/results/conversations.md).

Each conversation is built at the token level, the way a chat client's resent history reaches the
engine when its answers re-tokenize to themselves: turn k+1 is turn k's tokens, its answer's tokens
and the chat template's tokens of the next user message. How each turn reaches the cache (MODES):

  dense      the dense artifact, every turn prefilled whole: the reference
  reprefill  the compressed artifact, every turn prefilled whole (selected with its own window)
  resume-full  the compressed artifact resumed from a store that keeps every prompt row
             (`--session-keep full`, the default of `serve` and `run`): each turn prefills the
             last answer and its own tokens against them and re-selects, as reprefill does
  resume     each turn resumed from the kept B rows of the one before and re-selected with the
             new turn's window (`--session-keep slot`)
  ring       the compressed artifact, each turn's new tokens fed through decode steps after the
             kept cache, as generated tokens are (the ring; no re-selection)
  resume-quantized  resumed from a store that keeps the B rows in 8 bits and the dropped rows in
             4, attended by the new tokens (`--session-keep quantized`; not run by default)
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from snapcompile.config import ExportConfig, PolicyConfig
from snapcompile.errors import SnapcompileError
from snapcompile.evaluation.config import policy_for
from snapcompile.evaluation.conversations import KINDS, PARTS, Conversation, make_conversation, max_tokens
from snapcompile.evaluation.partial_results import append_partial, partial_path, read_partial
from snapcompile.prompts import encode, encode_text
from snapcompile.sessions.keepers import check_keep_with_cache

MODES = ("dense", "reprefill", "resume-full", "resume", "ring", "resume-quantized")
DEFAULT_MODES = MODES[:5]
MARK = "\u2063"           # stands for an answer while the template renders the turn after it


def session_keep_of(mode: str) -> str:
    """The engine's --session-keep for a mode (resume-full -> full; compressed otherwise)."""
    return {"resume-full": "full", "resume-quantized": "quantized"}.get(mode, "slot")


def first_turn(tokenizer, case: Conversation, chat: bool) -> list[int]:
    return encode(tokenizer, case.first_message(), chat)


def engine_turns(engine, chat: bool, first_ids: list[int], later_texts: list[str], answer_tokens: list[int],
                 ignore_eos: bool = False, top_logprobs: int = 0):
    """Yield (prompt ids, Result) for each turn of a conversation on `engine`, one request at a
    time: turn 1 is first_ids, each later one the turn before, its answer's tokens and the template's
    tokens of the next user text (`next_turn_tokens`); answer_tokens[k]: turn k + 1's
    max_new_tokens. Stops after a failed turn."""
    from snapcompile.engine.request import Request
    ids = first_ids
    for turn in range(len(later_texts) + 1):
        result, = engine.generate([Request(ids, max_new_tokens=answer_tokens[turn], ignore_eos=ignore_eos,
                                           top_logprobs=top_logprobs)])
        yield ids, result
        if result.error is not None or turn == len(later_texts):
            return
        ended = result.output_ids[-1] in engine.eos_ids
        ids = ids + result.output_ids + next_turn_tokens(engine.tokenizer, later_texts[turn], chat, ended)


def rows_kept_of(kept, token_ids: list[int], tokens: list[int]) -> float | None:
    """The share of (layer, KV head) pairs of the kept cache `kept` that hold every token of the
    first occurrence of the token sequence `tokens` in `token_ids` (None when it does not occur):
    whether a fact the turn asks about is still in the cache it is answered from."""
    n = len(tokens)
    first = next((i for i in range(len(token_ids) - n + 1) if token_ids[i:i + n] == tokens), None)
    if first is None or n == 0:
        return None
    span = np.arange(first, first + n)
    return float(np.mean([np.isin(span, head).all() for layer in kept.positions for head in layer]))


def next_turn_tokens(tokenizer, question: str, chat: bool, answer_ended: bool) -> list[int]:
    """The tokens that follow an answer's tokens up to the next answer: with a chat template, what
    it renders after an assistant message and before the next generation (less the end-of-turn
    token when the answer ended with it); raw, a blank line and the question."""
    if not chat:
        return encode_text(tokenizer, "\n\n" + question)
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": MARK},
                {"role": "user", "content": question}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    tail = rendered[rendered.index(MARK) + len(MARK):]
    eos = tokenizer.eos_token or ""
    if answer_ended and eos and tail.startswith(eos):
        tail = tail[len(eos):]
    return encode_text(tokenizer, tail)


@dataclass(frozen=True)
class TurnsConfig:
    source: str
    lengths: tuple[int, ...] = (3000,)
    samples: int = 10                 # conversations per length, the kinds taking turns
    seed: int = 0
    part: str = "tune"                # conversations.PARTS
    kinds: tuple[str, ...] = KINDS
    ratio: int = 4                    # budget = final conversation length // ratio
    policy: str = "snapstream"
    weight_format: str = "fp32"
    chunk: int = ExportConfig.chunk          # the product's own shapes (convert's default)
    modes: tuple[str, ...] = DEFAULT_MODES
    kernel: int = PolicyConfig.kernel  # the policy's pooling kernel K
    scope: str = "head"               # SnapStream selection scope
    prompt_share: int | None = None   # P (None: B minus a ring of B/4, less the summaries)
    summaries: int = 0                # summary rows of the dropped rows (PolicyConfig.summaries)
    summary_segment: int = PolicyConfig.summary_segment
    kv_dtype: str = ExportConfig.kv_dtype     # the KV cache of every artifact, dense's too (--kv-dtype)

    def policy_at(self, length: int) -> PolicyConfig:
        return policy_for(self.policy, self.budget(length), self.scope, self.kernel, self.prompt_share,
                          self.summaries, self.summary_segment)

    def export(self) -> ExportConfig:
        """Every artifact's shapes: one slot holding the longest final conversation."""
        return ExportConfig(slots=1, max_context=self.final_length(max(self.lengths)) + 64, chunk=self.chunk,
                            weight_format=self.weight_format, kv_dtype=self.kv_dtype)

    def final_length(self, length: int) -> int:
        """An upper bound on a conversation's tokens after its last turn."""
        return max_tokens(length)

    def budget(self, length: int) -> int:
        return self.final_length(length) // self.ratio

    def conversations(self, tokenizer, length: int, chat: bool) -> list[Conversation]:
        return [make_conversation(tokenizer, self.kinds[s % len(self.kinds)], self.part, self.seed, length, s, chat)
                for s in range(self.samples)]


def retention(records: list[dict]) -> list[dict]:
    """Per mode and turn: accuracy, its share of dense's, and of the conversations dense (and
    reprefill) answered at that turn the share this mode answered too."""
    right = {(r["mode"], r["case"], t["turn"]): t["correct"] for r in records for t in r["turns"]}
    rows = []
    for mode in MODES:
        per_turn: dict[int, list] = {}
        for record in (r for r in records if r["mode"] == mode):
            for t in record["turns"]:
                case_turn = (record["case"], t["turn"])
                per_turn.setdefault(t["turn"], []).append((t["correct"], right.get(("dense", *case_turn)),
                                                           right.get(("reprefill", *case_turn))))
        for turn, triples in sorted(per_turn.items()):
            accuracy = sum(c for c, _, _ in triples) / len(triples)
            reference = [d for _, d, _ in triples if d is not None]
            dense_acc = sum(reference) / len(reference) if reference else None
            rows.append({"mode": mode, "turn": turn, "cases": len(triples), "accuracy": accuracy,
                         "share_of_dense": accuracy / dense_acc if dense_acc else None,
                         "dense_sure_kept": _kept_share([c for c, d, _ in triples if d]),
                         "reprefill_kept": _kept_share([c for c, _, p in triples if p])})
    return rows


def later_turns(records: list[dict]) -> list[dict]:
    """Per mode, over turns 2..5 of every conversation: the answers dense and reprefill got right,
    how many of each this mode kept, and dense's answer margin on each one this mode lost."""
    turns = {(r["mode"], r["case"], t["turn"]): t for r in records for t in r["turns"] if t["turn"] > 1}
    rows = []
    for mode in MODES:
        mine = {(case, turn): t for (m, case, turn), t in turns.items() if m == mode}
        if not mine:
            continue
        dense = {k: turns.get(("dense", *k)) for k in mine}
        reprefill = {k: turns.get(("reprefill", *k)) for k in mine}
        dense_right = [k for k, t in dense.items() if t and t["correct"]]
        reprefill_right = [k for k, t in reprefill.items() if t and t["correct"]]
        lost = [k for k in dense_right if not mine[k]["correct"]]
        rows.append({"mode": mode, "answers": len(mine), "right": sum(t["correct"] for t in mine.values()),
                     "dense_right": len(dense_right), "of_dense_kept": sum(mine[k]["correct"] for k in dense_right),
                     "reprefill_right": len(reprefill_right),
                     "of_reprefill_kept": sum(mine[k]["correct"] for k in reprefill_right),
                     "lost_dense_margins": sorted(round(dense[k].get("margin") or 0.0, 3) for k in lost)})
    return rows


def _kept_share(outcomes: list[bool]) -> float | None:
    return sum(outcomes) / len(outcomes) if outcomes else None


class TurnsStore:
    """Finished (mode, case) conversations, appended to OUTPUT.partial.jsonl as they finish."""

    def __init__(self, output: Path, config: TurnsConfig):
        self.path, self.config_json = partial_path(output), json.dumps(asdict(config), sort_keys=True)
        self.records = {r["id"]: r for r in read_partial(self.path, self.config_json, "eval-turns")}

    def add(self, record: dict) -> None:
        self.records[record["id"]] = record
        append_partial(self.path, self.config_json, record)


SAME_CONVERSATIONS = ("source", "lengths", "samples", "seed", "part", "kinds", "weight_format", "chunk")


def reference_records(path: Path, config: TurnsConfig) -> list[dict]:
    """The dense records of an earlier eval-turns run on the same conversations (the dense mode
    does not depend on the compression policy), so a policy variant need not rerun them."""
    from snapcompile.evaluation.partial_results import read_results
    stored, records = read_results(path, "eval-turns", "records")
    current = asdict(config)
    differ = [k for k in SAME_CONVERSATIONS if json.dumps(stored.get(k)) != json.dumps(current[k])]
    if differ:
        raise SnapcompileError(f"{path} ran other conversations ({', '.join(differ)} differ); it cannot be the "
                               "dense reference of this run")
    dense = [r for r in records if r["mode"] == "dense"]
    if not dense:
        raise SnapcompileError(f"{path} holds no dense records")
    return dense


def check_config(config: TurnsConfig) -> None:
    if config.samples < 1 or config.ratio < 2 or not config.lengths or min(config.lengths) < 256:
        raise SnapcompileError("--samples must be >= 1, --ratio >= 2 and --lengths >= 256 tokens")
    if config.part not in PARTS or not config.kinds or set(config.kinds) - set(KINDS):
        raise SnapcompileError(f"--part must be one of {', '.join(PARTS)} and --kinds among {', '.join(KINDS)}")
    if config.policy not in ("snapstream", "streamingllm"):
        raise SnapcompileError("--policy must be snapstream or streamingllm")
    unknown = set(config.modes) - set(MODES)
    if unknown or not config.modes:
        raise SnapcompileError(f"--modes must be among {', '.join(MODES)}, got {', '.join(config.modes) or 'none'}")
    export = config.export()          # raises on what the export refuses
    for mode in config.modes:
        check_keep_with_cache(session_keep_of(mode), config.kv_dtype)
    for length in config.lengths:
        config.policy_at(length).check_against(export)   # a policy the budget or the cache cannot hold
