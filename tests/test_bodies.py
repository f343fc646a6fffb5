"""serve.bodies: request bodies parsed and bounded off the event loop, large ones in worker processes."""
import json
import os
import signal
import time

import pytest

from snapcompile.errors import SnapcompileError
from snapcompile.serve.bodies import IN_PROCESS_BYTES, BodyParser, max_values, parse_body


def test_parse_body_bounds_values_depth_and_text():
    body = {"model": "m", "prompt": [[1, 2, 3], [4]], "stop": ["x"]}
    assert parse_body(json.dumps(body).encode(), 100) == body
    with pytest.raises(SnapcompileError, match="more than 10 JSON values"):
        parse_body(json.dumps({"prompt": list(range(20))}).encode(), 10)
    with pytest.raises(SnapcompileError, match="nests deeper than 64"):
        parse_body(b"[" * 70 + b"]" * 70, 10_000)
    with pytest.raises(SnapcompileError, match="lone UTF-16 surrogate"):
        parse_body(b'{"prompt": "\\ud800"}', 100)
    with pytest.raises(SnapcompileError, match="not valid JSON"):
        parse_body(b'{"prompt": ', 100)
    assert max_values(32, 512) > 32 * 512


def test_large_bodies_are_parsed_in_a_worker_and_returned_only_when_bounded():
    parser = BodyParser(limit=max_values(4, 1000), workers=1, timeout_s=30)
    try:
        valid = {"model": "m", "prompt": [list(range(1000))] * 4, "text": "x" * IN_PROCESS_BYTES}
        raw = json.dumps(valid).encode()
        assert len(raw) > IN_PROCESS_BYTES and parser.parse(raw) == valid
        flood = json.dumps({"prompt": [[1, 2, 3]] * 100_000}).encode()
        with pytest.raises(SnapcompileError, match="JSON values"):
            parser.parse(flood)
        with pytest.raises(SnapcompileError, match="not valid JSON"):
            parser.parse(raw[:-1])
        os.kill(parser.pids()[0], signal.SIGKILL)        # a worker that dies fails its body, then is replaced
        time.sleep(0.2)
        with pytest.raises(SnapcompileError, match="body worker died"):
            parser.parse(raw)
        assert parser.parse(raw) == valid
    finally:
        parser.close()
    assert parser.pids() == []


def test_a_stopped_worker_cannot_hold_a_large_body_past_its_deadline():
    """A worker that stops reading (SIGSTOP) would block the job's write: the deadline counts from
    before the send, the worker is replaced, and the next body is parsed."""
    import threading
    parser = BodyParser(limit=max_values(4, 1000), workers=1, timeout_s=2)
    try:
        raw = json.dumps({"model": "m", "text": "x" * (300 * 1024)}).encode()
        os.kill(parser.pids()[0], signal.SIGSTOP)
        outcome = []

        def parse():
            try:
                parser.parse(raw)
            except SnapcompileError as err:
                outcome.append(str(err))
        started = time.monotonic()
        waiter = threading.Thread(target=parse, daemon=True)
        waiter.start()
        waiter.join(30)
        assert not waiter.is_alive(), "a stopped worker held the request past its deadline"
        assert outcome and "not parsed within 2 s" in outcome[0] and time.monotonic() - started < 10
        assert parser.parse(raw)["text"] == "x" * (300 * 1024)
    finally:
        for pid in parser.pids():
            os.kill(pid, signal.SIGCONT)
        parser.close()
