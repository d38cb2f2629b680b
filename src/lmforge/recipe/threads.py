"""How many CPU threads each stage gets.

torch's default (one thread per core it sees) spins OpenMP threads that fight other processes
for the cores: a user measured 7-10 s per demo step at load 7 on 2 cores with the default against
1.1-1.6 s with one thread. The rule: count the cores this process may use (CPU affinity, capped
by a cgroup CPU quota), subtract what other processes keep busy now (busy cores over half a
second of ``/proc/stat``; the 1-minute load average where that cannot be read, which would also
count a just-finished ``pip install`` of ``./run``'s set-up), and use what is left, at least one
thread. The model stays the same whatever the count: every stage
is step-budgeted. ``recipe.threads`` (or ``OMP_NUM_THREADS``) overrides the rule.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path


def choose_threads(usable_cpus: int, cpu_quota: float | None = None, load: float = 0.0) -> int:
    """Threads for a compute-bound stage: the usable cores (``usable_cpus`` capped by the cgroup
    ``cpu_quota`` in cores, when there is one) minus the ``load`` other processes put on them,
    rounded, and at least 1."""
    cores = max(1, usable_cpus)
    if cpu_quota is not None and cpu_quota > 0:
        cores = min(cores, max(1, math.floor(cpu_quota)))
    free = cores - max(0.0, load)
    return int(min(cores, max(1, math.floor(free + 0.5))))


def cgroup_cpu_quota(root: str | os.PathLike = "/sys/fs/cgroup") -> float | None:
    """The cgroup CPU limit in cores (cgroup v2 ``cpu.max``, else v1 ``cfs_quota/period``), or
    None when there is none or it cannot be read."""
    base = Path(root)
    try:
        text = (base / "cpu.max").read_text().split()
        if text and text[0] != "max":
            return int(text[0]) / int(text[1])
        return None
    except (OSError, ValueError, IndexError):
        pass
    try:
        quota = int((base / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((base / "cpu" / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def _cpu_times(stat: str | os.PathLike) -> tuple[int, int] | None:
    """(busy, total) jiffies of all cores from the first line of ``/proc/stat``."""
    try:
        fields = [int(x) for x in Path(stat).read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    if len(fields) < 4:
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def busy_cores(
    seconds: float = 0.5, stat: str | os.PathLike = "/proc/stat", cores: int | None = None
) -> float | None:
    """Cores kept busy by other processes over the next ``seconds`` (this one sleeps), from two
    readings of ``stat``; None where it cannot be read."""
    first = _cpu_times(stat)
    if first is None:
        return None
    time.sleep(seconds)
    second = _cpu_times(stat)
    if second is None or second[1] <= first[1]:
        return None
    n = cores if cores is not None else (os.cpu_count() or 1)
    return n * (second[0] - first[0]) / (second[1] - first[1])


def machine_threads() -> int:
    """:func:`choose_threads` for this process now (affinity, cgroup quota, busy cores now, else
    the load average)."""
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count() or 1
    load = busy_cores()
    if load is None:
        try:
            load = os.getloadavg()[0]
        except OSError:
            load = 0.0
    return choose_threads(usable, cgroup_cpu_quota(), load)
