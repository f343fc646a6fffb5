"""Where each token of a sequence lives in its fixed-size cache slot (no tensors here).

A slot holds `rows_per_slot` cache rows. The prompt's kept tokens occupy rows [0, kept) in position
order; decode tokens follow. For the dense policy rows_per_slot is max_context and nothing wraps;
for compressed policies rows_per_slot is the budget B and rows [kept, B) form a ring in which a new
token overwrites the oldest generated one.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DecodeStep:
    """Per-slot decode-graph inputs for one step.

    position: original position of the token fed this step (its RoPE position).
    write_index: cache row its K/V is written to.
    cache_len: rows [0, cache_len) hold valid K/V before this step's write; the row at
    write_index is excluded from attention (it is being overwritten), the new token attends to
    itself through the graph's "new token" branch.
    """

    position: int
    write_index: int
    cache_len: int


@dataclass(frozen=True)
class SlotLayout:
    """Cache layout of one sequence: prompt_len T tokens, of which `kept` sit in the slot."""

    prompt_len: int
    kept: int
    rows_per_slot: int
    ring: bool

    @classmethod
    def for_prompt(cls, prompt_len: int, rows_per_slot: int, prompt_share: int | None) -> SlotLayout:
        """prompt_share None = dense (keep everything, no ring)."""
        return cls.for_rows(prompt_len, prompt_len, rows_per_slot, prompt_share)

    @classmethod
    def for_rows(cls, prompt_len: int, rows: int, rows_per_slot: int, prompt_share: int | None) -> SlotLayout:
        """A prompt of `prompt_len` positions prefilled as `rows` cache rows (fewer for a resumed
        conversation, whose older positions were compressed before): at most the prompt share kept."""
        if prompt_share is None:
            return cls(prompt_len, rows, rows_per_slot, ring=False)
        return cls(prompt_len, min(rows, prompt_share), rows_per_slot, ring=True)

    @property
    def compressed(self) -> bool:
        return self.kept < self.prompt_len

    @property
    def ring_size(self) -> int:
        return self.rows_per_slot - self.kept

    def step(self, generated: int) -> DecodeStep:
        """Inputs for feeding the `generated`-th decode token (0-based: the first token sampled
        from the prefill logits is fed with generated=0)."""
        position = self.prompt_len + generated
        if not self.ring:
            if position >= self.rows_per_slot:
                raise IndexError(f"position {position} exceeds the cache rows_per_slot {self.rows_per_slot}")
            return DecodeStep(position, position, position)
        write = self.kept + generated % self.ring_size
        return DecodeStep(position, write, min(self.kept + generated, self.rows_per_slot))

    def fed_rows(self, fed: int) -> list[tuple[int, int]]:
        """(row, position) of the decode tokens whose K/V the slot holds once `fed` of them were
        fed (steps 0 .. fed-1), oldest first: all of them without a ring, the last ring_size with one."""
        first = max(0, fed - self.ring_size) if self.ring else 0
        return [(self.step(g).write_index, self.prompt_len + g) for g in range(first, fed)]

    def can_feed(self, generated: int) -> bool:
        """Whether decode token number `generated` still fits (always true for a ring)."""
        return self.ring or self.prompt_len + generated < self.rows_per_slot


@dataclass(frozen=True)
class WindowRing:
    """A sliding-window layer's cache (Gemma 3's local layers): `rows` rows in which the token at
    position p lives at row p % rows, whatever the policy, so the layer holds its window and no more.
    A query at position q sees the keys at positions (q - window, q] (Hugging Face's sliding window).

    rows = window + chunk: a prefill chunk of C tokens (the last one may start up to C - 1 positions
    before the rows already written end, `device.chunk_starts`) finds every key its window needs
    still in the ring; a row written past the chunk's first position only ever replaced a key
    older than every one of its queries' windows."""

    window: int
    rows: int

    @classmethod
    def for_export(cls, window: int, chunk: int) -> WindowRing:
        return cls(window, window + chunk)

    def row(self, position: int) -> int:
        """The row of the token at `position`."""
        return position % self.rows

    def position_at(self, row: int, first: int) -> int:
        """The position row `row` holds for a run whose first new token is at `first`, when every
        position before `first` was written in order: the latest p < first with p % rows == row
        (negative: never written in this sequence)."""
        return first - 1 - (first - 1 - row) % self.rows

    def held(self, end: int) -> range:
        """The positions a ring holds once positions [0, end) were written in order, oldest first:
        the last min(end, rows) of them."""
        return range(max(end - self.rows, 0), end)

    def resumes(self, first_held: int, first: int) -> bool:
        """Whether a ring holding positions [first_held, end) (end >= first, each at its row) serves a
        run whose first new token is at `first`: it holds every key of that token's window, so a row
        still holding a position >= first only ever stands, for the graphs, for one older than any
        new query's window (`position_at`)."""
        return first_held <= max(first - self.window + 1, 0)

    def visible(self, row: int, first: int, query: int) -> bool:
        """Whether the query at position `query` (>= first) sees ring row `row` of a run starting at
        `first`: the row holds a key of this sequence within the query's window. The graphs compute
        the same rule (export/llama_graph.py)."""
        held = self.position_at(row, first)
        return held >= 0 and query - held < self.window
