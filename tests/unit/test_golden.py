"""Golden bytes of format 1: a fixed input produces these exact objects forever (or the format
changes: FORMAT.md §8), and the checked-in objects stay readable. Stores written before 1.0 are
refused by name."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from xcluster import Publisher, PublisherConfig, Subscriber, SubscriberConfig, model_digest
from xcluster.errors import LegacyFormatError
from xcluster.format.packing import unpack
from xcluster.store import LocalStore
from tests.unit.helpers import assert_state_equal

GOLDEN = Path(__file__).parent.parent / "golden" / "format1"
BASIC = GOLDEN / "basic" / "store"
"""Every kind of tensor (bf16, f32 with inf/NaN/-0.0, int64, bool, a new fp16 tensor, a reshape),
a non-weight file, a keyframe at version 3 linked by prev_manifest; signed."""
EXP = GOLDEN / "exp" / "store"
"""bf16, fp16, fp32 and fp8 weights moved as an optimizer step moves them: a full-exp keyframe
(bf16) and sparse-exp2 deltas for every dtype with exponent groups; signed."""
GOLDEN_KEY = Path(__file__).parent.parent / "golden" / "signing-key.pem"
"""A published test key (never use it for anything else): Ed25519 signatures are deterministic,
so the signed golden objects pin the signature bytes too."""
TRUST = (str(GOLDEN_KEY) + ".pub",)
OLD_HEAD = (b'{"committed_unix_ms":1700000000000,"format":"xcluster-head","keyframe_version":1,"kind":"delta",'
            b'"manifest":"manifest-00000000.json.zst","manifest_xxh3_128":"e380eb316bbc6ddf1a18b7a433cabdce",'
            b'"run_id":"golden","schema_version":3,"version":3}')
"""HEAD as xcluster 0.2 wrote it (its golden store of schema 7, signature left out)."""


def golden_versions() -> list[dict[str, torch.Tensor]]:
    w = torch.arange(-600, 600, dtype=torch.float32).reshape(40, 30).div(1000).to(torch.bfloat16)
    v1 = {"w": w, "scale": torch.tensor([1.0, -0.0, float("inf"), float("nan")]),
          "ids": torch.arange(10, dtype=torch.int64), "mask": torch.tensor([True, False, True])}
    w2 = w.clone()
    w2.view(torch.int16).reshape(-1)[::37] += 1  # sparse +1 ulp
    w2.view(torch.int16).reshape(-1)[5::101] -= 1  # and -1 ulp
    v2 = {"w": w2, "scale": v1["scale"], "ids": torch.arange(10, dtype=torch.int64).reshape(2, 5),
          "new": torch.full((3,), 0.5, dtype=torch.float16)}
    v3 = dict(v2, scale=torch.tensor([2.0, 0.0, float("-inf"), 1.0]))
    return [v1, v2, v3]


def _publisher(root: Path, **kw) -> Publisher:
    return Publisher(store=LocalStore(root, fsync=False),
                     config=PublisherConfig(keyframe_every=100, run_id="golden", signing_key=str(GOLDEN_KEY),
                                            codec=_codec()),
                     clock=lambda: 1_700_000_000.0, attempt_id=lambda: "00000000", **kw)


def _codec():
    from xcluster import CodecConfig

    return CodecConfig(block_bytes=4096, chunk_bytes=4096)  # the default encodings; many blocks and chunks


def write_basic(root: Path) -> None:
    pub = _publisher(root, files={"config.json": b'{"model_type": "golden"}\n'})
    for i, sd in enumerate(golden_versions()):
        pub.publish(sd, step=i, keyframe=True if i == 2 else None)  # v3: a keyframe, linked by prev_manifest


def _bits(n: int, seed: int) -> list[int]:
    """A fixed pseudo-random sequence (a 32-bit LCG), the same on every platform and torch."""
    out, x = [], seed
    for _ in range(n):
        x = (x * 1664525 + 1013904223) % (1 << 32)
        out.append(x)
    return out


def golden_versions_v4() -> list[dict[str, torch.Tensor]]:
    """bf16, fp16, fp32 and fp8 weights of many exponents; each step moves elements by ±1 ulp
    (and a few by more) with a probability that doubles per exponent step down, as an optimizer
    step does: the sparse-exp workload."""
    def weights(dtype: torch.dtype, width: int, exp_shift: int, exp_lo: int, exp_n: int, n: int, seed: int):
        r = _bits(n, seed)
        raw = [((x >> 31) << (8 * width - 1)) | ((exp_lo + (x >> 8) % exp_n) << exp_shift)
               | (x & ((1 << exp_shift) - 1)) for x in r]
        return torch.tensor(raw, dtype=torch.int64).to(torch.int32 if width == 4 else torch.int16 if width == 2
                                                       else torch.uint8).view(dtype)

    def step(t: torch.Tensor, width: int, exp_shift: int, exp_hi: int, seed: int) -> torch.Tensor:
        new = t.clone()
        bits = new.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[width]).reshape(-1)
        for i, x in enumerate(_bits(bits.numel(), seed)):
            e = (int(bits[i]) & ((1 << (8 * width - 1)) - 1)) >> exp_shift
            if x % 4096 < 4096 >> max(0, min(12, exp_hi - e)):
                bits[i] += 1 if x & 1 else -1
                if x % 97 == 0:
                    bits[i] += 3
        return new

    specs = {"bf": (torch.bfloat16, 2, 7, 110, 12, 3000), "h": (torch.float16, 2, 10, 3, 10, 900),
             "f": (torch.float32, 4, 23, 110, 12, 1500), "q": (torch.float8_e4m3fn, 1, 3, 1, 6, 600)}
    v1 = {k: weights(dt, w, sh, lo, n_e, n, seed=i + 1) for i, (k, (dt, w, sh, lo, n_e, n)) in enumerate(specs.items())}
    versions = [v1]
    for s in (1, 2):
        versions.append({k: step(versions[-1][k], w, sh, lo + n_e, seed=100 * s + i)
                         for i, (k, (dt, w, sh, lo, n_e, n)) in enumerate(specs.items())})
    return versions


def golden_versions_v6() -> list[dict[str, torch.Tensor]]:
    """The v4 versions plus ``g``, bf16 weights whose exponents fall off geometrically below 120 (as
    real weights' do), so full-exp beats byte planes on it; it does not change."""
    # the high bits of two LCG sequences (an LCG's low bits have short periods, which zstd would find)
    ys = [(b >> 12) | 1 << 20 for b in _bits(2048, seed=61)]
    raw = [((a >> 31) << 15) | ((121 - (y & -y).bit_length()) << 7) | ((a >> 24) & 127)
           for a, y in zip(_bits(2048, seed=60), ys)]
    g = torch.tensor(raw, dtype=torch.int64).to(torch.int16).view(torch.bfloat16)
    return [dict(v, g=g, e=e) for v, e in zip(golden_versions_v4(), golden_table())]


def golden_table() -> list[torch.Tensor]:
    """``e``, a bf16 table of 120 rows of 40 whose steps change a few rows (as a batch changes an
    embedding's): sparse-rows. Its first range (4096 elements) ends inside row 102, which both
    steps change, so the second range starts inside a row."""
    ys = [(b >> 12) | 1 << 20 for b in _bits(4800, seed=71)]  # exponents as g's: full-exp in the keyframe
    raw = [((a >> 31) << 15) | ((121 - (y & -y).bit_length()) << 7) | ((a >> 24) & 127)
           for a, y in zip(_bits(4800, seed=70), ys)]
    e = torch.tensor(raw, dtype=torch.int64).to(torch.int16).view(torch.bfloat16).reshape(120, 40)
    out = [e]
    for rows in ((3, 50, 102, 110), (7, 102, 103, 110)):
        e = e.clone()
        bits = e.view(torch.int16).reshape(-1)
        for r in rows:
            for c in range(1, 40, 2):
                bits[r * 40 + c] += 1 if (r + c) % 2 else -1
        out.append(e)
    return out


def write_exp(root: Path) -> None:
    pub = _publisher(root)
    for i, sd in enumerate(golden_versions_v6()):
        pub.publish(sd, step=i)


def files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.name.startswith(".")}


@pytest.mark.parametrize("writer, golden", [(write_basic, BASIC), (write_exp, EXP)], ids=["basic", "exp"])
def test_writer_produces_the_golden_bytes(tmp_path, writer, golden):
    if os.environ.get("XCLUSTER_REGENERATE_GOLDEN"):
        shutil.rmtree(golden, ignore_errors=True)
        writer(golden)
    writer(tmp_path)
    got, want = files(tmp_path), files(golden)
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name] == want[name], f"{name} differs from {golden}: the format changed"


def manifests(store: Path) -> list[dict]:
    paths = sorted((store / "versions").rglob("manifest-*"))
    assert all(p.name == "manifest-00000000.json.zst" for p in paths)
    return [json.loads(unpack(p.read_bytes(), where=p.name)) for p in paths]


def test_golden_objects_decode(tmp_path):
    shutil.copytree(BASIC, tmp_path / "s")
    ms = manifests(tmp_path / "s")
    assert [m["format_version"] for m in ms] == [1, 1, 1]
    assert [m["kind"] for m in ms] == ["keyframe", "delta", "keyframe"]
    assert json.loads((tmp_path / "s" / "HEAD").read_bytes())["format_version"] == 1
    sub = Subscriber(str(tmp_path / "s"), config=SubscriberConfig(trusted_keys=TRUST))
    assert sub.sync(until=1) == 1  # reached from HEAD (keyframe 3) through prev_manifest
    assert_state_equal(sub.state_dict(), golden_versions()[0])
    assert sub.sync(until=2) == 2
    assert_state_equal(sub.state_dict(), golden_versions()[1])
    assert sub.model_digest == model_digest(golden_versions()[1])
    assert sub.manifest.kind == "delta"
    # pinned: a different digest here means the digest definition changed
    assert sub.model_digest == (GOLDEN.parent / "model_digest_v2.txt").read_text().strip()
    assert sub.sync() == 3
    assert sub.manifest.kind == "keyframe" and sub.manifest.prev_manifest.version == 2
    assert_state_equal(sub.state_dict(), golden_versions()[2])


def test_golden_exp_objects_decode(tmp_path):
    shutil.copytree(EXP, tmp_path / "s")
    ms = manifests(tmp_path / "s")
    key = ms[0]
    by: dict[str, set] = {}
    for b in key["blocks"]:
        by.setdefault(b["encoding"], set()).update(key["tensors"][s[0]]["name"] for s in b["segments"])
    assert key["encodings"] == ["full-exp", "planes"] and by["full-exp"] == {"e", "g"}
    assert by["planes"] == {"bf", "e", "f", "h", "q"}  # bf's uniform exponents, e's last 704 elements
    for m in ms[1:]:  # every dtype with exponent groups has a sparse-exp2 block; the table sparse-rows
        assert "sparse-exp2" in m["encodings"] and "sparse-rows" in m["encodings"]
        rows = [(s[1], s[2]) for b in m["blocks"] if b["encoding"] == "sparse-rows" for s in b["segments"]
                if m["tensors"][s[0]]["name"] == "e"]
        assert rows == [(0, 4096), (4096, 704)], rows  # both ranges, the second starting inside row 102
        exp = {m["tensors"][s[0]]["dtype"] for b in m["blocks"] if b["encoding"] == "sparse-exp2"
               for s in b["segments"]}
        assert exp == {"bfloat16", "float16", "float32", "float8_e4m3fn"}
    sub = Subscriber(str(tmp_path / "s"), config=SubscriberConfig(trusted_keys=TRUST))
    for v, sd in enumerate(golden_versions_v6(), 1):
        assert sub.sync(until=v) == v
        assert_state_equal(sub.state_dict(), sd)
    late = Subscriber(str(tmp_path / "s"))  # joins at the keyframe and replays: the same weights
    late.sync()
    assert late.model_digest == sub.model_digest


def test_a_store_written_before_1_0_is_refused_by_name_and_the_weights_kept(tmp_path):
    write_basic(tmp_path / "s")
    sub = Subscriber(str(tmp_path / "s"), config=SubscriberConfig(trusted_keys=TRUST))
    assert sub.sync() == 3
    (tmp_path / "s" / "HEAD").write_bytes(OLD_HEAD)  # the prefix is taken over by a 0.2 writer
    with pytest.raises(LegacyFormatError, match=r"written by xcluster 0\.x \(schema_version 3\).*xcluster<1"):
        sub.sync()
    assert sub.version == 3
    assert_state_equal(sub.state_dict(), golden_versions()[2])
