"""Golden bytes: a fixed input produces these exact objects forever (or the schema version changes),
and the checked-in objects stay readable."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from xcluster import CodecConfig, Publisher, PublisherConfig, Subscriber, SubscriberConfig, model_digest
from xcluster.codec import rans
from xcluster.manifest_object import unpack
from xcluster.store import LocalStore
from tests.unit.helpers import assert_state_equal

GOLDEN = Path(__file__).parent.parent / "golden" / "v2" / "store"
GOLDEN_V1 = Path(__file__).parent.parent / "golden" / "v1" / "store"
"""Written by schema 1 (xcluster 0.1): never regenerated, must stay readable."""
GOLDEN_V4 = Path(__file__).parent.parent / "golden" / "v4" / "store"
"""Schema 4: sparse-exp blocks (codec v2, Rice parameters derived from group sizes), with the v1
encodings where they are smaller. Writers now write sparse-exp2: never regenerated, must stay readable."""
GOLDEN_V4_0 = Path(__file__).parent.parent / "golden" / "v4-0" / "store"
"""v4 as the first writer of schema 4 laid it out (sparse-exp blocks sized by stream bytes): still read."""
GOLDEN_V5 = Path(__file__).parent.parent / "golden" / "v5" / "store"
"""Schema 5: the v4 versions as writers write them now: sparse-exp2 blocks (Rice parameters stored),
manifests packed (``manifest-<attempt>.json.zst``, HEAD schema 3), signed."""
GOLDEN_V6 = Path(__file__).parent.parent / "golden" / "v6" / "store"
"""Schema 6: the v5 store with ``rans_full``: the keyframe's bf16 ranges are full-rans blocks (FORMAT.md §5b)."""
GOLDEN_V7 = Path(__file__).parent.parent / "golden" / "v7" / "store"
"""Schema 7: the v5 store with ``exp_full``: the keyframe's bf16 ranges are full-exp blocks (FORMAT.md §5c)."""
EXP_GOLDENS = {GOLDEN_V4: ("sparse-exp", 4), GOLDEN_V4_0: ("sparse-exp", 4), GOLDEN_V5: ("sparse-exp2", 5),
               GOLDEN_V6: ("sparse-exp2", 5), GOLDEN_V7: ("sparse-exp2", 5)}
FULL_GOLDENS = {GOLDEN_V6: ("full-rans", 6), GOLDEN_V7: ("full-exp", 7)}
"""Stores whose keyframe codes whole bf16 values: that encoding and the keyframe's schema."""
GOLDEN_KEY = Path(__file__).parent.parent / "golden" / "signing-key.pem"
"""A published test key (never use it for anything else): Ed25519 signatures are deterministic,
so the signed golden objects pin the signature bytes too."""


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


def write(root: Path) -> None:
    """The schema 2 store: the v1 encodings only (``exp_groups=False``)."""
    pub = Publisher(store=LocalStore(root, fsync=False),
                    config=PublisherConfig(keyframe_every=100, codec=CodecConfig(block_bytes=4096, chunk_bytes=4096,
                                                                                 exp_groups=False),
                                           run_id="golden", signing_key=str(GOLDEN_KEY)),
                    clock=lambda: 1_700_000_000.0, attempt_id=lambda: "00000000",
                    files={"config.json": b'{"model_type": "golden"}\n'})
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
    real weights' do), so full-rans beats byte planes on it; it does not change."""
    # the high bits of two LCG sequences (an LCG's low bits have short periods, which zstd would find)
    ys = [(b >> 12) | 1 << 20 for b in _bits(2048, seed=61)]
    raw = [((a >> 31) << 15) | ((121 - (y & -y).bit_length()) << 7) | ((a >> 24) & 127)
           for a, y in zip(_bits(2048, seed=60), ys)]
    g = torch.tensor(raw, dtype=torch.int64).to(torch.int16).view(torch.bfloat16)
    return [dict(v, g=g) for v in golden_versions_v4()]


def write_v5(root: Path, **full: bool) -> None:
    """The schema 5 store; with ``rans_full`` or ``exp_full`` (``full``), the v6 versions."""
    pub = Publisher(store=LocalStore(root, fsync=False),
                    config=PublisherConfig(keyframe_every=100, codec=CodecConfig(block_bytes=4096, chunk_bytes=4096,
                                                                                 exp_groups=True, **full),
                                           run_id="golden", compress_manifest=True, signing_key=str(GOLDEN_KEY)),
                    clock=lambda: 1_700_000_000.0, attempt_id=lambda: "00000000")
    for i, sd in enumerate(golden_versions_v6() if full else golden_versions_v4()):
        pub.publish(sd, step=i)


def write_v6(root: Path) -> None:
    write_v5(root, rans_full=True)


def write_v7(root: Path) -> None:
    write_v5(root, exp_full=True)


def files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.name.startswith(".")}


@pytest.mark.parametrize("writer, golden", [(write, GOLDEN), (write_v5, GOLDEN_V5), (write_v6, GOLDEN_V6),
                                            (write_v7, GOLDEN_V7)], ids=["v2", "v5", "v6", "v7"])
def test_writer_produces_the_golden_bytes(tmp_path, writer, golden):
    if writer is write_v6 and not rans.compiled():
        pytest.skip("full-rans is written only with numba's compiled loops (without them: byte planes)")
    if os.environ.get("XCLUSTER_REGENERATE_GOLDEN"):
        shutil.rmtree(golden, ignore_errors=True)
        writer(golden)
    writer(tmp_path)
    got, want = files(tmp_path), files(golden)
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name] == want[name], f"{name} differs from {golden}: the format changed"


@pytest.mark.parametrize("golden", list(EXP_GOLDENS), ids=["v4", "v4-0", "v5", "v6", "v7"])
def test_golden_exp_objects_decode(tmp_path, golden):
    encoding, schema = EXP_GOLDENS[golden]
    packed = golden in (GOLDEN_V5, GOLDEN_V6, GOLDEN_V7)
    shutil.copytree(golden, tmp_path / "s")
    paths = sorted((tmp_path / "s" / "versions").rglob("manifest-*"))
    assert [p.name.endswith(".json.zst") for p in paths] == [packed] * 3
    manifests = [json.loads(unpack(p.name, p.read_bytes(), where=p.name)) for p in paths]
    full, key_schema = FULL_GOLDENS.get(golden, (None, 2))
    assert [m["schema_version"] for m in manifests] == [key_schema, schema, schema]
    if full:  # the keyframe's bf16 ranges are full-rans or full-exp, the other dtypes planes
        key = manifests[0]
        by = {b["encoding"]: {key["tensors"][s[0]]["dtype"] for s in b["segments"]} for b in key["blocks"]}
        assert by[full] == {"bfloat16"} and "bfloat16" not in by["planes"]
    assert json.loads((tmp_path / "s" / "HEAD").read_bytes())["schema_version"] == (3 if packed else 2)
    for m in manifests[1:]:  # every dtype with exponent groups has a block of the exponent encoding
        exp = {m["tensors"][s[0]]["dtype"] for b in m["blocks"] if b["encoding"] == encoding for s in b["segments"]}
        assert exp == {"bfloat16", "float16", "float32", "float8_e4m3fn"}
    trust = (str(GOLDEN_KEY) + ".pub",) if packed else ()
    sub = Subscriber(str(tmp_path / "s"), config=SubscriberConfig(trusted_keys=trust))
    for v, sd in enumerate(golden_versions_v6() if full else golden_versions_v4(), 1):
        assert sub.sync(until=v) == v
        assert_state_equal(sub.state_dict(), sd)
    late = Subscriber(str(tmp_path / "s"))  # joins at the keyframe and replays: the same weights
    late.sync()
    assert late.model_digest == sub.model_digest


@pytest.mark.parametrize("golden", [GOLDEN, GOLDEN_V1], ids=["v2", "v1"])
def test_golden_objects_decode(tmp_path, golden):
    shutil.copytree(golden, tmp_path / "s")
    trust = (str(GOLDEN_KEY) + ".pub",) if golden == GOLDEN else ()
    sub = Subscriber(str(tmp_path / "s"), config=SubscriberConfig(trusted_keys=trust))
    assert sub.sync(until=1) == 1  # v2 store: reached from HEAD (keyframe 3) through prev_manifest
    assert_state_equal(sub.state_dict(), golden_versions()[0])
    assert sub.sync(until=2) == 2
    assert_state_equal(sub.state_dict(), golden_versions()[1])
    assert sub.model_digest == model_digest(golden_versions()[1])
    assert sub.manifest.kind == "delta"
    # pinned: a different digest here means the digest definition changed
    assert sub.model_digest == (GOLDEN.parent.parent / "model_digest_v2.txt").read_text().strip()
    if golden == GOLDEN:
        assert sub.sync() == 3
        assert sub.manifest.kind == "keyframe" and sub.manifest.prev_manifest.version == 2
        assert_state_equal(sub.state_dict(), golden_versions()[2])
