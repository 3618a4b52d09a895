"""Where the repository is, and paths as result files record them (relative to it)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def repo_relative(path: str | Path) -> str:
    """A path inside the repository as relative to it (result files name no machine's paths)."""
    p = Path(path).resolve()
    return str(p.relative_to(REPO)) if p.is_relative_to(REPO) else str(path)
