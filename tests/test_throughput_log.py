"""The periodic throughput line (serve/throughput_log.py), on a clock the test moves."""
from __future__ import annotations

import logging

from snapcompile.engine.output import Result, TokenEvent
from snapcompile.serve.throughput_log import ThroughputLog


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _result(prompt: int, cached: int) -> Result:
    return Result("r", prompt, [1, 2], "", "length", None, 0.1, 1.0, [], cached_tokens=cached)


def test_one_line_an_interval_with_work_and_none_when_idle(caplog):
    clock = Clock()
    reporter = ThroughputLog(slots=4, interval_s=10.0, clock=clock, logger=logging.getLogger("test.throughput"))
    with caplog.at_level(logging.INFO, logger="test.throughput"):
        for _ in range(50):
            reporter.on_event(TokenEvent("r", 7, "x", False), None)
        reporter.on_event(TokenEvent("r", 7, "x", True, "length"), _result(prompt=300, cached=100))
        clock.now = 5.0
        reporter.set_load(running=1, waiting=2, slots_in_use=1, kv_bytes_active=0)
        assert caplog.records == []                      # within the interval
        clock.now = 10.0
        reporter.set_load(running=1, waiting=2, slots_in_use=1, kv_bytes_active=0)
        assert [r.getMessage() for r in caplog.records] == [
            "throughput: prompt 20.0 tok/s, generation 5.1 tok/s; 1 running, 2 waiting, 1 of 4 slots in use; "
            "100 prompt tokens reused from kept caches so far"]
        clock.now = 25.0                                 # an idle interval: nothing
        reporter.set_load(running=0, waiting=0, slots_in_use=0, kv_bytes_active=0)
        assert len(caplog.records) == 1
