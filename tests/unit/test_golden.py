"""Golden bytes: a fixed input produces these exact objects forever (or the schema version changes),
and the checked-in objects stay readable."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from xcluster import CodecConfig, Publisher, PublisherConfig, Subscriber, SubscriberConfig, model_digest
from xcluster.store import LocalStore
from tests.unit.helpers import assert_state_equal

GOLDEN = Path(__file__).parent.parent / "golden" / "v2" / "store"
GOLDEN_V1 = Path(__file__).parent.parent / "golden" / "v1" / "store"
GOLDEN_KEY = Path(__file__).parent.parent / "golden" / "signing-key.pem"
"""A published test key (never use it for anything else): Ed25519 signatures are deterministic,
so the signed golden objects pin the signature bytes too."""
"""Written by schema 1 (xcluster 0.1): never regenerated, must stay readable."""


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
    pub = Publisher(store=LocalStore(root, fsync=False),
                    config=PublisherConfig(keyframe_every=100, codec=CodecConfig(block_bytes=4096, chunk_bytes=4096),
                                           run_id="golden", signing_key=str(GOLDEN_KEY)),
                    clock=lambda: 1_700_000_000.0, attempt_id=lambda: "00000000",
                    files={"config.json": b'{"model_type": "golden"}\n'})
    for i, sd in enumerate(golden_versions()):
        pub.publish(sd, step=i, keyframe=True if i == 2 else None)  # v3: a keyframe, linked by prev_manifest


def files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.name.startswith(".")}


def test_writer_produces_the_golden_bytes(tmp_path):
    if os.environ.get("XCLUSTER_REGENERATE_GOLDEN"):
        shutil.rmtree(GOLDEN, ignore_errors=True)
        write(GOLDEN)
    write(tmp_path)
    got, want = files(tmp_path), files(GOLDEN)
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name] == want[name], f"{name} differs from tests/golden: the format changed"


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
