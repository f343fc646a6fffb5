"""Finished case records, kept so that an interrupted or widened evaluation resumes instead of
starting over: the results file of an earlier run, plus a `.partial.jsonl` beside it that every
finished case is appended to."""
from __future__ import annotations

import json
from dataclasses import MISSING, asdict, fields
from pathlib import Path

from snapcompile.errors import SnapcompileError, parse_json
from snapcompile.evaluation.config import EvalConfig
from snapcompile.evaluation.tasks import Case
from snapcompile.userfiles import json_lines, read_user_file


def partial_path(results_path: Path) -> Path:
    """Where an unfinished run keeps its records (removed once the results file is written)."""
    return Path(str(results_path) + ".partial.jsonl")


def read_results(path: Path, command: str, *items: str) -> tuple:
    """The configuration and each of the `items` lists stored in a results file that `command` wrote."""
    try:
        payload = json.loads(read_user_file(Path(path), "results file"))
        return (payload["config"], *(payload[item] for item in items))
    except (ValueError, TypeError, KeyError):
        raise SnapcompileError(f"{path} exists and is not a results file of `snapcompile {command}`; "
                               "choose another -o") from None


def config_defaults(config_class) -> dict:
    """A configuration dataclass's defaults, as they read back from JSON (what a stored
    configuration that predates a field counts it as)."""
    return json.loads(json.dumps({f.name: f.default for f in fields(config_class) if f.default is not MISSING}))


def read_partial(path: Path, config_json: str, what: str) -> list[dict]:
    """The records of a partial file whose first line is `config_json` (another configuration is
    refused: its records are not this run's). A truncated last line (a killed run was writing it)
    is dropped from the file, so that new records follow whole lines."""
    path = Path(path)
    if not path.is_file():
        return []
    lines = [line for line in json_lines(path.read_text(encoding="utf-8")) if line.strip()]
    if not lines or parse_json(lines[0], str(path)) != json.loads(config_json):
        raise SnapcompileError(f"{path} holds results of another {what} configuration: delete it or change -o")
    records = []
    for number, line in enumerate(lines[1:], 2):
        try:
            records.append(parse_json(line, f"{path} line {number}"))
        except SnapcompileError:
            if number != len(lines):
                raise
            path.write_text("\n".join(lines[:-1]) + "\n", encoding="utf-8")
    return records


def append_partial(path: Path, config_json: str, record: dict) -> None:
    """Append `record` as one JSON line (the file starts with `config_json`)."""
    path = Path(path)
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(config_json + "\n", encoding="utf-8")
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(record) + "\n")


class ResultStore:
    """Finished case records: those of the results file of an earlier run, and those of an
    interrupted run, appended one JSON line each to the partial file (the resume point).

    A run may reuse the records of an earlier run that differs only in its grid (policies, budgets,
    ratios, depths, samples, lengths up to the same longest): a record depends only on its case,
    policy and budget, and on the fields in `_SAME_RESULTS`, which must match."""

    def __init__(self, results_path: Path, config: EvalConfig):
        self.path = partial_path(results_path)
        self.config_json = json.dumps(asdict(config), sort_keys=True)
        self.records: dict[str, dict] = {}
        self._load_results(Path(results_path), config)
        if self.path.is_file():
            lines = json_lines(self.path.read_text(encoding="utf-8"))
            self._check_config(json.loads(lines[0]) if lines else {}, config, self.path)
            for line in lines[1:]:
                if line.strip():
                    record = json.loads(line)
                    self.records[record["id"]] = record

    def _load_results(self, path: Path, config: EvalConfig) -> None:
        if not path.is_file():
            return
        stored, records = read_results(path, "eval", "records")
        self._check_config(stored, config, path)
        self.records.update((record["id"], record) for record in records)

    @staticmethod
    def _check_config(stored: dict, config: EvalConfig, path: Path) -> None:
        differing = _differing_fields(stored, config)
        if differing:
            raise SnapcompileError(f"{path} holds results of another model, task, seed, scope, kernel, weights or "
                                   f"artifact shape ({', '.join(differing)} differ): delete it or change -o")

    @staticmethod
    def record_id(case: Case, policy: str, budget: int | None) -> str:
        return f"{policy}@{budget or '-'}/{case.key}"

    def done(self, case: Case, policy: str, budget: int | None) -> bool:
        return self.record_id(case, policy, budget) in self.records

    def add(self, record: dict) -> None:
        self.records[record["id"]] = record
        append_partial(self.path, self.config_json, record)


_SAME_RESULTS = ("source", "task", "seed", "slots", "chunk", "scope", "kernel", "weight_format", "block_size",
                 "kv_dtype", "generate")


def _differing_fields(stored: dict, config: EvalConfig) -> list[str]:
    """The fields of `_SAME_RESULTS` in which records stored under configuration `stored` differ from
    `config` (those it predates count as their defaults), and "lengths" where the artifact shape (its
    longest length) differs: records are valid for `config` when there are none."""
    current = json.loads(json.dumps(asdict(config)))
    defaults = config_defaults(EvalConfig)
    differing = [k for k in _SAME_RESULTS if stored.get(k, defaults.get(k)) != current[k]]
    return differing + (["lengths"] if max(stored.get("lengths") or [0]) != max(config.lengths) else [])
