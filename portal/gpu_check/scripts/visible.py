"""What CUDA shows this process, then what a child sees after the script sets its own
CUDA_VISIBLE_DEVICES=1 (the launcher maps it onto the booking). Prints one `[gpu-check] {json}`."""

import json
import os
import subprocess
import sys

PROBE = """
import json, os, torch
count = torch.cuda.device_count()
uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(count)]
uuids = [u if u.startswith("GPU-") else "GPU-" + u for u in uuids]
print(json.dumps({"env": os.environ.get("CUDA_VISIBLE_DEVICES"), "count": count, "uuids": uuids}))
"""

if __name__ == "__main__":
    if sys.argv[1:] == ["--probe"]:  # gpu exec runs the probe alone
        exec(PROBE)
        sys.exit()
    seen = json.loads(
        subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout
    )
    os.environ["CUDA_VISIBLE_DEVICES"] = "1"
    child = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    seen["remapped"] = json.loads(child.stdout)
    print("[gpu-check] " + json.dumps(seen), flush=True)
