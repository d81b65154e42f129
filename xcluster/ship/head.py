"""Reading HEAD (FORMAT.md §4), as the reader polls it and the committer compares and swaps it."""

from __future__ import annotations

from ..errors import ObjectNotFoundError
from ..format import HEAD_KEY, Head, parse_head
from ..store import Store


def read_head(store: Store) -> tuple[Head | None, str | None]:
    """HEAD and its etag; ``(None, None)`` on an empty prefix."""
    try:
        blob = store.get(HEAD_KEY)
    except ObjectNotFoundError:
        return None, None
    assert blob is not None
    return parse_head(blob.data, where=f"{store.url}/{HEAD_KEY}"), blob.etag


def poll_head(store: Store, etag: str | None) -> tuple[Head | None, str | None] | None:
    """One conditional GET of HEAD: ``None`` when it still has ``etag`` (nothing new), else
    ``(head, etag)`` — ``(None, None)`` when the prefix is empty."""
    try:
        blob = store.get(HEAD_KEY, if_none_match=etag)
    except ObjectNotFoundError:
        return None, None
    if blob is None:
        return None
    return parse_head(blob.data, where=f"{store.url}/{HEAD_KEY}"), blob.etag
