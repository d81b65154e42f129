import uuid

import pytest

from xcluster.store import LocalStore, open_store
from xcluster.store.fsspec_store import FsspecStore
from tests.store_conformance import StoreConformance


class TestLocalStore(StoreConformance):
    @pytest.fixture
    def store(self, tmp_path):
        return LocalStore(tmp_path / "store")


class TestMemoryStore(StoreConformance):
    @pytest.fixture
    def store(self):
        return open_store(f"memory://xc-{uuid.uuid4().hex}")


def test_open_store_dispatch(tmp_path):
    assert isinstance(open_store(str(tmp_path)), LocalStore)
    assert isinstance(open_store(f"file://{tmp_path}"), LocalStore)
    assert isinstance(open_store("memory://abc"), FsspecStore)
    st = LocalStore(tmp_path)
    assert open_store(st) is st


def test_local_store_leaves_no_temp_files(tmp_path):
    st = LocalStore(tmp_path)
    e = st.put("HEAD", b"1")
    st.put("HEAD", b"2", if_match=e)
    with pytest.raises(Exception):
        st.put("HEAD", b"3", if_match=e)
    st.put("m", b"x", if_none_match=True)
    with pytest.raises(Exception):
        st.put("m", b"y", if_none_match=True)
    leftovers = [p.name for p in tmp_path.rglob("*") if p.name.startswith(".xc-tmp")]
    assert leftovers == []
    assert st.list() == ["HEAD", "m"]
