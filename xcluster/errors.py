"""Every failure xcluster raises is a subclass of :class:`XclusterError`.

Each message names the object involved and, where there is one, what to do about it.
"""

from __future__ import annotations


class XclusterError(Exception):
    """Base of all xcluster errors."""


# --- configuration ---------------------------------------------------------------------------
class ConfigError(XclusterError, ValueError):
    """A configuration value is invalid."""


# --- storage ---------------------------------------------------------------------------------
class StoreError(XclusterError):
    """The object store failed."""


class ObjectNotFoundError(StoreError, KeyError):
    """The object does not exist."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "object not found"


class PreconditionFailedError(StoreError):
    """A conditional write (if-none-match / if-match) lost: someone else wrote first."""


class UnsafeKeyError(StoreError, ValueError):
    """An object key would escape its prefix or uses characters outside the allowed set."""


class TransientStoreError(StoreError):
    """A failure worth retrying (throttling, 5xx, reset, timeout, short read)."""


class UnsupportedURLError(StoreError, ValueError):
    """No backend handles this URL."""


# --- format ----------------------------------------------------------------------------------
class FormatError(XclusterError, ValueError):
    """A manifest or HEAD object is malformed: not JSON, wrong schema, impossible sizes."""


class SchemaVersionError(FormatError):
    """The object declares a format version this reader does not know."""


class LegacyFormatError(SchemaVersionError):
    """The object was written by xcluster before 1.0 (it declares a ``schema_version``): format-1
    readers do not read it. Read that store with the release that wrote it, or publish anew."""


class UnknownEncodingError(SchemaVersionError):
    """A manifest uses an encoding (named in the message) that this reader does not have:
    upgrade the reader, or keep the encoding out of the publisher's ``CodecConfig.encodings``."""


class UnsafeNameError(FormatError):
    """A tensor name or chunk key from a manifest is not allowed (path traversal, control chars)."""


# --- integrity -------------------------------------------------------------------------------
class IntegrityError(XclusterError):
    """Data does not match what its manifest promises."""


class ChecksumMismatchError(IntegrityError):
    """A chunk's bytes do not hash to the checksum recorded in the manifest."""


class TruncatedObjectError(IntegrityError):
    """A chunk is shorter or longer than the manifest says."""


class DigestMismatchError(IntegrityError):
    """Weights after applying a version do not hash to the manifest's digest."""


class CheckpointMismatchError(IntegrityError):
    """A checkpoint does not reproduce the committed version it names (other tensors, digests, run
    or files than that version's manifest, which the chain authenticates): it is not used."""


class DecodeError(IntegrityError):
    """An encoded stream is malformed (bad zstd frame, wrong decoded size, out-of-range index)."""


class DecompressionBombError(DecodeError):
    """A stream declares or produces more bytes than its tensor can hold."""


class ResourceLimitError(XclusterError):
    """Applying a version would need more memory than this reader's limits allow (or than the
    machine could allocate): refused before allocating, the held weights stay."""


# --- protocol --------------------------------------------------------------------------------
class BaseMismatchError(XclusterError):
    """A delta's base version is not the subscriber's current version."""


class RollbackError(XclusterError):
    """HEAD names a version below the one this subscriber holds: the store went backwards
    (rolled back, or replaced by a stale copy). The subscriber refuses and keeps what it has."""


class SignatureError(IntegrityError):
    """A subscriber that trusts signing keys met a HEAD or manifest that is unsigned, signed by a
    key it does not trust, or whose signature does not verify. It keeps its last good weights."""


class RunMismatchError(XclusterError):
    """A version belongs to another training run than the one this subscriber follows (a replay
    of another run's validly signed versions into this prefix, or a --run-id pin that differs)."""


class StaleHeadError(XclusterError):
    """HEAD was committed longer ago than the subscriber's ``max_staleness_s`` allows: the trainer
    stopped publishing, or the store is frozen or replayed. Nothing is applied; what is held stays."""


class ChainBrokenError(XclusterError):
    """The chain from the newest keyframe to the requested version is incomplete."""


class ConcurrentPublisherError(XclusterError):
    """Another publisher committed to this prefix; this one refuses to overwrite it."""


class ChunksMissingError(XclusterError):
    """Chunks this attempt uploaded are gone before its commit (retention removed them: an upload
    that outlived the grace period, or skewed clocks). Nothing is committed; publish again."""


# --- daemon ----------------------------------------------------------------------------------
class StateFileError(XclusterError):
    """The daemon's state record under --out is unreadable or inconsistent (it restarts from a keyframe)."""


# --- s3 --------------------------------------------------------------------------------------
class ShortReadError(TransientStoreError):
    """A response body ended before its Content-Length or the requested range (worth a retry)."""


class CorruptReadError(TransientStoreError):
    """Bytes read do not hash to what the store recorded at write time (re-fetch them)."""


class RetriesExhaustedError(StoreError):
    """A transient failure persisted past the retry budget; ``__cause__`` is the last error."""


class ObjectTooLargeError(StoreError):
    """An object is larger than the configured maximum this process will allocate for it."""


class ConditionalWritesUnsupportedError(StoreError):
    """The server ignores If-None-Match / If-Match on PutObject, so commits are not race-free."""


# --- follow (the subscriber daemon's sink and engine hand-off) ------------------------------
class ModelDirError(XclusterError, ValueError):
    """A model directory (or a version of one) is missing, partial, corrupt, cannot be written, or
    does not match the model's config."""


class HandoffError(XclusterError):
    """The inference engine did not take a new model directory (refused, unreachable, timed out)."""


class TransientHandoffError(HandoffError):
    """A hand-off failure worth retrying: connection refused/reset, timeout, HTTP 5xx or 429."""


class EngineWeightsMismatchError(HandoffError):
    """The engine's workers hashed their loaded parameters and they are not the version handed
    over (after an in-place update, the daemon reloads; after a reload, the hand-off fails)."""


# --- background publishing -------------------------------------------------------------------
class BackgroundPublishError(XclusterError):
    """A publish running in the background failed; ``__cause__`` is the original error.

    Raised by the next ``publish()`` / ``flush()`` / ``close()`` of the publisher, and by
    ``PublishTicket.result()`` of the snapshot concerned. Nothing of the failed version is
    visible; the next ``publish()`` is a fresh attempt."""


class PublishTimeoutError(XclusterError, TimeoutError):
    """``flush()``, ``close()`` or ``PublishTicket.result()`` ran out of time before the
    background publisher committed what it was waiting for."""


class PublishCancelledError(XclusterError):
    """A snapshot was dropped without being published: the publisher was closed (or the
    interpreter exited) while it was still waiting its turn."""


class PublisherClosedError(XclusterError):
    """``publish()`` was called on a publisher that has been closed."""


# --- sharded publishing (torch.distributed) --------------------------------------------------
class ShardedPublishError(XclusterError):
    """A sharded publish failed on some rank. Raised on every rank alike; rank 0 did not commit
    (or says so if it did), nothing of the version is visible and the next ``publish()`` retries
    the same version number. ``__cause__`` is this rank's own error, where it had one."""


class ShardLayoutError(ShardedPublishError, ValueError):
    """The ranks' shards do not add up to one model: a name held whole by two ranks, slices that
    overlap or leave a hole in dim 0, or dtype / global shape that differ between ranks."""


class RankLostError(ShardedPublishError):
    """A rank did not reach an exchange within ``ShardedConfig.timeout_s``, or its connection
    closed (killed, crashed): the version is abandoned and the process group cannot be trusted
    any more; this publisher refuses further publishes (restart the job)."""
