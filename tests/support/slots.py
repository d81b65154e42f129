"""Reading a rollout node's ``OUT/current`` from outside its daemon, as an engine would."""

from __future__ import annotations

from pathlib import Path

import torch

from xcluster.follow.slots import Slots


def read_current(out: Path | str) -> tuple[int, dict[str, torch.Tensor], dict[str, bytes]] | None:
    """(version, tensors, non-weight files) of the slot ``current`` names, by the slot's own tag;
    None if there is no ``current``. The tensors are copies (read while the slot stays tagged)."""
    s = Slots(out)
    name = s.current()
    if name is None:
        return None
    tag = s.read_tag(name)
    if tag is None:
        raise AssertionError(f"{out}/current names slot {name}, which carries no version tag")
    state = {n: t.clone() for n, t in s.map(name).items()}
    files = s.files(name)
    if s.read_tag(name) != tag:
        raise AssertionError(f"slot {name} changed while it was read")
    return tag[0], state, files
