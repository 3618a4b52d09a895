import json
import subprocess
import sys

import pytest
import torch

from adaflash.config import DrafterConfig
from adaflash.models.drafter import DFlashDrafter, save_drafter
from adaflash.models.target import load_target
from tests.tiny import VOCAB, add_tokenizer, build_checkpoint


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    target_dir = add_tokenizer(build_checkpoint(root / "target", "llama", seed=2, layers=6))
    target = load_target(target_dir)
    torch.manual_seed(0)
    drafter = DFlashDrafter(
        DrafterConfig.for_target(target.cfg, num_layers=1, mask_token_id=VOCAB - 1)
    )
    return target_dir, save_drafter(drafter, root / "drafter")


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_generate_prints_text_and_round_stats(folders):
    target, drafter = folders
    out = run_cli(
        "generate",
        "--target",
        str(target),
        "--drafter",
        str(drafter),
        "--dtype",
        "float32",
        "--max-new-tokens",
        "20",
        "--json",
        "Hi there",
        "Another one",
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert len(data["outputs"]) == 2 and all(isinstance(t, str) for t in data["outputs"])
    stats = data["stats"]
    assert stats["policy"] == "head" and stats["rounds"] > 0 and stats["accept_len"] >= 1.0
    assert 1.0 <= stats["verify_len"] <= 16


def test_generate_streams_single_prompt(folders):
    target, drafter = folders
    out = run_cli(
        "generate",
        "--target",
        str(target),
        "--drafter",
        str(drafter),
        "--max-new-tokens",
        "10",
        "Hello",
    )
    assert out.returncode == 0, out.stderr
    assert "accept_len=" in out.stderr and "verify_len=" in out.stderr


def test_generate_reports_bad_folder_clearly(tmp_path):
    out = run_cli("generate", "--target", str(tmp_path), "hello")
    assert out.returncode == 2
    assert "config.json" in out.stderr and "Traceback" not in out.stderr
