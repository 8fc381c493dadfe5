"""Every Python process of a gpu-check test on this fake machine reads the fake NVML (fake_gpu.py)."""

import os

if os.environ.get("FAKE_GPU_DIR"):
    import fake_gpu

    fake_gpu.install_when_imported()
