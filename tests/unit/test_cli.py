import torch

from xcluster import Publisher, PublisherConfig
from xcluster.cli import main
from xcluster.format import chunk_key, parse_manifest
from tests.unit.helpers import manifest_bytes
from xcluster.store import LocalStore


def publish(tmp_path, n=4):
    pub = Publisher(str(tmp_path), config=PublisherConfig(keyframe_every=3))
    w = torch.randn(64, 64).to(torch.bfloat16)
    for s in range(n):
        w.view(torch.int16).reshape(-1)[s::50] += 1
        pub.publish({"w": w.clone()}, step=s)


def test_ls_lists_versions(tmp_path, capsys):
    publish(tmp_path)
    assert main(["ls", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["version", "kind", "base"]
    rows = [line.split() for line in lines[1:]]
    assert [r[0] for r in rows] == ["1", "2", "3", "4"]
    assert [r[1] for r in rows] == ["keyframe", "delta", "delta", "keyframe"]
    assert rows[1][2] == "1" and rows[-1][-1] == "HEAD"


def test_ls_empty(tmp_path, capsys):
    assert main(["ls", str(tmp_path)]) == 0
    assert "no versions" in capsys.readouterr().out


def test_verify_ok_and_version(tmp_path, capsys):
    publish(tmp_path)
    assert main(["verify", str(tmp_path)]) == 0
    assert "verified version 4" in capsys.readouterr().out
    assert main(["verify", str(tmp_path), "--version", "3"]) == 0
    out = capsys.readouterr().out
    assert "verified version 3" in out and "version      1 keyframe" in out


def test_verify_detects_corruption(tmp_path, capsys):
    publish(tmp_path)
    store = LocalStore(tmp_path)
    m = parse_manifest(manifest_bytes(store, 3))
    key = chunk_key(3, m.chunks[0].name)
    data = bytearray(store.get(key).data)
    data[-1] ^= 1
    store.put(key, bytes(data))
    assert main(["verify", str(tmp_path), "--version", "3"]) == 2
    err = capsys.readouterr().err
    assert "ChecksumMismatchError" in err and key in err
