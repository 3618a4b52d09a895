"""The shipped prompt sets (workloads/*.jsonl, made by scripts/make_workloads.py) and the
trajectory files that ``adaflash regenerate`` writes from them."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

WORKLOADS_DIR = Path(__file__).resolve().parent.parent / "workloads"
DOMAINS = ("math", "code", "chat", "blend")
SPLITS = ("train", "eval")


@dataclass(frozen=True)
class Prompt:
    id: str
    domain: str
    prompt: str
    source: str


@dataclass(frozen=True)
class Trajectory:
    """A prompt and the response the target produced for it (on-policy data)."""

    id: str
    domain: str
    prompt_ids: list[int]
    response_ids: list[int]
    response: str
    finish_reason: str

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False)


def load_prompts(
    domain: str, split: str, limit: int | None = None, folder: Path = WORKLOADS_DIR
) -> list[Prompt]:
    if domain not in DOMAINS or split not in SPLITS:
        raise ValueError(f"workload must be one of {DOMAINS} × {SPLITS}, got {domain}/{split}")
    path = folder / f"{domain}_{split}.jsonl"
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]
    prompts = [Prompt(r["id"], r["domain"], r["prompt"], r["source"]) for r in rows]
    return prompts[:limit] if limit else prompts


def read_trajectories(paths: list[Path] | Path) -> list[Trajectory]:
    out = []
    for path in [paths] if isinstance(paths, Path) else paths:
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            if line.strip():
                out.append(Trajectory(**json.loads(line)))
    return out
