"""Memory and disk before a long build: say what it needs, refuse what cannot fit, report the peak.

A one-time build (the position-0 table, the inverse heads and their corpus states) holds a few
``(V, d)`` and ``(N, d)`` float32 matrices at once, so its need is known before it starts:
:func:`check_room` compares an estimate with what the machine has (``MemAvailable`` of
``/proc/meminfo``, the free space of the cache folder) and raises :class:`ResourceError` with both
numbers when the build cannot fit, instead of being killed by the kernel an hour later.
:func:`peak_rss` is the process's largest resident memory so far, printed with the one-time lines.
"""

from __future__ import annotations

import resource
import shutil
import sys
from pathlib import Path

from sipit.whitebox import SipitInputError

GB = 1024**3
FLOAT32 = 4


class ResourceError(SipitInputError):
    """A build needs more memory or disk than the machine has."""


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation (Linux ``MemAvailable``); None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def free_disk(folder: Path) -> int | None:
    """Free bytes on the file system that holds ``folder`` (or its nearest existing parent); None where unknown."""
    for part in (folder, *folder.parents):
        if part.exists():
            try:
                return shutil.disk_usage(part).free
            except OSError:
                return None
    return None


def check_room(what: str, memory: int, disk: int = 0, folder: Path | None = None) -> str:
    """Refuse (:class:`ResourceError`) a build of ``what`` that needs ``memory`` bytes of RAM, or ``disk``
    bytes in ``folder``, beyond what is available; otherwise return one line saying what it needs."""
    have_memory = available_memory()
    if have_memory is not None and memory > have_memory:
        raise ResourceError(f"{what} needs about {memory / GB:.1f} GB of memory and {have_memory / GB:.1f} GB "
                            "are available: free memory, or use --policy gradient (no one-time build)")
    have_disk = free_disk(folder) if folder is not None and disk else None
    if have_disk is not None and disk > have_disk:
        raise ResourceError(f"{what} needs about {disk / GB:.2f} GB of disk in {folder} and {have_disk / GB:.2f} GB "
                            "are free: free space, or point $SIPIT_CACHE_DIR elsewhere")
    line = f"{what}: needs about {memory / GB:.2f} GB of memory"
    if have_memory is not None:
        line += f" ({have_memory / GB:.1f} GB available)"
    if disk:
        line += f" and {disk / GB:.2f} GB of disk"
    return line


def peak_rss() -> int:
    """The largest resident memory of this process so far, in bytes."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux KiB
