"""heap.release gives freed heap memory back to the OS (glibc), as the publisher relies on."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from xcluster.util import heap

MiB = 1 << 20


def _rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


@pytest.mark.skipif(heap._malloc_trim() is None or not Path("/proc/self/statm").exists(),
                    reason="glibc's malloc_trim and /proc only")
def test_freed_temporaries_of_a_worker_thread_go_back_to_the_os():
    big = np.ones(16 * MiB, np.uint8)
    del big  # a large free raises glibc's mmap threshold: MiB blocks then come from the heap
    pin: list[np.ndarray] = []

    def work():  # what an encode or upload thread leaves: MiB-sized temporaries, freed, behind a live one
        temps = [np.ones(MiB, np.uint8) for _ in range(200)]
        pin.append(temps.pop())
        del temps

    t = threading.Thread(target=work)
    t.start()
    t.join()
    before = _rss()
    heap.release()
    assert before - _rss() > 100 * MiB, f"only {(before - _rss()) / MiB:.0f} MiB of ~200 MiB freed went back"
