"""What the container tests (tests/test_containers*.py) run in: a root filesystem built here from
the host's own python3 and the libraries it loads (no registry is reachable from a test), built
once per machine into the run's var base and shared by every xdist worker and later runs; a
second with JupyterLab for the labs (`lab_rootfs`: the venv's own base interpreter and the
distributions JupyterLab needs, hard-linked from the venv); the first as an oci-archive: file for
the pulls (`oci_archive`); and fake NVIDIA device nodes (mknod c 195 N: `open` answers ENXIO, as
with no driver loaded).

Where Podman cannot run containers here, the tier skips saying why, and fails on CI (CI=true),
which installs podman, runc and uidmap (.ci/run).
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import os
import pwd
import re
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

import pytest

ROOTFS_VERSION = "1"
ROOTLESS_ACCOUNT = "portal-ctest"  # the rootless tier's job account, made if absent
# Its subordinate ids when useradd gave it none (an /etc/subuid that did not exist yet).
ROOTLESS_SUBIDS = "1000000000-1000065535"  # bump to rebuild every cached root filesystem
# The run's var base (tests/isolation.py sets it): shared by its xdist workers and by later runs;
# the bench's var folder otherwise (bench/bench_containers.py).
_BASE = os.environ.get("PORTAL_TEST_VAR_BASE") or os.environ.get("PORTAL_VAR_DIR") or "var"
ROOTFS = Path(_BASE).resolve() / f"container-rootfs-{ROOTFS_VERSION}"
LAB_ROOTFS_VERSION = "2"  # bump to rebuild every cached lab root filesystem
LAB_ROOTFS = Path(_BASE).resolve() / f"container-rootfs-lab-{LAB_ROOTFS_VERSION}"
LAB_DISTRIBUTIONS = ("jupyterlab", "ipykernel")  # and what they require, as this venv has them
# Left out, a third of the size (the rootless tier imports the folder at each run): what no lab of
# the tests loads. debugpy: ipykernel runs without it (no debugger); every locale's data but
# English; jedi's stubs of other libraries (completion only).
LAB_LEFT_OUT = ("debugpy",)
LAB_LEFT_OUT_FILES = re.compile(r"babel/locale-data/(?!(?:root|en|en_US)\.dat)|jedi/third_party/typeshed/")
SKIPPED_IN_STDLIB = ("__pycache__", "test", "tests", "site-packages", "dist-packages", "idlelib", "tkinter")
SKIPPED_IN_STDLIB += (
    "ensurepip",
    "turtledemo",
    "lib2to3",
    "pydoc_data",
    "config-3*",
)  # config: a static libpython


def need_containers(account: pwd.struct_passwd | None = None) -> None:
    """Skip (fail on CI) unless Podman can start containers here: root-run, or as `account`'s
    own rootless Podman (with the settings' CONTAINER_MODE=rootless)."""
    from jobs.host.containers import account_status, runtime_status

    why = ""
    if os.geteuid() != 0:
        why = "the container tier runs Podman as root or as a test account and makes device nodes: needs root"
    else:
        ok, detail = runtime_status()
        if ok and account is not None:
            ok, detail = account_status(account)
        why = "" if ok else detail
    if not why:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must run the container tier, but {why}")
    pytest.skip(f"no container runtime: {why}")


def rootless_account() -> pwd.struct_passwd:
    """The rootless tier's job account (ROOTLESS_ACCOUNT), made with a home and subordinate ids
    if absent; skipped (failed on CI) where it cannot be."""
    from jobs.host.rootless import SUBID_FILES, subid_ranges

    try:
        account = pwd.getpwnam(ROOTLESS_ACCOUNT)
    except KeyError:
        if os.geteuid() != 0 or shutil.which("useradd") is None:
            _cannot(f"no account {ROOTLESS_ACCOUNT}, and no useradd as root to make one")
        subprocess.run(
            ["useradd", "--create-home", "--shell", "/usr/sbin/nologin", ROOTLESS_ACCOUNT],
            check=False, capture_output=True,
        )  # fmt: skip
        try:
            account = pwd.getpwnam(ROOTLESS_ACCOUNT)
        except KeyError:
            _cannot(f"useradd could not make the account {ROOTLESS_ACCOUNT}")
    if any(subid_ranges(account, path) == 0 for path in SUBID_FILES) and os.geteuid() == 0:
        for path in SUBID_FILES:
            Path(path).touch()
        ids = ["--add-subuids", ROOTLESS_SUBIDS, "--add-subgids", ROOTLESS_SUBIDS]
        subprocess.run(["usermod", *ids, ROOTLESS_ACCOUNT], check=False, capture_output=True)
    return account


def _cannot(why: str) -> NoReturn:
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must run the rootless container tier, but {why}")
    pytest.skip(f"no rootless containers: {why}")


def host_python() -> str:
    """The system's python3 (the interpreter's own files, outside any venv)."""
    found = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin") or sys.executable
    return os.path.realpath(found)


def rootfs() -> Path:
    """The shared root filesystem, built under a lock the first time (about 2 s, 60 MB)."""
    return _built(ROOTFS, lambda dest: _build(dest, host_python()))


def lab_rootfs() -> Path:
    """A root filesystem with JupyterLab (the lab tests, tests/test_containers_lab.py): this venv's
    own base interpreter, its standard library and the libraries it loads, and the distributions
    JupyterLab and ipykernel need, as this venv has them (so their compiled parts match that
    interpreter, on CI too), in its site-packages; hard links where the venv is on the same
    disk (the venv's folders mapped to its base interpreter's: site-packages, share/jupyter).
    Built under a lock the first time (about 3 s, 240 MB), shared as `rootfs()` is."""

    def build(dest: Path) -> None:
        python = os.path.realpath(
            os.path.join(sys.base_prefix, "bin", f"python{sys.version_info[0]}.{sys.version_info[1]}")
        )
        _build(dest, python)
        prefix = Path(sys.prefix).resolve()
        shared = []
        for dist in _required(LAB_DISTRIBUTIONS, LAB_LEFT_OUT):
            for file in dist.files or ():
                source = Path(dist.locate_file(file)).resolve()
                if (
                    source.is_file()
                    and source.is_relative_to(prefix)
                    and not LAB_LEFT_OUT_FILES.search(str(file))
                ):
                    relative = source.relative_to(prefix)  # lib/python3.x/site-packages/..., share/...
                    if relative.parts[0] != "bin":  # scripts, run by the venv's python: not there
                        _link(source, Path(f"{dest}{sys.base_prefix}") / relative)
                        shared += [str(source)] if source.suffix == ".so" else []
        _libraries(dest, shared, besides=prefix)  # the wheels' own (pyzmq.libs) are there already

    return _built(LAB_ROOTFS, build)


def oci_archive() -> Path:
    """`rootfs()` as an oci-archive: file (a registry pull's stand-in, no registry being reachable),
    made once with root's Podman (import, save, and the imported image removed)."""
    from jobs.host.containers import podman, podman_command, podman_env

    archive = Path(_BASE).resolve() / f"container-oci-{ROOTFS_VERSION}.tar"
    if archive.exists():
        return archive
    name = f"localhost/portal-test-archive-{os.getpid()}"
    tar = subprocess.Popen(["tar", "-C", str(rootfs()), "-cf", "-", "."], stdout=subprocess.PIPE)
    subprocess.run(
        podman_command("import", "--quiet", "--", "-", name),
        stdin=tar.stdout,
        env=podman_env(),
        check=True,
        capture_output=True,
    )
    tar.wait()
    partial = archive.with_name(f".{archive.name}.{os.getpid()}")
    podman("save", "--quiet", "--format", "oci-archive", "--output", str(partial), "--", name)
    podman("rmi", "--force", "--", name)
    partial.replace(archive)
    return archive


def _required(names: Sequence[str], but: Sequence[str] = ()) -> list[importlib.metadata.Distribution]:
    """The installed distributions `names` name and, recursively, those they require, but `but`."""
    from packaging.requirements import Requirement

    found: dict[str, importlib.metadata.Distribution] = {}
    wanted = list(names)
    while wanted:
        name = re.sub(r"[-_.]+", "-", wanted.pop()).lower()
        if name in found or name in but:
            continue
        dist = importlib.metadata.distribution(name)
        found[name] = dist
        for text in dist.requires or ():
            required = Requirement(text)
            if required.marker is None or required.marker.evaluate({"extra": ""}):
                wanted.append(required.name)
    return list(found.values())


def _link(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():
        return
    try:
        os.link(source, target)
    except OSError:  # another disk
        shutil.copy2(source, target)


def _built(dest: Path, build: Callable[[Path], None]) -> Path:
    """`dest`, built by `build` under a lock the first time, for every test process and later run."""
    done = dest / ".complete"
    if done.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / f".{dest.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(dest, ignore_errors=True)
            build(dest)
            done.touch()
    return dest


def _build(dest: Path, python: str) -> None:
    paths = subprocess.check_output(
        [
            python,
            "-c",
            "import sysconfig as s; p = s.get_paths(); print(p['stdlib']); print(p['platstdlib'])",
        ],
        text=True,
    ).split()
    _copy(dest, python)
    for folder in dict.fromkeys(paths):
        _copy(dest, folder)
    shared = [p for folder in paths for p in Path(folder).rglob("*.so")]
    _libraries(dest, [python, *(str(p) for p in shared if not set(p.parts) & set(SKIPPED_IN_STDLIB))])
    for folder in ("tmp", "dev", "proc", "sys", "etc", "run", "usr/bin", "var/tmp"):
        (dest / folder).mkdir(parents=True, exist_ok=True)
    (dest / "tmp").chmod(0o1777)
    (dest / "var/tmp").chmod(0o1777)
    if not (dest / "usr/bin/python3").exists():
        (dest / "usr/bin/python3").symlink_to(python)
    (dest / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (dest / "etc/group").write_text("root:x:0:\n")


def _libraries(dest: Path, binaries: Sequence[str], besides: Path | None = None) -> None:
    """The shared libraries `binaries` load (ldd), copied into `dest` at their paths (but those
    under `besides`)."""
    libraries: set[str] = set()
    for binary in binaries:
        listed = subprocess.run(["ldd", binary], capture_output=True, text=True).stdout
        libraries.update(word for word in listed.split() if word.startswith("/"))
    for library in libraries:
        real = os.path.realpath(library)
        if besides is not None and Path(real).is_relative_to(besides):
            continue
        _copy(dest, real)
        if real != library and not os.path.lexists(f"{dest}{library}"):
            os.makedirs(os.path.dirname(f"{dest}{library}"), exist_ok=True)
            os.symlink(real, f"{dest}{library}")


def _copy(dest: Path, source: str) -> None:
    target = f"{dest}{source}"
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if os.path.isdir(source) and not os.path.islink(source):
        ignore = shutil.ignore_patterns(*SKIPPED_IN_STDLIB)
        shutil.copytree(source, target, symlinks=True, dirs_exist_ok=True, ignore=ignore)
    elif not os.path.lexists(target):
        shutil.copy2(source, target, follow_symlinks=False)


def fake_gpu_nodes(folder: Path, count: int) -> Path:
    """/dev/nvidia0..count-1, nvidiactl and nvidia-uvm as fake character nodes in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    nodes = {f"nvidia{n}": n for n in range(count)} | {"nvidiactl": 255}
    for name, minor in nodes.items():
        os.mknod(folder / name, 0o666 | stat.S_IFCHR, os.makedev(195, minor))
        (folder / name).chmod(0o666)
    os.mknod(folder / "nvidia-uvm", 0o666 | stat.S_IFCHR, os.makedev(511, 0))
    (folder / "nvidia-uvm").chmod(0o666)
    return folder
