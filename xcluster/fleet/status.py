"""The fleet as the store sees it (``xcluster status``), torch-free: HEAD and every subscriber's lease."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from ..read.chain import read_head
from ..errors import ObjectNotFoundError, XclusterError
from ..format import Head, Lease
from .retention import RetentionConfig, read_lease
from ..store import Store


@dataclass(frozen=True, slots=True)
class SubscriberStatus:
    lease: Lease
    live: bool
    age_s: float
    """Seconds since the lease was written."""
    behind: int | None
    """HEAD's version minus the applied one (None before the first)."""
    staleness_s: float | None
    """Now minus the commit time of the applied version."""


@dataclass(frozen=True, slots=True)
class FleetStatus:
    head: Head | None
    subscribers: list[SubscriberStatus]
    unreadable: list[str]


def fleet_status(store: Store, *, lease_ttl_s: float = RetentionConfig.lease_ttl_s,
                 max_clock_skew_s: float = RetentionConfig.max_clock_skew_s,
                 now: Callable[[], float] = time.time) -> FleetStatus:
    """Every lease under ``leases/`` (read in bounded bytes), with how far behind HEAD its node is.
    A lease is live when updated within ``lease_ttl_s`` and dated at most ``max_clock_skew_s``
    ahead of this clock (further ahead: a skewed or forged clock, shown as not live)."""
    t = now()
    head, _ = read_head(store)
    subs, bad = [], []
    for key in store.list("leases/"):
        try:
            lease = read_lease(store, key)
        except (XclusterError, ObjectNotFoundError):
            bad.append(key)
            continue
        age = t - lease.updated_unix_ms / 1000
        behind = None if lease.version is None or head is None else max(0, head.version - lease.version)
        stale = None if lease.committed_unix_ms is None else max(0.0, t - lease.committed_unix_ms / 1000)
        live = -max_clock_skew_s <= age <= lease_ttl_s
        subs.append(SubscriberStatus(lease=lease, live=live, age_s=age, behind=behind,
                                     staleness_s=stale))
    subs.sort(key=lambda s: s.lease.node_id)
    return FleetStatus(head=head, subscribers=subs, unreadable=bad)
