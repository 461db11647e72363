"""Where the CPU goes while a load runs (Linux /proc; None elsewhere): the server's event-loop
thread, its other threads (the batch workers and the pass), this process (the load client) and
the machine's idle share. With them, the most a full-softmax server could reach on these cores
if its pass cost no more than the GEMM bound: the loop's and the client's work per request
come on top of the GEMM's, on the same cores."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def snapshot(pid: int) -> Optional[dict]:
    """CPU seconds so far of the server's main thread and of its other threads, of this process,
    and the machine's (idle, total) jiffies; None without /proc."""
    try:
        main = other = 0.0
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # the thread ended meanwhile
                continue
            seconds = (int(fields[11]) + int(fields[12])) / TICK  # utime + stime
            if int(task.name) == pid:
                main += seconds
            else:
                other += seconds
        jiffies = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except OSError:
        return None
    own = os.times()
    return {"wall": time.perf_counter(), "loop": main, "workers": other, "client": own.user + own.system,
            "idle": jiffies[3] + jiffies[4], "total": sum(jiffies)}


def split(before: Optional[dict], after: Optional[dict], requests_per_s: float) -> Optional[dict]:
    """Cores used by each part between two snapshots, core-milliseconds per request, the machine's
    idle share and its core count."""
    if before is None or after is None or requests_per_s <= 0:
        return None
    wall = after["wall"] - before["wall"]
    cores = {k: (after[k] - before[k]) / wall for k in ("loop", "workers", "client")}
    return {"cores": {k: round(v, 3) for k, v in cores.items()},
            "core_ms_per_request": {k: round(v / requests_per_s * 1e3, 4) for k, v in cores.items()},
            "idle_share": round((after["idle"] - before["idle"]) / max(1, after["total"] - before["total"]), 3),
            "cpus": os.cpu_count() or 1}


def ceiling_over_bound(cpu: Optional[dict], gemm_bound: Optional[float], inputs_per_request: int = 1) -> Optional[float]:
    """The share of the GEMM bound (inputs/s on every core) a server would reach whose pass cost
    exactly the bound's GEMM while its loop and the client cost what `cpu` measured per request:
    cpus / (cpus / bound + their core-seconds per input), over the bound."""
    if not cpu or not gemm_bound:
        return None
    per_input = (cpu["core_ms_per_request"]["loop"] + cpu["core_ms_per_request"]["client"]) / 1e3 / inputs_per_request
    return cpu["cpus"] / (cpu["cpus"] / gemm_bound + per_input) / gemm_bound
