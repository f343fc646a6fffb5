"""A tokenizer worker process (serve.tokenizer_pool): `python -m snapcompile.serve.tokenizer_worker
FOLDER HEADROOM_BYTES TEMPLATE FD` (TEMPLATE: a chat template file replacing the artifact's, or "").

Loads the artifact's tokenizer (a FileTokenizer: neither transformers nor torch; an artifact
without tokenizer.json goes through transformers, kept from torch), then answers ("chat", (messages,
TemplateOptions), max_chars) or ("text", text, None) with ("ok", ids) | ("error", message)
(serve.worker_side.run_worker).
"""
from __future__ import annotations

import sys
from pathlib import Path

from snapcompile.serve.worker_side import run_worker


def _load(folder: Path, template: str):
    sys.modules["torch"] = None       # should transformers load, as tokenizer-only (~120 MB instead of ~310 MB)
    from snapcompile.artifact.files import artifact_tokenizer
    from snapcompile.artifact.manifest import read_manifest
    from snapcompile.prompts import read_chat_template, set_chat_template
    tokenizer = artifact_tokenizer(folder, read_manifest(folder))
    if template:
        set_chat_template(tokenizer, read_chat_template(Path(template)))
    return tokenizer


def _answer(tokenizer, job) -> tuple[str, object]:
    from snapcompile.errors import SnapcompileError
    from snapcompile.prompts import encode_messages, encode_prompt
    kind, payload, max_chars = job
    try:
        if kind == "chat":
            messages, options = payload
            return "ok", encode_messages(tokenizer, messages, timeout_s=None, max_chars=max_chars, options=options)
        return "ok", encode_prompt(tokenizer, payload)
    except SnapcompileError as err:
        return "error", str(err)


if __name__ == "__main__":
    folder, headroom, template, fd = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    run_worker(fd, headroom, lambda: _load(folder, template), _answer)
