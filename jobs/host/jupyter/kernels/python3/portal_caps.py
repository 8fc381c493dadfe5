"""Run in each Python kernel of a portal JupyterLab before its first cell (the kernel spec's
IPKernelApp.exec_files; jobs/host/lab.py puts this kernel spec first on JUPYTER_PATH): the booking's
TensorFlow and PyTorch caps, applied by the job launcher's own code (jobs/host/launcher-bin), as in a
job. TensorFlow is configured when it is imported, PyTorch when CUDA starts; JAX reads its cap
from the environment. Nothing is left in the notebook's namespace."""


def _portal_caps() -> None:
    import importlib.util
    import os
    import sys

    path = os.environ.get("PORTAL_LAUNCHER", "")
    if not path or not os.path.isfile(path):
        return  # not a portal lab: the kernel runs as any other
    spec = importlib.util.spec_from_file_location("_portal_launcher", path)
    if spec is None or spec.loader is None:
        return
    launcher = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launcher)
    try:
        config = launcher.load_config(os.environ.get(launcher.CONFIG_VAR))
    except launcher.LaunchError as exc:
        print(f"[portal] the booking's TensorFlow and PyTorch caps are not applied: {exc}", file=sys.stderr)
        return
    launcher.guard_cuda_devices()
    if "tensorflow" not in sys.modules:
        sys.meta_path.insert(0, launcher.tensorflow_import_hook(config))
    sys.meta_path.insert(0, launcher.torch_import_hook(config))


_portal_caps()
del _portal_caps
