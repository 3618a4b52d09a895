"""Waiting on an `adaflash serve` reached over HTTP (the demo, the screenshot script and the
test fixtures each start one as a child process)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import httpx


def alive(url: str) -> bool:
    """Whether ``url/health`` answers 200."""
    try:
        return httpx.get(f"{url}/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def wait_until_up(
    url: str, proc: subprocess.Popen | None, timeout_s: float, log: Path | None = None
) -> None:
    """Until ``url`` is healthy; RuntimeError (with the log's tail) if ``proc`` exits first or
    ``timeout_s`` passes."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log and log.is_file() else ""
            raise RuntimeError(f"the server exited with {proc.returncode}; {log}:\n{tail}")
        if alive(url):
            return
        time.sleep(0.3)
    raise RuntimeError(f"no server answered at {url} within {timeout_s:.0f} s; see {log}")
