"""The GPU recipe end to end on the CPU at a tiny scale: data, teacher, training, a folder."""

import json
import subprocess
import sys

from adaflash.models.drafter import load_drafter
from tests.tiny import VOCAB, build_serving_folders


def test_gpu_recipe_runs_end_to_end_on_the_cpu(tmp_path):
    target, _ = build_serving_folders(tmp_path)
    out = tmp_path / "drafter"
    cmd = [
        sys.executable,
        "scripts/gpu_recipe.py",
        "--out", str(out),
        "--target", str(target),
        "--device", "cpu",
        "--prompts", "3",
        "--max-new-tokens", "10",
        "--gen-batch", "4",
        "--gen-minutes", "2",
        "--train-minutes", "5",
        "--minutes", "0.9",  # the budget cuts training to its 0.9 − 0.75 minutes or less
        "--block-size", "4",
        "--layers", "1",
        "--draft-vocab", "40",
        "--anchors", "4",
        "--batch-size", "2",
        "--teacher", "hf",  # what CUDA runs by default
        "--mask-token-id", str(VOCAB - 1),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    drafter = load_drafter(out)
    assert drafter.cfg.block_size == 4 and drafter.draft_vocab is not None
    card = json.loads((out / "training.json").read_text())
    assert card["data"]["trajectories"] == 6  # 3 chat + 3 code prompts answered
    assert set(card["simulated_tau_held_out"]) == {"chat", "code"}
    assert card["result"]["steps"] > 0
    assert card["data"]["taught"] == 6 and 0.1 <= card["settings"]["max_minutes"] <= 0.15
