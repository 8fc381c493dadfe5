"""Containers on the GPU hosts (docs/containers.md): the settings of jobs/host/containers.py and
the Podman executor, read by portal/settings.py (kept apart for that module's length)."""

from __future__ import annotations

from portal.env import env_choice, env_int, env_list, env_str

__all__ = [
    "CONTAINER_CDI_DIRS",
    "CONTAINER_CONF",
    "CONTAINER_DEVICE_DIR",
    "CONTAINER_MODE",
    "CONTAINER_PODMAN",
    "CONTAINER_PULL_SECONDS",
    "CONTAINER_ROOTLESS_RUN_DIR",
    "CONTAINER_ROOTLESS_STORAGE_DIR",
    "CONTAINER_START_SECONDS",
]

# "root": the worker's Podman (the worker runs as root) starts each container with --user set to
# the job's account; "rootless": the worker (still root) runs the job's account's own Podman, with
# a user namespace (--userns keep-id), in storage of the portal's for that account.
CONTAINER_MODE = env_choice("CONTAINER_MODE", "root", ("root", "rootless"))
CONTAINER_PODMAN = env_str("CONTAINER_PODMAN", "podman")  # the podman program, found on PATH if bare
# Where the booked /dev/nvidia<N> nodes, nvidiactl and nvidia-uvm* are found when the host has no
# NVIDIA CDI spec (tests point it at fake nodes: mknod c 195 N).
CONTAINER_DEVICE_DIR = env_str("CONTAINER_DEVICE_DIR", "/dev")
# Where an NVIDIA CDI spec (nvidia-ctk cdi generate) is looked for: one there, the cards go in by CDI.
CONTAINER_CDI_DIRS = env_list("CONTAINER_CDI_DIRS", ["/etc/cdi", "/var/run/cdi"])
# The containers.conf the portal writes and points CONTAINERS_CONF at; empty: VAR_DIR/containers.conf.
CONTAINER_CONF = env_str("CONTAINER_CONF", "")
# A container whose process has not started this long after `podman run` (the image pulled) fails.
CONTAINER_START_SECONDS = env_int("CONTAINER_START_SECONDS", 120, min_value=5, max_value=3600)
# A pull (a job's first use of an image on a host, or the pre-pull) gives up after this long.
CONTAINER_PULL_SECONDS = env_int("CONTAINER_PULL_SECONDS", 3600, min_value=10, max_value=24 * 3600)
# Rootless mode: each account's image storage (overlay) in <this>/<uid>, owned by the account; on
# a local disk (overlay does not work on NFS homes). Empty: VAR_DIR/rootless-storage.
CONTAINER_ROOTLESS_STORAGE_DIR = env_str("CONTAINER_ROOTLESS_STORAGE_DIR", "")
# Rootless mode: each account's runtime folder (XDG_RUNTIME_DIR: its containers' state, Podman's
# pause process) in <this>/<uid>, the portal's own (never /run/user/<uid>, which logind removes at
# the account's last logout). At most 50 characters with "/<uid>/containers" (Podman's limit).
# Empty: /run/portal-ctr/<a digest of PORTAL_INSTANCE_ID> (a tmpfs: a reboot clears it, as Podman
# expects).
CONTAINER_ROOTLESS_RUN_DIR = env_str("CONTAINER_ROOTLESS_RUN_DIR", "")
