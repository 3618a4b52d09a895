"""Refresh docs/screenshots/ from a real `adaflash serve` on the default model.

Starts the server (fresh data folder, admin token), sends a few chats through the OpenAI API so
the dashboard has data, then drives Debian's Chromium with Playwright through the three tabs.
With ``--adaptation URL`` it instead photographs the Dashboard of a server that `adaflash demo`
is driving (60-minute window: the version markers so far) as ``adaptation.png``.

    python scripts/screenshots.py [--out docs/screenshots]
    python scripts/screenshots.py --adaptation http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from playwright.sync_api import expect, sync_playwright

from app.serve_process import wait_until_up

TOKEN = "screenshot-admin-token"
QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for a good night's sleep.",
    "Write a haiku about the sea.",
]


BROWSER_ARGS = [
    "--no-sandbox",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-gpu",
]


def adaptation(url: str, path: Path) -> None:
    """The Dashboard of a running server over the last 60 minutes."""
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=BROWSER_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 1000})
        page.set_default_timeout(300_000)
        page.goto(url.rstrip("/") + "/ui/")
        page.get_by_role("tab", name="Dashboard").click()
        page.locator("#plot-timeline").scroll_into_view_if_needed()
        page.get_by_label("Window").click()
        page.get_by_role("option", name="60 min").click()
        expect(page.locator("#dash-summary")).to_contain_text("last 60 min", timeout=180_000)
        time.sleep(5)  # a timer tick or two: the plots redrawn for the window
        page.screenshot(path=str(path), full_page=True)
        browser.close()
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="docs/screenshots")
    ap.add_argument("--port", type=int, default=8631)
    ap.add_argument("--adaptation", metavar="URL", help="photograph this server's Dashboard")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.adaptation:
        adaptation(args.adaptation, out / "adaptation.png")
        return
    data = Path(tempfile.mkdtemp(prefix="adaflash-shots-"))
    env = {**os.environ, "ADAFLASH_DATA": str(data)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "app.cli",
            "serve",
            "--port",
            str(args.port),
            "--admin-token",
            TOKEN,
            "--no-trainer",
        ],
        env=env,
    )
    url = f"http://127.0.0.1:{args.port}"
    try:
        wait_until_up(url, proc, 600)
        for q in QUESTIONS[1:]:
            httpx.post(
                url + "/v1/chat/completions",
                timeout=300,
                json={
                    "messages": [{"role": "user", "content": q}],
                    "max_tokens": 96,
                    "temperature": 0,
                    "domain": "chat",
                },
            )
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=BROWSER_ARGS)
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.set_default_timeout(300_000)
            page.goto(url + "/ui/")
            page.locator("#chat-input textarea").fill(QUESTIONS[0])
            page.locator("#send").click()
            expect(page.locator("#reply-stats")).to_contain_text("finish:")
            page.screenshot(path=str(out / "chat.png"), full_page=True)
            page.get_by_role("tab", name="Dashboard").click()
            expect(page.locator("#plot-timeline img")).to_be_visible()
            time.sleep(3)
            page.screenshot(path=str(out / "dashboard.png"), full_page=True)
            page.get_by_role("tab", name="Admin").click()
            page.locator("#admin-token input").fill(TOKEN)
            page.locator("#admin-login").click()
            expect(page.locator("#versions-table")).to_contain_text("v0000")
            page.screenshot(path=str(out / "admin.png"), full_page=True)
            browser.close()
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    print(f"wrote {out}/chat.png, dashboard.png, admin.png")


if __name__ == "__main__":
    main()
