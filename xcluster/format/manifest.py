"""manifest: see docs/FORMAT.md."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol


from .dtypes import DTYPE_NAMES, itemsize
from ..errors import FormatError, UnsafeNameError

from .canonical import FORMAT_VERSION, MANIFEST_FORMAT, Signature, _int, _list, _load_json, _run_id, _signature, _str, canonical_json
from .keys import _ENCODING_NAME, _HEX128, _MANIFEST_NAME, check_chunk_name, check_file_name, check_manifest_name, check_tensor_name, checkpoint_dir, chunk_key
from .limits import MAX_CHUNK_BYTES, MAX_DIMS, MAX_FILES, MAX_FILES_TOTAL_BYTES, MAX_FILE_BYTES, MAX_MANIFEST_BYTES, MAX_PARTS, MAX_SEGMENT_ELEMENTS, MAX_STREAMS, MAX_TENSOR_ELEMENTS, MAX_VERSION


KEYFRAME = "keyframe"
DELTA = "delta"
CHECKPOINT = "checkpoint"
KINDS = (KEYFRAME, DELTA)
"""What a committed version is (HEAD and the chain): a keyframe only where there is no base."""
MANIFEST_KINDS = (*KINDS, CHECKPOINT)
"""A manifest is a version's, or a checkpoint's: the full state of a committed version, a side
object under ``checkpoints/<V>/`` that a joining node starts from (FORMAT.md §3a)."""
FULL_KINDS = (KEYFRAME, CHECKPOINT)

INIT_BASE = "base"  # tensor starts from the base version's tensor of the same name
INIT_NONE = "none"  # every element is given by planes segments

def object_key(m: Manifest, name: str) -> str:
    """Where chunk ``name`` of manifest ``m`` lives: its version's directory, or its checkpoint's."""
    if m.kind == CHECKPOINT:
        return f"{checkpoint_dir(m.version)}/{check_chunk_name(name)}"
    return chunk_key(m.version, name)


@dataclass(frozen=True, slots=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    digest: str
    init: str
    parts: tuple[int, ...] | None = None
    """The tensor was hashed in parts of these many elements, in order (at least two,
    each >= 1, summing to numel); ``digest`` is then the parts digest (digest.py). None: the
    digest is over the whole tensor."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)


@dataclass(frozen=True, slots=True)
class ChunkEntry:
    name: str
    size: int
    xxh3_128: str


@dataclass(frozen=True, slots=True)
class FileEntry:
    """A non-weight file of the model directory (config.json, tokenizer files), stored at
    ``files/<xxh3_128>``."""
    name: str
    size: int
    xxh3_128: str


@dataclass(frozen=True, slots=True)
class StreamEntry:
    codec: str
    stored: int
    raw: int


@dataclass(frozen=True, slots=True)
class Segment:
    tensor: int
    start: int
    count: int
    nnz: int


@dataclass(frozen=True, slots=True)
class BlockEntry:
    chunk: int
    offset: int
    encoding: str
    width: int
    streams: tuple[StreamEntry, ...]
    segments: tuple[Segment, ...]

    @property
    def stored(self) -> int:
        return sum(s.stored for s in self.streams)


def encodings_of(blocks) -> tuple[str, ...]:
    """A manifest's ``encodings``: the encodings of its blocks, sorted, each once."""
    return tuple(sorted({b.encoding for b in blocks}))


@dataclass(frozen=True, slots=True)
class ManifestLink:
    """``prev_manifest``: the previous committed version's manifest object and the hash of its
    bytes (what chain.Link follows)."""
    version: int
    manifest: str
    xxh3_128: str


@dataclass(frozen=True, slots=True)
class Manifest:
    version: int
    kind: str
    base_version: int | None
    base_model_digest: str | None
    base_manifest_xxh3_128: str | None
    keyframe_version: int
    step: int | None
    created_unix_ms: int
    model_digest: str
    tensors: tuple[TensorEntry, ...]
    chunks: tuple[ChunkEntry, ...]
    blocks: tuple[BlockEntry, ...]
    changed_elements: int = 0
    base_manifest: str | None = None
    """The name of the base version's manifest object (null for a keyframe)."""
    files: tuple[FileEntry, ...] = ()
    """The complete set of non-weight files of this version, sorted by name."""
    prev_manifest: ManifestLink | None = None
    """The link to version − 1's committed manifest, keyframes included (for a delta it repeats the
    base link); None for version 1."""
    run_id: str | None = None
    """Optional: the training run this version belongs to; a signature covers it."""
    signature: Signature | None = None
    """Optional: the publisher's signature over the signed payload."""
    signed_payload: bytes | None = field(default=None, repr=False, compare=False)
    """Set by the parser on a signed manifest: the bytes its signature covers."""
    checkpoint_of: ManifestLink | None = None
    """A checkpoint's link to the committed manifest of the version it reproduces (same version)."""

    @property
    def encodings(self) -> tuple[str, ...]:
        """The encodings this manifest's blocks use (its ``encodings`` field)."""
        return encodings_of(self.blocks)

    @property
    def total_elements(self) -> int:
        return sum(t.numel for t in self.tensors)

    @property
    def model_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def chunk_bytes(self) -> int:
        return sum(c.size for c in self.chunks)

    def to_obj(self) -> dict[str, Any]:
        obj = {
            "format": MANIFEST_FORMAT,
            "format_version": FORMAT_VERSION,
            "encodings": list(self.encodings),
            "version": self.version,
            "kind": self.kind,
            "base_version": self.base_version,
            "base_model_digest": self.base_model_digest,
            "base_manifest_xxh3_128": self.base_manifest_xxh3_128,
            "keyframe_version": self.keyframe_version,
            "step": self.step,
            "created_unix_ms": self.created_unix_ms,
            "model_digest": self.model_digest,
            "changed_elements": self.changed_elements,
            "tensors": [_tensor_obj(t) for t in self.tensors],
            "chunks": [{"name": c.name, "size": c.size, "xxh3_128": c.xxh3_128} for c in self.chunks],
            "blocks": [{"chunk": b.chunk, "offset": b.offset, "encoding": b.encoding, "width": b.width,
                        "streams": [[s.codec, s.stored, s.raw] for s in b.streams],
                        "segments": [[s.tensor, s.start, s.count, s.nnz] for s in b.segments]}
                       for b in self.blocks],
            "base_manifest": self.base_manifest,
            "files": [{"name": f.name, "size": f.size, "xxh3_128": f.xxh3_128} for f in self.files],
        }
        p = self.prev_manifest
        obj["prev_manifest"] = None if p is None else {"version": p.version, "manifest": p.manifest,
                                                       "xxh3_128": p.xxh3_128}
        if self.run_id is not None:
            obj["run_id"] = self.run_id
        if self.checkpoint_of is not None:
            c = self.checkpoint_of
            obj["checkpoint_of"] = {"version": c.version, "manifest": c.manifest, "xxh3_128": c.xxh3_128}
        if self.signature is not None:
            obj["signature"] = self.signature.to_obj()
        return obj

    def payload(self) -> bytes:
        """The bytes a signature of this manifest covers (its canonical JSON without ``signature``)."""
        return canonical_json({k: v for k, v in self.to_obj().items() if k != "signature"})

    def to_bytes(self) -> bytes:
        return canonical_json(self.to_obj())


def _tensor_obj(t: TensorEntry) -> dict[str, Any]:
    obj: dict[str, Any] = {"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "digest": t.digest,
                           "init": t.init}
    if t.parts is not None:
        obj["parts"] = list(t.parts)
    return obj


# --- parsing ---------------------------------------------------------------------------------
def _encodings(obj: dict, where: str) -> tuple[str, ...]:
    """``encodings``: sorted, distinct names. Whether this reader has them, and each block's
    limits under its encoding, is the codec's to check (``codec.encoding.check_manifest``): a
    relay or gc needs no encoding to move or keep bytes."""
    raw = obj.get("encodings")
    if (not isinstance(raw, list) or len(raw) > 64
            or any(not isinstance(e, str) or not _ENCODING_NAME.fullmatch(e) for e in raw)
            or raw != sorted(set(raw))):
        raise FormatError(f"{where}: field 'encodings' must be a sorted list of distinct encoding names, "
                          f"got {str(raw)[:200]}")
    return tuple(raw)


class EncodingRules(Protocol):
    """What a reader's codec checks while a manifest is parsed (``codec.encoding.RULES``): that it
    has every encoding the manifest names, and each block's limits under its encoding."""

    def check_names(self, encodings: tuple[str, ...], *, where: str) -> None: ...

    def check_block(self, block: BlockEntry, tensors: list[TensorEntry], *, where: str) -> None: ...


def parse_manifest(data: bytes, *, where: str = "manifest", rules: EncodingRules | None = None) -> Manifest:
    """Parse and check a manifest (FORMAT.md §3). Without ``rules`` only what every encoding shares
    is checked (enough to list, copy or keep its objects: a relay, gc); a reader that decodes
    parses with the codec's rules (``codec.encoding.parse_manifest``), which refuse an encoding
    it lacks by name before anything else is looked at."""
    obj = _load_json(data, where, MAX_MANIFEST_BYTES, MANIFEST_FORMAT)
    encodings = _encodings(obj, where)
    if rules is not None:
        rules.check_names(encodings, where=where)
    version = _int(obj, "version", where, lo=1)
    kind = _str(obj, "kind", where, choices=MANIFEST_KINDS)
    base_version = _int(obj, "base_version", where, lo=1, null=True)
    base_digest = _str(obj, "base_model_digest", where, pattern=_HEX128, null=True)
    base_mh = _str(obj, "base_manifest_xxh3_128", where, pattern=_HEX128, null=True)
    keyframe_version = _int(obj, "keyframe_version", where, lo=1)
    if kind == KEYFRAME:
        if base_version is not None or base_digest is not None or base_mh is not None \
                or keyframe_version != version:
            raise FormatError(f"{where}: a keyframe has no base (base_* null) and is its own keyframe_version")
    elif kind == CHECKPOINT:
        if base_version is not None or base_digest is not None or base_mh is not None \
                or keyframe_version > version:
            raise FormatError(f"{where}: a checkpoint has no base (base_* null) and keyframe_version <= version")
    else:
        if base_version != version - 1 or base_digest is None or base_mh is None:
            raise FormatError(f"{where}: a delta needs base_version = version - 1, base_model_digest and "
                              "base_manifest_xxh3_128")
        if not keyframe_version <= base_version:
            raise FormatError(f"{where}: keyframe_version must be <= base_version")
    files: list[FileEntry] = []
    run_id, (signature, payload) = _run_id(obj, where), _signature(obj, where)
    base_manifest = obj.get("base_manifest")
    if kind != DELTA and base_manifest is not None:
        raise FormatError(f"{where}: a {kind} has no base_manifest")
    if kind == DELTA:
        try:
            check_manifest_name(base_manifest)
        except UnsafeNameError as exc:
            raise FormatError(f"{where}: field 'base_manifest' is invalid: {exc}") from None
    prev = _parse_prev(obj.get("prev_manifest"), version, where)
    checkpoint_of = obj.get("checkpoint_of")
    if kind == CHECKPOINT:
        if prev is not None or checkpoint_of is None:
            raise FormatError(f"{where}: a checkpoint has checkpoint_of (the version's manifest) and no prev_manifest")
        checkpoint_of = _parse_prev(checkpoint_of, version + 1, where, field_name="checkpoint_of")
    elif checkpoint_of is not None:
        raise FormatError(f"{where}: only a checkpoint has checkpoint_of")
    if kind == DELTA and prev is not None and prev != ManifestLink(base_version, base_manifest, base_mh):
        raise FormatError(f"{where}: a delta's prev_manifest must repeat its base link (base_version, "
                          "base_manifest, base_manifest_xxh3_128)")
    fnames: set[str] = set()
    raw_files = _list(obj, "files", where)
    if len(raw_files) > MAX_FILES:
        raise FormatError(f"{where}: {len(raw_files)} files is over the limit of {MAX_FILES}")
    for i, f in enumerate(raw_files):
        fw = f"{where}: files[{i}]"
        if not isinstance(f, dict):
            raise FormatError(f"{fw} must be an object")
        fname = check_file_name(f.get("name"))
        if fname in fnames:
            raise FormatError(f"{fw}: duplicate file name {fname!r}")
        fnames.add(fname)
        files.append(FileEntry(fname, _int(f, "size", fw, hi=MAX_FILE_BYTES),
                               _str(f, "xxh3_128", fw, pattern=_HEX128)))
    if sum(f.size for f in files) > MAX_FILES_TOTAL_BYTES:
        raise FormatError(f"{where}: its files add up to {sum(f.size for f in files)} bytes, over the limit of "
                          f"{MAX_FILES_TOTAL_BYTES} per manifest (each listed name counts)")

    tensors: list[TensorEntry] = []
    seen: set[str] = set()
    for i, t in enumerate(_list(obj, "tensors", where)):
        tw = f"{where}: tensors[{i}]"
        if not isinstance(t, dict):
            raise FormatError(f"{tw} must be an object")
        name = check_tensor_name(t.get("name"))
        if name in seen:
            raise FormatError(f"{tw}: duplicate tensor name {name!r}")
        seen.add(name)
        dtype = _str(t, "dtype", tw, choices=DTYPE_NAMES)
        shape = t.get("shape")
        if (not isinstance(shape, list) or len(shape) > MAX_DIMS
                or any(type(s) is not int or s < 0 or s > MAX_VERSION for s in shape)):
            raise FormatError(f"{tw} ({name}): shape {shape!r} is not a list of at most {MAX_DIMS} "
                              "non-negative integers")
        # torch computes strides and storage size with every dim counted as at least 1, even
        # when another dim is 0: bounding that product bounds numel and keeps them in int64
        if math.prod(max(s, 1) for s in shape) > MAX_TENSOR_ELEMENTS:
            raise FormatError(f"{tw} ({name}): shape {shape} is over the limit: the product of its dims, "
                              f"each counted as at least 1, must be at most 2**44")
        init = _str(t, "init", tw, choices=(INIT_BASE, INIT_NONE))
        if kind in FULL_KINDS and init != INIT_NONE:
            raise FormatError(f"{tw} ({name}): every tensor of a {kind} has init 'none'")
        tensors.append(TensorEntry(name, dtype, tuple(shape), _str(t, "digest", tw, pattern=_HEX128), init,
                                   _parts(t, tw, name, math.prod(shape))))

    chunks: list[ChunkEntry] = []
    names: set[str] = set()
    for i, c in enumerate(_list(obj, "chunks", where)):
        cw = f"{where}: chunks[{i}]"
        if not isinstance(c, dict):
            raise FormatError(f"{cw} must be an object")
        cname = check_chunk_name(c.get("name"))
        if cname in names or _MANIFEST_NAME.fullmatch(cname):
            raise FormatError(f"{cw}: duplicate chunk name, or a manifest's name ({cname!r}): a chunk never "
                              "shares a name with a manifest in its version's directory")
        names.add(cname)
        chunks.append(ChunkEntry(cname, _int(c, "size", cw, lo=1, hi=MAX_CHUNK_BYTES),
                                 _str(c, "xxh3_128", cw, pattern=_HEX128)))

    blocks = []
    for i, b in enumerate(_list(obj, "blocks", where)):
        blocks.append(_parse_block(b, i, where, tensors, chunks, encodings))
        if rules is not None:
            rules.check_block(blocks[-1], tensors, where=f"{where}: blocks[{i}]")
    if encodings_of(blocks) != encodings:
        raise FormatError(f"{where}: 'encodings' lists {', '.join(encodings) or 'none'}, its blocks use "
                          f"{', '.join(encodings_of(blocks)) or 'none'}: they must be the same")
    _check_coverage(where, tensors, blocks)
    _check_tiling(where, chunks, blocks)
    changed = _int(obj, "changed_elements", where)
    return Manifest(version=version, kind=kind, base_version=base_version, base_model_digest=base_digest,
                    base_manifest_xxh3_128=base_mh, keyframe_version=keyframe_version,
                    step=_int(obj, "step", where, null=True),
                    created_unix_ms=_int(obj, "created_unix_ms", where),
                    model_digest=_str(obj, "model_digest", where, pattern=_HEX128),
                    tensors=tuple(tensors), chunks=tuple(chunks), blocks=tuple(blocks),
                    changed_elements=changed, base_manifest=base_manifest, files=tuple(files),
                    prev_manifest=prev, run_id=run_id, signature=signature,
                    signed_payload=payload, checkpoint_of=checkpoint_of)


def _parse_prev(p: Any, version: int, where: str, *, field_name: str = "prev_manifest") -> ManifestLink | None:
    """``prev_manifest``: absent or null (version 1, or a writer before the field), else
    ``{"version": version - 1, "manifest": name, "xxh3_128": hash}``."""
    if p is None:
        return None
    pw = f"{where}: {field_name}"
    if not isinstance(p, dict):
        raise FormatError(f"{pw} must be an object or null")
    pv = _int(p, "version", pw, lo=1)
    if pv != version - 1:
        raise FormatError(f"{pw} names version {pv}; it links version {version - 1}")
    try:
        name = check_manifest_name(p.get("manifest"))
    except UnsafeNameError as exc:
        raise FormatError(f"{pw}: field 'manifest' is invalid: {exc}") from None
    return ManifestLink(pv, name, _str(p, "xxh3_128", pw, pattern=_HEX128))


def _parts(t: dict, tw: str, name: str, numel: int) -> tuple[int, ...] | None:
    parts = t.get("parts")
    if parts is None:
        return None
    if (not isinstance(parts, list) or not 2 <= len(parts) <= MAX_PARTS
            or any(type(c) is not int or not 1 <= c <= MAX_TENSOR_ELEMENTS for c in parts)):
        raise FormatError(f"{tw} ({name}): 'parts' must be a list of 2 to {MAX_PARTS} element counts >= 1")
    if sum(parts) != numel:
        raise FormatError(f"{tw} ({name}): parts add up to {sum(parts)} elements, the tensor has {numel}")
    return tuple(parts)


def _parse_block(b: Any, i: int, where: str, tensors: list[TensorEntry], chunks: list[ChunkEntry],
                 encodings: tuple[str, ...]) -> BlockEntry:
    bw = f"{where}: blocks[{i}]"
    if not isinstance(b, dict):
        raise FormatError(f"{bw} must be an object")
    chunk = _int(b, "chunk", bw, hi=max(len(chunks) - 1, 0))
    if not chunks:
        raise FormatError(f"{bw}: names chunk {chunk} but the manifest has no chunks")
    offset = _int(b, "offset", bw, hi=MAX_CHUNK_BYTES)
    encoding = b.get("encoding")
    if encoding not in encodings:
        raise FormatError(f"{bw}: encoding {str(encoding)[:80]!r} is not one the manifest's 'encodings' lists")
    width = _int(b, "width", bw, lo=1, hi=8)
    if width not in (1, 2, 4, 8):
        raise FormatError(f"{bw}: width must be 1, 2, 4 or 8")
    streams = []
    for s in _list(b, "streams", bw):
        if (not isinstance(s, list) or len(s) != 3 or s[0] not in ("zstd", "raw")
                or any(type(x) is not int or x < 0 or x > MAX_CHUNK_BYTES for x in s[1:])):
            raise FormatError(f"{bw}: stream {s!r} must be [codec, stored, raw]")
        streams.append(StreamEntry(s[0], s[1], s[2]))
    segments = []
    for s in _list(b, "segments", bw):
        if (not isinstance(s, list) or len(s) != 4
                or any(type(x) is not int or x < 0 for x in s)):
            raise FormatError(f"{bw}: segment {s!r} must be [tensor, start, count, nnz]")
        t, start, count, nnz = s
        if t >= len(tensors):
            raise FormatError(f"{bw}: segment names tensor {t}, the manifest has {len(tensors)}")
        te = tensors[t]
        if count == 0 or count > MAX_SEGMENT_ELEMENTS or start + count > te.numel:
            raise FormatError(f"{bw}: segment [{start}, {start + count}) is empty, too long or outside "
                              f"{te.name} ({te.numel} elements)")
        if itemsize(te.dtype) != width:
            raise FormatError(f"{bw}: width {width} does not match {te.name} ({te.dtype})")
        segments.append(Segment(t, start, count, nnz))
    if not segments:
        raise FormatError(f"{bw}: a block has at least one segment")
    if not 1 <= len(streams) <= MAX_STREAMS:
        raise FormatError(f"{bw}: a block has 1 to {MAX_STREAMS} streams, got {len(streams)}")
    end = offset + sum(s.stored for s in streams)
    if end > chunks[chunk].size:
        raise FormatError(f"{bw}: bytes [{offset}, {end}) run past chunk {chunks[chunk].name} "
                          f"({chunks[chunk].size} bytes)")
    return BlockEntry(chunk, offset, encoding, width, tuple(streams), tuple(segments))


def _check_tiling(where: str, chunks: list[ChunkEntry], blocks: list[BlockEntry]) -> None:
    """The blocks of each chunk lie back to back from offset 0 to its end: no gaps, no overlap,
    no unreferenced bytes or chunks (so what is fetched is bounded by what is decoded)."""
    spans: dict[int, list[tuple[int, int]]] = {}
    for b in blocks:
        spans.setdefault(b.chunk, []).append((b.offset, b.offset + b.stored))
    for i, c in enumerate(chunks):
        pos = 0
        for a, e in sorted(spans.get(i, [])):
            if a != pos:
                raise FormatError(f"{where}: chunk {c.name} has a gap or overlap at byte {pos}")
            pos = e
        if pos != c.size:
            raise FormatError(f"{where}: blocks cover {pos} bytes of chunk {c.name} ({c.size} bytes): every "
                              "chunk byte belongs to exactly one block")


def _check_coverage(where: str, tensors: list[TensorEntry], blocks: list[BlockEntry]) -> None:
    spans: dict[int, list[tuple[int, int]]] = {}
    for b in blocks:
        for s in b.segments:
            spans.setdefault(s.tensor, []).append((s.start, s.start + s.count))
    for i, t in enumerate(tensors):
        ranges = sorted(spans.get(i, []))
        pos = 0
        for a, e in ranges:
            if a < pos:
                raise FormatError(f"{where}: segments of {t.name} overlap at element {a}")
            if t.init == INIT_NONE and a != pos:
                raise FormatError(f"{where}: {t.name} has a hole at elements [{pos}, {a})")
            pos = e
        if t.init == INIT_NONE and pos != t.numel:
            raise FormatError(f"{where}: {t.name} is covered up to element {pos} of {t.numel}")


# --- HEAD ------------------------------------------------------------------------------------
