"""fsspec backend: any filesystem fsspec knows (``memory://`` for tests, ``gs://``, ``az://`` …).

fsspec has no conditional writes, so create-once and compare-and-swap are emulated with a
read-check-write under a lock held in this process. That is exact for ``memory://`` (one
process) and narrows but cannot close the race between two processes on a remote filesystem:
run one publisher per prefix there, or use the S3 backend, whose conditional writes the server
enforces. ETags are the xxh3-64 of the content.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import fsspec

from ..errors import ObjectNotFoundError, PreconditionFailedError
from .base import Blob, Stat, blob_unless_match, check_key, check_prefix, content_etag

_LOCK = threading.Lock()


class FsspecStore:
    def __init__(self, url: str, **storage_options) -> None:
        self.url = url.rstrip("/")
        scheme, sep, path = self.url.partition("://")
        if sep:
            check_prefix(path, url)  # a//b: some filesystems collapse it, listing would not
        self.fs, root = fsspec.core.url_to_fs(self.url, **storage_options)
        self.root = root.rstrip("/")

    def _path(self, key: str) -> str:
        return f"{self.root}/{check_key(key)}"

    def _read(self, key: str) -> bytes:
        try:
            return self.fs.cat_file(self._path(key))
        except (FileNotFoundError, KeyError):
            raise ObjectNotFoundError(f"{self.url}/{key} does not exist") from None

    def get(self, key: str, *, if_none_match: str | None = None) -> Blob | None:
        data = self._read(key)
        return blob_unless_match(data, if_none_match)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        if start < 0 or length < 0:
            raise ValueError(f"bad range start={start} length={length}")
        try:
            return self.fs.cat_file(self._path(key), start=start, end=start + length)
        except (FileNotFoundError, KeyError):
            raise ObjectNotFoundError(f"{self.url}/{key} does not exist") from None

    def stat(self, key: str) -> Stat:
        data = self._read(key)
        mtime = None
        try:
            info = self.fs.info(self._path(key))
            raw = info.get("mtime", info.get("LastModified", info.get("created")))
            mtime = raw.timestamp() if hasattr(raw, "timestamp") else (float(raw) if raw is not None else None)
        except Exception:  # not every filesystem reports it
            mtime = None
        return Stat(len(data), content_etag(data), mtime)

    def list(self, prefix: str = "") -> list[str]:
        try:
            paths = self.fs.find(self.root)
        except FileNotFoundError:
            return []
        base = self.root.lstrip("/") + "/"
        keys = []
        for p in paths:
            rel = p.lstrip("/")
            if rel.startswith(base):
                rel = rel[len(base):]
            if rel.startswith(prefix):
                keys.append(rel)
        return sorted(keys)

    def put(self, key: str, data: bytes | memoryview, *, if_match: str | None = None,
            if_none_match: bool = False, tags: Mapping[str, str] | None = None) -> str:
        del tags  # fsspec has no portable object tagging
        if if_match is not None and if_none_match:
            raise ValueError("if_match and if_none_match are exclusive")
        path = self._path(key)
        with _LOCK:
            if if_none_match and self.fs.exists(path):
                raise PreconditionFailedError(
                    f"{self.url}/{key} already exists: another writer created it first")
            if if_match is not None:
                try:
                    current = content_etag(self.fs.cat_file(path))
                except (FileNotFoundError, KeyError):
                    current = None
                if current != if_match:
                    raise PreconditionFailedError(
                        f"{self.url}/{key} changed (etag {current}, expected {if_match})")
            parent = path.rsplit("/", 1)[0]
            if parent:
                self.fs.makedirs(parent, exist_ok=True)
            self.fs.pipe_file(path, bytes(data))
        return content_etag(data)

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            self.fs.rm_file(path)
        except (FileNotFoundError, KeyError):
            pass
