"""Time to first token of each turn of a growing conversation (`snapcompile bench-turns`).

A conversation of `turns` turns, each user message ~`turn_tokens` tokens of text and each answer
`answer_tokens` generated tokens (EOS ignored), built at the token level like `eval-turns`. Each
turn is one request on an idle engine, so its TTFT is its prefill (or resumed prefill). MODES:

  dense          the dense artifact, every turn prefilled whole
  dense-resume   the dense artifact with a session store: exact prefix caching
  reprefill      the compressed artifact, every turn prefilled whole
  resume         the compressed artifact with a session store: each turn resumed from the kept cache
  resume-full    the same with a store that keeps every prompt row (`--session-keep full`)
  resume-quantized  the B rows in 8 bits and the dropped rows in 4 (`--session-keep quantized`;
                 not run by default)

The modes alternate within each repeat, so a change in the machine's load falls on all of them.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from snapcompile.config import ExportConfig, PolicyConfig
from snapcompile.errors import SnapcompileError
from snapcompile.evaluation.conversation_eval import engine_turns, session_keep_of
from snapcompile.prompts import encode, encode_text

MODES = ("dense", "dense-resume", "reprefill", "resume", "resume-full", "resume-quantized")
DEFAULT_MODES = MODES[:5]
STORE_BYTES = 2**31


@dataclass(frozen=True)
class TurnsBenchConfig:
    source: str
    turns: int = 8
    turn_tokens: int = 450
    answer_tokens: int = 50
    repeats: int = 3
    ratio: int = 4                 # budget = final conversation length // ratio
    policy: str = "snapstream"
    weight_format: str = "fp32"
    chunk: int = ExportConfig.chunk          # the product's own shapes (convert's default)
    modes: tuple[str, ...] = DEFAULT_MODES
    kernel: int = PolicyConfig.kernel
    summaries: int = 0             # the compressed artifact's summary rows (PolicyConfig.summaries)

    def __post_init__(self):
        unknown = set(self.modes) - set(MODES)
        if unknown or not self.modes:
            raise SnapcompileError(f"--modes must be among {', '.join(MODES)}, got {', '.join(self.modes) or 'none'}")

    def compressed_policy(self) -> PolicyConfig:
        """The compressed artifact's policy."""
        return PolicyConfig(policy=self.policy, budget=self.budget, kernel=self.kernel, summaries=self.summaries)

    @property
    def final_length(self) -> int:
        return self.turns * (self.turn_tokens + self.answer_tokens + 32)

    @property
    def budget(self) -> int:
        return self.final_length // self.ratio


def user_texts(tokenizer, config: TurnsBenchConfig, conversation: int) -> list[str]:
    """One message per turn of natural prose (eval-turns' conversations draw theirs from the same
    text) and a question, headed by the conversation's number (so no conversation begins with
    another's tokens). The messages' lengths differ (drawn between about half and one and a half
    turn_tokens) but add up to at most turns x turn_tokens, so the conversation fits its bound."""
    import random

    from snapcompile.evaluation.conversations import prose
    rng = random.Random(f"bench-turns/{conversation}")
    sentences = prose(rng)
    weights = [rng.uniform(0.5, 1.5) for _ in range(config.turns)]
    words = " ".join(sentences[i % len(sentences)] for i in range(config.turns * config.turn_tokens // 8)).split()
    texts, at, total = [], 0, config.turn_tokens * config.turns
    for k, weight in enumerate(weights):
        head, tail = f"Conversation {conversation}, part {k + 1}. ", f" What did part {k + 1} say?"
        budget = int(total * weight / sum(weights)) - len(encode_text(tokenizer, head + tail))
        low, high = 0, len(words) - at          # the most words whose tokens fit the budget
        while low < high:
            middle = (low + high + 1) // 2
            low, high = (middle, high) if len(encode_text(tokenizer, " ".join(words[at:at + middle]))) <= budget \
                else (low, middle - 1)
        texts.append(head + " ".join(words[at:at + low]) + tail)
        at += low
    return texts


def run_conversation(engine, chat: bool, texts: list[str], answer_tokens: int) -> list[dict]:
    """One conversation on `engine` (idle): per turn its prompt tokens, the tokens resumed, TTFT."""
    rows = []
    first = encode(engine.tokenizer, texts[0], chat)
    turns = engine_turns(engine, chat, first, texts[1:], [answer_tokens] * len(texts), True)
    for turn, (ids, result) in enumerate(turns):
        if result.error is not None:
            raise RuntimeError(f"turn {turn + 1}: {result.error}")
        rows.append({"turn": turn + 1, "prompt_tokens": len(ids), "cached_tokens": result.cached_tokens,
                     "ttft_s": result.ttft_s})
    return rows


def medians(runs: list[dict]) -> list[dict]:
    """Per mode and turn, the median TTFT over the repeats (and the tokens of that turn)."""
    out = []
    for mode in [m for m in MODES if any(r["mode"] == m for r in runs)]:
        mode_runs = [r["turns"] for r in runs if r["mode"] == mode]
        for index in range(len(mode_runs[0]) if mode_runs else 0):
            turns = [run[index] for run in mode_runs]
            out.append({"mode": mode, "turn": index + 1, "prompt_tokens": turns[0]["prompt_tokens"],
                        "cached_tokens": turns[0]["cached_tokens"],
                        "ttft_median_s": statistics.median(t["ttft_s"] for t in turns),
                        "ttft_s": [t["ttft_s"] for t in turns]})
    return out


def open_engines(dense: Path, compressed: Path, modes: tuple[str, ...] = DEFAULT_MODES) -> dict:
    """One engine per mode (a store only for the resume modes)."""
    from snapcompile.engine.engine import Engine
    engines = {mode: Engine.from_artifact(dense if mode.startswith("dense") else compressed,
                                          session_cache_bytes=STORE_BYTES if "resume" in mode else 0,
                                          session_keep=session_keep_of(mode))
               for mode in modes}
    for engine in engines.values():               # no timed turn pays for making a graph
        engine.backend.make_graphs()
    return engines
