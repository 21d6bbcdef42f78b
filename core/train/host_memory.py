"""Whether what a rank keeps in host memory fits this host, checked at start.

Every process of a node shares the host's memory: each may take `MemAvailable / LOCAL_WORLD_SIZE`
(`/proc/meminfo`, the kernel's estimate of what can be allocated without swapping). A run whose
host buffers do not fit stops before it builds anything, in one line (exit 2), rather than being
killed by the kernel mid-step. `needs` names each use, so several features share one check.
"""

from __future__ import annotations

import os
from pathlib import Path

from core.config import ConfigError

MEMINFO = Path("/proc/meminfo")
GIB = 2 ** 30


def available_bytes(meminfo: Path = MEMINFO) -> int | None:
    """MemAvailable in bytes; None where the kernel does not say (not Linux)."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    except OSError:
        return None
    return None


def check_host_memory(needs: dict[str, int], meminfo: Path = MEMINFO, limit_gb: float = 0.0) -> None:
    """Raise ConfigError when the bytes of `needs` ({what: bytes}, per process) exceed this
    process's share of the host's available memory, or `limit_gb` (GB) where it is set
    (train.optimizer_offload_host_gb)."""
    needed = sum(needs.values())
    if not needed:
        return
    if limit_gb:
        share, source = int(limit_gb * 1e9), f"train.optimizer_offload_host_gb={limit_gb:g}"
    else:
        total = available_bytes(meminfo)
        if total is None:
            return
        local = max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1)
        share, source = total // local, f"MemAvailable {total / GIB:.2f} GiB / {local} processes on this host"
    if needed > share:
        parts = ", ".join(f"{what} {n / GIB:.2f} GiB" for what, n in needs.items() if n)
        raise ConfigError(f"host memory: this process needs {needed / GIB:.2f} GiB ({parts}) but has "
                          f"{share / GIB:.2f} GiB ({source}); use fewer processes per host, shorter sequences "
                          "or less offload")
