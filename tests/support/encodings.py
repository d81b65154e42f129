"""A reader that lacks some encodings, for the upgrade tests (docs/FORMAT.md §8)."""

from __future__ import annotations

import contextlib
from unittest import mock

from xcluster.codec import encoding


@contextlib.contextmanager
def without_encodings(*names: str):
    """While open, this process reads and writes as an xcluster without ``names`` would."""
    full = dict(encoding.registry())
    missing = [n for n in names if n not in full]
    assert not missing, f"no such encodings: {missing}"
    kept = {n: e for n, e in full.items() if n not in names}
    with mock.patch.object(encoding, "registry", lambda: kept):
        yield
