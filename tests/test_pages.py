"""The page allocator refuses bad page ids whole: a refused call changes nothing. Padding
writes into paged KV land nowhere."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp.cache.pages import PageAllocator, block_table_row
from mtp.ops.paged_kv import write_pages


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


def test_write_pages_lands_valid_rows_and_drops_padding_and_overflow():
    """Each valid row lands at its page and offset; a masked row, a negative position and one
    past the block table write nothing anywhere, the null page included."""
    rng = np.random.default_rng(7)
    pages = jnp.asarray(rng.standard_normal((9, 4, 2, 3)), jnp.float32)
    tables = jnp.asarray(np.stack([block_table_row([5, 2], 3), block_table_row([7, 1, 8], 3)]))
    positions = np.array([[0, 3, 4, 7, 8, -1], [2, 5, 11, 12, 6, 1]], np.int32)  # 8 and 12 lie past the tables
    valid = np.array([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 1]], bool)
    values = jnp.asarray(rng.standard_normal((2, 6, 2, 3)), jnp.float32)
    got = np.asarray(jax.jit(write_pages)(pages, values, tables, jnp.asarray(positions), jnp.asarray(valid)))
    want = np.asarray(pages).copy()
    table = np.asarray(tables)
    for b, t in zip(*np.nonzero(valid & (positions >= 0) & (positions < 12))):
        pos = positions[b, t]
        if pos // 4 < 2 + b:  # slot 0 holds two pages, slot 1 three; the rest of a row is the null page
            want[table[b, pos // 4], pos % 4] = np.asarray(values)[b, t]
    np.testing.assert_array_equal(got, want)
    assert (got != np.asarray(pages)).any(axis=(1, 2, 3)).sum() == 5  # pages 5, 2, 7, 1, 8; never page 0


def test_turn_end_eviction_drops_only_entries_whose_page_comes_free():
    from mtp.cache.prefix import Snapshot, TurnEndStore

    pool = PageAllocator(8, 4, "target KV")
    store = TurnEndStore(pool, max_entries=8)
    snap = lambda n: Snapshot(n, (), (), 1, 1)
    shared, own = pool.allocate(2)
    store.put([1, 2, 3, 4], None, snap(4))  # page-aligned: holds no page
    store.put([1, 2, 3, 4, 5], shared, snap(5))  # its page also held by a live turn
    store.put([1, 2, 3, 4, 5, 6], own, snap(6))
    pool.release([own])  # the turn that wrote `own` ended: the store is its only owner
    assert store.evict(1) == 1
    assert len(store) == 2 and pool.refcount(own) == 0 and pool.refcount(shared) == 2
    assert store.match([1, 2, 3, 4, 9], 1) is not None  # the aligned entry survived
    assert store.evict(1) == 0 and len(store) == 2  # nothing left whose drop frees a page
