import uuid

import pytest

from xcluster.errors import PreconditionFailedError
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
    with pytest.raises(PreconditionFailedError):
        st.put("HEAD", b"3", if_match=e)
    st.put("m", b"x", if_none_match=True)
    with pytest.raises(PreconditionFailedError):
        st.put("m", b"y", if_none_match=True)
    leftovers = [p.name for p in tmp_path.rglob("*") if p.name.startswith(".xc-tmp")]
    assert leftovers == []
    assert st.list() == ["HEAD", "m"]


@pytest.mark.parametrize("url", ["s3://bucket/runs//exp", "s3a://bucket/a///b",
                                 "s3://bucket/runs/./exp", "s3://bucket/runs/../exp"])
def test_s3_url_with_empty_or_dot_segment_is_refused(url):
    """SeaweedFS stores ``runs//exp/HEAD`` as ``runs/exp/HEAD`` while LIST filters on the verbatim
    prefix: ``xcluster ls`` would show nothing while publish and sync work. Refused up front."""
    from xcluster.errors import ConfigError
    from xcluster.store.s3.store import S3Store

    with pytest.raises(ConfigError, match="empty or '.'") as ei:
        S3Store.from_url(url, client=object())
    assert url in str(ei.value)
    with pytest.raises(ConfigError):
        open_store(url)


def test_s3_prefix_refused_by_the_constructor_too():
    from xcluster.errors import ConfigError
    from xcluster.store.s3.store import S3Store

    with pytest.raises(ConfigError, match="runs//exp"):
        S3Store("bucket", "runs//exp", client=object())
    ok = S3Store.from_url("s3://bucket//runs/exp/", client=object())  # outer slashes are only trimmed
    assert ok.url == "s3://bucket/runs/exp"


def test_fsspec_url_with_empty_segment_is_refused():
    from xcluster.errors import ConfigError

    with pytest.raises(ConfigError, match="memory://xc-a//b"):
        open_store("memory://xc-a//b")
    assert isinstance(open_store("memory://xc-a/b/"), FsspecStore)


@pytest.mark.parametrize("replaced", [1, 2, 3])
def test_s3_get_starts_over_while_the_object_is_replaced_mid_download(replaced):
    """A large GET is fetched as parts under If-Match; an object replaced meanwhile is fetched
    again from its new HEAD, three times at most (then a named StoreError)."""
    from xcluster.errors import PreconditionFailedError, StoreError
    from xcluster.store.s3.store import S3Store

    class Download:
        smalls = parts = 0

        def get_small(self, key, full, if_none_match):
            self.smalls += 1
            return {"ETag": f'"v{self.smalls}"'}  # too large for one GET: its parts follow

        def get_parts(self, key, full, head):
            self.parts += 1
            if self.parts <= replaced:
                raise PreconditionFailedError(f"{key} changed")
            return bytearray(b"payload " + head["ETag"].encode())

    store = S3Store("bucket", "p", client=object())
    store._download = dl = Download()
    if replaced < 3:
        blob = store.get("big")
        assert bytes(blob.data) == f'payload "v{replaced + 1}"'.encode() and blob.etag == f'"v{replaced + 1}"'
    else:
        with pytest.raises(StoreError, match="kept changing while it was downloaded"):
            store.get("big")
    assert (dl.smalls, dl.parts) == (min(replaced + 1, 3),) * 2
