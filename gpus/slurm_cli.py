"""Slurm's client commands, run by the worker on a login node, and what their text says (issue 37).

Slurm 22.05's `scontrol` has no `--json` (only `squeue`/`sinfo` do, through a plugin that not
every site builds), so the portal reads `scontrol show ... -o`: one record a line, `Key=Value`
pairs, values that may hold spaces (`OS=Linux 6.1 #1 SMP`, `Reason=Not responding [slurm@...]`)
and, in a job's detail (`-d`), keys that repeat (`Nodes=a CPU_IDs=0 GRES=gpu:2(IDX:0-1) Nodes=b ...`).
`pairs` keeps them in order; nothing here needs a cluster, so the parsers are unit-tested and
benchmarked against recorded and generated output.

Every command has a deadline (`SlurmCluster.command_timeout_seconds`): a cluster whose controller
does not answer is `SlurmUnreachable`, which marks the server offline (its telemetry stops) and is
said on its jobs' pages; a command Slurm refuses is `SlurmRefused`, carrying Slurm's own words.
No command goes through a shell, and no value a user gave can be read as an option.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

_KEY = re.compile(r"(?:^|(?<=\s))([A-Za-z][\w:/.]*)=")
_GRES_ITEM = re.compile(r"^(?P<name>[^:(]+)(?::(?P<type>[^:(]+))?(?::(?P<count>\d+))(?:\(.*\))?$")
_IDX = re.compile(r"\(IDX:([^)]*)\)")
SLURM_MESSAGE_MAX = 500


class SlurmError(RuntimeError):
    """A Slurm command failed."""


class SlurmUnreachable(SlurmError):
    """The cluster did not answer: no controller, a timeout, or the commands are not there."""


class SlurmTimedOut(SlurmUnreachable):
    """The command did not end in time: what it asked may still have been done (a job submitted)."""


class SlurmRefused(SlurmError):
    """Slurm answered no: the message is its own (`sbatch: error: Invalid partition name specified`)."""


def pairs(line: str) -> list[tuple[str, str]]:
    """`Key=Value` pairs of one `-o` record, in order, keys that repeat included."""
    found = list(_KEY.finditer(line))
    return [
        (m.group(1), line[m.end() : found[i + 1].start() if i + 1 < len(found) else len(line)].strip())
        for i, m in enumerate(found)
    ]


def records(text: str) -> list[dict[str, str]]:
    """Every record of `scontrol show <thing> -o`: the first value of each key."""
    out = []
    for line in text.splitlines():
        if "=" in line:
            record: dict[str, str] = {}
            for key, value in pairs(line):
                record.setdefault(key, value)
            out.append(record)
    return out


def hostnames(expression: str) -> list[str]:
    """A Slurm hostlist (`gpu[01-03,07],login`, `node[1-2]-ib`, `r[1-2]n[1-4]`) as names."""
    names: list[str] = []
    for item in _split_outside(expression.strip(), "[", "]"):
        names.extend(_expand(item))
    return names


def _expand(item: str) -> list[str]:
    """One hostlist item: its first bracket's ranges, each with the rest expanded."""
    prefix, bracket, rest = item.partition("[")
    if not bracket:
        return [item]
    ranges, _, suffix = rest.partition("]")
    out = []
    for part in ranges.split(","):
        low, _, high = part.partition("-")
        if not low.isdigit() or not (high or low).isdigit():
            return [item]  # not a range Slurm prints: the name as it is
        out += [
            f"{prefix}{n:0{len(low)}d}{tail}"
            for n in range(int(low), int(high or low) + 1)
            for tail in _expand(suffix)
        ]
    return out


def indices(text: str) -> list[int]:
    """Slurm's `IDX:0-1,3` list as numbers."""
    out: list[int] = []
    for part in text.split(","):
        low, _, high = part.strip().partition("-")
        if low.isdigit():
            out.extend(range(int(low), int(high or low) + 1))
    return out


def gpu_types(gres: str) -> list[str]:
    """A node's `Gres=gpu:a100:2(S:0),gpu:v100:1,shard:4` as one type name per GPU, in IDX order
    ("" where the GRES names no type)."""
    cards: list[str] = []
    for item in _split_gres(gres):
        m = _GRES_ITEM.match(item)
        if m and m.group("name") == "gpu":
            cards.extend([m.group("type") or ""] * int(m.group("count")))
    return cards


def _split_gres(gres: str) -> list[str]:
    """Commas inside `(S:0-1)` are not separators."""
    return [i for i in _split_outside(gres, "(", ")") if i != "(null)"]


def _split_outside(text: str, opening: str, closing: str) -> list[str]:
    """`text`'s comma-separated items, commas between `opening` and `closing` not separating."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch == opening) - (ch == closing)
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [i.strip() for i in items if i.strip()]


@dataclass(frozen=True)
class JobGres:
    """Which GPUs (by node and IDX) a running job holds, from `scontrol show job -d -o`."""

    job_id: str
    held: tuple[tuple[str, int], ...]


def job_gres(text: str) -> list[JobGres]:
    """Every job's GPUs by node and IDX; a `GRES=` belongs to the `Nodes=` just before it."""
    out = []
    for line in text.splitlines():
        job_id, nodes, held = "", [], []
        for key, value in pairs(line):
            if key == "JobId":
                job_id = value
            elif key == "Nodes":
                nodes = hostnames(value)
            elif key == "GRES" and nodes:
                for item in _split_gres(value):  # a GPU's IDX only: a NIC's IDX 0 is no card
                    if re.split(r"[:(]", item, maxsplit=1)[0] == "gpu":
                        for idx_list in _IDX.findall(item):
                            held.extend((node, i) for node in nodes for i in indices(idx_list))
        if job_id and held:
            out.append(JobGres(job_id, tuple(held)))
    return out


def node_state(slurm_state: str) -> str:
    """Slurm's node state (`IDLE`, `MIXED+DRAIN`, `DOWN*`, `IDLE+NOT_RESPONDING`) as the portal's
    five (SlurmNode.State): a node that is down or not responding is down; one draining or drained
    is drained (no new job goes there); else its base state."""
    words = slurm_state.upper().split("+")
    base = words[0].rstrip("*~#!%$@^-")
    if base in ("DOWN", "FAIL", "FAILING") or "NOT_RESPONDING" in words or words[0].endswith("*"):
        return "down"
    if "DRAIN" in words or base in ("DRAINED", "DRAINING", "DRAIN"):
        return "drained"
    if base in ("IDLE", "MIXED", "ALLOCATED"):
        return base.lower()
    if base == "COMPLETING":
        return "allocated"
    return "other"


@dataclass(frozen=True)
class SlurmCommands:
    """The client commands as the worker runs them: the folder they are in ("" for PATH), the
    cluster's SLURM_CONF ("" for Slurm's default) and a deadline for each."""

    bin_dir: str = ""
    slurm_conf: str = ""
    timeout: float = 10.0

    def path(self, command: str) -> str:
        return str(Path(self.bin_dir) / command) if self.bin_dir else command

    def run(self, command: str, args: Sequence[str], *, stdin: bytes | None = None) -> str:
        """`command args...` with its output as text; SlurmUnreachable when it cannot answer in
        time, SlurmRefused (Slurm's message) when it says no."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SQUEUE_"))}
        if self.slurm_conf:
            env["SLURM_CONF"] = self.slurm_conf
        argv = [self.path(command), *args]
        try:
            done = subprocess.run(
                argv, input=stdin, capture_output=True, timeout=self.timeout, env=env, check=False
            )
        except subprocess.TimeoutExpired:
            raise SlurmTimedOut(f"{command} did not answer within {self.timeout:g} s") from None
        except OSError as exc:
            raise SlurmUnreachable(f"cannot run {argv[0]}: {exc.strerror or exc}") from None
        out = done.stdout.decode(errors="replace")
        if done.returncode == 0:
            return out
        said = slurm_message(done.stderr.decode(errors="replace") or out)
        if _unreachable(said):
            raise SlurmUnreachable(f"{command}: {said}")
        raise SlurmRefused(said or f"{command} exited with code {done.returncode}")

    def show(self, thing: str, *args: str) -> str:
        return self.run("scontrol", ["show", thing, *args, "-o"])


_UNREACHABLE = (
    "Unable to contact slurm controller",
    "Socket timed out",
    "Connection refused",
    "Zero Bytes were transmitted",
    "Communication connection failure",
    "Unable to establish Slurm controller",
)


def _unreachable(message: str) -> bool:
    return any(s.lower() in message.lower() for s in _UNREACHABLE)


def slurm_message(text: str) -> str:
    """Slurm's error as one line a person reads: its `error:` lines and the controller's
    `allocation failure:` (what `sbatch --test-only` says), without their prefixes."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [
        re.sub(r"^(\w+: error: |allocation failure: )", "", line)
        for line in lines
        if "error:" in line or line.startswith("allocation failure:")
    ]
    return "; ".join(errors or lines)[:SLURM_MESSAGE_MAX]


def first(values: Iterable[str], default: str = "") -> str:
    return next(iter(values), default)
