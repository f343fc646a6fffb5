"""Scheduling policy: FIFO admission into free slots, one prefill at a time, token-budgeted.

No tensors here: it decides, the engine executes.
"""
from __future__ import annotations

from collections import deque

from snapcompile.engine.request import Sequence, Status
from snapcompile.engine.slots import SlotPool


class Scheduler:
    def __init__(self, slots: int, prefill_tokens_per_step: int):
        if prefill_tokens_per_step < 1:
            raise ValueError("prefill_tokens_per_step must be >= 1")
        self.pool = SlotPool(slots)
        self.waiting: deque[Sequence] = deque()
        self.prefilling: deque[Sequence] = deque()
        self.decoding: dict[int, Sequence] = {}
        self.prefill_tokens_per_step = prefill_tokens_per_step

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def admit(self) -> list[Sequence]:
        """Move waiting sequences into free slots; returns the newly admitted ones."""
        admitted = []
        while self.waiting and self.pool.free:
            seq = self.waiting.popleft()
            seq.slot, seq.status = self.pool.acquire(), Status.PREFILLING
            self.prefilling.append(seq)
            admitted.append(seq)
        return admitted

    def prefill_turn(self) -> Sequence | None:
        """The sequence whose prefill advances this step (the oldest admitted; the backend's
        scratch cache holds one prompt at a time)."""
        return self.prefilling[0] if self.prefilling else None

    def prefill_done(self, seq: Sequence) -> None:
        self.prefilling.remove(seq)
        seq.status = Status.DECODING
        self.decoding[seq.slot] = seq

    def release(self, seq: Sequence) -> None:
        """Free the sequence's slot at once (finished, failed or aborted); a sequence still waiting
        leaves the queue."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq.slot is None:
            return
        self.decoding.pop(seq.slot, None)
        if seq in self.prefilling:
            self.prefilling.remove(seq)
        self.pool.release(seq.slot)
        seq.slot = None

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.prefilling or self.decoding)
