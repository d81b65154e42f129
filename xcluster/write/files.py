"""Non-weight files that travel with the weights (config.json, generation_config.json, tokenizer files).

They are content-addressed in the store (``files/<xxh3_128>``), listed by name, size and hash in
every manifest, and uploaded only when they change: a publisher remembers what it uploaded and
asks the store once (``stat``) about a hash it has not seen. Torch-free.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from ..errors import ConfigError, ObjectNotFoundError
from ..format import MAX_FILE_BYTES, MAX_FILES, MAX_FILES_TOTAL_BYTES, FileEntry, check_file_name, file_key, xxh3_128
from ..store import Store

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx")
"""Files of a model directory that are weights (xcluster ships those as tensors), never attached."""
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def collect_files(files: str | os.PathLike | Mapping[str, bytes]) -> dict[str, bytes]:
    """Name → bytes from a mapping, or from a model directory's top-level regular files that are not
    weights, weight indexes or hidden files. Names and sizes are checked here."""
    if isinstance(files, Mapping):
        out = {name: bytes(data) for name, data in files.items()}
    else:
        root = Path(files)
        if not root.is_dir():
            raise ConfigError(f"files={files!r}: not a directory (pass a model directory or a name → bytes mapping)")
        out = {}
        for p in sorted(root.iterdir()):
            if (p.name.startswith(".") or not p.is_file() or p.is_symlink() or p.name in WEIGHT_INDEXES
                    or p.name.endswith(WEIGHT_SUFFIXES)):
                continue
            if p.stat().st_size > MAX_FILE_BYTES:
                raise ConfigError(f"{p}: {p.stat().st_size} bytes is over the {MAX_FILE_BYTES}-byte limit per file")
            out[p.name] = p.read_bytes()
    if len(out) > MAX_FILES:
        raise ConfigError(f"{len(out)} files is over the limit of {MAX_FILES}")
    for name, data in out.items():
        check_file_name(name)
        if len(data) > MAX_FILE_BYTES:
            raise ConfigError(f"file {name!r}: {len(data)} bytes is over the {MAX_FILE_BYTES}-byte limit per file")
    total = sum(len(d) for d in out.values())
    if total > MAX_FILES_TOTAL_BYTES:
        raise ConfigError(f"the files add up to {total} bytes, over the {MAX_FILES_TOTAL_BYTES}-byte limit "
                          "per version")
    return out


class FileSet:
    """The current set of non-weight files of one publisher, and what of it the store already has."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._data: dict[str, bytes] = {}
        self.entries: tuple[FileEntry, ...] = ()
        self._named: set[str] = set()  # hashes the last upload's entries named (so its version, once committed)

    def set(self, files: Mapping[str, bytes]) -> None:
        self._data = {h: d for h, d in ((xxh3_128(d), d) for d in files.values())}
        self.entries = tuple(sorted((FileEntry(n, len(d), xxh3_128(d)) for n, d in files.items()),
                                    key=lambda e: e.name))

    def upload(self) -> int:
        """Make every file of the next version present in the store; returns the bytes written.

        Every file is checked (``stat``) each version and put when missing: nothing is assumed to
        be there because this publisher put it once (retention deletes what no kept manifest
        names). A file that comes back after this publisher's previous version dropped it is put
        afresh even when an object of that hash exists: retention may be deleting it right now,
        and a fresh write gives it a new age, which retention's grace period protects until this
        version commits and names it. (A new publisher trusts what it finds: its files are
        normally those HEAD already names.)"""
        written = 0
        for e in self.entries:
            key = file_key(e.xxh3_128)
            present = False
            if not self._named or e.xxh3_128 in self._named:
                try:
                    present = self.store.stat(key).size == e.size
                except ObjectNotFoundError:
                    present = False
            if not present:
                self.store.put(key, self._data[e.xxh3_128])
                written += e.size
        self._named = {e.xxh3_128 for e in self.entries}
        return written
