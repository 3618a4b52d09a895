"""`adaflash demo` end to end: a real `serve` on the tiny models, its trainer publishing versions,
the demo's clients on the real OpenAI API and its windows read from the real /metrics."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import httpx

from tests.server import free_port
from tests.tiny import build_serving_folders

REPO = Path(__file__).resolve().parents[2]


def demo(tmp: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "ADAFLASH_DATA": str(tmp / "data"), "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "app.cli", "demo", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def prompt_file(tmp: Path) -> Path:
    path = tmp / "prompts.jsonl"
    rows = [{"prompt": p, "domain": "quiz"} for p in ("What is 2 + 2?", "Name a prime.", "Count.")]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_demo_starts_a_server_and_watches_new_versions_go_live(tmp_path):
    target, drafter = build_serving_folders(tmp_path)
    port = free_port()
    out = tmp_path / "demo.json"
    r = demo(
        tmp_path,
        *("--port", str(port), "--prompts", str(prompt_file(tmp_path))),
        *("--concurrency", "2", "--max-tokens", "16", "--versions", "2", "--settle-s", "3"),
        *("--minutes", "4", "--report-s", "3", "--out", str(out)),
        "--",
        *("--target", str(target), "--drafter", str(drafter), "--dtype", "float32"),
        *("--no-compile", "--min-new", "8", "--epochs", "1", "--poll-s", "0.5"),
        *("--gate-margin", "-100"),  # the gate is not this test's point: promote every version
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["stopped"] == "2 new version(s) served"
    assert summary["requests_done"] > 0 and summary["requests_failed"] == 0
    served = [w["version"] for w in summary["versions"]]
    assert served[0] == "v0000" and len(served) >= 3 and len(set(served)) == len(served)
    assert summary["overall"]["output_tokens"] > 0 and summary["overall"]["accept_len"] >= 1.0
    # each swap it saw is printed (a fast trainer may publish several versions between two
    # looks: the first one seen need not be v0001)
    assert f"now serving {served[1]}" in r.stdout and "| version |" in r.stdout
    # more requests than the file's 3 prompts: it says when it starts sending them again, once
    assert r.stdout.count("[demo] all 3 prompts sent; sending them again") == 1
    # requests carry the file's domain: the dashboard's per-domain τ shows it
    db = sqlite3.connect(tmp_path / "data" / "adaflash.db")
    assert {d for (d,) in db.execute("select distinct domain from round_stats")} == {"quiz"}
    db.close()
    # the server it started is gone, its log kept
    assert (tmp_path / "data" / "demo-serve.log").is_file()
    try:
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
        raise AssertionError("the demo's server still answers")
    except httpx.HTTPError:
        pass


def test_demo_on_a_running_server_leaves_it_running(server, tmp_path):
    out = tmp_path / "demo.json"
    r = demo(
        tmp_path,
        *("--url", server.url, "--prompts", str(prompt_file(tmp_path)), "--versions", "0"),
        *("--minutes", "0.1", "--max-tokens", "8", "--report-s", "2", "--out", str(out)),
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["stopped"] == "time limit" and summary["requests_done"] > 0
    assert [w["version"] for w in summary["versions"]] == ["v0000"]
    assert summary["versions"][0]["requests"] > 0
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200
    assert not (tmp_path / "data" / "demo-serve.log").exists()


def test_demo_refuses_a_bad_prompt_file_before_starting_anything(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"text": "no prompt field"}\n')
    r = demo(tmp_path, "--prompts", str(bad), "--port", str(free_port()), timeout=60)
    assert r.returncode == 2
    assert "bad.jsonl:2" in r.stderr and "'prompt'" in r.stderr
    assert not (tmp_path / "data").exists()


def test_demo_says_when_the_given_server_does_not_answer(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    r = demo(tmp_path, "--url", url, "--prompts", str(prompt_file(tmp_path)), timeout=60)
    assert r.returncode == 1
    assert f"no server answers at {url}" in r.stderr
