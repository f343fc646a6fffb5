"""`run -o OUTPUT`'s partial results, and a stopped run resumed from them.

OUTPUT.partial's first line names the run (`run_identity`: the artifact's configuration and files,
every prompt record and the command line's request values); each further line is one finished
turn, appended as it ends. The same command run again reads it back: conversations whose turns
are all there (or that ended in an error) are not run again, a conversation cut in the middle is
run whole, and the file is rewritten with what is kept before new lines are appended. A file of
another run is refused (`--force` replaces it).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from snapcompile.atomic import PartialLines, write_text_atomic
from snapcompile.errors import SnapcompileError, parse_json
from snapcompile.userfiles import json_lines, read_user_file


def run_identity(manifest, records: list, values: dict) -> str:
    """The first line of a run's partial file: a digest of what decides its results (the artifact's
    manifest fingerprint and file checksums, every prompt record, `values`: the command line's
    request values and flags), not of how it is run (slots, backend, threads)."""
    files = {name: entry["sha256"] for name, entry in manifest.files.items()}
    blob = json.dumps([manifest.fingerprint(), files, [record.fields for record in records], values],
                      sort_keys=True, default=str)
    return json.dumps({"snapcompile run": hashlib.sha256(blob.encode()).hexdigest()})


@dataclass
class Resumed:
    """What a partial file gave back: `rows[c]` the rows of conversation c kept whole (empty when
    it runs again), and `lines` the partial file now being appended to."""

    rows: list[list[dict]]
    lines: PartialLines

    @property
    def finished(self) -> int:
        return sum(bool(rows) for rows in self.rows)


def open_partial(output: Path, identity: str, turn_ids: list[list[str]], force: bool) -> Resumed:
    """OUTPUT.partial for this run: started afresh (none yet, or `force`), or resumed. turn_ids[c]:
    the request ids of conversation c's turns, in order."""
    path = PartialLines.path_of(output)
    kept: list[list[dict]] = [[] for _ in turn_ids]
    if path.exists() and not force:
        kept = _whole_conversations(path, identity, turn_ids)
    lines = "".join(json.dumps(row) + "\n" for rows in kept for row in rows)
    write_text_atomic(path, identity + "\n" + lines)
    partial = PartialLines(output, force=False, append=True)
    partial.lines = sum(len(rows) for rows in kept)
    return Resumed(kept, partial)


def _whole_conversations(path: Path, identity: str, turn_ids: list[list[str]]) -> list[list[dict]]:
    """The rows of `path` grouped by conversation, only where a conversation is whole: every turn
    there, or its turns up to one that failed (a run stops a conversation at its first error)."""
    lines = json_lines(read_user_file(path, "partial results file").decode("utf-8", errors="replace"))
    if not lines or lines[0] != identity:
        raise SnapcompileError(f"{path} holds results of another run (another artifact, prompts or request "
                               "values, or an older snapcompile): use --force to replace it, or move it away")
    where = {turn_id: (c, k) for c, ids in enumerate(turn_ids) for k, turn_id in enumerate(ids)}
    found: list[dict[int, dict]] = [{} for _ in turn_ids]
    for number, line in enumerate(lines[1:], 2):
        try:
            row = parse_json(line, f"{path} line {number}")
        except SnapcompileError:
            if number == len(lines):
                break                  # the line a stopped run was writing
            raise
        place = where.get(row.get("id")) if isinstance(row, dict) else None
        if place is None:
            raise SnapcompileError(f"{path} line {number} is not a turn of this run; use --force to start over")
        found[place[0]][place[1]] = row
    return [_whole(rows, len(ids)) for rows, ids in zip(found, turn_ids)]


def _whole(rows: dict[int, dict], turns: int) -> list[dict]:
    """The conversation's rows in turn order when they are whole, else []."""
    ordered = []
    for k in range(turns):
        if k not in rows:
            return []
        ordered.append(rows[k])
        if rows[k].get("error") is not None:
            break
    return ordered
