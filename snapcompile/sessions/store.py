"""The session store: finished sequences' caches kept in host memory, least recently used first
out, bounded by bytes (`--session-cache-bytes`). A request that begins with a kept sequence's
tokens resumes from it (`sessions/kept.py`), but only from an entry kept in its own scope: scopes
never see each other's entries, so what a lookup finds (and `cached_tokens`, which says how much it
found) reveals nothing across them (docs/serving.md, "Who shares kept caches"). Entries are never
changed; the engine thread is the only one that touches the store."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from snapcompile.sessions.kept import KeptCache, ResumePlan, plan_resume

MAX_ENTRIES = 1024        # a lookup compares the prompt with every entry


@dataclass
class StoreCounters:
    hits: int = 0
    misses: int = 0
    tokens_reused: int = 0
    evictions: int = 0
    refused: int = 0          # entries larger than the whole store


class SessionStore:
    def __init__(self, max_bytes: int, window: int, max_rows: int, min_tokens: int = 1,
                 max_entries: int = MAX_ENTRIES):
        """window: tokens a resumed request prefills anew at least (the policy's observation window,
        0 without a selection); max_rows: the rows a resumed prefill may attend over; min_tokens:
        the fewest tokens worth resuming (the engine uses one prefill chunk: less saves nothing)."""
        if max_bytes < 0 or max_entries < 1:
            raise ValueError("max_bytes must be >= 0 and max_entries >= 1")
        self.max_bytes, self.window, self.max_rows, self.max_entries = max_bytes, window, max_rows, max_entries
        self.min_tokens = min_tokens
        # (scope, token-id bytes) -> entry, least recently used first; and each scope's keys
        self._entries: OrderedDict[tuple[str, bytes], KeptCache] = OrderedDict()
        self._scopes: dict[str, dict[tuple[str, bytes], None]] = {}
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

    def put(self, kept: KeptCache, scope: str = "") -> None:
        """Keep `kept` in `scope` (replacing an entry of the same tokens there), evicting the least
        recently used entries of any scope until it fits; an entry larger than the store is not kept."""
        if kept.nbytes > self.max_bytes:
            self.counters.refused += 1
            return
        key = (scope, kept.token_ids.tobytes())
        if key in self._entries:
            self._remove(key)
        while self._entries and (self.bytes + kept.nbytes > self.max_bytes or len(self._entries) >= self.max_entries):
            self._remove(next(iter(self._entries)))
            self.counters.evictions += 1
        self._entries[key] = kept
        self._scopes.setdefault(scope, {})[key] = None
        self.bytes += kept.nbytes

    def _remove(self, key: tuple[str, bytes]) -> None:
        self.bytes -= self._entries.pop(key).nbytes
        keys = self._scopes[key[0]]
        del keys[key]
        if not keys:
            del self._scopes[key[0]]

    def lookup(self, token_ids: list[int], scope: str = "") -> ResumePlan | None:
        """The plan that reuses the most of `token_ids` over the entries of `scope` (that entry
        becomes the most recently used), or None; counted as a hit or a miss."""
        best = None
        if scope in self._scopes and len(token_ids) > 1:
            first = np.int64(token_ids[0])
            for key in self._scopes[scope]:
                kept = self._entries[key]
                if kept.token_ids[0] != first:
                    continue
                plan = plan_resume(kept, token_ids, self.window, self.max_rows, self.min_tokens)
                if plan is not None and (best is None or plan.resume_at > best[1].resume_at):
                    best = (key, plan)
        if best is None:
            self.counters.misses += 1
            return None
        self._entries.move_to_end(best[0])
        self.counters.hits += 1
        self.counters.tokens_reused += best[1].resume_at
        return best[1]
