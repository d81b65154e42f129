"""Object storage: a small :class:`Store` protocol and its backends.

``open_store(url)`` picks the backend: a plain path or ``file://`` → :class:`LocalStore`;
``s3://bucket/prefix`` → ``S3Store`` (boto3, imported only then); any other fsspec URL
(``memory://``, ``gs://``, …) → :class:`FsspecStore`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, UnsupportedURLError
from .base import Blob, Stat, Store, check_key
from .local import LocalStore

if TYPE_CHECKING:  # pragma: no cover
    from .s3.store import S3Config

__all__ = ["Blob", "Stat", "Store", "check_key", "LocalStore", "open_store", "resolve_store"]


def resolve_store(url: str | Any | None, store: Store | None, who: str) -> Store:
    """The store a component works on: ``store`` if given, else ``open_store(url)``."""
    if store is not None:
        return store
    if url is None:
        raise ConfigError(f"{who} needs a url or a store")
    return open_store(url)


def open_store(url: str | Any, *, s3: "S3Config | None" = None) -> Store:
    """Return the store for ``url`` (a Store instance is returned unchanged)."""
    if not isinstance(url, str):
        if isinstance(url, Store):
            return url
        url = str(url)  # os.PathLike
    if "://" not in url:
        return LocalStore(url)
    scheme = url.split("://", 1)[0].lower()
    if scheme == "file":
        return LocalStore(url[len("file://"):])
    if scheme in ("s3", "s3a"):
        try:
            from .s3.store import S3Store
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise UnsupportedURLError(
                f"{url}: the S3 backend needs boto3: pip install 'xcluster[s3]' ({exc})") from exc
        return S3Store.from_url(url, config=s3)
    try:
        from .fsspec_store import FsspecStore

        return FsspecStore(url)
    except ConfigError:
        raise
    except (ImportError, ValueError) as exc:
        raise UnsupportedURLError(f"{url}: no store backend for scheme {scheme!r} ({exc})") from exc
