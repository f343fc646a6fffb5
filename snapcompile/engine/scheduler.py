"""Scheduling policy: FIFO admission into free slots (lowest first), one prefill at a time,
token-budgeted; decoding sequences move down into free slots when that lets a step run on a
smaller decode graph.

No tensors here: it decides, the engine executes.
"""
from __future__ import annotations

from collections import deque

from snapcompile.artifact.naming import decode_graph_size
from snapcompile.engine.request import Sequence, Status
from snapcompile.engine.slots import SlotPool


class Scheduler:
    def __init__(self, slots: int, prefill_tokens_per_step: int, decode_sizes: list[int] | None = None):
        """decode_sizes: slot counts of the backend's decode graphs (a step whose highest active
        slot is h runs on the smallest one > h); default one graph of all slots."""
        if prefill_tokens_per_step < 1:
            raise ValueError("prefill_tokens_per_step must be >= 1")
        self.pool = SlotPool(slots)
        self.decode_sizes = sorted(decode_sizes or [slots])
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

    def graph_size(self, highest_slot: int) -> int:
        """Slots of the decode graph a step whose highest active slot is `highest_slot` runs on."""
        return decode_graph_size(self.decode_sizes, highest_slot)

    def compact(self) -> list[tuple[Sequence, int]]:
        """Move the highest decoding sequence into the lowest free slot while that makes the step's
        decode graph smaller. Returns (sequence, slot it left) per move, in order; the caller
        moves the cache rows before the next step. A prefilling sequence never moves."""
        moves = []
        while self.decoding and self.pool.lowest() is not None:
            highest, free = max(self.decoding), self.pool.lowest()
            after = max([*(slot for slot in self.decoding if slot != highest), free])
            if self.graph_size(after) >= self.graph_size(highest):
                break
            seq = self.decoding.pop(highest)
            seq.slot = self.pool.acquire()
            self.pool.release(highest)
            self.decoding[seq.slot] = seq
            moves.append((seq, highest))
        return moves

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
