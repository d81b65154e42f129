"""Load: a fleet of subscriber daemons following one store on SeaweedFS while a trainer publishes.

    .venv/bin/python bench/load.py                                   # 32 daemons, 30 versions, 30 s idle
    .venv/bin/python bench/load.py --subscribers 64 --procs 8 --versions 50 --interval 1

``--subscribers`` daemons (:class:`xcluster.follow.daemon.Daemon`, the code behind ``xcluster
subscribe``, with its default 1 s poll and 5 s lease unless told otherwise), spread as threads
over ``--procs`` worker processes; each daemon has its own store client and its own ``--out``
directory (under /dev/shm) and writes its own model directories and leases. A counting proxy
(tests/support/faultproxy.py, no faults) sits between the daemons and SeaweedFS; the trainer
(tests/support/soak.py's, its own process) writes to SeaweedFS directly, so the proxy sees only
what the fleet costs the server.

Reported:
- commit → applied latency per (daemon, version): from the trainer's commit time to the moment
  the daemon's directory of that version, or of a newer one, became ``current`` (p50 / p95 / max);
- server requests per version (all daemons, during the publishing window) and by method;
- starvation: every daemon applied every version or reached HEAD;
- idle cost: requests and bytes through the proxy while nothing is published, per daemon per
  hour, and for a 1,000-node fleet (with S3 Standard list prices as an illustration).

On a 2-core machine the daemons, SeaweedFS, the proxy and the trainer share the CPUs, so the
latencies are an upper bound for a real fleet, where each node has its own.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GET_PER_1K, PUT_PER_1K = 0.0004, 0.005  # USD, S3 Standard us-east-1 list prices (illustration only)


# --- a worker process: some daemons as threads ------------------------------------------------------
def worker_main(a: argparse.Namespace) -> int:
    import torch

    from xcluster.follow.daemon import Daemon, DaemonConfig

    torch.set_num_threads(1)
    out_lock = threading.Lock()

    def emit(rec: dict) -> None:
        with out_lock:
            sys.stdout.write(json.dumps(rec) + "\n")
            sys.stdout.flush()

    daemons = []
    for i in a.ids:
        d = Daemon(a.url, config=DaemonConfig(out=Path(a.out) / f"sub-{i:03d}", poll_s=a.poll,
                                              lease_every_s=a.lease_interval, node_id=f"load-{i:03d}"))
        d.on_update(lambda path, v, i=i: emit({"sub": i, "version": v, "t": time.time()}))
        daemons.append(d)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    threads = [threading.Thread(target=d.run, name=f"daemon-{i}") for d, i in zip(daemons, a.ids)]
    for t in threads:
        t.start()
    emit({"ready": list(a.ids)})
    stop.wait()
    for d in daemons:
        d.stop()
    for t in threads:
        t.join(timeout=60)
    return 0


# --- the orchestrator ---------------------------------------------------------------------------------
def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def main_run(a: argparse.Namespace) -> int:
    from tests.support.faultproxy import FaultProxy
    from tests.support.seaweed import ACCESS_KEY, SECRET_KEY, start_seaweedfs
    from tests.support.soak import ModelSpec, _client

    spec = ModelSpec(tensors=a.tensors, rows=a.rows, cols=a.cols)
    url = "s3://soak/load"
    base_env = {**os.environ, "PYTHONPATH": str(ROOT), "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}
    base_env.pop("AWS_PROFILE", None)
    events: dict[int, list[tuple[int, float]]] = {i: [] for i in range(a.subscribers)}
    ready: set[int] = set()
    lock = threading.Lock()

    def reader(proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            rec = json.loads(line)
            with lock:
                if "ready" in rec:
                    ready.update(rec["ready"])
                else:
                    events[rec["sub"]].append((rec["version"], rec["t"]))

    with tempfile.TemporaryDirectory(prefix="xc-load-", dir="/dev/shm") as tmp, \
            start_seaweedfs(data_root="/dev/shm") as sw:
        _client(sw.endpoint).create_bucket(Bucket="soak")
        host, port = sw.endpoint.rsplit("//", 1)[1].split(":")
        with FaultProxy((host, int(port))) as proxy:
            env = {**base_env, "AWS_ENDPOINT_URL": proxy.endpoint}
            ids = list(range(a.subscribers))
            groups = [ids[k::a.procs] for k in range(a.procs)]
            workers = []
            for g in groups:
                p = subprocess.Popen([sys.executable, __file__, "--worker", "--url", url, "--out", tmp,
                                      "--poll", str(a.poll), "--lease-interval", str(a.lease_interval),
                                      "--ids", *map(str, g)], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                     stderr=open(Path(tmp) / f"worker-{g[0]}.log", "wb"), text=True)
                workers.append(p)
                threading.Thread(target=reader, args=(p,), daemon=True).start()
            try:
                _wait(lambda: len(ready) == a.subscribers, 300, "workers to start")
                time.sleep(2 * a.poll + 1)
                # --- publishing window ---
                proxy.reset_traffic()
                journal = Path(tmp) / "journal.jsonl"
                t_pub = time.monotonic()
                pub = subprocess.run([sys.executable, "-m", "tests.support.soak", "publish", url, "--journal",
                                      str(journal), "--interval", str(a.interval), "--keyframe-every",
                                      str(a.keyframe_every), "--max-versions", str(a.versions), *spec.args()],
                                     env={**base_env, "AWS_ENDPOINT_URL": sw.endpoint}, cwd=ROOT,
                                     capture_output=True, text=True, timeout=3600)
                if pub.returncode != 0:
                    raise RuntimeError(f"trainer failed: {pub.stderr[-3000:]}")
                commits = {r["version"]: r["committed_unix"] for r in map(json.loads, journal.read_text().splitlines())}
                head = max(commits)

                def all_at_head() -> bool:
                    with lock:
                        return all(ev and ev[-1][0] == head for ev in events.values())
                caught_up = _wait(all_at_head, a.catch_up_timeout, "every daemon to reach HEAD", fail=False)
                publish_window = time.monotonic() - t_pub
                pub_req, pub_up, pub_down = proxy.traffic()
                by_method = dict(proxy.requests_by_method)
                # --- idle window ---
                time.sleep(a.poll + 0.5)
                proxy.reset_traffic()
                t_idle = time.monotonic()
                time.sleep(a.idle)
                idle_s = time.monotonic() - t_idle
                idle_req, idle_up, idle_down = proxy.traffic()
                idle_by_method = dict(proxy.requests_by_method)
            finally:
                for p in workers:
                    if p.poll() is None:
                        p.send_signal(signal.SIGTERM)
                for p in workers:
                    try:
                        p.wait(timeout=120)
                    except subprocess.TimeoutExpired:
                        p.kill()
                        p.wait()
    # --- the table ---
    lat, per_sub = [], []
    starving = []
    for i, ev in sorted(events.items()):
        applied = {v for v, _ in ev}
        for v, tc in commits.items():
            after = [t for av, t in ev if av >= v]
            if after:
                lat.append(min(after) - tc)
        reached = bool(ev) and ev[-1][0] == head
        every = all(v in applied for v in commits)
        per_sub.append((i, len(applied), reached))
        if not (reached or every):
            starving.append(i)
    n, ver = a.subscribers, len(commits)
    print(f"load: {n} daemons in {a.procs} processes (poll {a.poll:g}s, lease every {a.lease_interval:g}s), "
          f"{ver} versions every {a.interval:g}s (keyframe every {a.keyframe_every}), model "
          f"{spec.tensors}x{spec.rows}x{spec.cols} bf16 = {human(2 * spec.tensors * spec.rows * spec.cols)}; "
          f"SeaweedFS on 127.0.0.1, {os.cpu_count()} CPUs")
    rows = [
        ("commit → applied, p50 / p95 / max", f"{pct(lat, .5):.3f} / {pct(lat, .95):.3f} / {max(lat):.3f} s "
                                              f"({len(lat)} of {n * ver} daemon×version pairs)"),
        ("versions applied per daemon, min / max", f"{min(p[1] for p in per_sub)} / {max(p[1] for p in per_sub)} "
                                                   f"of {ver} (the rest were superseded before a poll)"),
        ("daemons at HEAD at the end", f"{sum(p[2] for p in per_sub)} of {n}; starving: {starving or 'none'}"
                                       f"{'' if caught_up else ' (timed out waiting)'}"),
        ("server requests per version (fleet)", f"{pub_req / ver:.1f} ({', '.join(f'{k} {v / ver:.1f}' for k, v in sorted(by_method.items()))}); "
                                                f"window {publish_window:.1f}s incl. idle polls and leases"),
        ("  of which fetching (minus idle rate)", f"{(pub_req - idle_req / idle_s * publish_window) / ver:.1f} requests, "
                                                  f"{human((pub_down - idle_down / idle_s * publish_window) / ver)} down"),
        ("  per daemon per version", f"{pub_req / ver / n:.2f} requests, {human(pub_down / ver / n)} down"),
        ("idle, per daemon per hour", f"{idle_req / n / idle_s * 3600:.0f} requests "
                                      f"({', '.join(f'{k} {v / n / idle_s * 3600:.0f}' for k, v in sorted(idle_by_method.items()))}), "
                                      f"{human(idle_up / n / idle_s * 3600)} up, {human(idle_down / n / idle_s * 3600)} down"),
    ]
    gets = sum(v for k, v in idle_by_method.items() if k in ("GET", "HEAD")) / n / idle_s * 3600 * 1000
    puts = sum(v for k, v in idle_by_method.items() if k not in ("GET", "HEAD")) / n / idle_s * 3600 * 1000
    rows.append(("idle, 1,000-node fleet per hour", f"{gets / 1e6:.2f} M GET + {puts / 1e6:.2f} M PUT, "
                 f"{human((idle_up + idle_down) / n / idle_s * 3600 * 1000)}; at S3 list prices "
                 f"${gets / 1000 * GET_PER_1K + puts / 1000 * PUT_PER_1K:.2f}/h "
                 f"(GET ${gets / 1000 * GET_PER_1K:.2f} + PUT ${puts / 1000 * PUT_PER_1K:.2f})"))
    w = max(len(r[0]) for r in rows)
    for k, v in rows:
        print(f"{k:<{w}}  {v}")
    return 0 if caught_up and not starving else 1


def _wait(pred, timeout: float, what: str, *, fail: bool = True) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.1)
    if fail:
        raise TimeoutError(f"timed out waiting for {what}")
    return False


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--subscribers", type=int, default=32)
    p.add_argument("--procs", type=int, default=4, help="worker processes the daemons are spread over")
    p.add_argument("--versions", type=int, default=30)
    p.add_argument("--interval", type=float, default=2.0, help="seconds between versions")
    p.add_argument("--keyframe-every", type=int, default=10)
    p.add_argument("--poll", type=float, default=1.0, help="daemon HEAD poll (the daemon's default: 1 s)")
    p.add_argument("--lease-interval", type=float, default=5.0, help="daemon lease writes (default 5 s)")
    p.add_argument("--idle", type=float, default=30.0, help="seconds of idle measurement")
    p.add_argument("--catch-up-timeout", type=float, default=300.0)
    p.add_argument("--tensors", type=int, default=8)
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--cols", type=int, default=512)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--ids", type=int, nargs="*", help=argparse.SUPPRESS)
    a = p.parse_args()
    return worker_main(a) if a.worker else main_run(a)


if __name__ == "__main__":
    sys.exit(main())
