"""Pass-key retrieval prompts (a number hidden in filler text) and the demo set of `run --demo`."""
from __future__ import annotations

import random

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
