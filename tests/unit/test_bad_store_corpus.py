"""A corpus of bad stores: each case damages a real store (written by the real Publisher) the way
a hostile or broken writer could, and must make ``sync()`` raise its own named error — the exact
class, with a message that names what was wrong — while the subscriber keeps serving the last
good version it holds (version, model digest and weights unchanged). Every case runs under
tracemalloc and a clock: a hostile store must not make a reader allocate or spin without bound.

Read it as a table: ``CASES`` maps a case name to the damage, the error class and a pattern its
message must match. ``tests/unit/test_bad_input.py`` holds the older, hand-picked cases; this file
does not repeat them.
"""

from __future__ import annotations

import json
import os
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import zstandard

from xcluster import CodecConfig, Publisher, PublisherConfig, Subscriber, SubscriberConfig
from xcluster.codec.encoding import core_names
from xcluster.read.chain import find_link, read_head
from xcluster.errors import (BaseMismatchError, ChainBrokenError, DecodeError,
                             DecompressionBombError, DigestMismatchError, FormatError, LegacyFormatError,
                             SchemaVersionError, UnknownEncodingError,
                             UnsafeNameError, XclusterError)
from xcluster.format import HEAD_KEY, MAX_MANIFEST_BYTES, MAX_VERSION, chunk_key, version_dir, xxh3_128
from xcluster.format.packing import pack, unpack
from xcluster.store import LocalStore
from tests.unit.helpers import assert_state_equal, follow_blocks, make_weights, memory_store
CORE_ENCODINGS = core_names()

MiB = 1 << 20
DEFAULT_MAX_MIB = 24   # a few MiB is what these tiny stores need; every bomb below aims at >= 256 MiB
DEFAULT_MAX_S = 10.0   # bounds against runaway behaviour, not a performance test


def weights(step: int) -> dict[str, torch.Tensor]:
    return {"b": torch.full((16,), float(step)), **make_weights(step, seed=7, cumulative=False, bump="step")}


# --- the store under attack ------------------------------------------------------------------
@dataclass
class Env:
    """A store with versions 1 (keyframe) … n (deltas), a subscriber that holds version 1, and
    the keys of the committed manifests (taken before any damage)."""

    store: Any
    pub: Publisher
    sub: Subscriber
    keys: dict[int, str]
    head_version: int

    def data(self, v: int) -> bytes:
        """The canonical JSON of version ``v``'s manifest (stored as one zstd frame)."""
        return unpack(self.store.get(self.keys[v]).data, where=self.keys[v])

    def obj(self, v: int) -> dict:
        return json.loads(self.data(v))

    def head(self) -> dict:
        return json.loads(self.store.get(HEAD_KEY).data)

    def put_head(self, head: dict | bytes) -> None:
        self.store.put(HEAD_KEY, head if isinstance(head, bytes) else encode(head))

    def put(self, v: int, manifest: dict | bytes, *, relink: bool = True) -> None:
        """Replace version ``v``'s manifest; with ``relink`` keep every link above it (the
        successors' ``base_manifest_xxh3_128`` and HEAD) consistent, as a writer with bucket
        access could: only the check under test stands between the damage and the reader."""
        data = manifest if isinstance(manifest, bytes) else encode(manifest)
        self.store.put(self.keys[v], pack(data))
        if not relink:
            return
        if v == self.head_version:
            self.put_head(dict(self.head(), manifest_xxh3_128=xxh3_128(data)))
        else:
            succ = self.obj(v + 1)
            succ["base_manifest_xxh3_128"] = xxh3_128(data)
            if isinstance(succ.get("prev_manifest"), dict):
                succ["prev_manifest"]["xxh3_128"] = xxh3_128(data)
            self.put(v + 1, succ)

    def edit(self, v: int, fn: Callable[[dict], Any]) -> None:
        o = self.obj(v)
        before = o.get("encodings")
        fn(o)
        follow_blocks(o, before)
        if isinstance(o, dict) and isinstance(o.get("prev_manifest"), dict) and o.get("kind") == "delta" \
                and o.get("base_version") == o.get("version", 0) - 1:
            # a delta's prev_manifest repeats its base link: keep them together, as a forger would
            o["prev_manifest"] = {"version": o["base_version"], "manifest": o.get("base_manifest"),
                                  "xxh3_128": o.get("base_manifest_xxh3_128")}
        self.put(v, o)

    def chunk(self, v: int, i: int = 0) -> str:
        return chunk_key(v, self.obj(v)["chunks"][i]["name"])


def encode(obj: Any) -> bytes:
    """Valid JSON, not necessarily canonical (readers accept any JSON; NaN stays as written, and is refused)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def build_env(store, *, versions: int = 3, config: SubscriberConfig | None = None) -> Env:
    # the core encodings: the cases edit their streams by hand (sparse-exp2: test_fuzz.py, test_roundtrip.py)
    pub = Publisher(store=store, config=PublisherConfig(keyframe_every=100, checkpoint_chain_fraction=None,
                                                        codec=CodecConfig(encodings=CORE_ENCODINGS)))
    sub = Subscriber(store=store, config=config)
    pub.publish(weights(0))
    assert sub.sync() == 1
    for step in range(1, versions):
        pub.publish(weights(step))
    head, _ = read_head(store)
    assert head is not None and head.version == versions
    keys = {v: find_link(store, head, v).key for v in range(1, versions + 1)}
    return Env(store, pub, sub, keys, versions)


# --- building blocks of the damage --------------------------------------------------------------
def set_at(path: tuple, value: Any) -> Callable[[dict], None]:
    """A mutation that sets ``o[path[0]][path[1]]… = value`` (on the manifest of the version)."""
    def mutate(o: dict) -> None:
        for k in path[:-1]:
            o = o[k]
        o[path[-1]] = value
    return mutate


def delete(key: str) -> Callable[[dict], None]:
    return lambda o: o.pop(key)


def edit(v: int, fn: Callable[[dict], Any]) -> Callable[[Env], None]:
    return lambda e: e.edit(v, fn)


def edit_head(**fields) -> Callable[[Env], None]:
    return lambda e: e.put_head(dict(e.head(), **fields))


def put_raw(v: int, data: Callable[[bytes], bytes]) -> Callable[[Env], None]:
    return lambda e: e.put(v, data(e.data(v)))


def splice(v: int, key: str, fragment: str) -> Callable[[Env], None]:
    def damage(e: Env) -> None:
        o = e.obj(v)
        o[key] = "@@SPLICE@@"
        e.put(v, encode(o).replace(b'"@@SPLICE@@"', fragment.encode()))
    return damage


def add_tensor(o: dict, name: str, dtype: str, shape: list[int], init: str = "none") -> int:
    o["tensors"].append({"name": name, "dtype": dtype, "shape": shape, "digest": "0" * 32, "init": init})
    return len(o["tensors"]) - 1


def tensor_index(o: dict, name: str) -> int:
    return [t["name"] for t in o["tensors"]].index(name)


def replace_payload(e: Env, v: int, blocks: list[dict], payload: bytes, *, tensors_fn=None) -> None:
    """Make ``blocks`` the only blocks of version ``v``, stored in one new chunk ``payload``."""
    name = f"cevil-{len(payload):06d}.xc"
    e.store.put(chunk_key(v, name), payload)

    def mutate(o: dict) -> None:
        if tensors_fn is not None:
            tensors_fn(o)
        o["chunks"] = [{"name": name, "size": len(payload), "xxh3_128": xxh3_128(payload)}]
        o["blocks"] = blocks
    e.edit(v, mutate)


def zstd_frame_with_content_size(frame: bytes, declared: int) -> bytes:
    """``frame`` with the Frame_Content_Size field of its header rewritten (RFC 8878 §3.1.1.1)."""
    fhd = frame[4]
    fcs_size = [1 if fhd & 0x20 else 0, 2, 4, 8][fhd >> 6]
    off = 5 + (0 if fhd & 0x20 else 1) + [0, 1, 2, 4][fhd & 3]
    assert fcs_size in (4, 8), "use a frame big enough for a 4- or 8-byte content size field"
    return frame[:off] + declared.to_bytes(fcs_size, "little") + frame[off + fcs_size:]


def dense_b_block(streams: list[list], segments_of_b: int = 16) -> Callable[[Env], None]:
    """Version 2 becomes one dense-sub block over tensor ``b`` (16 float32: width 4), with the
    given ``[codec, payload]`` streams laid back to back in one chunk."""
    def damage(e: Env) -> None:
        o = e.obj(2)
        bi = tensor_index(o, "b")
        payload = b"".join(p for _, p in streams)
        blocks = [{"chunk": 0, "offset": 0, "encoding": "dense-sub", "width": 4,
                   "streams": [[codec, len(p), raw] for (codec, p), raw in
                               zip(streams, [segments_of_b] * len(streams))],
                   "segments": [[bi, 0, segments_of_b, segments_of_b]]}]
        replace_payload(e, 2, blocks, payload)
    return damage


def zeros_stream(n: int = 16) -> list:
    return ["raw", b"\0" * n]


# --- damages that need more than one line ---------------------------------------------------------
def huge_manifest_object(e: Env) -> None:
    """A 4 GiB manifest object (a sparse file): a reader that read it whole would allocate 4 GiB.
    HEAD names the hash of the 64 MiB + 1 bytes a bounded reader fetches, so the size cap (not
    the hash) is what refuses it."""
    path = os.path.join(e.store.root, e.keys[3])
    with open(path, "r+b") as f:
        f.truncate(4 << 30)
    with open(path, "rb") as f:
        first = f.read(MAX_MANIFEST_BYTES + 1)
    e.put_head(dict(e.head(), manifest_xxh3_128=xxh3_128(first)))


def huge_head(e: Env) -> None:
    raw = encode(e.head())
    e.put_head(raw[:-1] + b" " * (64 << 10) + b"}")  # valid JSON, over HEAD's 64 KiB cap


def relabel_0x(e: Env) -> None:
    """Version 3 relabelled as a 0.x store's manifest (schema_version 7 instead of format_version)."""
    e.edit(3, lambda o: (o.pop("format_version"), o.__setitem__("schema_version", 7)))


def head_names_other_version(e: Env) -> None:
    """HEAD says version 5 and names a manifest there that holds version 3's bytes."""
    data = e.data(3)
    e.store.put(f"{version_dir(5)}/manifest-copy.json.zst", pack(data))
    e.put_head(dict(e.head(), version=5, manifest="manifest-copy.json.zst", manifest_xxh3_128=xxh3_128(data)))


def delete_manifest(v: int) -> Callable[[Env], None]:
    return lambda e: e.store.delete(e.keys[v])


def cycle_back_to_head(e: Env) -> None:
    """Version 3's base link is bent back to a copy of version 3 itself (a loop in the chain; the
    hash in the link matches the copy, so only the version check can stop the walk)."""
    copy = e.data(3)
    e.store.put(f"{version_dir(2)}/manifest-loop.json.zst", pack(copy))
    e.edit(3, lambda o: o.update(base_manifest="manifest-loop.json.zst", base_manifest_xxh3_128=xxh3_128(copy)))


ZZ = 1 << 16  # elements of the new uint8 tensor the zstd cases fill: a 64 KiB stream


def zz_stream(codec: str, payload: bytes) -> Callable[[Env], None]:
    """Version 2 becomes one planes block filling a new uint8 tensor ``zz`` of ZZ elements from a
    single stream ``[codec, payload]`` (declared raw: ZZ bytes, as dtype x shape says)."""
    def damage(e: Env) -> None:
        blocks = [{"chunk": 0, "offset": 0, "encoding": "planes", "width": 1,
                   "streams": [[codec, len(payload), ZZ]], "segments": [[2, 0, ZZ, ZZ]]}]
        replace_payload(e, 2, blocks, payload, tensors_fn=lambda o: add_tensor(o, "zz", "uint8", [ZZ]))
    return damage


def frame_inflating_past_declared(e: Env) -> None:
    """A frame whose header declares the 64 KiB the manifest expects but whose data inflates to
    256 MiB: a reader trusting the header with an unbounded decoder would allocate 256 MiB."""
    frame = zstandard.ZstdCompressor(level=1).compress(b"\0" * (256 * MiB))
    zz_stream("zstd", zstd_frame_with_content_size(frame, ZZ))(e)


def frame_declaring_more(e: Env) -> None:
    """An honest frame of 256 MiB of zeros (8 KiB compressed) where 64 KiB are declared."""
    zz_stream("zstd", zstandard.ZstdCompressor(level=1).compress(b"\0" * (256 * MiB)))(e)


def frame_without_content_size(e: Env) -> None:
    zz_stream("zstd", zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * ZZ))(e)


def two_frames(e: Env) -> None:
    frame = zstandard.ZstdCompressor().compress(b"\0" * ZZ)
    zz_stream("zstd", frame + frame)(e)


def garbage_frame(e: Env) -> None:
    zz_stream("zstd", b"\x28\xb5\x2f\xfd" + b"\xff" * 12)(e)


def truncated_frame(e: Env) -> None:
    frame = zstandard.ZstdCompressor().compress(bytes(range(256)) * (ZZ // 256))
    zz_stream("zstd", frame[:-8])(e)


def raw_stream_short(e: Env) -> None:
    zz_stream("raw", b"\0" * (ZZ - 1))(e)


def many_tiny_blocks_first_broken(e: Env, n: int = 8_000) -> None:
    """~0.8 MiB of manifest: n blocks of one element each; the first holds the
    chunk's one byte, every other one a zstd stream of 0 bytes (broken). A reader must stop at
    the first broken block, not decode (and keep the errors of) all of them."""
    blocks = [{"chunk": 0, "offset": 1, "encoding": "planes", "width": 1, "streams": [["zstd", 0, 1]],
               "segments": [[2, i, 1, 1]]} for i in range(n)]
    blocks[0].update(offset=0, streams=[["raw", 1, 1]])
    replace_payload(e, 2, blocks, b"\0", tensors_fn=lambda o: add_tensor(o, "zz_tiny", "uint8", [n]))


def many_tiny_segments(e: Env, n: int = 25_000) -> None:
    """One block of n one-element planes segments (~0.35 MiB of manifest) that all decode, then
    a digest that lies: the reader does all the work and must still stay within its bounds."""
    def tensors(o: dict) -> None:
        add_tensor(o, "zz_tiny", "uint8", [n])
    blocks = [{"chunk": 0, "offset": 0, "encoding": "planes", "width": 1, "streams": [["raw", n, n]],
               "segments": [[2, i, 1, 1] for i in range(n)]}]
    replace_payload(e, 2, blocks, bytes(range(256)) * (n // 256) + bytes(n % 256), tensors_fn=tensors)


def many_tiny_tensors(e: Env, n: int = 5_000) -> None:
    """n one-element tensors (~0.5 MiB of manifest), each filled by its own segment, digests lying."""
    def tensors(o: dict) -> None:
        for i in range(n):
            add_tensor(o, f"zz.{i:06d}", "uint8", [1])
    blocks = [{"chunk": 0, "offset": 0, "encoding": "planes", "width": 1, "streams": [["raw", n, n]],
               "segments": [[2 + i, 0, 1, 1] for i in range(n)]}]
    replace_payload(e, 2, blocks, b"\1" * n, tensors_fn=tensors)


def zero_element_tensor_with_huge_dims(e: Env) -> None:
    e.edit(2, lambda o: add_tensor(o, "zz_empty", "uint8", [0, 1 << 40, 1 << 30]))


# --- the table ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    name: str
    damage: Callable[[Env], None]
    error: type[XclusterError]
    match: str
    max_mib: float = DEFAULT_MAX_MIB
    max_s: float = DEFAULT_MAX_S
    store: str = "memory"
    versions: int = 3
    config: SubscriberConfig | None = None
    max_manifest_reads: int | None = None
    """At most this many manifest reads (a bounded walk)."""
    marks: tuple = field(default=())


def C(name, damage, error, match, **kw) -> Any:
    case = Case(name, damage, error, match, **kw)
    return pytest.param(case, id=name, marks=case.marks)


LONG = "x" * 600
CASES = [
    # malformed or truncated manifests (HEAD's hash follows each damage)
    C("manifest_truncated", put_raw(3, lambda d: d[: len(d) // 2]), FormatError, "not valid JSON"),
    C("manifest_empty", put_raw(3, lambda d: b""), FormatError, "not valid JSON"),
    C("manifest_trailing_garbage", put_raw(3, lambda d: d + b"\0{}"), FormatError, "not valid JSON"),
    C("manifest_null", put_raw(3, lambda d: b"null"), FormatError, "top level must be a JSON object"),
    C("manifest_missing_tensors", edit(3, delete("tensors")), FormatError, "'tensors' must be a list"),
    C("manifest_blocks_not_a_list", edit(3, set_at(("blocks",), {})), FormatError, "'blocks' must be a list"),
    C("manifest_version_is_bool", edit(3, set_at(("version",), True)), FormatError, "'version' must be an integer"),
    C("manifest_time_is_float", edit(3, set_at(("created_unix_ms",), 1.0)), FormatError, "'created_unix_ms'"),
    C("manifest_step_is_nan", edit(3, set_at(("step",), float("nan"))), FormatError, "NaN is not a JSON value"),
    C("manifest_int_of_5000_digits", splice(3, "step", "9" * 5000), FormatError, "not valid JSON"),
    C("manifest_deeply_nested_field", splice(3, "step", "[" * 200_000 + "]" * 200_000), FormatError,
      "not valid JSON"),
    C("manifest_object_of_4GiB", huge_manifest_object, FormatError, "over the 67108864-byte limit",
      store="local", max_mib=160),  # one bounded read of 64 MiB + 1 bytes, not 4 GiB
    C("manifest_unknown_format", edit(3, set_at(("format",), "xcluster-head")), FormatError, "'format' must be"),
    # format versions and encodings
    C("manifest_format_2", edit(3, set_at(("format_version",), 2)), SchemaVersionError, "format_version 2"),
    C("manifest_format_true", edit(3, set_at(("format_version",), True)), SchemaVersionError,
      "format_version True"),
    C("manifest_format_missing", edit(3, delete("format_version")), SchemaVersionError, "format_version None"),
    C("manifest_format_1_0", splice(3, "format_version", "1.0"), SchemaVersionError, "format_version 1.0"),
    C("manifest_written_by_0x", relabel_0x, LegacyFormatError, r"written by xcluster 0\.x \(schema_version 7\)"),
    C("manifest_unknown_encoding", edit(3, set_at(("encodings",), ["sparse-sub", "sparse-zz9"])),
      UnknownEncodingError, "uses encoding 'sparse-zz9'"),
    C("manifest_encodings_unsorted", edit(3, set_at(("encodings",), ["sparse-sub", "planes"])), FormatError,
      "sorted list of distinct"),
    C("manifest_encodings_missing", edit(3, delete("encodings")), FormatError, "'encodings' must be"),
    C("head_format_4", edit_head(format_version=4), SchemaVersionError, "HEAD: format_version 4"),
    C("head_written_by_0x", edit_head(schema_version=3, format_version=None), LegacyFormatError,
      "HEAD: written by xcluster 0.x"),
    C("head_truncated", lambda e: e.put_head(e.store.get(HEAD_KEY).data[:40]), FormatError, "not valid JSON"),
    C("head_over_64KiB", huge_head, FormatError, "over the 65536-byte limit"),
    C("head_wrong_format", edit_head(format="xcluster-manifest"), FormatError, "'format' must be"),
    # names that would escape the prefix
    *[C(f"tensor_name_{label}", edit(3, set_at(("tensors", 1, "name"), name)), UnsafeNameError,
        "tensor name .* is not allowed")
      for label, name in [("dotdot", "w..x"), ("slash", "a/w"), ("nul", "w\0"), ("absolute", "/w"),
                          ("long", LONG), ("empty", ""), ("newline", "w\n"), ("dot_first", ".w"),
                          ("fullwidth", "\uff57"), ("not_a_string", 7)]],
    *[C(f"chunk_name_{label}", edit(3, set_at(("chunks", 0, "name"), name)), UnsafeNameError,
        "chunk name .* is not allowed")
      for label, name in [("dotdot", "c..xc"), ("parent", ".."), ("slash", "c/../../HEAD"), ("nul", "c\0.xc"),
                          ("absolute", "/c.xc"), ("long", "c" * 101), ("upper", "C.xc"), ("empty", "")]],
    C("chunk_name_manifest_json", edit(3, set_at(("chunks", 0, "name"), "manifest-a.json.zst")), FormatError,
      "a manifest.s name"),
    C("base_manifest_escapes", edit(3, set_at(("base_manifest",), "../000000000001/manifest-a.json.zst")),
      FormatError, "'base_manifest' is invalid"),
    C("head_manifest_escapes", edit_head(manifest="../../HEAD"), FormatError, "'manifest' is invalid"),
    C("head_manifest_absolute", edit_head(manifest="/etc/passwd"), FormatError, "'manifest' is invalid"),
    C("file_name_escapes", edit(3, set_at(("files",), [{"name": "../config.json", "size": 1,
                                                          "xxh3_128": "0" * 32}])),
      UnsafeNameError, "file name .* is not allowed"),
    C("file_name_is_a_weight_file", edit(3, set_at(("files",), [{"name": "model.safetensors", "size": 1,
                                                                   "xxh3_128": "0" * 32}])),
      UnsafeNameError, "weight file"),
    # issue 31 item 4: a name the model directory writer refuses is refused at parse (one rule)
    C("file_name_is_an_adapter_weight_file", edit(3, set_at(("files",), [
        {"name": "adapter_model.safetensors", "size": 1, "xxh3_128": "0" * 32}])), UnsafeNameError, "weight file"),
    C("file_name_is_a_weight_index", edit(3, set_at(("files",), [
        {"name": "adapter_model.safetensors.index.json", "size": 1, "xxh3_128": "0" * 32}])),
      UnsafeNameError, "weight file"),
    # issue 31 item 3: one 256 MiB object listed under 5 names is 1.25 GiB to write: refused before any fetch
    C("files_total_over_limit", edit(3, set_at(("files",), [
        {"name": f"f{i}.json", "size": 256 << 20, "xxh3_128": "0" * 32} for i in range(5)])),
      FormatError, "files add up to 1342177280 bytes, over the limit"),
    # shapes whose product overflows (or that are not shapes)
    C("shape_product_2_64", edit(3, set_at(("tensors", 1, "shape"), [1 << 32, 1 << 32])), FormatError,
      "is over the limit"),
    C("shape_32_max_dims", edit(3, set_at(("tensors", 1, "shape"), [MAX_VERSION] * 32)), FormatError,
      "is over the limit"),
    C("shape_33_dims", edit(3, set_at(("tensors", 1, "shape"), [1] * 33)), FormatError, "at most 32"),
    C("shape_dim_over_2_53", edit(3, set_at(("tensors", 1, "shape"), [1 << 53])), FormatError,
      "non-negative integers"),
    C("shape_dim_is_bool", edit(3, set_at(("tensors", 1, "shape"), [True, 4096])), FormatError,
      "non-negative integers"),
    C("shape_dim_is_float", edit(3, set_at(("tensors", 1, "shape"), [64.0, 64])), FormatError,
      "non-negative integers"),
    C("shape_zero_elements_huge_dims", zero_element_tensor_with_huge_dims, FormatError, "zz_empty"),
    # declared sizes that disagree with dtype x shape
    C("stream_raw_smaller_than_segments", edit(3, lambda o: o["blocks"][0]["streams"][0].__setitem__(
        2, o["blocks"][0]["streams"][0][2] - 1)), FormatError, "its segments need"),
    C("width_not_the_dtype's", edit(3, lambda o: o["blocks"][1].__setitem__("width", 4)), FormatError,
      "does not match"),
    C("width_3", edit(3, lambda o: o["blocks"][1].__setitem__("width", 3)), FormatError, "width must be"),
    C("sparse_nnz_over_count", edit(3, lambda o: [s.__setitem__(3, s[2] + 1) for b in o["blocks"]
                                                   if b["encoding"] == "sparse-sub" for s in b["segments"]]),
      FormatError, "nnz .* outside"),
    C("segment_past_tensor_end", edit(3, lambda o: o["blocks"][0]["segments"][0].__setitem__(1, 1 << 40)),
      FormatError, "outside"),
    C("dtype_changed_same_width", edit(2, set_at(("tensors", 1, "dtype"), "float16")), BaseMismatchError,
      "w is carried over from the base"),
    C("shape_changed_same_numel", edit(2, set_at(("tensors", 1, "shape"), [4096])), BaseMismatchError,
      "w is carried over from the base"),
    C("raw_stream_stored_ne_raw", dense_b_block([["raw", b"\0" * 15]] + [zeros_stream()] * 3), FormatError,
      "raw stream 0 stores 15 bytes for 16"),
    C("zstd_stream_stored_over_raw", dense_b_block([["zstd", b"\0" * 20]] + [zeros_stream()] * 3),
      FormatError, "stores 20 bytes for 16"),
    C("too_few_streams", dense_b_block([zeros_stream()] * 3), FormatError, "has 4 streams, got 3"),
    # decompression bombs
    C("zstd_frame_inflates_past_declared", frame_inflating_past_declared, DecompressionBombError,
      "stream 0.*inflates past"),
    C("zstd_frame_declares_more", frame_declaring_more, DecompressionBombError,
      "frame declares 268435456 bytes, manifest says 65536"),
    C("zstd_frame_without_content_size", frame_without_content_size, DecodeError, "without a content size"),
    C("zstd_two_frames", two_frames, DecodeError, "unused data"),
    C("zstd_garbage", garbage_frame, DecodeError, "stream 0: not a zstd frame"),
    C("zstd_truncated_frame", truncated_frame, DecodeError, "stream 0: corrupt zstd frame"),
    C("raw_stream_shorter_than_declared", raw_stream_short, FormatError, "raw stream 0 stores 65535 bytes for 65536"),
    # duplicates
    C("duplicate_tensor_name", edit(3, lambda o: o["tensors"].append(dict(o["tensors"][0]))), FormatError,
      "duplicate tensor name 'b'"),
    C("duplicate_chunk_name", edit(3, lambda o: o["chunks"].append(dict(o["chunks"][0]))), FormatError,
      "duplicate chunk name"),
    C("duplicate_file_name", edit(3, set_at(("files",), [{"name": "config.json", "size": 1,
                                                          "xxh3_128": "0" * 32}] * 2)),
      FormatError, "duplicate file name"),
    # version gaps and chains that do not hold together
    C("head_names_missing_manifest", edit_head(manifest="manifest-gone.json.zst"), ChainBrokenError, "missing"),
    C("head_version_gap", edit_head(version=7), ChainBrokenError, "missing"),
    C("head_names_another_version", head_names_other_version, FormatError, "says it is version 3"),
    C("chain_gap_missing_base", delete_manifest(2), ChainBrokenError, "missing"),
    C("delta_skips_a_version", edit(3, set_at(("base_version",), 1)), FormatError, "base_version = version - 1"),
    C("delta_on_itself", edit(3, set_at(("base_version",), 3)), FormatError, "base_version = version - 1"),
    C("delta_on_a_later_version", edit(3, set_at(("base_version",), 4)), FormatError,
      "base_version = version - 1"),
    C("chain_cycle_back_to_head", cycle_back_to_head, FormatError, "manifest-loop.json.zst says it is version 3"),
    # keyframe_version that lies
    C("head_keyframe_version_above_version", edit_head(keyframe_version=4), FormatError,
      "keyframe_version 4 > version 3"),
    C("head_keyframe_version_lies", edit_head(keyframe_version=3), ChainBrokenError,
      "HEAD says version 3 is a delta of keyframe_version 3, its manifest says delta of 1"),
    C("head_kind_lies", edit_head(kind="keyframe", keyframe_version=3), ChainBrokenError,
      "HEAD says version 3 is a keyframe of keyframe_version 3, its manifest says delta of 1"),
    C("manifest_keyframe_version_lies", edit(3, set_at(("keyframe_version",), 2)), ChainBrokenError,
      "HEAD says version 3 is a delta of keyframe_version 1, its manifest says delta of 2"),
    C("head_and_manifest_keyframe_version_lie", lambda e: (edit(3, set_at(("keyframe_version",), 2))(e),
                                                           edit_head(keyframe_version=2)(e)), ChainBrokenError,
      "keyframe_version 2 differs from its base's"),
    C("delta_keyframe_version_above_base", edit(3, set_at(("keyframe_version",), 3)), FormatError,
      "keyframe_version must be <= base_version"),
    C("keyframe_that_claims_a_base", edit(1, set_at(("base_version",), 1)), FormatError,
      "a keyframe has no base"),
    # HEAD far ahead: no huge walk
    C("head_far_ahead_past_max_chain", edit_head(version=MAX_VERSION, keyframe_version=MAX_VERSION - 10**6),
      ChainBrokenError, "missing", max_manifest_reads=2),
    C("head_far_ahead_lying_keyframe", edit_head(version=10**12, keyframe_version=10**12), ChainBrokenError,
      "missing", max_manifest_reads=1),
    C("head_far_ahead_of_held", edit_head(version=10**12, keyframe_version=1), ChainBrokenError, "missing",
      max_manifest_reads=1),
    C("head_version_over_2_53", edit_head(version=MAX_VERSION + 1), FormatError, "'version'",
      max_manifest_reads=0),
    C("chain_longer_than_max_chain", lambda e: None, ChainBrokenError, "more than 4 versions",
      versions=9, config=SubscriberConfig(max_chain=4), max_manifest_reads=4),
    # manifests built to burn CPU or memory (scaled down from the 64 MiB cap; see each docstring)
    C("many_tiny_blocks_first_broken", many_tiny_blocks_first_broken, DecodeError, "not a zstd frame",
      ),
    C("many_tiny_segments_digest_lies", many_tiny_segments, DigestMismatchError, "hashes to .* the manifest says"),
    C("many_tiny_tensors_digest_lies", many_tiny_tensors, DigestMismatchError, "hashes to .* the manifest says"),
]


def count_manifest_reads(store) -> list[str]:
    reads: list[str] = []
    real = store.get_range

    def spy(key, start, length):
        if "/manifest" in key:
            reads.append(key)
        return real(key, start, length)
    store.get_range = spy
    return reads


@pytest.mark.parametrize("case", CASES)
def test_bad_store(case: Case, tmp_path):
    store = LocalStore(tmp_path / "store") if case.store == "local" else memory_store()
    env = build_env(store, versions=case.versions, config=case.config)
    sub = env.sub
    before = (sub.version, sub.model_digest, sub.snapshot().state)
    case.damage(env)
    reads = count_manifest_reads(store)
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(XclusterError) as ei:
            sub.sync()
        seconds = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert type(ei.value) is case.error, f"{case.name}: {type(ei.value).__name__}: {ei.value}"
    ei.match(case.match)
    assert peak < case.max_mib * MiB, f"{case.name}: peak {peak / MiB:.1f} MiB"
    assert seconds < case.max_s, f"{case.name}: {seconds:.1f} s"
    if case.max_manifest_reads is not None:
        assert len(reads) <= case.max_manifest_reads, reads
    # the subscriber still serves its last good weights
    assert (sub.version, sub.model_digest) == before[:2] == (1, before[1])
    assert_state_equal(sub.state_dict(), before[2])
    assert_state_equal(sub.state_dict(), weights(0))


def test_corpus_store_is_good_before_damage(tmp_path):
    """The stores the corpus damages are good: undamaged, every subscriber reaches HEAD."""
    for store in (memory_store(), LocalStore(tmp_path / "s")):
        env = build_env(store)
        assert env.sub.sync() == 3
        assert_state_equal(env.sub.state_dict(), weights(2))


def test_keyframe_version_that_lies_about_the_held_base(tmp_path):
    """The walk stops at the version held; the first delta past it must still name the held
    version's keyframe."""
    env = build_env(memory_store())
    sub = env.sub
    assert sub.sync(until=2) == 2
    before = (sub.version, sub.model_digest, sub.snapshot().state)
    env.edit(3, set_at(("keyframe_version",), 2))
    edit_head(keyframe_version=2)(env)  # HEAD tells the same lie
    with pytest.raises(ChainBrokenError, match="keyframe_version 2 differs from its base's .*version 2, "
                                               "keyframe_version 1"):
        sub.sync()
    assert (sub.version, sub.model_digest) == before[:2]
    assert_state_equal(sub.state_dict(), before[2])


def test_a_chunk_named_like_a_manifest_is_refused(tmp_path):
    """A chunk object ``manifest-x.json.zst`` would share the directory namespace with manifests
    (retention and ``xcluster ls`` would take it for one)."""
    from xcluster import Publisher
    from xcluster.format import parse_manifest
    from xcluster.store import LocalStore

    store = LocalStore(tmp_path)
    Publisher(store=store).publish({"w": torch.zeros(4)})
    key = next(k for k in store.list("versions/") if "manifest" in k)
    obj = json.loads(unpack(store.get(key).data, where=key))
    obj["chunks"][0]["name"] = "manifest-x.json.zst"
    with pytest.raises(FormatError, match="a manifest's name"):
        parse_manifest(encode(obj))
