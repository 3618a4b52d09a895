"""Where the repository is, and paths as result files record them (relative to it)."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def write_text_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` whole: a reader (or a process killed mid-write) sees the old
    file or the new one, never half of it."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def repo_relative(path: str | Path) -> str:
    """A path inside the repository as relative to it (result files name no machine's paths)."""
    p = Path(path).resolve()
    return str(p.relative_to(REPO)) if p.is_relative_to(REPO) else str(path)
