"""What a container is given (jobs/host/executors/podman_args.py) and how its end is read
(jobs/host/executors/podman.py), without a runtime: the argv Podman gets, the environment file,
128+N. The real runs are tests/test_containers.py."""

from __future__ import annotations

import pwd
import signal
from pathlib import Path

import pytest

from jobs.host.containers import ContainerError, local_name
from jobs.host.executors.base import ImageSpec, RunEnd, RunSpec
from jobs.host.executors.podman import _end_of, _preexec
from jobs.host.executors.podman_args import env_file_text, run_argv

UUIDS = ["GPU-aaaa", "GPU-bbbb"]
NOBODY = pwd.getpwnam("nobody")


@pytest.fixture
def nodes(tmp_path, settings) -> Path:
    """Plain files stand for the nodes here: only their names matter to the argv."""
    folder = tmp_path / "dev"
    folder.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidia2", "nvidiactl", "nvidia-uvm"):
        (folder / name).touch()
    settings.CONTAINER_DEVICE_DIR = str(folder)
    settings.CONTAINER_CDI_DIRS = [str(tmp_path / "cdi")]
    return folder


def _spec(reference: str = "/srv/images/tf", *, network: bool = False, **kwargs) -> RunSpec:
    return RunSpec(
        ["python3", "-u", "/opt/launcher.py", "job.py"], {"A": "1"}, "/work/job-1", "Job 1", NOBODY,
        gpu_uuids=UUIDS, image=ImageSpec("tf", reference, network), gpu_minors=(0, 2), **kwargs,
    )  # fmt: skip


def _argv(spec: RunSpec) -> list[str]:
    return run_argv(spec, "portal-x-job-1", Path("/var/env/file"))


def test_it_gives_the_booked_nodes_and_nothing_of_the_hosts_dev(nodes):
    argv = _argv(_spec())
    devices = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--device"]
    assert devices == [
        f"{nodes}/nvidia0:/dev/nvidia0:rw",
        f"{nodes}/nvidia2:/dev/nvidia2:rw",
        f"{nodes}/nvidiactl:/dev/nvidiactl:rw",
        f"{nodes}/nvidia-uvm:/dev/nvidia-uvm:rw",
    ]
    joined = " ".join(argv)
    assert "/dev:/dev" not in joined and ".sock" not in joined and "--privileged" not in argv
    for flag in ("--cap-drop", "--security-opt", "--user", "--network", "--init", "--replace"):
        assert flag in argv
    assert argv[argv.index("--cap-drop") + 1] == "all"
    assert argv[argv.index("--security-opt") + 1] == "no-new-privileges"
    assert argv[argv.index("--user") + 1] == f"{NOBODY.pw_uid}:{NOBODY.pw_gid}"
    assert argv[argv.index("--network") + 1] == "none"


def test_a_root_filesystem_is_the_last_argument_before_the_command_behind_an_overlay(nodes):
    argv = _argv(_spec())
    assert argv[-7:-4] == ["--rootfs", "--", "/srv/images/tf:O"]
    assert argv[-4:] == ["python3", "-u", "/opt/launcher.py", "job.py"]


def test_a_registry_image_is_run_as_pulled_and_an_archive_by_its_local_name(nodes):
    assert _argv(_spec("registry.lab/tf:2.17"))[-8:-4] == ["--pull", "never", "--", "registry.lab/tf:2.17"]
    archive = _argv(_spec("oci-archive:/srv/tf.tar"))[-5]
    assert archive == local_name("oci-archive:/srv/tf.tar") and archive.startswith(
        "localhost/portal-archive-"
    )


def test_the_network_is_the_hosts_only_where_the_image_allows_it(nodes):
    argv = _argv(_spec(network=True))
    assert argv[argv.index("--network") + 1] == "host"


def test_with_an_nvidia_cdi_spec_the_cards_go_in_by_uuid(nodes, tmp_path, settings):
    (tmp_path / "cdi").mkdir()
    (tmp_path / "cdi" / "nvidia.yaml").write_text("cdiVersion: 0.5.0\nkind: nvidia.com/gpu\n")
    argv = _argv(_spec())
    devices = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--device"]
    assert devices == ["nvidia.com/gpu=GPU-aaaa", "nvidia.com/gpu=GPU-bbbb"]


def test_a_card_without_its_node_is_refused_saying_where_it_looked(nodes):
    spec = _spec()
    spec = RunSpec(spec.argv, spec.env, spec.cwd, spec.name, spec.account, gpu_uuids=UUIDS, image=spec.image,
                   gpu_minors=(0, 7))  # fmt: skip
    with pytest.raises(ContainerError, match=f"GPU-bbbb has no device node {nodes}/nvidia7"):
        _argv(spec)


def test_folders_are_mounted_at_their_own_paths_read_only_where_asked(nodes, tmp_path):
    (tmp_path / "job").mkdir()
    argv = _argv(_spec(mounts=((str(tmp_path / "job"), True), ("/usr/lib", False), ("/not/here", True))))
    volumes = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--volume"]
    assert f"{tmp_path}/job:{tmp_path}/job:rw" in volumes and "/usr/lib:/usr/lib:ro" in volumes
    assert not any(v.startswith("/not/here") for v in volumes)


def test_the_environment_goes_in_a_file_never_on_the_command_line(nodes):
    assert "A=1" not in _argv(_spec())
    assert env_file_text({"A": "1", "B": "x = y "}) == "A=1\nB=x = y \n"
    with pytest.raises(ContainerError, match="The value of B holds a line break"):
        env_file_text({"B": "one\ntwo"})


@pytest.mark.parametrize(
    ("code", "sent", "oom", "end"),
    [
        (0, set(), False, RunEnd(code=0)),
        (3, set(), False, RunEnd(code=3)),
        (143, {signal.SIGTERM}, False, RunEnd(signal=15)),
        (143, set(), False, RunEnd(code=143)),  # the script's own exit(143): nobody sent SIGTERM
        (137, set(), False, RunEnd(code=137)),  # the script's own exit(137), as a shell gives it
        (137, {signal.SIGKILL}, False, RunEnd(signal=9)),
        (137, set(), True, RunEnd(signal=9)),  # Podman saw the OOM killer end it
        (139, set(), True, RunEnd(code=139)),  # out of memory, but not what killed it
        (-9, set(), False, RunEnd(signal=9)),  # the client itself killed
    ],
)
def test_128_plus_n_is_read_as_a_signal_only_when_the_portal_sent_it_or_the_oom_killer(code, sent, oom, end):
    assert _end_of(code, {int(s) for s in sent}, oom_killed=oom) == end


def test_a_reference_is_never_read_as_an_option(nodes):
    for reference in ("--privileged", "/srv/images/tf"):
        argv = _argv(_spec(reference))
        assert argv[argv.index("--") + 1].startswith(reference) and argv.index("--") > argv.index("--user")
    assert "--rm" not in _argv(_spec())  # removed by the worker, after it read how it ended


def test_a_labs_socket_is_passed_as_fd_3_with_preserve_fds(nodes):
    """Podman passes a run of descriptors from 3 (--preserve-fds N), never one at its own number:
    the client holds the lab's socket at 3 (podman._preexec), which the container's command gets."""
    assert "--preserve-fds" not in _argv(_spec())
    argv = _argv(_spec(pass_fds=[17]))
    assert argv[argv.index("--preserve-fds") + 1] == "1" and argv.index("--preserve-fds") < argv.index("--")


def test_the_clients_preexec_moves_the_passed_descriptors_to_3_on_without_losing_one():
    """In a child: fds 10 and 9 end up at 3 and 4, in order (3 and 4 held something else)."""
    import os

    first, second = os.pipe()  # two descriptors to tell apart by what they are
    preexec = _preexec([10, 9])  # made in the parent, as Popen's is
    pid = os.fork()
    if pid == 0:  # the child: what Popen's child does before exec
        code = 1
        try:
            os.dup2(first, 9), os.dup2(second, 10)
            preexec()
            same = os.path.sameopenfile
            code = 0 if same(3, second) and same(4, first) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    os.close(first), os.close(second)
    assert os.waitstatus_to_exitcode(status) == 0
