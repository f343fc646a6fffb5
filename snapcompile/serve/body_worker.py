"""A body worker process (serve.bodies): `python -m snapcompile.serve.body_worker LIMIT
HEADROOM_BYTES FD`; answers raw JSON bytes with ("ok", value) | ("error", message)
(serve.worker_side.run_worker)."""
from __future__ import annotations

import sys

from snapcompile.errors import SnapcompileError
from snapcompile.serve.bodies import parse_body
from snapcompile.serve.worker_side import run_worker


def _answer(limit: int, raw: bytes) -> tuple[str, object]:
    try:
        return "ok", parse_body(raw, limit)
    except SnapcompileError as err:
        return "error", str(err)


if __name__ == "__main__":
    limit, headroom, fd = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    run_worker(fd, headroom, lambda: limit, _answer)
