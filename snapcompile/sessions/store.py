"""The session store: finished sequences' caches kept in host memory, least recently used first
out, bounded by bytes (`--session-cache-bytes`). A request that begins with a kept sequence's
tokens resumes from it (`sessions/kept.py`), but only from an entry kept in its own partition: partitions
never see each other's entries, so what a lookup finds (and `cached_tokens`, which says how much it
found) reveals nothing across them (docs/serving.md, "Who shares kept caches"). Entries are never
changed; the engine thread is the only one that touches the store."""
from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from snapcompile.layout import WindowRing
from snapcompile.sessions.kept import KeptCache, ResumePlan, common_prefix, plan_resume
from snapcompile.sessions.prefix_index import PrefixIndex

MAX_ENTRIES = 1024        # entries of all partitions together
INDEX_MIN_BLOCK = 16      # a resume of fewer tokens than this compares the prompt with every entry of its partition


@dataclass
class StoreCounters:
    hits: int = 0
    misses: int = 0
    tokens_reused: int = 0
    evictions: int = 0
    refused: int = 0          # entries larger than the whole store


class SessionStore:
    def __init__(self, max_bytes: int, window: int, max_rows: int, min_tokens: int = 1,
                 max_entries: int = MAX_ENTRIES, ring: WindowRing | None = None):
        """window: tokens a resumed request prefills anew at least (the policy's observation window,
        0 without a selection); max_rows: the rows a resumed prefill may attend over; min_tokens:
        the fewest tokens worth resuming (the engine uses one prefill chunk: less saves nothing);
        ring: the model's window ring (layers of sliding-window attention; plan_resume)."""
        if max_bytes < 0 or max_entries < 1:
            raise ValueError("max_bytes must be >= 0 and max_entries >= 1")
        self.max_bytes, self.window, self.max_rows, self.max_entries = max_bytes, window, max_rows, max_entries
        self.min_tokens, self.ring = min_tokens, ring
        # (partition, token-id bytes) -> entry, least recently used first; and each partition's keys
        self._entries: OrderedDict[tuple[str, bytes], KeptCache] = OrderedDict()
        self._partitions: dict[str, dict[tuple[str, bytes], None]] = {}
        self._ticks: dict[tuple[str, bytes], int] = {}          # key -> when it was last kept or used
        self._clock = itertools.count()
        # entries by their token prefixes of min_tokens-token blocks: a lookup costs O(prompt)
        self._index = PrefixIndex(min_tokens) if min_tokens >= INDEX_MIN_BLOCK else None
        self.bytes = 0
        self.counters = StoreCounters()

    def __len__(self) -> int:
        return len(self._entries)

    def entry_bytes(self) -> list[int]:
        """Bytes of each kept entry, least recently used first."""
        return [kept.nbytes for kept in self._entries.values()]

    def newest(self) -> KeptCache | None:
        """The entry kept or used most recently (None when the store is empty)."""
        return next(reversed(self._entries.values()), None)

    def put(self, kept: KeptCache, partition: str = "") -> None:
        """Keep `kept` in `partition` (replacing an entry of the same tokens there), evicting the least
        recently used entries of any partition until it fits; an entry larger than the store is not kept."""
        if kept.nbytes > self.max_bytes:
            self.refuse()
            return
        key = (partition, kept.token_ids.tobytes())
        if key in self._entries:
            self._remove(key)
        while self._entries and (self.bytes + kept.nbytes > self.max_bytes or len(self._entries) >= self.max_entries):
            self._remove(next(iter(self._entries)))
            self.counters.evictions += 1
        self._entries[key] = kept
        self._partitions.setdefault(partition, {})[key] = None
        self._ticks[key] = next(self._clock)
        if self._index is not None:
            self._index.add(key, partition, kept.token_ids, floor=max(kept.compressed_at, self.min_tokens))
        self.bytes += kept.nbytes

    def refuse(self) -> None:
        """Count an entry not kept for being larger than the store (a keeper may know before making it)."""
        self.counters.refused += 1

    def _remove(self, key: tuple[str, bytes]) -> None:
        self.bytes -= self._entries.pop(key).nbytes
        del self._ticks[key]
        if self._index is not None:
            self._index.remove(key)
        keys = self._partitions[key[0]]
        del keys[key]
        if not keys:
            del self._partitions[key[0]]

    def lookup(self, token_ids: list[int], partition: str = "") -> ResumePlan | None:
        """The plan that reuses the most of `token_ids` over the entries of `partition` (ties: the least
        recently used entry; it becomes the most recently used), or None; counted as a hit or a miss.
        Only entries sharing a whole block with the prompt are looked at (`PrefixIndex`), deepest
        first, until no shallower one could reach the best resume point; a level whose entries all
        need a resume point past what it can give is passed over whole, and an entry whose reach
        (the block after the shared ones compared) cannot beat the best plan so far is not planned.
        So a prompt sharing a system prompt with every entry costs a few levels, not an entry each."""
        prompt = np.asarray(token_ids, np.int64)
        limit = len(prompt) - max(self.window, 1)      # no plan resumes past it (plan_resume)
        best = None                      # (resume_at, tick, key, plan)
        seen = set()
        for shared, bound, keys in self._candidates(partition, prompt):
            reachable = min(bound - 1, limit)          # what this level's keys not seen yet can give
            if best is not None and best[0] > reachable:
                break
            if not keys or min(keys.values()) > reachable:
                continue
            for key in sorted(keys.keys() - seen, key=self._ticks.__getitem__):     # least recently used first
                seen.add(key)
                kept, tick = self._entries[key], self._ticks[key]
                reach = min(shared + common_prefix(kept.token_ids[shared:bound], prompt[shared:bound]), limit)
                if reach < kept.compressed_at or (best is not None and (reach, -tick) <= (best[0], -best[1])):
                    continue
                plan = plan_resume(kept, prompt, self.window, self.max_rows, self.min_tokens, self.ring)
                if plan is not None and (best is None or (plan.resume_at, -tick) > (best[0], -best[1])):
                    best = (plan.resume_at, tick, key, plan)
        if best is None:
            self.counters.misses += 1
            return None
        key, plan = best[2], best[3]
        self._entries.move_to_end(key)
        self._ticks[key] = next(self._clock)
        self.counters.hits += 1
        self.counters.tokens_reused += plan.resume_at
        return plan

    def _candidates(self, partition: str, prompt: np.ndarray):
        """(shared, bound, {key: floor}) groups to compare, as PrefixIndex.levels gives them; without
        an index every key of the partition whose first token matches, unbounded."""
        if len(prompt) <= 1 or partition not in self._partitions:
            return
        if self._index is not None:
            yield from self._index.levels(partition, prompt)
            return
        first = prompt[0]
        yield 0, len(prompt) + 1, {key: 0 for key in self._partitions[partition]
                                   if self._entries[key].token_ids[0] == first}
