"""Transport benchmark: xcluster's S3Store vs ``aws s3 cp`` on one SeaweedFS server.

    sudo .venv/bin/python bench/transport.py            # loopback and emulated WAN
    .venv/bin/python bench/transport.py --no-wan         # loopback only (no root needed)

Two networks, side by side in one run:

* loopback: SeaweedFS on 127.0.0.1, client in this namespace.
* WAN: two network namespaces this script creates (``xcb-srv`` holding 10.201.0.2 with the
  server, ``xcb-cli`` holding 10.201.0.1 with the clients), joined by a veth pair with a
  ``tc tbf`` bandwidth cap on both ends (``--rate``, 1 Gbit/s), and tests/support/faultproxy.py
  in ``xcb-cli`` adding ``--rtt-ms`` (40 ms) to every request/response round trip (tc here has
  tbf but not netem; the proxy delays each exchange, not each packet, so TCP slow start does not
  see the RTT). The namespaces are removed on exit, also on failure.

Each transfer runs in a subprocess of its own so its peak RSS (``wait4``) is its alone; the
xcluster process holds the object in memory (its API takes and returns bytes), ``aws s3 cp``
streams from/to a file in /dev/shm. The server's data also lives in /dev/shm, so no disk is timed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MiB = 1 << 20
NS_SRV, NS_CLI = "xcb-srv", "xcb-cli"
IP_SRV, IP_CLI = "10.201.0.2", "10.201.0.1"
BUCKET = "bench"


def _env(endpoint: str) -> dict[str, str]:
    from tests.support.seaweed import ACCESS_KEY, SECRET_KEY

    return {**os.environ, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint,
            "AWS_CONFIG_FILE": "/dev/null", "AWS_SHARED_CREDENTIALS_FILE": "/dev/null"}


def _timed(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Run ``cmd``; return (seconds it reports or wall time, peak RSS MiB of that process)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    out, err = proc.stdout.read().decode(), proc.stderr.read().decode()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[:6]} failed ({proc.returncode}): {err[-2000:]}")
    seconds = json.loads(out.strip().splitlines()[-1])["seconds"] if out.strip().startswith("{") else wall
    return seconds, usage.ru_maxrss / 1024


# --- one transfer, in its own process -------------------------------------------------------------
def op_main(args: argparse.Namespace) -> None:
    from xcluster.store.s3.store import S3Config, S3Store

    store = S3Store.from_url(f"s3://{BUCKET}/xc", config=S3Config(addressing_style="path"))
    if args.op == "put":
        data = Path(args.file).read_bytes()
        t0 = time.perf_counter()
        store.put(args.key, data)
    elif args.op == "get":
        t0 = time.perf_counter()
        blob = store.get(args.key)
        assert blob is not None and len(blob.data) == args.size
    elif args.op == "latency":
        print(json.dumps(_latency(store, args.poll)))
        return
    else:  # small-object round trips: median of 20 GETs of 4 KiB
        store.put("small", os.urandom(4096))
        times = []
        for _ in range(20):
            t = time.perf_counter()
            store.get("small")
            times.append(time.perf_counter() - t)
        print(json.dumps({"seconds": statistics.median(times)}))
        return
    print(json.dumps({"seconds": time.perf_counter() - t0}))


def _latency(store, poll: float, versions: int = 6) -> dict:
    """Publisher and subscriber (polling every ``poll`` s) on one store: from HEAD committed to the
    delta applied and verified, for 1%-density deltas of a 32 MiB bf16 model."""
    import threading

    import torch

    from xcluster import Publisher, PublisherConfig, Subscriber

    g = torch.Generator().manual_seed(0)
    w = (torch.randn(16 * MiB, generator=g) * 0.02).to(torch.bfloat16)
    applied: dict[int, float] = {}
    done = threading.Event()
    sub = Subscriber(store=store, on_apply=lambda ev: applied.__setitem__(ev.version, ev.applied_unix))

    def follow() -> None:
        while not done.is_set():
            sub.sync()
            time.sleep(poll)

    pub = Publisher(store=store, config=PublisherConfig(keyframe_every=1000))
    pub.publish({"w": w})
    thread = threading.Thread(target=follow, daemon=True)
    thread.start()
    lat, sizes = [], []
    for _ in range(versions):
        w = w.clone()
        idx = torch.randperm(w.numel(), generator=g)[: w.numel() // 100]
        w.view(torch.int16)[idx] += 1
        time.sleep(poll * torch.rand(1, generator=g).item())  # commit at a random phase of the poll
        res = pub.publish({"w": w})
        deadline = time.time() + 30
        while res.version not in applied and time.time() < deadline:
            time.sleep(0.001)
        lat.append(applied[res.version] - res.committed_unix)
        sizes.append(res.bytes_written)
    done.set()
    thread.join()
    return {"seconds": statistics.median(lat), "max": max(lat), "bytes": int(statistics.median(sizes)),
            "poll": poll}


# --- a suite of transfers against one endpoint ----------------------------------------------------
def suite(endpoint: str, files: dict[int, str], repeats: int, *, poll: float, rtt_s: float = 0.0,
          link_bytes_s: float | None = None) -> list[dict]:
    env = _env(endpoint)
    py = [sys.executable, str(Path(__file__).resolve()), "op"]
    subprocess.run(["aws", "s3api", "create-bucket", "--bucket", BUCKET], env=env, check=True,
                   capture_output=True)
    rows = []
    for size, path in sorted(files.items(), reverse=True):
        n = 1 if size >= 256 * MiB else repeats
        for tool in ("xcluster", "aws s3 cp"):
            for op in ("put", "get"):
                key = f"obj-{size}"
                if tool == "xcluster":
                    cmd = py + [op, "--key", key, "--file", path, "--size", str(size)]
                elif op == "put":
                    cmd = ["aws", "s3", "cp", "--only-show-errors", path, f"s3://{BUCKET}/aws/{key}"]
                else:
                    cmd = ["aws", "s3", "cp", "--only-show-errors", f"s3://{BUCKET}/aws/{key}",
                           "/dev/shm/xcb-download"]
                runs = [_timed(cmd, env) for _ in range(n)]
                secs = statistics.median(r[0] for r in runs)
                rows.append({"tool": tool, "op": op, "size": size, "seconds": secs,
                             "rss_mib": max(r[1] for r in runs), "runs": n})
                print(f"  {tool:9} {op} {size / MiB:6.0f} MiB: {secs:7.3f} s", file=sys.stderr)
    small = _timed(py + ["small", "--key", "small", "--file", "", "--size", "4096"], env)
    rows.append({"tool": "xcluster", "op": "get 4 KiB", "size": 4096, "seconds": small[0],
                 "rss_mib": small[1], "runs": 20})
    out = subprocess.run(py + ["latency", "--key", "-", "--poll", str(poll)], env=env, check=True,
                         capture_output=True, text=True).stdout
    lat = json.loads(out.strip().splitlines()[-1])
    bound = poll + 2 * rtt_s + (lat["bytes"] / link_bytes_s if link_bytes_s else 0.0)
    rows.append({"tool": "xcluster", "op": f"delta commit → applied (median; max {lat['max'] * 1000:.0f} ms; "
                 f"bound poll {poll * 1000:.0f} + 2 RTT + bytes/bw = {bound * 1000:.0f} ms)",
                 "size": lat["bytes"], "seconds": lat["seconds"], "rss_mib": 0, "runs": 6})
    t = [_timed(["aws", "s3api", "head-bucket", "--bucket", BUCKET], env) for _ in range(3)]
    rows.append({"tool": "aws s3api", "op": "head-bucket (CLI start-up + 1 request)", "size": 0,
                 "seconds": min(x[0] for x in t), "rss_mib": max(x[1] for x in t), "runs": 3})
    Path("/dev/shm/xcb-download").unlink(missing_ok=True)
    return rows


def inner_main(args: argparse.Namespace) -> None:
    """Runs inside ``xcb-cli``: the latency proxy, then the suite through it."""
    from tests.support.faultproxy import FaultProxy

    files = json.loads(args.files)
    with FaultProxy((IP_SRV, args.port), latency_s=args.rtt_ms / 1000) as proxy:
        rows = suite(proxy.endpoint, {int(k): v for k, v in files.items()}, args.repeats, poll=args.poll,
                     rtt_s=args.rtt_ms / 1000, link_bytes_s=_rate_mb_s(args.rate) * 1e6)
    print(json.dumps(rows))


# --- the emulated WAN -----------------------------------------------------------------------------
def _sh(*cmd: str, check: bool = True) -> None:
    subprocess.run(list(cmd), check=check, capture_output=True)


@contextmanager
def wan(rate: str):
    """Two namespaces joined by a rate-capped veth pair; removed on exit."""
    for ns in (NS_SRV, NS_CLI):
        _sh("ip", "netns", "del", ns, check=False)  # leftovers of a killed run
    try:
        _sh("ip", "netns", "add", NS_SRV)
        _sh("ip", "netns", "add", NS_CLI)
        _sh("ip", "link", "add", "xcb0", "netns", NS_CLI, "type", "veth", "peer", "name", "xcb1",
            "netns", NS_SRV)
        for ns, dev, ip in ((NS_CLI, "xcb0", IP_CLI), (NS_SRV, "xcb1", IP_SRV)):
            run = ("ip", "netns", "exec", ns)
            _sh(*run, "ip", "link", "set", "lo", "up")
            _sh(*run, "ip", "addr", "add", f"{ip}/30", "dev", dev)
            _sh(*run, "ip", "link", "set", dev, "up")
            _sh(*run, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                "burst", "1mb", "latency", "50ms")
        yield
    finally:
        for ns in (NS_SRV, NS_CLI):
            _sh("ip", "netns", "del", ns, check=False)


def _rate_mb_s(rate: str) -> float:
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3}
    for unit, mult in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * mult / 8 / 1e6
    raise SystemExit(f"--rate {rate!r}: use e.g. 1gbit or 500mbit")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd")
    op = sub.add_parser("op")
    op.add_argument("op", choices=["put", "get", "small", "latency"])
    op.add_argument("--poll", type=float, default=0.05)
    op.add_argument("--key", required=True)
    op.add_argument("--file", default="")
    op.add_argument("--size", type=int, default=0)
    inner = sub.add_parser("inner")
    inner.add_argument("--port", type=int, required=True)
    inner.add_argument("--files", required=True)
    inner.add_argument("--rtt-ms", type=float, default=40)
    inner.add_argument("--repeats", type=int, default=5)
    inner.add_argument("--poll", type=float, default=0.05)
    inner.add_argument("--rate", default="1gbit")
    ap.add_argument("--big-mib", type=int, default=1024)
    ap.add_argument("--small-mib", type=int, default=8)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--rtt-ms", type=float, default=40)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-wan", action="store_true")
    ap.add_argument("--poll", type=float, default=0.05, help="subscriber poll interval for the latency row")
    args = ap.parse_args()
    if args.cmd == "op":
        return op_main(args)
    if args.cmd == "inner":
        return inner_main(args)
    if shutil.which("aws") is None:
        raise SystemExit("the AWS CLI is not on PATH")
    if not args.no_wan and os.geteuid() != 0:
        raise SystemExit("the WAN part needs root (network namespaces, tc); or pass --no-wan")

    from tests.support.seaweed import start_seaweedfs

    files = {}
    with ExitStack() as stack:
        for mib in (args.big_mib, args.small_mib):
            path = f"/dev/shm/xcb-src-{mib}"
            with open(path, "wb") as f:
                for _ in range(mib):
                    f.write(os.urandom(MiB))
            stack.callback(Path(path).unlink, missing_ok=True)
            files[mib * MiB] = path
        results = {}
        print("loopback ...", file=sys.stderr)
        with start_seaweedfs(data_root="/dev/shm") as sw:
            results["loopback"] = suite(sw.endpoint, files, args.repeats, poll=args.poll)
        if not args.no_wan:
            label = f"WAN {args.rate}, +{args.rtt_ms:.0f} ms RTT"
            print(f"{label} ...", file=sys.stderr)
            with wan(args.rate), start_seaweedfs(host=IP_SRV, netns=NS_SRV, data_root="/dev/shm") as sw:
                port = int(sw.endpoint.rsplit(":", 1)[1])
                out = subprocess.run(
                    ["ip", "netns", "exec", NS_CLI, sys.executable, str(Path(__file__).resolve()),
                     "inner", "--port", str(port), "--files", json.dumps(files),
                     "--rtt-ms", str(args.rtt_ms), "--repeats", str(args.repeats), "--poll", str(args.poll),
                     "--rate", args.rate],
                    check=True, stdout=subprocess.PIPE, text=True).stdout
                results[label] = json.loads(out.strip().splitlines()[-1])
    print(f"\n| network | tool | op | size | time | MB/s | % of link | peak RSS |")
    print("|---|---|---|---|---|---|---|---|")
    for net, rows in results.items():
        cap = None if net == "loopback" else _rate_mb_s(args.rate)
        for r in rows:
            size = f"{r['size'] / MiB:.0f} MiB" if r["size"] >= MiB else f"{r['size'] / 1024:.0f} KiB"
            if r["size"] >= MiB:
                mbs = r["size"] / r["seconds"] / 1e6
                pct = f"{100 * mbs / cap:.0f}%" if cap else "–"
                rate = f"{mbs:.0f}"
                t = f"{r['seconds']:.2f} s"
            else:
                rate, pct, t = "–", "–", f"{r['seconds'] * 1000:.1f} ms"
            rss = f"{r['rss_mib']:.0f} MiB" if r["rss_mib"] else "–"
            print(f"| {net} | {r['tool']} | {r['op']} | {size} | {t} | {rate} | {pct} | {rss} |")


if __name__ == "__main__":
    main()
