"""Durable local writes, shared by the chunk cache, the daemon's state and model directories."""

from __future__ import annotations

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
