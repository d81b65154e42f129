"""``xcluster`` command line: demo, subscribe, status, gc, ls, verify, keygen. It only fills in
configs and calls the library (relay included)."""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import time

from .errors import XclusterError


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n}"


def cmd_ls(args: argparse.Namespace) -> int:
    from .read.chain import Link, read_head, read_manifest
    from .errors import ChainBrokenError
    from .format import is_manifest_name, manifest_key, parse_manifest
    from .format.packing import unpack
    from .store import open_store

    store = open_store(args.url)
    head, _ = read_head(store)
    found: dict[int, list[str]] = {}
    for k in store.list("versions/"):
        if (m := re.fullmatch(r"versions/(\d{12})/([^/]+)", k)) and is_manifest_name(m.group(2)):
            found.setdefault(int(m.group(1)), []).append(m.group(2))
    if not found:
        print(f"{args.url}: no versions")
        return 0
    # the committed manifests: followed back from HEAD by their hash links (prev_manifest crosses
    # keyframes; a store written before it is linked back to HEAD's keyframe only)
    linked: dict[int, str] = {}
    if head is not None:
        link: Link | None = Link.of_head(head)
        try:
            while link is not None and link.version in found:
                linked[link.version] = link.manifest
                link = Link.prev_of(read_manifest(store, link).manifest)
        except (ChainBrokenError, XclusterError) as exc:
            print(f"warning: HEAD's chain is broken at version {link.version}: {exc}", file=sys.stderr)
    hdr = f"{'version':>8} {'kind':<9} {'base':>6} {'step':>6} {'chunks':>6} {'bytes':>11} {'ratio':>8} " \
          f"{'changed':>8} {'created (UTC)':<20} state"
    print(hdr)
    for v in sorted(found):
        for name in sorted(found[v]):
            key = manifest_key(v, name)
            data = store.get(key).data
            try:
                m = parse_manifest(unpack(data, where=key), where=key)
            except XclusterError as exc:
                print(f"{v:>8} {'?':<9} {'':>6} {'':>6} {'':>6} {'':>11} {'':>8} {'':>8} {'':<20} unreadable: {exc}")
                continue
            total = m.chunk_bytes + len(data)
            ratio = total / m.model_bytes if m.model_bytes else 0.0
            changed = m.changed_elements / m.total_elements if m.total_elements else 0.0
            created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(m.created_unix_ms / 1000))
            if head is not None and v == head.version and linked.get(v) == name:
                state = "HEAD"
            elif linked.get(v) == name:
                state = "committed"
            elif head is not None and v < min(linked, default=head.version) and len(found[v]) == 1:
                state = "not linked from HEAD (written before prev_manifest, or its successor was removed)"
            else:
                state = "uncommitted (left by a failed attempt: xcluster gc removes it)"
            print(f"{v:>8} {m.kind:<9} {m.base_version or '-':>6} {m.step if m.step is not None else '-':>6} "
                  f"{len(m.chunks):>6} {_human(total):>11} {ratio:>8.2%} {changed:>8.3%} {created:<20} {state}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from .read.subscriber import Subscriber, SubscriberConfig

    def report(ev) -> None:
        print(f"  version {ev.version:>6} {ev.kind:<9} {_human(ev.bytes_fetched):>11}  digest {ev.model_digest} ✓")

    sub = Subscriber(args.url, config=SubscriberConfig(trusted_keys=tuple(args.trust), run_id=args.run_id),
                     on_apply=report)
    t0 = time.perf_counter()
    v = sub.sync(until=args.version)
    if v is None:
        print(f"{args.url}: empty store, nothing to verify")
        return 1
    m = sub.manifest
    signed = ""
    if sub.verifier is not None:
        signed = f"; HEAD and every manifest signed by a trusted key (version {v}: key {m.signature.key_id})"
    elif m.signature is not None:
        signed = f"; signed by key {m.signature.key_id} but NOT checked (pass --trust KEY.pub)"
    print(f"verified version {v} of run {m.run_id or '-'}: every chunk checksum and tensor digest matched "
          f"({len(m.tensors)} tensors, {_human(m.model_bytes)}) in {time.perf_counter() - t0:.2f}s{signed}")
    return 0


def cmd_keygen(args: argparse.Namespace) -> int:
    from .trust.signing import generate_keypair

    priv, pub, kid = generate_keypair(args.path)
    print(f"key {kid}\n  private (the trainer's; keep it secret): {priv}\n  public (give to subscribers: --trust): {pub}")
    return 0


def cmd_subscribe(args: argparse.Namespace) -> int:
    import os
    from pathlib import Path

    from .follow.daemon import Daemon, DaemonConfig, default_node_id
    from .follow.handoff import HandoffConfig, make_handoff
    from .follow.logs import setup_logging
    from .follow.metrics import DaemonMetrics
    from .follow.slots import SlotsConfig
    from .read.subscriber import SubscriberConfig

    setup_logging(args.log_format, args.log_level)
    if args.exec_cmd and args.engine == "none":
        args.engine = "exec"
    handoff = None
    if args.engine != "none":
        handoff = make_handoff(args.engine, url=args.engine_url, body=args.engine_body, exec_cmd=args.exec_cmd,
                               **_given(pause_mode=args.pause_mode, engine_update=args.engine_update),
                               config=HandoffConfig(**_given(timeout_s=args.handoff_timeout)))
    notify_socket = os.environ.get("NOTIFY_SOCKET")  # systemd's, read here and passed down
    poll = _or_default(args.poll, DaemonConfig, "poll_s")
    config = DaemonConfig(
        out=Path(args.out), poll_s=poll,
        backoff_max_s=max(_or_default(args.backoff_max, DaemonConfig, "backoff_max_s"), poll), once=args.once,
        node_id=args.node_id or default_node_id(), **_given(lease_every_s=args.lease_interval),
        slots=SlotsConfig(**_given(shard_bytes=args.shard_size, slots=args.slots)),
        subscriber=SubscriberConfig(**_given(fetch_workers=args.fetch_workers), trusted_keys=tuple(args.trust),
                                    run_id=args.run_id, max_staleness_s=args.max_staleness),
        notify=notify_socket is not None, notify_socket=notify_socket,
        progress=sys.stderr.isatty() and not args.no_progress, warm_up=not args.no_warm_up,
        write_checkpoints_every=args.write_checkpoints)
    metrics = DaemonMetrics()
    server = metrics.serve(args.metrics_port, addr=args.metrics_addr) if args.metrics_port else None
    daemon = Daemon(args.url, config=config, handoff=handoff, metrics=metrics)
    daemon.install_signal_handlers()
    try:
        return daemon.run()
    finally:
        if server is not None:
            server.shutdown()


def _add_subscribe(sub) -> None:
    p = sub.add_parser("subscribe", help="follow a store: apply each version, write a model directory, "
                       "hand it to the inference engine (runs until stopped)",
                       description="The rollout-node daemon. Every committed version is fetched, verified and "
                       "applied while the engine keeps serving, into the standby of two Hugging Face model "
                       "directories (OUT/slots/a, OUT/slots/b) whose files are patched in place; then OUT/current "
                       "is switched to it, the engine told to reload, and the other slot brought level.")
    p.add_argument("url", help="store URL: a path, file://, s3://bucket/prefix, …")
    p.add_argument("--out", required=True, help="directory for model directories and state (e.g. /dev/shm/xc)")
    p.add_argument("--poll", type=float, help="seconds between HEAD polls (default: DaemonConfig.poll_s)")
    p.add_argument("--backoff-max", type=float,
                   help="longest wait while failing, s (default: DaemonConfig.backoff_max_s)")
    p.add_argument("--once", action="store_true", help="apply and hand over what is there, then exit")
    p.add_argument("--engine", choices=["none", "vllm", "sglang", "http", "exec"], default="none",
                   help="how to hand a new directory to the engine (default none)")
    p.add_argument("--engine-url", help="engine base URL (vllm, sglang) or endpoint (http)")
    p.add_argument("--engine-body", help="--engine http: JSON body template with {path} and {version}")
    p.add_argument("--exec", dest="exec_cmd", help="--engine exec: command run with XCLUSTER_MODEL_DIR and "
                   "XCLUSTER_VERSION set")
    p.add_argument("--pause-mode", choices=["keep", "wait", "abort"],
                   help="vLLM: what happens to requests in flight during the switch (default: make_handoff's pause_mode)")
    p.add_argument("--engine-update", choices=["in-place", "reload"],
                   help="vLLM: in-place writes only each delta's changed elements into the running engine "
                   "(needs xcluster's worker extension in it, else it reloads), reload always reloads from the "
                   "directory (default: make_handoff's engine_update)")
    p.add_argument("--handoff-timeout", type=float,
                   help="seconds per hand-off request (default: HandoffConfig.timeout_s)")
    p.add_argument("--slots", type=int, choices=[1, 2],
                   help="2: patch a standby copy while the engine's stays whole; 1: one copy patched in place, "
                   "for engines that keep their own (default: SlotsConfig.slots)")
    p.add_argument("--shard-size", type=int,
                   help="bytes per safetensors shard (default: SlotsConfig.shard_bytes)")
    p.add_argument("--fetch-workers", type=int,
                   help="chunks fetched in parallel (default: SubscriberConfig.fetch_workers)")
    _add_trust(p)
    p.add_argument("--max-staleness", type=float, default=None, metavar="SECONDS",
                   help="refuse a HEAD committed longer ago than this (a frozen or replayed store; see "
                        "docs/SECURITY.md); what is held keeps being served")
    p.add_argument("--node-id", help="name in leases/<node-id>.json (default: hostname)")
    p.add_argument("--write-checkpoints", type=int, metavar="N",
                   help="write a checkpoint of the version held into the store followed whenever its newest is N "
                        "or more versions behind (a cluster-local store: joiners then start from a checkpoint that "
                        "never crossed the WAN; needs write access there). Default: never")
    p.add_argument("--lease-interval", type=float,
                   help="seconds between lease writes, 0: none (default: DaemonConfig.lease_every_s)")
    p.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus metrics on this port")
    p.add_argument("--metrics-addr", default="127.0.0.1", help="address for --metrics-port (default 127.0.0.1)")
    p.add_argument("--log-format", choices=["plain", "json"], default="plain")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--no-progress", action="store_true", help="no progress bar even on a terminal")
    p.add_argument("--no-warm-up", action="store_true",
                   help="do not load the codec's compiled loops in the background at start (they load on first "
                        "use, adding about a second to the first delta)")
    p.set_defaults(func=cmd_subscribe)


def cmd_status(args: argparse.Namespace) -> int:
    import json

    from .fleet.status import fleet_status
    from .store import open_store

    from .fleet.retention import RetentionConfig

    fs = fleet_status(open_store(args.url), lease_ttl_s=_or_default(args.lease_ttl, RetentionConfig, "lease_ttl_s"))
    if args.json:
        print(json.dumps({"head": fs.head.version if fs.head else None, "subscribers": [
            {"node": s.lease.node_id, "version": s.lease.version, "behind": s.behind, "staleness_s": s.staleness_s,
             "engine_state": s.lease.engine_state, "engine_version": s.lease.engine_version, "live": s.live,
             "engine_update": s.lease.engine_update, "engine_verified_version": s.lease.engine_verified_version,
             "lease_age_s": round(s.age_s, 3), "last_error": s.lease.last_error} for s in fs.subscribers],
            "unreadable_leases": fs.unreadable}, indent=1))
    else:
        print(f"{args.url}: HEAD {'none' if fs.head is None else fs.head.version}"
              f"{'' if fs.head is None else f' ({fs.head.kind}, keyframe {fs.head.keyframe_version})'}; "
              f"{len(fs.subscribers)} subscriber(s)")
        print(f"{'node':<24} {'version':>8} {'behind':>6} {'stale':>9} {'engine':<16} {'update':<10} "
              f"{'verified':<10} {'lease':<14} last error")
        for s in fs.subscribers:
            le = s.lease
            eng = le.engine_state + (f" v{le.engine_version}" if le.engine_version is not None else "")
            upd = le.engine_update or "-"
            ver = "-" if le.engine_verified_version is None else f"v{le.engine_verified_version}"
            if le.engine_version is not None and le.engine_verified_version not in (None, le.engine_version):
                ver += " UNPROVEN"  # the engine serves a version its own hashes did not prove
            stale = "-" if s.staleness_s is None else f"{s.staleness_s:.1f}s"
            lease = f"{'live' if s.live else 'EXPIRED'} {s.age_s:.0f}s"
            print(f"{le.node_id:<24} {le.version if le.version is not None else '-':>8} "
                  f"{s.behind if s.behind is not None else '-':>6} {stale:>9} {eng:<16} {upd:<10} {ver:<10} {lease:<14} "
                  f"{(le.last_error or '')[:100]}")
        for key in fs.unreadable:
            print(f"unreadable lease: {key}")
    if args.fail_if_behind is not None and any(
            s.live and (s.behind is None or s.behind > args.fail_if_behind) for s in fs.subscribers):
        return 3
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    from .fleet.retention import RetentionConfig, gc
    from .store import open_store

    report = gc(open_store(args.url), config=RetentionConfig(**_given(lease_ttl_s=args.lease_ttl, grace_s=args.grace)),
                apply=args.apply)
    verb = "deleted" if report.applied else "would delete"
    for key, size, why in report.deleted:
        print(f"{verb:>12} {_human(size):>11}  {key}  ({why})")
    for node, (a, b) in sorted(report.protected_by_leases.items()):
        print(f"kept versions {a}..{b} for live subscriber {node}")
    print(f"HEAD {report.head_version}: {verb} {len(report.deleted)} objects, {_human(report.bytes)}; "
          f"kept {report.kept}{'' if report.applied else ' (dry run: --apply to delete)'}")
    return 0


def cmd_relay(args: argparse.Namespace) -> int:
    from .follow.logs import setup_logging
    from .fleet.relay import Relay, RelayConfig, default_relay_id
    from .fleet.retention import RetentionConfig

    setup_logging(args.log_format, args.log_level)
    from .store import open_store

    retention = RetentionConfig(**_given(lease_ttl_s=args.gc_lease_ttl, grace_s=args.gc_grace)) if args.gc else None

    def side(url: str, profile: str | None, endpoint: str | None):
        if profile is None and endpoint is None:
            return open_store(url)
        from .store.s3.config import S3Config

        return open_store(url, s3=S3Config(profile=profile, endpoint_url=endpoint))

    poll = _or_default(args.poll, RelayConfig, "poll_s")
    relay = Relay(src_store=side(args.src, args.src_profile, args.src_endpoint),
                  dst_store=side(args.dst, args.dst_profile, args.dst_endpoint), config=RelayConfig(
        poll_s=poll, backoff_max_s=max(_or_default(args.backoff_max, RelayConfig, "backoff_max_s"), poll),
        once=args.once, **_given(workers=args.workers, lease_every_s=args.lease_interval),
        node_id=args.node_id or default_relay_id(),
        trusted_keys=tuple(args.trust), gc=retention))
    restore = relay.install_signal_handlers()
    try:
        code = relay.run()
    finally:
        restore()
    s = relay.stats
    print(f"relay stopped at version {relay.version}: {s.versions_copied} version(s), {s.objects_copied} object(s) "
          f"copied ({_human(s.bytes_from_source)} read from the source), {s.objects_present} already present",
          file=sys.stderr)
    return code


def _add_relay(sub) -> None:
    p = sub.add_parser("relay", help="mirror a remote store into a cluster-local one, verbatim and in commit "
                       "order: one WAN copy per cluster (runs until stopped)")
    p.add_argument("src", help="the remote store (URL)")
    p.add_argument("dst", help="the cluster-local store its subscribers read (URL)")
    for end in ("src", "dst"):
        p.add_argument(f"--{end}-profile", help=f"AWS profile for the {end} store (its credentials and "
                       "endpoint_url; default: the standard chain)")
        p.add_argument(f"--{end}-endpoint", help=f"S3 endpoint URL of the {end} store (default: the profile's, "
                       "$AWS_ENDPOINT_URL_S3, $AWS_ENDPOINT_URL, else AWS)")
    p.add_argument("--poll", type=float, help="seconds between polls of the source's HEAD (default: "
                   "RelayConfig.poll_s)")
    p.add_argument("--backoff-max", type=float, help="longest wait while failing, s (default: "
                   "RelayConfig.backoff_max_s)")
    p.add_argument("--once", action="store_true", help="copy what is there, then exit")
    p.add_argument("--workers", type=int, help="objects copied in parallel (default: RelayConfig.workers)")
    p.add_argument("--node-id", help="name of this relay's lease in the source (default: relay-<hostname>)")
    p.add_argument("--lease-interval", type=float,
                   help="seconds between lease writes, 0: none (default: RelayConfig.lease_every_s)")
    p.add_argument("--trust", action="append", default=[], metavar="KEY.pub",
                   help="copy only versions signed by this key (subscribers check again)")
    p.add_argument("--gc", action="store_true", help="after each keyframe, run retention on the destination "
                   "by its subscribers' leases")
    p.add_argument("--gc-grace", type=float,
                   help="with --gc: never delete younger objects, s (default: RetentionConfig.grace_s)")
    p.add_argument("--gc-lease-ttl", type=float,
                   help="with --gc: leases fresher than this protect, s (default: RetentionConfig.lease_ttl_s)")
    p.add_argument("--log-format", choices=["plain", "json"], default="plain")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=cmd_relay)


def _add_trust(p) -> None:
    p.add_argument("--trust", action="append", default=[], metavar="KEY.pub",
                   help="accept only versions signed by this Ed25519 public key (repeat for a rotation; "
                        "default: $XCLUSTER_TRUSTED_KEYS / $XCLUSTER_TRUSTED_KEY_FILES, else unchecked)")
    p.add_argument("--run-id", default=None, help="accept only versions of this training run")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="xcluster", description="Lossless delta transport of model weights.")
    sub = p.add_subparsers(dest="command", required=True)
    from .demo import register

    register(sub)
    ls = sub.add_parser("ls", help="list the versions in a store")
    ls.add_argument("url", help="store URL: a path, file://, s3://bucket/prefix, memory://…")
    ls.set_defaults(func=cmd_ls)
    ver = sub.add_parser("verify", help="reconstruct a version from its keyframe and check every digest")
    ver.add_argument("url")
    ver.add_argument("--version", type=int, default=None, help="version to verify (default: HEAD)")
    _add_trust(ver)
    ver.set_defaults(func=cmd_verify)
    kg = sub.add_parser("keygen", help="write a new Ed25519 signing key (PATH) and its public key (PATH.pub)")
    kg.add_argument("path")
    kg.set_defaults(func=cmd_keygen)
    _add_subscribe(sub)
    _add_relay(sub)
    st = sub.add_parser("status", help="the subscribers following a store, from their leases")
    st.add_argument("url")
    st.add_argument("--lease-ttl", type=float,
                    help="a lease older than this is expired, s (default: RetentionConfig.lease_ttl_s)")
    st.add_argument("--json", action="store_true")
    st.add_argument("--fail-if-behind", type=int, default=None,
                    help="exit 3 if a live subscriber is more than N versions behind HEAD (alerting)")
    st.set_defaults(func=cmd_status)
    g = sub.add_parser("gc", help="retention: delete what neither HEAD nor a live subscriber needs (dry run)")
    g.add_argument("url")
    g.add_argument("--apply", action="store_true", help="delete (default: only print what would go)")
    g.add_argument("--lease-ttl", type=float,
                   help="leases fresher than this protect, s (default: RetentionConfig.lease_ttl_s)")
    g.add_argument("--grace", type=float,
                   help="never delete objects younger than this, s (default: RetentionConfig.grace_s)")
    g.set_defaults(func=cmd_gc)
    return p


def _given(**options):
    """The options given on the command line (not None): the rest take their config's default,
    which the CLI never restates."""
    return {k: v for k, v in options.items() if v is not None}


def _or_default(value, config_cls, name: str):
    """``value``, else the default of field ``name`` of the dataclass ``config_cls``."""
    if value is not None:
        return value
    (f,) = [f for f in dataclasses.fields(config_cls) if f.name == name]
    return f.default


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except XclusterError as exc:
        print(f"xcluster: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
