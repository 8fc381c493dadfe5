"""Hold MiB of GPU memory with PyTorch on the first visible card until killed: `hold.py 2048`.

Prints `held <epoch time>` once the memory is allocated.
"""

import sys
import time

import torch

MIB = 2**20

block = torch.empty(int(sys.argv[1]) * MIB, dtype=torch.uint8, device="cuda:0")
torch.cuda.synchronize()
print(f"held {time.time()}", flush=True)
while True:
    time.sleep(1)
