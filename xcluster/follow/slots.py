"""Two model directories, slots ``a`` and ``b``, patched in place; ``current`` names the one the engine reads.

Layout under ``root``::

    root/
      current -> slots/a               relative symlink, swapped atomically
      slots/
        a/                             a Hugging Face model directory, holding one exact version
          model-00001-of-00002.safetensors
          model-00002-of-00002.safetensors
          model.safetensors.index.json {"metadata": {"total_size": N}, "weight_map": {name: file}}
          config.json, tokenizer.json …  the version's non-weight files
          .xcluster-version            {"version": V, "model_digest": D} while the slot holds V whole
        b/                             the standby: the next version is patched into it
        .tmp-b-1a2b3c4d/               a full write in progress (keyframe, repair), or a crash's leftover

A slot's tensors are **memory-mapped** (``MAP_SHARED``, :meth:`Slots.map`): a delta decoded against
them patches the files themselves, so the daemon holds no second copy of the model. Within a
shard, tensors are laid out widest dtype first (8-, 4-, 2-, then 1-byte elements, by name inside a
width) after a header padded to 8 bytes, so every tensor starts aligned to its element size and
maps as a view. Shards are filled in sorted-name order up to ``shard_bytes``.

A **full write** (keyframe, checkpoint, a repair, a changed set of tensors) goes into a
``.tmp-`` directory (:meth:`Slots.layout`: files sized and headed first, then filled through their
mapping), is fsynced, and is swapped in with one ``renameat2(RENAME_EXCHANGE)`` (or two renames
where the filesystem cannot exchange). Which slot holds which version, and whether it may be
trusted, is the daemon's record (``state.py``), not this module's: this module only lays out,
maps, copies, syncs and links.

One writer per root: the daemon owns it. Readers (the engine) follow ``current`` or the slot path
handed to them, and must copy the weights out of the files while loading (vLLM, SGLang and
transformers' loaders do): the slot they read is patched again one version later.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ConfigError, ModelDirError, UnsafeNameError
from ..format import check_file_name, xxh3_128
from ..util.fsutil import exchange_paths, fsync_path, write_atomic, write_synced
from .safetensors_file import ST_DTYPES, ST_NAMES, aligned_order, header_bytes, plan_shards, read_header, spec_bytes, width

log = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
CURRENT_NAME = "current"
SLOTS_NAME = "slots"
SLOT_NAMES = ("a", "b")
TMP_PREFIX = ".tmp-"
_CURRENT_TMP = ".current.tmp"
TAG_NAME = ".xcluster-version"
_SHARD_RE = re.compile(r"model-(\d{5})-of-(\d{5})\.safetensors")
_MAX_INDEX_BYTES = 64 * 2**20

TensorSpec = tuple[str, torch.dtype, tuple[int, ...]]


@dataclass(frozen=True, kw_only=True)
class SlotsConfig:
    """How slots are laid out, and how many the node keeps."""

    shard_bytes: int = 5 * 10**9
    """Most tensor bytes per safetensors shard (Hugging Face's default is 5 GB); a tensor larger
    than this gets a shard of its own."""
    slots: int = 2
    """2: the standby slot is patched while the engine's slot stays whole (host memory ≈ 2× the
    model). 1: one slot, patched in place with ``current`` unlinked meanwhile (≈ 1×), for GPU
    nodes whose engine holds its own copy and reads the directory only when it (re)starts."""

    def __post_init__(self) -> None:
        if isinstance(self.shard_bytes, bool) or not isinstance(self.shard_bytes, int) or self.shard_bytes < 1:
            raise ConfigError(f"SlotsConfig.shard_bytes must be a positive int of bytes, got {self.shard_bytes!r}")
        if self.slots not in (1, 2):
            raise ConfigError(f"SlotsConfig.slots must be 1 or 2, got {self.slots!r}")


@dataclass
class Pending:
    """A full write in progress: a ``.tmp-`` directory whose files are sized and headed, and the
    writable views of its tensors. :meth:`Slots.commit` makes it the slot's directory."""

    slot: str
    path: Path
    tensors: dict[str, torch.Tensor]


class Slots:
    """The slot directories under ``root/slots`` and the ``root/current`` link."""

    def __init__(self, root: Path | str, *, config: SlotsConfig = SlotsConfig()) -> None:
        self.root = Path(root)
        self.config = config
        self._dir = self.root / SLOTS_NAME

    # --- naming ----------------------------------------------------------------------------------
    @property
    def names(self) -> tuple[str, ...]:
        return SLOT_NAMES[:self.config.slots]

    def path(self, name: str) -> Path:
        self._check_name(name)
        return self._dir / name

    def other(self, name: str) -> str:
        """The slot that is not ``name`` (itself with one slot)."""
        self._check_name(name)
        return name if self.config.slots == 1 else SLOT_NAMES[1 - SLOT_NAMES.index(name)]

    def exists(self, name: str) -> bool:
        return (self.path(name) / INDEX_NAME).is_file()

    def current(self) -> str | None:
        """The slot ``current`` names, or None if there is no ``current``."""
        link = self.root / CURRENT_NAME
        try:
            target = os.readlink(link)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise ModelDirError(f"{link} is not a symlink made by xcluster ({exc}); move it away") from exc
        parts = Path(target).parts
        if len(parts) != 2 or parts[0] != SLOTS_NAME or parts[1] not in SLOT_NAMES:
            raise ModelDirError(f"{link} points at {target!r}, not at slots/a or slots/b; remove the link")
        return parts[1]

    def switch_current(self, name: str) -> None:
        """Point ``current`` at ``slots/<name>`` atomically (symlink + rename, then fsync root)."""
        if not self.exists(name):
            raise ModelDirError(f"cannot switch current to {self.path(name)}: it is not a complete model directory")
        link = self.root / CURRENT_NAME
        if link.exists() and not link.is_symlink():
            raise ModelDirError(f"{link} exists and is not a symlink; move it away so current can be switched")
        tmp = self.root / _CURRENT_TMP
        tmp.unlink(missing_ok=True)
        os.symlink(os.path.join(SLOTS_NAME, name), tmp)
        os.replace(tmp, link)
        fsync_path(self.root, directory=True)

    def unlink_current(self) -> None:
        """Remove ``current`` (an engine (re)started meanwhile finds nothing rather than a file being patched)."""
        link = self.root / CURRENT_NAME
        if link.is_symlink():
            link.unlink()
            fsync_path(self.root, directory=True)

    # --- full writes -----------------------------------------------------------------------------
    def layout(self, name: str, specs: Iterable[TensorSpec]) -> Pending:
        """A ``.tmp-`` directory for slot ``name`` whose shards are sized and headed for ``specs``
        and whose index is written; returns it with writable views of every tensor (the bytes
        read as zeros until filled). Nothing of the slot itself changes until :meth:`commit`."""
        specs = sorted(specs, key=lambda s: s[0])
        for n, dtype, _ in specs:
            if dtype not in ST_DTYPES:
                raise ModelDirError(f"tensor {n!r} is {dtype}, which safetensors cannot name; it cannot be "
                                    "written into a model directory")
        sized = [(n, spec_bytes(dtype, shape)) for n, dtype, shape in specs]
        by_name = {s[0]: s for s in specs}
        shards = plan_shards(sized, self.config.shard_bytes)
        self._dir.mkdir(parents=True, exist_ok=True)
        tmp = self._dir / f"{TMP_PREFIX}{name}-{secrets.token_hex(4)}"
        tmp.mkdir()
        try:
            weight_map: dict[str, str] = {}
            tensors: dict[str, torch.Tensor] = {}
            total = 0
            for i, group in enumerate(shards, start=1):
                shard = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                order = aligned_order([by_name[n] for n in group])
                head, offsets = header_bytes(order, {"format": "pt"})
                size = len(head) + (offsets[-1][1] if offsets else 0)
                with open(tmp / shard, "wb") as f:
                    f.write(head)
                    f.truncate(size)
                tensors.update(_views(tmp / shard, size, len(head), order, offsets))
                for n, _, _ in order:
                    weight_map[n] = shard
                total += size - len(head)
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            write_synced(tmp / INDEX_NAME, json.dumps(index, indent=2, sort_keys=True).encode() + b"\n")
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return Pending(slot=name, path=tmp, tensors=tensors)

    def commit(self, pending: Pending, files: Mapping[str, bytes]) -> dict[str, torch.Tensor]:
        """Write ``files`` beside the filled ``pending`` tensors, fsync everything, and make it
        slot ``pending.slot`` (the old directory is swapped out and deleted). Returns the views,
        which stay valid: they map the files now in the slot."""
        extra = checked_files(files)
        tmp = pending.path
        for fname, data in extra.items():
            write_synced(tmp / fname, data)
        self._sync_dir(tmp)
        self._swap_in(tmp, self.path(pending.slot))
        return pending.tensors

    def discard_pending(self, pending: Pending) -> None:
        shutil.rmtree(pending.path, ignore_errors=True)

    def write(self, name: str, state: Mapping[str, torch.Tensor], files: Mapping[str, bytes]) -> dict[str, torch.Tensor]:
        """A full write of ``state`` and ``files`` as slot ``name``; returns the views of the new files."""
        for n, t in state.items():
            if not isinstance(t, torch.Tensor):
                raise ModelDirError(f"state[{n!r}] is a {type(t).__name__}, not a torch.Tensor")
        pending = self.layout(name, [(n, t.dtype, tuple(t.shape)) for n, t in state.items()])
        try:
            for n, t in state.items():
                if t.numel():
                    pending.tensors[n].copy_(t.detach())
            return self.commit(pending, files)
        except BaseException:
            self.discard_pending(pending)
            raise

    def copy(self, src: str, dst: str) -> None:
        """Make slot ``dst`` a byte copy of slot ``src`` (temp directory, fsync, swap in)."""
        source = self.path(src)
        self._dir.mkdir(parents=True, exist_ok=True)
        tmp = self._dir / f"{TMP_PREFIX}{dst}-{secrets.token_hex(4)}"
        tmp.mkdir()
        try:
            for p in sorted(source.iterdir()):
                if p.is_symlink() or not p.is_file():
                    raise ModelDirError(f"{p} is not a regular file; slot {src} is not ours")
                shutil.copyfile(p, tmp / p.name)
            self._sync_dir(tmp)
            self._swap_in(tmp, self.path(dst))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    # --- in place --------------------------------------------------------------------------------
    def flush(self, name: str) -> None:
        """fsync every file of slot ``name`` and the directory (patches through the mapping are
        in the page cache until then)."""
        self._sync_dir(self.path(name))

    def set_files(self, name: str, files: Mapping[str, bytes]) -> bool:
        """Make the non-weight files of slot ``name`` exactly ``files`` (changed ones replaced
        atomically, others removed). Returns True if anything changed."""
        extra = checked_files(files)
        directory = self.path(name)
        weights = set(self._checked_index(directory)) | {INDEX_NAME, TAG_NAME}
        changed = False
        for p in sorted(directory.iterdir()):
            if p.name not in weights and p.name not in extra:
                p.unlink()
                changed = True
        for fname, data in extra.items():
            p = directory / fname
            if not (p.is_file() and not p.is_symlink() and p.read_bytes() == data):
                write_atomic(p, data, sync_dir=False)
                changed = True
        if changed:
            fsync_path(directory, directory=True)
        return changed

    def tag(self, name: str, version: int, model_digest: str) -> None:
        """Record in the slot itself that it holds ``version`` whole (atomic; after the flush)."""
        write_atomic(self.path(name) / TAG_NAME,
                     json.dumps({"version": version, "model_digest": model_digest}).encode() + b"\n")

    def untag(self, name: str) -> None:
        """Remove the tag before the slot is patched: a reader then sees no version there."""
        p = self.path(name) / TAG_NAME
        if p.exists():
            p.unlink()
            fsync_path(p.parent, directory=True)

    def read_tag(self, name: str) -> tuple[int, str] | None:
        """(version, model digest) the slot's tag names, or None (no tag: being patched, or never
        finished). For readers outside the daemon (``xcluster status``, tests); the daemon's own
        record is ``state.json``."""
        try:
            obj = json.loads((self.path(name) / TAG_NAME).read_bytes()[:4096])
            return int(obj["version"]), str(obj["model_digest"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    # --- reading ---------------------------------------------------------------------------------
    def map(self, name: str, *, expected_files: Mapping[str, tuple[int, str]] | None = None,
            ) -> dict[str, torch.Tensor]:
        """Writable views (``MAP_SHARED``) of every tensor in slot ``name``, after checking that
        each shard's header accounts for the whole file, names exactly the tensors the index maps
        to it and lays each out aligned, and that the sizes add up to the index's ``total_size``.
        With ``expected_files`` (name -> (size, xxh3-128), a manifest's ``files``) the slot must
        hold exactly those non-weight files besides the index and its shards. The bits are not
        checked here: that is the caller's digest check."""
        directory = self.path(name)
        by_shard = self._checked_index(directory)
        if expected_files is not None:
            self._check_files(directory, set(by_shard), expected_files)
        tensors: dict[str, torch.Tensor] = {}
        for shard, names in sorted(by_shard.items()):
            path = directory / shard
            head_len, entries = read_header(path)
            if sorted(entries) != sorted(names):
                raise ModelDirError(f"{path} holds {sorted(entries)[:5]}… but the index maps {sorted(names)[:5]}… "
                                    "to it; the slot is corrupt")
            order, offsets = [], []
            for n, (st_dtype, shape, begin, end) in entries.items():
                dtype = ST_NAMES.get(st_dtype)
                if dtype is None:
                    raise ModelDirError(f"{path}: {n!r} has dtype {st_dtype!r}, which xcluster does not write")
                if end - begin != spec_bytes(dtype, shape):
                    raise ModelDirError(f"{path}: {n!r} spans {end - begin} bytes, its shape {shape} of {st_dtype} "
                                        "needs another size")
                if (head_len + begin) % width(dtype):
                    raise ModelDirError(f"{path}: {n!r} is not aligned to its element size; the slot was not "
                                        "written by xcluster")
                order.append((n, dtype, shape))
                offsets.append((begin, end))
            tensors.update(_views(path, path.stat().st_size, head_len, order, offsets))
        return tensors

    def files(self, name: str) -> dict[str, bytes]:
        """The non-weight files of slot ``name`` (all but the index and its shards), by name."""
        directory = self.path(name)
        weights = set(self._checked_index(directory)) | {INDEX_NAME, TAG_NAME}
        return {p.name: p.read_bytes() for p in sorted(directory.iterdir())
                if p.is_file() and not p.is_symlink() and p.name not in weights}

    def _check_files(self, directory: Path, shards: set[str], expected: Mapping[str, tuple[int, str]]) -> None:
        seen = set()
        for p in sorted(directory.iterdir()):
            if p.name == INDEX_NAME or p.name in shards or p.name == TAG_NAME:
                if p.is_symlink() or not p.is_file():
                    raise ModelDirError(f"{p} is not a regular file; the slot is not ours")
                continue
            if p.name not in expected:
                raise ModelDirError(f"{p} is not among the files of the version's manifest (added after it was "
                                    "written); the slot is not the one verified")
            size, digest = expected[p.name]
            if p.is_symlink() or not p.is_file():
                raise ModelDirError(f"{p} is not a regular file; the manifest lists it as one")
            if p.stat().st_size != size or xxh3_128(p.read_bytes()) != digest:
                raise ModelDirError(f"{p} differs from the manifest's entry (size or xxh3-128); it was changed "
                                    "after it was written")
            seen.add(p.name)
        if missing := sorted(set(expected) - seen):
            raise ModelDirError(f"{directory} is missing {', '.join(missing)}, listed in its manifest")

    def _checked_index(self, directory: Path) -> dict[str, list[str]]:
        """Parse the index and check it against every shard's size; return shard -> names."""
        index_path = directory / INDEX_NAME
        if not index_path.is_file():
            raise ModelDirError(f"{directory} is not a complete model directory (no {INDEX_NAME})")
        if index_path.stat().st_size > _MAX_INDEX_BYTES:
            raise ModelDirError(f"{index_path} is larger than {_MAX_INDEX_BYTES} bytes; it is not ours")
        try:
            index = json.loads(index_path.read_bytes())
            total_size = index["metadata"]["total_size"]
            weight_map = index["weight_map"]
            if not isinstance(total_size, int) or not isinstance(weight_map, dict):
                raise TypeError("total_size must be an int and weight_map an object")
        except (ValueError, KeyError, TypeError) as exc:
            raise ModelDirError(f"{index_path} is malformed ({exc!r}); the slot must be rewritten") from exc
        by_shard: dict[str, list[str]] = {}
        for n, shard in weight_map.items():
            if not isinstance(shard, str) or not _SHARD_RE.fullmatch(shard):
                raise ModelDirError(f"{index_path} maps {n!r} to {shard!r}, not a shard file name")
            by_shard.setdefault(shard, []).append(n)
        seen = 0
        for shard in by_shard:
            _, entries = read_header(directory / shard)
            seen += sum(e[3] - e[2] for e in entries.values())
        if seen != total_size:
            raise ModelDirError(f"{index_path} declares total_size {total_size} but the shards hold {seen} bytes; "
                                "the slot is corrupt")
        return by_shard

    # --- housekeeping ----------------------------------------------------------------------------
    def discard(self, name: str) -> None:
        """Delete slot ``name`` (renamed to a temp name first); if ``current`` names it, unlink ``current``."""
        try:
            names_it = self.current() == name
        except ModelDirError:
            names_it = False
        if names_it:
            self.unlink_current()
        directory = self.path(name)
        if directory.is_dir() and not directory.is_symlink():
            doomed = self._dir / f"{TMP_PREFIX}{name}-{secrets.token_hex(4)}"
            os.rename(directory, doomed)
            fsync_path(self._dir, directory=True)
            shutil.rmtree(doomed)

    def clean_partial(self) -> list[Path]:
        """Remove temp directories (and a stale ``current`` temp link) left by a crash; return them."""
        removed = []
        stale = self.root / _CURRENT_TMP
        if stale.is_symlink() or stale.exists():
            stale.unlink()
            removed.append(stale)
        if self._dir.is_dir():
            for entry in sorted(p for p in self._dir.iterdir() if p.name.startswith(TMP_PREFIX)):
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
                removed.append(entry)
        return removed

    def slot_bytes(self, name: str) -> int:
        """Bytes of the files of slot ``name``."""
        d = self.path(name)
        return sum(p.stat().st_size for p in d.iterdir() if p.is_file()) if d.is_dir() else 0

    # --- internals -------------------------------------------------------------------------------
    def _check_name(self, name: str) -> None:
        if name not in self.names:
            raise ModelDirError(f"{self.root}: no slot {name!r} (slots: {', '.join(self.names)})")

    def _sync_dir(self, directory: Path) -> None:
        for p in directory.iterdir():
            if p.is_file() and not p.is_symlink():
                fsync_path(p)
        fsync_path(directory, directory=True)

    def _swap_in(self, tmp: Path, final: Path) -> None:
        if final.exists() and exchange_paths(tmp, final):
            fsync_path(self._dir, directory=True)
            shutil.rmtree(tmp)  # now the old directory
        else:
            if final.exists():
                doomed = self._dir / f"{TMP_PREFIX}{final.name}-{secrets.token_hex(4)}"
                os.rename(final, doomed)
                shutil.rmtree(doomed)
            os.rename(tmp, final)
        fsync_path(self._dir, directory=True)


# --- helpers -------------------------------------------------------------------------------------
def _views(path: Path, size: int, head_len: int, order: list[TensorSpec],
           offsets: list[tuple[int, int]]) -> dict[str, torch.Tensor]:
    """Writable ``MAP_SHARED`` views of the tensors of one shard file."""
    out: dict[str, torch.Tensor] = {}
    buf = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8) if size else None
    for (n, dtype, shape), (begin, end) in zip(order, offsets):
        if end == begin:
            out[n] = torch.empty(shape, dtype=dtype)
            continue
        out[n] = buf[head_len + begin:head_len + end].view(dtype).view(shape)
    return out


def checked_files(files: Mapping[str, bytes]) -> dict[str, bytes]:
    """Validate the non-weight file names: plain names that cannot escape the directory or shadow weights."""
    out = {}
    for name, data in files.items():
        if (not isinstance(name, str) or not name or name in (".", "..", TAG_NAME) or "/" in name or "\\" in name
                or "\x00" in name or ".." in name or name.startswith(TMP_PREFIX)):
            raise ModelDirError(f"extra file name {name!r} is not a plain file name (no '/', no '..')")
        try:  # the one rule for non-weight file names, which the publisher applies before uploading
            check_file_name(name)
        except UnsafeNameError as exc:
            raise ModelDirError(f"extra file name {name!r} would collide with the weights this directory "
                                f"holds, or is not a plain file name ({exc})") from None
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ModelDirError(f"extra file {name!r} must be bytes, got {type(data).__name__}")
        out[name] = bytes(data)
    return out


def backed_by(state: Mapping[str, torch.Tensor], views: Mapping[str, torch.Tensor]) -> bool:
    """True if every tensor of ``state`` shares the memory of the view of ``views`` of its name,
    and there are no more or fewer: patches to ``state`` then went into the files they map."""
    if state.keys() != views.keys():
        return False
    for n, t in state.items():
        v = views[n]
        if t.dtype != v.dtype or t.shape != v.shape or (t.numel() and t.data_ptr() != v.data_ptr()):
            return False
    return True


__all__ = ["CURRENT_NAME", "INDEX_NAME", "Pending", "SLOT_NAMES", "Slots", "SlotsConfig", "backed_by",
           "checked_files"]
