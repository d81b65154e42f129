"""Configuration of the S3 backend: one keyword-only, frozen dataclass.

Memory: an object is never held twice. On upload, request bodies are read from the caller's
buffer a piece at a time (no part is copied whole); on download, every part, the first one
included, is read straight into one result buffer sized from the first answer's headers. The
extra is socket and hashing buffers, about a MiB per part in flight (``max_concurrency``).

Endpoint, credentials and region come from the standard AWS chain (environment, shared
config/credentials files and profile, instance metadata) unless set here; this module never
reads the environment itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ...errors import ConfigError
from ...util.retry import RetryPolicy

MiB = 1024 * 1024
GiB = 1024 * MiB
S3_MIN_PART = 5 * MiB  # every multipart part but the last must be at least this big
S3_MAX_PART = 5 * GiB
S3_MAX_PARTS = 10_000


@dataclass(kw_only=True, frozen=True)
class S3Config:
    """How :class:`~xcluster.store.s3.store.S3Store` talks to an S3-compatible server."""

    part_size: int = 16 * MiB
    """Bytes per multipart-upload part and per ranged GET (5 MiB … 5 GiB)."""
    multipart_threshold: int = 32 * MiB
    """Objects larger than this go up as a multipart upload and come down as parallel ranged
    GETs; smaller ones use one PUT / one GET."""
    max_concurrency: int = 8
    """Parts in flight at once per upload or download (threads and HTTP connections)."""
    max_object_size: int = 64 * GiB
    """Largest object a download will allocate memory for; checked against the size the server
    reports before allocating."""
    connect_timeout_s: float = 10.0
    """Seconds to establish a TCP/TLS connection."""
    read_timeout_s: float = 60.0
    """Seconds without a byte from the server before an attempt is abandoned (and retried)."""
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    """Attempts, deadline and backoff for transient failures (see :mod:`xcluster.util.retry`).
    botocore's own retries are switched off, so this is the whole policy."""
    addressing_style: Literal["auto", "path", "virtual"] = "auto"
    """``path`` (``http://host/bucket/key``) for SeaweedFS, MinIO and most self-hosted servers;
    ``virtual`` (``http://bucket.host/key``); ``auto`` lets botocore choose (virtual on AWS)."""
    endpoint_url: str | None = None
    """Server URL such as ``http://127.0.0.1:8333``. ``None``: the standard chain decides
    (``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``, ``endpoint_url`` in the profile, else AWS)."""
    region: str | None = None
    """Region to sign for. ``None``: the standard chain (``AWS_REGION``, the profile)."""
    profile: str | None = None
    """Named profile of the shared AWS config/credentials files. ``None``: the default chain."""
    require_conditional_writes: bool = True
    """If the server turns out to ignore ``If-None-Match``/``If-Match`` on writes, raise
    :class:`~xcluster.errors.ConditionalWritesUnsupportedError`. ``False``: warn loudly and fall
    back to a HEAD-then-PUT check, which narrows the race between two writers but cannot close it."""
    probe_conditional_writes: bool = True
    """Before the first conditional write, check once (three small requests on a scratch key
    under the prefix) that the server enforces conditional writes. ``False``: trust it."""
    verify_reads: bool = True
    """Record an xxh3-64 of every part in the object's metadata on write, and check what is read
    back against it (a mismatch is re-fetched). Objects written by other tools are not checked."""

    def __post_init__(self) -> None:
        if not S3_MIN_PART <= self.part_size <= S3_MAX_PART:
            raise ConfigError(f"part_size must be between 5 MiB and 5 GiB (S3's limits for a "
                              f"multipart part), got {self.part_size}")
        if self.multipart_threshold < S3_MIN_PART:
            raise ConfigError(f"multipart_threshold must be ≥ 5 MiB (S3's smallest part), "
                              f"got {self.multipart_threshold}")
        if not 1 <= self.max_concurrency <= 256:
            raise ConfigError(f"max_concurrency must be 1 … 256 parts in flight, got "
                              f"{self.max_concurrency}")
        if self.max_object_size < 1:
            raise ConfigError(f"max_object_size must be ≥ 1 byte, got {self.max_object_size}")
        if self.connect_timeout_s <= 0 or self.read_timeout_s <= 0:
            raise ConfigError("connect_timeout_s and read_timeout_s must be > 0 seconds, got "
                              f"{self.connect_timeout_s} and {self.read_timeout_s}")
        if self.addressing_style not in ("auto", "path", "virtual"):
            raise ConfigError(f"addressing_style must be 'auto', 'path' or 'virtual', got "
                              f"{self.addressing_style!r}")
        if self.endpoint_url is not None and not self.endpoint_url.startswith(("http://", "https://")):
            raise ConfigError(f"endpoint_url must start with http:// or https://, got "
                              f"{self.endpoint_url!r}")
        if not isinstance(self.retry, RetryPolicy):
            raise ConfigError(f"retry must be a RetryPolicy, got {type(self.retry).__name__}")

    @property
    def peak_extra_bytes(self) -> int:
        """A generous bound on the memory a transfer needs beyond the object itself:
        ``max_concurrency × part_size`` (in practice about a MiB per part in flight)."""
        return self.max_concurrency * self.part_size
