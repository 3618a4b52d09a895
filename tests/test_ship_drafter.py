"""scripts/ship_drafter.py: a trained folder becomes the shipped drafter with its lineage and
served τ in the model card; logs stay behind; a folder that does not load is refused."""

import json
import subprocess
import sys

from adaflash.models.drafter import load_drafter
from tests.tiny import build_serving_folders


def ship(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "scripts/ship_drafter.py", *args], capture_output=True, text=True
    )


def test_ship_copies_without_logs_and_extends_the_card(tmp_path):
    _, run = build_serving_folders(tmp_path)
    (run / "logs").mkdir()
    (run / "logs" / "metrics.csv").write_text("step\n1\n")
    (run / "README.md").write_text("# tiny drafter\n")
    (run / "training.json").write_text(json.dumps({"result": {"blocks_seen": 300}}))
    curve = tmp_path / "curve.json"
    points = [
        {"blocks": 100, "tau_chat": 1.5, "tau_code": 1.4, "run": "run 1"},
        {"blocks": 300, "tau_chat": 2.0, "tau_code": 1.9, "run": "run 2"},
        {"blocks": 400, "tau_chat": 2.5, "tau_code": 2.4, "run": "run 3"},  # a later run
    ]
    curve.write_text(json.dumps({"points": points}))
    result = {
        "dtype": "bfloat16",
        "max_new_tokens": 64,
        "machine": {"threads": 2},
        "date": "2026-11-30",
        "note": "quiet",
        "rows": [
            {"domain": "chat", "method": "ar", "prompts": 8, "accept_len": 1.0,
             "verify_len": 1.0, "tokens_per_s": 20.0},
            {"domain": "chat", "method": "fixed", "prompts": 8, "accept_len": 2.6,
             "verify_len": 8.0, "tokens_per_s": 30.0, "speedup_vs_ar": 1.5,
             "outputs_identical_to_ar": 8},
        ],
    }  # fmt: skip
    evaluation = tmp_path / "eval.json"
    evaluation.write_text(json.dumps(result))
    out = tmp_path / "shipped"
    proc = ship(str(run), str(out), "--curve", str(curve), "--eval", str(evaluation))
    assert proc.returncode == 0, proc.stderr
    assert not (out / "logs").exists()
    load_drafter(out)
    card = (out / "README.md").read_text()
    assert "| run 2 | 300 | 2.00 | 1.90 |" in card
    assert "run 3" not in card  # only the runs this drafter descends from
    assert "| chat | fixed | 2.60 | 8.00 | 30.0 | 1.50× | 8/8 |" in card


def test_ship_refuses_a_folder_that_does_not_load(tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{}")
    proc = ship(str(bad), str(tmp_path / "out"))
    assert proc.returncode != 0
    assert not (tmp_path / "out").exists()
