"""The generated conversations of eval-turns: kinds, parts, follow-up lengths, answers in the document."""
import pytest
from transformers import AutoTokenizer

from snapcompile.errors import SnapcompileError
from snapcompile.evaluation.conversations import (
    FOLLOW_UP_TOKENS,
    KINDS,
    TURNS,
    make_conversation,
    max_tokens,
)
from snapcompile.prompts import encode, encode_text


@pytest.fixture(scope="module")
def tokenizer():
    from snapcompile.models.loader import _smollm2_folder
    return AutoTokenizer.from_pretrained(str(_smollm2_folder()))


@pytest.fixture(scope="module")
def suite(tokenizer):
    return [make_conversation(tokenizer, kind, part, 3, 1200, sample, True)
            for part in ("tune", "held-out") for kind in KINDS for sample in range(4)]


def test_conversations_are_drawn_again_the_same_and_parts_differ(tokenizer, suite):
    again = make_conversation(tokenizer, "names", "tune", 3, 1200, 2, True)
    assert again in suite
    tune = {c.document for c in suite if c.part == "tune"}
    held = {c.document for c in suite if c.part == "held-out"}
    assert len(tune) == len(held) == 4 * len(KINDS) and not tune & held


def test_every_answer_is_in_its_document_and_every_turn_has_one(suite):
    for c in suite:
        assert len(c.questions) == len(c.answers) == len(c.depths) == len(c.answer_tokens) == TURNS
        for turn in range(TURNS):
            assert any(a in c.document for a in c.answers[turn]), (c.key, turn)
            if c.depths[turn] is None:
                assert turn >= 2 and c.depths[turn - 1] is not None, "about the answer just before"
                assert "last answer" in c.questions[turn]
                assert c.answers[turn][0] in c.questions[turn - 1]


def test_facts_are_spread_or_packed_and_two_documents_alternate(suite):
    layouts = {len(set(d for d in c.depths if d is not None)) for c in suite if c.kind != "two-documents"}
    assert 1 in layouts and max(layouts) >= 4, "facts packed into one sentence and one per line both occur"
    for c in (c for c in suite if c.kind == "two-documents"):
        assert "Memo A." in c.document and "Memo B." in c.document
    assert any(";" in c.document for c in suite), "several facts to a sentence"


def test_follow_ups_and_answers_vary_in_length(tokenizer, suite):
    lengths = [len(encode_text(tokenizer, q)) for c in suite for q in c.questions[1:]]
    assert min(lengths) <= 8 and max(lengths) >= 150
    assert all(3 <= n <= FOLLOW_UP_TOKENS[1] * 1.5 for n in lengths), "about 5 to 200 (prose of code runs denser)"
    assert {t for c in suite for t in c.answer_tokens} == {16, 40, 96}


def test_turn_one_fits_the_length_and_the_bound_holds(tokenizer, suite):
    for c in suite:
        tokens = len(encode(tokenizer, c.first_message(), True))
        assert 0.85 * c.length <= tokens <= 1.1 * c.length, (c.key, tokens)
    assert max_tokens(1200) >= 1.1 * 1200 + TURNS * (96 + FOLLOW_UP_TOKENS[1])


def test_unknown_kind_or_part_is_refused(tokenizer):
    with pytest.raises(SnapcompileError, match="unknown conversation kind"):
        make_conversation(tokenizer, "recipes", "tune", 0, 1200, 0, True)
    with pytest.raises(SnapcompileError, match="unknown conversation kind"):
        make_conversation(tokenizer, "names", "test", 0, 1200, 0, True)
