"""Review 2, items 3 and 4: one rule for non-weight file names, checked by the publisher before any
upload, by the parser and by the model directory writer; and a bound on their total."""

from __future__ import annotations

import pytest
import torch

from xcluster import Publisher
from xcluster.errors import ConfigError, ModelDirError, UnsafeNameError
from xcluster.follow.daemon import Daemon, DaemonConfig
from xcluster.follow.slots import Slots
from xcluster.store import LocalStore
from tests.unit.helpers import make_weights


def weights(step: int) -> dict[str, torch.Tensor]:
    return {**make_weights(step, base="arange", changed=40, pick="prefix"), "b": torch.full((8,), float(step))}


def run_once(url, out) -> int:
    return Daemon(url, config=DaemonConfig(out=out, once=True, lease_every_s=0)).run()


@pytest.mark.parametrize("name", ["adapter_model.safetensors", "model.safetensors",
                                  "adapter_model.safetensors.index.json"])
def test_publisher_refuses_a_file_name_the_model_directory_refuses_before_uploading(tmp_path, name):
    store = LocalStore(tmp_path / "store")
    with pytest.raises(UnsafeNameError, match="weight file"):
        Publisher(store=store, files={name: b"x"})
    assert store.list("") == []
    with pytest.raises(ModelDirError, match="weight file"):  # the same rule, in the writer
        Slots(tmp_path / "out").write("a", weights(0), {name: b"x"})


def test_publisher_refuses_files_over_the_total_limit(tmp_path, monkeypatch):
    import xcluster.write.files

    monkeypatch.setattr(xcluster.write.files, "MAX_FILES_TOTAL_BYTES", 100)
    store = LocalStore(tmp_path / "store")
    with pytest.raises(ConfigError, match="add up to 120 bytes, over the 100-byte limit"):
        Publisher(store=store, files={f"f{i}.json": b"x" * 40 for i in range(3)})
    assert store.list("") == []


def test_every_name_the_publisher_accepts_the_model_directory_writes(tmp_path):
    names = ["config.json", "tokenizer.json", "generation_config.json", "vocab.txt", "merges.txt",
             "special_tokens_map.json", "adapter_config.json", "tokenizer.model", "model.bin", "x-y_z.1"]
    url = str(tmp_path / "store")
    files = {n: n.encode() for n in names}
    Publisher(url, files=files).publish(weights(0))
    assert run_once(url, tmp_path / "out") == 0
    assert Slots(tmp_path / "out").files("a") == files


def test_one_stored_object_listed_under_several_names_is_fetched_once(tmp_path):
    fetched: list[str] = []

    class Counting(LocalStore):
        def get_range(self, key, start, length):
            if key.startswith("files/"):
                fetched.append(key)
            return super().get_range(key, start, length)

    store = Counting(tmp_path / "store")
    same = b'{"same": true}'
    Publisher(store=store, files={"a.json": same, "b.json": same, "c.json": same}).publish(weights(0))
    d = Daemon(store=store, config=DaemonConfig(out=tmp_path / "out", once=True, lease_every_s=0))
    assert d.run() == 0
    assert len(fetched) == 1
    assert Slots(tmp_path / "out").files("a") == {"a.json": same, "b.json": same, "c.json": same}
