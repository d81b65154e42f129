import pytest
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


def test_the_cli_takes_its_defaults_from_the_config_dataclasses(monkeypatch, tmp_path):
    """Review of format 1 (issue 28): the CLI restated 16 defaults and one had drifted
    (--handoff-timeout 300 s against HandoffConfig's 120). Options not given are left to the configs."""
    import dataclasses

    from xcluster.cli import build_parser
    from xcluster.follow import daemon as daemon_mod
    from xcluster.follow.handoff import HandoffConfig

    args = build_parser().parse_args(["subscribe", str(tmp_path), "--out", str(tmp_path / "o"), "--engine", "vllm",
                                      "--engine-url", "http://127.0.0.1:9", "--once"])
    cli_only = ("command", "url", "out", "engine", "engine_url", "once", "func", "trust", "metrics_addr",
                "log_format", "log_level")  # what no config dataclass holds
    defaults = {k: v for k, v in vars(args).items() if k not in cli_only}
    assert all(v in (None, False) for v in defaults.values()), defaults
    seen = {}

    class Stop(Exception):
        pass

    def fake_daemon(url, *, config, handoff, metrics):
        seen.update(config=config, handoff=handoff)
        raise Stop

    monkeypatch.setattr(daemon_mod, "Daemon", fake_daemon)
    with pytest.raises(Stop):
        main(["subscribe", str(tmp_path), "--out", str(tmp_path / "o"), "--engine", "vllm",
              "--engine-url", "http://127.0.0.1:9", "--once"])
    config, handoff = seen["config"], seen["handoff"]
    want = daemon_mod.DaemonConfig(out=config.out, node_id=config.node_id, once=True)
    for f in ("poll_s", "backoff_max_s", "lease_every_s"):
        assert getattr(config, f) == getattr(want, f)
    assert config.slots == want.slots
    assert dataclasses.asdict(handoff.config) == dataclasses.asdict(HandoffConfig())
    assert handoff.pause_mode == "keep"  # make_handoff's own default
