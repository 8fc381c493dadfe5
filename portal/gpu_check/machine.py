"""This machine as the check sees it, apart from the portal: nvidia-smi, NVML's own process list,
the frameworks its Python has, and the helper processes the checks start on a card."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pynvml

from portal.gpu_check.waiting import Deadline

SCRIPTS = Path(__file__).resolve().parent / "scripts"
SMI_FIELDS = (
    "uuid",
    "name",
    "memory.total",
    "memory.used",
    "utilization.gpu",
    "temperature.gpu",
    "power.draw",
)
FRAMEWORKS = {"PyTorch": "torch", "JAX": "jax", "TensorFlow": "tensorflow"}


def nvidia_smi() -> list[dict[str, str]]:
    """One dict per card, nvidia-smi's own words ("[N/A]" where a card cannot say)."""
    argv = ["nvidia-smi", f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader,nounits"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=True).stdout
    return [
        dict(zip(SMI_FIELDS, (v.strip() for v in line.split(",")), strict=True))
        for line in out.splitlines()
        if line.strip()
    ]


def frameworks(python: str, deadline: Deadline) -> dict[str, str]:
    """{framework: "" if it imports in `python`, else why not}, each import within 120 s and
    the start-up's `deadline`."""
    found = {}
    for name, module in FRAMEWORKS.items():
        limit = min(120.0, deadline.left())
        try:
            done = subprocess.run(
                [python, "-c", f"import {module}"], capture_output=True, text=True, timeout=limit
            )
            found[name] = (
                "" if done.returncode == 0 else (done.stderr.strip().splitlines() or ["?"])[-1][:200]
            )
        except subprocess.TimeoutExpired:
            found[name] = f"`import {module}` took over {limit:.0f} s"
    return found


class Nvml:
    """NVML read directly (pynvml), for what the portal's figures are compared with."""

    def __init__(self) -> None:
        pynvml.nvmlInit()
        self.lock = threading.Lock()

    def processes(self, uuid: str) -> dict[int, int]:
        """{pid: MiB} of the card's compute and graphics processes."""
        with self.lock:
            handle = self._handle(uuid)
            listed = [*pynvml.nvmlDeviceGetComputeRunningProcesses(handle)]
            with contextlib.suppress(pynvml.NVMLError):
                listed += pynvml.nvmlDeviceGetGraphicsRunningProcesses(handle)
        return {p.pid: (p.usedGpuMemory or 0) // 2**20 for p in listed}

    def _handle(self, uuid: str) -> object:
        # By index, not nvmlDeviceGetHandleByUUID: older drivers answer that one slowly.
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            if pynvml.nvmlDeviceGetUUID(handle) == uuid:
                return handle
        raise RuntimeError(f"NVML lists no card {uuid}")

    def close(self) -> None:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()


class PeakSampler:
    """Samples a card's NVML process list ten times a second while a job runs: each pid's peak MiB."""

    def __init__(self, nvml: Nvml, uuid: str) -> None:
        self.nvml, self.uuid = nvml, uuid
        self.peaks: dict[int, int] = {}
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="gpu-check-sampler", daemon=True)

    def __enter__(self) -> PeakSampler:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        self.thread.join(timeout=5)

    def _run(self) -> None:
        while not self.stopped.wait(0.1):
            with contextlib.suppress(pynvml.NVMLError):
                for pid, mib in self.nvml.processes(self.uuid).items():
                    self.peaks[pid] = max(mib, self.peaks.get(pid, 0))


class Helper:
    """A process the check starts itself (never through the portal), in a session of its own;
    its output goes to a file. Stopped by its process group while it is our unreaped child."""

    def __init__(self, argv: list[str], output: Path, env: dict[str, str]) -> None:
        self.output = output
        with open(output, "wb") as out:
            self.proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.started = time.time()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def said(self, word: str) -> bool:
        if word in self.text():
            return True
        if self.proc.poll() is not None:
            raise RuntimeError(f"helper {self.pid} exited ({self.proc.returncode}): {self.text()[-500:]}")
        return False

    def text(self) -> str:
        return self.output.read_text(errors="replace")

    def wait_said(self, word: str, deadline: Deadline) -> float:
        """When the helper said `word` (the epoch time it printed after it, else now)."""
        deadline.wait_for(lambda: self.said(word), f"'{word}' from helper {self.pid}")
        after = self.text().split(word, 1)[1].split()
        try:
            return float(after[0])
        except (IndexError, ValueError):
            return time.time()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
