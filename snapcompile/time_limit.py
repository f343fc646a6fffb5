"""A time limit on Python code running on this thread (a chat template's rendering)."""
from __future__ import annotations

import contextlib
import sys
import time


class TimeLimitExceeded(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise TimeLimitExceeded inside Python code running longer than `seconds` on this thread (a
    trace function: a template's loops are Python code; Rust tokenization is bounded by size)."""
    deadline = time.monotonic() + seconds

    def tracer(frame, event, arg):
        if time.monotonic() > deadline:
            raise TimeLimitExceeded
        return tracer
    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        yield
    finally:
        sys.settrace(previous)
