"""A Hugging Face model directory per applied version, and a ``current`` link the engine reads.

Layout under ``root``::

    root/
      current -> versions/42          relative symlink, swapped atomically
      versions/
        41/                           a complete version (kept while an engine may still read it)
        42/
          model-00001-of-00002.safetensors
          model-00002-of-00002.safetensors
          model.safetensors.index.json   {"metadata": {"total_size": N}, "weight_map": {name: file}}
          config.json, tokenizer.json …  the extra ``files`` given to write_version
        .tmp-43-1a2b3c4d/             a write in progress, or left by a crash (clean_partial removes it)

Crash safety: a version is written into a ``.tmp-`` directory, every file and the directory are
fsynced, and only then is it renamed to its decimal name (and the parent fsynced). A decimal
directory is therefore always complete; deletion first renames it back to a ``.tmp-`` name, so a
crash mid-delete never leaves a half-deleted decimal directory either. ``current`` is replaced by
``rename(2)`` of a fresh symlink, so it names the old or the new version, never neither.

One writer per root: the daemon owns it. Readers (the engine) only follow ``current`` or a path
handed to them.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from ..util.fsutil import exchange_paths, fsync_path, write_synced
from .safetensors_file import (ST_DTYPES, bits_equal, nbytes, plain_copy, plan_shards, shard_sizes,
                               stream_safetensors)
from ..errors import ConfigError, ModelDirError, UnsafeNameError
from ..format import check_file_name

log = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
CURRENT_NAME = "current"
VERSIONS_NAME = "versions"
TMP_PREFIX = ".tmp-"
_CURRENT_TMP = ".current.tmp"
_SHARD_RE = re.compile(r"model-(\d{5})-of-(\d{5})\.safetensors")
_MAX_INDEX_BYTES = 64 * 2**20


@dataclass(frozen=True, kw_only=True)
class ModelDirConfig:
    """How version directories are laid out and how many are kept."""

    shard_bytes: int = 5 * 10**9
    """Most tensor bytes per safetensors shard (Hugging Face's default is 5 GB). Tensors fill shards
    in sorted-name order; a tensor larger than this gets a shard of its own."""
    keep: int = 2
    """Version directories kept by :meth:`ModelDir.prune` besides the one ``current`` names: an
    engine may still be reading the previous one when ``current`` moves on."""

    def __post_init__(self) -> None:
        if isinstance(self.shard_bytes, bool) or not isinstance(self.shard_bytes, int) or self.shard_bytes < 1:
            raise ConfigError(f"ModelDirConfig.shard_bytes must be a positive int of bytes, got {self.shard_bytes!r}")
        if isinstance(self.keep, bool) or not isinstance(self.keep, int) or self.keep < 0:
            raise ConfigError(f"ModelDirConfig.keep must be an int ≥ 0 (versions kept besides current), "
                              f"got {self.keep!r}")


class ModelDir:
    """One Hugging Face model directory per version under ``root/versions``, plus ``root/current``."""

    def __init__(self, root: Path | str, *, config: ModelDirConfig = ModelDirConfig()) -> None:
        self.root = Path(root)
        self.config = config
        self._versions = self.root / VERSIONS_NAME

    # --- naming ----------------------------------------------------------------------------------
    def path(self, version: int) -> Path:
        """``root/versions/<version>`` (plain decimal); it may not exist."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ModelDirError(f"model dir {self.root}: version must be an int ≥ 0, got {version!r}")
        return self._versions / str(version)

    def versions(self) -> list[int]:
        """Complete version directories present, ascending (temp directories are not versions)."""
        if not self._versions.is_dir():
            return []
        found = []
        for entry in self._versions.iterdir():
            if _is_decimal(entry.name) and not entry.is_symlink() and (entry / INDEX_NAME).is_file():
                found.append(int(entry.name))
        return sorted(found)

    def current_version(self) -> int | None:
        """The version ``current`` names, or None if there is no ``current`` yet."""
        link = self.root / CURRENT_NAME
        try:
            target = os.readlink(link)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise ModelDirError(f"{link} is not a symlink made by xcluster ({exc}); move it away") from exc
        parts = Path(target).parts
        if len(parts) != 2 or parts[0] != VERSIONS_NAME or not _is_decimal(parts[1]):
            raise ModelDirError(f"{link} points at {target!r}, not at versions/<N>; remove the link "
                                "and switch_current() again")
        return int(parts[1])

    # --- writing ---------------------------------------------------------------------------------
    def write_version(self, version: int, state: Mapping[str, torch.Tensor], files: Mapping[str, bytes]) -> Path:
        """Write ``state`` as sharded safetensors plus ``files`` into ``versions/<version>``; return it.

        If ``versions/<version>`` already exists (a crash after the rename, before ``current``
        moved), it is **reused only if verified**: every tensor and file read back equals what was
        given, bit for bit. Otherwise it is **replaced** by the freshly written copy, also when
        ``current`` names it (a corrupt directory found after a restart): the complete copy is
        written beside it first and swapped in with one ``renameat2(RENAME_EXCHANGE)``, so the
        path ``current`` names holds a complete directory throughout; only then is the bad one
        deleted. Where the filesystem cannot exchange, the bad one is renamed away and the copy
        renamed in (between the two, ``current`` names nothing: never a mixed directory).
        """
        final = self.path(version)
        names = sorted(state)
        extra = _checked_files(files)
        for name in names:
            if not isinstance(state[name], torch.Tensor):
                raise ModelDirError(f"model dir {self.root}: state[{name!r}] is a {type(state[name]).__name__}, "
                                    "not a torch.Tensor")
        if final.is_dir():
            if self._matches(final, state, extra):
                log.info("version dir %s already complete and verified; reusing it", final)
                return final
            log.warning("version dir %s differs from version %d%s; replacing it with a verified copy", final,
                        version, " (`current` names it)" if self.current_version() == version else "")
        self._versions.mkdir(parents=True, exist_ok=True)
        tmp = self._temp_path(version)
        try:
            tmp.mkdir()
            self._write_into(tmp, state, names, extra)
            fsync_path(tmp, directory=True)
            if final.exists() and exchange_paths(tmp, final):
                fsync_path(self._versions, directory=True)
                shutil.rmtree(tmp)  # now the bad copy
            else:
                if final.exists():
                    self._remove(final)
                os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        fsync_path(self._versions, directory=True)
        return final

    def _write_into(self, tmp: Path, state: Mapping[str, torch.Tensor], names: list[str],
                    extra: dict[str, bytes]) -> None:
        from safetensors.torch import save_file

        shards = plan_shards([(n, nbytes(state[n])) for n in names], self.config.shard_bytes)
        weight_map: dict[str, str] = {}
        total = 0
        seen_storage: set[int] = set()
        for i, group in enumerate(shards, start=1):
            shard_name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            tensors = {}
            for name in group:
                tensors[name] = plain_copy(state[name], seen_storage)
                weight_map[name] = shard_name
                total += tensors[name].nbytes
            try:
                if all(t.dtype in ST_DTYPES for t in tensors.values()):
                    stream_safetensors(tmp / shard_name, tensors, {"format": "pt"})
                else:  # a dtype this writer does not name: safetensors' own (it copies each tensor)
                    save_file(tensors, str(tmp / shard_name), metadata={"format": "pt"})
            except Exception as exc:  # safetensors raises plain ValueError/RuntimeError
                raise ModelDirError(f"writing {tmp / shard_name} failed: {exc}") from exc
            fsync_path(tmp / shard_name)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        write_synced(tmp / INDEX_NAME, json.dumps(index, indent=2, sort_keys=True).encode() + b"\n")
        for name, data in extra.items():
            write_synced(tmp / name, data)

    def switch_current(self, version: int) -> None:
        """Point ``current`` at ``versions/<version>`` atomically (symlink + rename, then fsync root)."""
        target = self.path(version)
        if not (target / INDEX_NAME).is_file():
            raise ModelDirError(f"cannot switch current to {target}: it is not a complete version "
                                "directory; write_version() it first")
        link = self.root / CURRENT_NAME
        if link.exists() and not link.is_symlink():
            raise ModelDirError(f"{link} exists and is not a symlink; move it away so current can be switched")
        tmp = self.root / _CURRENT_TMP
        tmp.unlink(missing_ok=True)
        os.symlink(os.path.join(VERSIONS_NAME, str(version)), tmp)
        os.replace(tmp, link)
        fsync_path(self.root, directory=True)

    # --- reading ---------------------------------------------------------------------------------
    def load(self, version: int, *, expected_files: Mapping[str, tuple[int, str]] | None = None,
             ) -> tuple[dict[str, torch.Tensor], dict[str, bytes]]:
        """Read ``versions/<version>`` back: (tensors, extra files), bit-exact.

        Sizes are checked before any tensor is read: each shard's header must account for the
        whole file, name exactly the tensors the index maps to it, and the sizes must add up to
        the index's ``total_size``. With ``expected_files`` (name -> (size, xxh3-128), a manifest's
        ``files``) the directory must hold exactly those non-weight files, as regular files of
        that size and hash, and nothing else besides the index and its shards: an engine is handed
        the whole directory, so a changed config.json or an added tokenizer_config.json is as bad
        as a changed tensor.
        """
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        directory = self.path(version)
        by_shard = self._checked_index(directory)
        if expected_files is not None:
            self._check_files(directory, set(by_shard), expected_files)
        state: dict[str, torch.Tensor] = {}
        for shard in sorted(by_shard):
            try:
                state.update(load_file(str(directory / shard)))
            except (SafetensorError, OSError, ValueError) as exc:
                raise ModelDirError(f"{directory / shard} cannot be read ({exc}); rewrite version {version}") from exc
        files = {p.name: p.read_bytes() for p in sorted(directory.iterdir())
                 if p.is_file() and p.name != INDEX_NAME and p.name not in by_shard}
        return state, files

    def _check_files(self, directory: Path, shards: set[str], expected: Mapping[str, tuple[int, str]]) -> None:
        """Every entry of ``directory`` is the index, one of ``shards`` or an ``expected`` file
        (a regular file of its size and xxh3-128), and every expected file is there."""
        from ..format import xxh3_128

        seen = set()
        for p in sorted(directory.iterdir()):
            if p.name == INDEX_NAME or p.name in shards:
                if p.is_symlink() or not p.is_file():
                    raise ModelDirError(f"{p} is not a regular file; the directory is not ours")
                continue
            if p.name not in expected:
                raise ModelDirError(f"{p} is not among the files of version {directory.name}'s manifest "
                                    "(added after it was written); the directory is not the one verified")
            size, digest = expected[p.name]
            if p.is_symlink() or not p.is_file():
                raise ModelDirError(f"{p} is not a regular file; the manifest lists it as one")
            if p.stat().st_size != size or xxh3_128(p.read_bytes()) != digest:
                raise ModelDirError(f"{p} differs from the manifest's entry (size or xxh3-128); it was "
                                    "changed after it was written")
            seen.add(p.name)
        if missing := sorted(set(expected) - seen):
            raise ModelDirError(f"{directory} is missing {', '.join(missing)}, listed in its manifest")

    def _checked_index(self, directory: Path) -> dict[str, list[str]]:
        """Parse and cross-check the index against every shard header; return shard -> names."""
        index_path = directory / INDEX_NAME
        if not index_path.is_file():
            raise ModelDirError(f"{directory} is not a complete version directory (no {INDEX_NAME}); "
                                "it was never written or has been deleted")
        if index_path.stat().st_size > _MAX_INDEX_BYTES:
            raise ModelDirError(f"{index_path} is larger than {_MAX_INDEX_BYTES} bytes; it is not ours")
        try:
            index = json.loads(index_path.read_bytes())
            total_size = index["metadata"]["total_size"]
            weight_map = index["weight_map"]
            if not isinstance(total_size, int) or not isinstance(weight_map, dict):
                raise TypeError("total_size must be an int and weight_map an object")
        except (ValueError, KeyError, TypeError) as exc:
            raise ModelDirError(f"{index_path} is malformed ({exc!r}); rewrite this version") from exc
        by_shard: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            if not isinstance(shard, str) or not _SHARD_RE.fullmatch(shard):
                raise ModelDirError(f"{index_path} maps {name!r} to {shard!r}, not a shard file name")
            by_shard.setdefault(shard, []).append(name)
        seen = 0
        for shard, names in by_shard.items():
            sizes = shard_sizes(directory / shard)
            if sorted(sizes) != sorted(names):
                raise ModelDirError(f"{directory / shard} holds {sorted(sizes)[:5]}… but the index maps "
                                    f"{sorted(names)[:5]}… to it; the directory is corrupt")
            seen += sum(sizes.values())
        if seen != total_size:
            raise ModelDirError(f"{index_path} declares total_size {total_size} but the shards hold {seen} "
                                "bytes; the directory is corrupt")
        return by_shard

    def _matches(self, directory: Path, state: Mapping[str, torch.Tensor], extra: dict[str, bytes]) -> bool:
        """True if ``directory`` holds exactly ``state`` and ``extra``, bit for bit (one tensor at a time)."""
        from safetensors import safe_open

        try:
            by_shard = self._checked_index(directory)
        except ModelDirError as exc:
            log.warning("existing %s fails its checks: %s", directory, exc)
            return False
        if sorted(n for names in by_shard.values() for n in names) != sorted(state):
            return False
        on_disk = {p.name for p in directory.iterdir() if p.name != INDEX_NAME and p.name not in by_shard}
        if on_disk != set(extra) or any((directory / n).read_bytes() != d for n, d in extra.items()):
            return False
        try:
            for shard, names in by_shard.items():
                with safe_open(str(directory / shard), framework="pt") as f:
                    for name in names:
                        if not bits_equal(f.get_tensor(name), state[name]):
                            return False
        except Exception as exc:  # any read failure means "not verified": rewrite it
            log.warning("existing %s cannot be read back (%r)", directory, exc)
            return False
        return True

    # --- housekeeping ----------------------------------------------------------------------------
    def discard(self, version: int) -> None:
        """Set a bad ``versions/<version>`` aside (renamed to a temp name, then deleted) so no engine
        (re)started on ``current`` loads it; if ``current`` names it, ``current`` is removed too
        (an engine then finds nothing rather than bad weights) until a verified copy is switched in."""
        directory = self.path(version)
        link = self.root / CURRENT_NAME
        try:
            names_it = self.current_version() == version
        except ModelDirError:
            names_it = False
        if names_it:
            link.unlink()
            fsync_path(self.root, directory=True)
        if directory.is_dir() and not directory.is_symlink():
            self._remove(directory)
            fsync_path(self._versions, directory=True)

    def prune(self) -> list[int]:
        """Delete every version but ``current`` and the ``keep`` newest others; return those deleted."""
        current = self.current_version()
        others = [v for v in self.versions() if v != current]
        doomed = others[:max(0, len(others) - self.config.keep)]
        for v in doomed:
            self._remove(self.path(v))
        if doomed:
            fsync_path(self._versions, directory=True)
        return doomed

    def clean_partial(self) -> list[Path]:
        """Remove temp directories (and a stale ``current`` temp link) left by a crash; return them."""
        removed = []
        stale_link = self.root / _CURRENT_TMP
        if stale_link.is_symlink() or stale_link.exists():
            stale_link.unlink()
            removed.append(stale_link)
        for entry in self._iter_temps():
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
            removed.append(entry)
        return removed

    def _iter_temps(self) -> Iterator[Path]:
        if self._versions.is_dir():
            yield from sorted(p for p in self._versions.iterdir() if p.name.startswith(TMP_PREFIX))

    def _temp_path(self, version: int) -> Path:
        return self._versions / f"{TMP_PREFIX}{version}-{secrets.token_hex(4)}"

    def _remove(self, directory: Path) -> None:
        """Delete a version directory: rename it to a temp name first, so no half-deleted decimal
        directory can survive a crash."""
        doomed = self._temp_path(int(directory.name))
        os.rename(directory, doomed)
        shutil.rmtree(doomed)


# --- helpers -------------------------------------------------------------------------------------
def _is_decimal(name: str) -> bool:
    return name.isascii() and name.isdigit() and (name == "0" or not name.startswith("0"))


def _checked_files(files: Mapping[str, bytes]) -> dict[str, bytes]:
    """Validate the extra file names: plain names that cannot escape the directory or shadow weights."""
    out = {}
    for name, data in files.items():
        if (not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name
                or "\x00" in name or ".." in name or name.startswith(TMP_PREFIX)):
            raise ModelDirError(f"extra file name {name!r} is not a plain file name (no '/', no '..')")
        try:  # the one rule for non-weight file names, which the publisher applies before uploading
            check_file_name(name)
        except UnsafeNameError as exc:
            raise ModelDirError(f"extra file name {name!r} would collide with the weights this directory "
                                f"writes, or is not a plain file name ({exc})") from None
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ModelDirError(f"extra file {name!r} must be bytes, got {type(data).__name__}")
        out[name] = bytes(data)
    return out
