"""The shipped prompt sets (workloads/*.jsonl, made by scripts/make_workloads.py) and the
trajectory files that ``adaflash regenerate`` writes from them."""

from __future__ import annotations

import gzip
import json
from dataclasses import asdict, dataclass
from pathlib import Path

WORKLOADS_DIR = Path(__file__).resolve().parent.parent / "workloads"
DOMAINS = ("math", "code", "chat", "blend", "edit", "quote")  # edit, quote: repetition is real
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


def read_prompt_file(path: str | Path, domain: str | None = None) -> list[Prompt]:
    """Any JSONL file whose rows carry a ``prompt`` (``id``, ``domain`` and ``source`` optional);
    refuses a file without prompts with the line that lacks one."""
    path = Path(path)
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            text = row["prompt"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{n}: each line must be a JSON object with 'prompt'") from exc
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{path}:{n}: 'prompt' must be a non-empty string")
        rid = str(row.get("id") or f"{path.stem}-{n:05d}")
        out.append(
            Prompt(rid, domain or row.get("domain") or path.stem, text, row.get("source", ""))
        )
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


# Second turns for multi-turn chat data: the user follows up on the target's own first answer.
FOLLOW_UPS = (
    "Can you explain that in more detail?",
    "Can you give me an example?",
    "Why is that?",
    "Summarize that in one sentence.",
    "What else should I know about this?",
    "Can you say that more simply?",
    "Thanks! Is there anything you would add?",
    "Is that always true?",
)


def follow_up(trajectory_id: str) -> str:
    """The follow-up question for a trajectory (fixed per id, spread over ``FOLLOW_UPS``)."""
    return FOLLOW_UPS[sum(trajectory_id.encode()) % len(FOLLOW_UPS)]


def read_trajectories(paths: list[Path] | Path) -> list[Trajectory]:
    """Trajectories of JSONL files (gzipped where a name ends in ``.gz``)."""
    out = []
    for path in [paths] if isinstance(paths, Path) else paths:
        raw = Path(path).read_bytes()
        text = (gzip.decompress(raw) if str(path).endswith(".gz") else raw).decode("utf-8")
        for line in text.splitlines():
            if line.strip():
                out.append(Trajectory(**json.loads(line)))
    return out
