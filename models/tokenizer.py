"""Tokenizers: loaded from a model or artifact folder without running its code, and a
byte-level tokenizer for the tiny random-weight models (no download, deterministic)."""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from snapcompile.errors import SnapcompileError, first_line, parse_json
from snapcompile.models.file_tokenizer import refuse_auto_map

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CODE_CONFIGS = ("config.json", "tokenizer_config.json")


def refuse_remote_code(folder: Path) -> None:
    """One error line for a folder whose configs ask transformers to import the folder's own
    Python code (`auto_map`): snapcompile never executes code from a model folder or artifact."""
    for name in CODE_CONFIGS:
        path = Path(folder) / name
        try:
            text = path.read_bytes()
        except FileNotFoundError:
            continue
        refuse_auto_map(parse_json(text, str(path)), path)


def load_tokenizer(folder: Path, gguf_file: str | None = None, files: list[str] | None = None):
    """The tokenizer saved in `folder` (a model folder or an artifact), remote code refused.
    files: read only these files of the folder (an artifact's manifest lists them): they are
    copied into a private folder first, so a file added beside them (an extra chat template,
    added_tokens.json) cannot change the tokenization."""
    if files is None:
        return _from_pretrained(Path(folder), gguf_file, shown=folder)
    with tempfile.TemporaryDirectory(prefix="snapcompile-tokenizer-") as staged:
        for name in files:
            shutil.copyfile(Path(folder) / name, Path(staged) / name)
        return _from_pretrained(Path(staged), gguf_file, shown=folder)


def _from_pretrained(folder: Path, gguf_file: str | None, shown: Path):
    from transformers import AutoTokenizer
    refuse_remote_code(folder)
    try:
        return AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf_file, trust_remote_code=False,
                                             local_files_only=True)
    except Exception as err:  # transformers raises many types for missing or malformed files
        raise SnapcompileError(f"cannot load the tokenizer in {shown}: {first_line(err)}") from None


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """256 byte tokens (ids 0..255) followed by the special tokens; EOS is <|im_end|>. It carries
    SmolLM2's ChatML template (the tiny models still take raw prompts by default: their `chat`
    flag is off), so chat endpoints can be tested on them."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<|im_start|>",
                                        eos_token="<|im_end|>", unk_token=None,
                                        pad_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS)})
    tokenizer.chat_template = CHATML
    return tokenizer
