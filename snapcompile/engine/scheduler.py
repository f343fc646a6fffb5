"""Scheduling policy: FIFO admission into free slots (lowest first), one prefill at a time,
token-budgeted; decoding sequences move down into free slots when that lets a step run on a
smaller decode graph. A request's followers (Request.shares_prefill_of: the other samples of one
request) are admitted with it, each into a slot of its own, and wait there for its prefill.

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
        self.followers: dict[str, list[Sequence]] = {}     # leader's request id -> admitted followers
        self.prefill_tokens_per_step = prefill_tokens_per_step

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def admit(self) -> list[Sequence]:
        """Move waiting sequences into free slots, each with its waiting followers once there are
        slots for all of them; returns the newly admitted ones that prefill (not the followers).
        A follower whose leader is gone is admitted as a sequence of its own."""
        admitted = []
        while self.waiting:
            seq = self.waiting[0]
            followers = self.waiting_followers(seq)
            if self.pool.free < 1 + len(followers):
                break
            for member in (seq, *followers):
                self.waiting.remove(member)
                member.slot, member.status = self.pool.acquire(), Status.PREFILLING
            self.prefilling.append(seq)
            if followers:
                self.followers[seq.request.request_id] = followers
            admitted.append(seq)
        return admitted

    def waiting_followers(self, leader: Sequence) -> list[Sequence]:
        return [seq for seq in self.waiting if seq.request.shares_prefill_of == leader.request.request_id
                and seq is not leader]

    def take_followers(self, leader: Sequence) -> list[Sequence]:
        """The followers waiting in their slots for `leader`'s prefill (handed over once)."""
        return self.followers.pop(leader.request.request_id, [])

    def prefill_turn(self) -> Sequence | None:
        """The sequence whose prefill advances this step (the oldest admitted; the backend's
        scratch cache holds one prompt at a time)."""
        return self.prefilling[0] if self.prefilling else None

    def prefill_done(self, seq: Sequence) -> None:
        """`seq` decodes from now on (a prefilled sequence, or a follower given its leader's cache)."""
        if seq in self.prefilling:
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
        for followers in self.followers.values():
            if seq in followers:
                followers.remove(seq)
        if seq.slot is None:
            return
        self.decoding.pop(seq.slot, None)
        if seq in self.prefilling:
            self.prefilling.remove(seq)
        self.pool.release(seq.slot)
        seq.slot = None

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.prefilling or self.decoding or any(self.followers.values()))
