"""A prompt cache behind an engine's sequence slots: the KV rows of whole prefill chunks, kept in
RAM after the slot that made them moves on to another request, found again by the tokens that
made them (llama.cpp's server keeps prompts in RAM the same way, `--cache-ram`; vLLM shares such
blocks by reference in its paged pool, which nerva's slots, one contiguous cache each, are not:
here a hit is copied into the slot).

A chunk is keyed by a digest chained over every token from position 0 to its end, so a hit is
the same tokens at the same positions. Its rows are the ones that chunk's prefill made: a prompt
restored from them answers as the prefilled one would, to the bit (the rule a slot's own cache
follows: steps.answer_steps). Least recently used chunks go first when a new one does not fit.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np


def chunk_keys(ids: list[int], chunk: int, count: int) -> list[bytes]:
    """The keys of `ids`' first `count` whole chunks of `chunk` tokens: key j is a digest of key
    j - 1 and chunk j's tokens, so it names every token up to chunk j's end."""
    keys, key = [], b""
    tokens = np.asarray(ids[:count * chunk], dtype=np.int64)
    for j in range(count):
        key = hashlib.blake2b(key + tokens[j * chunk:(j + 1) * chunk].tobytes(), digest_size=16).digest()
        keys.append(key)
    return keys


class PromptCache:
    """Chunks' KV rows (an engine's kv_rows: a K and a V array a layer), at most `capacity`
    bytes of them, by chunk_keys key. Used by one thread (a model's worker)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.bytes = 0
        self.entries: OrderedDict[bytes, tuple[list[np.ndarray], list[np.ndarray], int]] = OrderedDict()

    def __contains__(self, key: bytes) -> bool:
        return key in self.entries

    def get(self, key: bytes):
        """(k_rows, v_rows) of the chunk, now the most recently used; None if not held."""
        entry = self.entries.get(key)
        if entry is None:
            return None
        self.entries.move_to_end(key)
        return entry[0], entry[1]

    def put(self, key: bytes, k_rows: list[np.ndarray], v_rows: list[np.ndarray], limit: int | None = None) -> bool:
        """Keeps the chunk, dropping the least recently used ones until it fits the capacity and
        `limit` (bytes it may hold now, where less); -> whether it was kept (not where it alone
        is larger than those)."""
        size = sum(a.nbytes for a in k_rows) + sum(a.nbytes for a in v_rows)
        most = self.capacity if limit is None else min(self.capacity, limit)
        if key in self.entries:
            self.entries.move_to_end(key)
            return True
        if size > most:
            return False
        self.shrink(most - size)
        self.entries[key] = (k_rows, v_rows, size)
        self.bytes += size
        return True

    def shrink(self, most: int) -> int:
        """Drops the least recently used chunks until at most `most` bytes are held; -> the bytes dropped."""
        before = self.bytes
        while self.bytes > most:
            _, (_, _, dropped) = self.entries.popitem(last=False)
            self.bytes -= dropped
        return before - self.bytes

    def held_run(self, keys: list[bytes], start: int) -> int:
        """How many of keys[start:] are held one after another from keys[start]."""
        n = start
        while n < len(keys) and keys[n] in self.entries:
            n += 1
        return n - start
