"""Multi-turn conversations through the engine, the way a chat client sends them: each turn is a
request holding the whole conversation so far (earlier turns and their answers), submitted when
the turn before it finished. With a session store the engine resumes each turn from the kept cache
of the one before; without one every turn is prefilled whole."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from snapcompile.engine.engine import Engine, Result
from snapcompile.engine.request import Request
from snapcompile.prompts import encode_messages, encode_prompt


@dataclass
class Conversation:
    """request: the conversation's fields (sampling, limits, id), its prompt ids empty; turns: the
    user's texts. In chat form each turn is a user message after the earlier turns and answers; in
    raw form the prompt is the earlier turns and answers concatenated, then the turn's text."""

    request: Request
    turns: list[str]
    results: list[Result] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.results) == len(self.turns) or any(r.failed for r in self.results)

    def next_request(self, tokenizer, chat: bool) -> Request:
        turn = len(self.results)
        if chat:
            messages = []
            for text, result in zip(self.turns, self.results):
                messages += [{"role": "user", "content": text}, {"role": "assistant", "content": result.text}]
            ids = encode_messages(tokenizer, messages + [{"role": "user", "content": self.turns[turn]}])
        else:
            ids = encode_prompt(tokenizer, "".join(t + r.text for t, r in zip(self.turns, self.results))
                                + self.turns[turn])
        request_id = self.request.request_id if len(self.turns) == 1 else f"{self.request.request_id}/{turn + 1}"
        return replace(self.request, prompt_ids=ids, request_id=request_id)


def run_conversations(engine: Engine, conversations: list[Conversation], chat: bool,
                      on_result: Callable[[Conversation, Result], None] | None = None) -> None:
    """Run every conversation to its last turn (or its first failed one), all of them batched
    together; `on_result` after each turn. Results are appended to each Conversation."""
    owner: dict[str, Conversation] = {}

    def submit(conversation: Conversation) -> None:
        request = conversation.next_request(engine.tokenizer, chat)
        owner[request.request_id] = conversation
        engine.submit(request)

    for conversation in conversations:
        submit(conversation)
    while not engine.scheduler.idle:
        for event in engine.step():
            if not event.finished:
                continue
            conversation = owner.pop(event.request_id)
            result = engine.result(event.request_id)
            conversation.results.append(result)
            if on_result:
                on_result(conversation, result)
            if not conversation.done:
                submit(conversation)
