"""This process's host memory around a save: resident now, and the peak since a reset (Linux's VmHWM).

>>> before = start_peak(); ...save...; peak = peak_since()     # bytes; None where the system does not say
"""

from __future__ import annotations


def _status(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def start_peak() -> int | None:
    """Reset the kernel's peak-resident counter to the resident size now (returned, in bytes)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return _status("VmRSS")


def peak_since() -> int | None:
    """The most host memory this process held since `start_peak`, in bytes."""
    return _status("VmHWM")
