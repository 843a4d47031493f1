"""Host-side page allocator for a paged KV pool.

Pages are reference counted so that a prefix cache can share full pages between
sequences: a page returns to the free list only when its last holder lets go.
Running out is a `PagePoolExhausted` error raised before anything is handed out,
never a silent reuse of a page somebody still holds.
"""

from __future__ import annotations

import collections
import math
import operator

import numpy as np

from mtp.ops.paged_kv import NULL_PAGE


class PagePoolExhausted(RuntimeError):
    """The pool cannot satisfy a request; nothing was allocated."""


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int, name: str = "kv"):
        if num_pages < 2:
            raise ValueError(f"{name} pool needs at least 2 pages (page {NULL_PAGE} is reserved), got {num_pages}")
        if page_size <= 0:
            raise ValueError(f"{name} pool page_size must be positive, got {page_size}")
        self.name = name
        self.num_pages = num_pages
        self.page_size = page_size
        self._free = list(range(num_pages - 1, 0, -1))  # pop() hands out low ids first
        self._refs = np.zeros(num_pages, np.int32)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise PagePoolExhausted(
                f"{self.name} page pool exhausted: asked for {count} pages of {self.page_size} tokens, "
                f"{len(self._free)} of {self.num_pages - 1} free")
        pages = [self._free.pop() for _ in range(count)]
        self._refs[pages] = 1
        return pages

    def share(self, pages) -> None:
        """Take another reference on pages someone already holds (prefix reuse)."""
        ids = self._checked_ids(pages, "share")
        if unheld := sorted({p for p in ids if self._refs[p] <= 0}):
            raise ValueError(f"{self.name} pages {unheld} are not allocated; cannot share them")
        for p in ids:
            self._refs[p] += 1

    def release(self, pages) -> None:
        """Drop one reference per id (a page listed twice drops two).

        The whole batch is checked before any count changes, so a bad call leaves the pool
        as it was rather than half released.
        """
        ids = self._checked_ids(pages, "release")
        if over := sorted((p, n) for p, n in collections.Counter(ids).items() if n > self._refs[p]):
            detail = ", ".join(f"page {p} released {n}x, held {self._refs[p]}x" for p, n in over)
            raise ValueError(f"{self.name} pages released more often than they were held: {detail}")
        for p in ids:
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)

    def _checked_ids(self, pages, action: str) -> list[int]:
        """``pages`` as ints, refusing ids that are no page of this pool.

        Numpy indexing would wrap a negative id onto the last pages (and the free list would
        then hand it out) and fail a too-large one with a bare IndexError; `NULL_PAGE` is
        never handed out, so it is never held.
        """
        ids = [operator.index(p) for p in pages]
        if bad := sorted({p for p in ids if not NULL_PAGE < p < self.num_pages}):
            raise ValueError(f"{self.name} pool cannot {action} page ids {bad}: its pages are "
                             f"{NULL_PAGE + 1}..{self.num_pages - 1} (page {NULL_PAGE} is reserved)")
        return ids

    def refcount(self, page: int) -> int:
        return int(self._refs[page])


def block_table_row(pages: list[int], width: int) -> np.ndarray:
    """A slot's block table: its pages, then `NULL_PAGE` up to ``width``."""
    if len(pages) > width:
        raise ValueError(f"{len(pages)} pages do not fit a block table of width {width}")
    row = np.full((width,), NULL_PAGE, np.int32)
    row[: len(pages)] = pages
    return row
