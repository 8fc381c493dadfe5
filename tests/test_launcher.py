"""jobs/host/launcher-bin/launcher.py, run as the worker runs it: a subprocess of the venv's
python, no database.

TensorFlow subprocesses cost several seconds each, so there are three: the Keras example, the TF1 session
example and one script that imports TensorFlow only indirectly.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from jobs.host.launch import LAUNCHER

ROOT = Path(__file__).resolve().parent.parent


def _load_launcher() -> ModuleType:
    """The launcher as a module, for its pure helpers; it lives in no package, so load it by path."""
    spec = importlib.util.spec_from_file_location("portal_job_launcher", LAUNCHER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    writes = sys.dont_write_bytecode
    sys.dont_write_bytecode = True  # no __pycache__ beside it: its folder holds the launcher's files alone
    try:
        spec.loader.exec_module(module)
    finally:
        sys.dont_write_bytecode = writes
    return module


launcher = _load_launcher()
EXAMPLES = ROOT / "jobs" / "examples"
BOOKING = {"job_id": 12, "allow_growth": True, "intra_op_threads": 2, "inter_op_threads": 1}


def launch(
    script: Path | str,
    *args: str,
    cwd: Path,
    config: dict[str, Any] | str | None = None,
    cuda: str = "GPU-test-00",
) -> subprocess.CompletedProcess[str]:
    env = _job_env(cuda)
    if config is not None:
        env[launcher.CONFIG_VAR] = config if isinstance(config, str) else json.dumps(config)
    return subprocess.run(
        [sys.executable, "-u", str(LAUNCHER), str(script), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


def _job_env(cuda: str = "GPU-test-00") -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", launcher.CONFIG_VAR}}
    # A fake card UUID: TF sees no GPU and runs on the CPU, as on a machine without CUDA.
    env.update(CUDA_VISIBLE_DEVICES=cuda, PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2", PORTAL_JOB_ID="12")
    return env


def write(path: Path, source: str) -> Path:
    path.write_text(textwrap.dedent(source))
    return path


def portal_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("[portal] launcher:")]


def env_only_line(cuda: str) -> str:
    """The launcher's line for a script that imports no GPU framework, run by `launch`."""
    return (
        "[portal] launcher: job 12 · no TensorFlow, PyTorch or JAX import in the script: settings via "
        f"environment only (CUDA_VISIBLE_DEVICES={cuda}, TF_FORCE_GPU_ALLOW_GROWTH unset, "
        "XLA_PYTHON_CLIENT_MEM_FRACTION unset, XLA_PYTHON_CLIENT_PREALLOCATE unset)"
    )


def test_it_runs_a_script_without_tensorflow_like_python(tmp_path: Path) -> None:
    # A user module named like one of the project's: nothing of the portal's may shadow it.
    write(tmp_path / "models.py", "WHO = 'user'\n")
    script = write(
        tmp_path / "train.py",
        """
        import json, os, sys
        import models
        print("RESULT " + json.dumps({
            "argv": sys.argv,
            "path0": sys.path[0],
            "main": __name__,
            "models": models.WHO,
            "tensorflow_loaded": "tensorflow" in sys.modules,
            "config_var": "PORTAL_LAUNCH_CONFIG" in os.environ,
            "job_id": os.environ.get("PORTAL_JOB_ID"),
            "launcher_dir_on_path": any(os.path.realpath(p or ".") == LAUNCHER_DIR for p in sys.path),
        }))
        """.replace("LAUNCHER_DIR", repr(str(LAUNCHER.parent))),
    )

    result = launch("train.py", "--lr", "0.1", cwd=tmp_path, config=BOOKING)

    assert result.returncode == 0, result.stderr
    assert portal_lines(result.stdout) == [env_only_line("GPU-test-00")]
    assert result.stdout.startswith("[portal] launcher:")
    seen = json.loads(result.stdout.split("RESULT ", 1)[1])
    assert seen == {
        "argv": ["train.py", "--lr", "0.1"],
        "path0": str(script.parent.resolve()),
        "main": "__main__",
        "models": "user",
        "tensorflow_loaded": False,
        "config_var": False,
        "job_id": "12",
        "launcher_dir_on_path": False,
    }


def test_it_lives_alone_in_a_folder_that_is_no_package() -> None:
    folder = LAUNCHER.parent
    assert not folder.name.isidentifier()  # no `import` can name it
    files = sorted(p.name for p in folder.iterdir() if p.name != "__pycache__")
    assert files == sorted(["launcher.py", *(f"{name}.py" for name in launcher.SIBLINGS)])
    assert all(name.startswith("_portal_launch_") for name in launcher.SIBLINGS)
    own = set(launcher.SIBLINGS)
    for path in folder.glob("*.py"):
        tree = ast.parse(path.read_bytes())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        # The job's interpreter may be any venv: the standard library only, TensorFlow when the script
        # uses it, and the launcher's own modules.
        assert {name.split(".")[0] for name in imported} - {"tensorflow"} - own <= sys.stdlib_module_names
        # The job's account reads them all as it reads the launcher.
        assert (path.stat().st_mode, path.stat().st_uid, path.stat().st_gid) == (
            LAUNCHER.stat().st_mode,
            LAUNCHER.stat().st_uid,
            LAUNCHER.stat().st_gid,
        )
    # Loading the launcher leaves none of its modules in sys.modules.
    assert not own & set(sys.modules)


def test_it_neither_shadows_nor_is_shadowed_by_user_modules_named_like_its_own(tmp_path: Path) -> None:
    """The script is named like one of the launcher's modules, a module and a package beside it like the
    others: the script imports its own, as with `python script.py`, and the launcher still runs on its
    own (it applied the booking, and keeps CUDA_VISIBLE_DEVICES on the booked cards)."""
    project = tmp_path / "project"
    (project / "_portal_launch_curves").mkdir(parents=True)
    write(project / "_portal_launch_config.py", "WHO = 'user config'\n")
    write(project / "_portal_launch_curves" / "__init__.py", "WHO = 'user curves'\n")
    write(
        project / "_portal_launch_tf.py",
        """
        import json, os, sys
        import _portal_launch_config, _portal_launch_curves
        os.environ["CUDA_VISIBLE_DEVICES"] = "1"
        print("RESULT " + json.dumps({
            "main": __name__,
            "path0": sys.path[0],
            "own": [m.WHO for m in (_portal_launch_config, _portal_launch_curves)],
            "files": [m.__file__ for m in (_portal_launch_config, _portal_launch_curves)],
            "loaded": sorted(name for name in sys.modules if name.startswith("_portal_launch")),
            "cuda": os.environ["CUDA_VISIBLE_DEVICES"],
        }))
        """,
    )
    script = "project/_portal_launch_tf.py"

    direct = subprocess.run(
        [sys.executable, "-u", script],
        cwd=tmp_path,
        env=_job_env(BOOKED),
        capture_output=True,
        text=True,
        timeout=60,
    )
    launched = launch(script, cwd=tmp_path, config=BOOKING, cuda=BOOKED)

    assert direct.returncode == 0, direct.stderr
    assert launched.returncode == 0, launched.stderr
    seen = json.loads(launched.stdout.split("RESULT ", 1)[1])
    assert seen == {**json.loads(direct.stdout.split("RESULT ", 1)[1]), "cuda": "GPU-test-01"}
    assert seen["own"] == ["user config", "user curves"]
    assert seen["files"] == [
        str(project.resolve() / "_portal_launch_config.py"),
        str(project.resolve() / "_portal_launch_curves" / "__init__.py"),
    ]
    assert seen["loaded"] == ["_portal_launch_config", "_portal_launch_curves"]  # the script's, only
    assert portal_lines(launched.stdout) == [env_only_line(BOOKED)]
    assert cuda_lines(launched)[0].startswith('[portal] CUDA_VISIBLE_DEVICES="1" asked by the script')


def test_it_finds_its_own_modules_when_its_folder_is_not_on_sys_path(tmp_path: Path) -> None:
    """PYTHONSAFEPATH (as -P) keeps the launcher's folder off sys.path: it loads its modules by path."""
    write(tmp_path / "job.py", "import sys\nprint('RESULT', sys.argv)\n")
    env = {**_job_env(), "PYTHONSAFEPATH": "1", launcher.CONFIG_VAR: json.dumps(BOOKING)}

    result = subprocess.run(
        [sys.executable, "-u", str(LAUNCHER), "job.py", "x"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert result.returncode == 0, result.stderr
    assert "RESULT ['job.py', 'x']" in result.stdout.splitlines()
    assert len(portal_lines(result.stdout)) == 1


@pytest.mark.parametrize("folder", ["project", "link"])
def test_it_gives_the_script_the_sys_path_of_python_script_py(tmp_path: Path, folder: str) -> None:
    """Run from another folder by a relative path (`link` is a symlink to `project`): the script
    imports its own siblings, even those named like the project's modules or the launcher, and the
    standard library's `selectors` (which the project's jobs/selectors.py would shadow)."""
    project = tmp_path / "project"
    project.mkdir()
    (tmp_path / "link").symlink_to(project)
    for name in ("helpers", "models", "signals", "runner", "launcher"):
        write(project / f"{name}.py", f"WHO = 'user {name}'\n")
    write(
        project / "train.py",
        """
        import json, selectors, sys
        import helpers, launcher, models, runner, signals
        print("RESULT " + json.dumps({
            "path": sys.path,
            "own": [m.WHO for m in (helpers, launcher, models, runner, signals)],
            "stdlib_selectors": hasattr(selectors, "DefaultSelector"),
        }))
        """,
    )
    script = f"{folder}/train.py"

    direct = subprocess.run(
        [sys.executable, "-u", script],
        cwd=tmp_path,
        env=_job_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    launched = launch(script, cwd=tmp_path, config=BOOKING)

    assert direct.returncode == 0, direct.stderr
    assert launched.returncode == 0, launched.stderr
    seen = json.loads(launched.stdout.split("RESULT ", 1)[1])
    assert seen == json.loads(direct.stdout.split("RESULT ", 1)[1])
    assert seen["path"][0] == str(project.resolve())
    assert seen["own"] == ["user helpers", "user launcher", "user models", "user runner", "user signals"]
    assert seen["stdlib_selectors"] is True


def test_it_imports_tensorflow_from_the_scripts_folder_first_as_python_does(tmp_path: Path) -> None:
    """The script's folder is first on sys.path before the launcher imports TensorFlow for it, so a
    package beside the script shadows the installed one, for that import too: here a fake
    `tensorflow` (just enough of the API for the settings) that records sys.path[0] when imported."""
    project = tmp_path / "project"
    (project / "tensorflow").mkdir(parents=True)
    write(
        project / "tensorflow" / "__init__.py",
        """
        import sys
        from types import SimpleNamespace

        __version__ = "0.0-beside-the-script"
        PATH0_AT_IMPORT = sys.path[0]
        ARGV_AT_IMPORT = list(sys.argv)
        _noop = lambda *args, **kwargs: None
        config = SimpleNamespace(
            list_physical_devices=lambda kind: [],
            set_soft_device_placement=_noop,
            threading=SimpleNamespace(
                set_intra_op_parallelism_threads=_noop, set_inter_op_parallelism_threads=_noop
            ),
        )
        debugging = SimpleNamespace(set_log_device_placement=_noop)
        """,
    )
    write(
        project / "train.py",
        """
        import json, sys
        import tensorflow as tf
        print("RESULT " + json.dumps({
            "file": tf.__file__,
            "path0_at_import": tf.PATH0_AT_IMPORT,
            "argv_at_import": tf.ARGV_AT_IMPORT,
        }))
        """,
    )

    direct = subprocess.run(
        [sys.executable, "-u", "project/train.py", "--lr", "0.1"],
        cwd=tmp_path,
        env=_job_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    launched = launch("project/train.py", "--lr", "0.1", cwd=tmp_path, config=BOOKING)

    assert direct.returncode == 0, direct.stderr
    assert launched.returncode == 0, launched.stderr
    seen = json.loads(launched.stdout.split("RESULT ", 1)[1])
    assert seen == json.loads(direct.stdout.split("RESULT ", 1)[1])
    assert seen["file"] == str(project.resolve() / "tensorflow" / "__init__.py")
    assert seen["path0_at_import"] == str(project.resolve())
    assert seen["argv_at_import"] == ["project/train.py", "--lr", "0.1"]
    # The launcher applied the booking to that package: it is the one it imported.
    (line,) = portal_lines(launched.stdout)
    assert line.startswith("[portal] launcher: job 12 · TensorFlow 0.0-beside-the-script")


@pytest.mark.parametrize(
    ("body", "code"),
    [("raise ValueError('boom')", 1), ("import sys\nsys.exit(3)", 3), ("print('fine')", 0)],
)
def test_it_passes_exit_codes_through(tmp_path: Path, body: str, code: int) -> None:
    write(tmp_path / "job.py", f"def run():\n    pass\n{body}\n")

    result = launch("job.py", cwd=tmp_path, config=BOOKING)

    assert result.returncode == code, result.stderr
    if code == 1:
        assert "Traceback (most recent call last):" in result.stderr
        assert 'job.py", line 3, in <module>' in result.stderr
        assert result.stderr.rstrip().endswith("ValueError: boom")
        # Reads like `python job.py`: none of the launcher's own frames.
        assert "launcher.py" not in result.stderr and "runpy" not in result.stderr


@pytest.mark.parametrize(
    "config",
    [None, "{not json", "[1, 2]", '{"allow_growth": "yes"}', '{"memory_limit_mb": -5}'],
)
def test_it_rejects_a_missing_or_bad_config(tmp_path: Path, config: str | None) -> None:
    write(tmp_path / "job.py", "print('should not run')\n")

    result = launch("job.py", cwd=tmp_path, config=config)

    assert result.returncode == 2
    assert "PORTAL_LAUNCH_CONFIG" in result.stderr
    assert "should not run" not in result.stdout


def test_it_rejects_a_missing_script(tmp_path: Path) -> None:
    result = launch("nope.py", cwd=tmp_path, config=BOOKING)

    assert result.returncode == 2
    assert "script not found: nope.py" in result.stderr


def test_it_finds_framework_imports_anywhere_in_the_script() -> None:
    used = launcher.frameworks_used
    tf, torch, jax = launcher.TENSORFLOW, launcher.TORCH, launcher.JAX
    assert used(b"def f():\n    import tensorflow as tf\n", None) == {tf}
    assert used(b"import os, tensorflow.compat.v1 as tf\n", None) == {tf}
    assert used(b"from tf_keras import layers\n", "jax") == {tf}  # Keras 2 runs on TensorFlow only
    assert used(b"import torch.nn as nn\nfrom flax import linen\n", None) == {torch, jax}
    assert not used(
        b"import tensorflow_helpers, torchvision_like\nfrom .keras import x\n# import jax\n", None
    )
    assert not used(b"def broken(:\n", None)


@pytest.mark.parametrize(
    ("backend", "source", "expected"),
    [
        (None, "import keras", {"tensorflow"}),  # Keras 3's default backend
        ("tensorflow", "from keras.layers import Dense", {"tensorflow"}),
        ("jax", "import keras", {"jax"}),
        ("torch", "import keras", {"torch"}),
        ("numpy", "import keras", set()),  # holds no GPU
        ("nonsense", "import keras", set()),  # Keras itself says what is wrong
        # The script chooses its backend itself, as Keras's own examples do: that wins.
        ("torch", 'import os\nos.environ["KERAS_BACKEND"] = "jax"\nimport keras', {"jax"}),
        (None, 'import os\nos.environ.setdefault("KERAS_BACKEND", "torch")\nimport keras', {"torch"}),
        ("jax", 'import os\nos.environ["KERAS_BACKEND"] = "jax"', set()),  # no Keras: nothing
    ],
)
def test_it_counts_keras_as_its_backend(backend: str | None, source: str, expected: set[str]) -> None:
    assert launcher.frameworks_used(source.encode(), backend) == expected


def test_it_runs_the_keras_example_with_the_booking(tmp_path: Path) -> None:
    result = launch(EXAMPLES / "keras_example.py", "--epochs", "2", cwd=tmp_path, config=BOOKING)

    assert result.returncode == 0, result.stderr
    (line,) = portal_lines(result.stdout)
    assert result.stdout.startswith(line)
    assert line.startswith("[portal] launcher: job 12 · TensorFlow 2.21")
    assert "GPUs visible: 0 (CUDA_VISIBLE_DEVICES=GPU-test-00)" in line
    assert "threads intra 2 / inter 1" in line
    assert "memory_limit none · allow_growth on" in line
    assert "CUDA_VISIBLE_DEVICES=GPU-test-00" in result.stdout.splitlines()
    assert "Epoch 1/2" in result.stdout and "Epoch 2/2" in result.stdout
    assert "loss:" in result.stdout
    assert "done: accuracy=" in result.stdout


def test_it_applies_settings_after_an_indirect_import_and_ignores_later_setters(tmp_path: Path) -> None:
    # The script itself never imports TensorFlow: its helper does, so the meta path hook has to apply.
    write(tmp_path / "helper.py", "import tensorflow as tf\n")
    write(
        tmp_path / "job.py",
        """
        import importlib.util
        assert importlib.util.find_spec("tensorflow")  # an availability check must not use up the hook
        import helper
        tf = helper.tf
        print("sum", float(tf.reduce_sum(tf.constant([1.0, 2.0]))))  # the runtime is initialised now
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.experimental.set_memory_growth(cpu, True)
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()])
        tf.config.experimental.set_virtual_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()])
        tf.config.threading.set_intra_op_parallelism_threads(7)
        strategy = tf.distribute.get_strategy()
        print("THREADS", tf.config.threading.get_intra_op_parallelism_threads(),
              tf.config.threading.get_inter_op_parallelism_threads())
        print("STRATEGY", type(strategy).__name__, strategy.num_replicas_in_sync)
        """,
    )
    booking = {
        **BOOKING,
        "memory_limit_mb": 1024,
        "intra_op_threads": 3,
        "inter_op_threads": 2,
        "mirrored": True,
    }

    result = launch("job.py", cwd=tmp_path, config=booking, cuda="")

    assert result.returncode == 0, result.stderr
    env_line, applied_line = portal_lines(result.stdout)
    assert "no TensorFlow, PyTorch or JAX import in the script" in env_line
    assert applied_line.startswith("[portal] launcher: job 12 · TensorFlow 2.21")
    assert "GPUs visible: 0 (CUDA_VISIBLE_DEVICES=)" in applied_line
    assert "memory_limit 1024 MiB per GPU" in applied_line
    assert "threads intra 3 / inter 2" in applied_line
    assert "MirroredStrategy on (1 replicas)" in applied_line
    assert applied_line.endswith("applied when TensorFlow was imported indirectly")
    assert "THREADS 3 2" in result.stdout
    assert "STRATEGY MirroredStrategy 1" in result.stdout
    for name in ("set_memory_growth", "set_logical_device_configuration", "set_virtual_device_configuration"):
        assert (
            f"[portal] ignored {name}(...): the portal already configured GPU memory for this booking"
            in result.stderr
        )
    assert "[portal] ignored set_intra_op_parallelism_threads(...)" in result.stderr


def test_it_merges_the_booking_into_tf1_sessions(tmp_path: Path) -> None:
    booking = {**BOOKING, "memory_fraction": 0.25, "intra_op_threads": 4}

    # The script asks for 0.9 (more than booked: capped) and then 0.1 (less than booked: kept).
    result = launch(EXAMPLES / "tf1_session_example.py", "0.9", "0.1", cwd=tmp_path, config=booking)

    assert result.returncode == 0, result.stderr
    sessions = [
        json.loads(line.split(" ", 1)[1]) for line in result.stdout.splitlines() if "SESSION_CONFIG" in line
    ]
    assert [s["fraction"] for s in sessions] == [0.25, 0.1]
    for held in sessions:
        assert held["allow_growth"] is True  # the script asked for False
        assert held["intra"] == 4  # the script asked for 16
        assert held["inter"] == 1
        assert held["soft"] is True
        assert held["log"] is False
        assert held["script_fraction"] == held["asked_fraction"]  # the caller's ConfigProto is not mutated
        assert held["result"] == 12.0
    assert result.stderr.count("[portal] merged the booking into a tf.compat.v1.Session config") == 1
    assert "fraction=0.25, allow_growth=True, intra=4, inter=1" in result.stderr


# --------------------------------------------------------------------------------------------------------
# CUDA_VISIBLE_DEVICES stays on the booked cards

BOOKED = "GPU-test-00,GPU-test-01,GPU-test-02"
# What the script sees of its variables, three ways: os.environ, the process environment as C code reads it
# (PyTorch and JAX call getenv when CUDA starts), and a child process started without env=.
SEES = """
import ctypes, json, os, subprocess

libc = ctypes.CDLL(None)
libc.getenv.restype = ctypes.c_char_p


def seen(name):
    c_value = libc.getenv(name.encode())
    child = subprocess.run(["sh", "-c", f'echo "${{{name}-(unset)}}"'], capture_output=True, text=True)
    return {
        "environ": os.environ.get(name),
        "getenv": c_value.decode() if c_value is not None else None,
        "child": child.stdout.rstrip("\\n"),
    }


print("RESULT " + json.dumps({name: seen(name) for name in NAMES}))
"""


def run_seeing(tmp_path: Path, statements: str, names: tuple[str, ...] = ("CUDA_VISIBLE_DEVICES",)) -> Any:
    """Run `statements` as the top of a script on a booking of three cards; return what it then sees."""
    source = textwrap.dedent(statements) + SEES.replace("NAMES", repr(names))
    write(tmp_path / "job.py", source)
    result = launch("job.py", cwd=tmp_path, config=BOOKING, cuda=BOOKED)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.split("RESULT ", 1)[1]), result


def cuda_lines(result: subprocess.CompletedProcess[str]) -> list[str]:
    assert "[portal] CUDA_VISIBLE_DEVICES" not in result.stdout  # the launcher's warnings go to stderr
    return [line for line in result.stderr.splitlines() if line.startswith("[portal] CUDA_VISIBLE_DEVICES")]


def everywhere(value: str) -> dict[str, str]:
    return {"environ": value, "getenv": value, "child": value}


@pytest.mark.parametrize(
    ("asked", "got", "what"),
    [
        ("2", "GPU-test-02", "booked card 2"),  # an old tutorial's host index counts the booked cards
        ("0,1", "GPU-test-00,GPU-test-01", "booked cards 0, 1"),
        ("-1", "-1", "no GPU"),
        ("", "", "no GPU"),
        ("7", "-1", "no GPU"),  # beyond the booking: dropped, nothing left
        ("GPU-test-01", "GPU-test-01", "booked card 1"),
        ("GPU-other-05,1", "GPU-test-01", "booked card 1"),  # somebody else's card: dropped
    ],
)
def test_it_keeps_a_scripts_cuda_visible_devices_on_the_booked_cards(
    tmp_path: Path, asked: str, got: str, what: str
) -> None:
    # Set twice, as a loop or a second helper would: one line in the log all the same.
    seen, result = run_seeing(
        tmp_path,
        f"""
        import os
        os.environ["CUDA_VISIBLE_DEVICES"] = {asked!r}
        os.environ["CUDA_VISIBLE_DEVICES"] = {asked!r}
        """,
    )

    assert seen["CUDA_VISIBLE_DEVICES"] == everywhere(got)
    assert cuda_lines(result) == [
        f'[portal] CUDA_VISIBLE_DEVICES="{asked}" asked by the script → "{got}" ({what}); '
        "indices count the 3 booked cards only, other cards are dropped"
    ]


UNSET_LINE = (
    f'[portal] CUDA_VISIBLE_DEVICES unset by the script → "{BOOKED}" (booked cards 0, 1, 2); '
    "unset, it would mean every card of the host"
)


@pytest.mark.parametrize(
    ("statements", "expected", "lines"),
    [
        ('os.environ.update(CUDA_VISIBLE_DEVICES="1")', everywhere("GPU-test-01"), 1),
        ('os.environ |= {"CUDA_VISIBLE_DEVICES": "1"}', everywhere("GPU-test-01"), 1),
        ('os.environb[b"CUDA_VISIBLE_DEVICES"] = b"1"', everywhere("GPU-test-01"), 1),
        # Already set (to the booking): nothing to do, as for any variable that is set.
        ('os.environ.setdefault("CUDA_VISIBLE_DEVICES", "1")', everywhere(BOOKED), 0),
        # os.putenv leaves os.environ as it was, as it always does; the process environment is mapped.
        (
            'os.putenv("CUDA_VISIBLE_DEVICES", "1")',
            {"environ": BOOKED, "getenv": "GPU-test-01", "child": "GPU-test-01"},
            1,
        ),
    ],
)
def test_it_maps_every_way_of_setting_cuda_visible_devices(
    tmp_path: Path, statements: str, expected: dict[str, str], lines: int
) -> None:
    seen, result = run_seeing(tmp_path, f"import os\n{statements}\n")

    assert seen["CUDA_VISIBLE_DEVICES"] == expected
    assert len(cuda_lines(result)) == lines
    if lines:
        assert cuda_lines(result)[0].startswith('[portal] CUDA_VISIBLE_DEVICES="1" asked by the script')


@pytest.mark.parametrize(
    ("statements", "in_environ"),
    [
        ('del os.environ["CUDA_VISIBLE_DEVICES"]', BOOKED),
        ('assert os.environ.pop("CUDA_VISIBLE_DEVICES") == "GPU-test-02"', BOOKED),
        (
            'os.environ.pop("CUDA_VISIBLE_DEVICES", None)\nos.environ.pop("CUDA_VISIBLE_DEVICES", None)',
            BOOKED,
        ),
        ("os.environ.clear()", BOOKED),
        # os.unsetenv leaves os.environ as it was, as it always does; the process environment is mapped.
        ('os.unsetenv("CUDA_VISIBLE_DEVICES")', "GPU-test-02"),
    ],
)
def test_it_gives_the_booking_back_when_a_script_unsets_cuda_visible_devices(
    tmp_path: Path, statements: str, in_environ: str
) -> None:
    # Unset, CUDA would show every card of the host. The script narrowed it to one card first.
    seen, result = run_seeing(
        tmp_path, f'import os\nos.environ["CUDA_VISIBLE_DEVICES"] = "2"\n{statements}\n'
    )

    assert seen["CUDA_VISIBLE_DEVICES"] == {**everywhere(BOOKED), "environ": in_environ}
    assert cuda_lines(result)[1:] == [UNSET_LINE]


def test_it_leaves_other_variables_alone(tmp_path: Path) -> None:
    seen, result = run_seeing(
        tmp_path,
        """
        import os
        os.environ["OTHER_DEVICES"] = "2"
        os.environ.update(CUDA_DEVICE_ORDER="FASTEST_FIRST")
        os.environ.setdefault("NEW_ONE", "x")
        os.putenv("PUT_ONLY", "7")
        del os.environ["PORTAL_JOB_ID"]
        os.unsetenv("TF_CPP_MIN_LOG_LEVEL")
        """,
        names=(
            "OTHER_DEVICES",
            "CUDA_DEVICE_ORDER",
            "NEW_ONE",
            "PUT_ONLY",
            "PORTAL_JOB_ID",
            "TF_CPP_MIN_LOG_LEVEL",
            "CUDA_VISIBLE_DEVICES",
        ),
    )

    assert seen == {
        "OTHER_DEVICES": everywhere("2"),
        "CUDA_DEVICE_ORDER": everywhere("FASTEST_FIRST"),
        "NEW_ONE": everywhere("x"),
        "PUT_ONLY": {"environ": None, "getenv": "7", "child": "7"},
        "PORTAL_JOB_ID": {"environ": None, "getenv": None, "child": "(unset)"},
        "TF_CPP_MIN_LOG_LEVEL": {"environ": "2", "getenv": None, "child": "(unset)"},
        "CUDA_VISIBLE_DEVICES": everywhere(BOOKED),
    }
    assert cuda_lines(result) == []


def test_it_maps_names_and_indices_onto_the_booked_cards_only() -> None:
    devices = launcher.CudaDevices(["GPU-aa11", "GPU-bb22", "GPU-ab33"])
    assert devices.resolve(" 2 , 0,2") == "GPU-ab33,GPU-aa11"  # CUDA's spaces; a card once
    assert devices.resolve("GPU-b") == "GPU-bb22"  # a unique prefix, as CUDA takes it
    assert devices.resolve("GPU-a,3") == "-1"  # an ambiguous prefix; an index beyond the booking
    assert devices.resolve("MIG-9c1f,GPU-cc44") == "-1"  # no MIG id names a booked card here
    assert devices.resolve("  ") == ""
    assert devices.resolve(None) == "GPU-aa11,GPU-bb22,GPU-ab33"
    for asked in ("1,2", "0,-1", "-1", "", "GPU-b,GPU-aa", None):
        got = devices.resolve(asked)
        assert devices.resolve(got) == got  # os.environ maps, then os.putenv maps what it got
    assert launcher.CudaDevices([]).resolve("0") == "-1"  # a job without a card gets none
