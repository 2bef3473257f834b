"""What ``/proc`` says of a process and of the machine: the probes the benches share
(bench/overhead, bench/scale, bench/soak), so each figure is read one way everywhere.

Linux only, as every bench here is; a process that ended between two reads of its threads
is skipped, not an error.
"""

from __future__ import annotations

import os

#: Clock ticks a second: the unit of ``/proc/<pid>/stat`` and ``/proc/stat`` times.
CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_ns(pid: int) -> int:
    """CPU time run by every thread of ``pid`` (first field of /proc/<pid>/task/*/schedstat),
    in nanoseconds: the same time as utime + stime, without the clock ticks' resolution."""
    total = 0
    base = f"/proc/{pid}/task"
    for tid in os.listdir(base):
        try:
            with open(f"{base}/{tid}/schedstat") as handle:
                total += int(handle.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total


def cpu_ticks_seconds(pid: int) -> float:
    """utime + stime of ``pid`` (/proc/<pid>/stat, all its threads), in seconds, at clock-tick
    resolution."""
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def rss_kib(pid: int) -> int | None:
    """Resident memory of ``pid`` in KiB (VmRSS), None when /proc does not say."""
    with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return None


def rss_bytes(pid: int) -> int:
    """Resident memory of ``pid`` in bytes; raises when /proc does not say."""
    kib = rss_kib(pid)
    if kib is None:
        raise RuntimeError(f"no VmRSS for {pid}")
    return kib * 1024


def descriptors(pid: int) -> int:
    """Open descriptors of ``pid``."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def stat_busy() -> dict[str, float]:
    """Busy seconds per /proc/stat cpu line (user nice system irq softirq steal): ``cpu`` is
    the whole machine, ``cpu0``... each core."""
    out = {}
    with open("/proc/stat") as handle:
        for line in handle:
            if not line.startswith("cpu"):
                break
            f = line.split()
            v = [int(x) for x in f[1:9]]
            out[f[0]] = (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / CLK_TCK
    return out
