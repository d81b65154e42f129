"""xcluster: lossless delta transport of model weights over object storage.

Public names are imported lazily (module ``__getattr__``), so the torch-free parts — the CLI's
``ls``, ``status``, ``gc``, a relay host — start without importing torch.
"""

from importlib import import_module

_EXPORTS = {
    "AppliedVersion": ".read.subscriber", "Subscriber": ".read.subscriber", "SubscriberConfig": ".read.subscriber",
    "Snapshot": ".read.subscriber",
    "Publisher": ".write.publisher", "PublisherConfig": ".write.publisher", "PublishResult": ".write.publisher",
    "BackgroundPublisher": ".write.background", "BackgroundConfig": ".write.background",
    "PublishTicket": ".write.ticket", "BackgroundStats": ".write.ticket",
    "ShardedPublisher": ".write.sharded", "ShardedConfig": ".write.sharded", "ShardedPublishResult": ".write.sharded",
    "Slice": ".write.sharded",
    "BackgroundPublishError": ".errors",
    "CodecConfig": ".codec.encode",
    "model_digest": ".codec.digest", "tensor_digest": ".codec.digest",
    "XclusterError": ".errors",
    "open_store": ".store",
}
__all__ = sorted(_EXPORTS)
__version__ = "1.0.0"


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'xcluster' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
