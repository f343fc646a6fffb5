"""Token constraints: structured output as a mask on the logits, one token at a time.

A `GrammarConstraint` wraps an llguidance matcher (JSON schemas compiled against the model's
tokenizer): before each token the logits of every token the grammar forbids become -inf, after it
the token is consumed. EOS is allowed only where the grammar may end, so an answer reported as
finished ("stop") is complete; one cut by max_tokens ends with "length". A schema no value
satisfies (its grammar in error before the first token) is refused when compiled; one whose values
never end (an object that must hold itself) runs to "length". A request without a
constraint pays nothing. llguidance is imported only when a grammar is made.
"""
from __future__ import annotations

import json

import numpy as np

from snapcompile.errors import SnapcompileError

MAX_SCHEMA_CHARS = 64 * 1024
# no free whitespace between JSON tokens: a model (a random one at once, a real one sometimes) can
# otherwise spend every token on spaces and never finish the object
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarTokenizer:
    """The model's tokenizer as llguidance sees it (built once per server: ~0.3 s at SmolLM2's
    49152 tokens). `vocab_size`: the width of the model's logits."""

    def __init__(self, tokenizer, vocab_size: int):
        import llguidance
        self.vocab_size = vocab_size
        if hasattr(tokenizer, "to_json"):          # a FileTokenizer: no transformers needed
            self.ll = llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=vocab_size,
                                             eos_token=tokenizer.eos_token_id)
        else:
            import llguidance.hf
            self.ll = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)

    def json_schema(self, schema: dict) -> JsonGrammar:
        """The grammar of JSON valid under `schema`, compiled and checked once (each request makes
        its own constraint from it); SnapcompileError for a schema that is too large or that
        llguidance refuses (the message says why)."""
        import llguidance
        text = json.dumps(schema)
        if len(text) > MAX_SCHEMA_CHARS:
            raise SnapcompileError(f"the JSON schema has {len(text)} characters; at most {MAX_SCHEMA_CHARS}")
        grammar = llguidance.LLMatcher.grammar_from_json_schema(text, overrides=COMPACT_JSON)
        problem = llguidance.LLMatcher.validate_grammar(grammar, self.ll)
        if problem:
            raise SnapcompileError(f"the JSON schema cannot be used: {problem.strip().splitlines()[0]}")
        checked = JsonGrammar(self, grammar)
        start = checked.constraint()
        start.mask(np.zeros(self.vocab_size, np.float32))       # the matcher finds its dead ends computing a mask
        if start.matcher.is_error() or start.finished:
            raise SnapcompileError("no JSON value satisfies this schema (a $ref that only reaches itself, or "
                                   "choices that exclude each other): refused rather than answered empty")
        return checked


class JsonGrammar:
    """A checked grammar; `constraint()` -> a fresh GrammarConstraint (one per request)."""

    def __init__(self, tokenizer: GrammarTokenizer, grammar):
        self.tokenizer, self.grammar = tokenizer, grammar

    def constraint(self) -> GrammarConstraint:
        import llguidance
        return GrammarConstraint(llguidance.LLMatcher(self.tokenizer.ll, self.grammar), self.tokenizer.vocab_size)


class GrammarConstraint:
    """One request's grammar state: `mask(logits [V])` -> a copy with every forbidden token at
    -inf; `consume(token)` (a SnapcompileError, which fails the request, if the grammar refuses it);
    `finished` once the grammar allows nothing more."""

    def __init__(self, matcher, vocab_size: int):
        import llguidance.numpy as llnp
        self._llnp, self.matcher = llnp, matcher
        self._bitmask = llnp.allocate_token_bitmask(1, vocab_size)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        masked = np.array(logits, dtype=np.float32, copy=True)[None]
        self._llnp.fill_next_token_bitmask(self.matcher, self._bitmask, 0)
        self._llnp.apply_token_bitmask_inplace(masked, self._bitmask)
        return masked[0]

    def consume(self, token: int) -> None:
        """Advance by `token`; a token the grammar refuses, or one that leaves it in error (nothing
        valid can follow), fails the request: "stop" is only ever a complete, valid answer."""
        if not self.matcher.consume_token(token) or self.matcher.is_error():
            raise SnapcompileError(f"the output grammar refused token {token}: {self.matcher.get_error()}")

    @property
    def finished(self) -> bool:
        """The grammar allows nothing more (the answer is complete)."""
        return self.matcher.is_stopped()
