"""CPU time of processes by pid (Linux): for helper processes that a benchmark must count.

`cpu_seconds(pid)` reads the process's CPU-time clock (`clock_gettime` on
`MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)`, all threads, ns resolution); where that is refused
it falls back to `/proc/<pid>/stat` utime + stime (10 ms ticks). Stdlib only: the side scripts
import it inside other virtual environments.
"""

from __future__ import annotations

import os
import time

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _process_clock(pid: int) -> int:
    return ((~pid) << 3) | 2  # the kernel's CPUCLOCK_SCHED clock of a whole process


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of `pid` so far, every thread of it included."""
    if pid == os.getpid():
        return time.process_time()
    try:
        return time.clock_gettime(_process_clock(pid))
    except OSError:
        pass
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def reaped_cpu_seconds(pid: int) -> float:
    """CPU seconds of the children `pid` has waited for (cutime + cstime); 0 once it is gone.
    A process whose helpers come and go (the flight recorder's segment writers) keeps their
    time here after they exit."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[13]) + int(fields[14])) / _TICKS


def cpu_seconds_or_zero(pid: int) -> float:
    """`cpu_seconds`, or 0 for a process that has exited meanwhile."""
    try:
        return cpu_seconds(pid)
    except OSError:
        return 0.0


def name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (children, their children, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # exited meanwhile
        children.setdefault(ppid, []).append(int(entry))
    out: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def tree_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """{pid: (name, CPU seconds)} for `pid` and every process below it that is still alive."""
    out: dict[int, tuple[str, float]] = {}
    for p in [pid, *descendants(pid)]:
        try:
            out[p] = (name(p), cpu_seconds(p))
        except OSError:
            continue  # exited meanwhile
    return out


def cpu_delta(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]
) -> dict[str, float]:
    """CPU seconds each process used between two `tree_cpu` snapshots, summed by name
    (processes that started in between count from zero)."""
    out: dict[str, float] = {}
    for p, (label, seconds) in after.items():
        used = seconds - before.get(p, (label, 0.0))[1]
        out[label] = out.get(label, 0.0) + used
    return out


def reset_peak_rss(pid: int) -> bool:
    """Start the kernel's peak resident set size of `pid` (VmHWM) again from its current RSS
    (Linux 4.0 on: `5` to /proc/PID/clear_refs); False where that is refused."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes(pid: int) -> int:
    """The peak resident set size of `pid` (VmHWM) since it started or was reset; 0 when it
    has exited."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def tree_peak_rss_bytes(pid: int) -> int:
    """The sum of the peak RSS of `pid` and every live process below it: an engine's memory
    when its processes each peak (an upper bound of their peak together)."""
    return sum(peak_rss_bytes(p) for p in [pid, *descendants(pid)])
