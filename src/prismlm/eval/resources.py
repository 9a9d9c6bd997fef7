"""What a measurement reads of the process besides time: peak resident memory, and a call timed with it.

Linux reports peaks since the process started (``ru_maxrss``) unless the kernel's counter is reset
(``/proc/self/clear_refs``), which ``timed_call`` does first so that a reading covers only that call.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

R = TypeVar("R")


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far, MiB (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter (VmHWM) of this process, so the next reading covers only what
    runs after it. Returns False where not supported (then readings are peaks since process start)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def current_peak_rss_mib() -> float:
    """VmHWM (peak RSS since the last ``reset_peak_rss``) in MiB; falls back to ru_maxrss."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return peak_rss_mib()


def timed_call(fn: Callable[[], R]) -> tuple[R, float, float]:
    """``fn()``'s result, its seconds and the peak RSS (MiB) while it ran (the peak counter reset first)."""
    reset_peak_rss()
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0, current_peak_rss_mib()
