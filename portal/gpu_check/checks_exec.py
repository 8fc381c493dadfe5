"""Check 6: `gpu exec` on a booking, run through the CLI as a person on the GPU host would."""

from __future__ import annotations

import json
import subprocess
import sys

from portal.gpu_check.bootstrap import ROOT
from portal.gpu_check.context import Context, row, skip
from portal.gpu_check.machine import SCRIPTS
from portal.gpu_check.report import Row
from portal.gpu_check.waiting import Deadline


def check_exec(ctx: Context, deadline: Deadline) -> list[Row]:
    name = "gpu exec sees only the booked card"
    expected = (
        "inside `gpu exec -r <booking>`: CUDA_VISIBLE_DEVICES the booked UUID, device_count 1, that UUID"
    )
    if ctx.frameworks["PyTorch"]:
        return [skip(name, expected, f"no PyTorch ({ctx.frameworks['PyTorch']})")]
    card = ctx.cards[0]
    booking = ctx.book(ctx.alice, [card["uuid"]], ctx.share_mb(card))
    env = {
        **ctx.portal.env,
        "GPU_PORTAL_URL": ctx.portal.base,
        "GPU_PORTAL_TOKEN": ctx.alice.token,
        "GPU_SERVER": ctx.server,
        "XDG_CONFIG_HOME": str(ctx.work / "config"),  # never this account's own `gpu login`
    }
    gpu = [sys.executable, "-c", "from gpu_cli.main import cli; cli()"]
    probe = [ctx.python, str(SCRIPTS / "visible.py"), "--probe"]
    done = subprocess.run(
        [*gpu, "exec", "-r", str(booking), "--", *probe],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=deadline.left(),
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        return [row(name, expected, f"exit {done.returncode}: {(done.stdout + done.stderr)[-500:]}", False)]
    said = json.loads(lines[-1])
    ok = said["env"] == card["uuid"] and said["count"] == 1 and said["uuids"] == [card["uuid"]]
    seen = f"CUDA_VISIBLE_DEVICES={said['env']}; device_count {said['count']}, UUIDs {said['uuids']}"
    return [row(name, expected, seen, ok)]
