"""This portal's own jobs on simulated cards: which real processes of this machine run for which
simulated card, found as a driver would find them (see `local_job_processes`).
"""

from __future__ import annotations

import os

import psutil

from gpus.inventory import ProcessInfo
from gpus.procinfo import describe_process, is_process_pid


def local_job_processes(server: str, instance: str) -> dict[str, list[ProcessInfo]]:
    """This portal's job processes on this machine for simulated `server`, by booked card UUID.

    The simulation stands in for the driver's knowledge of which card a process uses: it takes
    it from the job's environment (PORTAL_SERVER, CUDA_VISIBLE_DEVICES), which the worker wrote.
    Only processes that also carry this portal's PORTAL_INSTANCE count: another checkout on this
    machine runs jobs on the same simulated server names, and they are not this portal's to
    show, nor its watchdog's to stop. What the process is, and which job it belongs to, comes
    from `describe_process` and the session id, exactly as with NVML; a job's own
    PORTAL_JOB_ID is never read.
    """
    found: dict[str, list[ProcessInfo]] = {}
    for proc in psutil.process_iter():
        try:
            if not is_process_pid(proc.pid) or os.getsid(proc.pid) != proc.pid:
                continue  # the job's session leader stands for the job; never pid 0 or init
            env = proc.environ()
            if env.get("PORTAL_SERVER") != server or env.get("PORTAL_INSTANCE") != instance:
                continue
            cards = [u for u in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if u]
            # Spread over its cards, so the job's sum over cards is its real footprint.
            used_mb = proc.memory_info().rss // (1024 * 1024) // max(1, len(cards))
        except (psutil.Error, OSError):
            continue  # exited meanwhile, or another user's (JOB_USER): the simulation cannot see it
        info = describe_process(proc.pid, used_mb)
        for card in cards:
            found.setdefault(card, []).append(info)
    return found
