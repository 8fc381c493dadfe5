"""A JupyterLab's listening socket (jobs.host.lab): made by the worker before the lab exists, handed
to the lab's process alone, and proved to be the server that answers at the lab's address before
the lab's token goes there.

A GPU host is shared with people who have shells: any of them can listen on a free port, read
every command line in /proc, and answer at an address the portal was about to use. So the
worker never picks a port and publishes it for the lab to bind later (the race a lab lost while
Jupyter imported, 1-2 s): it binds and listens itself (`listen`), passes the socket down as an
inherited fd (jobs/host/jupyter/lab_launcher.py serves Jupyter on it) and keeps no copy. While that
socket lives, nothing else can listen at its address; `listener_proof` checks that it still is
the one there, held by the lab's process, and the supervisor checks it again on every connection
that carries the token (`listening_at`).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import socket
import struct
import subprocess
from dataclasses import dataclass

import psutil
from django.conf import settings

from jobs.environment import JobSetupError
from jobs.host.executors import Executor, Run
from portal.processes import start_job_process

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Listener:
    """The listening socket the worker made for a lab: where it listens, and its inode."""

    host: str
    port: int
    inode: int

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def listen(host: str) -> tuple[socket.socket, Listener]:
    """A socket listening on `host`, on a port the kernel picks. No SO_REUSEADDR, no SO_REUSEPORT:
    while it lives, no other socket on this host can listen at its address."""
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        raise JobSetupError(f"SESSION_BIND_ADDRESS={host!r} is no IP address: ask an admin") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        sock.listen(128)
        where = sock.getsockname()
        return sock, Listener(host=where[0], port=where[1], inode=os.fstat(sock.fileno()).st_ino)
    except OSError as exc:
        sock.close()
        raise JobSetupError(f"cannot listen on SESSION_BIND_ADDRESS={host}: {exc.strerror}") from None


def listener_proof(executor: Executor, lab: Run, listener: Listener, *, uid: int, gid: int) -> str | None:
    """None when the server listening at `listener`'s address is the JupyterLab this worker
    started; else why it is not. The lab's token goes nowhere before this holds.

    Why: any account on the host can listen on a free port, so an answer at the lab's address
    proves nothing. The worker made the listening socket before the lab existed and handed it to
    the lab's process alone. So the proof is (1) that the one socket listening at that address
    (/proc/net/tcp and tcp6, which anyone may read) is that very socket, by its inode, and (2)
    that it is open in the lab's leader, the process the worker started: its own unreaped child,
    whose pid can name no other process, or, in a container, the command its init started. A lab
    that let go of its socket (closed it, or passed it to a process of its own) is not proved
    either."""
    refused = f"the server at {listener.address} is not the JupyterLab the worker started"
    listening = listening_at(listener)
    if listening != {listener.inode}:
        what = f"socket {', '.join(map(str, sorted(listening)))}" if listening else "no socket"
        return (
            f"{refused}: {what} listens there, not the socket {listener.inode} the worker made "
            "and handed to it"
        )
    held = held_sockets(lab.leader.pid, uid=uid, gid=gid)
    if listener.inode not in held:
        # In a container the leader is its init (catatonit), which hands the socket to the lab's
        # command, its child in its session, and keeps no copy. (Podman's conmon, root's or the
        # account's own, holds one too, and never accepts on it.)
        for child in session_children(lab.leader.pid):
            held |= held_sockets(child, uid=uid, gid=gid)
    if listener.inode not in held or executor.poll(lab) is not None:
        return (
            f"{refused}: the socket {listener.inode} listening there is not held by the lab's "
            f"process {lab.leader.pid}"
        )
    return None


def listening_at(listener: Listener) -> set[int]:
    """The inodes of the TCP sockets that listen for connections to `listener`'s address: at
    that very address, or at the wildcard of its family (IPv4 in IPv6 read as IPv4)."""
    wanted = ipaddress.ip_address(listener.host)
    wildcards = {ipaddress.ip_address("0.0.0.0"), ipaddress.ip_address("::")}
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as rows:
                next(rows, None)  # the header
                for row in rows:
                    fields = row.split()
                    if len(fields) < 10 or fields[3] != "0A":  # TCP_LISTEN
                        continue
                    address, _, port = fields[1].partition(":")
                    host = _proc_net_address(address)
                    if int(port, 16) == listener.port and (host == wanted or host in wildcards):
                        found.add(int(fields[9]))
        except FileNotFoundError:
            continue  # no IPv6 on this host
    return found


def _proc_net_address(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address as /proc/net/tcp{,6} prints it: 32-bit words in the host's byte order."""
    words = [int(hex_address[i : i + 8], 16) for i in range(0, len(hex_address), 8)]
    address = ipaddress.ip_address(struct.pack(f"={len(words)}I", *words))
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def session_children(pid: int) -> list[int]:
    """The children of process `pid` that are in its session (not a kernel, which has its own)."""
    try:
        children = psutil.Process(pid).children()
    except psutil.Error:
        return []
    found = []
    for child in children:
        with contextlib.suppress(OSError):
            if os.getsid(child.pid) == os.getsid(pid):
                found.append(child.pid)
    return found


# Run as the lab's account, where the worker may not read another account's /proc/<pid>/fd.
FD_LINKS = (
    "import os, sys\n"
    "d = '/proc/%s/fd' % sys.argv[1]\n"
    "for n in os.listdir(d):\n"
    "    try: print(os.readlink(d + '/' + n))\n"
    "    except OSError: pass\n"
)


def held_sockets(pid: int, *, uid: int, gid: int) -> set[int]:
    """The inodes of the sockets open in process `pid` (of account `uid`).

    The worker reads /proc/<pid>/fd itself where it may: as root, or as the lab's own account.
    A worker with JOB_USER runs labs as their owners' accounts and has no CAP_SYS_PTRACE (nor
    should it), so there the table is read by a process started as the lab's account, as a job
    is: no privileges, the lab's uid and gid, which may read its own account's tables."""
    links: list[str] = []
    try:
        folder = f"/proc/{pid}/fd"
        for name in os.listdir(folder):
            with contextlib.suppress(OSError):  # closed meanwhile
                links.append(os.readlink(f"{folder}/{name}"))
    except OSError as exc:
        if uid == os.geteuid():
            log.warning("Cannot read the fd table of process %s: %s", pid, exc)
            return set()
        links = _fd_links_as(pid, uid=uid, gid=gid)
    return {int(link[8:-1]) for link in links if link.startswith("socket:[") and link[8:-1].isdigit()}


def _fd_links_as(pid: int, *, uid: int, gid: int) -> list[str]:
    argv = [settings.JOB_INTERPRETERS["default"], "-I", "-c", FD_LINKS, str(pid)]
    try:
        reader = start_job_process(argv, env={}, cwd="/", user=uid, group=gid)
    except OSError as exc:
        log.warning("Cannot start a reader of process %s's fd table: %s", pid, exc)
        return []
    try:
        out, _ = reader.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        reader.kill()
        out, _ = reader.communicate()
    if reader.returncode != 0:
        log.warning("Cannot read the fd table of process %s as uid %s: %s", pid, uid, out[-300:])
        return []
    return out.decode(errors="replace").splitlines()
