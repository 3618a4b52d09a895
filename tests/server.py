"""A real `adaflash serve` process on a tiny model, reached over HTTP (API and UI tests)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from app.serve_process import wait_until_up
from tests.tiny import build_serving_folders

ADMIN_TOKEN = "test-admin-token"


@dataclass
class Server:
    url: str
    target: Path
    drafter: Path
    data: Path
    proc: subprocess.Popen
    log: Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(root: Path, *extra: str, admin: bool = True, compile: bool = False) -> Server:
    """``serve`` on tiny models; eager steps unless ``compile`` (a background compile would
    switch a test's steps to the compiled graph halfway through; tests/app/test_compiled_serve.py
    covers that path)."""
    target, drafter = build_serving_folders(root)
    port = free_port()
    data = root / "data"
    log = root / "server.log"
    cmd = [
        sys.executable,
        "-m",
        "app.cli",
        "serve",
        "--target",
        str(target),
        "--drafter",
        str(drafter),
        "--dtype",
        "float32",
        "--port",
        str(port),
        "--no-trainer",
        "--max-new-tokens",
        "256",
        *extra,
    ]
    if admin:
        cmd += ["--admin-token", ADMIN_TOKEN]
    if not compile:
        cmd += ["--no-compile"]
    env = {**os.environ, "ADAFLASH_DATA": str(data), "PYTHONUNBUFFERED": "1"}
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(url, proc, 120, log)
    except RuntimeError:
        proc.kill()
        raise
    return Server(url, target, drafter, data, proc, log)


def stop_server(server: Server) -> int:
    server.proc.send_signal(signal.SIGINT)
    return server.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server(tmp_path_factory.mktemp("serve"))
    yield s
    if s.proc.poll() is None:
        stop_server(s)
