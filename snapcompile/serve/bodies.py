"""Request bodies parsed and bounded off the event loop, large ones in worker processes.

A JSON body of a few MiB of small lists costs its parser a second of CPU under the GIL, on a worker
thread too, and every other request (and /health) waits for the GIL meanwhile. A body past
IN_PROCESS_BYTES is therefore parsed in a worker process (serve.workers), which returns it only when
it holds at most `max_values` JSON values (what the longest valid request needs: every prompt of a
list at the model's context, plus room for messages and parameters), so the process serving
everyone only ever unpickles a bounded body. Smaller bodies are parsed on a thread: their cost is
small whatever they hold.
"""
from __future__ import annotations

from snapcompile.errors import JsonTooDeep, SnapcompileError, parse_json
from snapcompile.serve.workers import Lane, WorkerProcess, start_all

JSON_MAX_DEPTH = 64                 # nesting of a request body (OpenAI's bodies need 4 or 5)
IN_PROCESS_BYTES = 256 * 1024       # bodies up to this are parsed on a thread
HEADROOM_BYTES = 1 * 2**30          # a body worker's allocations beyond its start (4 MiB of JSON needs < 200 MB)
OTHER_VALUES = 4096                 # a request's values besides its prompts: parameters, stop strings


def max_values(max_prompts: int, prompt_limit: int) -> int:
    """The JSON values the longest valid request holds: `max_prompts` token-id lists (or a chat's
    messages, at least a few tokens each) of `prompt_limit` tokens, and OTHER_VALUES more."""
    return (max_prompts + 4) * (prompt_limit + 2) + OTHER_VALUES


def parse_body(raw: bytes, limit: int):
    """The request body as JSON, or a SnapcompileError (the caller's 400): invalid JSON, integers
    too long to convert, nesting past JSON_MAX_DEPTH, a lone surrogate, or more than `limit` values."""
    try:
        value = parse_json(raw, "the request body")
    except JsonTooDeep:
        raise SnapcompileError(f"the request body nests deeper than {JSON_MAX_DEPTH} levels") from None
    _check_json_value(value, limit)
    return value


def _check_json_value(value, limit: int) -> None:
    """Depth at most JSON_MAX_DEPTH, at most `limit` values, and no string that UTF-8 cannot encode
    (walked without recursion)."""
    stack, seen = [(value, 1)], 0
    while stack:
        item, depth = stack.pop()
        seen += 1
        if seen > limit:
            raise SnapcompileError(f"the request body holds more than {limit} JSON values, more than any "
                                   "request this model can serve")
        if depth > JSON_MAX_DEPTH:
            raise SnapcompileError(f"the request body nests deeper than {JSON_MAX_DEPTH} levels")
        if isinstance(item, dict):
            stack.extend((k, depth + 1) for k in item)
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise SnapcompileError("the request body holds a lone UTF-16 surrogate (\\ud800-\\udfff), "
                                       "which is not text") from None


class BodyParser:
    """parse(raw) -> the JSON body or SnapcompileError; blocks (call it from a worker thread).
    `workers` processes parse bodies past IN_PROCESS_BYTES, each within `timeout_s`."""

    def __init__(self, limit: int, workers: int = 2, timeout_s: float = 30.0):
        self.limit, self.timeout_s = limit, timeout_s
        self._lane = Lane("body", [WorkerProcess("body worker", "snapcompile.serve.body_worker",
                                                 [str(limit), str(HEADROOM_BYTES)]) for _ in range(workers)])
        start_all(self._lane.workers)

    def parse(self, raw: bytes):
        if len(raw) <= IN_PROCESS_BYTES:
            return parse_body(raw, self.limit)
        return self._lane.run(raw, self.timeout_s, f"the request body was not parsed within {self.timeout_s:g} s")

    def pids(self) -> list[int]:
        return [worker.pid for worker in self._lane.workers if worker.pid is not None]

    def close(self) -> None:
        for worker in self._lane.workers:
            worker.stop()
