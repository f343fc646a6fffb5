"""Turning text into token ids: a chat template rendered within a time limit, plain text, and the
chat-or-not choice of an instruct model."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from snapcompile.errors import SnapcompileError, first_line
from snapcompile.time_limit import TimeLimitExceeded, time_limit

RENDER_TIMEOUT_S = 10.0     # a chat template (a file of the artifact) renders within this, or is refused


@dataclass(frozen=True)
class TemplateOptions:
    """How a chat is rendered, as transformers' apply_chat_template takes it: with the assistant's
    generation prompt (the default), or ending inside the final message so the model continues it
    (`continue_final_message`: the rendered text cut right after that message's content), and extra
    variables the template reads (`variables`: (name, JSON scalar) pairs, e.g. enable_thinking), and
    the tools for a template that renders them itself."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    variables: tuple[tuple[str, object], ...] = ()
    tools: tuple[dict, ...] = ()      # tool definitions for a template that renders them (serve.tool_formats)

    def __post_init__(self):
        if self.add_generation_prompt and self.continue_final_message:
            raise SnapcompileError("continue_final_message and add_generation_prompt cannot both be true")


def encode_messages(tokenizer, messages: list[dict], timeout_s: float | None = RENDER_TIMEOUT_S,
                    max_chars: int | None = None, options: TemplateOptions = TemplateOptions()) -> list[int]:
    """Token ids of chat `messages` through the tokenizer's chat template, rendered within
    `timeout_s` (None: no deadline here; the caller bounds the process) to at most `max_chars`
    characters (None: no bound) and then tokenized as apply_chat_template does. A template that
    fails, loops, renders too much, or a tokenizer that errs is a SnapcompileError naming what went
    wrong (the template and tokenizer come from files, not from code here)."""
    rendered = render_messages(tokenizer, messages, timeout_s, options)
    if max_chars is not None and len(rendered) > max_chars:
        raise SnapcompileError(f"the chat template rendered {len(rendered)} characters: more than this model's "
                               f"context can hold ({max_chars} at the most)")
    return encode_text(tokenizer, rendered)


def render_messages(tokenizer, messages: list[dict], timeout_s: float | None = RENDER_TIMEOUT_S,
                    options: TemplateOptions = TemplateOptions()) -> str:
    """The chat template's text for `messages` rendered with `options`, within `timeout_s`."""
    import jinja2
    try:
        with time_limit(timeout_s) if timeout_s is not None else contextlib.nullcontext():
            rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=options.add_generation_prompt,
                                                     tokenize=False, tools=list(options.tools) or None,
                                                     **dict(options.variables))
        if options.continue_final_message:
            rendered = cut_after_final_message(rendered, messages)
    except TimeLimitExceeded:
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


def cut_after_final_message(rendered: str, messages: list[dict]) -> str:
    """`rendered` cut right after the final message's content (its last occurrence), as transformers'
    continue_final_message cuts it: the model's next token continues that message."""
    final = messages[-1]["content"] if messages else ""
    if not isinstance(final, str) or not final.strip() or final.strip() not in rendered:
        raise SnapcompileError("continue_final_message: the final message's content does not appear in the "
                               "rendered chat (an empty final message cannot be continued)")
    at = rendered.rindex(final.strip())
    kept = len(final.lstrip()) if rendered[at:at + len(final.lstrip())] == final.lstrip() else len(final.strip())
    return rendered[:at + kept]


MAX_TEMPLATE_BYTES = 2**20


def read_chat_template(path: Path) -> str:
    """A chat template file's text (UTF-8, at most MAX_TEMPLATE_BYTES, Jinja that compiles); one error
    line otherwise. Rendering it stays bounded as the artifact's own template is (serve's workers)."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    try:
        with open(path, "rb") as file:
            data = file.read(MAX_TEMPLATE_BYTES + 1)
    except OSError as err:
        raise SnapcompileError(f"cannot read the chat template {path}: {err.strerror or err}") from None
    if len(data) > MAX_TEMPLATE_BYTES:
        raise SnapcompileError(f"the chat template {path} is larger than {MAX_TEMPLATE_BYTES // 2**20} MiB")
    try:
        text = data.decode("utf-8")
        ImmutableSandboxedEnvironment().parse(text)
    except UnicodeDecodeError:
        raise SnapcompileError(f"the chat template {path} is not UTF-8 text") from None
    except jinja2.TemplateSyntaxError as err:
        raise SnapcompileError(f"the chat template {path} is not valid Jinja: line {err.lineno}: {err.message}") \
            from None
    return text


def set_chat_template(tokenizer, template: str) -> None:
    """Replace `tokenizer`'s chat template (a FileTokenizer or a transformers tokenizer)."""
    if hasattr(tokenizer, "set_chat_template"):
        tokenizer.set_chat_template(template)
    else:
        tokenizer.chat_template = template


def encode_text(tokenizer, text: str, add_special_tokens: bool = False) -> list[int]:
    """Token ids of raw `text` (a piece of a prompt, or a rendered chat template, which writes its own
    special tokens); a tokenizer error (e.g. its regex's backtracking limit) is a SnapcompileError."""
    try:
        return [int(i) for i in tokenizer.encode(text, add_special_tokens=add_special_tokens)]
    except BaseException as err:
        _reraise_tokenizer_failure(err)


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Token ids of a whole plain-text prompt: with the special tokens the tokenizer puts around a text
    (a base model's BOS, Gemma's `<bos>`, without which it rambles; none for SmolLM2's), as vLLM's
    /v1/completions and llama.cpp encode a prompt."""
    return encode_text(tokenizer, text, add_special_tokens=True)


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
    return encode_prompt(tokenizer, text)
