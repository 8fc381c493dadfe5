"""How work runs on a GPU host: one small interface (`Executor`), one handle (`Run`), one end
(`RunEnd`), in the manner of Open OnDemand's `ood_core` job adapter. Jobs (jobs/host/runner.py) and
JupyterLabs (jobs/host/lab.py) are run through it; what they run *in* is the executor's business:
a subprocess of the worker (`LocalProcess`, jobs/host/executors/local.py), or a container for work
in an image (`Podman`, jobs/host/executors/podman.py; issue 34). The queue, the watchdog and the
pages never see an executor; the supervisors ask `executor_for` for one and keep their own
deadlines, rows and logs.

When each method is called, by a supervisor:

    start(spec)          once, after the row is claimed; OSError: the run never started
    poll(run)            every tick: None while the main process runs, its RunEnd once it exited
    signal(run, sig)     a stop decided (SIGTERM), and SIGKILL once the grace period is over
    wait(run)            the main process is about to end (or has): block until it has
    sweep(run)           after its exit, before collect: SIGKILL whatever it left
    collect(run)         last: the end, and the run's ids released (reaped)
    stop(run, grace)     all of the stop at once, for a caller with nothing to read meanwhile

A supervisor that reads output while it stops (the job runner) calls signal() twice itself;
one that does not (a lab) calls stop(). `did_not_start(end)` tells the executor's own failures
before the command ran (a privilege drop, a missing image) from the command's exit code.

What a new executor must guarantee:
- **Its own session.** A run is a session or process group (or a container) of its own: a
  signal to the run reaches all of it and nothing else, never the worker's own group.
- **Proof before signal.** Every signal names its target by something reuse cannot fake (a pid
  *and* its start time, a pidfd, an unreaped child, a container id), checked before it is sent:
  a pid that was reused is never signalled. `Run.leader` (pid and start) is what the row keeps,
  and the orphan sweep proves by, after the worker died; a container's host PIDs are attributed
  to the run the same way.
- **Nothing left after stop.** Once `sweep` (or `stop`) has returned, no process of the run is
  left, or `Signalled.left`/`denied` and its lines say what is; for a container also no
  container and no mount.
- **Output streamed.** stdout and stderr come interleaved, as printed, through `Run.output`,
  read ahead by a bounded amount only (the run waits, not the worker's memory).
- **Exit codes as a shell gives them.** `RunEnd` holds the exit code or the signal; a runtime
  that reports 128+N after signal N reports it as `RunEnd(signal=N)` where it knows that N killed
  it (the portal sent N, or the runtime recorded the OOM killer), and a script's own exit(128+N)
  as that code. `RunEnd.returncode`
  (minus N after a signal) is what Job.exit_code records.
- **Started with nothing of the worker's.** No capabilities, no secrets of the worker's in its
  environment or argv, only the descriptors in `RunSpec.pass_fds`, only the cards in
  `RunSpec.gpu_uuids`, as `RunSpec.account`.
"""

from __future__ import annotations

from jobs.host.executors.base import Executor, Run, RunEnd, RunOutput, RunSpec, Signalled
from jobs.host.executors.local import LocalProcess
from jobs.host.executors.podman import Podman
from portal.names import instance_label

__all__ = [
    "Executor",
    "LocalProcess",
    "Podman",
    "Run",
    "RunEnd",
    "RunOutput",
    "RunSpec",
    "Signalled",
    "executor_for",
]


def executor_for(work: object) -> Executor:
    """The executor that runs `work` (a Job or an InteractiveSession): a container (`Podman`,
    named portal-<instance>-<digest>-job-<id> or -session-<id>) when its image is set, else a local process.
    The one place the way to run is chosen."""
    if getattr(work, "image_id", None) is None:
        return LocalProcess()
    kind = "session" if type(work).__name__ == "InteractiveSession" else "job"
    return Podman(f"portal-{instance_label()}-{kind}-{work.pk}")  # type: ignore[attr-defined]
