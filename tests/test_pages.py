"""The page pool alone: exact page ids, reference counts, prefix index, LRU eviction order."""

import pytest

from vmkv.core.pages import PagePool
from vmkv.errors import OutOfPages


def test_allocates_lowest_ids_first_and_reuses_freed_pages():
    pool = PagePool(4)
    assert pool.allocate(2) == [0, 1]
    pool.decref(0)
    assert pool.allocate(1) == [0]  # the freed page comes back first
    assert pool.allocate(2) == [2, 3]
    pool.check()


def test_out_of_pages_takes_nothing():
    pool = PagePool(3)
    pool.allocate(2)
    with pytest.raises(OutOfPages, match="need 2 pages but only 1"):
        pool.allocate(2)
    assert pool.num_free == 1 and pool.num_in_use == 2
    pool.check()


def test_shared_page_is_freed_by_its_last_owner():
    pool = PagePool(2)
    (page,) = pool.allocate(1)
    pool.incref(page)
    assert pool.num_shared == 1
    pool.decref(page)
    assert pool.num_free == 1 and pool.refcount(page) == 1
    pool.decref(page)
    assert pool.num_free == 2
    with pytest.raises(AssertionError):
        pool.decref(page)
    pool.check()


def test_cached_pages_are_evicted_least_recently_used_first():
    pool = PagePool(3)
    a, b, c = pool.allocate(3)
    for page, key in ((a, b"a"), (b, b"b"), (c, b"c")):
        assert pool.register(page, key)
    pool.decref(b)  # released in the order b, a, c: LRU order b, a, c
    pool.decref(a)
    pool.decref(c)
    assert pool.num_cached == 3 and pool.num_free == 0
    pool.incref(pool.lookup(b"b"))  # a hit on b, released again: b becomes most recent, order a, c, b
    pool.decref(b)
    assert pool.allocate(2) == [a, c]
    assert pool.lookup(b"a") is None and pool.lookup(b"c") is None
    assert pool.lookup(b"b") == b and pool.evictions == 2
    pool.check()


def test_a_hit_takes_a_cached_page_out_of_the_lru():
    pool = PagePool(2)
    (page,) = pool.allocate(1)
    pool.register(page, b"h")
    pool.decref(page)
    assert pool.num_cached == 1
    pool.incref(pool.lookup(b"h"))
    assert pool.num_cached == 0 and pool.refcount(page) == 1
    assert pool.allocate(1) == [1]  # the hit page is not evictable while referenced
    pool.check()


def test_register_refuses_duplicates_and_unregister_drops_the_hash():
    pool = PagePool(2)
    a, b = pool.allocate(2)
    assert pool.register(a, b"x")
    assert not pool.register(b, b"x")  # another page already holds the hash
    assert not pool.register(a, b"y")  # the page is already hashed
    pool.unregister(a)
    assert pool.lookup(b"x") is None and pool.page_hash(a) is None
    pool.decref(a)
    assert pool.num_free == 1
    pool.check()


def test_evict_all_frees_every_cached_page():
    pool = PagePool(3)
    pages = pool.allocate(3)
    for i, page in enumerate(pages):
        pool.register(page, bytes([i]))
        pool.decref(page)
    assert sorted(pool.evict_all()) == pages
    assert pool.num_free == 3 and pool.num_cached == 0
    pool.check()
