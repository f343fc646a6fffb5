"""Evaluation cases generated in code from a seed (nothing is downloaded).

passkey   a 5-digit key in filler text at a chosen depth, asked at the end; correct when the
          key appears in the answer.
multikey  several "The special number for <word> is <number>." lines among filler, one asked.
fidelity  natural text (standard-library docstrings, shipped as data/fidelity.txt), greedy continuation compared with
          dense attention (token agreement and KL of the next-token distributions).
"""
from __future__ import annotations

import hashlib
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from snapcompile.errors import SnapcompileError
from snapcompile.passkeys import FILLER, INTRO, passkey_text
from snapcompile.prompts import encode

TASKS = ("passkey", "multikey", "fidelity")
WORDS = ("apple", "river", "candle", "falcon", "marble", "violet", "harbor", "copper", "meadow", "lantern",
         "glacier", "pepper", "saddle", "thunder", "orchid", "walnut")

@dataclass(frozen=True)
class Case:
    task: str
    length: int          # target prompt length in tokens (chat template included)
    depth: float         # where the needle sits, 0..1 (fidelity: unused, 0)
    sample: int
    prompt: str
    answer: str          # expected substring of the answer ("" for fidelity)

    @property
    def key(self) -> str:
        return f"{self.task}/L{self.length}/d{self.depth:.2f}/s{self.sample}"

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "prompt"}


def fit_text(tokenizer, build, length: int, chat: bool) -> str:
    """The text build(repeats) whose token count is closest to `length` without exceeding it."""
    per_repeat = max(1, len(encode(tokenizer, FILLER * 20, False)) // 20)
    repeats = max(1, length // per_repeat)
    for _ in range(8):
        over = len(encode(tokenizer, build(repeats), chat)) - length
        if -per_repeat < over <= 0:
            break
        if over > 0 and repeats == 1:
            raise SnapcompileError(f"length {length} is too short for this task's prompt "
                                   f"({length + over} tokens at least)")
        repeats = max(1, repeats - (over // per_repeat) - (1 if over > 0 else 0))
    return build(repeats)


def passkey_case(tokenizer, length: int, depth: float, sample: int, seed: int, chat: bool) -> Case:
    rng = random.Random(f"passkey/{seed}/{length}/{depth}/{sample}")
    key = rng.randint(10000, 99999)
    text = fit_text(tokenizer, lambda repeats: passkey_text(key, repeats, depth), length, chat)
    return Case("passkey", length, depth, sample, text, str(key))


def multikey_case(tokenizer, length: int, depth: float, sample: int, seed: int, chat: bool, keys: int = 4) -> Case:
    """`keys` needles spread around `depth`; the one at `depth` is asked."""
    rng = random.Random(f"multikey/{seed}/{length}/{depth}/{sample}")
    words = rng.sample(WORDS, keys)
    numbers = [rng.randint(100000, 999999) for _ in words]
    depths = sorted({depth, *(rng.random() for _ in range(keys - 1))})[:keys]
    asked = words[depths.index(depth)]

    def build(repeats: int) -> str:
        return (facts_text(words, numbers, depths, repeats)
                + f"\n\nWhat is the special number for {asked}? Answer with the number only.")
    return Case("multikey", length, depth, sample, fit_text(tokenizer, build, length, chat),
                str(numbers[words.index(asked)]))


def facts_text(words, numbers, depths, repeats: int) -> str:
    """INTRO and `repeats` filler sentences with "The special number for WORD is NUMBER." placed
    at each depth (0..1, ascending) among them."""
    parts, previous = [INTRO], 0
    for word, number, where in zip(words, numbers, depths):
        cut = int(repeats * where)
        parts.append(FILLER * (cut - previous) + f"The special number for {word} is {number}. ")
        previous = cut
    parts.append(FILLER * (repeats - previous))
    return "".join(parts)


FIDELITY_TEXT = Path(__file__).with_name("data") / "fidelity.txt"
FIDELITY_TEXT_SHA256 = "058bccd6070b80194ba125b4b6ac0a80144060fc9e052054c27f26407c56d2d4"


def fidelity_text() -> str:
    """Long natural English, shipped with the package so that every interpreter evaluates the same
    cases: the docstrings of 23 standard-library modules and their public members as CPython 3.11.7
    has them (Python Software Foundation License), joined by blank lines (data/fidelity.txt)."""
    data = FIDELITY_TEXT.read_bytes()
    if hashlib.sha256(data).hexdigest() != FIDELITY_TEXT_SHA256:
        raise SnapcompileError(f"{FIDELITY_TEXT} was modified: reinstall snapcompile")
    return data.decode("utf-8")


def fidelity_case(tokenizer, length: int, sample: int, seed: int) -> Case:
    """A window of `length` tokens of fidelity_text(), at an offset chosen from the seed."""
    ids = encode(tokenizer, fidelity_text(), chat=False)
    rng = random.Random(f"fidelity/{seed}/{length}/{sample}")
    start = rng.randint(0, max(0, len(ids) - length - 1))
    return Case("fidelity", length, 0.0, sample, tokenizer.decode(ids[start:start + length]), "")


def make_cases(task: str, tokenizer, lengths, depths, samples: int, seed: int, chat: bool) -> list[Case]:
    cases = []
    for length in lengths:
        for sample in range(samples):
            if task == "fidelity":
                cases.append(fidelity_case(tokenizer, length, sample, seed))
                continue
            for depth in depths:
                make = passkey_case if task == "passkey" else multikey_case
                cases.append(make(tokenizer, length, depth, sample, seed, chat))
    return cases
