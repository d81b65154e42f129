"""One conformance suite for every Store backend. Subclass it and provide a ``store`` fixture
that yields a fresh, empty store."""

from __future__ import annotations

import threading

import pytest

from xcluster.errors import ObjectNotFoundError, PreconditionFailedError, UnsafeKeyError


class StoreConformance:
    def test_put_get_roundtrip(self, store):
        etag = store.put("versions/000000000001/chunk-000000.xc", b"hello world")
        blob = store.get("versions/000000000001/chunk-000000.xc")
        assert blob.data == b"hello world"
        assert blob.etag == etag

    def test_empty_object(self, store):
        store.put("empty", b"")
        assert store.get("empty").data == b""
        assert store.stat("empty").size == 0

    def test_overwrite_changes_etag(self, store):
        e1 = store.put("HEAD", b"one")
        e2 = store.put("HEAD", b"two")
        assert e1 != e2
        assert store.get("HEAD").data == b"two"

    def test_missing_raises_not_found(self, store):
        with pytest.raises(ObjectNotFoundError):
            store.get("nope")
        with pytest.raises(ObjectNotFoundError):
            store.stat("nope")
        with pytest.raises(ObjectNotFoundError):
            store.get_range("nope", 0, 1)

    def test_get_range(self, store):
        data = bytes(range(256)) * 4
        store.put("r", data)
        assert store.get_range("r", 0, 10) == data[:10]
        assert store.get_range("r", 100, 50) == data[100:150]
        assert store.get_range("r", 1000, 100) == data[1000:]

    def test_stat(self, store):
        etag = store.put("s", b"x" * 1234)
        st = store.stat("s")
        assert st.size == 1234
        assert st.etag == etag

    def test_list_prefix_sorted(self, store):
        for k in ["versions/000000000002/manifest.json", "versions/000000000001/manifest.json",
                  "versions/000000000001/chunk-000000.xc", "HEAD"]:
            store.put(k, b"x")
        assert store.list("versions/000000000001/") == [
            "versions/000000000001/chunk-000000.xc", "versions/000000000001/manifest.json"]
        assert store.list() == sorted(["HEAD", "versions/000000000001/chunk-000000.xc",
                                       "versions/000000000001/manifest.json",
                                       "versions/000000000002/manifest.json"])
        assert store.list("nothing/") == []

    def test_delete(self, store):
        store.put("d", b"x")
        store.delete("d")
        with pytest.raises(ObjectNotFoundError):
            store.get("d")
        store.delete("d")  # idempotent
        assert "d" not in store.list()

    def test_create_once(self, store):
        store.put("m", b"first", if_none_match=True)
        with pytest.raises(PreconditionFailedError):
            store.put("m", b"second", if_none_match=True)
        assert store.get("m").data == b"first"

    def test_compare_and_swap(self, store):
        e1 = store.put("HEAD", b"v1")
        e2 = store.put("HEAD", b"v2", if_match=e1)
        with pytest.raises(PreconditionFailedError):
            store.put("HEAD", b"v3", if_match=e1)  # stale etag
        assert store.get("HEAD").data == b"v2"
        store.put("HEAD", b"v3", if_match=e2)
        assert store.get("HEAD").data == b"v3"

    def test_conditional_get(self, store):
        etag = store.put("HEAD", b"v1")
        assert store.get("HEAD", if_none_match=etag) is None
        store.put("HEAD", b"v2")
        blob = store.get("HEAD", if_none_match=etag)
        assert blob is not None and blob.data == b"v2"

    def test_concurrent_create_once_has_one_winner(self, store):
        wins, losses = [], []

        def attempt(i):
            try:
                store.put("race", f"writer-{i}".encode(), if_none_match=True)
                wins.append(i)
            except PreconditionFailedError:
                losses.append(i)

        threads = [threading.Thread(target=attempt, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(wins) == 1 and len(losses) == 5
        assert store.get("race").data == f"writer-{wins[0]}".encode()

    @pytest.mark.parametrize("key", ["../escape", "/abs", "a/../b", "a//b", "", ".hidden",
                                     "a/./b", "back\\slash", "nul\x00", "spa ce", "-dash"])
    def test_unsafe_keys_rejected(self, store, key):
        with pytest.raises(UnsafeKeyError):
            store.put(key, b"x")
        with pytest.raises(UnsafeKeyError):
            store.get(key)

    def test_binary_payload_exact(self, store):
        import os
        data = os.urandom(3 * 1024 * 1024 + 17)
        store.put("big", data)
        assert store.get("big").data == data
