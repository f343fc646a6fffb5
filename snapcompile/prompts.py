"""Built-in prompts and prompt files (JSONL), and turning text into token ids."""
from __future__ import annotations

import contextlib
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from snapcompile.errors import SnapcompileError, check_text, first_line, parse_json
from snapcompile.userfiles import read_user_file

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
          "There and back again. ")


INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. "
         "Find it and memorize it.\n\n")


def passkey_text(passkey: int, repeats: int, depth: float) -> str:
    """A pass-key retrieval prompt: `repeats` filler blocks with the key after a `depth` (0..1)
    share of them, the question last."""
    before = int(repeats * depth)
    needle = f"The pass key is {passkey}. Remember it. {passkey} is the pass key. "
    return (INTRO + FILLER * before + needle + FILLER * (repeats - before)
            + "\n\nWhat is the pass key? Answer with the number only.")


def passkey_prompt(passkey: int, approx_tokens: int, depth: float = 0.5) -> str:
    """A pass-key prompt of ~approx_tokens for a GPT-style tokenizer (a filler block ~ 26 tokens)."""
    return passkey_text(passkey, max(1, approx_tokens // 26), depth)


def demo_prompts() -> list[str]:
    """The demo set: two short questions and one pass-key prompt of ~1k tokens."""
    return ["What is the capital of France?",
            "Write one sentence about the ocean.",
            passkey_prompt(random.Random(7).randint(10000, 99999), 1000, depth=0.4)]


@dataclass(frozen=True)
class PromptRecord:
    """One prompt and its per-request fields; `where` names its source for error messages
    ("prompts.jsonl line 7", "--prompt 2")."""

    fields: dict
    where: str

    @property
    def turns(self) -> list[str]:
        """The user's turns: the one prompt, or a conversation's "turns"."""
        return self.fields["turns"] if "turns" in self.fields else [self.fields["prompt"]]

    @property
    def prompt(self) -> str:
        """The first turn."""
        return self.turns[0]


MAX_TURNS = 64      # turns of one conversation in a prompts file


def read_prompts_file(path: Path) -> list[PromptRecord]:
    """JSONL (UTF-8), one object per line with "prompt" (text) or "turns" (a conversation: a list
    of the user's texts, each sent with the answers so far) and optional "id", "max_new_tokens",
    "stop", "temperature", "top_k", "top_p", "seed"."""
    try:
        lines = read_user_file(Path(path), "prompts file").decode("utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise SnapcompileError(f"prompts file {path} is not UTF-8 text (byte {err.start})") from None
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path} line {number}"
        record = parse_json(line, where)
        records.append(PromptRecord(_checked_record(record, where), where))
    if not records:
        raise SnapcompileError(f"{path} holds no prompts")
    return records


def _checked_record(record, where: str) -> dict:
    """A prompts-file record with one "prompt" string or 1..MAX_TURNS "turns" strings."""
    if not isinstance(record, dict) or ("prompt" in record) == ("turns" in record):
        raise SnapcompileError(f'{where}: each line must be an object with a "prompt" string or a "turns" list')
    if "prompt" in record:
        if not isinstance(record["prompt"], str):
            raise SnapcompileError(f'{where}: "prompt" must be a string')
        check_text(record["prompt"], f"{where}: the prompt")
        return record
    turns = record["turns"]
    if not isinstance(turns, list) or not 1 <= len(turns) <= MAX_TURNS or not all(isinstance(t, str) for t in turns):
        raise SnapcompileError(f'{where}: "turns" must be a list of 1..{MAX_TURNS} strings')
    for number, turn in enumerate(turns, 1):
        check_text(turn, f"{where}: turn {number}")
    return record


RENDER_TIMEOUT_S = 10.0     # a chat template (a file of the artifact) renders within this, or is refused


class _RenderTimeout(Exception):
    pass


@contextlib.contextmanager
def _time_limit(seconds: float):
    """Raise _RenderTimeout inside Python code running longer than `seconds` on this thread (a
    trace function: a template's loops are Python code; Rust tokenization is bounded by size)."""
    deadline = time.monotonic() + seconds

    def tracer(frame, event, arg):
        if time.monotonic() > deadline:
            raise _RenderTimeout
        return tracer
    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        yield
    finally:
        sys.settrace(previous)


def encode_messages(tokenizer, messages: list[dict], timeout_s: float | None = RENDER_TIMEOUT_S,
                    max_chars: int | None = None) -> list[int]:
    """Token ids of chat `messages` through the tokenizer's chat template, rendered within
    `timeout_s` (None: no deadline here; the caller bounds the process) to at most `max_chars`
    characters (None: no bound) and then tokenized as apply_chat_template does. A template that
    fails, loops, renders too much, or a tokenizer that errs is a SnapcompileError naming what went
    wrong (the template and tokenizer come from files, not from code here)."""
    rendered = render_messages(tokenizer, messages, timeout_s)
    if max_chars is not None and len(rendered) > max_chars:
        raise SnapcompileError(f"the chat template rendered {len(rendered)} characters: more than this model's "
                               f"context can hold ({max_chars} at the most)")
    return encode_text(tokenizer, rendered)


def render_messages(tokenizer, messages: list[dict], timeout_s: float | None = RENDER_TIMEOUT_S) -> str:
    """The chat template's text for `messages` (with the generation prompt), within `timeout_s`."""
    import jinja2
    try:
        with _time_limit(timeout_s) if timeout_s is not None else contextlib.nullcontext():
            rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except _RenderTimeout:
        raise SnapcompileError(f"the chat template did not render within {timeout_s:g} s; refused") from None
    except jinja2.TemplateError as err:
        raise SnapcompileError(f"the chat template failed: {type(err).__name__}: {first_line(err)}") from None
    except (ValueError, TypeError) as err:
        raise SnapcompileError(f"the chat template cannot be applied: {first_line(err)}") from None
    except MemoryError:
        raise SnapcompileError("the chat template ran out of memory while rendering; refused") from None
    if not isinstance(rendered, str):
        raise SnapcompileError(f"the chat template rendered a {type(rendered).__name__}, not text")
    return rendered


def encode_text(tokenizer, text: str) -> list[int]:
    """Token ids of raw `text`; a tokenizer error (e.g. its regex's backtracking limit) is a SnapcompileError."""
    try:
        return [int(i) for i in tokenizer.encode(text, add_special_tokens=False)]
    except BaseException as err:
        _reraise_tokenizer_failure(err)


def _reraise_tokenizer_failure(err: BaseException):
    """The tokenizers library fails with plain Exceptions, and its Rust code with a PanicException
    (a BaseException: e.g. its regex engine's backtracking limit on a crafted pre-tokenizer
    pattern): a SnapcompileError either way. Interrupts and exits go on as they are."""
    if isinstance(err, (KeyboardInterrupt, SystemExit, SnapcompileError)):
        raise err
    raise SnapcompileError(f"the tokenizer failed on this prompt: {first_line(err)}") from None


def max_prompt_chars(tokenizer, max_tokens: int) -> int:
    """An upper bound on the characters of a prompt that fits in `max_tokens` tokens: each token
    stands for at most as many characters as its longest vocabulary entry has."""
    longest = max((len(token) for token in tokenizer.get_vocab()), default=1)
    return max_tokens * max(longest, 1)


def encode(tokenizer, text: str, chat: bool) -> list[int]:
    """Token ids of `text`, wrapped in the chat template when `chat`."""
    if chat:
        return encode_messages(tokenizer, [{"role": "user", "content": text}])
    return encode_text(tokenizer, text)
