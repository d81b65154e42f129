"""Which slot holds what, and keeping that true: the daemon's slot bookkeeping (``slots.py`` lays
out and maps; this module decides what goes where and records it in ``state.json``).

The record (:class:`~xcluster.follow.state.DaemonState`) is the journal: before a slot is
touched it is recorded untrusted (two slots: ``standby_version`` None; one slot: ``patching``,
with ``current`` unlinked) and its tag removed; only a slot whose patch verified and whose files
were fsynced is recorded, tagged and made ``current``. The subscriber holds the tensors of the
*work* slot (the standby; with one slot, the only one) as memory-mapped views, so a delta patches
the files themselves. docs/DAEMON.md tells the crash story.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from ..codec.dtypes import torch_dtype
from ..codec.encoding import parse_manifest
from ..errors import ChainBrokenError, XclusterError
from ..format import FULL_KINDS, INIT_BASE, Manifest
from ..read.subscriber import AppliedVersion, Snapshot, Subscriber
from .metrics import DaemonMetrics
from .slots import Pending, Slots, backed_by
from .state import DaemonState, StateStore

log = logging.getLogger("xcluster.daemon")


def listed(m: Manifest) -> dict[str, tuple[int, str]]:
    """A manifest's non-weight files as ``Slots.map`` checks them: name -> (size, xxh3-128)."""
    return {f.name: (f.size, f.xxh3_128) for f in m.files}


class SlotKeeper:
    """The slots of one daemon, the subscriber that patches them, and the record of both."""

    def __init__(self, slots: Slots, states: StateStore, subscriber: Subscriber, metrics: DaemonMetrics, *,
                 fetch_files: Callable[[Manifest], dict[str, bytes]],
                 count_error: Callable[[BaseException], None]) -> None:
        self.slots = slots
        self.states = states
        self.subscriber = subscriber
        self.metrics = metrics
        self.fetch_files = fetch_files
        self.count_error = count_error
        self.state: DaemonState | None = None
        self.views: dict[str, dict[str, torch.Tensor]] = {}  # slot -> views of its mapped files
        self.work: str | None = None  # the slot whose views the subscriber holds
        self.pending: list[Pending] = []  # full writes in progress (keyframes)
        self.patched_bytes = 0
        self.saw_full = False
        self.replaying = False
        self.replayed: tuple[str, int] | None = None  # (slot, version) replayed unverified, held now
        subscriber.allocate = self.allocate

    def on_applied(self, ev: AppliedVersion) -> None:
        self.patched_bytes += ev.bytes_patched
        self.saw_full = self.saw_full or ev.kind in FULL_KINDS

    def discard_pending(self) -> None:
        """Full writes that did not verify."""
        for pending in self.pending:
            self.slots.discard_pending(pending)
        self.pending.clear()

    def resume_current(self, st: DaemonState, views: dict[str, torch.Tensor], mdata: bytes) -> None:
        """Take up a record whose ``current`` slot was just verified (``views``, ``mdata``)."""
        self.views[st.slot] = views
        self.state = st = replace(st, patching=False)
        if self.slots.config.slots == 1:
            self.subscriber.restore(views, mdata, verify=False)  # verified by the caller
            self.work = st.slot
        else:
            self.resume_standby(st)
        self.states.save(self.state)
        if self.slots.current() != st.slot:
            self.slots.switch_current(st.slot)

    def resume_standby(self, st: DaemonState) -> None:
        """Hold the standby slot's weights if its digests prove the version recorded for it;
        otherwise record it untrusted (``ready_standby`` repairs it from ``current``)."""
        standby = self.slots.other(st.slot)
        if st.standby_version is not None and st.standby_manifest_xxh3_128 is not None:
            try:
                sdata = self.states.manifest(st.standby_version, st.standby_manifest_xxh3_128)
                sviews = self.slots.map(standby, expected_files=listed(parse_manifest(sdata, where="standby")))
                self.subscriber.restore(sviews, sdata)  # re-hashed: never trust a half-patched file
                self.views[standby] = sviews
                self.work = standby
                return
            except XclusterError as exc:
                log.warning("standby slot %s does not prove version %d (%s); repairing it from slot %s", standby,
                            st.standby_version, exc, st.slot)
                self.count_error(exc)
        self.state = replace(st, standby_version=None, standby_manifest_xxh3_128=None)

    def work_slot(self) -> str:
        """The slot new versions go into: the one ``current`` does not name (with one slot, that one)."""
        st = self.state
        if st is None:
            return self.slots.names[0]
        return self.slots.other(st.slot)

    def mark_dirty(self) -> None:
        """Record the slot about to be patched as untrusted, before anything touches it (with one
        slot, ``current`` is unlinked too: an engine (re)started meanwhile finds nothing)."""
        st = self.state
        if st is None:
            return
        if self.slots.config.slots == 1:
            self.slots.unlink_current()
            self.state = replace(st, patching=True)
        else:
            self.state = replace(st, standby_version=None, standby_manifest_xxh3_128=None)
        self.states.save(self.state)
        work = self.work_slot()
        if self.slots.exists(work):
            self.slots.untag(work)

    def mark_clean(self) -> None:
        """The work slot holds the recorded version again (an undone patch): flush, record, relink."""
        st = self.state
        if st is None:
            return
        work = self.work_slot()
        if self.work != work or self.subscriber.version != st.version or work not in self.views \
                or not self.subscriber.verified \
                or not backed_by(self.subscriber.state_dict(copy=False), self.views[work]):
            return  # not provably whole: ready_standby repairs it
        self.slots.flush(work)
        self.slots.tag(work, st.version, st.model_digest)
        if self.slots.config.slots == 1:
            self.state = replace(st, patching=False)
            self.states.save(self.state)
            self.slots.switch_current(st.slot)
        else:
            self.state = replace(st, standby_version=st.version, standby_manifest_xxh3_128=st.manifest_xxh3_128)
            self.states.save(self.state)

    def allocate(self, m: Manifest, where: str) -> dict[int, torch.Tensor] | None:
        """A full version is written straight into a fresh directory for the work slot (so it never
        sits in memory as well); the slot's old files are dropped first, so a keyframe costs no
        third copy of the model. Other versions allocate in memory (the rare new tensor)."""
        if any(t.init == INIT_BASE for t in m.tensors) or m.kind not in FULL_KINDS:
            return None
        if self.replaying:  # the install recorded no standby version across a keyframe: never here
            raise ChainBrokenError(f"{where}: a full version between the standby's version and current's; "
                                   "the standby is copied instead")
        work = self.work_slot()
        self.subscriber.release()  # it held the work slot's files: they are about to be replaced
        self.views.pop(work, None)
        self.work = None
        self.slots.discard(work)
        pending = self.slots.layout(work, [(t.name, torch_dtype(t.dtype), t.shape) for t in m.tensors])
        self.pending.append(pending)
        return {i: pending.tensors[t.name] for i, t in enumerate(m.tensors)}

    def ready_standby(self, *, engine_behind: bool) -> bool:
        """Two slots: make the subscriber hold the standby slot, at ``current``'s version. The
        standby is brought forward by the deltas it lacks (their chunks are cached), or, after a
        keyframe or when that fails, repaired as a byte copy of ``current``'s slot, re-verified.
        One slot: the subscriber holds it already. False if the standby could not be made ready."""
        st = self.state
        if st is None or self.slots.config.slots == 1:
            return True
        standby = self.slots.other(st.slot)
        if not engine_behind and self.work == standby and self.subscriber.version == st.version and \
                (st.standby_version == st.version or self.replayed == (standby, st.version)):
            return True
        t0 = time.perf_counter()
        try:
            if engine_behind or not self.replay(st, standby):
                self.repair(st, standby)
        except (OSError, XclusterError) as exc:
            log.error("could not bring standby slot %s to version %d: %s", standby, st.version, exc)
            self.count_error(exc)
            return False
        self.metrics.catch_up_seconds.observe(time.perf_counter() - t0)
        self.subscriber.prune_chunk_cache(st.version)  # both slots have every version up to it
        return True

    def replay(self, st: DaemonState, standby: str) -> bool:
        """Apply to the standby the deltas from its recorded version to ``st.version``; False when
        it cannot (nothing proven there, a keyframe between, a failure: all logged)."""
        base = st.standby_version
        if base is None or st.standby_manifest_xxh3_128 is None:
            return False
        if not (self.work == standby and self.subscriber.version == base and standby in self.views):
            try:
                bdata = self.states.manifest(base, st.standby_manifest_xxh3_128)
                views = self.views.get(standby) or self.slots.map(standby)
                self.subscriber.restore(views, bdata, verify=False)  # verified when it held that version
                self.views[standby] = views
                self.work = standby
            except XclusterError as exc:
                log.warning("standby slot %s cannot be read (%s); repairing it", standby, exc)
                return False
        if base != st.version:
            self.state = st = replace(st, standby_version=None, standby_manifest_xxh3_128=None)
            self.states.save(st)  # untrusted while patched
            self.slots.untag(standby)
            self.replaying = True
            try:  # versions verified before, onto their proven base: hashed once, at the next version
                self.subscriber.sync(until=st.version, poll=False, verify=False)
            except XclusterError as exc:
                log.warning("replaying versions %d..%d onto standby slot %s failed (%s: %s); repairing it from "
                            "slot %s", base + 1, st.version, standby, type(exc).__name__, exc, st.slot)
                return False
            finally:
                self.replaying = False
        snap = self.subscriber.snapshot(copy=False)
        if snap.version != st.version or snap.manifest_xxh3_128 != st.manifest_xxh3_128 \
                or not backed_by(snap.state, self.views[standby]):
            return False
        self.metrics.slot_bytes_written.labels("patch").inc(self.patched_bytes)
        self.patched_bytes = 0
        self.slots.set_files(standby, self.fetch_files(snap.manifest))
        if self.subscriber.verified:  # nothing replayed: it holds the version it was proven to hold
            self.slots.flush(standby)
            self.slots.tag(standby, st.version, st.model_digest)
            self.state = replace(st, standby_version=st.version, standby_manifest_xxh3_128=st.manifest_xxh3_128)
            self.states.save(self.state)
        else:  # recorded untrusted, untagged: the next version, applied on top, verifies every tensor
            self.replayed = (standby, st.version)
            log.info("standby slot %s brought to version %d by the deltas since %d", standby, st.version, base)
        return True

    def repair(self, st: DaemonState, standby: str) -> None:
        """The standby as a byte copy of ``current``'s slot, proven by its digests (its old files
        go first: a copy beside them would be a third model's worth)."""
        self.subscriber.release()
        self.views.pop(standby, None)
        self.work = None
        self.slots.discard(standby)
        self.slots.copy(st.slot, standby)
        self.metrics.slot_bytes_written.labels("copy").inc(self.slots.slot_bytes(standby))
        mdata = self.states.manifest(st.version, st.manifest_xxh3_128)
        views = self.slots.map(standby)
        self.subscriber.restore(views, mdata)
        self.slots.tag(standby, st.version, st.model_digest)
        self.views[standby] = views
        self.work = standby
        self.state = replace(st, standby_version=st.version, standby_manifest_xxh3_128=st.manifest_xxh3_128)
        self.states.save(self.state)
        log.info("standby slot %s repaired as a copy of slot %s (version %d)", standby, st.slot, st.version)

    def install(self, snap: Snapshot, files: dict[str, bytes], committed_unix_ms: int | None) -> Path:
        """Make the held version's slot durable and complete, record it, switch ``current`` to it;
        returns the slot's path."""
        m = snap.manifest
        assert m is not None and snap.version is not None and snap.manifest_data is not None
        work = self.work_slot()
        pending: Pending | None = next((p for p in self.pending if backed_by(snap.state, p.tensors)), None)
        if pending is not None:  # a keyframe written into its fresh directory
            self.pending.remove(pending)
            views = self.slots.commit(pending, files)
            self.metrics.slot_bytes_written.labels("full").inc(m.model_bytes)
        elif self.work == work and backed_by(snap.state, self.views.get(work, {})):  # patched in place
            self.slots.set_files(work, files)
            self.slots.flush(work)
            views = self.views[work]
            self.metrics.slot_bytes_written.labels("patch").inc(self.patched_bytes)
        else:  # new tensors, or nothing mapped yet: one full write
            views = self.slots.write(work, snap.state, files)
            self.subscriber.rebind(views)
            self.metrics.slot_bytes_written.labels("full").inc(m.model_bytes)
        self.patched_bytes = 0
        self.views[work] = views
        self.work = work
        self.replayed = None
        self.slots.tag(work, snap.version, m.model_digest)
        saw_full, self.saw_full = self.saw_full, False  # the standby then gets a copy, not a replay
        prev = self.state
        two = self.slots.config.slots == 2
        st = DaemonState(version=snap.version, model_digest=m.model_digest,
                         manifest_xxh3_128=snap.manifest_xxh3_128, committed_unix_ms=committed_unix_ms,
                         engine_version=prev.engine_version if prev else None, slot=work,
                         standby_version=prev.version if two and prev and not saw_full else None,
                         standby_manifest_xxh3_128=prev.manifest_xxh3_128 if two and prev else None)
        if st.standby_version is None:
            st = replace(st, standby_manifest_xxh3_128=None)
        self.states.save(st, snap.manifest_data)
        self.slots.switch_current(work)
        self.state = st
        return self.slots.path(work)
