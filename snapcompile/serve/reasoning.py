"""Reasoning models' thinking apart from their answer (`serve --reasoning-parser`, vLLM's): the text
between <think> and </think> goes to the message's `reasoning_content`, the rest to its `content`.

Two parsers, as vLLM's of the same names read the output: "deepseek_r1" — the template opens the
thinking in the prompt, so the output is reasoning until </think> (a leading <think> is dropped);
without </think> all of it is reasoning. "qwen3" — the output reasons only when it begins with
<think> (thinking switched off, Qwen3's template closes an empty block in the prompt); otherwise all
of it is content. Streamed, the text is split as it comes: a piece that may still be the start of a
tag is held back until it cannot (never more than a tag's length).
"""
from __future__ import annotations

from snapcompile.engine.output import stop_prefix_overlap

PARSERS = ("deepseek_r1", "qwen3")
OPEN, CLOSE = "<think>", "</think>"


class ReasoningSplit:
    """One answer's text, fed piece by piece: feed(piece) and, at the end, finish() give the
    (reasoning, content) text each adds. Each piece costs its own length and a tag's."""

    def __init__(self, parser: str):
        if parser not in PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}; choose from {', '.join(PARSERS)}")
        self.parser = parser
        self.state = "start"          # "start" (the beginning may still be <think>) | "reasoning" | "content"
        self.held = ""

    def feed(self, piece: str) -> tuple[str, str]:
        self.held += piece
        reasoning = content = ""
        while True:
            if self.state == "start":
                begun = self.held.lstrip()
                if begun.startswith(OPEN):
                    self.held, self.state = begun[len(OPEN):], "reasoning"
                elif OPEN.startswith(begun):
                    return reasoning, content          # may still become <think>
                else:
                    self.state = "reasoning" if self.parser == "deepseek_r1" else "content"
                continue
            if self.state == "reasoning":
                at = self.held.find(CLOSE)
                if at >= 0:
                    reasoning += self.held[:at]
                    self.held, self.state = self.held[at + len(CLOSE):], "content"
                    continue
                keep = stop_prefix_overlap(self.held[-(len(CLOSE) - 1):], CLOSE)
                reasoning += self.held[:len(self.held) - keep]
                self.held = self.held[len(self.held) - keep:]
                return reasoning, content
            content += self.held
            self.held = ""
            return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What the held-back end adds once the answer ended."""
        rest, self.held = self.held, ""
        if self.state == "reasoning" or (self.state == "start" and self.parser == "deepseek_r1"):
            return rest, ""
        return "", rest


def split_reasoning(text: str, parser: str) -> tuple[str | None, str | None]:
    """(reasoning_content, content) of a whole answer: None for a part it has not (content is None
    only when the answer is all reasoning)."""
    split = ReasoningSplit(parser)
    reasoning, content = (a + b for a, b in zip(split.feed(text), split.finish()))
    return reasoning or None, content if content or not reasoning else None
