"""Durable local writes, shared by the chunk cache, the daemon's state and model directories."""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import threading
from pathlib import Path


def fsync_path(path: Path | str, *, directory: bool = False) -> None:
    """fsync a file or a directory by path."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it (no rename: for files inside a temp directory)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_atomic(path: Path, data: bytes, *, sync_dir: bool = True) -> None:
    """Replace ``path`` with ``data``: temp name, fsync, rename, fsync the directory. A reader
    (or a process restarted after ``kill -9``) sees the old bytes or the new ones, never a mix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    write_synced(tmp, data)
    os.replace(tmp, path)
    if sync_dir:
        fsync_path(path.parent, directory=True)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


@functools.cache
def _renameat2():
    """libc's ``renameat2`` (glibc ≥ 2.28), or None."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def exchange_paths(a: Path, b: Path) -> bool:
    """Swap two existing paths atomically (``renameat2(RENAME_EXCHANGE)``); False where the libc,
    the kernel or the filesystem cannot, so the caller falls back to two renames."""
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))
