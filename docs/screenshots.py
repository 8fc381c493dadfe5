"""Take the README's two screenshots from a running portal: docs/img/dashboard.png and docs/img/job.png.

Start a private portal first (its own var folder, port and Redis socket), then run this script
against it, then stop the portal with Ctrl-C:

    mkdir -p /tmp/var-docs
    PORTAL_DEVELOPMENT=1 PORTAL_VAR_DIR=/tmp/var-docs PORT=8765 WORKER_CONCURRENCY=1 \
        .venv/bin/python -m portal.embedded_redis --socket /tmp/var-docs/redis.sock -- \
        .venv/bin/python manage.py runportal &
    .venv/bin/python docs/screenshots.py --url http://localhost:8765

As bob (demo password) it books a whole card; as alice, 8 GB of a shared card, on which it
runs the example Keras job (jobs/examples/keras_example.py) for many epochs. It takes the job
page once the live log shows a few epochs, then the dashboard, then cancels the job.
Needs Debian's chromium (apt-get install chromium), as the browser tests do.
"""

from __future__ import annotations

import argparse
import os
import struct
import zlib
from pathlib import Path

import numpy as np  # installed with TensorFlow
from playwright.sync_api import Page, sync_playwright

CHROMIUM = os.environ.get("CHROMIUM_PATH", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
IMG = Path(__file__).resolve().parent / "img"
EXAMPLE = Path(__file__).resolve().parent.parent / "jobs" / "examples" / "keras_example.py"
EPOCHS = 300
PASSWORD = os.environ.get("PORTAL_DEMO_PASSWORD", "gpu-lab-demo")


def log_in(page: Page, username: str) -> None:
    page.goto("/login/")
    page.fill("input[name=username]", username)
    page.fill("input[name=password]", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url("**/")


def book(page: Page, *, server: str, memory: str, note: str) -> None:
    """One card on `server` through the booking form; `memory` empty books the whole card."""
    page.goto("/reservations/new/")
    page.fill("input[name=count]", "1")
    page.select_option("select[name=server]", server)
    page.fill("input[name=memory]", memory)
    page.fill("textarea[name=note]", note)
    page.click("form.booking-form button[type=submit]")
    page.wait_for_url("**/reservations/*/")


def run_example(page: Page) -> bool:
    """Submit the example script through *Run a job*, with more epochs than *Run the example*
    (3) so both pages can be taken while it runs. True once the live log shows a few epochs,
    False if the job ended first (on a machine shared with test runs, a test's worker for the
    same simulated server name may kill it as an orphan)."""
    page.click("text=Run a job")
    page.set_input_files("input[name=script]", str(EXAMPLE))
    page.fill("input[name=args]", f"--epochs {EPOCHS}")
    page.click("form.job-form button[type=submit]")
    page.wait_for_url("**/jobs/*/")
    # The page polls the log once a second; the example prints one line per epoch.
    handle = page.wait_for_function(
        """() => {
            const log = document.querySelector('#job-log').textContent;
            const status = document.querySelector('#job-log-status').textContent;
            if (log.includes('Epoch 6/')) return 'running';
            return status.startsWith('finished') ? 'ended' : false;
        }""",
        timeout=180_000,
    )
    return handle.json_value() == "running"


def _png_rgb(data: bytes) -> np.ndarray:
    """Decode an 8-bit RGB/RGBA PNG as Chromium writes it (no interlace) into height × width × 3."""
    pos, idat = 8, b""
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        body = data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, color = struct.unpack(">IIBB", body[:10])
            if depth != 8 or color not in (2, 6) or body[12]:
                raise ValueError(f"unexpected PNG: depth {depth}, colour type {color}, interlace {body[12]}")
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    bpp = 3 if color == 2 else 4
    raw = np.frombuffer(zlib.decompress(idat), np.uint8).reshape(height, 1 + width * bpp)
    out = np.zeros((height, width * bpp), np.int32)
    prev = np.zeros(width * bpp, np.int32)
    zero = np.zeros(bpp, np.int32)
    for y in range(height):  # undo the row filters (PNG spec, section 9)
        kind, cur = raw[y, 0], raw[y, 1:].astype(np.int32)
        if kind == 1:  # Sub: a running sum along the row, per channel
            cur = (np.cumsum(cur.reshape(width, bpp), axis=0) & 255).reshape(-1)
        elif kind == 2:  # Up
            cur = (cur + prev) & 255
        elif kind in (3, 4):  # Average, Paeth: pixel by pixel
            for x in range(0, width * bpp, bpp):
                a = cur[x - bpp : x] if x else zero
                b = prev[x : x + bpp]
                if kind == 3:
                    pred = (a + b) // 2
                else:
                    c = prev[x - bpp : x] if x else zero
                    p = a + b - c
                    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                    pred = np.where((pa <= pb) & (pa <= pc), a, np.where(pb <= pc, b, c))
                cur[x : x + bpp] = (cur[x : x + bpp] + pred) & 255
        out[y] = prev = cur
    return out.reshape(height, width, bpp)[:, :, :3]


def shrink_png(path: Path) -> None:
    """Rewrite a screenshot as a 256-colour palette PNG: a page has a few thousand colours, most
    of them anti-aliasing, so it looks the same at a third of the size. (Pillow is not a
    dependency, so this is numpy and zlib.)"""
    image = _png_rgb(path.read_bytes())
    height, width, _ = image.shape
    keys = (image[:, :, 0] << 16 | image[:, :, 1] << 8 | image[:, :, 2]).reshape(-1)
    colours, index, counts = np.unique(keys, return_inverse=True, return_counts=True)
    rgb = np.stack([colours >> 16 & 255, colours >> 8 & 255, colours & 255], axis=1)
    palette = rgb[np.argsort(-counts)[:256]]  # the most used; every other colour takes its nearest
    nearest = ((rgb[:, None, :] - palette[None, :, :]) ** 2).sum(axis=2).argmin(axis=1).astype(np.uint8)
    rows = np.concatenate([np.zeros((height, 1), np.uint8), nearest[index].reshape(height, width)], axis=1)

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    path.write_bytes(
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 3, 0, 0, 0))
        + chunk(b"PLTE", palette.astype(np.uint8).tobytes())
        + chunk(b"IDAT", zlib.compress(rows.tobytes(), 9))
        + chunk(b"IEND", b"")
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", default="http://localhost:8765")
    args = parser.parse_args()
    IMG.mkdir(exist_ok=True)

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            bob = browser.new_context(base_url=args.url, viewport={"width": 1280, "height": 800})
            page = bob.new_page()
            log_in(page, "bob")
            book(page, server="sim-rtx-4x24", memory="", note="LLM eval sweep")
            bob.close()

            alice = browser.new_context(base_url=args.url, viewport={"width": 1280, "height": 800})
            page = alice.new_page()
            page.set_default_timeout(30_000)
            log_in(page, "alice")
            book(page, server="sim-h100-8x80", memory="16G", note="ResNet-50 fine-tune")
            booking_url = page.url
            for _attempt in range(3):
                page.goto(booking_url)
                if run_example(page):
                    break
            else:
                raise SystemExit("the example job failed three times: see the portal's log")
            job_url = page.url
            page.screenshot(path=str(IMG / "job.png"), full_page=True)

            page.goto("/")
            page.wait_for_timeout(4_000)  # a telemetry round: the job's process on its card
            page.screenshot(path=str(IMG / "dashboard.png"), full_page=True)

            page.goto(job_url)
            page.click("form[action$='/cancel/'] button[type=submit]")
            alice.close()
        finally:
            browser.close()
    for name in ("dashboard.png", "job.png"):
        shrink_png(IMG / name)
        print(f"{IMG / name}: {(IMG / name).stat().st_size // 1024} KB")


if __name__ == "__main__":
    main()
