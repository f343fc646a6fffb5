"""The conversations of `eval-turns`, generated from a seed (nothing is downloaded), in two parts:
`tune` (what anyone tuning a policy or a mode looks at) and `held-out` (reported, drawn by a seed
chosen after the tuning). A part and a seed name disjoint random streams, so no held-out
conversation is a tune one.

Each conversation is a document and five turns. KINDS of document:

  numbers        "The special number for apple is 482913."
  names          "The contact for the Orion project is Maria Lindqvist."
  dates          "The Lisbon shipment is due on 14 March."
  codes          "The door code for room 214 is K7Q-3X9."
  two-documents  two memos, each of facts of another kind, asked about alternately

The facts stand one per line among prose (text of the standard library's docstrings, the
fidelity task's) or several to a sentence. Turn 1 is the document and a question; each later
turn is a follow-up of 5 to 200 tokens (chatter and a question): about another fact, or (from
turn 3, one time in four) about the previous answer itself. The questions ask for answers of
different lengths (the value alone, a sentence, a few sentences), so the answers in between differ
in length too.
"""
from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from snapcompile.errors import SnapcompileError
from snapcompile.evaluation.tasks import WORDS, fidelity_text, fit_text

KINDS = ("numbers", "names", "dates", "codes", "two-documents")
PARTS = ("tune", "held-out")
TURNS = 5
FACTS = 5                       # facts per document (two-documents: 3 + 3)
FOLLOW_UP_TOKENS = (5, 200)     # a later turn's user message, question included (about)
SHORT_BELOW = 24                # a follow-up drawn shorter is the terse question alone ("And river?")
# (question suffix, tokens the answer may take): the value alone, a sentence, a few sentences
ANSWER_STYLES = (("Answer with the {what} only.", 16), ("Answer in one sentence.", 40),
                 ("Answer, then say in two or three sentences what else the memo said near it.", 96))
MAX_ANSWER_TOKENS = max(tokens for _, tokens in ANSWER_STYLES)

FIRST = ("Maria", "John", "Aiko", "Pedro", "Fatima", "Lars", "Chen", "Olga", "Kwame", "Sofia", "Ravi", "Emma")
LAST = ("Lindqvist", "Okafor", "Tanaka", "Moreau", "Haddad", "Novak", "Brennan", "Castillo", "Petrov", "Weber",
        "Nakamura", "Oyelaran")
PROJECTS = ("Orion", "Falcon", "Juniper", "Atlas", "Beacon", "Cobalt", "Delta", "Ember", "Granite", "Harbor")
CITIES = ("Lisbon", "Oslo", "Nairobi", "Osaka", "Quito", "Dublin", "Hanoi", "Lima", "Perth", "Tunis")
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December")
CODE_CHARS = "ABCDEFGHJKLMNPQRSTUVWXYZ23456789"


@dataclass(frozen=True)
class Fact:
    """One fact: `sentence` states it; `question` asks for it; any of `answers` in a reply is right.
    key: what the fact is about (what a question about the previous answer expects back)."""

    key: str
    sentence: str
    question: str
    what: str
    answers: tuple[str, ...]
    short: str          # the terse follow-up asking for it ("And river?")


def _number_fact(rng: random.Random, used: set) -> Fact:
    word = _fresh(rng, WORDS, used)
    number = str(rng.randint(100000, 999999))
    return Fact(word, f"The special number for {word} is {number}.", f"What is the special number for {word}?",
                "number", (number,), f"And for {word}?")


def _name_fact(rng: random.Random, used: set) -> Fact:
    project = _fresh(rng, PROJECTS, used)
    first, last = rng.choice(FIRST), _fresh(rng, LAST, used)
    return Fact(project, f"The contact for the {project} project is {first} {last}.",
                f"Who is the contact for the {project} project?", "name", (last,), f"And the {project} project?")


def _date_fact(rng: random.Random, used: set) -> Fact:
    city, day, month = _fresh(rng, CITIES, used), rng.randint(1, 28), rng.choice(MONTHS)
    return Fact(city, f"The {city} shipment is due on {day} {month}.", f"When is the {city} shipment due?", "date",
                (f"{day} {month}", f"{month} {day}"), f"And {city}?")


def _code_fact(rng: random.Random, used: set) -> Fact:
    room = str(_fresh(rng, range(100, 990), used))
    code = "".join(rng.choice(CODE_CHARS) for _ in range(3)) + "-" + "".join(rng.choice(CODE_CHARS) for _ in range(3))
    return Fact(room, f"The door code for room {room} is {code}.", f"What is the door code for room {room}?",
                "code", (code,), f"And room {room}?")


FACT_MAKERS: dict[str, Callable[[random.Random, set], Fact]] = {
    "numbers": _number_fact, "names": _name_fact, "dates": _date_fact, "codes": _code_fact}


def _fresh(rng: random.Random, choices, used: set):
    """A choice not used before in this conversation (so every question has one answer)."""
    value = rng.choice([c for c in choices if c not in used])
    used.add(value)
    return value


@dataclass(frozen=True)
class Conversation:
    """One conversation of TURNS turns. Turn 1's user message is `document`, a blank line and
    questions[0]; turn k's (k > 1) is questions[k - 1] alone. answers[k]: the accepted answers
    (any of them in the reply is right); depths[k]: where the asked fact sits in its document
    (0..1; None for a question about the previous answer); answer_tokens[k]: the most tokens the
    answer of turn k + 1 may take."""

    kind: str
    part: str
    sample: int
    length: int
    document: str
    questions: tuple[str, ...]
    answers: tuple[tuple[str, ...], ...]
    depths: tuple[float | None, ...]
    answer_tokens: tuple[int, ...]

    @property
    def key(self) -> str:
        return f"{self.part}/{self.kind}/L{self.length}/s{self.sample}"

    def first_message(self) -> str:
        return self.document + "\n\n" + self.questions[0]

    def found(self, turn: int, text: str) -> str | None:
        """The first of turn `turn`'s answers in `text` (in any case), as `text` spells it; None
        when none is (the reply is wrong)."""
        for answer in self.answers[turn]:
            at = text.lower().find(answer.lower())
            if at >= 0:
                return text[at:at + len(answer)]
        return None


def max_tokens(length: int) -> int:
    """An upper bound on a conversation's tokens after its last answer (turn 1 of `length`
    tokens, fitted within 10%; each later turn's template and follow-up, and every answer, at most)."""
    return length + length // 10 + TURNS * (MAX_ANSWER_TOKENS + FOLLOW_UP_TOKENS[1] + 48)


def make_conversation(tokenizer, kind: str, part: str, seed: int, length: int, sample: int,
                      chat: bool) -> Conversation:
    """Conversation `sample` of `kind` in `part`, its turn 1 about `length` tokens."""
    if kind not in KINDS or part not in PARTS:
        raise SnapcompileError(f"unknown conversation kind {kind!r} or part {part!r}")
    rng = random.Random(f"conversations/{part}/{seed}/{kind}/{length}/{sample}")
    used: set = set()
    if kind == "two-documents":
        first, second = rng.sample(sorted(FACT_MAKERS), 2)
        memos = [[FACT_MAKERS[first](rng, used) for _ in range(3)], [FACT_MAKERS[second](rng, used) for _ in range(3)]]
    else:
        memos = [[FACT_MAKERS[kind](rng, used) for _ in range(FACTS)]]
    placed = [_placement(rng, len(facts)) for facts in memos]
    sentences = prose(rng)
    asked = _asking_order(rng, [len(facts) for facts in memos])
    questions, answers, depths, answer_tokens = [], [], [], []
    for turn, (memo, index) in enumerate(asked):
        (style, tokens), target = rng.choice(ANSWER_STYLES), round(rng.uniform(*FOLLOW_UP_TOKENS))
        refers = turn >= 2 and depths[-1] is not None and rng.random() < 0.25
        if refers:
            before = memos[asked[turn - 1][0]][asked[turn - 1][1]]
            question = (f"In your last answer you gave me a {before.what}. Which item was that {before.what} for? "
                        + style.format(what="name of that item"))
            answers.append((before.key,))
            depths.append(None)
        else:
            fact = memos[memo][index]
            terse = turn > 0 and target < SHORT_BELOW
            question = fact.short if terse else fact.question + " " + style.format(what=fact.what)
            tokens = ANSWER_STYLES[1][1] if terse else tokens
            answers.append(fact.answers)
            depths.append(placed[memo][index])
        questions.append(question if turn == 0 else _follow_up(rng, sentences, question, target))
        answer_tokens.append(tokens)

    def build(repeats: int) -> str:
        return _document(memos, placed, sentences, repeats) + "\n\n" + questions[0]
    document = fit_text(tokenizer, build, length, chat)[: -len(questions[0]) - 2]
    return Conversation(kind, part, sample, length, document, tuple(questions), tuple(answers), tuple(depths),
                        tuple(answer_tokens))


def _placement(rng: random.Random, count: int) -> list[float]:
    """Depths (0..1) of `count` facts: one per line at spread depths, or packed into sentences of
    two or three facts each at one or two depths."""
    if rng.random() < 0.5:
        return [round((i + rng.random()) / count, 3) for i in range(count)]
    clusters = sorted(round(rng.random(), 3) for _ in range(rng.choice((1, 2))))
    return [clusters[i * len(clusters) // count] for i in range(count)]


def _asking_order(rng: random.Random, counts: list[int]) -> list[tuple[int, int]]:
    """(memo, fact) asked per turn: every fact of one memo in a random order; with two memos the
    turns alternate between them."""
    orders = [rng.sample(range(n), n) for n in counts]
    asked = []
    for turn in range(TURNS):
        memo = turn % len(orders)
        asked.append((memo, orders[memo][turn // len(orders) % len(orders[memo])]))
    return asked


def prose(rng: random.Random) -> list[str]:
    """The sentences of the fidelity text from a random one on, wrapping round to the first."""
    sentences = [s.strip() + "." for s in fidelity_text().replace("\n", " ").split(". ") if 20 < len(s) < 300]
    start = rng.randrange(len(sentences))
    return sentences[start:] + sentences[:start]


def _document(memos: list[list[Fact]], placed: list[list[float]], prose: list[str], repeats: int) -> str:
    """The memos, each `repeats` sentences of prose (split evenly) with its facts at their depths:
    a fact alone on its line, or facts at the same depth joined into one sentence."""
    parts, per_memo = [], max(1, repeats // len(memos))

    def sentences(first: int, end: int) -> str:
        return " ".join(prose[i % len(prose)] for i in range(first, end))
    for number, (facts, depths) in enumerate(zip(memos, placed)):
        title = f"Memo {'AB'[number]}." if len(memos) > 1 else "Memo."
        body, previous, base = [title], 0, number * per_memo
        for depth in sorted(set(depths)):
            cut = int(per_memo * depth)
            body.append(sentences(base + previous, base + cut))
            body.append("\n" + _joined([f.sentence for f, d in zip(facts, depths) if d == depth]) + "\n")
            previous = cut
        body.append(sentences(base + previous, base + per_memo))
        parts.append(" ".join(b for b in body if b))
    return "\n\n".join(parts)


def _joined(sentences: list[str]) -> str:
    """Facts at one depth: one sentence each when alone, else joined into one with semicolons."""
    if len(sentences) == 1:
        return sentences[0]
    return "; ".join(s.rstrip(".") for s in sentences[:-1]) + "; and " + sentences[-1][0].lower() + sentences[-1][1:]


def _follow_up(rng: random.Random, prose: list[str], question: str, tokens: int) -> str:
    """A later turn's message of about `tokens` tokens (~1.3 a word): chatter quoting some prose,
    then the question; the question alone when it is that long already."""
    words = int(tokens / 1.3) - len(question.split()) - 8
    if words < 4:
        return question
    start = rng.randrange(len(prose))
    chatter = " ".join(" ".join(prose[(start + i) % len(prose)] for i in range(40)).split()[:words])
    return f"Thanks. Something else I read today: \"{chatter}\" Anyway. {question}"
