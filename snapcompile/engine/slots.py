"""Which of the N static decode slots are free."""
from __future__ import annotations


class SlotPool:
    def __init__(self, slots: int):
        self._free = list(range(slots - 1, -1, -1))
        self.num_slots = slots

    def acquire(self) -> int | None:
        """A free slot (lowest number first), or None when all are busy."""
        return self._free.pop() if self._free else None

    def lowest(self) -> int | None:
        """The slot `acquire` would give, without taking it."""
        return self._free[-1] if self._free else None

    def release(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} is not in use")
        self._free.append(slot)
        self._free.sort(reverse=True)

    @property
    def free(self) -> int:
        return len(self._free)
