"""Process helpers shared by the server fixtures."""

from __future__ import annotations

import os
import signal
import subprocess


def stop_process(proc: subprocess.Popen, timeout: float) -> None:
    """Stop a server by PID: SIGTERM, then SIGKILL if it has not exited within ``timeout``."""
    if proc.poll() is not None:
        return
    os.kill(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=timeout)
