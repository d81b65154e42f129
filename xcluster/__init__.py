"""xcluster: lossless delta transport of model weights over object storage."""

from .background import BackgroundStats, PublishTicket
from .codec.encode import CodecConfig
from .digest import model_digest, tensor_digest
from .errors import BackgroundPublishError, XclusterError
from .publisher import Publisher, PublisherConfig, PublishResult
from .store import open_store
from .subscriber import AppliedVersion, Subscriber, SubscriberConfig

__all__ = ["AppliedVersion", "BackgroundPublishError", "BackgroundStats", "CodecConfig", "Publisher",
           "PublisherConfig", "PublishResult", "PublishTicket", "Subscriber", "SubscriberConfig", "XclusterError",
           "model_digest", "open_store", "tensor_digest"]
__version__ = "0.1.0"
