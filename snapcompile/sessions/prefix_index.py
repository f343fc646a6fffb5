"""Kept entries found by their token prefixes in O(prompt) instead of a comparison with every entry
(as vLLM's and SGLang's prefix caches find blocks). No tensors.

An entry of n tokens is filed under the hash of each of its prefixes of whole blocks (k * block
tokens, k = 1 .. n // block), within its partition. A prompt's k-block prefix hash finds every entry
that shares at least its first k blocks; such an entry shares fewer than (k + 1) * block tokens
when it is not found at level k + 1. The store checks the candidates' real tokens (`plan_resume`),
so a hash collision only adds a candidate. Each entry is filed with a `floor` (the store's: the
fewest tokens it can resume at), kept per prefix hash, so a level none of whose entries can resume
below its bound is passed over without looking at them.
"""
from __future__ import annotations

import hashlib
from collections.abc import Hashable, Iterator

import numpy as np


def prefix_digests(token_ids, block: int) -> list[bytes]:
    """The hash of each whole-block prefix of `token_ids`: [hash(ids[:block]), hash(ids[:2 * block]), ...]."""
    ids = np.asarray(token_ids, np.int64)
    running, digests = hashlib.blake2b(digest_size=16), []
    for start in range(0, len(ids) - block + 1, block):
        running.update(ids[start:start + block].tobytes())
        digests.append(running.copy().digest())
    return digests


class PrefixIndex:
    def __init__(self, block: int):
        """block: tokens per block (at most the fewest common tokens a resume needs, so every
        entry a prompt can resume from shares a whole block with it)."""
        if block < 1:
            raise ValueError("block must be >= 1")
        self.block = block
        self._keys: dict[tuple[str, bytes], dict[Hashable, int]] = {}   # (partition, prefix hash) -> key: floor
        self._filed: dict[Hashable, tuple[str, list[bytes]]] = {}        # key -> (partition, its prefix hashes)

    def add(self, key: Hashable, partition: str, token_ids, floor: int = 0) -> None:
        digests = prefix_digests(token_ids, self.block)
        self._filed[key] = (partition, digests)
        for digest in digests:
            self._keys.setdefault((partition, digest), {})[key] = floor

    def remove(self, key: Hashable) -> None:
        partition, digests = self._filed.pop(key)
        for digest in digests:
            keys = self._keys[(partition, digest)]
            del keys[key]
            if not keys:
                del self._keys[(partition, digest)]

    def levels(self, partition: str, token_ids) -> Iterator[tuple[int, int, dict[Hashable, int]]]:
        """Deepest first: (shared, bound, {key: floor}) for each k with entries sharing the prompt's
        first shared = k * block tokens; bound = (k + 1) * block: the keys not yielded before share
        fewer tokens than that."""
        digests = prefix_digests(token_ids, self.block)
        for k in range(len(digests), 0, -1):
            keys = self._keys.get((partition, digests[k - 1]))
            if keys:
                yield k * self.block, (k + 1) * self.block, keys
