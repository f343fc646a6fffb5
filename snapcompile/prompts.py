"""Built-in prompts and prompt files (JSONL), and turning text into token ids."""
from __future__ import annotations

import json
import random
from pathlib import Path

from snapcompile.errors import SnapcompileError

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
          "There and back again. ")


def passkey_prompt(passkey: int, approx_tokens: int, depth: float = 0.5) -> str:
    """A pass-key retrieval prompt: filler text with the key at `depth` (0..1), question last.
    ~approx_tokens for a GPT-style tokenizer (one filler sentence ~ 6 tokens)."""
    repeats = max(1, approx_tokens // 26)
    before = int(repeats * depth)
    needle = f"The pass key is {passkey}. Remember it. {passkey} is the pass key. "
    body = FILLER * before + needle + FILLER * (repeats - before)
    return ("There is an important piece of information hidden inside a lot of irrelevant text. "
            "Find it and memorize it.\n\n" + body + "\n\nWhat is the pass key? Answer with the number only.")


def demo_prompts() -> list[str]:
    """The demo set: two short questions and one pass-key prompt of ~1k tokens."""
    return ["What is the capital of France?",
            "Write one sentence about the ocean.",
            passkey_prompt(random.Random(7).randint(10000, 99999), 1000, depth=0.4)]


def read_prompts_file(path: Path) -> list[dict]:
    """JSONL, one object per line with "prompt" (text) and optional "id", "max_new_tokens",
    "stop", "temperature", "top_k", "top_p", "seed"."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as err:
        raise SnapcompileError(f"cannot read prompts file {path}: {err.strerror}") from None
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise SnapcompileError(f"{path}:{number}: not valid JSON ({err.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise SnapcompileError(f'{path}:{number}: each line must be an object with a "prompt" string')
        records.append(record)
    if not records:
        raise SnapcompileError(f"{path} holds no prompts")
    return records


def encode(tokenizer, text: str, chat: bool) -> list[int]:
    """Token ids of `text`, wrapped in the chat template when `chat`."""
    if chat:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    return [int(i) for i in tokenizer.encode(text, add_special_tokens=False)]
