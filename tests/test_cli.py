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
    assert stats["policy"] == "cost" and stats["rounds"] > 0 and stats["accept_len"] >= 1.0
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


def test_regenerate_writes_trajectories_and_resumes(folders, tmp_path):
    from adaflash.workloads import load_prompts, read_trajectories

    target_dir, drafter_dir = folders
    out = tmp_path / "chat_eval.jsonl"
    common = ["--domain", "chat", "--split", "eval", "--out", str(out), "--target"]
    common += [str(target_dir), "--max-new-tokens", "6", "--dtype", "float32", "--batch", "2"]
    first = run_cli("regenerate", *common, "--limit", "3")
    assert first.returncode == 0, first.stderr
    before = out.read_text().splitlines()
    assert len(before) == 3
    # resumed with a drafter: the 3 answered prompts are kept, 2 more are appended, and greedy
    # speculation gives the same answers plain decoding would
    second = run_cli("regenerate", *common, "--limit", "5", "--drafter", str(drafter_dir))
    assert second.returncode == 0, second.stderr
    after = out.read_text().splitlines()
    assert after[:3] == before and len(after) == 5
    trajs = read_trajectories(out)
    assert {t.id for t in trajs} == {p.id for p in load_prompts("chat", "eval", 5)}
    assert all(t.domain == "chat" and 0 < len(t.response_ids) <= 6 for t in trajs)
    third = run_cli("regenerate", *common, "--limit", "5")
    assert third.returncode == 0 and "already answered" in third.stdout
    assert out.read_text().splitlines() == after
    plain = tmp_path / "plain.jsonl"
    common[common.index(str(out))] = str(plain)
    assert run_cli("regenerate", *common, "--limit", "5").returncode == 0
    assert {t.id: t.response_ids for t in read_trajectories(plain)} == {
        t.id: t.response_ids for t in trajs
    }
