"""Local-directory backend: the embedded default store.

Atomicity: every write goes to a temporary file in the same directory, is fsynced, then renamed
into place (``os.replace``), so a reader sees the old object or the whole new one. Create-once
writes use ``os.link`` (fails if the name exists); compare-and-swap holds an ``flock`` on a lock
file beside the object for the read-compare-rename. ETags are the xxh3-64 of the content.
"""

from __future__ import annotations

import errno
import fcntl
import os
import tempfile
from collections.abc import Mapping
from contextlib import contextmanager
from pathlib import Path


from ..errors import ObjectNotFoundError, PreconditionFailedError, StoreError
from .base import Blob, Stat, blob_unless_match, check_key, content_etag

_TMP_PREFIX = ".xc-tmp-"
_UMASK = os.umask(0o022)
os.umask(_UMASK)


def _lock_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.lock")


class LocalStore:
    """A store rooted at a local directory (created if missing)."""

    def __init__(self, root: str | os.PathLike[str], *, fsync: bool = True) -> None:
        self.root = Path(root).expanduser().resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.url = f"file://{self.root}"
        self._fsync = fsync

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    # --- reads --------------------------------------------------------------------------------
    def get(self, key: str, *, if_none_match: str | None = None) -> Blob | None:
        path = self._path(key)
        try:
            data = path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            raise ObjectNotFoundError(f"{self.url}/{key} does not exist") from None
        except IsADirectoryError:
            raise ObjectNotFoundError(f"{self.url}/{key} is a directory, not an object") from None
        except OSError as exc:
            raise StoreError(f"reading {self.url}/{key}: {exc}") from exc
        return blob_unless_match(data, if_none_match)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        if start < 0 or length < 0:
            raise ValueError(f"bad range start={start} length={length}")
        try:
            with open(self._path(key), "rb") as f:
                f.seek(start)
                # read(n) allocates n bytes up front: clamp to what the file holds, so a bounded
                # read (manifest: 64 MiB + 1) costs the object's size, not the bound
                return f.read(max(0, min(length, os.fstat(f.fileno()).st_size - start)))
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ObjectNotFoundError(f"{self.url}/{key} does not exist (or is not a file)") from None
        except OSError as exc:
            raise StoreError(f"reading {self.url}/{key}: {exc}") from exc

    def stat(self, key: str) -> Stat:
        blob = self.get(key)
        assert blob is not None
        try:
            mtime = self._path(key).stat().st_mtime
        except OSError:
            mtime = None
        return Stat(len(blob.data), blob.etag, mtime)

    def list(self, prefix: str = "") -> list[str]:
        out: list[str] = []
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            rel = os.path.relpath(dirpath, self.root)
            for name in filenames:
                if name.startswith("."):  # temp and lock files; keys never start with "."
                    continue
                key = name if rel == "." else f"{rel}/{name}".replace(os.sep, "/")
                if key.startswith(prefix):
                    out.append(key)
        return sorted(out)

    # --- writes -------------------------------------------------------------------------------
    def _write_temp(self, path: Path, data: bytes | memoryview) -> str:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, dir=path.parent)
        try:
            os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp makes 0600; objects are as readable as any file
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                if self._fsync:
                    f.flush()
                    os.fsync(f.fileno())
        except BaseException:
            os.unlink(tmp)
            raise
        return tmp

    @contextmanager
    def _locked(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(_lock_path(path), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def put(self, key: str, data: bytes | memoryview, *, if_match: str | None = None,
            if_none_match: bool = False, tags: Mapping[str, str] | None = None) -> str:
        del tags  # a directory has no lifecycle rules
        if if_match is not None and if_none_match:
            raise ValueError("if_match and if_none_match are exclusive")
        path = self._path(key)
        try:
            tmp: str | None = self._write_temp(path, data)
        except OSError as exc:
            raise StoreError(f"writing {self.url}/{key}: {exc}") from exc
        try:
            if if_none_match:
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    raise PreconditionFailedError(
                        f"{self.url}/{key} already exists: another writer created it first") from None
            elif if_match is not None:
                with self._locked(path):
                    try:
                        current = content_etag(path.read_bytes())
                    except FileNotFoundError:
                        current = None
                    if current != if_match:
                        raise PreconditionFailedError(
                            f"{self.url}/{key} changed (etag {current}, expected {if_match}): "
                            "another writer updated it")
                    os.replace(tmp, path)
                    tmp = None
            else:
                os.replace(tmp, path)
                tmp = None
        except OSError as exc:
            what = "no space left" if exc.errno == errno.ENOSPC else str(exc)
            raise StoreError(f"writing {self.url}/{key}: {what}") from exc
        finally:
            if tmp is not None:
                os.unlink(tmp)
        if self._fsync:
            dfd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        return content_etag(data)

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        try:
            _lock_path(path).unlink()
        except FileNotFoundError:
            pass
