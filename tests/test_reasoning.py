"""serve/reasoning.py: a reasoning model's thinking apart from its answer, whole or streamed in any pieces."""
from __future__ import annotations

import random

import pytest

from snapcompile.serve.reasoning import ReasoningSplit, split_reasoning

CASES = [  # parser, output, (reasoning_content, content)
    ("deepseek_r1", "Let me add 2 and 2.\n</think>\n\nIt is 4.", ("Let me add 2 and 2.\n", "\n\nIt is 4.")),
    ("deepseek_r1", "<think>First, x.</think>Answer.", ("First, x.", "Answer.")),
    ("deepseek_r1", "still thinking, cut < /thin", ("still thinking, cut < /thin", None)),
    ("deepseek_r1", "", (None, "")),
    ("qwen3", "<think>\nplan</think>\n\nDone </think> twice.", ("\nplan", "\n\nDone </think> twice.")),
    ("qwen3", "No thinking here, <think> later is text.", (None, "No thinking here, <think> later is text.")),
    ("qwen3", "<thi", (None, "<thi")),
    ("qwen3", "  <think>cut mid-way </thi", ("cut mid-way </thi", None)),
]


@pytest.mark.parametrize("parser, output, expected", CASES)
def test_whole_and_streamed_in_any_pieces_agree(parser, output, expected):
    assert split_reasoning(output, parser) == expected
    rng = random.Random(output)
    for _ in range(40):
        split, reasoning, content, at = ReasoningSplit(parser), "", "", 0
        while at < len(output):
            step = rng.randint(1, 5)
            more = split.feed(output[at:at + step])
            reasoning, content, at = reasoning + more[0], content + more[1], at + step
        rest = split.finish()
        assert (reasoning + rest[0] or None, content + rest[1]) == (expected[0], expected[1] or "")


def test_a_piece_that_may_be_a_tag_is_held_back_only_that_long():
    split = ReasoningSplit("deepseek_r1")
    assert split.feed("thinking </thi") == ("thinking ", "")
    assert split.feed("nk>ok") == ("", "ok")
    assert split.feed(" more") == ("", " more")
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        ReasoningSplit("nope")
