"""Start a real ``moto`` server on 127.0.0.1 for a test, and stop it by PID.

Usage::

    with start_moto_server(env={"INITIAL_NO_AUTH_ACTION_COUNT": "0"}) as endpoint:
        s3 = boto3.client("s3", endpoint_url=endpoint, ...)

The server runs as ``sys.executable -m moto.server`` so it is the moto installed next to the
interpreter running the tests. Readiness is probed on ``/moto-api/config``, which is not an AWS
action: it does not use up any of ``INITIAL_NO_AUTH_ACTION_COUNT``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

from tests.support.procs import stop_process

__all__ = ["start_moto_server", "TEST_CREDENTIALS"]

#: Credentials moto accepts while IAM enforcement is off (it never checks them then).
TEST_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
}

_HOST = "127.0.0.1"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((_HOST, 0))
        return sock.getsockname()[1]


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/moto-api/config", timeout=1) as response:
            response.read()
        return True
    except urllib.error.HTTPError:
        return True  # it answered, even if not with 2xx
    except OSError:
        return False


def _log_tail(log, limit: int = 4000) -> str:
    log.flush()
    log.seek(0)
    return log.read().decode("utf-8", "replace")[-limit:]


@contextmanager
def start_moto_server(
    *,
    env: dict[str, str] | None = None,
    startup_timeout: float = 30.0,
    stop_timeout: float = 10.0,
) -> Iterator[str]:
    """Run ``moto.server`` on a free port of 127.0.0.1 and yield its endpoint URL.

    ``env`` is added to a copy of this process's environment for the server (for example
    ``{"INITIAL_NO_AUTH_ACTION_COUNT": "0"}`` to enforce IAM from the first request). The server
    is stopped by PID (SIGTERM, then SIGKILL) when the block exits. Raises ``RuntimeError``
    with the tail of the server's log if it exits or does not answer within ``startup_timeout``.
    """
    server_env = {**os.environ, **(env or {})}
    with tempfile.TemporaryFile() as log:
        for attempt in range(3):
            port = _free_port()
            url = f"http://{_HOST}:{port}"
            proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", _HOST, "-p", str(port)],
                env=server_env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            try:
                deadline = time.monotonic() + startup_timeout
                while not _answers(url):
                    if proc.poll() is not None:
                        break  # exited: most likely the port was taken meanwhile; retry
                    if time.monotonic() > deadline:
                        raise RuntimeError(
                            f"moto server (pid {proc.pid}) did not answer on {url} within "
                            f"{startup_timeout:.0f}s; its log ends with:\n{_log_tail(log)}"
                        )
                    time.sleep(0.1)
                else:
                    yield url
                    return
            finally:
                stop_process(proc, stop_timeout)
        raise RuntimeError(
            f"moto server exited during startup {attempt + 1} times; "
            f"its log ends with:\n{_log_tail(log)}"
        )
