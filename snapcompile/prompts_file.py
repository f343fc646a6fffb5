"""Prompts files (JSONL): one prompt, or one conversation's turns, a line, each with its request fields."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from snapcompile.errors import SnapcompileError, check_text, parse_json
from snapcompile.userfiles import json_lines, read_user_file


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
        lines = json_lines(read_user_file(Path(path), "prompts file").decode("utf-8"))
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
