"""The page allocator refuses bad page ids whole: a refused call changes nothing."""

import pytest

from mtp.cache.pages import PageAllocator


def _state(pool):
    return list(pool._free), [pool.refcount(p) for p in range(pool.num_pages)]


@pytest.mark.parametrize("method", ["release", "share"])
@pytest.mark.parametrize("bad", [-1, 0, 5, 99])
def test_ids_outside_the_pool_are_refused_and_change_nothing(method, bad):
    """-1 would alias the last page through numpy indexing, 5+ would be a bare IndexError,
    0 is the reserved null page."""
    pool = PageAllocator(5, 16, "kv")
    held = pool.allocate(4)
    before = _state(pool)
    with pytest.raises(ValueError, match=rf"kv pool cannot {method} page ids \[{bad}\]: its pages are 1\.\.4"):
        getattr(pool, method)([held[0], bad])
    assert _state(pool) == before


def test_a_negative_id_never_reaches_the_free_list():
    pool = PageAllocator(5, 16)
    pool.allocate(4)
    with pytest.raises(ValueError):
        pool.release([-1])
    assert pool.num_free == 0 and pool.refcount(4) == 1


def test_releasing_a_page_more_often_than_held_in_one_call_changes_nothing():
    pool = PageAllocator(5, 16, "kv")
    a, b = pool.allocate(2)
    pool.share([b])
    before = _state(pool)
    with pytest.raises(ValueError, match=rf"kv pages released more often than they were held: page {a} released 2x, "
                                         rf"held 1x$"):
        pool.release([a, b, a])
    assert _state(pool) == before
    pool.release([b, a, b])  # duplicates up to the count held are fine
    assert pool.refcount(a) == pool.refcount(b) == 0 and pool.num_free == 4


def test_sharing_unallocated_pages_changes_nothing():
    pool = PageAllocator(5, 16, "kv")
    (a,) = pool.allocate(1)
    before = _state(pool)
    with pytest.raises(ValueError, match=r"kv pages \[2, 3\] are not allocated; cannot share them"):
        pool.share([a, 3, 2])
    assert _state(pool) == before
    pool.share([a, a])
    assert pool.refcount(a) == 3
