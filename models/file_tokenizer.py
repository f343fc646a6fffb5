"""An artifact's tokenizer read from its files with `tokenizers` and jinja2 alone: no transformers,
no torch (the serving path's footprint, docs/results/memory.md). It offers what snapcompile uses of
Hugging Face's fast tokenizer (encode, decode, the vocabulary, the special tokens, the chat template
rendered as `apply_chat_template(..., tokenize=False)` renders it) and gives the same ids, text and
renderings (tests/test_file_tokenizer.py checks both on the project's prompt sets).

The chat template runs in jinja2's immutable sandbox with the globals and filters transformers
gives templates (`raise_exception`, `strftime_now`, `tojson` without HTML escaping, `dict`, a
`namespace` refusing underscore names, loop controls); a template using other extensions (such as
the `{% generation %}` tag, which only training code reads) fails to compile, a clear error.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from tokenizers import Tokenizer

from snapcompile.errors import SnapcompileError, first_line, parse_json

# the named special tokens a chat template sees (transformers' SPECIAL_TOKENS_ATTRIBUTES)
NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
TEMPLATE_FILE = "chat_template.jinja"


class FileTokenizer:
    """core: the Rust tokenizer of tokenizer.json; config: tokenizer_config.json; chat_template:
    the template's text (None: the model has none)."""

    def __init__(self, core: Tokenizer, config: dict, chat_template: str | None):
        self.core, self.config, self.chat_template = core, config, chat_template
        self.special_tokens_map = {name: _content(config[name]) for name in NAMED_TOKENS
                                   if config.get(name) is not None}
        self._clean_up = bool(config.get("clean_up_tokenization_spaces", False)) \
            and type(core.model).__name__ != "BPE"      # transformers skips it for BPE, which it would corrupt
        self._template = None

    def set_chat_template(self, template: str) -> None:
        """Replace the chat template (serve --chat-template)."""
        self.chat_template, self._template = template, None

    @classmethod
    def from_folder(cls, folder: Path, files: list[str]) -> FileTokenizer:
        """The tokenizer of `folder`'s files tokenizer.json, tokenizer_config.json and, when `files`
        lists it, chat_template.jinja (no other file is read); one error line for a missing or bad one."""
        folder = Path(folder)
        try:
            core = Tokenizer.from_file(str(folder / "tokenizer.json"))
            config_text = (folder / "tokenizer_config.json").read_bytes()
            template = (folder / TEMPLATE_FILE).read_text("utf-8") if TEMPLATE_FILE in files else None
        except Exception as err:   # tokenizers raises plain Exceptions; OSError, UnicodeDecodeError
            raise SnapcompileError(f"cannot load the tokenizer in {folder}: {first_line(err)}") from None
        config = parse_json(config_text, str(folder / "tokenizer_config.json"))
        if not isinstance(config, dict):
            raise SnapcompileError(f"{folder / 'tokenizer_config.json'} is not a JSON object")
        refuse_auto_map(config, folder / "tokenizer_config.json")
        if template is None and isinstance(config.get("chat_template"), str):
            template = config["chat_template"]
        return cls(core, config, template)

    # ------------------------------------------------------------------ tokens
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.core.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        text = self.core.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._clean_up else text

    def get_vocab(self) -> dict[str, int]:
        return self.core.get_vocab(with_added_tokens=True)

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json holds it, without padding or truncation (llguidance
        builds its token table from it)."""
        core = Tokenizer.from_str(self.core.to_str())
        core.no_padding()
        core.no_truncation()
        return core.to_str()

    def __len__(self) -> int:
        return self.core.get_vocab_size(with_added_tokens=True)

    def __getattr__(self, name: str):
        """eos_token_id, bos_token_id, ...: the id of a named special token (None when unset)."""
        if name.startswith("_"):
            raise AttributeError(name)
        if name.endswith("_token_id") and name[:-3] in NAMED_TOKENS:
            token = self.special_tokens_map.get(name[:-3])
            return None if token is None else self.core.token_to_id(token)
        if name in NAMED_TOKENS:
            return self.special_tokens_map.get(name)
        raise AttributeError(name)

    # ------------------------------------------------------------------ chat
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False, tokenize: bool = False,
                            tools: list[dict] | None = None, **variables) -> str:
        """The template's text for `messages` (and `tools`, JSON schemas), as transformers renders it;
        `variables` are the template's extra variables (transformers' chat template kwargs: a
        special token's name among them overrides the tokenizer's, the arguments above do not)."""
        if tokenize:
            raise ValueError("FileTokenizer renders text only (tokenize=False); encode the text after")
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        if self._template is None:
            self._template = _compile(self.chat_template)
        return self._template.render({**self.special_tokens_map, **variables, "messages": messages, "tools": tools,
                                      "documents": None, "add_generation_prompt": add_generation_prompt})

    def __deepcopy__(self, memo) -> FileTokenizer:
        """A copy with a Rust tokenizer of its own (a thread's; the Rust state is borrowed per call)."""
        return FileTokenizer(Tokenizer.from_str(self.core.to_str()), dict(self.config), self.chat_template)


def refuse_auto_map(config, path: Path) -> None:
    """One error line for a config asking to import the folder's own Python code (`auto_map`):
    FileTokenizer would not run it, but reading tokenizer.json instead of the class the model asks
    for could tokenize differently, silently; snapcompile never executes code from a model folder."""
    if isinstance(config, dict) and "auto_map" in config:
        raise SnapcompileError(f"{path} asks to run Python code from the folder (auto_map); snapcompile "
                               "never executes code from a model folder or artifact: refused")


def _content(token) -> str:
    """A special token as tokenizer_config.json writes it: its text, or {"content": text, ...}."""
    return str(token["content"]) if isinstance(token, dict) else str(token)


def _clean_up_tokenization(text: str) -> str:
    """transformers' clean_up_tokenization: no space before punctuation and contractions."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text


def _compile(source: str):
    """The template compiled in jinja2's immutable sandbox with what transformers gives templates."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template cannot set {name!r} on a namespace")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=TemplateDict(), namespace=TemplateNamespace)
    return env.from_string(source)
