"""Finished benchmark points, kept so that a killed `bench` resumes instead of starting over:
every measured point (and each context's prefill timings) is appended as one JSON line to
`OUTPUT.partial.jsonl`, whose first line is the configuration; the file goes once OUTPUT is written."""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from snapcompile.evaluation.partial_results import append_partial, partial_path, read_partial


class PointStore:
    """Points by (slots, context) and prefill timings by context, from an interrupted run of the
    same configuration (any other configuration is refused: its figures are not this run's)."""

    def __init__(self, results_path: Path | None, config):
        self.path = partial_path(results_path) if results_path is not None else None
        self.config_json = json.dumps(asdict(config), sort_keys=True)
        self.points: dict[tuple[int, int], dict] = {}      # (slots, context) -> {"point", "step_bytes"}
        self.prefill: dict[int, dict] = {}
        if self.path is not None and self.path.is_file():
            self._load()
        self.resumed = len(self.points)                    # points taken from the killed run

    def _load(self) -> None:
        for record in read_partial(self.path, self.config_json, "bench"):
            if record.get("kind") == "point":
                self.points[(record["slots"], record["context"])] = record
            elif record.get("kind") == "prefill":
                self.prefill[record["context"]] = record["prefill"]

    def add_point(self, point: dict, step_bytes: dict) -> None:
        record = {"kind": "point", "slots": point["slots"], "context": point["context"], "point": point,
                  "step_bytes": step_bytes}
        self.points[(point["slots"], point["context"])] = record
        self._append(record)

    def add_prefill(self, context: int, prefill: dict) -> None:
        self.prefill[context] = prefill
        self._append({"kind": "prefill", "context": context, "prefill": prefill})

    def _append(self, record: dict) -> None:
        if self.path is not None:
            append_partial(self.path, self.config_json, record)
