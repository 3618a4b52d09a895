"""The code-quality gates run with the tests: ruff (lint + format) and mypy on the typed core."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", *cmd], cwd=REPO, capture_output=True, text=True, timeout=600
    )


def test_ruff_lint_and_format():
    lint = run("ruff", "check", ".")
    assert lint.returncode == 0, lint.stdout[-3000:]
    fmt = run("ruff", "format", "--check", ".")
    assert fmt.returncode == 0, fmt.stdout[-3000:]


def test_mypy_on_adaflash_db_app_ui():
    out = run("mypy", "adaflash", "db", "app", "ui")
    assert out.returncode == 0, out.stdout[-3000:]
