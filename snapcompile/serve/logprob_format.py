"""Log probabilities as the wire formats give them: OpenAI's chat `logprobs.content` entries, OpenAI's
legacy completion block ({tokens, token_logprobs, top_logprobs, ...}, also over an echoed prompt), and
vLLM's `prompt_logprobs`. Token texts are the tokenizer's decode of the one token."""
from __future__ import annotations

from snapcompile.engine.output import TokenEvent
from snapcompile.engine.sampling import PromptLogprob


class LogprobFormat:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def chat(self, tokens: list[TokenEvent]) -> dict:
        """OpenAI's chat block: {"content": [{token, logprob, bytes, top_logprobs}, ...]}."""
        return {"content": [{**self._entry(event.token_id, event.logprob),
                             "top_logprobs": [self._entry(i, lp) for i, lp in (event.top_logprobs or [])]}
                            for event in tokens]}

    def legacy(self, tokens: list[TokenEvent]) -> dict:
        """OpenAI's legacy completion block of the generated tokens."""
        return {"tokens": [self.text(e.token_id) for e in tokens], "token_logprobs": [e.logprob for e in tokens],
                "top_logprobs": [self._top_by_text(e.top_logprobs or []) for e in tokens]}

    def legacy_prompt(self, prompt: list[int], scores: list[PromptLogprob], top: int) -> dict:
        """The legacy block of a prompt's tokens (the first has no log probability: null)."""
        return {"tokens": [self.text(token) for token in prompt],
                "token_logprobs": [None] + [score.logprob for score in scores],
                "top_logprobs": [None] + [self._top_by_text(score.top[:top]) for score in scores]}

    def vllm_prompt(self, scores: list[PromptLogprob] | None, top: int) -> list | None:
        """vLLM's prompt_logprobs: None for the first token, then per token {id: {logprob, rank,
        decoded_token}} of the token itself and the `top` likeliest there (None: not computed)."""
        if scores is None:
            return None
        positions = []
        for score in scores:
            position = {str(score.token_id): self._ranked(score.token_id, score.logprob, score.rank)}
            for rank, (token, logprob) in enumerate(score.top[:top], start=1):
                position.setdefault(str(token), self._ranked(token, logprob, rank))
            positions.append(position)
        return [None, *positions]

    def text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self.text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def _ranked(self, token_id: int, logprob: float, rank: int) -> dict:
        return {"logprob": logprob, "rank": rank, "decoded_token": self.text(token_id)}

    def _top_by_text(self, pairs: list[tuple[int, float]]) -> dict[str, float]:
        """The legacy format's {token text: logprob}, likeliest first: tokens whose texts are the same
        (byte pieces of one character) keep the likeliest's."""
        top: dict[str, float] = {}
        for token, logprob in pairs:
            top.setdefault(self.text(token), logprob)
        return top
