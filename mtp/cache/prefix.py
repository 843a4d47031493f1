"""Host-side prefix reuse: the target's block-hash prefix cache and the GDN snapshot store.

Both key a token prefix by a chain of block hashes, ``h_i = H(h_{i-1}, tokens of
block i)``, so a hash names the whole prefix up to and including its block, never
just the block's own tokens.

* `PrefixCache` maps a chain hash to the KV page holding that block. The cache
  owns one reference per page; sequences that reuse a prefix take their own.
  Eviction is LRU over pages that only the cache still holds.
* `SnapshotStore` keeps Gated DeltaNet states at block-aligned prefix lengths.
  A state is a pure function of its token prefix, so any request with the same
  prefix may restore it; each snapshot is stamped with the session that wrote
  it, for the record (and so a debug log can say whose state was reused).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from typing import Any, Sequence

import numpy as np

from mtp.cache.pages import PageAllocator


def chain_hashes(tokens: Sequence[int], block_size: int) -> list[bytes]:
    """One hash per full block of ``tokens``; entry ``i`` names ``tokens[: (i + 1) * block_size]``."""
    out, prev = [], b""
    arr = np.asarray(tokens, np.int64)
    for i in range(len(arr) // block_size):
        prev = hashlib.blake2b(prev + arr[i * block_size : (i + 1) * block_size].tobytes(), digest_size=16).digest()
        out.append(prev)
    return out


class PrefixCache:
    def __init__(self, allocator: PageAllocator):
        self.allocator = allocator
        self.block_size = allocator.page_size
        self._pages: collections.OrderedDict[bytes, int] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._pages)

    def match(self, hashes: Sequence[bytes], max_blocks: int) -> list[int]:
        """Pages of the longest cached prefix (at most ``max_blocks``), touched as recently used."""
        pages = []
        for h in hashes[:max_blocks]:
            page = self._pages.get(h)
            if page is None:
                break
            self._pages.move_to_end(h)
            pages.append(page)
        return pages

    def insert(self, hashes: Sequence[bytes], pages: Sequence[int]) -> int:
        """Register full blocks a finished sequence wrote; returns how many were new."""
        new = 0
        for h, page in zip(hashes, pages):
            if h in self._pages:
                self._pages.move_to_end(h)
                continue
            self.allocator.share([page])
            self._pages[h] = page
            new += 1
        return new

    def evict(self, pages_needed: int) -> int:
        """Free least-recently-used pages that nobody but the cache holds."""
        freed = 0
        for h in list(self._pages):
            if freed >= pages_needed:
                break
            page = self._pages[h]
            if self.allocator.refcount(page) == 1:
                del self._pages[h]
                self.allocator.release([page])
                freed += 1
        return freed


@dataclasses.dataclass(frozen=True)
class Snapshot:
    position: int  # tokens consumed: the state after tokens[:position]
    conv: tuple[Any, ...]  # per linear layer [1, K-1, C]
    recurrent: tuple[Any, ...]  # per linear layer [1, Hv, Dk, Dv]
    session_hash: int
    generation: int


class SnapshotStore:
    def __init__(self, interval: int, block_size: int, max_entries: int = 512):
        if interval % block_size:
            raise ValueError(f"snapshot interval {interval} must be a multiple of the block size {block_size}")
        self.interval = interval
        self.block_size = block_size
        self.max_entries = max_entries
        self._store: collections.OrderedDict[bytes, Snapshot] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._store)

    def key(self, hashes: Sequence[bytes], position: int) -> bytes:
        return hashes[position // self.block_size - 1]

    def put(self, hashes: Sequence[bytes], snap: Snapshot) -> None:
        k = self.key(hashes, snap.position)
        self._store[k] = snap
        self._store.move_to_end(k)
        while len(self._store) > self.max_entries:
            self._store.popitem(last=False)

    def best(self, hashes: Sequence[bytes], limit: int) -> Snapshot | None:
        """The longest snapshot of this prefix at a position ``<= limit``."""
        pos = (limit // self.interval) * self.interval
        while pos > 0:
            snap = self._store.get(self.key(hashes, pos))
            if snap is not None:
                self._store.move_to_end(self.key(hashes, pos))
                return snap
            pos -= self.interval
        return None


def exact_key(tokens: Sequence[int]) -> bytes:
    """A hash of exactly these tokens (any length, unlike the block chain)."""
    return hashlib.blake2b(b"exact:" + np.asarray(tokens, np.int64).tobytes(), digest_size=16).digest()


@dataclasses.dataclass(frozen=True)
class TurnEnd:
    length: int  # tokens with KV in the cache at the turn's end (every token but the last)
    tail_page: int | None  # the partial last page (None when `length` is page-aligned)
    snapshot: Snapshot


class TurnEndStore:
    """Each finished turn's final GDN state, with the partial page that completes its KV.

    The prefix cache shares only full pages, so a state taken at a turn's end
    (rarely page-aligned) could not be paired with its KV from that cache alone:
    this store keeps a reference on the turn's partial last page, which a later
    turn copies (never writes) before extending it. Bounded, LRU; entries give
    their page back when evicted.
    """

    def __init__(self, allocator: PageAllocator, max_entries: int):
        self.allocator = allocator
        self.max_entries = max_entries
        self._entries: collections.OrderedDict[bytes, TurnEnd] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, tokens: Sequence[int], tail_page: int | None, snapshot: Snapshot) -> None:
        key = exact_key(tokens)
        if key in self._entries:
            self._drop(key)
        if tail_page is not None:
            self.allocator.share([tail_page])
        self._entries[key] = TurnEnd(len(tokens), tail_page, snapshot)
        while len(self._entries) > self.max_entries:
            self._drop(next(iter(self._entries)))

    def match(self, prompt: Sequence[int], full_pages_cached: int) -> TurnEnd | None:
        """The longest entry that ``prompt`` strictly extends, whose full pages are all cached."""
        best_key, best = None, None
        bs = self.allocator.page_size
        for key, entry in self._entries.items():
            if (entry.length < len(prompt) and entry.length // bs == full_pages_cached
                    and (best is None or entry.length > best.length) and exact_key(prompt[: entry.length]) == key):
                best_key, best = key, entry
        if best_key is not None:
            self._entries.move_to_end(best_key)
        return best

    def evict(self, pages_needed: int) -> int:
        """Drop least recently used entries until ``pages_needed`` pages came free; returns how
        many did. An entry whose drop would free nothing (a page-aligned turn end holds no
        page; another owner still holds its page) is kept: it costs the pool nothing."""
        freed = 0
        for key in list(self._entries):
            if freed >= pages_needed:
                break
            page = self._entries[key].tail_page
            if page is None or self.allocator.refcount(page) != 1:
                continue
            self._drop(key)
            freed += 1
        return freed

    def _drop(self, key: bytes) -> None:
        entry = self._entries.pop(key)
        if entry.tail_page is not None:
            self.allocator.release([entry.tail_page])
