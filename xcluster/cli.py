"""``xcluster`` command line: demo, ls, verify. It only fills in configs and calls the library."""

from __future__ import annotations

import argparse
import re
import sys
import time

from .errors import ObjectNotFoundError, XclusterError


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n}"


def cmd_ls(args: argparse.Namespace) -> int:
    from .format import HEAD_KEY, manifest_key, parse_head, parse_manifest
    from .store import open_store

    store = open_store(args.url)
    try:
        blob = store.get(HEAD_KEY)
        head = parse_head(blob.data).version if blob else 0
    except ObjectNotFoundError:
        head = 0
    versions = sorted({int(m.group(1)) for k in store.list("versions/")
                       if (m := re.fullmatch(r"versions/(\d{12})/manifest\.json", k))})
    if not versions:
        print(f"{args.url}: no versions")
        return 0
    hdr = f"{'version':>8} {'kind':<9} {'base':>6} {'step':>6} {'chunks':>6} {'bytes':>11} {'ratio':>8} " \
          f"{'changed':>8} {'created (UTC)':<20} state"
    print(hdr)
    for v in versions:
        key = manifest_key(v)
        data = store.get(key).data
        m = parse_manifest(data, where=key)
        total = m.chunk_bytes + len(data)
        ratio = total / m.model_bytes if m.model_bytes else 0.0
        changed = m.changed_elements / m.total_elements if m.total_elements else 0.0
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(m.created_unix_ms / 1000))
        state = "HEAD" if v == head else ("committed" if v < head else "uncommitted")
        print(f"{v:>8} {m.kind:<9} {m.base_version or '-':>6} {m.step if m.step is not None else '-':>6} "
              f"{len(m.chunks):>6} {_human(total):>11} {ratio:>8.2%} {changed:>8.3%} {created:<20} {state}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from .subscriber import Subscriber, SubscriberConfig

    def report(ev) -> None:
        print(f"  version {ev.version:>6} {ev.kind:<9} {_human(ev.bytes_fetched):>11}  digest {ev.model_digest} ✓")

    sub = Subscriber(args.url, config=SubscriberConfig(), on_apply=report)
    t0 = time.perf_counter()
    v = sub.sync(until=args.version)
    if v is None:
        print(f"{args.url}: empty store, nothing to verify")
        return 1
    print(f"verified version {v}: every chunk checksum and tensor digest matched "
          f"({len(sub.manifest.tensors)} tensors, {_human(sub.manifest.model_bytes)}) in {time.perf_counter() - t0:.2f}s")
    return 0


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
    ver.set_defaults(func=cmd_verify)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except XclusterError as exc:
        print(f"xcluster: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
